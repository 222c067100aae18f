"""Readers for TensorFlow Federated HDF5 and FedJAX SQLite files."""

import sqlite3
import zlib

import h5py
import msgpack
import numpy as np
import pytest

from fedjx import datasets as fd


def _clients():
  rng = np.random.default_rng(0)
  return {
      'f0001_12': {'pixels': rng.random((3, 28, 28), dtype=np.float32),
                   'label': np.array([1, 7, 3], dtype=np.int32)},
      'f0000_03': {'pixels': rng.random((5, 28, 28), dtype=np.float32),
                   'label': np.arange(5, dtype=np.int32)},
  }


# --- TensorFlow Federated HDF5 -------------------------------------------------


def test_read_tff_hdf5_written_with_h5py(tmp_path):
  path = tmp_path / 'emnist.h5'
  clients = _clients()
  with h5py.File(path, 'w') as f:
    for cid, examples in clients.items():
      for key, value in examples.items():
        f.create_dataset(f'examples/{cid}/{key}', data=value)
    f.create_dataset('examples/zz_text/snippets',
                     data=np.array([b'To be', b'or not'], dtype=object),
                     dtype=h5py.string_dtype())
  ds = fd.read_tff_hdf5(path)
  assert ds.num_clients == 3
  assert [ds.client_name(c) for c in range(3)] == ['f0000_03', 'f0001_12', 'zz_text']
  np.testing.assert_array_equal(ds.examples_per_client(), [5, 3, 2])
  for c, name in enumerate(['f0000_03', 'f0001_12']):
    data = ds.client_data(c)
    assert set(data) == {'pixels', 'label'}
    for key in data:
      np.testing.assert_array_equal(data[key], clients[name][key])
      assert data[key].dtype == clients[name][key].dtype
  assert list(ds.client_data(2)['snippets']) == [b'To be', b'or not']
  cohort = fd.make_cohort(ds.subset([0, 1]), [0, 1], 2)
  assert cohort.batches['pixels'].shape == (2, 4, 2, 28, 28)


def test_write_tff_hdf5_round_trip(tmp_path):
  path = tmp_path / 'out.h5'
  fd.write_tff_hdf5(path, _clients())
  with h5py.File(path, 'r') as f:
    assert sorted(f['examples'].keys()) == ['f0000_03', 'f0001_12']
    assert f['examples/f0001_12/label'].shape == (3,)
  ds = fd.read_tff_hdf5(path)
  np.testing.assert_array_equal(ds.client_data(1)['label'], [1, 7, 3])


def test_tff_hdf5_bad_files(tmp_path):
  missing = tmp_path / 'missing.h5'
  with pytest.raises(FileNotFoundError, match='missing.h5'):
    fd.read_tff_hdf5(missing)
  corrupt = tmp_path / 'corrupt.h5'
  corrupt.write_bytes(b'not an hdf5 file at all' * 10)
  with pytest.raises(ValueError, match='corrupt.h5.*not a readable HDF5'):
    fd.read_tff_hdf5(corrupt)
  other = tmp_path / 'other.h5'
  with h5py.File(other, 'w') as f:
    f.create_dataset('data/x', data=np.zeros(3))
  with pytest.raises(ValueError, match=r'other.h5.* no group "examples".*\[\'data\'\]'):
    fd.read_tff_hdf5(other)
  ragged = tmp_path / 'ragged.h5'
  with h5py.File(ragged, 'w') as f:
    f.create_dataset('examples/a/x', data=np.zeros(3))
    f.create_dataset('examples/a/y', data=np.zeros(2))
  with pytest.raises(ValueError, match="client 'a'.*lengths"):
    fd.read_tff_hdf5(ragged).num_examples(0)


def test_tff_hdf5_a_client_or_feature_of_the_wrong_kind_names_path_and_client(tmp_path):
  path = tmp_path / 'kinds.h5'
  with h5py.File(path, 'w') as f:
    f.create_dataset('examples/a_dataset', data=np.zeros((3, 2)))  # Not a group.
    f.create_dataset('examples/b_group/deeper/x', data=np.zeros(3))  # A group feature.
    f.create_dataset('examples/c_good/x', data=np.zeros(3))
  data = fd.read_tff_hdf5(path)
  assert [data.client_name(i) for i in range(3)] == ['a_dataset', 'b_group', 'c_good']
  for read in (data.num_examples, data.client_data):
    with pytest.raises(ValueError) as e:
      read(0)
    assert str(path) in str(e.value) and "client 'a_dataset'" in str(e.value)
    assert 'dataset of shape (3, 2), not a group' in str(e.value)
    with pytest.raises(ValueError) as e:
      read(1)
    assert str(path) in str(e.value) and "client 'b_group'" in str(e.value)
    assert "feature 'deeper' is a group, not a dataset" in str(e.value)
  assert data.num_examples(2) == 3  # The well-formed client still reads.
  np.testing.assert_array_equal(data.client_data(2)['x'], np.zeros(3))


