"""Evaluation data: held-out clients, held-out examples, or a central split.

Three ways to hold data out of training, each deterministic in ``seed``:

* :func:`split_clients`: a fraction of the clients is kept for evaluation
  (generalisation to unseen clients, as in Yuan et al. 2022 and LEAF).
* :func:`split_examples`: every client keeps a fraction of its own examples
  (the per-client train/test split of LEAF and FedProx).
* a central test split (e.g. from :func:`fedjx.datasets.load_digits`), batched
  with :func:`eval_batches`.

:func:`evaluate` gives the example-weighted means of a per-example function
(a model's ``metrics_fn`` or ``loss_fn``) over held-out examples in one
compiled call; :func:`eval_cohorts` walks over every client of a dataset
exactly once in fixed-size cohorts, for federated evaluation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets.cohort import (Cohort, bucket_steps, make_cohort, pad_batches,
                                   place_cohort)
from fedjx.datasets.federated import Examples, FederatedDataset, num_rows


def _check_fraction(name: str, fraction: float) -> float:
  if not 0.0 < fraction < 1.0:
    raise ValueError(f'{name}={fraction!r}; it must be a float in (0, 1).')
  return float(fraction)


def split_clients(dataset: FederatedDataset, test_fraction: float = 0.2,
                  seed: int = 0) -> tuple[FederatedDataset, FederatedDataset]:
  """Splits the clients into disjoint (train, test) populations.

  ``round(test_fraction * num_clients)`` clients (at least one, at most all but
  one), chosen uniformly at random, form the test population. Both keep client
  names; ids are renumbered from 0 within each (``.base_ids`` maps back).
  """
  _check_fraction('test_fraction', test_fraction)
  n = dataset.num_clients
  if n < 2:
    raise ValueError(f'split_clients needs at least 2 clients; the dataset has {n}.')
  num_test = min(max(1, round(test_fraction * n)), n - 1)
  perm = _seeding.rng(_seeding.SPLIT, seed, 0).permutation(n)
  return dataset.subset(np.sort(perm[num_test:])), dataset.subset(np.sort(perm[:num_test]))


class _ExampleSplit(FederatedDataset):
  """One side of a per-client example split of ``base``."""

  def __init__(self, base: FederatedDataset, fraction: float, seed: int, test: bool):
    self._base, self._fraction, self._seed, self._test = base, fraction, seed, test
    sizes = base.examples_per_client()
    small = np.flatnonzero(sizes < 2)
    if small.size:
      c = int(small[0])
      raise ValueError(f'split_examples: client {c} ({base.client_name(c)!r}) has '
                       f'{sizes[c]} example(s); a per-client split needs at least '
                       '2 per client (use split_clients instead).')
    num_test = np.clip(np.rint(sizes * fraction).astype(np.int64), 1, sizes - 1)
    self._sizes = num_test if test else sizes - num_test

  @property
  def num_clients(self) -> int:
    return self._base.num_clients

  def client_name(self, cid: int) -> str:
    return self._base.client_name(cid)

  def num_examples(self, cid: int) -> int:
    return int(self._sizes[self.check_client(cid)])

  def examples_per_client(self) -> np.ndarray:
    return self._sizes.copy()

  def _client_data(self, cid: int) -> Examples:
    data = self._base.client_data(cid)
    n = num_rows(data, where=f'client {cid}')
    perm = _seeding.rng(_seeding.SPLIT, self._seed, 1, cid).permutation(n)
    num_train = n - int(np.clip(round(n * self._fraction), 1, n - 1))
    take = np.sort(perm[num_train:] if self._test else perm[:num_train])
    return {k: np.asarray(v)[take] for k, v in data.items()}


def split_examples(dataset: FederatedDataset, test_fraction: float = 0.2,
                   seed: int = 0) -> tuple[FederatedDataset, FederatedDataset]:
  """Splits each client's examples into (train, test) datasets with the same ids.

  Client ``c`` of ``n >= 2`` examples gives ``round(test_fraction * n)`` of them
  (clipped to ``[1, n - 1]``), chosen uniformly at random from ``(seed, c)``,
  to the test side. Both sides read the base client lazily.
  """
  _check_fraction('test_fraction', test_fraction)
  return (_ExampleSplit(dataset, test_fraction, seed, test=False),
          _ExampleSplit(dataset, test_fraction, seed, test=True))


def eval_batches(examples: Mapping[str, Any], batch_size: int,
                 bucket: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """A central split as ``[S, B, ...]`` arrays plus an ``[S, B]`` mask.

  All ``n`` examples in order, ``S = ceil(n / B)`` (rounded up to a power of
  two if ``bucket``); the last batch is padded with zeros and mask False.
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f'batch_size={batch_size!r}; it must be an int >= 1.')
  n = num_rows(examples, where='eval_batches: examples')
  if n < 1:
    raise ValueError('eval_batches: examples is empty; nothing to evaluate.')
  steps = math.ceil(n / batch_size)
  if bucket:
    steps = bucket_steps(steps)
  return pad_batches(examples, np.arange(n), batch_size, steps)


