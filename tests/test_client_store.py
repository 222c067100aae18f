"""ClientStore against a dict of NumPy rows: reads, writes, budget, checkpoints."""

import os

import numpy as np
import pytest

import fedjx
from fedjx import client_store

N = 50


def _initial():
  return {'w': np.full((3, 2), 0.5, np.float32), 'b': np.arange(4, dtype=np.int32),
          's': np.float32(-1.0)}


def _rows(rng, n):
  return {'w': rng.normal(size=(n, 3, 2)).astype(np.float32),
          'b': rng.integers(-9, 9, (n, 4)).astype(np.int32),
          's': rng.normal(size=(n,)).astype(np.float32)}


class Reference:
  """The rows as a dict of id -> row, every other client reading ``initial``."""

  def __init__(self, initial):
    self.initial, self.rows = initial, {}

  def read(self, ids):
    return {k: np.stack([self.rows.get(i, self.initial)[k] if i >= 0
                         else self.initial[k] for i in ids])
            for k in self.initial}

  def write(self, ids, rows):
    for j, i in enumerate(ids):
      if i >= 0:
        self.rows[i] = {k: rows[k][j].copy() for k in rows}


@pytest.fixture(params=['one thread', 'threads'])
def copies(request, monkeypatch):
  """Copies between host arrays on one thread, or in blocks of a row or two
  on several (what a store of large rows does)."""
  if request.param == 'threads':
    monkeypatch.setattr(client_store, '_PARALLEL_BYTES', 40)
    monkeypatch.setattr(client_store.os, 'cpu_count', lambda: 4)
  return request.param


def test_row_blocks_cover_each_row_of_each_leaf_once(monkeypatch):
  monkeypatch.setattr(client_store, '_PARALLEL_BYTES', 40)
  arrays = [np.zeros((9, 3, 2), np.float32), np.zeros((12, 4), np.int32),
            np.zeros((9,), np.float32)]
  blocks = client_store._row_blocks(arrays, 7)
  for k, a in enumerate(arrays):
    rows = [r for j, lo, hi in blocks if j == k for r in range(lo, hi)]
    assert rows == list(range(7))
    step = max(1, 40 // a[:1].nbytes)  # 1 row of 24 bytes, 2 of 16, 10 of 4.
    assert all(hi - lo <= step for j, lo, hi in blocks if j == k)
  assert len(blocks) == 7 + 4 + 1


def _assert_same(store, ref, ids):
  got, want = store.read(ids), ref.read(ids)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
    assert got[k].dtype == want[k].dtype


def _cohort(rng, c, pad=2):
  ids = rng.choice(N, c, replace=False)
  return np.concatenate([ids, -np.ones(pad, np.int64)])


def _drive(store, ref, rng, rounds, c=6):
  for _ in range(rounds):
    ids = _cohort(rng, c)
    _assert_same(store, ref, ids)
    rows = _rows(rng, len(ids))
    store.write(ids, rows)
    ref.write(ids, rows)


def test_exported_and_initial_for_unwritten_and_padding_clients():
  assert fedjx.ClientStore is client_store.ClientStore
  store = client_store.ClientStore(_initial(), N)
  assert len(store) == 0 and store.memory_bytes == 0 and store.disk_bytes == 0
  _assert_same(store, Reference(_initial()), np.array([3, -1, 0, 49]))
  assert store.read(np.array([], np.int64))['w'].shape == (0, 3, 2)


@pytest.mark.parametrize('budget_rows', [None, 0, 7])
def test_random_reads_and_writes_cross_the_memory_budget(tmp_path, budget_rows, copies):
  store = client_store.ClientStore(_initial(), N, directory=tmp_path)
  budget = None if budget_rows is None else budget_rows * store.row_bytes
  store = client_store.ClientStore(_initial(), N, directory=tmp_path,
                                   memory_budget_bytes=budget)
  ref, rng = Reference(_initial()), np.random.default_rng(budget_rows or 1)
  _drive(store, ref, rng, rounds=12)
  _assert_same(store, ref, np.arange(-1, N))
  assert len(store) == len(ref.rows)
  np.testing.assert_array_equal(store.ids(), sorted(ref.rows))
  assert all(i in store for i in ref.rows) and -1 not in store
  held = len(ref.rows)
  if budget_rows is None:
    assert store.disk_bytes == 0 and store.memory_bytes >= held * store.row_bytes
  else:
    assert store.memory_bytes <= budget
    assert (store.memory_bytes + store.disk_bytes) >= held * store.row_bytes
    assert store.disk_bytes <= 2 * max(held - budget_rows, 1) * store.row_bytes
    assert (store.disk_bytes > 0) == (held > budget_rows)


def test_budget_without_directory_and_invalid_arguments_are_refused():
  store = client_store.ClientStore(_initial(), N, memory_budget_bytes=0)
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match='memory_budget_bytes=0 and directory=None'):
    store.write(np.array([1]), _rows(rng, 1))
  store = client_store.ClientStore(_initial(), N)
  with pytest.raises(ValueError, match=r'ids \[2\] appear more than once'):
    store.write(np.array([2, -1, 2, -1]), _rows(rng, 4))
  with pytest.raises(ValueError, match=r'outside \[0, 50\)'):
    store.write(np.array([50]), _rows(rng, 1))
  with pytest.raises(ValueError, match=r'outside \[0, 50\)'):
    store.read([0, 60])
  with pytest.raises(ValueError, match='1-D array of ints'):
    store.read(np.array([0.5]))
  with pytest.raises(ValueError, match=r'shape \(2, 3, 2\); it must be \(3, 3, 2\)'):
    store.write(np.array([0, 1, 2]), _rows(rng, 2) | {'s': np.zeros(3, np.float32),
                                                     'b': np.zeros((3, 4), np.int32)})
  with pytest.raises(ValueError, match='structure'):
    store.write(np.array([0]), {'w': np.zeros((1, 3, 2), np.float32)})
  with pytest.raises(ValueError, match='num_clients=0'):
    client_store.ClientStore(_initial(), 0)
  with pytest.raises(ValueError, match='memory_budget_bytes=-1'):
    client_store.ClientStore(_initial(), N, memory_budget_bytes=-1)
  with pytest.raises(ValueError, match='directory=None'):
    store.save(0)
  assert len(store) == 0  # Refused writes left nothing behind.