# --- FedJAX SQLite ------------------------------------------------------------


def _fedjax_blob(examples):
  """FedJAX's encoding, written out independently of the reader."""
  def ext(x):
    if x.dtype == object:
      return msgpack.ExtType(4, msgpack.packb((list(x.shape), list(x.reshape(-1))),
                                              use_bin_type=True))
    return msgpack.ExtType(1, msgpack.packb(
        (list(x.shape), x.dtype.name, x.tobytes('C')), use_bin_type=True))
  return zlib.compress(msgpack.packb(examples, default=ext, strict_types=True))


def _write_sqlite(path, clients):
  conn = sqlite3.connect(path)
  conn.execute('CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, '
               'data BLOB NOT NULL, num_examples INTEGER NOT NULL);')
  for cid, examples in clients.items():
    n = len(next(iter(examples.values())))
    conn.execute('INSERT INTO federated_data VALUES (?, ?, ?)',
                 (cid.encode(), _fedjax_blob(examples), n))
  conn.commit()
  conn.close()


def test_read_fedjax_sqlite(tmp_path):
  path = tmp_path / 'data.sqlite'
  clients = _clients()
  clients['text'] = {'snippet': np.array([b'ab', b'cde'], dtype=object),
                     'id': np.array([4, 5], dtype=np.int64)}
  _write_sqlite(path, clients)
  ds = fd.read_fedjax_sqlite(path)
  names = list(clients)
  assert [ds.client_name(c) for c in range(3)] == names  # row order
  np.testing.assert_array_equal(ds.examples_per_client(), [3, 5, 2])
  for c, name in enumerate(names):
    data = ds.client_data(c)
    assert set(data) == set(clients[name])
    for key, value in clients[name].items():
      np.testing.assert_array_equal(data[key], value)
      assert data[key].dtype == value.dtype
      assert data[key].shape == value.shape


def test_write_fedjax_sqlite_round_trip(tmp_path):
  path = tmp_path / 'rt.sqlite'
  clients = _clients()
  fd.write_fedjax_sqlite(path, clients)
  conn = sqlite3.connect(path)
  blob = conn.execute('SELECT data FROM federated_data WHERE client_id = ?',
                      (b'f0000_03',)).fetchone()[0]
  assert blob == _fedjax_blob(clients['f0000_03'])
  conn.close()
  ds = fd.read_fedjax_sqlite(path)
  np.testing.assert_array_equal(ds.client_data(1)['pixels'],
                                clients['f0000_03']['pixels'])


def test_fedjax_sqlite_bad_files(tmp_path):
  with pytest.raises(FileNotFoundError, match='nope.sqlite'):
    fd.read_fedjax_sqlite(tmp_path / 'nope.sqlite')
  assert not (tmp_path / 'nope.sqlite').exists()  # Not created by the attempt.
  garbage = tmp_path / 'garbage.sqlite'
  garbage.write_bytes(b'\x00\x01 definitely not sqlite' * 100)
  with pytest.raises(ValueError, match='garbage.sqlite.*not a FedJAX SQLite'):
    fd.read_fedjax_sqlite(garbage)
  wrong = tmp_path / 'wrong.sqlite'
  conn = sqlite3.connect(wrong)
  conn.execute('CREATE TABLE other (x INTEGER)')
  conn.commit()
  conn.close()
  with pytest.raises(ValueError, match='wrong.sqlite.*federated_data'):
    fd.read_fedjax_sqlite(wrong)
  bad_blob = tmp_path / 'bad_blob.sqlite'
  _write_sqlite(bad_blob, _clients())
  conn = sqlite3.connect(bad_blob)
  conn.execute("UPDATE federated_data SET data = x'00ff00' WHERE client_id = ?",
               (b'f0001_12',))
  conn.commit()
  conn.close()
  ds = fd.read_fedjax_sqlite(bad_blob)
  ds.client_data(1)  # The intact client still reads.
  with pytest.raises(ValueError, match="client 'f0001_12' in .*bad_blob.sqlite.*corrupt"):
    ds.client_data(0)
