"""Orbax checkpoints holding everything a run needs to continue exactly.

A checkpoint at step ``r`` (after ``r`` rounds) holds:

* ``state``: the algorithm state pytree (server parameters, optimizer states,
  per-client state, counters), saved with ``StandardSave``; PRNG key arrays
  inside it are stored as their raw key data and re-wrapped on restore.
* ``meta`` (JSON): the round, the run's seed and base PRNG key data, the
  sampler position (the next round to sample: cohorts are a pure function of
  ``(seed, round)``, so this is all the sampler needs), a fingerprint of
  the config so a workdir is not resumed with a different experiment, the
  state's ``structure`` (every leaf's tree path, shape and dtype), a
  SHA-256 ``checksum`` of the state's bytes and, when the checkpointer is
  given the run's data position (:mod:`fedjx.experiments.data_position`),
  ``data_position``: the round, the population, the sampler, the batching
  and each client's example count, rounds taken part in, epoch and offset.

Once a checkpoint is completely written, the size and SHA-256 of each of its
files go to ``checkpoint_manifests/<step>.json`` next to the checkpoint
directory (single-process runs).

Restoring reads ``meta`` first and compares the structure with the state the
current code builds (:func:`structure_difference`), so a changed model or
optimizer is one line naming the leaf instead of an error deep in Orbax; the
saved ``data_position`` is compared with the position the data now
configured give at the restored step, so changed data (a corpus of another
size, another ``num_shards``) is one line (:class:`DataPositionMismatch`)
instead of a resumed run that silently trains on other examples.
:meth:`Checkpointer.restore_latest_intact` checks the files against their
manifest before Orbax reads them, verifies the checksum of what it restored,
and falls back to the next older checkpoint when a file is truncated,
deleted or altered.

Per-round randomness is ``fold_in(key(seed), round)`` and cohorts are
``sampler.sample(round)``, so restoring ``state`` and the round reproduces the
uninterrupted run bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from fedjx import distributed
from fedjx.experiments import checkpoint_manifests
from fedjx.experiments import metrics_writers


class StructureMismatch(ValueError):
  """The checkpoint's state has other leaves, shapes or dtypes than the run's."""


def _one_line(e: BaseException) -> str:
  text = ' '.join(str(e).split())
  return f'{type(e).__name__}: {text[:200]}'


@contextlib.contextmanager
def _quiet_abandoned_reads() -> Iterator[None]:
  """Silences Orbax's read coroutines that a failed restore leaves behind.

  When a damaged file fails a restore, Orbax's other pending reads of it are
  abandoned; once collected they print their own copy of the error as
  "Exception ignored in: <coroutine ...>". That error is already reported in
  one line, so within this block (which collects them before it ends) such
  coroutines from Orbax are not printed; anything else is.
  """
  previous = sys.unraisablehook

  def hook(unraisable):
    obj = unraisable.object
    if inspect.iscoroutine(obj) and 'orbax' in obj.cr_code.co_filename:
      return
    previous(unraisable)
  sys.unraisablehook = hook
  try:
    yield
  finally:
    gc.collect()
    sys.unraisablehook = previous


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_savable(tree: Any) -> Any:
  def one(x):
    if _is_key(x):
      return jax.random.key_data(x)
    if isinstance(x, (jax.Array, np.ndarray)):
      return x
    return np.asarray(x)
  return jax.tree.map(one, tree)


def _abstract(tree: Any) -> Any:
  def one(x):
    if _is_key(x):
      x = jax.random.key_data(x)
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.tree.map(one, tree)


def _like_commitment(saved: Any, ref: jax.Array) -> Any:
  """``saved`` uncommitted when ``ref`` is (as a state that never left the device is).

  JAX compiles a function called with device-committed arrays (what Orbax
  restores) apart from one called with uncommitted arrays, and XLA may order
  float operations differently in the two programs: a resumed run would then
  differ from an uninterrupted one in the last bits.
  """
  if ref.committed or not isinstance(saved, jax.Array):
    return saved
  return jnp.asarray(np.asarray(saved))


def _from_saved(restored: Any, like: Any) -> Any:
  def one(saved, ref):
    if _is_key(ref):
      data = _like_commitment(saved, jax.random.key_data(ref))
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(ref))
    if isinstance(ref, jax.Array):
      return _like_commitment(saved, ref)
    if isinstance(ref, np.ndarray):
      return saved
    return type(ref)(np.asarray(saved).item()) if np.ndim(ref) == 0 else saved
  return jax.tree.map(one, restored, like)


class CheckpointError(RuntimeError):
  """No checkpoint in the directory can be restored intact."""


class DataPositionMismatch(CheckpointError):
  """A checkpoint's saved data position differs from the data now configured."""


