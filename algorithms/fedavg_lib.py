"""Federated Averaging and its server-optimizer family FedOpt.

FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks
from Decentralized Data", AISTATS 2017, Algorithm 1. FedOpt: Reddi et al.,
"Adaptive Federated Optimization", ICLR 2021, Algorithm 1. Each round:

    broadcast x to the cohort
    for each client i (in parallel):          y_i = ClientOpt^T(x; D_i)
    pseudo-gradient    g = x - sum_i w_i y_i / sum_i w_i,  w_i = n_i (or 1)
    server step        x <- x + ServerOpt(g)

With ``server_optimizer=optax.sgd(1.0)`` the server step is ``x <- sum_i w_i
y_i / sum_i w_i``, McMahan's FedAvg; FedAdam, FedYogi, FedAdagrad and FedAvgM
only change ``ServerOpt``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms.yogi_lib import adaptive_adagrad
from fedjx.algorithms.yogi_lib import adaptive_adam
from fedjx.algorithms.yogi_lib import yogi


@kit.with_options(kit.OPTIONS)
def fedavg(loss_fn: kit.LossFn, *,
           hparam_schedules: Mapping[str, Any] | None = None,
           **options: Any) -> kit.Algorithm:
  """Federated Averaging with any optax client and server optimizer.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    client_optimizer: local optimizer (default: SGD, learning rate 0.1, with
      injected hyperparameters).
    server_optimizer: applied to the pseudo-gradient (default: SGD, learning
      rate 1.0: plain averaging).
    metrics_fn: optional ``metrics_fn(params, batch) -> {name: [B]}``.
    local_epochs: passes over each client's steps ``E``.
    local_steps: or exactly this many local steps per client.
    weighting: ``'num_examples'`` (``w_i = n_i``) or ``'uniform'``.
    client_transform: an optax transformation chained in front of the client
      optimizer (:mod:`fedjx.algorithms.transforms.core`, e.g.
      ``proximal(mu)``: FedProx); it is initialised from the model each
      client receives, and its injected hyperparameters live at the top level
      of ``state.hparams``.
    aggregator: how updates are combined
      (:mod:`fedjx.algorithms.aggregators`; default the weighted mean);
      e.g. ``aggregators.gaussian(...)`` for DP.
    client_evaluation: evaluate each client's loss and metrics on all its
      data before and after local training (``train_loss_before`` /
      ``train_loss_after``; two extra forward passes over the data). False
      reports only ``train_loss_during``, the loss of the local steps
      themselves, at no extra cost.
    skip_nonfinite: leave out of the round every client whose update or
      weight is NaN or Inf, and report their number as ``nonfinite_clients``
      (:mod:`fedjx.algorithms.nonfinite`); False checks nothing.
    client_metrics: also return per-client ``[C]`` metrics (see
      :func:`fedjx.algorithms.base.client_metrics`); False adds nothing.
    hparam_schedules: hyperparameters as functions of the round, e.g.
      ``{'client_optimizer/learning_rate': optax.exponential_decay(0.3, 1,
      0.99), 'server_optimizer/learning_rate': ...}``: client learning-rate
      decay across rounds and server schedules
      (:func:`fedjx.algorithms.schedules.scheduled`); None: constant.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState`.
  """
  algorithm = build('fedavg', loss_fn,
                    kit.take_options('fedavg', options, kit.OPTIONS))
  if hparam_schedules is None:
    return algorithm
  return kit.scheduled(algorithm, hparam_schedules, name='fedavg')


def build(name: str, loss_fn: kit.LossFn,
          options: Mapping[str, Any]) -> kit.Algorithm:
  """FedAvg's round with its parts (``options``: all of :data:`kit.OPTIONS`).

  ``name`` names the builder in errors and in the round's function name.
  """
  o = options
  metrics_fn, client_transform = o['metrics_fn'], o['client_transform']
  weighting, skip_nonfinite = o['weighting'], o['skip_nonfinite']
  client_metrics = o['client_metrics']
  client_optimizer, server_optimizer, aggregator, schedule = kit.check_parts(name, o)

  train = kit.client_training(loss_fn, metrics_fn, client_optimizer,
                              client_transform, schedule)

  def init(params):
    return kit.ServerState(
        params=params, opt_state=server_optimizer.init(params),
        hparams=kit.initial_hparams(client_optimizer, server_optimizer,
                                    client_transform, aggregator, params, name),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def client_fn(x, hparams, batches, mask):
    out = train(x, hparams, batches, mask)
    delta = kit.tree_sub(x, out.params)
    extra = kit.client_metrics(delta, out) if client_metrics else ()
    return kit.ClientOutput(delta, out.stats, extra=extra,
                            checked=out.params)

  def round_fn(state, cohort, key):
    client_hparams = kit.client_hparams_of(state, client_transform)
    clients = kit.map_clients(
        aggregator, state.hparams, client_fn,
        (fedjx.broadcast(state.params), fedjx.broadcast(client_hparams),
         cohort.batches, cohort.mask),
        cohort.num_examples, weighting, skip_nonfinite,
        aggregator_state=state.aggregator_state, client_ids=cohort.client_ids)
    pseudo_grad, params, opt_state, agg_state, agg_metrics = kit.server_step(
        aggregator, server_optimizer, state, state.hparams['server_optimizer'],
        clients, key)
    metrics = kit.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad), **agg_metrics)
    # What the round's clients uploaded (the adapters alone, for a LoraModel).
    metrics['communicated_bytes'] = kit.upload_bytes(
        aggregator, state.params, metrics['clients'], agg_metrics)
    metrics.update(clients.extra)  # Per-client [C] metrics, if asked.
    return state._replace(params=params, opt_state=opt_state,
                          round_index=state.round_index + 1,
                          aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o,
                            indexed_batches=True)


# ------------------------------------------------------------------- FedOpt

def _fedopt(fn: str, loss_fn: kit.LossFn, optimizer, options: Mapping[str, Any],
            learning_rate: float, b1: float, b2: float | None, eps: float,
            **more: Any) -> kit.Algorithm:
  """FedAvg (named ``fn``) with the server optimizer ``optimizer(...)``."""
  kit.check_number(fn, 'server_learning_rate', learning_rate)
  kit.check_number(fn, 'b1', b1, high=1.0)
  if b2 is not None:
    kit.check_number(fn, 'b2', b2, high=1.0)
    more['b2'] = b2
  kit.check_number(fn, 'eps', eps)
  options = kit.take_options(fn, options, FEDOPT_OPTIONS)
  return build(fn, loss_fn, dict(options, server_optimizer=optimizer(
      learning_rate=learning_rate, b1=b1, eps=eps, **more)))


# What the FedOpt conveniences take besides their own: fedavg's options but
# the server optimizer, which they set (use fedavg to pass your own).
FEDOPT_OPTIONS = kit.without('server_optimizer')


def _fedopt_optimizer(fn, initial_accumulator_value, bias_correction):
  """``fn`` with injected hyperparameters; the convention options static.

  With the defaults the optimizer is the one of earlier versions (same
  ``state.hparams`` keys: ``learning_rate``, ``b1``, ``b2``, ``eps``).
  """
  kit.check_choice(fn.__name__, 'bias_correction', bias_correction,
                    (False, True))
  if initial_accumulator_value is not None:
    kit.check_number(fn.__name__, 'initial_accumulator_value',
                     initial_accumulator_value)
  extra = {}
  if initial_accumulator_value is not None:
    extra['initial_accumulator_value'] = initial_accumulator_value
  if bias_correction:
    extra['bias_correction'] = True
  static = ('bias_correction',) if bias_correction else ()
  return functools.partial(optax.inject_hyperparams(fn, static_args=static),
                           **extra)


@kit.with_options(FEDOPT_OPTIONS)
def fedadam(loss_fn: kit.LossFn, *, server_learning_rate: float = 1e-2,
            b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3,
            initial_accumulator_value: float | None = None,
            bias_correction: bool = False, **options: Any) -> kit.Algorithm:
  """FedAdam (Reddi et al. 2021): FedAvg with Adam on the pseudo-gradient.

  ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
  ``x <- x - lr m / (sqrt(v) + eps)`` (no bias correction, ``v_{-1} =
  eps^2``). ``initial_accumulator_value`` sets ``v_{-1}`` and
  ``bias_correction=True`` scales the step by ``sqrt(1 - b2^t) / (1 -
  b1^t)``: with ``initial_accumulator_value=0.0, bias_correction=True`` and
  their ``eps``, Flower's and TFF's FedAdam (:mod:`fedjx.algorithms.yogi_lib`).
  ``eps`` may be 0. Other arguments as :func:`fedavg`.
  """
  return _fedopt('fedadam', loss_fn, _fedopt_optimizer(
      adaptive_adam, initial_accumulator_value, bias_correction), options,
                 server_learning_rate, b1, b2, eps)


@kit.with_options(FEDOPT_OPTIONS)
def fedyogi(loss_fn: kit.LossFn, *, server_learning_rate: float = 1e-2,
            b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3,
            initial_accumulator_value: float | None = None,
            bias_correction: bool = False, **options: Any) -> kit.Algorithm:
  """FedYogi (Reddi et al. 2021): FedAvg with Yogi on the pseudo-gradient.

  ``v = v - (1-b2) g^2 sign(v - g^2)``, otherwise as :func:`fedadam`.
  """
  return _fedopt('fedyogi', loss_fn, _fedopt_optimizer(
      yogi, initial_accumulator_value, bias_correction), options,
                 server_learning_rate, b1, b2, eps)


@kit.with_options(FEDOPT_OPTIONS)
def fedadagrad(loss_fn: kit.LossFn, *, server_learning_rate: float = 1e-1,
               b1: float = 0.9, eps: float = 1e-3,
               initial_accumulator_value: float | None = None,
               bias_correction: bool = False,
               **options: Any) -> kit.Algorithm:
  """FedAdagrad (Reddi et al. 2021): ``v = v + g^2``, otherwise as FedAdam."""
  return _fedopt('fedadagrad', loss_fn, _fedopt_optimizer(
      adaptive_adagrad, initial_accumulator_value, bias_correction), options,
                 server_learning_rate, b1, None, eps)


@kit.with_options(FEDOPT_OPTIONS)
def fedavgm(loss_fn: kit.LossFn, *, server_learning_rate: float = 1.0,
            server_momentum: float = 0.9, **options: Any) -> kit.Algorithm:
  """FedAvgM (Hsu et al. 2019, arXiv 1909.06335): server heavy-ball momentum.

  ``v <- server_momentum v + g``, ``x <- x - lr v``.
  """
  fn = 'fedavgm'
  kit.check_number(fn, 'server_learning_rate', server_learning_rate)
  kit.check_number(fn, 'server_momentum', server_momentum, high=1.0)
  return build(fn, loss_fn, dict(
      kit.take_options(fn, options, FEDOPT_OPTIONS),
      server_optimizer=kit.default_sgd(server_learning_rate,
                                       momentum=server_momentum)))


__all__ = ['fedavg', 'fedadam', 'fedyogi', 'fedadagrad', 'fedavgm']
