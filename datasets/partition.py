"""Partitioners: which examples of a centralized dataset each client holds.

Each partitioner takes a per-example column (labels, or anything of the right
length when only the count matters) and returns a list of index arrays, one per
client, sorted ascending. Pass the result to ``from_arrays(arrays,
groups=...)`` or ``from_tfds(..., partition=...)``. All are deterministic
functions of their arguments and ``seed``.

* :func:`partition_iid`: a uniformly random split into near-equal clients.
* :func:`partition_dirichlet`: label skew, each client's label distribution
  drawn from a Dirichlet (Hsu, Qi and Brown 2019, "Measuring the Effects of
  Non-Identical Data Distribution for Federated Visual Classification").
* :func:`partition_quantity_skew`: IID labels, client sizes drawn from a
  lognormal or power law (as in LEAF, Caldas et al. 2018, and FedProx,
  Li et al. 2020).
* :func:`partition_by_feature`: natural groups, one client per distinct value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedjx.datasets import _seeding

_QUANTITY_DISTRIBUTIONS = ('lognormal', 'power_law')


def unique_groups(values: Any) -> tuple[np.ndarray, list[np.ndarray]]:
  """The distinct values of ``values`` (sorted) and each one's example indices."""
  values = np.asarray(values)
  if values.ndim != 1:
    values = values.reshape(values.shape[0], -1)
    if values.shape[1] != 1:
      raise ValueError(f'a grouping feature must hold one value per example; got '
                       f'shape {values.shape}.')
    values = values[:, 0]
  uniques, inverse = np.unique(values, return_inverse=True)
  order = np.argsort(inverse, kind='stable')
  bounds = np.searchsorted(inverse[order], np.arange(len(uniques) + 1))
  return uniques, [order[bounds[i]:bounds[i + 1]] for i in range(len(uniques))]


def _count(labels: Any) -> int:
  if isinstance(labels, (int, np.integer)):
    return int(labels)
  return int(np.shape(labels)[0])


def _check_clients(name: str, num_clients: Any, n: int, minimum: int = 1) -> int:
  if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) \
      or num_clients < 1:
    raise ValueError(f'{name}: num_clients={num_clients!r}; it must be an int >= 1.')
  if num_clients * minimum > n:
    raise ValueError(f'{name}: num_clients={num_clients} clients of at least '
                     f'{minimum} example(s) need {num_clients * minimum} examples;'
                     f' only {n} are given.')
  return int(num_clients)


def _even_sizes(n: int, num_clients: int) -> np.ndarray:
  sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
  sizes[:n % num_clients] += 1
  return sizes


def partition_iid(labels: Any, num_clients: int, seed: int = 0) -> list[np.ndarray]:
  """Splits ``n`` examples uniformly at random into ``num_clients`` clients.

  Sizes differ by at most one (the first ``n % num_clients`` clients get the
  extra example).

  Args:
    labels: a per-example array (only its length is used) or the count ``n``.
    num_clients: how many clients.
    seed: the random seed.
  """
  n = _count(labels)
  num_clients = _check_clients('partition_iid', num_clients, n)
  perm = _seeding.rng(_seeding.PARTITION, seed, 0).permutation(n)
  bounds = np.concatenate([[0], np.cumsum(_even_sizes(n, num_clients))])
  return [np.sort(perm[bounds[c]:bounds[c + 1]]) for c in range(num_clients)]


