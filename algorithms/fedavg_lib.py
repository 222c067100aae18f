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
only change ``ServerOpt``. This round is the round template itself
(:mod:`fedjx.algorithms.template`): FedAvg has no hook of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import optax

from fedjx.algorithms import kit
from fedjx.algorithms.yogi_lib import adaptive_adagrad
from fedjx.algorithms.yogi_lib import adaptive_adam
from fedjx.algorithms.yogi_lib import yogi

TRAITS = kit.Traits(options=kit.options_but(), updates_reach_params=True,
                    indexed_batches=True, aggregates_whole_model=True)
"""What FedAvg declares: every option of :class:`~fedjx.algorithms.kit.Options`;
every update reaches the model in its round, an indexed cohort is read as it
is, the whole model is aggregated once a round
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def fedavg(loss_fn: kit.LossFn, *,
           hparam_schedules: Mapping[str, Any] | None = None,
           **options: Any) -> kit.Algorithm:
  """Federated Averaging with any optax client and server optimizer.

  The round is the template's (:func:`fedjx.algorithms.kit.algorithm`) with
  FedAvg's client and no hook of its own.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    hparam_schedules: hyperparameters as functions of the round, e.g.
      ``{'client_optimizer/learning_rate': optax.exponential_decay(0.3, 1,
      0.99), 'server_optimizer/learning_rate': ...}``: client learning-rate
      decay across rounds and server schedules
      (:func:`fedjx.algorithms.schedules.scheduled`); None: constant.
    **options: :class:`~fedjx.algorithms.kit.Options`: ``client_optimizer``
      (default SGD 0.1, injected), ``server_optimizer`` (default SGD 1.0:
      plain averaging), ``local_epochs``, ``local_steps``,
      ``client_transform`` (e.g. ``proximal(mu)``: FedProx), ``aggregator``
      (e.g. ``aggregators.gaussian(...)``: DP), ``client_metrics``,
      ``metrics_fn``, ``weighting``, ``client_evaluation``,
      ``skip_nonfinite``.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState`.
  """
  algorithm = kit.algorithm('fedavg', loss_fn, kit.Options.of('fedavg', options),
                            traits=TRAITS)
  if hparam_schedules is None:
    return algorithm
  return kit.scheduled(algorithm, hparam_schedules, name='fedavg')


# ------------------------------------------------------------------- FedOpt

FEDOPT_TRAITS = TRAITS._replace(options=kit.options_but('server_optimizer'))
"""What the FedOpt conveniences declare: FedAvg's traits, every option but
the server optimizer, which they set (use :func:`fedavg` to pass your own)."""


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
  return kit.algorithm(fn, loss_fn, kit.Options.of(
      fn, options, FEDOPT_TRAITS.options, server_optimizer=optimizer(
          learning_rate=learning_rate, b1=b1, eps=eps, **more)),
                       traits=FEDOPT_TRAITS)


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


@kit.declare(FEDOPT_TRAITS)
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
  ``eps`` may be 0. ``**options`` as :func:`fedavg`'s, but
  ``server_optimizer``.
  """
  return _fedopt('fedadam', loss_fn, _fedopt_optimizer(
      adaptive_adam, initial_accumulator_value, bias_correction), options,
                 server_learning_rate, b1, b2, eps)


@kit.declare(FEDOPT_TRAITS)
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


@kit.declare(FEDOPT_TRAITS)
def fedadagrad(loss_fn: kit.LossFn, *, server_learning_rate: float = 1e-1,
               b1: float = 0.9, eps: float = 1e-3,
               initial_accumulator_value: float | None = None,
               bias_correction: bool = False,
               **options: Any) -> kit.Algorithm:
  """FedAdagrad (Reddi et al. 2021): ``v = v + g^2``, otherwise as FedAdam."""
  return _fedopt('fedadagrad', loss_fn, _fedopt_optimizer(
      adaptive_adagrad, initial_accumulator_value, bias_correction), options,
                 server_learning_rate, b1, None, eps)


@kit.declare(FEDOPT_TRAITS)
def fedavgm(loss_fn: kit.LossFn, *, server_learning_rate: float = 1.0,
            server_momentum: float = 0.9, **options: Any) -> kit.Algorithm:
  """FedAvgM (Hsu et al. 2019, arXiv 1909.06335): server heavy-ball momentum.

  ``v <- server_momentum v + g``, ``x <- x - lr v``.
  """
  fn = 'fedavgm'
  kit.check_number(fn, 'server_learning_rate', server_learning_rate)
  kit.check_number(fn, 'server_momentum', server_momentum, high=1.0)
  return kit.algorithm(fn, loss_fn, kit.Options.of(
      fn, options, FEDOPT_TRAITS.options, server_optimizer=kit.default_sgd(
          server_learning_rate, momentum=server_momentum)),
                       traits=FEDOPT_TRAITS)


__all__ = ['fedavg', 'fedadam', 'fedyogi', 'fedadagrad', 'fedavgm']
