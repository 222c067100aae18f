"""APFL against FedJAX's apfl test scenarios and a float64 NumPy oracle.

FedJAX (``fedjax/algorithms/apfl_test.py``) trains with ``grad_fn(params,
batch) = params / sum(batch['x'])``. That is the gradient of the batch mean
of ``0.5 ||w||^2 * inv_sum``, with ``inv_sum = 1 / sum(batch['x'])`` a
feature every example of the batch carries, which is how the scenarios are
rebuilt here. FedJAX's shuffled batches of 2 over one epoch fill the last
batch with an example of the next epoch; the expected numbers there come
from client 0's batches ``[4, 6], [2, 2]`` and client 1's ``[8, 10]``, given
here as they are. FedJAX steps ``v`` on ``grad f(vbar)``
(``personal_gradient='mixed'``) and keeps one ``alpha`` per parameter leaf:
its models have one leaf.

Tolerances: FedJAX's numbers are float32 results printed to 7-8 digits from
at most a few products and sums: ``rtol = ft.rtol(16)`` (about 2e-6) covers
both roundings. The NumPy oracle's are those of ``CHAIN``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
import linreg_oracle as ref
from fedjx.algorithms.apfl_lib import initial_row
from fedjx.algorithms.apfl_lib import personalize_fn
from fedjx.datasets.cohort import Cohort
from test_algorithms_util import CHAIN, KEY, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

RTOL = ft.rtol(16)
STRATEGIES = [('vmap', None),
              pytest.param('chunked', 1, marks=pytest.mark.slow),
              pytest.param('sequential', None, marks=pytest.mark.slow),
              pytest.param('auto', None, marks=pytest.mark.slow)]


class RowStore:
  """Clients' rows in a dict; a client never written reads ``initial``."""

  def __init__(self, initial):
    self.initial = jax.tree.map(np.asarray, initial)
    self.rows = {}

  def read(self, ids):
    rows = [self.rows.get(int(i), self.initial) for i in ids]
    return jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *rows)

  def write(self, ids, rows):
    for j, i in enumerate(ids):
      if i >= 0:
        self.rows[int(i)] = jax.tree.map(lambda x: np.asarray(x[j]), rows)


def fedjax_loss(params, batch):
  return 0.5 * jnp.sum(params['w'] ** 2) * batch['inv_sum']


def fedjax_cohort(x, mask, rows, num_examples=None):
  """A cohort of the given batches; ``num_examples`` the distinct examples."""
  x = np.asarray(x, np.float32)
  mask = np.asarray(mask, bool)
  s = np.where(mask, x, 0.0).sum(-1, keepdims=True)
  inv = np.where(mask, 1.0 / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)
  c = x.shape[0]
  return Cohort({'x': jnp.asarray(x), 'inv_sum': jnp.asarray(inv)},
                jnp.asarray(mask), jnp.asarray(
                    mask.sum((1, 2)) if num_examples is None else num_examples,
                    jnp.float32),
                jnp.arange(c, dtype=jnp.int32), rows)


def fedjax_algorithm(**kw):
  return algos.apfl(fedjax_loss, client_optimizer=optax.sgd(1.0),
                    server_optimizer=optax.sgd(1.0), init_alpha=0.5,
                    alpha_learning_rate=1.0, personal_gradient='mixed', **kw)


@pytest.mark.parametrize('strategy,chunk', STRATEGIES)
def test_fedjax_apply_numbers_under_every_map_strategy(strategy, chunk):
  algo = fedjax_algorithm(client_metrics=True).compile(
      map_strategy=strategy, chunk_size=chunk)
  params = {'w': jnp.array([0., 2., 4.])}
  state = algo.init(params)
  np.testing.assert_array_equal(state.params['w'], params['w'])
  store = RowStore(algo.client_state_init(params))
  cohort = fedjax_cohort([[[4., 6.], [2., 2.]], [[8., 10.], [0., 0.]]],
                         [[[1, 1], [1, 1]], [[1, 1], [0, 0]]], store.read([0, 1]),
                         num_examples=[3, 2])  # [2, 2] repeats an example.
  state, metrics, rows = algo.round(state, cohort, KEY)
  np.testing.assert_allclose(state.params['w'], [0., 1.5655555, 3.131111], rtol=RTOL)
  np.testing.assert_allclose(rows['params']['w'][0], [0., 1.35, 2.7], rtol=RTOL)
  np.testing.assert_allclose(rows['params']['w'][1], [0., 1.888889, 3.777778],
                             rtol=RTOL)
  np.testing.assert_allclose(rows['alpha'], [0.5, 0.5], rtol=RTOL)
  np.testing.assert_array_equal(rows['rounds'], [1, 1])
  # FedJAX's delta_l2_norm of each client.
  np.testing.assert_allclose(metrics['client_update_norm'],
                             [1.4534444262, 0.2484521282], rtol=RTOL)


