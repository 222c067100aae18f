"""FedBuff: buffered asynchronous aggregation, as a compiled round.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
AISTATS 2022, Algorithm 1. Clients train on the model version they received;
the server steps whenever ``K`` updates are buffered. Server step ``t`` (the
server holds version ``x_t``) with the buffer's clients ``i = 1..K``:

    client i trained from x_{t - tau_i}:   y_i = ClientOpt^T(x_{t - tau_i}; D_i)
    Delta_i = x_{t - tau_i} - y_i
    g   = sum_i w_i s(tau_i) Delta_i / sum_i w_i      (w_i = n_i, or 1)
    x_{t+1} = x_t + ServerOpt(g)

with the paper's staleness scaling (the polynomial function of Xie et al.,
"Asynchronous Federated Optimization", 2019, with the paper's ``a = 1/2``)

    s(tau) = 1 / (1 + tau)^a       ('polynomial', a = staleness_exponent = 0.5)
    s(tau) = 1                     ('constant')

With ``weighting='uniform'`` this is the paper's ``(1/K) sum_i s(tau_i)
Delta_i`` (the default ``'num_examples'`` weights by ``n_i``, as FedAvg):
stale updates shrink the step, they do not only lose weight against fresh
ones. With ``tau_i = 0`` for all clients the round is FedAvg's on the same
cohort (``s(0) = 1``).

Which clients report when is simulated on the host
(:mod:`fedjx.datasets.async_schedule`); the round receives them as an
:class:`AsyncCohort`: a :class:`~fedjx.datasets.Cohort` plus each client's
staleness. The state keeps a ring of the last ``V = max_staleness + 1``
model versions (``x_v`` in slot ``v mod V``; every slot starts as ``x_0``),
not one model per client; a client with ``tau_i`` outside ``[0,
max_staleness]`` is dropped (weight 0, no local steps) and counted in
``stale_dropped``.

How each client gets its version: the ring is broadcast (``fedjx.broadcast``
is not copied per client: ``map_fn`` hands the one array to every client)
and each client reads its slot ``(t - tau_i) mod V`` inside the client map.
So a chunk of clients holds one model each, as in FedAvg, and the server
``V`` versions; gathering the versions outside the map would instead hold
``K`` models at once whatever the map strategy. (A MapReduce plan of the
round sends the ring to each client.)

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): it is asynchronous, its round takes an
:class:`AsyncCohort` whose clients trained from stale versions of the model
that the server keeps in a ring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import template
from fedjx.algorithms import nonfinite
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators

STALENESS_WEIGHTINGS = ('polynomial', 'constant')
# Xie et al. 2019's three staleness functions (FedAsync takes them all).
STALENESS_FUNCTIONS = ('polynomial', 'constant', 'hinge')
DROPPED = 'stale_dropped'


class AsyncCohort(NamedTuple):
  """The ``K`` buffered clients of one server step.

  Attributes:
    cohort: their data, a :class:`fedjx.datasets.Cohort` (``[K, S, B, ...]``).
    staleness: ``int32 [K]``, server steps since the version each client
      trained from (placed like ``cohort``).

  ``batches``, ``mask``, ``num_examples`` and ``client_ids`` are the
  cohort's, so an ``AsyncCohort`` is a cohort wherever one is read.
  """

  cohort: Any
  staleness: Any

  @property
  def batches(self):
    return self.cohort.batches

  @property
  def mask(self):
    return self.cohort.mask

  @property
  def num_examples(self):
    return self.cohort.num_examples

  @property
  def client_ids(self):
    return self.cohort.client_ids

  @property
  def shape(self) -> tuple[int, int, int]:
    return tuple(int(d) for d in self.mask.shape)  # type: ignore[return-value]


# ------------------------------------------------------------- the pieces

def staleness_weight(staleness: jax.Array, weighting: str = 'polynomial',
                     exponent: float | jax.Array = 0.5,
                     hinge: float | jax.Array = 0.0) -> jax.Array:
  """``s(tau) = (1 + tau)^-a`` (``'polynomial'``) or 1 (``'constant'``), float32.

  ``'hinge'`` (Xie et al. 2019, with ``a = exponent``, ``b = hinge``):
  ``s(tau) = 1`` for ``tau <= b``, else ``1 / (a (tau - b) + 1)``.
  """
  tau = jnp.asarray(staleness, jnp.float32)
  if weighting == 'constant':
    return jnp.ones_like(tau)
  if weighting == 'hinge':
    a, b = (jnp.asarray(v, jnp.float32) for v in (exponent, hinge))
    return jnp.where(tau <= b, 1.0, 1.0 / (a * jnp.maximum(tau - b, 0.0) + 1.0))
  return jnp.power(1.0 + tau, -jnp.asarray(exponent, jnp.float32))


def check_staleness_options(fn: str, max_staleness: Any, weighting: Any,
                            exponent: Any,
                            allowed: tuple[str, ...] = STALENESS_WEIGHTINGS) -> None:
  """One-line errors for the staleness options (``weighting`` one of ``allowed``)."""
  if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) \
      or max_staleness < 0:
    raise ValueError(f'{fn}: max_staleness={max_staleness!r} must be an int '
                     '>= 0 (versions kept: max_staleness + 1).')
  kit.check_choice(fn, 'staleness_weighting', weighting, allowed)
  kit.check_number(fn, 'staleness_exponent', exponent)


def check_async_options(fn: str, o: Mapping[str, Any], who: str
                        ) -> tuple[int | None, int, str, Any]:
  """``(buffer_size, max_staleness, staleness_weighting, staleness_exponent)``
  of an asynchronous algorithm's options ``o``, checked (one-line errors;
  ``who`` names what trains: clients or replicas)."""
  buffer_size, concurrency = o['buffer_size'], o['concurrency']
  kit.check_positive_int(fn, 'buffer_size', buffer_size, allow_none=True)
  kit.check_positive_int(fn, 'concurrency', concurrency, allow_none=True)
  if None not in (buffer_size, concurrency) and concurrency < buffer_size:
    raise ValueError(f'{fn}: concurrency={concurrency} is less than '
                     f'buffer_size={buffer_size}; at least K {who} must train '
                     'at once.')
  weighting, exponent = o['staleness_weighting'], o['staleness_exponent']
  check_staleness_options(fn, o['max_staleness'], weighting, exponent)
  return buffer_size, o['max_staleness'], weighting, exponent


def check_async_cohort(fn: str, cohort: Any, buffer_size: int | None) -> None:
  """Trace-time checks: an :class:`AsyncCohort` of ``buffer_size`` clients."""
  if not isinstance(cohort, AsyncCohort):
    raise ValueError(f'{fn}: the round takes an AsyncCohort(cohort, staleness) '
                     f'(fedjx.datasets.async_cohort_iterator makes them); got '
                     f'{type(cohort).__name__}.')
  k = cohort.mask.shape[0]
  if jnp.shape(cohort.staleness) != (k,):
    raise ValueError(f'{fn}: staleness must have shape [K] = ({k},) (one '
                     f'entry per client); got {jnp.shape(cohort.staleness)}.')
  if not jnp.issubdtype(jnp.result_type(cohort.staleness), jnp.integer):
    raise ValueError(f'{fn}: staleness must be integers; got dtype '
                     f'{jnp.result_type(cohort.staleness)}.')
  if buffer_size is not None and k != buffer_size:
    raise ValueError(f'{fn}: the cohort has {k} clients but buffer_size='
                     f'{buffer_size}; a server step takes buffer_size updates.')


def ring_init(params: kit.Params, size: int) -> kit.PyTree:
  """``size`` copies of ``params`` on a new leading axis (every slot ``x_0``)."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (size,) + jnp.shape(x)),
                      params)


