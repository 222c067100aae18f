"""Evaluating a server model on held-out data.

:func:`pool_examples` gathers the held-out examples of an experiment (a dict
of arrays, or the held-out clients of a federated dataset, concatenated);
:func:`make_evaluator` turns them into ``evaluate(params)``: the
example-weighted means of the model's evaluation loss and metrics over every
held-out example (no dropout), in one compiled call. Parameters sharded
over processes (FSDP in a multi-process run) are gathered first
(:func:`gather_to_host`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from fedjx import datasets
from fedjx import distributed
from fedjx import execution
from fedjx import models


def pool_examples(test: Any, limit: int) -> dict[str, np.ndarray] | None:
  """Held-out data as one dict of arrays (held-out clients are concatenated)."""
  if test is None:
    return None
  if isinstance(test, Mapping):
    out = {k: np.asarray(v)[:limit] for k, v in test.items()}
  else:  # A FederatedDataset of held-out clients.
    parts, total = [], 0
    for cid in range(test.num_clients):
      part = test.client_data(cid)
      parts.append(part)
      total += len(next(iter(part.values())))
      if total >= limit:
        break
    out = {k: np.concatenate([p[k] for p in parts])[:limit] for k in parts[0]}
  if not out or len(next(iter(out.values()))) == 0:
    return None
  return out


EVAL_SETTINGS = ('lower config.eval_batch_size or config.eval_max_examples, or use a '
                 'model that holds fewer activations')


def make_evaluator(model: models.Model, examples: Mapping[str, np.ndarray],
                   batch_size: int, params: Any = None,
                   log: Callable[[str], None] = print,
                   held_bytes: int = 0) -> Callable[[Any], dict[str, float]]:
  """``evaluate(params) -> {'eval_loss', 'eval_<metric>'...}`` over ``examples``.

  Example-weighted means of the model's evaluation loss and metrics (no
  dropout) over every held-out example, computed batch by batch with
  ``lax.map`` in one compiled call. Given ``params`` (their shapes), the
  evaluation is compiled at once, and on an accelerator the batches are
  halved until the program's outputs and temporaries fit ``HEADROOM`` of
  the device's memory less ``held_bytes`` (what stays on the device while
  it runs, e.g. the algorithm's state), logged once; a batch of one that
  does not fit raises :class:`fedjx.execution.OutOfMemory` naming the
  settings to change.
  """
  n = len(next(iter(examples.values())))
  batch_size = min(batch_size, n)

  @jax.jit
  def sums(params, batches, mask):
    def one(inputs):
      batch, m = inputs
      m = m.astype(jnp.float32)
      values = dict(model.metrics_fn(params, batch))
      values['loss'] = model.eval_loss_fn(params, batch)
      return {k: jnp.sum(v * m) for k, v in values.items()}, jnp.sum(m)
    totals, counts = jax.lax.map(one, (batches, mask))
    count = jnp.maximum(jnp.sum(counts), 1.0)
    return {k: jnp.sum(v) / count for k, v in totals.items()}

  program = sums
  if params is not None and jax.default_backend() != 'cpu':
    program, batch_size = _fit(sums, params, examples, batch_size, log, held_bytes)
  batches, mask = datasets.eval_batches(dict(examples), batch_size)
  batches = jax.device_put(batches)
  mask = jax.device_put(mask)

  def evaluate(params) -> dict[str, float]:
    with execution.naming_out_of_memory(
        f"the evaluation in batches of {batch_size} ran out of the device's memory while "
        'running', lambda: EVAL_SETTINGS):
      out = jax.device_get(program(gather_to_host(params), batches, mask))
    return {f'eval_{k}': float(v) for k, v in sorted(out.items())}

  return evaluate


def _fit(sums: Any, params: Any, examples: Mapping[str, np.ndarray], batch_size: int,
         log: Callable[[str], None], held_bytes: int) -> tuple[Any, int]:
  """The compiled evaluation and the largest batch, from ``batch_size`` halving, that fits."""
  spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
  limit = execution.device_memory_bytes()
  room = None if limit is None else execution.HEADROOM * (limit - held_bytes)
  first = batch_size
  while True:
    batches, mask = datasets.eval_batches(dict(examples), batch_size)
    lowered = sums.lower(jax.tree.map(spec, params), jax.tree.map(spec, batches), spec(mask))
    what = f'the evaluation in batches of {batch_size}'
    try:
      compiled = execution.compile_to_fit(lowered, what, EVAL_SETTINGS)
      memory = compiled.memory_analysis()
      need = memory.temp_size_in_bytes + memory.output_size_in_bytes + sum(
          x.nbytes for x in jax.tree.leaves((batches, mask)))
      if room is not None and need > room:
        raise execution.OutOfMemory(
            f'{what} plans {need / 2**30:.2f} GiB beside the {held_bytes / 2**30:.2f} GiB '
            f"the run holds, more than {execution.HEADROOM:.0%} of the device's "
            f'{limit / 2**30:.2f} GiB; {EVAL_SETTINGS}.')
    except execution.OutOfMemory:
      if batch_size == 1:
        raise
      batch_size = max(1, batch_size // 2)
      continue
    if batch_size != first:
      log(f'fedjx: the evaluation in batches of {first} examples does not fit the '
          f"device's memory beside the run's state; it runs in batches of {batch_size}.")
    return compiled, batch_size


def gather_to_host(tree: Any) -> Any:
  """NumPy copies of ``tree``'s arrays, gathering those sharded over processes.

  An array that no process holds whole (FSDP-sharded parameters of a
  multi-process run) is gathered with
  ``jax.experimental.multihost_utils.process_allgather``, a collective: every
  process must call this with the same tree, as the runner's evaluation does.
  """

  def one(x):
    if (isinstance(x, jax.Array) and not x.is_fully_addressable and
        not x.sharding.is_fully_replicated):
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x
  return distributed.to_host(jax.tree.map(one, tree))
