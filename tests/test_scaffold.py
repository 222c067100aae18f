"""SCAFFOLD's control variates against option II on quadratics (NumPy)."""

import re

import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.client_store import ClientStore
from fedjx.datasets import Cohort
from test_algorithms_util import KEY, assert_trees_close, make_cohort

DIM, N, ETA_L, ETA_G = 3, 5, 0.1, 0.8


def quadratic_loss(params, batch):
  """Per-example 0.5 sum_j h_j (y_j - a_j)^2: a diagonal quadratic."""
  return 0.5 * ((batch['h'] * (params['y'] - batch['a']) ** 2)).sum(-1)


def _client(rng, n):
  return {'h': rng.uniform(0.5, 2.0, (n, DIM)).astype(np.float32),
          'a': rng.normal(size=(n, DIM)).astype(np.float32)}


def _grad(y, batch):  # grad of the mean quadratic over a minibatch.
  return np.mean(batch['h'] * (y - batch['a']), axis=0)


def test_control_variates_follow_option_ii():
  rng = np.random.default_rng(30)
  population = {i: _client(rng, n) for i, n in enumerate([4, 6, 2, 5, 3])}
  cohorts = [[4, 0, 2], [1, 4, 3], [2, 0, 1]]
  batch = 2
  algo = algos.scaffold(quadratic_loss, N, client_learning_rate=ETA_L,
                        server_optimizer=optax.sgd(ETA_G))
  x0 = np.array([0.3, -0.2, 0.1], np.float32)
  state = algo.init({'y': x0})
  # NumPy reference of Algorithm 1 (option II), uniform aggregation by size.
  x, c = x0.astype(np.float64), np.zeros(DIM)
  ci = np.zeros((N, DIM))
  for ids in cohorts:
    cohort = make_cohort([population[i] for i in ids], batch_size=batch, steps=3,
                         client_ids=ids)
    state, metrics = algo.round(state, cohort, KEY)
    dys, dcs, sizes = [], [], []
    for i in ids:
      d = population[i]
      y, k = x.copy(), 0
      for s in range(0, len(d['a']), batch):
        b = {key: v[s:s + batch].astype(np.float64) for key, v in d.items()}
        y = y - ETA_L * (_grad(y, b) - ci[i] + c)
        k += 1
      c_plus = ci[i] - c + (x - y) / (k * ETA_L)
      dys.append(y - x)
      dcs.append(c_plus - ci[i])
      sizes.append(len(d['a']))
      ci[i] = c_plus
    x = x + ETA_G * np.average(dys, axis=0, weights=sizes)
    c = c + np.sum(dcs, axis=0) / N
    assert_trees_close(state.params['y'], x)  # Against float64: 2 gamma_CHAIN.
    assert_trees_close(state.extras['y'], c)
    assert_trees_close(state.client_states['y'], ci)
  # c stays the mean of the population's c_i.
  assert_trees_close(state.extras['y'], ci.mean(0))
  assert float(metrics['clients']) == 3


def test_padding_client_keeps_its_control_variate():
  rng = np.random.default_rng(31)
  data = [_client(rng, 3), {k: v[:0] for k, v in _client(rng, 1).items()}]
  algo = algos.scaffold(quadratic_loss, 4)
  state = algo.init({'y': np.zeros(DIM, np.float32)})
  state, _ = algo.round(state, make_cohort(data, 2, client_ids=[2, 3]), KEY)
  controls = np.asarray(state.client_states['y'])
  assert np.all(controls[[0, 1, 3]] == 0)
  assert np.any(controls[2] != 0)


def test_scaffold_arguments():
  with pytest.raises(ValueError, match='num_clients'):
    algos.scaffold(quadratic_loss, 0)
  with pytest.raises(ValueError, match='client_learning_rate'):
    algos.scaffold(quadratic_loss, 3, client_learning_rate=-0.1)


@pytest.mark.parametrize('aggregator', [
    algos.aggregators.gaussian(1.0, 1.0),
    algos.privacy.distributed_skellam(clip_norm=1.0, noise_multiplier=1.0),
    algos.privacy.local_gaussian(clip_norm=1.0, noise_multiplier=1.0),
], ids=['gaussian', 'distributed_skellam', 'local_gaussian'])
def test_dp_aggregators_are_refused(aggregator):
  # Delta c_i is summed exactly beside the noised Delta y_i: no DP holds.
  with pytest.raises(ValueError, match=(
      rf'scaffold: aggregator {re.escape(str(aggregator.traits.privacy))} is refused: each '
      r"client's control variate change")) as e:
    algos.scaffold(quadratic_loss, 3, aggregator=aggregator)
  assert '\n' not in str(e.value)
  assert algos.scaffold(quadratic_loss, 3).traits.unprivatized is not None
  # A non-private secure sum is still taken.
  algos.scaffold(quadratic_loss, 3, aggregator=algos.aggregators.secure_sum())


