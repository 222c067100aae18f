"""FedDyn against a float64 NumPy oracle of Acar et al. 2021, Algorithm 1:
two rounds with a client drawn twice (its stored gradient state read back),
a padding client and a skipped (non-finite) client whose rows come back
unchanged, under every map strategy; h over the population size m; DP
refused; one-line errors."""

import jax
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import aggregators
from client_rows import Rows, batches_of, linreg_grad, run_round, theta_of
from test_algorithms_util import CHAIN, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

B, LR, ALPHA, M = 2, 0.1, 0.3, 6
SIZES = [5, 3, 4, 6]
ROUNDS = [[0, 2, 1, -1], [2, 3, 1, -1]]   # Client 2 twice; 1 is NaN in round 2.


def _population():
  return linreg_data(np.random.default_rng(9), SIZES, shift=2.0)


def _cohort(population, ids, nan=()):
  data = []
  for i in ids:
    d = dict(population[max(i, 0)])
    if i < 0:
      d = {k: v[:0] for k, v in d.items()}
    elif i in nan:
      d['x'] = np.full_like(d['x'], np.nan)
    data.append(d)
  return make_cohort(data, B, steps=3, client_ids=ids)


def _oracle(theta, h, grads, population, ids, weighting, skip=()):
  """One FedDyn round in float64: (theta^t, h^t, the g_k)."""
  grads = dict(grads)
  models, sizes = [], []
  for i in ids:
    if i < 0 or i in skip:
      continue
    g_k = grads.get(i, np.zeros_like(theta))
    t = theta.copy()
    for x, y in batches_of(population[i], B):
      t = t - LR * (linreg_grad(t, x, y) - g_k + ALPHA * (t - theta))
    grads[i] = g_k - ALPHA * (t - theta)
    models.append(t)
    sizes.append(len(population[i]['y']) if weighting == 'num_examples' else 1)
  h = h - ALPHA / M * sum(t - theta for t in models)
  return np.average(models, axis=0, weights=sizes) - h / ALPHA, h, grads


# The maps under the paper's uniform mean (chunked with the slow tests), and
# the example-weighted mean under vmap.
CASES = [pytest.param('vmap', None, 'uniform', id='vmap'),
         pytest.param('sequential', None, 'uniform', id='sequential'),
         pytest.param('chunked', 2, 'uniform', id='chunked', marks=pytest.mark.slow),
         pytest.param('vmap', None, 'num_examples', id='vmap-num_examples')]


@pytest.mark.parametrize('strategy, chunk, weighting', CASES)
def test_two_rounds_against_numpy(strategy, chunk, weighting):
  population = _population()
  algo = algos.feddyn(linreg_loss, M, alpha=ALPHA, weighting=weighting,
                      client_optimizer=optax.sgd(LR)).compile(strategy, chunk)
  params = linreg_params()
  state = algo.init(params)
  store = Rows(algo.client_state_init(params))
  theta, h, grads = theta_of(params), np.zeros(4), {}
  for r, ids in enumerate(ROUNDS):
    nan = (1,) if r == 1 else ()
    before = {i: store.row(i) for i in ids}
    state, metrics, rows = run_round(algo, state, _cohort(population, ids, nan),
                                     store, jax.random.key(r))
    theta, h, grads = _oracle(theta, h, grads, population, ids, weighting, nan)
    # theta^t subtracts h / alpha: its float32 error is the chain's over alpha.
    assert_trees_close(theta_of(state.params), theta, n=CHAIN / ALPHA)
    assert_trees_close(theta_of(state.extras), h, n=CHAIN)
    for j, i in enumerate(ids):
      row = jax.tree.map(lambda x: x[j], rows)
      if i < 0 or i in nan:  # Padding and skipped clients: rows unchanged.
        jax.tree.map(np.testing.assert_array_equal, row, before[i])
      else:
        assert_trees_close(theta_of(row), grads[i], n=CHAIN)
    assert float(metrics['nonfinite_clients']) == len(nan)
  # h stays (1/m) sum_k g_k over the whole population (zero rows included).
  assert_trees_close(theta_of(state.extras), sum(grads.values()) / M, n=CHAIN)


@pytest.mark.parametrize('kwargs, match', [
    (dict(num_clients=0), r'feddyn: num_clients=0 must be a positive int'),
    (dict(alpha=0.0), r'feddyn: alpha=0.0 is not allowed'),
    (dict(aggregator=aggregators.gaussian(1.0, 1.0)), r'feddyn: aggregator gaussian \(central DP\) is refused'),
    (dict(weighting='count'), r"weighting='count'"),
    (dict(client_transform=optax.sgd(1.0)), r'option client_transform=.* is not taken'),
])
def test_errors_are_one_line(kwargs, match):
  kwargs = {'num_clients': 4, **kwargs}
  with pytest.raises(ValueError, match=match) as e:
    algos.feddyn(linreg_loss, **kwargs)
  assert '\n' not in str(e.value)


def test_run_rounds_is_refused():
  algo = algos.feddyn(linreg_loss, 4)
  state = algo.init(linreg_params())
  with pytest.raises(ValueError, match='run_rounds is not available'):
    algo.run_rounds(state, None, None)
