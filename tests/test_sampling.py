"""Samplers for private training: Poisson and shuffled epochs (fedjx.datasets.sampling)."""

import math

import numpy as np
import pytest

from fedjx import datasets
from fedjx.datasets import sampling


def test_poisson_is_a_function_of_seed_and_round():
  a = datasets.PoissonSampler(300, 0.1, seed=4)
  b = datasets.PoissonSampler(300, 0.1, seed=4)
  for r in (0, 7, 7, 123):
    np.testing.assert_array_equal(a.sample(r), b.sample(r))
  assert not np.array_equal(a.sample(0), a.sample(1))
  assert not np.array_equal(a.sample(0), datasets.PoissonSampler(300, 0.1, 5).sample(0))
  ids = a.sample(3)
  assert ids.dtype == np.int32 and np.all(np.diff(ids) > 0)
  assert ids.min() >= 0 and ids.max() < 300


def test_poisson_sizes_and_inclusion_match_the_binomial():
  # R rounds of N clients with rate q: the mean cohort size has standard
  # error sqrt(N q (1 - q) / R) and each client's count is Binomial(R, q);
  # the bounds are 6 standard deviations (false failure < 1e-8 per check,
  # < 1e-5 over the N clients by the union bound).
  n, q, rounds = 400, 0.05, 1500
  s = datasets.PoissonSampler(n, q, seed=0)
  draws = [s.sample(r) for r in range(rounds)]
  sizes = np.array([len(d) for d in draws])
  assert abs(sizes.mean() - n * q) < 6 * math.sqrt(n * q * (1 - q) / rounds)
  var = n * q * (1 - q)  # sample variance: relative sd sqrt(2 / R)
  assert abs(sizes.var(ddof=1) / var - 1) < 6 * math.sqrt(2 / rounds)
  counts = np.bincount(np.concatenate(draws), minlength=n)
  assert np.all(np.abs(counts - rounds * q) < 6 * math.sqrt(rounds * q * (1 - q)))
  assert sizes.max() <= s.cohort_size
  assert s.expected_cohort_size == pytest.approx(n * q, rel=1e-12)


def test_poisson_bucket_is_mean_plus_six_sigma_and_overflow_is_an_error():
  assert sampling.poisson_bucket(1000, 0.01) == math.ceil(10 + 6 * math.sqrt(9.9))
  assert sampling.poisson_bucket(10, 0.9) == 10  # at most N
  assert datasets.PoissonSampler(1000, 0.01).cohort_size == sampling.poisson_bucket(1000, 0.01)
  small = datasets.PoissonSampler(100, 0.5, seed=0, cohort_size=10)
  with pytest.raises(ValueError, match=r'round 0 drew \d+ clients, more than the '
                     r'bucket cohort_size=10; truncating') as e:
    small.sample(0)
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match=r'rate=1.5; it must be a number in \(0, 1\]'):
    datasets.PoissonSampler(100, 1.5)
  with pytest.raises(ValueError, match=r'cohort_size=0; it must be an int in \[1, 100\]'):
    datasets.PoissonSampler(100, 0.1, cohort_size=0)


def test_poisson_cohorts_are_padded_to_the_bucket():
  data, _ = datasets.load_digits(num_clients=40, seed=0)
  s = datasets.PoissonSampler(data, 0.1, seed=1, cohort_size=12)
  cohort = datasets.cohort_for_round(data, s, 2, batch_size=8, num_steps=1)
  real = s.sample(2)
  assert cohort.shape[0] == 12
  np.testing.assert_array_equal(cohort.client_ids[:len(real)], real)
  assert np.all(cohort.client_ids[len(real):] == datasets.PADDING_CLIENT)
  assert np.all(cohort.num_examples[len(real):] == 0)


def test_epochs_bound_participation_to_once_per_epoch():
  n, c = 103, 10  # E = 10 rounds per epoch; 3 clients sit each epoch out
  s = datasets.EpochSampler(n, c, seed=2)
  assert s.rounds_per_epoch == 10
  for epoch in range(3):
    rounds = [s.sample(epoch * 10 + j) for j in range(10)]
    assert all(len(ids) == c and np.all(np.diff(ids) > 0) for ids in rounds)
    ids = np.concatenate(rounds)
    assert len(np.unique(ids)) == 100  # disjoint cohorts within an epoch
  assert not np.array_equal(s.sample(0), s.sample(10))  # a fresh permutation
  np.testing.assert_array_equal(s.sample(17), datasets.EpochSampler(n, c, 2).sample(17))
  counts = np.bincount(np.concatenate([s.sample(r) for r in range(25)]), minlength=n)
  assert counts.max() <= s.max_participations(25) == 3
  with pytest.raises(ValueError, match=r'cohort_size=200; it must be an int in \[1, 103\]'):
    datasets.EpochSampler(n, 200)
