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

from fedjx import datasets
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


def make_evaluator(model: models.Model, examples: Mapping[str, np.ndarray],
                   batch_size: int) -> Callable[[Any], dict[str, float]]:
  """``evaluate(params) -> {'eval_loss', 'eval_<metric>'...}`` over ``examples``.

  Example-weighted means of the model's evaluation loss and metrics (no
  dropout) over every held-out example, computed batch by batch with
  ``lax.map`` in one compiled call.
  """
  n = len(next(iter(examples.values())))
  batch_size = min(batch_size, n)
  batches, mask = datasets.eval_batches(dict(examples), batch_size)
  batches = jax.device_put(batches)
  mask = jax.device_put(mask)

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

  def evaluate(params) -> dict[str, float]:
    out = jax.device_get(sums(gather_to_host(params), batches, mask))
    return {f'eval_{k}': float(v) for k, v in sorted(out.items())}

  return evaluate


def gather_to_host(tree: Any) -> Any:
  """NumPy copies of ``tree``'s arrays, gathering those sharded over processes.

  An array that no process holds whole (FSDP-sharded parameters of a
  multi-process run) is gathered with
  ``jax.experimental.multihost_utils.process_allgather``, a collective: every
  process must call this with the same tree, as the runner's evaluation does.
  """
  from fedjx import distributed  # pylint: disable=g-import-not-at-top

  def one(x):
    if (isinstance(x, jax.Array) and not x.is_fully_addressable and
        not x.sharding.is_fully_replicated):
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x
  return distributed.to_host(jax.tree.map(one, tree))
