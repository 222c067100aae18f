"""Per-client state kept on the host, outside the server state.

An algorithm whose clients keep state between rounds (SCAFFOLD's ``c_i``, a
personal model; ``Algorithm.client_state_init`` is set) reads its cohort's
rows before a round and returns their new values after it
(``docs/client_state.md``). Over a population of millions of clients the rows
cannot live in the server state on the device: :class:`ClientStore` keeps
them on the host.

Design:

* Sparse. Only clients that have been written hold an entry (a slot); every
  other client reads ``initial``, the value ``client_state_init(params)``
  gives one client that never participated. The id -> slot index is one
  integer per client of the population, allocated zeroed (pages the
  operating system maps on first touch), so a store costs what its written
  rows cost.
* Memory, then disk. Slots ``[0, M)`` live in host memory, ``M =
  memory_budget_bytes // row_bytes``; slots beyond live in memory-mapped
  files under ``directory/rows`` (one file per leaf of the row, ``[slots,
  ...]`` row-major), grown by doubling. Reads and writes are NumPy fancy
  indexing on those arrays, so a round costs what its cohort's rows cost,
  whatever the population (measured in benchmarks/results/HISTORY.md,
  "Client state at population scale", with the other backends considered).
* Incremental checkpoints. ``save(step)`` writes only the rows written since
  the previous save: a delta file (the ids, int64, then each leaf's rows) and
  then, last and atomically (a temporary file, fsync, rename), a small JSON
  manifest naming the delta, its SHA-256, and the previous saved step. A save
  killed before its manifest is renamed into place is not a saved step.
  ``restore(step)`` verifies every delta of the step's chain first (a
  mismatch raises :class:`CorruptCheckpointError` naming the file, leaving the
  store as it was), then rebuilds the rows from them alone: the live files are
  scratch (after a kill they may hold rows written after the last save), so
  the rows are exactly those as of ``step`` even if later steps were saved.
  Those later steps are an abandoned branch; the next ``save`` deletes them.
  ``compact(step)`` merges the chain up to ``step`` into one delta and frees
  the steps before it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Any

import numpy as np
from jax import tree_util

DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30  # 1 GiB of rows in host memory.
FORMAT = 1  # The checkpoint format's version, in every manifest.
_BLOCK_BYTES = 64 << 20  # Rows are copied between files this much at a time.
# Copies between host arrays of more than this many bytes in all run as
# blocks of about this size on several threads (NumPy releases the GIL
# while it copies): one thread copies far below a host's memory bandwidth.
_PARALLEL_BYTES = 32 << 20
_COPY_THREADS = 8
_MANIFEST = re.compile(r'manifest_(\d+)\.json')


def _row_blocks(arrays: list[np.ndarray], n: int) -> list[tuple[int, int, int]]:
  """``(leaf, start, stop)`` blocks of rows ``[0, n)`` of each of ``arrays``
  (``[n, ...]`` or longer), each about ``_PARALLEL_BYTES`` (one row at least)."""
  blocks = []
  for k, a in enumerate(arrays):
    row = max(a[:1].nbytes, 1)
    step = max(1, _PARALLEL_BYTES // row)
    blocks += [(k, i, min(i + step, n)) for i in range(0, n, step)]
  return blocks


def _copy_in_blocks(copy, arrays: list[np.ndarray], n: int) -> None:
  """Calls ``copy(leaf, start, stop)`` over the rows ``[0, n)`` of ``arrays``:
  on up to ``_COPY_THREADS`` threads where they hold more than
  ``_PARALLEL_BYTES`` in all, else once per leaf. Each call writes a
  distinct block, so the result is that of one thread."""
  total = sum(a[:1].nbytes for a in arrays) * n
  threads = min(_COPY_THREADS, os.cpu_count() or 1)
  if total <= _PARALLEL_BYTES or threads < 2:
    for k in range(len(arrays)):
      copy(k, 0, n)
    return
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for done in [pool.submit(copy, *b) for b in _row_blocks(arrays, n)]:
      done.result()


class CorruptCheckpointError(ValueError):
  """A saved step's manifest or delta is unreadable or fails its checksum."""