class CheckpointWriteError(CheckpointError):
  """A checkpoint could not be written (a full disk, a read-only directory...)."""


def _os_error(error: BaseException) -> OSError | None:
  """The first OSError among ``error`` and its causes, if any."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, OSError):
      return error
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return None


class _OrbaxErrors(logging.Filter):
  """Drops the error records (and tracebacks) Orbax logs from its background
  threads; the error itself reaches the caller as an exception."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and
                f'{os.sep}orbax{os.sep}' in (record.pathname or ''))


_ORBAX_ERRORS = _OrbaxErrors()


def quiet_orbax_errors(quiet: bool = True) -> None:
  """Hides (or shows again) the errors Orbax logs with their tracebacks.

  A failed save or restore is reported by :class:`Checkpointer` as one
  exception (a :class:`CheckpointWriteError`, or a one-line fallback
  warning); Orbax also logs it, with a traceback per thread involved. The
  command line hides those unless ``--debug`` is given.
  """
  for name in ('absl', 'orbax'):
    logger = logging.getLogger(name)
    if quiet:
      logger.addFilter(_ORBAX_ERRORS)
    else:
      logger.removeFilter(_ORBAX_ERRORS)


def structure(tree: Any) -> list[list[Any]]:
  """Every leaf of ``tree`` as ``[path, shape, dtype]`` (JSON-ready)."""
  leaves = jax.tree_util.tree_leaves_with_path(_abstract(tree))
  return [[jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)]
          for path, leaf in leaves]


def structure_difference(saved: list[list[Any]], current: list[list[Any]]
                         ) -> str | None:
  """The first difference of two :func:`structure` lists in words, or None."""
  old = {p: (tuple(s), d) for p, s, d in saved}
  new = {p: (tuple(s), d) for p, s, d in current}
  for path in [p for p, _, _ in current] + [p for p, _, _ in saved]:
    if path not in old:
      return f'state leaf {path} is new (shape {new[path][0]}, {new[path][1]})'
    if path not in new:
      return f'state leaf {path} is gone (it was {old[path][0]}, {old[path][1]})'
    if old[path] != new[path]:
      (s0, d0), (s1, d1) = old[path], new[path]
      return f'state leaf {path}: shape {s0} {d0} -> {s1} {d1}'
  return None


