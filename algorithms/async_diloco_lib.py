"""Asynchronous DiLoCo: replicas of unequal speed, buffered outer steps.

DiLoCo (Douillard et al. 2023, :mod:`fedjx.algorithms.diloco_lib`) waits for
every replica before an outer step, so the slowest sets the pace. Here
replicas report when they finish, as in Liu et al., "Asynchronous Local-SGD
Training for Language Modeling", 2024 (arXiv 2401.09135): the server takes
an outer step whenever ``K`` outer gradients are buffered (FedBuff's
machinery, :mod:`fedjx.algorithms.fedbuff_lib`), each replica having trained
``H`` inner steps, with its own persistent inner optimizer state, from the
version it received ``tau_k`` outer steps ago:

    Delta_k = theta_{t - tau_k} - theta_k                  (outer gradient)
    g_t     = sum_k w_k s(tau_k) Q(Delta_k) / sum_k w_k     (s as FedBuff's)
    theta_{t+1} = theta_t + OuterOpt(g_t)

Liu et al. find that Nesterov momentum on stale outer gradients hurts, and
propose the *Delayed Nesterov* outer optimizer (their Algorithm 3): the
momentum ``m`` moves only once every ``N`` outer steps, from the mean of the
``N`` outer gradients received meanwhile (``Delta``, their sum); every outer
gradient is applied once, at weight ``1/N``, as it arrives, and the momentum
term is spread over the ``N`` steps by the *momentum activation*
``c in [0, 1/N]`` (learning rate ``eta``, momentum ``beta``;
:func:`delayed_nesterov`):

    Delta <- Delta + g_t
    t + 1 a multiple of N:  m <- beta m + Delta / N,   Delta <- 0
                            theta <- theta - eta ((1 - cN + c) beta m + g_t / N)
    otherwise:              theta <- theta - eta (c beta m + g_t / N)

Derivation (why these weights). Over one period the gradients add up to
``eta Delta / N``: the period's mean, applied once, gradient by gradient as
the replicas report (a replica starting mid-period trains from a model that
already holds the earlier reports). The momentum term's weights add up to
``(N - 1) c + (1 - cN + c) = 1``: the period's first ``N - 1`` steps apply
``c beta m`` with the momentum of the previous periods, its last step the
rest with the updated ``m``. So a period moves ``theta`` by ``eta (Delta / N
+ beta ((N - 1) c m_old + (1 - cN + c) m_new))``: with ``c = 0`` exactly a
Nesterov step on the period's mean gradient, spread over its steps (DiLoCo's
outer step when the ``N`` gradients are one synchronous round's); ``c``
moves part of the momentum, one period older, to the steps in between
(``c = 1/N``: ``beta m / N`` at every step). With ``N = 1`` both branches
are Nesterov SGD, ``m <- beta m + g``, ``theta <- theta - eta (beta m +
g)``, whatever ``c``. These three facts pin the weights: ``N = 1`` is
Nesterov SGD; with ``c = 1/N`` and ``m = 0`` a period's first steps apply
``eta g_t / N`` (the earlier reading below applied ``eta c g_t`` there and
agreed with Algorithm 3 on those steps); the momentum's weights over a
period sum to one.

(An earlier reading of the paper applied ``eta c g_t`` between momentum
steps and ``eta (beta m + mean of the period's g)`` at the period's last
step, so with ``c > 0`` the first ``N - 1`` gradients of a period were
applied twice, once alone and again in the mean, and the momentum at full
weight at the last step. The old and the new rule agree on a period's first ``N - 1`` steps while ``m = 0`` and
``c = 1/N``, and first differ at its last step:
``tests/test_async_diloco.py`` checks both against float64 NumPy.)

With ``N = 1`` it is DiLoCo's outer Nesterov SGD. Liu et al.'s second
proposal, *Dynamic Local Updates* (each worker's inner steps proportional
to its speed, so that workers finish together), is not implemented: it is
partial work decided by the system model, which sets each client's steps
through the cohort's step masks.

With all replicas finishing together (``K = M``, every ``tau_k = 0``) and
``N = 1``, a round is DiLoCo's exactly.

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): it is asynchronous, its round takes an
:class:`~fedjx.algorithms.fedbuff_lib.AsyncCohort` whose replicas trained
from stale versions of the model kept in a ring.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.compression import quantization
from fedjx.algorithms.diloco_lib import OPTIONS as DILOCO_OPTIONS
from fedjx.algorithms.diloco_lib import check_aggregator
from fedjx.algorithms.diloco_lib import check_options
from fedjx.algorithms.diloco_lib import outer_nesterov
from fedjx.algorithms.diloco_lib import outer_step
from fedjx.algorithms.diloco_lib import replica_states
from fedjx.algorithms.diloco_lib import stack_states
from fedjx.algorithms.fedbuff_lib import async_metrics
from fedjx.algorithms.fedbuff_lib import check_async_cohort
from fedjx.algorithms.fedbuff_lib import check_async_options
from fedjx.algorithms.fedbuff_lib import in_ring
from fedjx.algorithms.fedbuff_lib import kept
from fedjx.algorithms.fedbuff_lib import ring_init
from fedjx.algorithms.fedbuff_lib import ring_push
from fedjx.algorithms.fedbuff_lib import ring_read
from fedjx.algorithms.fedbuff_lib import staleness_scale


class DelayedNesterovState(NamedTuple):
  """:func:`delayed_nesterov`'s state (inside ``optax.inject_hyperparams``'s).

  Attributes:
    count: outer gradients received, ``t``.
    momentum: ``m``.
    buffer: ``Delta``, the sum of the current period's outer gradients.
  """

  count: jax.Array
  momentum: kit.PyTree
  buffer: kit.PyTree


def _delayed_nesterov(learning_rate: float, momentum: float,
                      momentum_activation: float,
                      period: int) -> optax.GradientTransformation:
  eta, beta, c, n = learning_rate, momentum, momentum_activation, period

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros, zeros)

  def update(updates, state, params=None):
    del params
    g = updates
    buffer = jax.tree.map(jnp.add, state.buffer, g)                # Delta += g_t
    stepped = (state.count + 1) % n == 0
    m = jax.tree.map(lambda m, d: jnp.where(stepped, beta * m + d / n, m),
                     state.momentum, buffer)
    weight = jnp.where(stepped, 1.0 - c * n + c, c)                # of beta m
    step = jax.tree.map(
        lambda m, g: (-eta * (weight * beta * m + g / n)).astype(g.dtype), m, g)
    buffer = jax.tree.map(lambda d: jnp.where(stepped, jnp.zeros_like(d), d),
                          buffer)
    return step, DelayedNesterovState(state.count + 1, m, buffer)

  return optax.GradientTransformation(init, update)


def delayed_nesterov(learning_rate: float = 0.7, momentum: float = 0.9,
                     period: int = 1, *,
                     momentum_activation: float = 0.0) -> optax.GradientTransformation:
  """Liu et al. 2024's Delayed Nesterov outer optimizer, their Algorithm 3.

  With ``g_t`` the ``t``-th outer gradient, ``N = period``, ``c =
  momentum_activation`` (module docstring for the derivation)::

      Delta <- Delta + g_t
      (t + 1) mod N == 0:  m <- beta m + Delta / N;  Delta <- 0
                           update = -eta ((1 - cN + c) beta m + g_t / N)
      otherwise:           update = -eta (c beta m + g_t / N)

  Args:
    learning_rate: ``eta`` (injected hyperparameter).
    momentum: ``beta`` in ``[0, 1]`` (injected).
    period: ``N``, outer steps per momentum step (static).
    momentum_activation: ``c`` in ``[0, 1/N]`` (injected): the share of the
      momentum term applied at each of a period's first ``N - 1`` steps.

  With ``period=1`` it returns DiLoCo's outer Nesterov SGD itself
  (:func:`fedjx.algorithms.diloco_lib.outer_nesterov`: the same program, so the
  same bits, and no ``momentum_activation`` hyperparameter).
  """
  fn = 'delayed_nesterov'
  kit.check_number(fn, 'learning_rate', learning_rate)
  kit.check_number(fn, 'momentum', momentum, high=1.0)
  kit.check_positive_int(fn, 'period', period)
  kit.check_number(fn, 'momentum_activation', momentum_activation,
                   high=1.0 / period)
  if period == 1:
    return outer_nesterov(learning_rate, momentum)
  return optax.inject_hyperparams(_delayed_nesterov, static_args=('period',))(
      learning_rate=learning_rate, momentum=momentum,
      momentum_activation=momentum_activation, period=period)


TRAITS = kit.Traits(options=DILOCO_OPTIONS, population='num_replicas',
                    asynchronous=True)
"""What asynchronous DiLoCo declares: DiLoCo's options, replicas by id,
rounds from a simulated schedule (:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def async_diloco(loss_fn: kit.LossFn, num_replicas: int, *,
                 inner_optimizer: optax.GradientTransformation | None = None,
                 outer_optimizer: optax.GradientTransformation | None = None,
                 outer_learning_rate: float | None = None,
                 outer_momentum: float | None = None,
                 inner_steps: int | None = None,
                 reset_inner_state: bool = False,
                 quantization_format: str = 'float32',
                 aggregator: Any = None,
                 buffer_size: int | None = None, max_staleness: int = 16,
                 staleness_weighting: str = 'polynomial',
                 staleness_exponent: float = 0.5, delay_period: int = 1,
                 momentum_activation: float = 0.0,
                 concurrency: int | None = None, client_durations: Any = None,
                 **options: Any) -> kit.Algorithm:
  """Asynchronous DiLoCo with ``num_replicas`` replicas.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_replicas: ``R``; replica ids (``cohort.client_ids``) lie in ``[0, R)``.
    buffer_size: ``K``, outer gradients per outer step; None accepts any.
    max_staleness, staleness_weighting, staleness_exponent: as
      :func:`~fedjx.algorithms.fedbuff`'s (default ``s = (1 + tau)^-0.5``).
    delay_period: ``N`` of :func:`delayed_nesterov` [1: Nesterov SGD].
    momentum_activation: ``c`` of :func:`delayed_nesterov`, in ``[0, 1/N]``
      [0].
    outer_optimizer: any optax optimizer instead of the delayed Nesterov
      one (then ``delay_period`` and ``momentum_activation`` are not taken); or
      ``outer_learning_rate`` [0.7] and ``outer_momentum`` [0.9] for it.
    concurrency, client_durations: the runner's schedule, as FedBuff's
      (default ``M = K``).
    inner_optimizer, inner_steps, reset_inner_state, quantization_format,
    aggregator: as :func:`~fedjx.algorithms.diloco`.
    **options: ``metrics_fn``, ``weighting``, ``client_evaluation``,
      ``skip_nonfinite``, as :func:`~fedjx.algorithms.diloco`.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` are the ring of
    the last ``max_staleness + 1`` versions, leaves ``[V, ...]``
    (``theta_v`` in slot ``v mod V``), and ``client_states`` each replica's
    inner optimizer state, leaves ``[R, ...]`` (``()`` when
    ``reset_inner_state``); its round takes an
    :class:`~fedjx.algorithms.AsyncCohort`.
  """
  name = 'async_diloco'
  del client_durations  # The runner's schedule reads it, not the round.
  kit.check_positive_int(name, 'num_replicas', num_replicas)
  period, scale = delay_period, momentum_activation
  kit.check_positive_int(name, 'delay_period', period)
  kit.check_number(name, 'momentum_activation', scale, high=1.0 / period)
  if outer_optimizer is None:
    lr, mu = outer_learning_rate, outer_momentum
    lr, mu = 0.7 if lr is None else lr, 0.9 if mu is None else mu
    kit.check_number(name, 'outer_learning_rate', lr)
    kit.check_number(name, 'outer_momentum', mu, high=1.0)
    outer_optimizer = delayed_nesterov(lr, mu, period, momentum_activation=scale)
    outer_learning_rate = outer_momentum = None
  elif (period, scale) != (1, 0.0):
    raise ValueError(f'{name}: delay_period={period!r} and momentum_activation='
                     f'{scale!r} set the delayed Nesterov outer optimizer; '
                     'they cannot apply to outer_optimizer.')
  o = check_options(
      name, options, inner_optimizer=inner_optimizer,
      outer_optimizer=outer_optimizer, outer_learning_rate=outer_learning_rate,
      outer_momentum=outer_momentum, inner_steps=inner_steps)
  inner_optimizer, outer_optimizer = o.client_optimizer, o.server_optimizer
  schedule, metrics_fn = o.schedule, o.metrics_fn
  kit.check_choice(name, 'reset_inner_state', reset_inner_state, (False, True))
  quantization.check_format(name, 'quantization_format', quantization_format)
  aggregator = check_aggregator(name, aggregator, quantization_format)
  buffer_size, max_staleness, weighting, exponent = check_async_options(
      name, dict(buffer_size=buffer_size, concurrency=concurrency,
                 max_staleness=max_staleness,
                 staleness_weighting=staleness_weighting,
                 staleness_exponent=staleness_exponent), 'replicas')

  def init(params):
    inner = () if reset_inner_state else stack_states(
        inner_optimizer.init(params), num_replicas)
    return kit.ServerState(
        params=params, opt_state=outer_optimizer.init(params),
        extras=ring_init(params, max_staleness + 1), client_states=inner,
        hparams=base.combine_hparams(
            'async_diloco',
            algorithm={'inner_optimizer': base.optimizer_hparams(inner_optimizer, params),
                       'outer_optimizer': base.optimizer_hparams(outer_optimizer, params)},
            aggregator=aggregators.init_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def replica_fn(versions, round_index, hparams, tau, inner_state, batches, mask):
    theta = ring_read(versions, round_index, tau)
    mask = jnp.logical_and(mask, in_ring(tau, max_staleness))  # Dropped: no steps.
    if reset_inner_state:
      inner_state = inner_optimizer.init(theta)
    inner_state = kit.with_hparams(inner_state, hparams)
    out = client_update.local_update(loss_fn, metrics_fn, inner_optimizer, theta,
                           inner_state, batches, mask, schedule)
    s = staleness_scale(tau, max_staleness, weighting, exponent)
    delta = jax.tree.map(lambda a, b: (a - b) * s.astype(a.dtype), theta,
                         out.params)
    return nonfinite.ClientOutput(delta, out.stats, state=out.opt_state,
                            previous_state=inner_state, checked=out.params)

  def round_fn(state, cohort, key):
    check_async_cohort(name, cohort, buffer_size)
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    tau = jnp.asarray(cohort.staleness, jnp.int32)
    num_examples = cohort.num_examples * kept(tau, max_staleness)
    clients = aggregators.map_clients(
        aggregator, state.hparams, replica_fn,
        (fedjx.broadcast(state.extras), fedjx.broadcast(state.round_index),
         fedjx.broadcast(state.hparams['inner_optimizer']), tau,
         replica_states(state, ids, reset_inner_state), cohort.batches,
         cohort.mask),
        num_examples, o.weighting, o.skip_nonfinite,
        aggregator_state=state.aggregator_state)
    updated, metrics = outer_step(aggregator, outer_optimizer, state, clients,
                                  key, ids, num_examples, reset_inner_state,
                                  **async_metrics(cohort, max_staleness))
    t = state.round_index + 1
    return state._replace(
        extras=ring_push(state.extras, updated['params'], t),
        round_index=t, **updated), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)


__all__ = ['DelayedNesterovState', 'async_diloco',
           'delayed_nesterov']