def ring_push(versions: kit.PyTree, params: kit.Params,
              version: jax.Array) -> kit.PyTree:
  """The ring with ``params`` stored as version ``version`` (slot ``version mod V``)."""
  def put(ring, x):
    return ring.at[version % ring.shape[0]].set(x.astype(ring.dtype))
  return jax.tree.map(put, versions, params)


def ring_read(versions: kit.PyTree, round_index: jax.Array,
              staleness: jax.Array) -> kit.PyTree:
  """Version ``round_index - staleness`` of the ring (one client, in the map)."""
  def get(ring):
    return ring[(round_index - staleness) % ring.shape[0]]
  return jax.tree.map(get, versions)


def in_ring(staleness: jax.Array, max_staleness: int) -> jax.Array:
  """Whether ``0 <= staleness <= max_staleness``: the version is in the ring."""
  tau = jnp.asarray(staleness)
  return jnp.logical_and(tau >= 0, tau <= max_staleness)


def kept(staleness: jax.Array, max_staleness: int) -> jax.Array:
  """Placed: 1.0 for clients whose version is in the ring, else 0.0."""
  return in_ring(staleness, max_staleness).astype(jnp.float32)


def staleness_scale(staleness: jax.Array, max_staleness: int, weighting: str,
                    exponent: float | jax.Array,
                    hinge: float | jax.Array = 0.0) -> jax.Array:
  """One client's ``s(tau)``, and 0 when it is dropped (never inf or NaN)."""
  ok = in_ring(staleness, max_staleness)
  return jnp.where(ok, staleness_weight(jnp.where(ok, staleness, 0), weighting,
                                        exponent, hinge), 0.0)