def test_client_learning_rate_is_the_optimizer_s_or_a_mismatch_is_refused():
  sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
  with pytest.raises(ValueError, match='client_learning_rate=0.1 differs'):
    algos.scaffold(quadratic_loss, 3, client_learning_rate=0.1,
                   client_optimizer=sgd)
  rng = np.random.default_rng(32)
  cohort = make_cohort([_client(rng, 3), _client(rng, 4)], 2)
  params = {'y': np.zeros(DIM, np.float32)}
  derived = algos.scaffold(quadratic_loss, 2, client_optimizer=sgd)
  paper = algos.scaffold(quadratic_loss, 2, client_learning_rate=0.05)
  s1, _ = derived.round(derived.init(params), cohort, KEY)
  s2, _ = paper.round(paper.init(params), cohort, KEY)
  assert float(s1.hparams['client_learning_rate']) == np.float32(0.05)
  assert_trees_close(s1.client_states['y'], s2.client_states['y'])
  assert_trees_close(s1.params['y'], s2.params['y'])


def _store_cohort(population, ids, batch):
  """A cohort of ``ids`` (-1: a padding client with no data)."""
  empty = {k: v[:0] for k, v in population[0].items()}
  return make_cohort([population[i] if i >= 0 else empty for i in ids],
                     batch_size=batch, steps=3, client_ids=ids)


@pytest.mark.parametrize('strategy,chunk', [('vmap', None), ('chunked', 2),
                                            ('sequential', None)])
def test_store_placement_equals_dense_over_rounds(strategy, chunk):
  rng = np.random.default_rng(33)
  population = {i: _client(rng, n) for i, n in enumerate([4, 6, 2, 5, 3])}
  # Repeated clients across rounds, padding clients (-1) among them.
  cohorts = [[4, 0, -1, 2], [1, 4, 3, -1], [2, -1, 0, 4], [3, 2, 1, -1]]
  kw = dict(client_learning_rate=ETA_L, server_optimizer=optax.sgd(ETA_G))
  dense = algos.scaffold(quadratic_loss, N, **kw).compile(strategy, chunk)
  store = algos.scaffold(quadratic_loss, N, client_state='store', **kw).compile(
      strategy, chunk)
  assert dense.client_state_init is None
  params = {'y': np.array([0.3, -0.2, 0.1], np.float32)}
  initial = store.client_state_init(params)
  np.testing.assert_array_equal(initial['y'], np.zeros(DIM, np.float32))
  rows = ClientStore(initial, N)
  s_dense, s_store = dense.init(params), store.init(params)
  assert s_store.client_states == ()
  for ids in cohorts:
    cohort = _store_cohort(population, ids, batch=2)
    s_dense, m_dense = dense.round(s_dense, cohort, KEY)
    read = rows.read(np.asarray(ids))
    s_store, m_store, new = store.round(
        s_store, Cohort(*cohort, client_states=read), KEY)
    pad = np.asarray(ids) < 0
    np.testing.assert_array_equal(np.asarray(new['y'])[pad], read['y'][pad])
    rows.write(np.asarray(ids), new)
    assert_trees_close(s_store.params, s_dense.params)
    assert_trees_close(s_store.extras, s_dense.extras)
    assert_trees_close(rows.read(np.arange(N)), s_dense.client_states)
    assert float(m_store['clients']) == float(m_dense['clients']) == 3
  assert len(rows) == N  # Every client of the population has participated.


def test_store_placement_needs_the_cohort_s_rows():
  rng = np.random.default_rng(34)
  algo = algos.scaffold(quadratic_loss, 3, client_state='store')
  state = algo.init({'y': np.zeros(DIM, np.float32)})
  cohort = Cohort(*make_cohort([_client(rng, 3), _client(rng, 2)], 2))
  with pytest.raises(ValueError, match='cohort.client_states=None'):
    algo.round(state, cohort, KEY)
  rows = {'y': np.zeros((3, DIM), np.float32)}  # 3 rows for 2 clients.
  with pytest.raises(ValueError, match='leading axis must be the cohort size 2'):
    algo.round(state, cohort._replace(client_states=rows), KEY)
  with pytest.raises(ValueError, match='run_rounds is not available'):
    algo.run_rounds(state, cohort, KEY)
  with pytest.raises(ValueError, match="client_state='device'"):
    algos.scaffold(quadratic_loss, 3, client_state='device')


def test_store_placement_returns_a_skipped_client_s_row_unchanged():
  rng = np.random.default_rng(35)
  bad = _client(rng, 3)
  bad['a'][1] = np.nan  # Its update is non-finite: the client is skipped.
  cohort = make_cohort([_client(rng, 4), bad], 2, client_ids=[0, 1])
  algo = algos.scaffold(quadratic_loss, 2, client_state='store',
                        skip_nonfinite=True)
  state = algo.init({'y': np.zeros(DIM, np.float32)})
  rows = {'y': rng.normal(size=(2, DIM)).astype(np.float32)}
  state, metrics, new = algo.round(state, Cohort(*cohort, client_states=rows), KEY)
  np.testing.assert_array_equal(np.asarray(new['y'])[1], rows['y'][1])
  assert np.all(np.asarray(new['y'])[0] != rows['y'][0])
  assert np.all(np.isfinite(np.asarray(state.params['y'])))
