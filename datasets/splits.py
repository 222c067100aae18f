"""Per-client train / held-out splits, for evaluating personalized models.

A personalized model is trained (or fine-tuned) on a client's own data and
judged on that same client's unseen data, so each evaluated client needs two
parts with the same client id. :func:`client_splits` gives them:

* **natural splits** (``test`` given): the population's own per-client test
  data, e.g. TensorFlow Federated's ``*_train.h5`` and ``*_test.h5`` files of
  EMNIST or Shakespeare, whose clients share ids (names). Clients are matched
  by name; those present on both sides, in the training side's order, are
  kept, both sides renumbered ``0 .. K - 1`` alike.
* **a documented split** (``test`` None, partitioned data such as digits or
  Synthetic): client ``c`` with ``n >= 2`` examples keeps
  ``round(test_fraction * n)`` of them (clipped to ``[1, n - 1]``), drawn
  uniformly from ``(seed, c)``, on the held-out side
  (:func:`fedjx.datasets.split_examples`, the LEAF / FedProx split). A client
  with a single example has nothing to hold out and is left out of both.

Both are deterministic in their arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedjx.datasets.evaluation import split_examples
from fedjx.datasets.federated import FederatedDataset


class ClientSplits(NamedTuple):
  """Each kept client's training and held-out data, under the same id.

  Attributes:
    train: client ``k``'s training split.
    test: client ``k``'s held-out split.
    base_ids: ``int64 [K]``: client ``k``'s id in the population split.
  """

  train: FederatedDataset
  test: FederatedDataset
  base_ids: np.ndarray


def client_splits(population: FederatedDataset,
                  test: FederatedDataset | None = None, *,
                  test_fraction: float = 0.2, seed: int = 0) -> ClientSplits:
  """Per-client ``(train, test)`` splits of ``population`` (see the module doc).

  Args:
    population: the clients (their training data when ``test`` is given).
    test: per-client held-out data whose client names match
      ``population``'s, or None to split each client's examples.
    test_fraction: with ``test`` None, the held-out fraction, in (0, 1).
    seed: with ``test`` None, seeds each client's split.

  Returns:
    A :class:`ClientSplits`.
  """
  if test is not None:
    index = {test.client_name(c): c for c in range(test.num_clients)}
    names = [population.client_name(c) for c in range(population.num_clients)]
    ids = np.array([c for c, name in enumerate(names) if name in index], np.int64)
    if ids.size == 0:
      raise ValueError(
          f'client_splits: none of the {population.num_clients} training clients '
          f'(e.g. {names[0]!r}) is among the {test.num_clients} test clients '
          f'(e.g. {test.client_name(0)!r}); natural splits match clients by name.')
    test_ids = np.array([index[names[c]] for c in ids], np.int64)
    return ClientSplits(population.subset(ids), test.subset(test_ids), ids)
  ids = np.flatnonzero(population.examples_per_client() >= 2).astype(np.int64)
  if ids.size == 0:
    raise ValueError(f'client_splits: all {population.num_clients} clients hold '
                     'one example; a per-client split needs clients of 2 or more.')
  kept = population if ids.size == population.num_clients else population.subset(ids)
  train, held_out = split_examples(kept, test_fraction, seed)
  return ClientSplits(train, held_out, ids)
