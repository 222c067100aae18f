"""Readers (and writers) for federated data researchers already keep on disk.

* TensorFlow Federated's HDF5 files (EMNIST, Shakespeare, Stack Overflow, CIFAR-
  100 in ``tff.simulation.datasets``): one group per client,
  ``examples/<client_id>/<feature>``, each feature a dataset with the client's
  examples on its leading axis.
* FedJAX's SQLite files (``fedjax.core.sqlite_federated_data``): a table
  ``federated_data(client_id BLOB PRIMARY KEY, data BLOB, num_examples
  INTEGER)`` whose ``data`` is a zlib-compressed msgpack map from feature name
  to array. Arrays are msgpack extension type 1 holding a msgpack
  ``[shape, dtype name, C-order bytes]``; arrays of bytes objects are type 4
  holding ``[shape, flat list of bytes]``.

Both readers keep the file open and read a client when asked. Clients are
numbered in the file's order (HDF5: sorted group names; SQLite: row order) and
named by their ids in the file.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import msgpack
import numpy as np

from fedjx.datasets.federated import Examples, FederatedDataset, num_rows

_EXT_NDARRAY = 1
_EXT_BYTES_NDARRAY = 4


def _check_exists(path: str | os.PathLike, what: str) -> str:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{what}: path={path!r} does not exist or is not a file.')
  return path


class TffHdf5Dataset(FederatedDataset):
  """Clients of a TensorFlow Federated HDF5 file, read lazily with h5py."""

  def __init__(self, path: str | os.PathLike):
    self.path = _check_exists(path, 'read_tff_hdf5')
    try:
      self._file = h5py.File(self.path, 'r')
    except OSError as e:
      raise ValueError(f'read_tff_hdf5: path={self.path!r} is not a readable HDF5 '
                       f'file ({e}).') from e
    if 'examples' not in self._file or not isinstance(self._file['examples'], h5py.Group):
      raise ValueError(f'read_tff_hdf5: path={self.path!r} has no group "examples"; '
                       'expected the layout examples/<client_id>/<feature>, found '
                       f'top-level keys {sorted(self._file.keys())}.')
    self._clients = self._file['examples']
    self._names = sorted(self._clients.keys())
    if not self._names:
      raise ValueError(f'read_tff_hdf5: path={self.path!r} has no clients under '
                       '"examples".')
    self._sizes: dict[int, int] = {}
    self._lock = threading.Lock()

  @property
  def num_clients(self) -> int:
    return len(self._names)

  def client_name(self, cid: int) -> str:
    return self._names[self.check_client(cid)]

  def _group(self, cid: int) -> Any:
    """Client ``cid``'s group, its features checked to be datasets (hold the lock)."""
    name = self._names[cid]
    group = self._clients[name]
    where = f'read_tff_hdf5: client {name!r} in {self.path!r}'
    if not isinstance(group, h5py.Group):
      raise ValueError(f'{where} is a {_hdf5_kind(group)}, not a group; the '
                       'layout is examples/<client_id>/<feature>, one dataset '
                       'per feature.')
    for key in group:
      if not isinstance(group[key], h5py.Dataset):
        raise ValueError(f'{where}: its feature {key!r} is a '
                         f'{_hdf5_kind(group[key])}, not a dataset; the layout '
                         'is examples/<client_id>/<feature>, one dataset per '
                         'feature.')
    return group

  def num_examples(self, cid: int) -> int:
    cid = self.check_client(cid)
    if cid not in self._sizes:
      with self._lock:
        group = self._group(cid)
        lengths = {k: group[k].shape[0] if group[k].shape else None for k in group}
      if not lengths or len(set(lengths.values())) != 1 or None in lengths.values():
        raise ValueError(f'read_tff_hdf5: client {self._names[cid]!r} in '
                         f'{self.path!r} has features of lengths {lengths}; each '
                         'client needs features sharing a leading example axis.')
      self._sizes[cid] = next(iter(lengths.values()))
    return self._sizes[cid]

  def _client_data(self, cid: int) -> Examples:
    name = self._names[cid]
    with self._lock:
      group = self._group(cid)
      data = {k: group[k][()] for k in group}
    num_rows(data, where=f'read_tff_hdf5: client {name!r} in {self.path!r}')
    return data

  def close(self) -> None:
    self._file.close()


def _hdf5_kind(obj: Any) -> str:
  if isinstance(obj, h5py.Dataset):
    return f'dataset of shape {obj.shape}'
  return 'group' if isinstance(obj, h5py.Group) else type(obj).__name__


def read_tff_hdf5(path: str | os.PathLike) -> TffHdf5Dataset:
  """Opens a TensorFlow Federated HDF5 file (``examples/<client_id>/<feature>``).

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: the file is not HDF5 or lacks the ``examples`` layout; when
      a client is read: the client is not a group, a feature is not a
      dataset, or its features differ in length (naming the path and the
      client).
  """
  return TffHdf5Dataset(path)


def write_tff_hdf5(path: str | os.PathLike, clients: Mapping[str, Mapping[str, Any]]
                   ) -> None:
  """Writes ``{client_id: {feature: array}}`` in TensorFlow Federated's layout."""
  with h5py.File(os.fspath(path), 'w') as f:
    for client_id, examples in clients.items():
      group = f.create_group(f'examples/{client_id}')
      for key, value in examples.items():
        value = np.asarray(value)
        if value.dtype.kind in 'SUO':
          value = np.array([v if isinstance(v, bytes) else str(v).encode()
                            for v in value.reshape(-1)], dtype=object).reshape(value.shape)
          group.create_dataset(key, data=value, dtype=h5py.string_dtype('utf-8'))
        else:
          group.create_dataset(key, data=value)