def _snapshot(ref):
  return {i: {k: v.copy() for k, v in row.items()} for i, row in ref.rows.items()}


def test_save_and_restore_bring_back_each_step_exactly(tmp_path):
  rng = np.random.default_rng(3)
  store = client_store.ClientStore(_initial(), N, directory=tmp_path,
                                   memory_budget_bytes=5 * 40)
  ref = Reference(_initial())
  snapshots = {}
  for step in (0, 2, 5, 9):
    _drive(store, ref, rng, rounds=3)
    store.save(step)
    snapshots[step] = _snapshot(ref)
  assert store.saved_steps() == [0, 2, 5, 9]
  _drive(store, ref, rng, rounds=2)  # Written after the last save: lost.
  # A new process on the same directory (after a kill): live rows discarded.
  for step in (5, 0, 9, 2):
    fresh = client_store.ClientStore(_initial(), N, directory=tmp_path,
                                     memory_budget_bytes=5 * 40)
    assert len(fresh) == 0
    fresh.restore(step)
    want = Reference(_initial())
    want.rows = snapshots[step]
    _assert_same(fresh, want, np.arange(-1, N))
    assert len(fresh) == len(snapshots[step])
  # Each delta holds only the rows written since the previous save.
  sizes = [store._read_manifest(s)['rows'] for s in (0, 2, 5, 9)]
  assert all(r <= 18 for r in sizes) and sizes[0] == len(snapshots[0])
  # Restoring an earlier step and saving on: the later steps are abandoned.
  store.restore(2)
  want = Reference(_initial())
  want.rows = snapshots[2]
  _drive(store, want, rng, rounds=2)
  store.save(6)
  assert store.saved_steps() == [0, 2, 6]
  with pytest.raises(ValueError, match='must be greater'):
    store.save(6)
  fresh = client_store.ClientStore(_initial(), N, directory=tmp_path)
  fresh.restore(6)
  _assert_same(fresh, want, np.arange(-1, N))
  with pytest.raises(ValueError, match=r'step=5 was not saved; saved steps: \[0, 2, 6\]'):
    fresh.restore(5)
  # Compacting at 6: the same rows, the steps before it freed.
  before = fresh.checkpoint_bytes
  fresh.compact(6)
  assert fresh.saved_steps() == [6] and fresh.checkpoint_bytes < before
  fresh = client_store.ClientStore(_initial(), N, directory=tmp_path)
  fresh.restore(6)
  _assert_same(fresh, want, np.arange(-1, N))
  assert len([f for f in os.listdir(tmp_path / 'checkpoints')
              if f.startswith('delta_')]) == 1