def checksum(tree: Any) -> str | None:
  """SHA-256 over every leaf's path, dtype, shape and bytes, in tree order.

  None when the state is sharded over processes (no process sees all of it).
  """
  try:
    host = distributed.to_host(_to_savable(tree))
  except ValueError:
    return None
  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(host):
    leaf = np.ascontiguousarray(leaf)
    digest.update(f'{jax.tree_util.keystr(path)}|{leaf.dtype}|{leaf.shape}|'.encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


def written_steps(directory: str) -> list[int]:
  """The steps of the finished checkpoints in ``directory``, read from the
  names of its step folders only (Orbax writes a step under a temporary name
  and renames it ``<step>`` when complete), oldest first; ``[]`` when there
  is none. Nothing is opened, so it cannot say whether a step is intact:
  :meth:`Checkpointer.restore_latest_intact` does."""
  try:
    names = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):
    return []
  return sorted(int(n) for n in names
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


class Checkpointer:
  """Saves and restores run state under ``workdir/checkpoints``.

  Args:
    directory: the checkpoint directory (created if missing).
    max_to_keep: how many recent checkpoints to keep.
    async_save: write in a background thread (training continues meanwhile);
      a checkpoint becomes visible only once fully written, so a process
      killed mid-write leaves the previous checkpoint as the latest.
    position: the run's data position
      (:class:`fedjx.experiments.data_position.DataPosition`: ``at(step)``
      and ``difference(saved, step)``), saved in every checkpoint's meta and
      checked on restore; None: neither.
  """

  def __init__(self, directory: str, max_to_keep: int = 2, async_save: bool = True,
               position: Any = None):
    self.directory = os.path.abspath(directory)
    self.position = position
    self.manifests = os.path.join(os.path.dirname(self.directory),
                                  'checkpoint_manifests')
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._saved = False  # Only a writer records manifests.
    self._writing: int | None = None  # The step of the save in flight.
    self._failed: CheckpointWriteError | None = None

  def _files(self, step: int) -> dict[str, list[Any]]:
    """``{relative path: [size, sha256]}`` of step ``step``'s data files."""
    return checkpoint_manifests.files(os.path.join(self.directory, str(step)))

  def _record_files(self) -> None:
    """Writes the manifest of every complete step that lacks one; drops stale ones."""
    if jax.process_count() != 1 or not self._saved:
      return  # Each process's files may live on its own disk.
    steps = set(self.all_steps())
    os.makedirs(self.manifests, exist_ok=True)
    for name in os.listdir(self.manifests):
      stem = name.split('.')[0]
      if not name.endswith('.json') or not stem.isdigit() or int(stem) not in steps:
        os.remove(os.path.join(self.manifests, name))
    for step in steps:
      path = os.path.join(self.manifests, f'{step}.json')
      if not os.path.exists(path):
        metrics_writers.write_atomically(
            path, json.dumps(self._files(step), sort_keys=True))

  def _check_files(self, step: int) -> str | None:
    """What is wrong with step ``step``'s files per its manifest, or None."""
    if jax.process_count() != 1:
      return None
    return checkpoint_manifests.problem(self.directory, self.manifests, step)

  def latest_step(self) -> int | None:
    """The last completely written step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every completely written step, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any],
           force: bool = False) -> None:
    """Saves ``state`` and ``meta`` as step ``step`` (asynchronously).

    ``meta`` gains the state's ``structure`` and ``checksum``, and the data
    position after ``step`` rounds (``data_position``) when the checkpointer
    has one. Orbax first waits for any save still in flight, so at most one
    is pending.
    """
    if self._manager.latest_step() == step:
      return
    self.wait()
    self._saved = True
    meta = dict(meta, structure=structure(state), checksum=checksum(state))
    if self.position is not None:
      meta['data_position'] = self.position.at(step)
    self._writing = step
    with self._reporting_write_errors():
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_to_savable(state)),
          meta=ocp.args.JsonSave(meta)), force=force)

  @contextlib.contextmanager
  def _reporting_write_errors(self) -> Iterator[None]:
    """An OSError while a checkpoint is written becomes one CheckpointWriteError
    naming the workdir, the step, the errno and what is kept; raised again
    by every later wait (the save stays failed)."""
    if self._failed is not None:
      raise self._failed
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      error = _os_error(e)
      if error is None:
        raise
      workdir = os.path.dirname(self.directory)
      kept = [s for s in self._manager.all_steps() if s != self._writing]
      last = (f'its newest checkpoint, of step {max(kept)}, is intact' if kept
              else 'no checkpoint was written before')
      reason = (f'[Errno {error.errno}] {os.strerror(error.errno)}'
                if error.errno else _one_line(error))
      self._failed = CheckpointWriteError(
          f'cannot write the checkpoint of step {self._writing} in {workdir}: '
          f'{reason} ({error.filename or self.directory}); {last} and the '
          'metrics written so far are kept. Free space (or fix the directory) '
          'and run the same command again to continue.')
      raise self._failed from None

  def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
    """Restores step ``step`` into the structure (and shardings) of ``like``.

    Args:
      step: a saved step.
      like: a state pytree of the same structure, e.g. ``algo.init(params)``.

    Returns:
      ``(state, meta)``.
    """
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_abstract(like)),
        meta=ocp.args.JsonRestore()))
    return _from_saved(restored.state, like), dict(restored.meta)

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata of step ``step`` alone (the state is not read)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))
    return dict(restored.meta)

  def restore_latest_intact(
      self, like: Any, check_meta: Callable[[dict[str, Any]], None] = lambda m: None,
      warn: Callable[[str], None] = lambda msg: None,
  ) -> tuple[Any, dict[str, Any]] | None:
    """Restores the newest checkpoint that reads back intact, or None if none exist.

    For each step, newest first: reads ``meta`` and calls ``check_meta(meta)``
    (which raises to refuse a different experiment: that error propagates),
    compares the saved structure with ``like``'s and the saved data position
    with the checkpointer's (:meth:`check_position`), restores the state and
    verifies its checksum. A checkpoint that fails to read or verify is
    reported through ``warn`` in one line and deleted, and the next older one
    is tried, so training continues from the newest intact state.

    Raises:
      CheckpointError: checkpoints exist but none is intact.
      DataPositionMismatch: the newest readable checkpoint's data position
        differs from the data now configured.
      ValueError: (from ``check_meta``) or a structure different from ``like``.
    """
    steps = self.all_steps()
    if not steps:
      return None
    current = structure(like)
    for step in reversed(steps):
      problem = self._check_files(step)
      if problem is not None:
        self._discard(step, problem, warn)
        continue
      try:
        meta = self.read_meta(step)
      except Exception as e:  # pylint: disable=broad-except
        self._discard(step, f'its metadata cannot be read ({_one_line(e)})', warn)
        continue
      check_meta(meta)
      if 'structure' in meta:
        diff = structure_difference(meta['structure'], current)
        if diff is not None:
          raise StructureMismatch(
              f'{os.path.dirname(self.directory)} holds a checkpoint of a '
              f'different model or optimizer: {diff}.')
      self.check_position(step, meta)
      failure = None
      with _quiet_abandoned_reads():
        try:
          state, meta = self.restore(step, like)
        except Exception as e:  # pylint: disable=broad-except
          failure = _one_line(e)
      if failure is not None:
        self._discard(step, f'it cannot be read ({failure})', warn)
        continue
      expected = meta.get('checksum')
      if expected is not None and checksum(state) != expected:
        self._discard(step, 'its checksum does not match its contents', warn)
        continue
      return state, meta
    raise CheckpointError(
        f'no checkpoint in {self.directory} is intact (steps {steps} failed to '
        'read or verify); start over with --fresh (or delete the directory).')

  def check_position(self, step: int, meta: dict[str, Any]) -> None:
    """Refuses step ``step`` when its ``meta['data_position']`` differs from
    the position the checkpointer's data give after ``meta['step']`` rounds
    (one line naming the first difference). A checkpoint without a saved
    position, or a checkpointer without one, is not checked."""
    saved = meta.get('data_position')
    if self.position is None or saved is None:
      return
    diff = self.position.difference(saved, int(meta.get('step', step)))
    if diff is not None:
      raise DataPositionMismatch(
          f'{os.path.dirname(self.directory)} holds a checkpoint of step {step} '
          f'written with other data: {diff}; run it with the data it was written '
          'with, or start over with --fresh (or use a new --workdir).')

  def _discard(self, step: int, why: str, warn: Callable[[str], None]) -> None:
    warn(f'fedjx: warning: the checkpoint of step {step} is damaged: {why}; '
         'falling back to the previous checkpoint.')
    self._manager.delete(step)
    manifest = os.path.join(self.manifests, f'{step}.json')
    if os.path.exists(manifest):
      os.remove(manifest)

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk (and recorded).

    Raises:
      CheckpointWriteError: the save in flight failed with an OSError (a
        full disk: the errno and the workdir in one line).
    """
    with self._reporting_write_errors():
      self._manager.wait_until_finished()
    self._writing = None
    self._record_files()

  def close(self) -> None:
    """Waits for the save in flight, then releases Orbax's threads (also
    when that save failed, whose error is raised after)."""
    try:
      self.wait()
    finally:
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-except
        if self._failed is None:
          raise