def _unpack_ext(code: int, data: bytes) -> Any:
  if code == _EXT_NDARRAY:
    shape, dtype, buffer = msgpack.unpackb(data, raw=True)
    dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
    return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape).copy()
  if code == _EXT_BYTES_NDARRAY:
    shape, flat = msgpack.unpackb(data, raw=True)
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(shape)
  raise ValueError(f'unsupported msgpack extension type {code}; FedJAX examples '
                   f'use types {_EXT_NDARRAY} (array) and {_EXT_BYTES_NDARRAY} '
                   '(array of bytes).')


def _pack_ext(value: Any) -> Any:
  value = np.asarray(value)
  if value.dtype.kind in 'OS':
    flat = [bytes(v) for v in value.reshape(-1)]
    return msgpack.ExtType(_EXT_BYTES_NDARRAY,
                           msgpack.packb((value.shape, flat), use_bin_type=True))
  value = np.ascontiguousarray(value)
  return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb(
      (value.shape, value.dtype.name, value.tobytes('C')), use_bin_type=True))


class FedjaxSqliteDataset(FederatedDataset):
  """Clients of a FedJAX SQLite file, read lazily (one query per client)."""

  def __init__(self, path: str | os.PathLike):
    self.path = _check_exists(path, 'read_fedjax_sqlite')
    self._lock = threading.Lock()
    try:
      uri = Path(os.path.abspath(self.path)).as_uri() + '?mode=ro'
      self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
      rows = self._conn.execute(
          'SELECT client_id, num_examples FROM federated_data ORDER BY rowid'
      ).fetchall()
    except sqlite3.DatabaseError as e:
      raise ValueError(f'read_fedjax_sqlite: path={self.path!r} is not a FedJAX '
                       'SQLite file (expected a table federated_data(client_id, '
                       f'data, num_examples)): {e}.') from e
    if not rows:
      raise ValueError(f'read_fedjax_sqlite: path={self.path!r} has no clients.')
    self._ids = [r[0] for r in rows]
    self._sizes = np.array([r[1] for r in rows], dtype=np.int64)
    empty = np.flatnonzero(self._sizes < 1)
    if empty.size:
      raise ValueError(f'read_fedjax_sqlite: client {self.client_name(int(empty[0]))!r}'
                       f' in {self.path!r} has num_examples '
                       f'{self._sizes[empty[0]]}; every client needs at least one.')

  @property
  def num_clients(self) -> int:
    return len(self._ids)

  def client_name(self, cid: int) -> str:
    raw = self._ids[self.check_client(cid)]
    return raw.decode('utf-8', errors='replace') if isinstance(raw, bytes) else str(raw)

  def num_examples(self, cid: int) -> int:
    return int(self._sizes[self.check_client(cid)])

  def examples_per_client(self) -> np.ndarray:
    return self._sizes.copy()

  def _client_data(self, cid: int) -> Examples:
    name = self.client_name(cid)
    with self._lock:
      row = self._conn.execute('SELECT data FROM federated_data WHERE client_id = ?',
                               (self._ids[cid],)).fetchone()
    try:
      data = msgpack.unpackb(zlib.decompress(row[0]), ext_hook=_unpack_ext, raw=False)
    except (zlib.error, ValueError, msgpack.UnpackException, TypeError) as e:
      raise ValueError(f'read_fedjax_sqlite: client {name!r} in {self.path!r} has '
                       f'corrupt data: {e}.') from e
    if not isinstance(data, dict):
      raise ValueError(f'read_fedjax_sqlite: client {name!r} in {self.path!r} holds '
                       f'a {type(data).__name__}; expected a map of feature arrays.')
    n = num_rows(data, where=f'read_fedjax_sqlite: client {name!r}')
    if n != self._sizes[cid]:
      raise ValueError(f'read_fedjax_sqlite: client {name!r} in {self.path!r} has '
                       f'{n} examples but num_examples={self._sizes[cid]}.')
    return {str(k): v for k, v in data.items()}

  def close(self) -> None:
    self._conn.close()


def read_fedjax_sqlite(path: str | os.PathLike) -> FedjaxSqliteDataset:
  """Opens a FedJAX SQLite file (table ``federated_data``).

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: the file is not SQLite, lacks the table, or a client's blob is
      corrupt (when that client is read).
  """
  return FedjaxSqliteDataset(path)


def write_fedjax_sqlite(path: str | os.PathLike,
                        clients: Mapping[str | bytes, Mapping[str, Any]]) -> None:
  """Writes ``{client_id: {feature: array}}`` in FedJAX's SQLite format."""
  conn = sqlite3.connect(os.fspath(path))
  try:
    conn.execute('CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, '
                 'data BLOB NOT NULL, num_examples INTEGER NOT NULL)')
    for client_id, examples in clients.items():
      cid = client_id.encode() if isinstance(client_id, str) else bytes(client_id)
      n = num_rows(examples, where=f'write_fedjax_sqlite: client {client_id!r}')
      blob = zlib.compress(msgpack.packb(dict(examples), default=_pack_ext,
                                         strict_types=True, use_bin_type=True))
      conn.execute('INSERT INTO federated_data VALUES (?, ?, ?)', (cid, blob, n))
    conn.commit()
  finally:
    conn.close()
