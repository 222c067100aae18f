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

import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import base
from fedjx.algorithms import client_update
from fedjx.algorithms import nonfinite
from fedjx.algorithms.yogi import adaptive_adagrad
from fedjx.algorithms.yogi import adaptive_adam
from fedjx.algorithms.yogi import yogi


def fedavg(loss_fn: base.LossFn, *,
           client_optimizer: optax.GradientTransformation | None = None,
           server_optimizer: optax.GradientTransformation | None = None,
           metrics_fn: base.MetricsFn | None = None,
           local_epochs: int = 1, local_steps: int | None = None,
           weighting: str = 'num_examples', map_strategy: str = 'auto',
           chunk_size: int | None = None,
           client_evaluation: bool = True,
           skip_nonfinite: bool = True) -> base.Algorithm:
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
    map_strategy: how clients run, see ``fedjx.program``.
    chunk_size: clients per chunk for ``map_strategy='chunked'``.
    client_evaluation: evaluate each client's loss and metrics on all its
      data before and after local training (``train_loss_before`` /
      ``train_loss_after``; two extra forward passes over the data). False
      reports only ``train_loss_during``, the loss of the local steps
      themselves, at no extra cost.
    skip_nonfinite: leave out of the round every client whose update or
      weight is NaN or Inf, and report their number as ``nonfinite_clients``
      (:mod:`fedjx.algorithms.nonfinite`); False checks nothing.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState`.
  """
  name = 'fedavg'
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
                 'server_optimizer': base.optimizer_hparams(server_optimizer, params)},
        round_index=jnp.zeros((), jnp.int32))

  def client_fn(x, hparams, batches, mask):
    opt_state = base.with_hparams(client_optimizer.init(x), hparams)
    out = client_update.local_update(loss_fn, metrics_fn, client_optimizer, x,
                                     opt_state, batches, mask, schedule)
    return nonfinite.ClientOutput(base.tree_sub(x, out.params), out.stats,
                                  checked=out.params)

  def round_fn(state, cohort, key):
    del key  # FedAvg is deterministic given the cohort.
    clients = nonfinite.map_clients(client_fn, (
        fedjx.broadcast(state.params),
        fedjx.broadcast(state.hparams['client_optimizer']),
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


# ------------------------------------------------------------------- FedOpt

def _check_fedopt(fn: str, learning_rate: float, b1: float, b2: float | None,
                  eps: float, fedavg_kwargs: dict) -> None:
  base.check_number(fn, 'server_learning_rate', learning_rate)
  base.check_number(fn, 'b1', b1, high=1.0)
  if b2 is not None:
    base.check_number(fn, 'b2', b2, high=1.0)
  base.check_number(fn, 'eps', eps, strict=True)
  if 'server_optimizer' in fedavg_kwargs:
    raise ValueError(f'{fn}: server_optimizer is set by {fn}; use fedavg to '
                     'pass your own.')


def fedadam(loss_fn: base.LossFn, *, server_learning_rate: float = 1e-2,
            b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3,
            **fedavg_kwargs) -> base.Algorithm:
  """FedAdam (Reddi et al. 2021): FedAvg with Adam on the pseudo-gradient.

  ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
  ``x <- x - lr m / (sqrt(v) + eps)`` (no bias correction, ``v_{-1} =
  eps^2``). Other arguments as :func:`fedavg`.
  """
  _check_fedopt('fedadam', server_learning_rate, b1, b2, eps, fedavg_kwargs)
  opt = optax.inject_hyperparams(adaptive_adam)(
      learning_rate=server_learning_rate, b1=b1, b2=b2, eps=eps)
  return fedavg(loss_fn, server_optimizer=opt, **fedavg_kwargs)


def fedyogi(loss_fn: base.LossFn, *, server_learning_rate: float = 1e-2,
            b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3,
            **fedavg_kwargs) -> base.Algorithm:
  """FedYogi (Reddi et al. 2021): FedAvg with Yogi on the pseudo-gradient.

  ``v = v - (1-b2) g^2 sign(v - g^2)``, otherwise as :func:`fedadam`.
  """
  _check_fedopt('fedyogi', server_learning_rate, b1, b2, eps, fedavg_kwargs)
  opt = optax.inject_hyperparams(yogi)(
      learning_rate=server_learning_rate, b1=b1, b2=b2, eps=eps)
  return fedavg(loss_fn, server_optimizer=opt, **fedavg_kwargs)


def fedadagrad(loss_fn: base.LossFn, *, server_learning_rate: float = 1e-1,
               b1: float = 0.9, eps: float = 1e-3,
               **fedavg_kwargs) -> base.Algorithm:
  """FedAdagrad (Reddi et al. 2021): ``v = v + g^2``, otherwise as FedAdam."""
  _check_fedopt('fedadagrad', server_learning_rate, b1, None, eps, fedavg_kwargs)
  opt = optax.inject_hyperparams(adaptive_adagrad)(
      learning_rate=server_learning_rate, b1=b1, eps=eps)
  return fedavg(loss_fn, server_optimizer=opt, **fedavg_kwargs)


def fedavgm(loss_fn: base.LossFn, *, server_learning_rate: float = 1.0,
            server_momentum: float = 0.9, **fedavg_kwargs) -> base.Algorithm:
  """FedAvgM (Hsu et al. 2019, arXiv 1909.06335): server heavy-ball momentum.

  ``v <- server_momentum v + g``, ``x <- x - lr v``.
  """
  fn = 'fedavgm'
  _check_fedopt(fn, server_learning_rate, 0.0, None, 1.0, fedavg_kwargs)
  base.check_number(fn, 'server_momentum', server_momentum, high=1.0)
  opt = base.default_sgd(server_learning_rate, momentum=server_momentum)
  return fedavg(loss_fn, server_optimizer=opt, **fedavg_kwargs)


__all__ = ['fedavg', 'fedadam', 'fedyogi', 'fedadagrad', 'fedavgm']
