"""FedProx: FedAvg whose clients minimise a proximal local objective.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020,
Algorithm 2. Client ``i`` starts from the server model ``x`` and approximately
minimises

    h_i(y; x) = F_i(y) + (mu / 2) ||y - x||^2,

so each local step uses the gradient ``grad F_i(y) + mu (y - x)``. The server
then averages as FedAvg does (``w_i = n_i`` by default; with a server
optimizer as in FedOpt). ``mu = 0`` is FedAvg. Reported train losses are of
``F_i``, without the proximal term.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import base
from fedjx.algorithms import client_update
from fedjx.algorithms import nonfinite


def fedprox(loss_fn: base.LossFn, *, mu: float = 0.01,
            client_optimizer: optax.GradientTransformation | None = None,
            server_optimizer: optax.GradientTransformation | None = None,
            metrics_fn: base.MetricsFn | None = None,
            local_epochs: int = 1, local_steps: int | None = None,
            weighting: str = 'num_examples', map_strategy: str = 'auto',
            chunk_size: int | None = None,
            client_evaluation: bool = True,
            skip_nonfinite: bool = True) -> base.Algorithm:
  """FedProx with proximal coefficient ``mu`` (``state.hparams['mu']``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    mu: the proximal coefficient, >= 0.
    client_optimizer, server_optimizer, metrics_fn, local_epochs, local_steps,
    weighting, map_strategy, chunk_size, client_evaluation, skip_nonfinite:
      as for :func:`fedavg`.
  """
  name = 'fedprox'
  base.check_number(name, 'mu', mu)
  client_optimizer = client_optimizer or base.default_sgd(0.1)
  server_optimizer = server_optimizer or base.default_sgd(1.0)
  base.check_optimizer(name, 'client_optimizer', client_optimizer)
  base.check_optimizer(name, 'server_optimizer', server_optimizer)
  base.check_choice(name, 'weighting', weighting, base.WEIGHTINGS)
  nonfinite.check_flag(name, skip_nonfinite)
  schedule = client_update.check_schedule(name, local_epochs, local_steps,
                                          client_evaluation)

  def init(params):
    return base.ServerState(
        params=params, opt_state=server_optimizer.init(params),
        hparams={'client_optimizer': base.optimizer_hparams(client_optimizer, params),
                 'server_optimizer': base.optimizer_hparams(server_optimizer, params),
                 'mu': jnp.asarray(mu, jnp.float32)},
        round_index=jnp.zeros((), jnp.int32))

  def client_fn(x, hparams, mu, batches, mask):
    def proximal(grads, y):  # grad of (mu / 2) ||y - x||^2 added to grad F_i.
      return jax.tree.map(lambda g, y, x: g + mu * (y - x), grads, y, x)

    opt_state = base.with_hparams(client_optimizer.init(x), hparams)
    out = client_update.local_update(loss_fn, metrics_fn, client_optimizer, x,
                                     opt_state, batches, mask, schedule,
                                     correction=proximal)
    return nonfinite.ClientOutput(base.tree_sub(x, out.params), out.stats,
                                  checked=out.params)

  def round_fn(state, cohort, key):
    del key
    clients = nonfinite.map_clients(client_fn, (
        fedjx.broadcast(state.params),
        fedjx.broadcast(state.hparams['client_optimizer']),
        fedjx.broadcast(state.hparams['mu']),
        cohort.batches, cohort.mask),
        base.aggregation_weights(cohort.num_examples, weighting),
        cohort.num_examples, skip_nonfinite)
    pseudo_grad = nonfinite.weighted_mean(clients)
    params, opt_state = base.server_update(
        server_optimizer, state.opt_state, state.hparams['server_optimizer'],
        state.params, pseudo_grad)
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad))
    return state._replace(params=params, opt_state=opt_state,
                          round_index=state.round_index + 1), metrics

  return base.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                             metrics_fn=metrics_fn, map_strategy=map_strategy,
                             chunk_size=chunk_size)