def test_fedjax_train_for_each_client_numbers():
  # Six clients, one batch [2, 4, 6] each, rows that trained before.
  v = np.array([2., 2., 2., 8., 8., 8.], np.float32)
  alpha = np.array([0., 0.5, 1., 0., 0.5, 1.], np.float32)
  rows = {'params': {'w': jnp.asarray(v)}, 'alpha': jnp.asarray(alpha),
          'rounds': jnp.ones(6, jnp.int32)}
  cohort = fedjax_cohort([[[2., 4., 6.]]] * 6, [[[1, 1, 1]]] * 6, rows)
  algo = fedjax_algorithm(client_metrics=True)
  state, _, new = algo.round(algo.init({'w': jnp.array(4.0)}), cohort, KEY)
  np.testing.assert_allclose(new['params']['w'],
                             [1.6666666, 1.75, 1.8333334, 7.6666665, 7.5, 7.3333335],
                             rtol=RTOL)
  np.testing.assert_allclose(new['alpha'], [0.6666667, 1., 1., 0., 0., 0.],
                             rtol=RTOL, atol=RTOL)
  # Every client's delta is 0.33333325; the server takes their mean.
  np.testing.assert_allclose(state.params['w'], 4.0 - 0.33333325, rtol=RTOL)


def test_fedjax_eval_numbers_through_personalize_fn():
  # FedJAX's fake model: example j is classified by one_hot(x_j w_j % 3).
  personalize = personalize_fn()
  server = algos.ServerState(params={'w': jnp.array([0., 2., 4.])}, opt_state=(),
                             hparams={}, round_index=jnp.zeros((), jnp.int32))
  x, y = np.array([0., 2., 4.]), np.array([0, 2, 2])
  want = {0.: 1 / 3, 0.5: 1 / 3, 1.: 1.}
  for a, acc in want.items():
    row = {'params': {'w': jnp.array([0., 1., 2.])}, 'alpha': jnp.float32(a),
           'rounds': jnp.int32(1)}
    w = np.asarray(personalize(server, row, None)['w'])
    assert np.mean(np.mod(x * w, 3).astype(int) == y) == pytest.approx(acc)
  # A client with no row (b'cid3') and one that never trained: the server model.
  np.testing.assert_array_equal(personalize(server, None, None)['w'], [0., 2., 4.])
  fresh = initial_row({'w': jnp.array([9., 9., 9.])})
  np.testing.assert_array_equal(personalize(server, fresh, None)['w'], [0., 2., 4.])


# ----------------------------------------------------- float64 NumPy oracle

B, LR, SERVER_LR, ETA_A, ALPHA0 = 3, 0.1, 0.7, 0.3, 0.25
SIZES = [7, 4, 5, 6]


def _grad(p, xb, yb):
  r = (xb @ p['w'] + p['b'] - yb) / len(yb)
  return {'w': xb.T @ r, 'b': np.sum(r)}


def reference_client(x, row, data, chain):
  """One client's local APFL steps in float64 (the module docstring)."""
  v = ref.as64(x) if row['rounds'] == 0 else ref.as64(row['params'])
  w, a = ref.as64(x), float(row['alpha'])
  xs, ys = np.asarray(data['x'], np.float64), np.asarray(data['y'], np.float64)
  for i in range(0, len(ys), B):
    xb, yb = xs[i:i + B], ys[i:i + B]
    vbar = {k: a * v[k] + (1 - a) * w[k] for k in w}
    gw, g = _grad(w, xb, yb), _grad(vbar, xb, yb)
    ga = sum(float(np.sum((v[k] - w[k]) * g[k])) for k in w)
    w = {k: w[k] - LR * gw[k] for k in w}
    v = {k: v[k] - LR * (a if chain else 1.0) * g[k] for k in v}
    a = min(max(a - ETA_A * ga, 0.0), 1.0)
  return w, {'params': v, 'alpha': a, 'rounds': row['rounds'] + 1}


def _data(seed):
  return linreg_data(np.random.default_rng(30 + seed), SIZES, shift=2.0)


