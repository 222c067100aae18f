"""Deterministic random streams keyed by (purpose, seed, round, client).

Every random choice in ``fedjx.datasets`` draws from a generator built here, so
that a result depends only on the integers that name it: a cohort for round
``r`` is the same whether it is computed first, after a restart, or in a
background thread. The purpose tag keeps streams that share a seed independent
(sampling a cohort and shuffling a client never reuse the same numbers).

NumPy's ``SeedSequence`` treats ``[a, b]`` and ``[a, b, 0]`` as the same
entropy, so each purpose always uses the same number of keys.
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