def test_killed_save_is_ignored_and_corrupted_delta_is_detected(tmp_path):
  rng = np.random.default_rng(4)
  store = client_store.ClientStore(_initial(), N, directory=tmp_path)
  ref = Reference(_initial())
  _drive(store, ref, rng, rounds=2)
  store.save(1)
  at_1 = _snapshot(ref)
  _drive(store, ref, rng, rounds=2)
  store.save(2)
  at_2 = _snapshot(ref)
  _drive(store, ref, rng, rounds=2)
  store.save(3)
  # Step 3 killed before its manifest was renamed into place.
  os.rename(store._manifest_path(3), store._manifest_path(3) + '.ab12cd34.tmp')
  fresh = client_store.ClientStore(_initial(), N, directory=tmp_path)
  assert fresh.saved_steps() == [1, 2]
  fresh.restore(2)
  want = Reference(_initial())
  want.rows = at_2
  _assert_same(fresh, want, np.arange(N))
  # Step 2's delta corrupted: named in the error; the store keeps its rows.
  delta = tmp_path / 'checkpoints' / fresh._read_manifest(2)['file']
  data = bytearray(delta.read_bytes())
  data[len(data) // 2] ^= 0xFF
  delta.write_bytes(bytes(data))
  with pytest.raises(client_store.CorruptCheckpointError, match=delta.name):
    fresh.restore(2)
  _assert_same(fresh, want, np.arange(N))
  fresh.restore(1)  # The fallback to an earlier step.
  want.rows = at_1
  _assert_same(fresh, want, np.arange(-1, N))
  # A truncated manifest is reported as corrupt too.
  with open(fresh._manifest_path(2), 'w') as f:
    f.write('{"format": 1, "st')
  with pytest.raises(client_store.CorruptCheckpointError, match='manifest'):
    fresh.restore(2)
  # Saving on from step 1 removes the broken step and the killed save's files.
  fresh.save(4)
  assert fresh.saved_steps() == [1, 4]
  names = os.listdir(tmp_path / 'checkpoints')
  assert not any(n.endswith('.tmp') for n in names)
  assert len([n for n in names if n.startswith('delta_')]) == 2


def test_restore_refuses_rows_of_another_shape(tmp_path):
  store = client_store.ClientStore(_initial(), N, directory=tmp_path)
  store.write(np.array([1]), _rows(np.random.default_rng(0), 1))
  store.save(0)
  other = client_store.ClientStore({'w': np.zeros((3, 2), np.float32)}, N,
                                   directory=tmp_path)
  with pytest.raises(ValueError, match='this store holds rows'):
    other.restore(0)


@pytest.mark.parametrize('budget_rows', [None, 3])
def test_staged_rows_are_written_on_commit_and_dropped_on_discard(tmp_path, budget_rows, copies):
  """A round's rows staged in chunks (padding skipped) equal one write of them
  at commit; discarded ones leave the store as it was; a restore drops them."""
  probe = client_store.ClientStore(_initial(), N)
  budget = None if budget_rows is None else budget_rows * probe.row_bytes
  store = client_store.ClientStore(_initial(), N, directory=tmp_path,
                                   memory_budget_bytes=budget)
  ref, rng = Reference(_initial()), np.random.default_rng(7)
  _drive(store, ref, rng, rounds=3)
  store.save(1)
  for commit in (True, False, True, True):
    ids = _cohort(rng, 9)
    rows = _rows(rng, len(ids))
    for part in np.array_split(np.arange(len(ids)), 4):  # Chunks of a round.
      store.stage(ids[part], {k: v[part] for k, v in rows.items()})
    _assert_same(store, ref, np.arange(N))  # Staged rows are not read.
    if commit:
      store.commit()
      ref.write(ids, rows)
    else:
      store.discard()
    _assert_same(store, ref, np.arange(-1, N))
  saved = Reference(_initial())
  saved.rows = dict(ref.rows)
  store.save(2)
  store.stage(_cohort(rng, 4), _rows(rng, 6))
  store.restore(2)
  store.commit()  # Nothing staged is left after the restore.
  _assert_same(store, saved, np.arange(N))
  store.close()


def test_read_into_given_arrays(copies):
  store = client_store.ClientStore(_initial(), N)
  ref, rng = Reference(_initial()), np.random.default_rng(3)
  _drive(store, ref, rng, rounds=4)
  for ids in (_cohort(rng, 5, pad=0), _cohort(rng, 5, pad=2)):  # Held only; with padding.
    out = {k: np.full((len(ids),) + np.shape(v), 9, np.asarray(v).dtype)
           for k, v in _initial().items()}
    got = store.read(ids, out=out)
    assert all(got[k] is out[k] for k in out)
    want = ref.read(ids)
    for k in want:
      np.testing.assert_array_equal(out[k], want[k])
  with pytest.raises(ValueError, match=r"ClientStore.read: out leaf 0 is ndarray of dtype "
                                       r"float64; it must be a writeable NumPy array of "
                                       r"dtype int32"):
    store.read(np.arange(2), out={k: np.zeros((2,) + np.shape(v))
                                  for k, v in _initial().items()})
  with pytest.raises(ValueError, match=r'out leaf 0 has shape \(3, 4\); it must be \(2, 4\)'):
    store.read(np.arange(2), out={k: np.zeros((3,) + np.shape(v), np.asarray(v).dtype)
                                  for k, v in _initial().items()})


def test_reset_forgets_every_row_as_a_new_store(tmp_path):
  store = client_store.ClientStore(_initial(), N, directory=tmp_path)
  ref, rng = Reference(_initial()), np.random.default_rng(11)
  _drive(store, ref, rng, rounds=3)
  store.save(1)
  store.stage(_cohort(rng, 3), _rows(rng, 5))
  store.reset()
  store.commit()  # The staged rows went with the reset.
  fresh = Reference(_initial())
  _assert_same(store, fresh, np.arange(-1, N))
  assert len(store) == 0
  _drive(store, fresh, rng, rounds=2)
  store.save(2)  # A new chain: step 2 holds only the rows since the reset.
  store.restore(2)
  _assert_same(store, fresh, np.arange(N))
  assert len(store) == len(fresh.rows)
  store.close()
