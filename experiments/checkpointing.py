"""Orbax checkpoints holding everything a run needs to continue exactly.

A checkpoint at step ``r`` (after ``r`` rounds) holds:

* ``state``: the algorithm state pytree (server parameters, optimizer states,
  per-client state, counters), saved with ``StandardSave``; PRNG key arrays
  inside it are stored as their raw key data and re-wrapped on restore.
* ``meta`` (JSON): the round, the run's seed and base PRNG key data, the
  sampler position (the next round to sample: cohorts are a pure function of
  ``(seed, round)``, so this is all the sampler needs), and a fingerprint of
  the config so a workdir is not resumed with a different experiment.

Per-round randomness is ``fold_in(key(seed), round)`` and cohorts are
``sampler.sample(round)``, so restoring ``state`` and the round reproduces the
uninterrupted run bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


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


def _from_saved(restored: Any, like: Any) -> Any:
  def one(saved, ref):
    if _is_key(ref):
      return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(ref))
    if isinstance(ref, (jax.Array, np.ndarray)):
      return saved
    return type(ref)(np.asarray(saved).item()) if np.ndim(ref) == 0 else saved
  return jax.tree.map(one, restored, like)


class Checkpointer:
  """Saves and restores run state under ``workdir/checkpoints``.

  Args:
    directory: the checkpoint directory (created if missing).
    max_to_keep: how many recent checkpoints to keep.
    async_save: write in a background thread (training continues meanwhile);
      a checkpoint becomes visible only once fully written, so a process
      killed mid-write leaves the previous checkpoint as the latest.
  """

  def __init__(self, directory: str, max_to_keep: int = 2, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The last completely written step, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any],
           force: bool = False) -> None:
    """Saves ``state`` and ``meta`` as step ``step`` (asynchronously)."""
    if self._manager.latest_step() == step:
      return
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_to_savable(state)),
        meta=ocp.args.JsonSave(meta)), force=force)

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

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