def partition_dirichlet(labels: Any, num_clients: int, alpha: float,
                        seed: int = 0,
                        client_sizes: Sequence[int] | np.ndarray | None = None
                        ) -> list[np.ndarray]:
  """Label-skewed clients: client ``k``'s class mix is ``q_k ~ Dir(alpha * p)``.

  Follows Hsu, Qi and Brown (2019): ``p`` is the dataset's class distribution
  and ``alpha > 0`` a concentration. As ``alpha -> inf`` every ``q_k -> p``
  (IID); as ``alpha -> 0`` each client holds a single class. With 10 balanced
  classes, ``alpha = 0.1`` gives mostly one or two classes per client and
  ``alpha = 100`` is close to IID.

  Clients are filled in turn. Client ``k`` draws its ``size_k`` class counts
  from ``Multinomial(size_k, q_k)`` over the examples not yet taken; when a
  class runs out, the shortfall is redrawn from ``q_k`` restricted to the
  classes that remain (uniformly if ``q_k`` puts no mass on them). Examples of
  a class are taken in a random order, without replacement.

  Args:
    labels: ``[n]`` class labels (any sortable values).
    num_clients: how many clients.
    alpha: the Dirichlet concentration, ``> 0``.
    seed: the random seed.
    client_sizes: examples per client (default: ``n`` split evenly), e.g. from
      :func:`quantity_skew_sizes` to combine label and quantity skew. Must sum
      to at most ``n``.

  Returns:
    ``num_clients`` sorted index arrays.
  """
  labels = np.asarray(labels).reshape(np.shape(labels)[0], -1)
  if labels.shape[1] != 1:
    raise ValueError('partition_dirichlet: labels must hold one class per example;'
                     f' got shape {np.shape(labels)}.')
  labels = labels[:, 0]
  n = labels.shape[0]
  num_clients = _check_clients('partition_dirichlet', num_clients, n)
  if not np.isfinite(alpha) or alpha <= 0:
    raise ValueError(f'partition_dirichlet: alpha={alpha!r}; it must be a finite '
                     'float > 0 (small: skewed labels; large: IID).')
  if client_sizes is None:
    sizes = _even_sizes(n, num_clients)
  else:
    sizes = np.asarray(client_sizes, dtype=np.int64).reshape(-1)
    if sizes.shape[0] != num_clients or sizes.min() < 1 or sizes.sum() > n:
      raise ValueError(
          f'partition_dirichlet: client_sizes (length {sizes.shape[0]}, sum '
          f'{sizes.sum()}, min {sizes.min() if sizes.size else None}) must give '
          f'{num_clients} sizes >= 1 summing to at most {n}.')
  classes, pools = unique_groups(labels)
  rng = _seeding.rng(_seeding.PARTITION, seed, 1)
  pools = [rng.permutation(pool) for pool in pools]
  prior = np.array([len(p) for p in pools], dtype=np.float64) / n
  remaining = np.array([len(p) for p in pools], dtype=np.int64)
  taken = np.zeros(len(classes), dtype=np.int64)
  out = []
  for k in range(num_clients):
    q = rng.dirichlet(alpha * prior)
    counts = np.zeros(len(classes), dtype=np.int64)
    need = int(sizes[k])
    while need > 0:
      available = remaining - counts
      weights = np.where(available > 0, q, 0.0)
      if weights.sum() <= 0:
        weights = (available > 0).astype(np.float64)
      draw = np.minimum(rng.multinomial(need, weights / weights.sum()), available)
      counts += draw
      need -= int(draw.sum())
    parts = [pools[c][taken[c]:taken[c] + counts[c]] for c in range(len(classes))]
    taken += counts
    remaining -= counts
    out.append(np.sort(np.concatenate(parts)))
  return out


def quantity_skew_sizes(n: int, num_clients: int, distribution: str = 'lognormal',
                        sigma: float = 1.0, exponent: float = 1.5, seed: int = 0,
                        min_examples: int = 1) -> np.ndarray:
  """Client sizes summing to ``n``, skewed by a lognormal or power law.

  Weights are ``w_k ~ LogNormal(0, sigma)`` or ``w_k ~ Pareto(exponent)``
  (``P(w > t) = t^-exponent`` for ``t >= 1``). Each client gets
  ``min_examples`` plus its share ``w_k / sum(w)`` of the rest, rounded by
  largest remainders so the sizes sum to exactly ``n``.
  """
  num_clients = _check_clients('quantity_skew_sizes', num_clients, n, min_examples)
  if distribution not in _QUANTITY_DISTRIBUTIONS:
    raise ValueError(f'quantity skew: distribution={distribution!r} is not one of '
                     f'{_QUANTITY_DISTRIBUTIONS}.')
  if min_examples < 1:
    raise ValueError(f'quantity skew: min_examples={min_examples}; it must be >= 1.')
  rng = _seeding.rng(_seeding.PARTITION, seed, 2)
  if distribution == 'lognormal':
    if not sigma > 0:
      raise ValueError(f'quantity skew: sigma={sigma!r}; it must be > 0.')
    weights = rng.lognormal(0.0, sigma, num_clients)
  else:
    if not exponent > 0:
      raise ValueError(f'quantity skew: exponent={exponent!r}; it must be > 0.')
    weights = rng.pareto(exponent, num_clients) + 1.0
  rest = n - num_clients * min_examples
  share = rest * weights / weights.sum()
  sizes = np.floor(share).astype(np.int64)
  leftover = rest - int(sizes.sum())
  sizes[np.argsort(-(share - sizes), kind='stable')[:leftover]] += 1
  return sizes + min_examples


def partition_quantity_skew(labels: Any, num_clients: int,
                            distribution: str = 'lognormal', sigma: float = 1.0,
                            exponent: float = 1.5, seed: int = 0,
                            min_examples: int = 1) -> list[np.ndarray]:
  """IID examples in clients whose sizes follow :func:`quantity_skew_sizes`.

  Args:
    labels: a per-example array (only its length is used) or the count ``n``.
    num_clients: how many clients.
    distribution: ``'lognormal'`` (spread ``sigma``) or ``'power_law'`` (tail
      ``exponent``; smaller is more skewed).
    sigma: lognormal standard deviation of the log-weights.
    exponent: Pareto tail exponent.
    seed: the random seed.
    min_examples: every client's minimum size.
  """
  n = _count(labels)
  sizes = quantity_skew_sizes(n, num_clients, distribution, sigma, exponent, seed,
                              min_examples)
  perm = _seeding.rng(_seeding.PARTITION, seed, 3).permutation(n)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  return [np.sort(perm[bounds[c]:bounds[c + 1]]) for c in range(len(sizes))]


def partition_by_feature(values: Any) -> list[np.ndarray]:
  """Natural groups: one client per distinct value of ``values`` (sorted)."""
  return unique_groups(values)[1]
