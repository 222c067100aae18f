"""FedExP against float64 NumPy rounds (one and two, both weightings, every
map strategy); eta_g = 1 gives FedAvg; the averaged iterate; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import aggregators
from fedjx.algorithms.fedexp_lib import averaged_params
import float_tolerance as ft
from test_algorithms_util import CHAIN, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

SIZES = [8, 4, 6, 5]
B, LR = 4, 0.1


def _features(d):
  return np.concatenate([d['x'], np.ones((len(d['y']), 1), np.float32)],
                        1).astype(np.float64), d['y'].astype(np.float64)


def _theta(params):
  return np.concatenate([np.asarray(params['w'], np.float64),
                         np.asarray(params['b'], np.float64)[None]])


def _oracle_round(theta, data, weighting, eps):
  """Jhunjhunwala et al. 2023, Algorithm 1, in float64: local SGD (one
  epoch, batches of B), then the extrapolated server step."""
  deltas, w = [], []
  for x, y in map(_features, data):
    yi = theta.copy()
    for i in range(0, len(y), B):
      xb, yb = x[i:i + B], y[i:i + B]
      yi = yi - LR * xb.T @ (xb @ yi - yb) / len(yb)
    deltas.append(theta - yi)
    w.append(len(y) if weighting == 'num_examples' else 1.0)
  p = np.asarray(w) / np.sum(w)
  mean = sum(pi * d for pi, d in zip(p, deltas))
  num = sum(pi * d @ d for pi, d in zip(p, deltas))
  eta = max(1.0, num / (2 * (mean @ mean + eps)))
  return theta - eta * mean, eta


def _data(seed, sizes=SIZES):
  return linreg_data(np.random.default_rng(seed), sizes, shift=2.0)


def _algo(**kw):
  return algos.fedexp(linreg_loss, client_optimizer=optax.sgd(LR), **kw)


_SLOW = pytest.mark.slow
STRATEGIES = [pytest.param('vmap', None, id='vmap'),
              pytest.param('sequential', None, id='sequential'),
              pytest.param('chunked', 3, id='chunked3', marks=_SLOW),
              pytest.param('auto', None, id='auto', marks=_SLOW)]


@pytest.mark.parametrize('strategy, chunk', STRATEGIES)
@pytest.mark.parametrize('weighting', ['uniform', 'num_examples'])
def test_two_rounds_against_numpy(weighting, strategy, chunk):
  eps = 1e-3
  algo = _algo(weighting=weighting, epsilon=eps).compile(strategy, chunk)
  params = linreg_params()
  state = algo.init(params)
  theta = _theta(params)
  etas = []
  for r in range(2):
    data = _data(r)
    previous = _theta(state.params)
    state, metrics = algo.round(state, make_cohort(data, B), jax.random.key(r))
    theta, eta = _oracle_round(theta, data, weighting, eps)
    etas.append(eta)
    # eta_g: a ratio of sums of <= 4 client terms over the CHAIN's updates.
    np.testing.assert_allclose(metrics['server_step_size'], eta,
                               rtol=2 * ft.rtol(CHAIN))
    assert_trees_close(_theta(state.params), theta, n=2 * CHAIN)
    np.testing.assert_array_equal(_theta(state.extras), previous)
  assert max(etas) > 1.0  # The heterogeneous clients extrapolate.


def test_one_client_is_fedavg():
  # sum ||Delta||^2 / (2 ||Delta||^2) = 1/2 < 1: eta_g = 1.
  data = _data(3, sizes=[8])
  fedexp = _algo()
  fedavg = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(LR),
                        server_optimizer=optax.sgd(1.0))
  cohort = make_cohort(data, B)
  a, ma = fedexp.round(fedexp.init(linreg_params()), cohort, jax.random.key(0))
  b, _ = fedavg.round(fedavg.init(linreg_params()), cohort, jax.random.key(0))
  assert float(ma['server_step_size']) == 1.0
  assert_trees_close(a.params, b.params)


def test_averaged_params_are_the_mean_of_the_last_two_iterates():
  algo = _algo()
  state = algo.init(linreg_params())
  for r in range(2):
    old = jax.tree.map(np.asarray, state.params)  # round donates the state
    state, _ = algo.round(state, make_cohort(_data(r), B), jax.random.key(r))
  avg = averaged_params(state)
  want = jax.tree.map(lambda a, b: (np.float64(a) + np.float64(b)) / 2,
                      state.params, old)
  assert_trees_close(avg, want, n=2)


def test_epsilon_is_traced():
  # A larger eps shrinks eta_g towards 1, without recompiling.
  algo = _algo()
  state = algo.init(linreg_params())
  cohort = make_cohort(_data(0), B)
  _, small = algo.round(state, cohort, jax.random.key(0))
  big = algo.init(linreg_params())
  big = big._replace(hparams=dict(big.hparams, epsilon=jnp.float32(1e3)))
  _, large = algo.round(big, cohort, jax.random.key(0))
  assert float(small['server_step_size']) > 1.0
  assert float(large['server_step_size']) == 1.0


@pytest.mark.parametrize('kwargs, match', [
    (dict(aggregator=aggregators.gaussian(1.0, 1.0)), r'fedexp: aggregator .*DP'),
    (dict(epsilon=0.0), r'epsilon=0.0'),
    (dict(server_optimizer=optax.sgd(1.0)), r'option server_optimizer=.* is not taken'),
    (dict(weighting='count'), r"weighting='count'"),
])
def test_errors_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match):
    algos.fedexp(linreg_loss, **kwargs)
