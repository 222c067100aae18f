"""FedExP: FedAvg with a server step size extrapolated from the updates' norms.

Jhunjhunwala, Wang, Joshi, "FedExP: Speeding Up Federated Averaging via
Extrapolation", ICLR 2023, Algorithm 1. FedAvg's average of the client
updates is a projection step of POCS (projection onto convex sets) when the
clients' optima intersect; Pierra's extrapolation of POCS steps further,
by the ratio of the mean squared update to the squared mean update. A
round on a cohort of ``M`` clients with normalized weights ``p_i = w_i /
sum_j w_j`` (the paper's ``p_i = 1/M``: ``weighting='uniform'``):

    client i:   y_i = ClientOpt^T(x; D_i),   Delta_i = x - y_i
    server:     Delta = sum_i p_i Delta_i
                eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps)))
                x <- x - eta_g Delta

With uniform weights the numerator is the paper's ``sum_i ||Delta_i||^2 /
(2M)``. ``eta_g >= 1``: FedExP never steps shorter than FedAvg; with one
client ``eta_g = 1`` (the ratio is 1/2) and the round is FedAvg's. The
updates are similar when the clients agree and the ratio is near 1/2, so
the step grows as they disagree (their mean cancels). ``eps`` (the paper's
``epsilon``, 1e-3 in most of its experiments) keeps the ratio finite when
the mean update vanishes; it is traced (``state.hparams['epsilon']``).

The paper evaluates the mean of the last two iterates, ``(x_t + x_{t-1}) /
2``, because extrapolated iterates oscillate around the optimum;
:func:`averaged_params` returns it from the state, which keeps ``x_{t-1}``.
The runner evaluates ``state.params``, the last iterate.

Aggregators: the mean update may be combined by any non-private
aggregator (quantized, robust); the numerator reads each client's exact
``||Delta_i||^2``. A DP aggregator is refused: ``eta_g`` is a second
statistic of the clients' updates that its noise does not cover (its
private form, DP-FedEXP, adds noise to the numerator too).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit

# What a round releases beside the aggregate (``Algorithm.unprivatized``).
UNPRIVATIZED = ('its server step size eta_g reads sum_i ||Delta_i||^2, the '
                'squared norms of the exact updates, which the noise does not '
                'cover (DP-FedEXP noises that sum too)')


class FedExPState(NamedTuple):
  """FedExP's server state.

  Attributes:
    params: the server model ``x_t``.
    previous_params: ``x_{t-1}`` (``x_0`` before the first round), for
      :func:`averaged_params`.
    hparams: ``client_optimizer`` and ``epsilon`` (and the client
      transform's and aggregator's) hyperparameters.
    round_index: rounds run so far.
    aggregator_state: the aggregator's state (``()`` when it has none).
  """

  params: kit.Params
  previous_params: kit.Params
  hparams: dict[str, Any]
  round_index: jax.Array
  aggregator_state: Any = ()


def averaged_params(state: FedExPState) -> kit.Params:
  """``(x_t + x_{t-1}) / 2``, the model the paper evaluates."""
  return jax.tree.map(lambda a, b: (a + b) / 2, state.params,
                      state.previous_params)


def step_size(mean_squared_norm: jax.Array, mean_update: kit.PyTree,
              epsilon: jax.Array) -> jax.Array:
  """``eta_g = max(1, mean_squared_norm / (2 (||mean_update||^2 + eps)))``."""
  sq = jnp.square(optax.tree.norm(mean_update)).astype(jnp.float32)
  return jnp.maximum(1.0, mean_squared_norm / (2.0 * (sq + epsilon)))


OPTIONS: dict[str, Any] = {**kit.without('server_optimizer', 'client_metrics'),
                           'epsilon': 1e-3}


@kit.with_options(OPTIONS)
def fedexp(loss_fn: kit.LossFn, **options: Any) -> kit.Algorithm:
  """FedExP (module docstring).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    epsilon: ``eps`` of the step size, ``> 0`` [1e-3] (traced).
    client_optimizer, local_epochs, local_steps, client_transform,
    metrics_fn, weighting, client_evaluation, skip_nonfinite: as
      :func:`~fedjx.algorithms.fedavg` (``weighting='uniform'`` is the
      paper's ``1/M``).
    aggregator: how the ``Delta_i`` are averaged; not a DP mechanism.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`FedExPState`. Metrics add ``server_step_size`` (``eta_g``) and
    ``mean_update_sq_norm`` (``sum_i p_i ||Delta_i||^2``).
  """
  name = 'fedexp'
  o = kit.take_options(name, options, OPTIONS)
  eps = o['epsilon']
  kit.check_number(name, 'epsilon', eps, strict=True)
  client_optimizer, _, aggregator, schedule = kit.check_parts(
      name, dict(o, server_optimizer=None, client_metrics=False))
  kit.check_private_uploads(name, aggregator, UNPRIVATIZED)
  transform = o['client_transform']
  weighting, guard = o['weighting'], o['skip_nonfinite']
  train = kit.client_training(loss_fn, o['metrics_fn'], client_optimizer,
                              transform, schedule)

  def init(params):
    transform_hparams = ({} if transform is None else
                         kit.optimizer_hparams(transform, params))
    return FedExPState(
        params=params, previous_params=params,
        hparams=kit.combine_hparams(
            name,
            algorithm={'client_optimizer': kit.optimizer_hparams(client_optimizer, params),
                       'epsilon': jnp.asarray(eps, jnp.float32)},
            client_transform=transform_hparams,
            aggregator=kit.aggregator_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def client_fn(x, hparams, batches, mask):
    out = train(x, hparams, batches, mask)
    delta = kit.tree_sub(x, out.params)
    sq = jnp.square(optax.tree.norm(delta)).astype(jnp.float32)
    return kit.ClientOutput(delta, out.stats, extra=sq, checked=out.params)

  def round_fn(state, cohort, key):
    x = state.params
    clients = kit.map_clients(
        aggregator, state.hparams, client_fn,
        (fedjx.broadcast(x), fedjx.broadcast(kit.client_hparams_of(state, transform)),
         cohort.batches, cohort.mask),
        cohort.num_examples, weighting, guard,
        aggregator_state=state.aggregator_state, client_ids=cohort.client_ids)
    delta, agg_state, agg_metrics = kit.aggregate(
        aggregator, state.aggregator_state, state.hparams, clients, key)
    total = fedjx.reduce_sum(clients.weights)
    mean_sq = fedjx.reduce_sum(clients.weights * clients.extra) / jnp.maximum(
        total, jnp.finfo(jnp.float32).tiny)
    eta = step_size(mean_sq, delta, state.hparams['epsilon'])
    params = jax.tree.map(lambda p, d: p - eta.astype(d.dtype) * d, x, delta)
    metrics = kit.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(delta), server_step_size=eta,
        mean_update_sq_norm=mean_sq, **agg_metrics)
    return state._replace(params=params, previous_params=x,
                          round_index=state.round_index + 1,
                          aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o,
                            unprivatized=UNPRIVATIZED)


__all__ = ['FedExPState', 'averaged_params', 'fedexp', 'step_size']
