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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
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

OPTIONS: dict[str, Any] = {
    **kit.without('server_optimizer', 'client_transform'),
    'alpha': 0.6,
    'rho': 0.0,
    'max_staleness': 16,
    'staleness_weighting': 'polynomial',
    'staleness_exponent': 0.5,
    'staleness_hinge': 4.0,
    'concurrency': None,
    'client_durations': None,
}


class FedAsyncState(NamedTuple):
  """FedAsync's state.

  Attributes:
    params: the server model ``x_t``.
    versions: the ring of the last ``V`` versions (FedBuff's).
    hparams: ``client_optimizer``, ``alpha``, the staleness function's
      ``staleness_exponent`` and ``staleness_hinge``, ``mu`` (the proximal
      ``rho``) when ``rho > 0``, and the aggregator's.
    round_index: updates applied (or dropped), ``t``.
    aggregator_state: the aggregator's state (``()`` when it has none).
  """

  params: kit.Params
  versions: kit.PyTree
  hparams: dict[str, Any]
  round_index: jax.Array
  aggregator_state: Any = ()


@kit.with_options(OPTIONS)
def fedasync(loss_fn: kit.LossFn, **options: Any) -> kit.Algorithm:
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
    client_optimizer, local_epochs, local_steps, aggregator, weighting,
    client_metrics, metrics_fn, client_evaluation, skip_nonfinite: as
      :func:`~fedjx.algorithms.fedavg`.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`FedAsyncState` and its round takes an :class:`AsyncCohort` of
    one client.
  """
  name = 'fedasync'
  o = kit.take_options(name, options, OPTIONS)
  kit.check_number(name, 'alpha', o['alpha'], strict=True, high=1.0)
  kit.check_number(name, 'rho', o['rho'])
  kit.check_positive_int(name, 'concurrency', o['concurrency'], allow_none=True)
  weighting, exponent = o['staleness_weighting'], o['staleness_exponent']
  max_staleness = o['max_staleness']
  check_staleness_options(name, max_staleness, weighting, exponent,
                          allowed=STALENESS_FUNCTIONS)
  kit.check_number(name, 'staleness_hinge', o['staleness_hinge'])
  transform = (optax.inject_hyperparams(kit.proximal)(mu=o['rho'])
               if o['rho'] > 0 else None)
  client_optimizer, _, aggregator, schedule = kit.check_parts(
      name, dict(o, server_optimizer=None, client_transform=transform))
  train = kit.client_training(loss_fn, o['metrics_fn'], client_optimizer,
                              transform, schedule)

  def init(params):
    hparams = kit.combine_hparams(
        name,
        algorithm={'client_optimizer': kit.optimizer_hparams(client_optimizer, params),
                   'alpha': jnp.float32(o['alpha']),
                   'staleness_exponent': jnp.float32(exponent),
                   'staleness_hinge': jnp.float32(o['staleness_hinge'])},
        client_transform=({} if transform is None else
                          kit.optimizer_hparams(transform, params)),
        aggregator=kit.aggregator_hparams(aggregator))
    return FedAsyncState(
        params=params, versions=ring_init(params, max_staleness + 1),
        hparams=hparams, round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def client_fn(x_now, versions, round_index, hparams, a, b, tau, batches, mask):
    x = ring_read(versions, round_index, tau)  # x_tau
    mask = jnp.logical_and(mask, in_ring(tau, max_staleness))
    out = train(x, hparams, batches, mask)
    s = staleness_scale(tau, max_staleness, weighting, a, b)
    delta = jax.tree.map(lambda u, y: (u - y) * s.astype(u.dtype), x_now,
                         out.params)  # s(tau) (x_t - y)
    extra = kit.client_metrics(delta, out) if o['client_metrics'] else ()
    return kit.ClientOutput(delta, out.stats, extra=extra,
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
    clients = kit.map_clients(
        aggregator, hp, client_fn,
        (fedjx.broadcast(state.params), fedjx.broadcast(state.versions),
         fedjx.broadcast(state.round_index),
         fedjx.broadcast(kit.client_hparams_of(state, transform)),
         fedjx.broadcast(hp['staleness_exponent']),
         fedjx.broadcast(hp['staleness_hinge']),
         tau, cohort.batches, cohort.mask),
        num_examples, o['weighting'], o['skip_nonfinite'],
        aggregator_state=state.aggregator_state)
    delta, agg_state, agg_metrics = kit.aggregate(
        aggregator, state.aggregator_state, hp, clients, key)
    alpha = hp['alpha']
    params = jax.tree.map(lambda x, d: x - alpha.astype(x.dtype) * d,
                          state.params, delta)  # (1 - alpha_t) x_t + alpha_t y
    scale = fedjx.reduce_sum(fedjx.map_fn(
        lambda t, a, b: staleness_scale(t, max_staleness, weighting, a, b),
        (tau, fedjx.broadcast(hp['staleness_exponent']),
         fedjx.broadcast(hp['staleness_hinge']))))
    metrics = kit.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(delta),
        mixing_weight=alpha * scale, **agg_metrics,
        **async_metrics(cohort, max_staleness))
    metrics.update(clients.extra)
    t = state.round_index + 1
    return state._replace(params=params,
                          versions=ring_push(state.versions, params, t),
                          round_index=t, aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o)


__all__ = ['FedAsyncState', 'fedasync']
