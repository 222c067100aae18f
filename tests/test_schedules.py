"""Hyperparameter schedules across rounds: FedAvg with a decaying client and
an annealed server learning rate against float64 NumPy; config specs;
errors."""

import jax
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import schedules
import float_tolerance as ft
from test_algorithms_util import CHAIN, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

SIZES, B = [8, 4, 6], 4
CLIENT = optax.exponential_decay(0.2, transition_steps=1, decay_rate=0.5)
SERVER = optax.cosine_decay_schedule(2.0, decay_steps=3, alpha=0.1)


def _features(d):
  return np.concatenate([d['x'], np.ones((len(d['y']), 1), np.float32)],
                        1).astype(np.float64), d['y'].astype(np.float64)


def _theta(params):
  return np.concatenate([np.asarray(params['w'], np.float64),
                         np.asarray(params['b'], np.float64)[None]])


def _oracle_round(theta, data, lr_client, lr_server):
  """FedAvg (example-weighted mean, server SGD) in float64."""
  deltas, n = [], []
  for x, y in map(_features, data):
    yi = theta.copy()
    for i in range(0, len(y), B):
      xb, yb = x[i:i + B], y[i:i + B]
      yi = yi - lr_client * xb.T @ (xb @ yi - yb) / len(yb)
    deltas.append(theta - yi)
    n.append(len(y))
  mean = sum(ni * d for ni, d in zip(n, deltas)) / sum(n)
  return theta - lr_server * mean


def _data(seed):
  return linreg_data(np.random.default_rng(seed), SIZES, shift=2.0)


@pytest.mark.parametrize('strategy', ['vmap', 'sequential'])
def test_fedavg_with_schedules_against_numpy(strategy):
  algo = algos.fedavg(
      linreg_loss, hparam_schedules={'client_optimizer/learning_rate': CLIENT,
                                     'server_optimizer/learning_rate': SERVER},
  ).compile(strategy)
  params = linreg_params()
  state = algo.init(params)
  theta = _theta(params)
  # 0.2 * 0.5^t and 0.1 + 0.9 * 2 (1 + cos(pi t / 3)) / 2 in float64.
  lr_c = [0.2 * 0.5 ** t for t in range(3)]
  lr_s = [2.0 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * t / 3))) for t in range(3)]
  for t in range(3):
    data = _data(t)
    state, metrics = algo.round(state, make_cohort(data, B), jax.random.key(t))
    theta = _oracle_round(theta, data, lr_c[t], lr_s[t])
    assert_trees_close(_theta(state.params), theta, n=CHAIN)
    # optax evaluates the schedules in float32: a few roundings.
    np.testing.assert_allclose(metrics['hparam/client_optimizer/learning_rate'],
                               lr_c[t], rtol=ft.rtol(8))
    np.testing.assert_allclose(metrics['hparam/server_optimizer/learning_rate'],
                               lr_s[t], rtol=ft.rtol(8))
  # The state holds the values of the last round run.
  np.testing.assert_allclose(state.hparams['client_optimizer']['learning_rate'],
                             lr_c[2], rtol=ft.rtol(8))


def test_config_specs_build_schedules():
  built = schedules.build_schedule('fedavg', 'p', dict(
      name='exponential_decay', init_value=0.3, transition_steps=10,
      decay_rate=0.1))
  np.testing.assert_allclose(built(20), 0.3 * 0.1 ** 2, rtol=ft.rtol(8))
  piecewise = schedules.build_schedule('fedavg', 'p', dict(
      name='piecewise_constant_schedule', init_value=1.0,
      boundaries_and_scales={'2': 0.5}))
  assert float(piecewise(1)) == 1.0 and float(piecewise(3)) == 0.5
  assert float(schedules.build_schedule('fedavg', 'p', 0.25)(7)) == 0.25


def test_run_rounds_follow_the_schedule():
  # lax.scan over rounds reads each round's index from the carried state.
  algo = algos.fedavg(linreg_loss,
                      hparam_schedules={'client_optimizer/learning_rate': CLIENT})
  cohorts = [make_cohort(_data(t), B) for t in range(3)]
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *cohorts)
  _, metrics = algo.run_rounds(algo.init(linreg_params()), stacked,
                               jax.random.split(jax.random.key(0), 3))
  np.testing.assert_allclose(metrics['hparam/client_optimizer/learning_rate'],
                             [0.2, 0.1, 0.05], rtol=ft.rtol(8))


@pytest.mark.parametrize('schedules_, match', [
    ({'client_optimizer/lr': CLIENT}, r"names 'client_optimizer/lr'.*client_optimizer/learning_rate"),
    ({'client_optimizer': CLIENT}, r"names 'client_optimizer', which is not a scalar"),
    ({'server_optimizer/learning_rate': 'fast'}, r"= 'fast' is not a schedule"),
    ({'server_optimizer/learning_rate': dict(name='cosine_decay_schedule')},
     r'cosine_decay_schedule'),
    ({}, r'hparam_schedules=\{\} must be a non-empty dict'),
])
def test_errors_are_one_line(schedules_, match):
  with pytest.raises(ValueError, match=match):
    algos.fedavg(linreg_loss, hparam_schedules=schedules_).init(linreg_params())
