"""Dataset builders for configs: each returns an :class:`ExperimentData`.

A builder wraps a loader of ``fedjx.datasets`` and says how its held-out data
is evaluated and what models need to know about it (``num_classes``,
``vocab_size``). The registry (:mod:`fedjx.experiments.registry`) maps config
names to these builders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fedjx import datasets


@dataclasses.dataclass
class ExperimentData:
  """What a dataset builder gives the runner.

  Attributes:
    train: the training population (a ``fedjx.datasets.FederatedDataset``).
    test: held-out data: a dict of arrays (a central split), a
      ``FederatedDataset`` (held-out clients, pooled for evaluation), or None.
    info: facts models may need (``num_classes``, ``vocab_size``, ...); the
      model builder receives those it takes, unless the config sets them.
  """

  train: Any
  test: Any = None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def digits(num_clients: int = 50, alpha: float | None = 0.5, seed: int = 0,
           test_fraction: float = 0.2) -> ExperimentData:
  """scikit-learn digits over ``num_clients`` clients (Dirichlet ``alpha``)."""
  train, test = datasets.load_digits(num_clients=num_clients, alpha=alpha,
                                     seed=seed, test_fraction=test_fraction)
  return ExperimentData(train, test, {'num_classes': 10})


BUILDERS: dict[str, Callable[..., ExperimentData]] = {
    'digits': digits,
}
