"""Samplers for private training: who takes part in each round, as accounted.

A differential-privacy guarantee holds for the sampling the accountant
assumes, so the simulation must draw cohorts exactly that way. Each sampler
here is a :class:`fedjx.datasets.Sampler`: ``sample(r)`` is a deterministic
function of ``(seed, r)`` (a resumed run sees the same cohorts) and returns
at most ``cohort_size`` sorted int32 ids; :func:`cohort_iterator` fills the
rest of the cohort with padding clients (weight 0), so shapes stay fixed.

* :class:`CohortSampler` (``fedjx.datasets.cohort``): ``C`` of the ``N``
  clients uniformly without replacement, every round independently
  (``dp_accounting.SampledWithoutReplacementDpEvent``, replace-one
  neighbours; the RDP accountant of Wang, Balle, Kasiviswanathan 2019).
* :class:`PoissonSampler`: every client independently with probability
  ``q`` (``dp_accounting.PoissonSampledDpEvent``, add/remove-one
  neighbours; Abadi et al. 2016, Mironov, Talwar, Zhang 2019). The cohort
  has a random size, ``Binomial(N, q)``; it is padded to a fixed bucket.
* :class:`EpochSampler`: shuffled epochs; each epoch a fresh random
  permutation of the clients cut into cohorts of ``C``, so a client takes
  part at most once per epoch. This is the participation bound DP-FTRL's
  tree aggregation needs (Kairouz et al. 2021, with trees restarted at
  epoch boundaries); no amplification by sampling or shuffling is claimed.

A Poisson draw larger than the bucket is an error, never a truncation:
dropping sampled clients would change the mechanism (it would no longer be
the Poisson subsampled Gaussian that is accounted). The default bucket,
``qN + 6 sqrt(N q (1 - q))`` rounded up, is exceeded with probability below
``1e-8`` per round (Chernoff); ``max_cohort_size`` sets another.
"""

from __future__ import annotations

import math

import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets.cohort import CohortSampler
from fedjx.datasets.federated import FederatedDataset

# Standard deviations of Binomial(N, q) above its mean in the default bucket.
BUCKET_STDDEVS = 6.0

__all__ = ['BUCKET_STDDEVS', 'CohortSampler', 'EpochSampler', 'PoissonSampler',
           'poisson_bucket']


def _num_clients(population: FederatedDataset | int) -> int:
  n = (population.num_clients if isinstance(population, FederatedDataset)
       else population)
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f'population={repr(population)[:60]}; it must be a '
                     'FederatedDataset or an int >= 1 (the number of clients).')
  return int(n)


def poisson_bucket(population: int, rate: float,
                   stddevs: float = BUCKET_STDDEVS) -> int:
  """``ceil(qN + k sqrt(N q (1 - q)))``, at least 1 and at most ``N``."""
  mean = population * rate
  std = math.sqrt(population * rate * (1.0 - rate))
  return int(min(population, max(1, math.ceil(mean + stddevs * std))))


class PoissonSampler:
  """Each client takes part in round ``r`` independently with probability ``q``.

  Args:
    population: a :class:`FederatedDataset` or its number of clients ``N``.
    rate: ``q`` in ``(0, 1]``.
    seed: the random seed (also seeds the clients' example shuffles).
    cohort_size: the bucket, the cohort's fixed size that padding clients
      fill; default :func:`poisson_bucket` (``qN`` plus six standard
      deviations). A round that draws more clients raises ``ValueError``.

  Attributes:
    expected_cohort_size: ``qN``, the fixed denominator DP-FedAvg divides by.
  """

  def __init__(self, population: FederatedDataset | int, rate: float,
               seed: int = 0, cohort_size: int | None = None):
    self.num_clients = _num_clients(population)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) \
        or not 0.0 < rate <= 1.0:
      raise ValueError(f'PoissonSampler: rate={rate!r}; it must be a number '
                       'in (0, 1] (the probability a client takes part).')
    self.rate = float(rate)
    if cohort_size is None:
      cohort_size = poisson_bucket(self.num_clients, self.rate)
    if isinstance(cohort_size, bool) or not isinstance(
        cohort_size, (int, np.integer)) or not 1 <= cohort_size <= self.num_clients:
      raise ValueError(f'PoissonSampler: cohort_size={cohort_size!r}; it must '
                       f'be an int in [1, {self.num_clients}] (the bucket).')
    self.cohort_size = int(cohort_size)
    self.seed = int(seed)

  @property
  def expected_cohort_size(self) -> float:
    return self.rate * self.num_clients

  def sample(self, round_num: int) -> np.ndarray:
    """``int32 [k]``, ``k ~ Binomial(N, q)``: the sorted ids of round ``round_num``."""
    if round_num < 0:
      raise ValueError(f'round_num={round_num}; rounds are numbered from 0.')
    gen = _seeding.rng(_seeding.COHORT, self.seed, round_num)
    ids = np.flatnonzero(gen.random(self.num_clients) < self.rate)
    if ids.size > self.cohort_size:
      raise ValueError(
          f'PoissonSampler: round {round_num} drew {ids.size} clients, more '
          f'than the bucket cohort_size={self.cohort_size}; truncating would '
          'break the Poisson accounting, so rerun with a larger bucket '
          "(config.sampling['max_cohort_size']).")
    return ids.astype(np.int32)


class EpochSampler:
  """Shuffled epochs: each client takes part at most once per epoch.

  Epoch ``e`` covers rounds ``[e E, (e + 1) E)`` with ``E = N // C``
  (:attr:`rounds_per_epoch`); it is a permutation of the ``N`` clients drawn
  from ``(seed, e)``, of which round ``e E + j`` takes positions
  ``[j C, (j + 1) C)``. The ``N - E C`` clients at the end of the
  permutation sit that epoch out. Over ``R`` rounds a client takes part at
  most ``ceil(R / E)`` times (:meth:`max_participations`), at most once in
  any window of rounds inside one epoch.

  Args:
    population: a :class:`FederatedDataset` or its number of clients ``N``.
    cohort_size: ``C``, clients per round, ``1 <= C <= N``.
    seed: the random seed.
  """

  def __init__(self, population: FederatedDataset | int, cohort_size: int,
               seed: int = 0):
    self.num_clients = _num_clients(population)
    if isinstance(cohort_size, bool) or not isinstance(
        cohort_size, (int, np.integer)) or not 1 <= cohort_size <= self.num_clients:
      raise ValueError(f'EpochSampler: cohort_size={cohort_size!r}; it must '
                       f'be an int in [1, {self.num_clients}] (the number of '
                       'clients).')
    self.cohort_size = int(cohort_size)
    self.seed = int(seed)

  @property
  def rounds_per_epoch(self) -> int:
    return self.num_clients // self.cohort_size

  def max_participations(self, rounds: int) -> int:
    """The most rounds among the first ``rounds`` that one client takes part in."""
    return -(-int(rounds) // self.rounds_per_epoch)

  def sample(self, round_num: int) -> np.ndarray:
    """``int32 [C]``: the sorted client ids of round ``round_num``."""
    if round_num < 0:
      raise ValueError(f'round_num={round_num}; rounds are numbered from 0.')
    epoch, j = divmod(int(round_num), self.rounds_per_epoch)
    perm = _seeding.rng(_seeding.EPOCH, self.seed, epoch).permutation(
        self.num_clients)
    ids = perm[j * self.cohort_size:(j + 1) * self.cohort_size]
    return np.sort(ids).astype(np.int32)
