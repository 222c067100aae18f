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
transformation :func:`fedjx.algorithms.transforms.proximal`, anchored
at the model the client received.
"""

from __future__ import annotations

from typing import Any

import optax

from fedjx.algorithms import kit
from fedjx.algorithms import fedavg_lib
from fedjx.algorithms.transforms import core as transforms

TRAITS = fedavg_lib.TRAITS._replace(options=kit.options_but('client_transform'))
"""FedAvg's traits; every option but the client transform, which FedProx sets."""


@kit.declare(TRAITS)
def fedprox(loss_fn: kit.LossFn, *, mu: float = 0.01,
            **options: Any) -> kit.Algorithm:
  """FedProx with proximal coefficient ``mu`` (``state.hparams['mu']``).

  ``fedavg(client_transform=optax.inject_hyperparams(proximal)(mu=mu))``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    mu: the proximal coefficient, >= 0.
    **options: those of :func:`~fedjx.algorithms.fedavg` but
      ``client_transform`` (``client_optimizer``, ``server_optimizer``,
      ``local_epochs``, ``local_steps``, ``weighting``, ``aggregator``, ...).
  """
  name = 'fedprox'
  kit.check_number(name, 'mu', mu)
  proximal = optax.inject_hyperparams(transforms.proximal)(mu=mu)
  return kit.algorithm(name, loss_fn, kit.Options.of(
      name, options, TRAITS.options, client_transform=proximal), traits=TRAITS)
