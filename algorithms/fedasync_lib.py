"""FedAsync: asynchronous federated optimization, one update at a time.

Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", arXiv 1903.03934
(2019), Algorithm 1. Workers train on the model version they received; the
server mixes each arriving model in at once:

    worker:  receives x_tau;  y = x_tau after H local SGD steps on
             g_{x_tau}(y; z) = f(y; z) + (rho / 2) ||y - x_tau||^2
    server (update t, holding x_t, receiving y trained from x_tau):
             alpha_t = alpha s(t - tau)
             x_{t+1} = (1 - alpha_t) x_t + alpha_t y

with the paper's staleness functions

    constant     s = 1
    polynomial   s_a(tau) = (tau + 1)^-a
    hinge        s_{a,b}(tau) = 1 if tau <= b, else 1 / (a (tau - b) + 1)

Here ``tau`` counts the server updates since the client's version (0 for
the freshest update, so ``alpha_t = alpha`` then), as FedBuff's staleness
does; in Algorithm 1's indexing the freshest update has ``t - tau = 1``.

The simulation is FedBuff's (:mod:`fedjx.algorithms.fedbuff_lib`,
:mod:`fedjx.datasets.async_schedule`) with a buffer of one: each round is one
arrival, an :class:`~fedjx.algorithms.AsyncCohort` of one client with its
staleness, so ``config.cohort_size = 1`` and ``config.algorithm.concurrency``
clients train at once. The server keeps FedBuff's ring of the last
``max_staleness + 1`` versions (staler arrivals are dropped: ``x`` is kept).
The mixing is written as a step on the client's message

    Delta = s(tau) (x_t - y),     x_{t+1} = x_t - alpha Delta,

which the client computes from ``x_t`` and its model (the same ``x_{t+1}``);
an aggregator acts on ``Delta`` (the mean of one update is the update; a DP
aggregator clips and noises it: ``x_t`` is the server's own state).

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): it is asynchronous (an
:class:`~fedjx.algorithms.fedbuff_lib.AsyncCohort` of one arrival, trained
from a stale version) and mixes the arrival in without a server optimizer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import template
from fedjx.algorithms import nonfinite
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.transforms import core as transforms
from fedjx.algorithms.fedbuff_lib import STALENESS_FUNCTIONS
from fedjx.algorithms.fedbuff_lib import async_metrics
from fedjx.algorithms.fedbuff_lib import check_async_cohort
from fedjx.algorithms.fedbuff_lib import check_staleness_options
from fedjx.algorithms.fedbuff_lib import in_ring
from fedjx.algorithms.fedbuff_lib import kept
from fedjx.algorithms.fedbuff_lib import ring_init
from fedjx.algorithms.fedbuff_lib import ring_push
from fedjx.algorithms.fedbuff_lib import ring_read
from fedjx.algorithms.fedbuff_lib import staleness_scale

TRAITS = kit.Traits(options=kit.options_but('server_optimizer', 'client_transform'),
                    asynchronous=True, updates_reach_params=True)
"""What FedAsync declares: FedAvg's options but the server optimizer (its
mixing is its own) and the client transform (``rho``'s); rounds from a
simulated schedule, each arrival mixed in at once
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def fedasync(loss_fn: kit.LossFn, *, alpha: float = 0.6, rho: float = 0.0,
             max_staleness: int = 16, staleness_weighting: str = 'polynomial',
             staleness_exponent: float = 0.5, staleness_hinge: float = 4.0,
             concurrency: int | None = None, client_durations: Any = None,
             **options: Any) -> kit.Algorithm:
  """FedAsync (Xie et al. 2019): each arriving model mixed in at once.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    alpha: the mixing weight ``alpha`` in ``(0, 1]`` [0.6]
      (``state.hparams['alpha']``).
    rho: the proximal coefficient of the local objective [0: plain local
      SGD]; ``rho > 0`` chains :func:`fedjx.algorithms.transforms.proximal` (its
      ``state.hparams['mu']``) before the client optimizer.
    max_staleness: versions kept are ``max_staleness + 1``; staler updates
      are dropped and counted in ``stale_dropped``.
    staleness_weighting: ``'polynomial'`` (default), ``'constant'`` or
      ``'hinge'``.
    staleness_exponent: ``a`` of the polynomial (exponent) and of the hinge
      (slope) [0.5].
    staleness_hinge: ``b``, the staleness up to which the hinge is flat [4].
    concurrency, client_durations: the simulated schedule's (as
      :func:`~fedjx.algorithms.fedbuff`); read by the runner.
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``server_optimizer``
      and ``client_transform``.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` are the ring of
    the last ``V`` versions (FedBuff's), its ``hparams`` ``client_optimizer``,
    ``alpha``, the staleness function's ``staleness_exponent`` and
    ``staleness_hinge``, ``mu`` (the proximal ``rho``) when ``rho > 0``,
    and the aggregator's; its round takes an :class:`AsyncCohort` of one
    client.
  """
  name = 'fedasync'
  del client_durations  # The runner's schedule reads it, not the round.
  kit.check_number(name, 'alpha', alpha, strict=True, high=1.0)
  kit.check_number(name, 'rho', rho)
  kit.check_positive_int(name, 'concurrency', concurrency, allow_none=True)
  weighting, exponent = staleness_weighting, staleness_exponent
  check_staleness_options(name, max_staleness, weighting, exponent,
                          allowed=STALENESS_FUNCTIONS)
  kit.check_number(name, 'staleness_hinge', staleness_hinge)
  transform = (optax.inject_hyperparams(transforms.proximal)(mu=rho)
               if rho > 0 else None)
  o = kit.Options.of(name, options, TRAITS.options, client_transform=transform)
  client_optimizer, aggregator, schedule = (o.client_optimizer, o.aggregator,
                                            o.schedule)

  def init(params):
    hparams = base.combine_hparams(
        name,
        algorithm={'client_optimizer': base.optimizer_hparams(client_optimizer, params),
                   'alpha': jnp.float32(alpha),
                   'staleness_exponent': jnp.float32(exponent),
                   'staleness_hinge': jnp.float32(staleness_hinge)},
        client_transform=({} if transform is None else
                          base.optimizer_hparams(transform, params)),
        aggregator=aggregators.init_hparams(aggregator))
    return kit.ServerState(
        params=params, opt_state=(), hparams=hparams,
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params),
        extras=ring_init(params, max_staleness + 1))

  def client_fn(x_now, versions, round_index, hparams, a, b, tau, batches, mask):
    x = ring_read(versions, round_index, tau)  # x_tau
    mask = jnp.logical_and(mask, in_ring(tau, max_staleness))
    out = template.trainer(loss_fn, o, x, hparams, batches, mask)()
    s = staleness_scale(tau, max_staleness, weighting, a, b)
    delta = jax.tree.map(lambda u, y: (u - y) * s.astype(u.dtype), x_now,
                         out.params)  # s(tau) (x_t - y)
    extra = base.client_metrics(delta, out) if o.client_metrics else ()
    return nonfinite.ClientOutput(delta, out.stats, extra=extra,
                            checked=out.params)

  def round_fn(state, cohort, key):
    check_async_cohort(name, cohort, None)
    if cohort.mask.shape[0] != 1:
      raise ValueError(f'{name}: the cohort has {cohort.mask.shape[0]} clients; '
                       'FedAsync mixes in one arrival per round (an AsyncCohort '
                       'of one client: config.cohort_size = 1).')
    hp = state.hparams
    tau = jnp.asarray(cohort.staleness, jnp.int32)
    num_examples = cohort.num_examples * kept(tau, max_staleness)
    clients = aggregators.map_clients(
        aggregator, hp, client_fn,
        (fedjx.broadcast(state.params), fedjx.broadcast(state.extras),
         fedjx.broadcast(state.round_index),
         fedjx.broadcast(hp),
         fedjx.broadcast(hp['staleness_exponent']),
         fedjx.broadcast(hp['staleness_hinge']),
         tau, cohort.batches, cohort.mask),
        num_examples, o.weighting, o.skip_nonfinite,
        aggregator_state=state.aggregator_state)
    delta, agg_state, agg_metrics = aggregators.aggregate(
        aggregator, state.aggregator_state, hp, clients, key)
    a_t = hp['alpha']
    params = jax.tree.map(lambda x, d: x - a_t.astype(x.dtype) * d,
                          state.params, delta)  # (1 - alpha_t) x_t + alpha_t y
    scale = fedjx.reduce_sum(fedjx.map_fn(
        lambda t, a, b: staleness_scale(t, max_staleness, weighting, a, b),
        (tau, fedjx.broadcast(hp['staleness_exponent']),
         fedjx.broadcast(hp['staleness_hinge']))))
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(delta),
        mixing_weight=a_t * scale, **agg_metrics,
        **async_metrics(cohort, max_staleness))
    metrics.update(clients.extra)
    t = state.round_index + 1
    return state._replace(params=params,
                          extras=ring_push(state.extras, params, t),
                          round_index=t, aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=o.metrics_fn, traits=TRAITS)


__all__ = ['fedasync']