def evaluate(fn: Callable[[Any, Mapping[str, jax.Array]], Any], params: Any,
             examples: Mapping[str, Any], batch_size: int = 256) -> Any:
  """Example-weighted means of ``fn(params, batch)`` over every held-out example.

  ``fn`` returns one value per example: an array ``[B]`` or a pytree of them
  (a model's ``metrics_fn``, ``{'accuracy': [B]}``, or its ``loss_fn``).
  The ``n`` examples are batched in order by :func:`eval_batches` with
  ``B = min(batch_size, n)``, the last batch padded and masked, and each
  leaf's result is the masked mean over the ``S`` batches

      mean(v) = sum_{s, b} m[s, b] v[s, b] / sum_{s, b} m[s, b]  (= sum_i v_i / n),

  padded rows contributing nothing (not even a NaN). The batches run in one
  compiled call (``lax.map``, float32 sums), compiled once per ``fn`` and
  shape. Returns ``fn``'s structure with Python floats::

    datasets.evaluate(model.metrics_fn, state.params, test)  # {'accuracy': 0.97}
    datasets.evaluate(model.eval_loss_fn, state.params, test)  # 0.11

  Raises ``ValueError`` for empty ``examples``, a ``batch_size`` that is not
  an int >= 1, or an output leaf that is not one value per example.
  """
  n = num_rows(examples, where='evaluate: examples')
  if n < 1:
    raise ValueError('evaluate: examples is empty; nothing to evaluate.')
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f'batch_size={batch_size!r}; it must be an int >= 1.')
  batches, mask = eval_batches(examples, min(batch_size, n))
  sums, count = jax.device_get(_masked_sums(fn, params, batches, mask))
  return jax.tree.map(lambda s: float(s) / float(count), sums)


@functools.partial(jax.jit, static_argnums=0)
def _masked_sums(fn, params, batches, mask):
  """``(sum over real examples of each leaf of fn, number of real examples)``."""
  def one(inputs):
    batch, m = inputs
    values = fn(params, batch)
    for path, v in jax.tree_util.tree_leaves_with_path(values):
      if jnp.shape(v) != m.shape:
        raise ValueError(
            f'evaluate: fn returned shape {tuple(jnp.shape(v))} at '
            f'{jax.tree_util.keystr(path) or "its output"}; it must return one '
            f'value per example, shape {tuple(m.shape)} for a batch of {m.shape[0]}.')
    return jax.tree.map(
        lambda v: jnp.sum(jnp.where(m, jnp.asarray(v, jnp.float32), 0.0)), values)
  sums = jax.lax.map(one, (batches, mask))
  return jax.tree.map(jnp.sum, sums), jnp.sum(mask, dtype=jnp.int32)


def eval_cohorts(dataset: FederatedDataset, cohort_size: int, batch_size: int,
                 *, max_steps: int | None = None, bucket: bool = True,
                 mesh: jax.sharding.Mesh | None = None,
                 place: bool = True) -> Iterator[Cohort]:
  """Every client once, in order, in cohorts of ``cohort_size`` (one epoch, unshuffled).

  The last cohort is filled up to ``cohort_size`` with empty clients: all-False
  mask, ``num_examples`` 0 and ``client_ids`` -1, so weighted means ignore them.
  """
  if isinstance(cohort_size, bool) or not isinstance(cohort_size, int) or cohort_size < 1:
    raise ValueError(f'cohort_size={cohort_size!r}; it must be an int >= 1.')
  ids = dataset.client_ids
  for start in range(0, len(ids), cohort_size):
    chunk = ids[start:start + cohort_size]
    cohort = make_cohort(dataset, chunk, batch_size, num_epochs=1,
                         max_steps=max_steps, shuffle_seed=None, bucket=bucket)
    missing = cohort_size - len(chunk)
    if missing:
      pad = lambda x, fill=0: np.concatenate(
          [x, np.full((missing,) + x.shape[1:], fill, dtype=x.dtype)])
      cohort = Cohort({k: pad(v) for k, v in cohort.batches.items()},
                      pad(cohort.mask, False), pad(cohort.num_examples),
                      pad(cohort.client_ids, -1))
    yield place_cohort(cohort, mesh) if place else cohort