@pytest.mark.parametrize('chain', [True, pytest.param(False, marks=pytest.mark.slow)])
def test_two_rounds_match_numpy_with_a_client_drawn_twice(chain):
  algo = algos.apfl(linreg_loss, client_optimizer=algos.default_sgd(LR),
                    server_optimizer=algos.default_sgd(SERVER_LR),
                    init_alpha=ALPHA0, alpha_learning_rate=ETA_A,
                    personal_gradient='chain' if chain else 'mixed')
  state = algo.init(linreg_params())
  store = RowStore(algo.client_state_init(linreg_params()))
  x = ref.as64(linreg_params())
  oracle_rows = {}
  population = _data(0)
  # Round 2 draws client 2 again, a new client 3 and a padding client.
  for ids in ([0, 1, 2], [2, 3, -1]):
    clients = [population[i] if i >= 0 else
               {'x': np.zeros((0, 3), np.float32), 'y': np.zeros(0, np.float32)}
               for i in ids]
    cohort = make_cohort(clients, batch_size=B, steps=3, client_ids=ids)
    cohort = Cohort(*cohort, client_states=store.read(ids))
    state, metrics, rows = algo.round(state, cohort, KEY)
    store.write(ids, rows)
    # The oracle.
    num, den = {k: np.zeros_like(v) for k, v in x.items()}, 0.0
    for i in ids:
      if i < 0:
        continue
      row = oracle_rows.get(i, {'params': x, 'alpha': ALPHA0, 'rounds': 0})
      y, oracle_rows[i] = reference_client(x, row, population[i], chain)
      n = len(population[i]['y'])
      num = {k: num[k] + n * (x[k] - y[k]) for k in x}
      den += n
    x = {k: x[k] - SERVER_LR * num[k] / den for k in x}
    assert_trees_close(state.params, x, n=CHAIN * 2)
    for j, i in enumerate(ids):
      if i < 0:  # The padding client's row comes back as it was read.
        np.testing.assert_array_equal(rows['rounds'][j], 0)
        assert_trees_close(jax.tree.map(lambda r: r[j], rows['params']),
                           linreg_params(), n=1)
        continue
      want = oracle_rows[i]
      assert_trees_close(jax.tree.map(lambda r: r[j], rows['params']),
                         want['params'], n=CHAIN * 2)
      # alpha: a sum over parameters of the float32 models' products.
      np.testing.assert_allclose(rows['alpha'][j], want['alpha'],
                                 rtol=ft.rtol(CHAIN * 2), atol=ft.rtol(CHAIN * 2))
      assert int(rows['rounds'][j]) == want['rounds']
    real = [oracle_rows[i]['alpha'] for i in ids if i >= 0]
    np.testing.assert_allclose(metrics['alpha_mean'], np.mean(real),
                               rtol=ft.rtol(CHAIN * 2), atol=ft.rtol(CHAIN * 2))
  assert store.rows[2]['rounds'] == 2  # Client 2 trained from its stored row.


def test_a_nonfinite_client_keeps_its_row_and_is_left_out():
  algo = algos.apfl(linreg_loss, client_evaluation=False)
  data = _data(1)[:2]
  data[1] = {'x': data[1]['x'].copy(), 'y': data[1]['y'].copy()}
  data[1]['y'][0] = np.nan
  store = RowStore(algo.client_state_init(linreg_params()))
  store.rows[1] = {'params': jax.tree.map(lambda p: np.asarray(p) + 1.0,
                                          linreg_params()),
                   'alpha': np.float32(0.75), 'rounds': np.int32(3)}
  cohort = Cohort(*make_cohort(data, batch_size=B), client_states=store.read([0, 1]))
  state, metrics, rows = algo.round(algo.init(linreg_params()), cohort, KEY)
  assert float(metrics['nonfinite_clients']) == 1.0
  assert int(rows['rounds'][1]) == 3 and float(rows['alpha'][1]) == 0.75
  np.testing.assert_array_equal(rows['params']['b'][1], store.rows[1]['params']['b'])
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_a_dp_aggregator_applies_to_the_global_update():
  # The server sees FedAvg's update: a DP aggregator applies to it.
  algo = algos.apfl(linreg_loss, client_evaluation=False,
                    aggregator=algos.aggregators.gaussian(clip_norm=1.0,
                                                          noise_multiplier=0.0))
  params = linreg_params()
  store = RowStore(algo.client_state_init(params))
  cohort = Cohort(*make_cohort(_data(0)[:2], batch_size=B),
                  client_states=store.read([0, 1]))
  _, metrics, _ = algo.round(algo.init(params), cohort, KEY)
  assert np.isfinite(float(metrics['train_loss_during']))


def test_errors_are_one_line():
  algo = algos.apfl(linreg_loss)
  params = linreg_params()
  cohort = Cohort(*make_cohort(_data(0)[:2], batch_size=B))
  with pytest.raises(ValueError, match=r'apfl: cohort.client_states=None'):
    algo.round(algo.init(params), cohort, KEY)
  with pytest.raises(ValueError, match=r'apfl: run_rounds is not available'):
    algo.run_rounds(algo.init(params), cohort, jnp.stack([KEY]))
  with pytest.raises(ValueError, match=r'apfl: init_alpha=1.5 is not allowed'):
    algos.apfl(linreg_loss, init_alpha=1.5)
  with pytest.raises(ValueError, match=r"personal_gradient='both' is not one of"):
    algos.apfl(linreg_loss, personal_gradient='both')
  with pytest.raises(ValueError, match=r'option client_transform=.* is not taken'):
    algos.apfl(linreg_loss, client_transform=optax.identity())
