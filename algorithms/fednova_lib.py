"""FedNova: normalized averaging for clients that take different numbers of steps.

Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization", NeurIPS 2020. When client
``i`` takes ``tau_i`` local SGD steps, FedAvg's average update
``sum_i p_i Delta_i`` weights client ``i``'s gradients by ``p_i tau_i``: it
converges to a stationary point of the *surrogate* objective ``sum_i p_i
tau_i F_i / sum_j p_j tau_j``, not of ``F = sum_i p_i F_i`` (their Theorem
1). FedNova normalizes each update by its number of steps and rescales by an
effective step count (their eq. 6, with vanilla SGD's ``a_i = 1_{tau_i}``,
``||a_i||_1 = tau_i``):

    d_i      = Delta_i / tau_i                      (normalized update)
    tau_eff  = sum_i p_i tau_i                      (p_i = w_i / sum_j w_j)
    x       <- x - tau_eff sum_i p_i d_i            (server SGD, rate 1)

With any ``server_optimizer``, ``g = tau_eff sum_i p_i d_i`` is its
pseudo-gradient, as in FedOpt. ``tau_i`` counts the client's real local
steps (mask True), so partial work (later steps masked,
:mod:`fedjx.datasets.systems`) is normalized by the steps actually done.

The round is FedAvg's client work (:func:`fedjx.algorithms.client_update.
local_update`) with the normalization carried in the aggregation weights:
client ``i`` is averaged with weight ``w'_i = p_i tau_eff / tau_i``, so

    g = sum_i w'_i Delta_i / sum_i p_i = tau_eff sum_i p_i d_i,

computed as the weighted mean ``sum_i w'_i Delta_i / sum_i w'_i`` times
``sum_i w'_i / sum_i p_i``. With equal ``tau_i`` (and integer weights such
as example counts, whose float32 sums are exact) ``w'_i = p_i`` and the
factor is exactly 1, so the round *is* FedAvg's round, bit for bit.
Clients left out by the non-finite guard are left out of ``tau_eff`` too.

Only vanilla local SGD's normalization (``||a_i||_1 = tau_i``) is
implemented: with local momentum or a proximal term the paper's ``a_i``
differs, so FedNova here takes no ``client_transform``; a client optimizer
with momentum is normalized by its steps all the same.

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): its client weights ``w'_i`` are a
function of every client's step count, computed before the client map,
where the template weights clients by the aggregator or ``weighting``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators

def local_steps(mask: jax.Array, schedule: client_update.LocalSchedule) -> jax.Array:
  """``tau_i``, the real local steps one client takes (float32; its ``[S, B]``
  mask), as :func:`fedjx.algorithms.client_update.train` counts them."""
  real = jnp.any(mask, axis=-1)
  if schedule.steps is None:
    return schedule.epochs * jnp.sum(real, dtype=jnp.float32)
  return schedule.steps * jnp.any(real).astype(jnp.float32)


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
  """``num / den``, and 0 where ``den`` is 0."""
  nonzero = den != 0
  return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


TRAITS = kit.Traits(
    options=kit.options_but('client_transform', 'aggregator', 'client_metrics'),
    updates_reach_params=True, indexed_batches=True)
"""What FedNova declares: FedAvg's options but those its normalization does
not cover (:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def fednova(loss_fn: kit.LossFn, **options: Any) -> kit.Algorithm:
  """FedNova (Wang et al. 2020) with local SGD and any server optimizer.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    client_optimizer: local optimizer (default: SGD, learning rate 0.1).
    server_optimizer: applied to ``g = tau_eff sum_i p_i d_i`` (default: SGD,
      learning rate 1.0: the paper's update).
    **options: :func:`fedjx.algorithms.fedavg`'s but ``client_transform``,
      ``aggregator`` and ``client_metrics`` (``p_i`` are the
      ``weighting``'s weights, normalized).

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` (``state.hparams`` has
    ``client_optimizer`` and ``server_optimizer``). Metrics are FedAvg's plus
    ``tau_eff``.
  """
  name = 'fednova'
  o = kit.Options.of(name, options, TRAITS.options)
  client_optimizer, server_optimizer = o.client_optimizer, o.server_optimizer
  weighting, skip_nonfinite = o.weighting, o.skip_nonfinite
  schedule, metrics_fn = o.schedule, o.metrics_fn

  def init(params):
    return kit.ServerState(
        params=params, opt_state=server_optimizer.init(params),
        hparams={'client_optimizer': base.optimizer_hparams(client_optimizer, params),
                 'server_optimizer': base.optimizer_hparams(server_optimizer, params)},
        round_index=jnp.zeros((), jnp.int32))

  def client_fn(x, hparams, batches, mask):
    opt_state = kit.with_hparams(client_optimizer.init(x), hparams)
    out = client_update.local_update(loss_fn, metrics_fn, client_optimizer, x,
                           opt_state, batches, mask, schedule)
    return nonfinite.ClientOutput(base.tree_sub(x, out.params), out.stats,
                            checked=out.params)

  def normalized_weights(p, tau, tau_eff):
    return jnp.where(tau > 0, p * (tau_eff / jnp.where(tau > 0, tau, 1.0)), 0.0)

  def round_fn(state, cohort, key):
    del key
    p = base.aggregation_weights(cohort.num_examples, weighting)
    tau = fedjx.map_fn(lambda m: local_steps(m, schedule), cohort.mask)
    tau_all = _ratio(fedjx.reduce_sum(p * tau), fedjx.reduce_sum(p))
    w = fedjx.map_fn(normalized_weights, (p, tau, fedjx.broadcast(tau_all)))
    clients = nonfinite.map_clients(
        client_fn, (fedjx.broadcast(state.params),
                    fedjx.broadcast(state.hparams['client_optimizer']),
                    cohort.batches, cohort.mask),
        w, cohort.num_examples, skip_nonfinite)
    # The clients kept by the guard: sum_i p_i and tau_eff over them.
    p_kept = p if clients.skipped is None else p * (1.0 - clients.skipped)
    p_sum = fedjx.reduce_sum(p_kept)
    tau_eff = _ratio(fedjx.reduce_sum(p_kept * tau), p_sum)
    scale = (_ratio(fedjx.reduce_sum(clients.weights), p_sum)
             * _ratio(tau_eff, tau_all))
    pseudo_grad = jax.tree.map(lambda g: g * scale.astype(g.dtype),
                               nonfinite.weighted_mean(clients))
    params, opt_state = base.server_update(
        server_optimizer, state.opt_state, state.hparams['server_optimizer'],
        state.params, pseudo_grad)
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad), tau_eff=tau_eff)
    metrics['communicated_bytes'] = aggregators.upload_bytes(  # The full updates.
        aggregators.mean(), state.params, metrics['clients'], {})
    return state._replace(params=params, opt_state=opt_state,
                          round_index=state.round_index + 1), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)


__all__ = ['fednova', 'local_steps']
