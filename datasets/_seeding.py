"""Deterministic random streams keyed by (purpose, seed, round, client).

Every random choice in ``fedjx.datasets`` draws from a generator built here, so
that a result depends only on the integers that name it: a cohort for round
``r`` is the same whether it is computed first, after a restart, or in a
background thread. The purpose tag keeps streams that share a seed independent
(sampling a cohort and shuffling a client never reuse the same numbers).

NumPy's ``SeedSequence`` treats ``[a, b]`` and ``[a, b, 0]`` as the same
entropy, so each purpose always uses the same number of keys. Shuffles of
a cohort's clients draw from :func:`hashed` instead: one hash per example
slot, vectorized over the cohort, where a generator per client cost more
host time than a small client's round.
"""

from __future__ import annotations

import numpy as np

# Purpose tags: one per kind of random choice.
COHORT = 1
SHUFFLE = 2
PARTITION = 3
SPLIT = 4
SYNTHETIC_SIZES = 5
SYNTHETIC_CLIENT = 6
SYNTHETIC_GLOBAL = 7
SUMMARY = 8
EPOCH = 9  # shuffled-epoch cohorts (fedjx.datasets.sampling)
POISON = 10  # poisoned examples of malicious clients (fedjx.datasets.poisoning)


def rng(purpose: int, *keys: int) -> np.random.Generator:
  """A generator seeded from ``(purpose, *keys)``; keys must be ints >= 0."""
  entropy = [int(purpose)]
  for k in keys:
    k = int(k)
    if k < 0:
      raise ValueError(f'seed keys must be non-negative ints; got {k}.')
    entropy.append(k)
  return np.random.default_rng(np.random.SeedSequence(entropy))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer (Steele, Lea and Flood 2014): a bijection of
  uint64 whose every output bit depends on every input bit."""
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def hashed(purpose: int, *keys: int | np.ndarray) -> np.ndarray:
  """Uniform ``uint64`` values, one per entry of the broadcast ``keys``
  (ints or int arrays, all >= 0), each a hash of ``(purpose, *keys)``
  alone: a counter-based stream, so many streams (a cohort's clients, their
  examples) are drawn in one vectorized pass, and an entry does not depend on
  which others are drawn with it."""
  arrays = [np.asarray(k) for k in keys]
  for a in arrays:
    if a.size and (not np.issubdtype(a.dtype, np.integer) or a.min() < 0):
      raise ValueError(f'hash keys must be non-negative ints; got {a.min()!r}.')
  with np.errstate(over='ignore'):
    h = _mix(np.full((), purpose, np.uint64) + _GOLDEN)
    for a in arrays:
      h = _mix(h ^ _mix(a.astype(np.uint64) + _GOLDEN))
  return h