def _tree_util():
  # JAX's pytree registry flattens rows the way rounds produce them (dicts,
  # NamedTuples, Flax structs); imported on first use so importing this
  # module stays light.
  return tree_util


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


class ClientStore:
  """One row of per-client state for each client of a population.

  Args:
    initial: one client's state (a pytree of arrays), what a client that has
      never been written reads; converted to NumPy.
    num_clients: the population size ``N``; ids lie in ``[0, N)``.
    directory: where rows beyond the memory budget (``rows/``) and saved
      steps (``checkpoints/``) go; None keeps everything in memory (then the
      budget is a hard limit and there is no ``save``/``restore``). Live row
      files left there by an earlier process are discarded (they are scratch:
      ``restore`` rebuilds rows from the saved steps).
    memory_budget_bytes: bytes of rows held in host memory (None: no limit).
  """

  def __init__(self, initial: Any, num_clients: int, *,
               directory: str | os.PathLike | None = None,
               memory_budget_bytes: int | None = DEFAULT_MEMORY_BUDGET_BYTES):
    tu = _tree_util()
    if (isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer))
        or num_clients < 1):
      raise ValueError(f'ClientStore: num_clients={num_clients!r} must be a '
                       'positive int (the population size).')
    if memory_budget_bytes is not None and (
        isinstance(memory_budget_bytes, bool)
        or not isinstance(memory_budget_bytes, (int, np.integer))
        or memory_budget_bytes < 0):
      raise ValueError(f'ClientStore: memory_budget_bytes={memory_budget_bytes!r} '
                       'must be a non-negative int or None (no limit).')
    leaves, self._treedef = tu.tree_flatten(initial)
    if not leaves:
      raise ValueError(f'ClientStore: initial={initial!r} has no array leaves; '
                       'it must be one client\'s state (e.g. zeros_like(params)).')
    self._initial = [np.array(leaf) for leaf in leaves]
    for i, leaf in enumerate(self._initial):
      if leaf.dtype == object or leaf.dtype.hasobject:
        raise ValueError(f'ClientStore: initial leaf {i} has dtype {leaf.dtype}; '
                         'only numeric and bool arrays can be stored.')
    self._num_clients = int(num_clients)
    self._row_bytes = sum(leaf.nbytes for leaf in self._initial)
    self._budget = None if memory_budget_bytes is None else int(memory_budget_bytes)
    if self._budget is None or self._row_bytes == 0:
      self._memory_slots = None  # No limit.
    else:
      self._memory_slots = self._budget // self._row_bytes
    self._directory = None if directory is None else os.fspath(directory)
    # slot + 1 per client, 0 where it holds no entry.
    index_dtype = np.int32 if num_clients < 2 ** 31 - 1 else np.int64
    self._index = np.zeros(self._num_clients, index_dtype)
    self._size = 0
    self._memory = self._empty_arrays(0)
    self._disk: list[np.memmap] | None = None
    self._disk_capacity = 0
    self._dirty: set[int] = set()
    self._last_saved: int | None = None
    self._staging: list[np.ndarray] | None = None  # See stage().
    self._staged, self._staged_ids = 0, []
    if self._directory is not None:
      os.makedirs(self._checkpoint_dir, exist_ok=True)
      shutil.rmtree(self._rows_dir, ignore_errors=True)

  # The population and the rows.

  @property
  def num_clients(self) -> int:
    return self._num_clients

  @property
  def initial(self) -> Any:
    """The state of a client that holds no entry (a copy)."""
    return self._treedef.unflatten([leaf.copy() for leaf in self._initial])

  @property
  def row_spec(self) -> Any:
    """One client's row as a pytree of ``jax.ShapeDtypeStruct`` (nothing copied)."""
    import jax  # pylint: disable=import-outside-toplevel
    return self._treedef.unflatten([jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                                    for leaf in self._initial])

  @property
  def row_bytes(self) -> int:
    """Bytes of one client's row."""
    return self._row_bytes

  def __len__(self) -> int:
    """Clients holding an entry (written at least once)."""
    return self._size

  def __contains__(self, client_id: int) -> bool:
    return 0 <= client_id < self._num_clients and bool(self._index[client_id])

  def ids(self) -> np.ndarray:
    """The ids of the clients holding an entry, ascending (reads the index)."""
    return np.flatnonzero(self._index)

  @property
  def memory_bytes(self) -> int:
    """Bytes of row arrays allocated in host memory (the index excluded)."""
    return sum(a.nbytes for a in self._memory)

  @property
  def disk_bytes(self) -> int:
    """Bytes of the live files holding rows beyond the memory budget."""
    return self._disk_capacity * self._row_bytes

  @property
  def checkpoint_bytes(self) -> int:
    """Bytes of the saved steps' files (manifests and deltas)."""
    if self._directory is None or not os.path.isdir(self._checkpoint_dir):
      return 0
    return sum(e.stat().st_size for e in os.scandir(self._checkpoint_dir)
               if e.is_file())

  def read(self, ids: Any, out: Any = None) -> Any:
    """The rows of ``ids`` (pytree of ``[len(ids), ...]`` arrays).

    Ids < 0 (padding clients) and clients holding no entry read ``initial``.
    The rows are new memory, or ``out``'s: arrays of the rows' shapes and
    dtypes that a caller reuses from read to read (memory written before
    costs a copy; new memory also costs the operating system's first touch
    of every page, several times the copy on some hosts).
    """
    ids = self._check_ids('read', ids)
    if out is None:
      out = [np.empty((len(ids),) + leaf.shape, leaf.dtype) for leaf in self._initial]
    else:
      out = self._check_rows(out, len(ids), 'read', exact=True)
    slots = np.where(ids >= 0, self._index[np.maximum(ids, 0)], 0).astype(np.int64) - 1
    for o, leaf in zip(out, self._initial):
      o[slots < 0] = leaf
    held = np.flatnonzero(slots >= 0)
    if held.size == len(ids):  # Straight into ``out``.
      self._gather(slots, out)
    elif held.size:
      for o, rows in zip(out, self._gather(slots[held])):
        o[held] = rows
    return self._treedef.unflatten(out)

  def write(self, ids: Any, rows: Any) -> None:
    """Sets the rows of ``ids`` (leaves ``[len(ids), ...]``); ids < 0 are skipped."""
    ids = self._check_ids('write', ids)
    real = ids[ids >= 0]
    if np.unique(real).size != real.size:
      values, counts = np.unique(real, return_counts=True)
      raise ValueError(f'ClientStore.write: ids {values[counts > 1].tolist()} '
                       'appear more than once; each client is written once per call.')
    leaves = self._check_rows(rows, len(ids), 'write')
    if real.size < ids.size:  # Padding rows are dropped.
      keep = np.flatnonzero(ids >= 0)
      leaves = [leaf[keep] for leaf in leaves]
    self._assign(real, leaves)
    self._dirty.update(real.tolist())

  def reset(self) -> None:
    """Forgets every row, as a new store: each client reads ``initial``, the
    staged rows are dropped, the next :meth:`save` starts a new chain. The
    staging arrays are kept."""
    self._clear()
    self._dirty.clear()
    self._last_saved = None

  # A round's new rows, staged chunk by chunk until the round is accepted.

  def stage(self, ids: Any, rows: Any) -> None:
    """Holds ``rows`` for ``ids`` (ids < 0 skipped) without writing them.

    A round streamed in chunks stages each chunk's new rows as they arrive;
    :meth:`commit` then writes all of them (as one :meth:`write`) once the
    round is accepted, and :meth:`discard` drops them (a round run again).
    The staging arrays are kept and reused from round to round, so staging
    costs a copy into memory written before (see :meth:`read`).
    """
    ids = self._check_ids('stage', ids)
    leaves = self._check_rows(rows, len(ids), 'stage')
    keep = np.flatnonzero(ids >= 0)
    start, stop = self._staged, self._staged + keep.size
    if self._staging is None or len(self._staging[0]) < stop:
      grown = self._empty_arrays(max(stop, 2 * (0 if self._staging is None
                                                  else len(self._staging[0]))))
      if self._staging is not None:
        for new, old in zip(grown, self._staging):
          new[:start] = old[:start]
      self._staging = grown
    if keep.size < len(ids):
      leaves = [leaf[keep] for leaf in leaves]

    def copy(k, a, b):
      self._staging[k][start + a:start + b] = leaves[k][a:b]
    _copy_in_blocks(copy, leaves, keep.size)
    self._staged_ids.append(ids[keep])
    self._staged = stop

  def commit(self) -> None:
    """Writes the staged rows (:meth:`stage`), as one :meth:`write`."""
    if self._staged:
      ids = np.concatenate(self._staged_ids)
      self.write(ids, self._treedef.unflatten([a[:self._staged] for a in self._staging]))
    self.discard()

  def discard(self) -> None:
    """Drops the staged rows (:meth:`stage`) without writing them."""
    self._staged, self._staged_ids = 0, []

  # Checkpoints.

  def saved_steps(self) -> list[int]:
    """Steps with a manifest in place (a save killed before it is not one)."""
    if self._directory is None or not os.path.isdir(self._checkpoint_dir):
      return []
    return sorted(int(m.group(1)) for m in map(_MANIFEST.fullmatch,
                                                os.listdir(self._checkpoint_dir))
                  if m)

  def save(self, step: int) -> None:
    """Saves the rows written since the previous save (or restore) as ``step``.

    Steps increase. Saved steps after the one this store was restored to (an
    abandoned branch) are deleted, as are files no manifest names.
    """
    self._need_directory('save')
    self._check_step('save', step)
    if self._last_saved is not None and step <= self._last_saved:
      raise ValueError(f'ClientStore.save: step={step} must be greater than the '
                       f'previous saved (or restored) step {self._last_saved}.')
    ids = np.array(sorted(self._dirty), np.int64)
    name = f'delta_{step:012d}_{uuid.uuid4().hex[:8]}.bin'
    digest, size = self._write_delta(name, ids, self._blocks_of(ids))
    self._write_manifest(step, {'parent': self._last_saved, 'file': name,
                                'bytes': size, 'sha256': digest,
                                'rows': int(ids.size)})
    for other in self.saved_steps():  # The abandoned branch.
      if other != step and (self._last_saved is None or other > self._last_saved):
        os.remove(self._manifest_path(other))
    self._remove_unreferenced()
    self._last_saved = step
    self._dirty.clear()

  def restore(self, step: int) -> None:
    """Brings back exactly the rows as of saved ``step``.

    Raises ValueError if ``step`` was not saved, and
    :class:`CorruptCheckpointError` (naming the file) if a manifest or delta
    of its chain is unreadable or fails its checksum; the store is then left
    as it was.
    """
    self._need_directory('restore')
    self._check_step('restore', step)
    chain = self._chain(step)
    for manifest in chain:
      self._verify(manifest)
    self._clear()
    for manifest in reversed(chain):  # Oldest first: later rows win.
      for ids, leaves in self._delta_blocks(manifest):
        self._assign(ids, leaves)
    self._last_saved = step
    self._dirty.clear()

  def compact(self, step: int) -> None:
    """Merges saved ``step``'s chain into one delta; earlier steps are freed.

    ``step`` restores the same rows afterwards; the steps before it no longer
    restore (their files are deleted), the steps after it still do.
    """
    self._need_directory('compact')
    self._check_step('compact', step)
    chain = self._chain(step)
    for manifest in chain:
      self._verify(manifest)
    # The latest row of each id over the chain: its delta and its position.
    ids, source, position = [], [], []
    for k, manifest in enumerate(reversed(chain)):
      delta_ids = self._delta_ids(manifest)
      ids.append(delta_ids)
      source.append(np.full(delta_ids.size, k))
      position.append(np.arange(delta_ids.size))
    ids, source, position = map(np.concatenate, (ids, source, position))
    last = ids.size - 1 - np.unique(ids[::-1], return_index=True)[1]
    ids, source, position = ids[last], source[last], position[last]
    arrays = [self._delta_arrays(m)[1] for m in reversed(chain)]

    def blocks():
      per_block = self._rows_per_block()
      for s in range(0, ids.size, per_block):
        src, pos = source[s:s + per_block], position[s:s + per_block]
        out = [np.empty((src.size,) + leaf.shape, leaf.dtype) for leaf in self._initial]
        for k in np.unique(src):
          at = np.flatnonzero(src == k)
          for o, a in zip(out, arrays[k]):
            o[at] = a[pos[at]]
        yield out

    name = f'delta_{step:012d}_{uuid.uuid4().hex[:8]}.bin'
    digest, size = self._write_delta(name, ids, blocks())
    self._write_manifest(step, {'parent': None, 'file': name, 'bytes': size,
                                'sha256': digest, 'rows': int(ids.size)})
    for other in self.saved_steps():
      if other < step:
        os.remove(self._manifest_path(other))
    self._remove_unreferenced()

  def close(self) -> None:
    """Releases the rows; the live row files are deleted, saved steps kept."""
    self._disk = None
    self._disk_capacity = 0
    self._memory = self._empty_arrays(0)
    if self._directory is not None:
      shutil.rmtree(self._rows_dir, ignore_errors=True)

  def __enter__(self) -> 'ClientStore':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # Rows by slot.

  def _empty_arrays(self, capacity: int) -> list[np.ndarray]:
    return [np.empty((capacity,) + leaf.shape, leaf.dtype) for leaf in self._initial]

  def _gather(self, slots: np.ndarray, out: list[np.ndarray] | None = None
              ) -> list[np.ndarray]:
    """Rows at ``slots`` (int64), into ``out`` or new arrays."""
    m = len(self._memory[0]) if self._memory_slots is None else self._memory_slots
    if out is None:
      out = [np.empty((slots.size,) + leaf.shape, leaf.dtype) for leaf in self._initial]
    in_memory = slots < m
    mem_at, disk_at = np.flatnonzero(in_memory), np.flatnonzero(~in_memory)
    if mem_at.size == slots.size:  # Straight into ``out``: no temporary copy
      # ('clip' is not buffered as 'raise' is; the slots are valid).
      def copy(k, a, b):
        np.take(self._memory[k], slots[a:b], axis=0, out=out[k][a:b], mode='clip')
      _copy_in_blocks(copy, out, slots.size)
      return out
    for k, o in enumerate(out):
      if mem_at.size:
        o[mem_at] = self._memory[k][slots[mem_at]]
      if disk_at.size:
        o[disk_at] = self._disk[k][slots[disk_at] - m]
    return out

  def _assign(self, ids: np.ndarray, leaves: list[np.ndarray]) -> None:
    """Writes rows of distinct ``ids`` >= 0, giving new ids the next slots."""
    slots = self._index[ids].astype(np.int64) - 1
    new = slots < 0
    if new.any():
      fresh = np.arange(self._size, self._size + int(new.sum()))
      self._reserve(self._size + fresh.size)
      slots[new] = fresh
      self._index[ids[new]] = fresh + 1
      self._size += fresh.size
    m = len(self._memory[0]) if self._memory_slots is None else self._memory_slots
    in_memory = slots < m
    mem_at, disk_at = np.flatnonzero(in_memory), np.flatnonzero(~in_memory)
    if mem_at.size == slots.size:  # From ``leaves`` themselves, no temporary copy.
      def copy(k, a, b):
        self._memory[k][slots[a:b]] = leaves[k][a:b]
      _copy_in_blocks(copy, leaves, slots.size)
      return
    for k, leaf in enumerate(leaves):
      if mem_at.size:
        self._memory[k][slots[mem_at]] = leaf[mem_at]
      if disk_at.size:
        self._disk[k][slots[disk_at] - m] = leaf[disk_at]

  def _reserve(self, size: int) -> None:
    """Capacity for ``size`` slots: memory first, then files, by doubling."""
    capacity = len(self._memory[0])
    limit = size if self._memory_slots is None else min(size, self._memory_slots)
    if limit > capacity:
      cap = max(limit, 2 * capacity, 1)
      if self._memory_slots is not None:
        cap = min(cap, self._memory_slots)
      grown = self._empty_arrays(cap)
      for g, a in zip(grown, self._memory):
        g[:capacity] = a
      self._memory = grown
    if self._memory_slots is None or size <= self._memory_slots:
      return
    if self._directory is None:
      raise ValueError(
          f'ClientStore: {size} rows of {self._row_bytes} bytes exceed '
          f'memory_budget_bytes={self._budget} and directory=None; give a '
          'directory for the rows beyond the budget, or a larger budget.')
    need = size - self._memory_slots
    if need > self._disk_capacity:
      self._grow_disk(max(need, 2 * self._disk_capacity))

  def _grow_disk(self, capacity: int) -> None:
    os.makedirs(self._rows_dir, exist_ok=True)
    self._disk = None  # Unmaps the old views before the files grow.
    arrays = []
    for k, leaf in enumerate(self._initial):
      path = os.path.join(self._rows_dir, f'leaf_{k}.bin')
      with open(path, 'ab') as f:
        f.truncate(capacity * leaf.nbytes)
      arrays.append(np.memmap(path, leaf.dtype, 'r+',
                              shape=(capacity,) + leaf.shape))
    self._disk, self._disk_capacity = arrays, capacity

  def _clear(self) -> None:
    self.close()
    self.discard()
    self._index = np.zeros_like(self._index)
    self._size = 0

  # Checks.

  def _check_ids(self, fn: str, ids: Any) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.dtype.kind in 'iu' or ids.size == 0):
      raise ValueError(f'ClientStore.{fn}: ids have shape {ids.shape} and dtype '
                       f'{ids.dtype}; they must be a 1-D array of ints.')
    ids = ids.astype(np.int64)
    bad = ids >= self._num_clients
    if bad.any():
      raise ValueError(f'ClientStore.{fn}: ids {ids[bad][:5].tolist()} are outside '
                       f'[0, {self._num_clients}) (num_clients); padding clients '
                       'are negative.')
    return ids

  def _check_rows(self, rows: Any, n: int, fn: str, exact: bool = False
                  ) -> list[np.ndarray]:
    """``rows``' leaves, checked against the store's; ``exact``: arrays of the
    store's dtypes, used as they are (``read``'s ``out``)."""
    tu = _tree_util()
    name = 'out' if exact else 'rows'
    leaves, treedef = tu.tree_flatten(rows)
    if treedef != self._treedef:
      raise ValueError(f'ClientStore.{fn}: {name} have structure {treedef}; '
                       f'the store holds {self._treedef}.')
    out = []
    for i, (leaf, init) in enumerate(zip(leaves, self._initial)):
      if exact and not (isinstance(leaf, np.ndarray) and leaf.dtype == init.dtype
                        and leaf.flags.writeable):
        raise ValueError(f'ClientStore.{fn}: {name} leaf {i} is '
                         f'{type(leaf).__name__} of dtype {getattr(leaf, "dtype", None)}; '
                         f'it must be a writeable NumPy array of dtype {init.dtype}.')
      leaf = np.asarray(leaf)
      if leaf.shape != (n,) + init.shape:
        raise ValueError(f'ClientStore.{fn}: {name} leaf {i} has shape {leaf.shape}; '
                         f'it must be {(n,) + init.shape} (one row per id).')
      if not np.can_cast(leaf.dtype, init.dtype, 'same_kind'):
        raise ValueError(f'ClientStore.{fn}: {name} leaf {i} has dtype {leaf.dtype}; '
                         f'the store holds {init.dtype}.')
      out.append(leaf.astype(init.dtype, copy=False))
    return out

  def _check_step(self, fn: str, step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f'ClientStore.{fn}: step={step!r} must be a non-negative int.')

  def _need_directory(self, fn: str) -> None:
    if self._directory is None:
      raise ValueError(f'ClientStore.{fn}: the store has directory=None; '
                       'checkpoints need a directory.')

  # Files.

  @property
  def _rows_dir(self) -> str:
    return os.path.join(self._directory, 'rows')

  @property
  def _checkpoint_dir(self) -> str:
    return os.path.join(self._directory, 'checkpoints')

  def _manifest_path(self, step: int) -> str:
    return os.path.join(self._checkpoint_dir, f'manifest_{step:012d}.json')

  def _leaf_specs(self) -> list[dict[str, Any]]:
    return [{'shape': list(leaf.shape), 'dtype': leaf.dtype.str}
            for leaf in self._initial]

  def _rows_per_block(self) -> int:
    return max(1, _BLOCK_BYTES // max(self._row_bytes, 1))

  def _blocks_of(self, ids: np.ndarray):
    per_block = self._rows_per_block()
    for s in range(0, ids.size, per_block):
      block = ids[s:s + per_block]
      yield self._gather(self._index[block].astype(np.int64) - 1)

  def _write_delta(self, name: str, ids: np.ndarray, blocks) -> tuple[str, int]:
    """Writes ids, then each leaf's rows (leaf-major), fsynced; (sha256, bytes)."""
    path = os.path.join(self._checkpoint_dir, name)
    digest = hashlib.sha256()
    # Leaf-major order: a leaf's rows for all ids, then the next leaf. Blocks
    # come row-major, so each leaf's part is written at its offset.
    offsets = np.cumsum([ids.nbytes] + [ids.size * leaf.nbytes
                                         for leaf in self._initial])
    with open(path, 'wb') as f:
      f.write(ids.astype('<i8').tobytes())
      f.truncate(int(offsets[-1]))
      done = 0
      for block in blocks:
        n = len(block[0])
        for k, rows in enumerate(block):
          f.seek(int(offsets[k]) + done * self._initial[k].nbytes)
          f.write(np.ascontiguousarray(rows).data)  # Its buffer, not a copy.
        done += n
      f.flush()
      os.fsync(f.fileno())
    with open(path, 'rb') as f:
      digest = hashlib.file_digest(f, 'sha256').hexdigest()
    return digest, int(offsets[-1])

  def _write_manifest(self, step: int, fields: dict[str, Any]) -> None:
    manifest = {'format': FORMAT, 'step': int(step),
                'num_clients': self._num_clients, 'leaves': self._leaf_specs(),
                **fields}
    path = self._manifest_path(step)
    tmp = f'{path}.{uuid.uuid4().hex[:8]}.tmp'
    with open(tmp, 'w') as f:
      json.dump(manifest, f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(self._checkpoint_dir)

  def _read_manifest(self, step: int) -> dict[str, Any]:
    path = self._manifest_path(step)
    try:
      with open(path) as f:
        manifest = json.load(f)
      bad = (manifest['format'] != FORMAT or manifest['step'] != step
             or not isinstance(manifest['file'], str))
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise CorruptCheckpointError(
          f'ClientStore.restore: manifest {path} is unreadable ({e}).') from e
    if bad:
      raise CorruptCheckpointError(f'ClientStore.restore: manifest {path} is not a '
                                   f'format-{FORMAT} manifest of step {step}.')
    if (manifest['num_clients'] != self._num_clients
        or manifest['leaves'] != self._leaf_specs()):
      raise ValueError(
          f'ClientStore.restore: step {step} holds rows {manifest["leaves"]} of '
          f'{manifest["num_clients"]} clients; this store holds rows '
          f'{self._leaf_specs()} of {self._num_clients}.')
    return manifest

  def _chain(self, step: int) -> list[dict[str, Any]]:
    """The manifests from ``step`` back to its chain's first, newest first."""
    if not os.path.exists(self._manifest_path(step)):
      raise ValueError(f'ClientStore.restore: step={step} was not saved; saved '
                       f'steps: {self.saved_steps()}.')
    chain = [self._read_manifest(step)]
    while chain[-1]['parent'] is not None:
      parent = chain[-1]['parent']
      if not isinstance(parent, int) or parent >= chain[-1]['step']:
        raise CorruptCheckpointError(
            f'ClientStore.restore: manifest {self._manifest_path(chain[-1]["step"])} '
            f'names parent step {parent!r}.')
      if not os.path.exists(self._manifest_path(parent)):
        raise CorruptCheckpointError(
            f'ClientStore.restore: step {step} builds on step {parent}, whose '
            f'manifest {self._manifest_path(parent)} is missing.')
      chain.append(self._read_manifest(parent))
    return chain

  def _verify(self, manifest: dict[str, Any]) -> None:
    path = os.path.join(self._checkpoint_dir, manifest['file'])
    try:
      size = os.path.getsize(path)
      with open(path, 'rb') as f:
        digest = hashlib.file_digest(f, 'sha256').hexdigest()
    except OSError as e:
      raise CorruptCheckpointError(
          f'ClientStore.restore: delta {path} of step {manifest["step"]} is '
          f'unreadable ({e}).') from e
    if size != manifest['bytes'] or digest != manifest['sha256']:
      raise CorruptCheckpointError(
          f'ClientStore.restore: delta {path} of step {manifest["step"]} fails '
          f'its checksum ({size} bytes, sha256 {digest[:12]}...; the manifest '
          f'says {manifest["bytes"]} bytes, {manifest["sha256"][:12]}...).')

  def _delta_arrays(self, manifest: dict[str, Any]):
    """Read-only maps of a delta's ids and each leaf's rows."""
    path = os.path.join(self._checkpoint_dir, manifest['file'])
    n = manifest['rows']
    if n == 0:
      return np.zeros(0, np.int64), self._empty_arrays(0)
    ids = np.memmap(path, '<i8', 'r', 0, (n,))
    offset, leaves = ids.nbytes, []
    for leaf in self._initial:
      leaves.append(np.memmap(path, leaf.dtype, 'r', offset, (n,) + leaf.shape))
      offset += n * leaf.nbytes
    return ids, leaves

  def _delta_ids(self, manifest: dict[str, Any]) -> np.ndarray:
    return np.array(self._delta_arrays(manifest)[0], np.int64)

  def _delta_blocks(self, manifest: dict[str, Any]):
    ids, leaves = self._delta_arrays(manifest)
    per_block = self._rows_per_block()
    for s in range(0, len(ids), per_block):
      yield (np.array(ids[s:s + per_block], np.int64),
             [np.array(a[s:s + per_block]) for a in leaves])

  def _remove_unreferenced(self) -> None:
    """Deletes deltas no manifest names and temporary files of killed saves."""
    keep = set()
    for step in self.saved_steps():
      try:
        with open(self._manifest_path(step)) as f:
          keep.add(json.load(f).get('file'))
      except (OSError, ValueError, AttributeError):
        continue  # Left for restore to report.
    for entry in os.scandir(self._checkpoint_dir):
      if entry.name.endswith('.tmp') or (entry.name.startswith('delta_')
                                         and entry.name not in keep):
        os.remove(entry.path)
