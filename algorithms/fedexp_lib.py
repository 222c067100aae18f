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

The round is the template's (:func:`fedjx.algorithms.kit.algorithm`): the
client hook adds ``||Delta_i||^2`` to FedAvg's update, the server hook
takes the extrapolated step itself (no server optimizer) and keeps
``x_{t-1}`` in ``state.extras``.

Aggregators: the mean update may be combined by any non-private
aggregator (quantized, robust); the numerator reads each client's exact
``||Delta_i||^2``. A DP aggregator is refused: ``eta_g`` is a second
statistic of the clients' updates that its noise does not cover (its
private form, DP-FedEXP, adds noise to the numerator too).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit

# What a round releases beside the aggregate (``Traits.unprivatized``).
UNPRIVATIZED = ('its server step size eta_g reads sum_i ||Delta_i||^2, the '
                'squared norms of the exact updates, which the noise does not '
                'cover (DP-FedEXP noises that sum too)')

TRAITS = kit.Traits(options=kit.options_but('server_optimizer', 'client_metrics'),
                    updates_reach_params=True, unprivatized=UNPRIVATIZED)
"""What FedExP declares: FedAvg's options but the server optimizer (its step
is its own) and per-client metrics; what its round releases beside the
aggregate (:class:`~fedjx.algorithms.traits.Traits`)."""


def averaged_params(state: kit.ServerState) -> kit.Params:
  """``(x_t + x_{t-1}) / 2``, the model the paper evaluates."""
  return jax.tree.map(lambda a, b: (a + b) / 2, state.params, state.extras)


def step_size(mean_squared_norm: jax.Array, mean_update: kit.PyTree,
              epsilon: jax.Array) -> jax.Array:
  """``eta_g = max(1, mean_squared_norm / (2 (||mean_update||^2 + eps)))``."""
  sq = jnp.square(optax.tree.norm(mean_update)).astype(jnp.float32)
  return jnp.maximum(1.0, mean_squared_norm / (2.0 * (sq + epsilon)))


@kit.declare(TRAITS)
def fedexp(loss_fn: kit.LossFn, *, epsilon: float = 1e-3,
           **options: Any) -> kit.Algorithm:
  """FedExP (module docstring).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    epsilon: ``eps`` of the step size, ``> 0`` [1e-3] (traced).
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``server_optimizer``
      and ``client_metrics`` (``weighting='uniform'`` is the paper's
      ``1/M``); ``aggregator`` averages the ``Delta_i``, not a DP mechanism.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` is ``x_{t-1}``
    (``x_0`` before the first round; :func:`averaged_params`). Metrics add
    ``server_step_size`` (``eta_g``) and ``mean_update_sq_norm`` (``sum_i p_i
    ||Delta_i||^2``).
  """
  name = 'fedexp'
  kit.check_number(name, 'epsilon', epsilon, strict=True)
  o = kit.Options.of(name, options, TRAITS.options)
  kit.check_private_uploads(name, o.aggregator, UNPRIVATIZED)

  def client(c):  # FedAvg's client, and ||Delta_i||^2.
    trained = c.train()
    delta = optax.tree.sub(c.x, trained.params)
    sq = jnp.square(optax.tree.norm(delta)).astype(jnp.float32)
    return kit.Upload(delta, trained, extra=sq)

  def server(s):  # x <- x - eta_g Delta
    x, delta, w = s.state.params, s.aggregate, s.clients.weights
    total = fedjx.reduce_sum(w)
    mean_sq = fedjx.reduce_sum(w * s.clients.extra) / jnp.maximum(
        total, jnp.finfo(jnp.float32).tiny)
    eta = step_size(mean_sq, delta, s.state.hparams['epsilon'])
    params = jax.tree.map(lambda p, d: p - eta.astype(d.dtype) * d, x, delta)
    return kit.Step(delta, extras=x, params=params,
                    metrics={'server_step_size': eta,
                             'mean_update_sq_norm': mean_sq})

  return kit.algorithm(name, loss_fn, o, client=client, server=server,
                       hparams={'epsilon': epsilon},
                       extras=lambda params: params, traits=TRAITS)


__all__ = ['averaged_params', 'fedexp', 'step_size']