def async_metrics(cohort: AsyncCohort, max_staleness: int) -> dict[str, jax.Array]:
  """``stale_dropped`` (clients with data past the ring) and ``mean_staleness``
  (over the clients with data that were kept)."""
  real = (jnp.asarray(cohort.num_examples) > 0).astype(jnp.float32)
  keep = kept(cohort.staleness, max_staleness)
  tau = jnp.asarray(cohort.staleness, jnp.float32)
  used = fedjx.reduce_sum(real * keep)
  return {DROPPED: fedjx.reduce_sum(real * (1.0 - keep)),
          'mean_staleness': fedjx.reduce_sum(real * keep * tau)
                            / jnp.maximum(used, 1.0)}


# ------------------------------------------------------------- the builder

TRAITS = kit.Traits(options=kit.options_but(), asynchronous=True,
                    updates_reach_params=True)
"""What FedBuff declares: every option of FedAvg; rounds from a simulated
schedule, its buffer the round's cohort
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def fedbuff(loss_fn: kit.LossFn, *, buffer_size: int | None = None,
            max_staleness: int = 16, staleness_weighting: str = 'polynomial',
            staleness_exponent: float = 0.5, concurrency: int | None = None,
            client_durations: Any = None, **options: Any) -> kit.Algorithm:
  """FedBuff: FedAvg's client work and aggregator on buffered, stale updates.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    buffer_size: ``K``, updates per server step (the round's cohort size);
      None accepts any cohort size.
    max_staleness: versions kept are ``max_staleness + 1``; staler clients
      are dropped and counted in ``stale_dropped``.
    staleness_weighting: ``'polynomial'`` (``s = (1 + tau)^-a``, the paper's)
      or ``'constant'`` (``s = 1``).
    staleness_exponent: ``a`` [0.5].
    concurrency: ``M``, clients training at once (default ``K``), and
    client_durations: the duration model's spec (default
      ``{'name': 'lognormal'}``, :mod:`fedjx.datasets.async_schedule`): read
      by the runner's schedule, not by the round.
    **options: :func:`~fedjx.algorithms.fedavg`'s.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` are the ring of
    the last ``V`` versions, leaves ``[V, ...]`` (``x_v`` in slot ``v mod
    V``); its round takes an :class:`AsyncCohort`.
  """
  name = 'fedbuff'
  del client_durations  # The runner's schedule reads it, not the round.
  o = kit.Options.of(name, options, TRAITS.options)
  client_transform, metrics_fn = o.client_transform, o.metrics_fn
  client_optimizer, server_optimizer = o.client_optimizer, o.server_optimizer
  aggregator, schedule = o.aggregator, o.schedule
  buffer_size, max_staleness, weighting, exponent = check_async_options(
      name, dict(buffer_size=buffer_size, concurrency=concurrency,
                 max_staleness=max_staleness,
                 staleness_weighting=staleness_weighting,
                 staleness_exponent=staleness_exponent), 'clients')

  def init(params):
    return kit.ServerState(
        params=params, opt_state=server_optimizer.init(params),
        hparams=template.hparams_of(name, o, {}, params),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params),
        extras=ring_init(params, max_staleness + 1))

  def client_fn(versions, round_index, hparams, tau, batches, mask):
    x = ring_read(versions, round_index, tau)
    mask = jnp.logical_and(mask, in_ring(tau, max_staleness))  # Dropped: no steps.
    out = template.trainer(loss_fn, o, x, hparams, batches, mask)()
    s = staleness_scale(tau, max_staleness, weighting, exponent)
    delta = jax.tree.map(lambda a, b: (a - b) * s.astype(a.dtype), x, out.params)
    extra = base.client_metrics(delta, out) if o.client_metrics else ()
    return nonfinite.ClientOutput(delta, out.stats, extra=extra,
                            checked=out.params)

  def round_fn(state, cohort, key):
    check_async_cohort(name, cohort, buffer_size)
    tau = jnp.asarray(cohort.staleness, jnp.int32)
    num_examples = cohort.num_examples * kept(tau, max_staleness)
    clients = aggregators.map_clients(
        aggregator, state.hparams, client_fn,
        (fedjx.broadcast(state.extras), fedjx.broadcast(state.round_index),
         fedjx.broadcast(state.hparams), tau, cohort.batches, cohort.mask),
        num_examples, o.weighting, o.skip_nonfinite,
        aggregator_state=state.aggregator_state)
    pseudo_grad, params, opt_state, agg_state, agg_metrics = aggregators.step(
        aggregator, server_optimizer, state, state.hparams['server_optimizer'],
        clients, key)
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad), **agg_metrics,
        **async_metrics(cohort, max_staleness))
    metrics['communicated_bytes'] = aggregators.upload_bytes(
        aggregator, state.params, metrics['clients'], agg_metrics)
    metrics.update(clients.extra)
    t = state.round_index + 1
    return state._replace(params=params, opt_state=opt_state,
                          extras=ring_push(state.extras, params, t),
                          round_index=t, aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)


__all__ = ['AsyncCohort', 'fedbuff', 'staleness_weight']
