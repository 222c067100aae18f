"""FedProx: FedAvg whose clients minimise a proximal local objective.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020,
Algorithm 2. Client ``i`` starts from the server model ``x`` and approximately
minimises

    h_i(y; x) = F_i(y) + (mu / 2) ||y - x||^2,

so each local step uses the gradient ``grad F_i(y) + mu (y - x)``. The server
then averages as FedAvg does (``w_i = n_i`` by default; with a server
optimizer as in FedOpt). ``mu = 0`` is FedAvg. Reported train losses are of
``F_i``, without the proximal term.

FedProx is FedAvg whose client optimizer is chained after the proximal
transformation :func:`fedjx.algorithms.client_transforms.proximal`, anchored
at the model the client received.
"""

from __future__ import annotations

import optax

from fedjx.algorithms import aggregators
from fedjx.algorithms import base
from fedjx.algorithms import client_transforms
from fedjx.algorithms.fedavg import build as fedavg_build


def fedprox(loss_fn: base.LossFn, *, mu: float = 0.01,
            client_optimizer: optax.GradientTransformation | None = None,
            server_optimizer: optax.GradientTransformation | None = None,
            metrics_fn: base.MetricsFn | None = None,
            local_epochs: int = 1, local_steps: int | None = None,
            weighting: str = 'num_examples',
            aggregator: aggregators.Aggregator | None = None,
            client_evaluation: bool = True,
            skip_nonfinite: bool = True,
            client_metrics: bool = False,
            map_strategy: str | None = None,
            chunk_size: int | None = None) -> base.Algorithm:
  """FedProx with proximal coefficient ``mu`` (``state.hparams['mu']``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    mu: the proximal coefficient, >= 0.
    client_optimizer, server_optimizer, metrics_fn, local_epochs, local_steps,
    weighting, aggregator, client_evaluation, skip_nonfinite, client_metrics,
    map_strategy, chunk_size: as for :func:`~fedjx.algorithms.fedavg`.
  """
  name = 'fedprox'
  base.check_number(name, 'mu', mu)
  return fedavg_build(
      name, loss_fn, client_optimizer=client_optimizer,
      server_optimizer=server_optimizer, metrics_fn=metrics_fn,
      local_epochs=local_epochs, local_steps=local_steps, weighting=weighting,
      client_transform=optax.inject_hyperparams(client_transforms.proximal)(mu=mu),
      aggregator=aggregator, client_evaluation=client_evaluation,
      skip_nonfinite=skip_nonfinite, map_strategy=map_strategy,
      chunk_size=chunk_size, client_metrics=client_metrics)
