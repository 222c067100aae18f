"""HypCluster against FedJAX's hyp_cluster test scenarios and a float64 NumPy oracle.

FedJAX (``fedjax/algorithms/hyp_cluster_test.py``) scenarios rebuilt with
fedjx's API: a scalar model ``p`` with the loss ``(p - x)^2``, whose SGD
step of 0.5 lands on ``x`` (so FedJAX's shuffled repeated batches of one
example give the numbers of fedjx's ordered ones), the k-means++-like
initialisation, the cluster choice by mean loss (FedJAX's
``maximization_step``) and the evaluation on the chosen cluster
(``HypClusterEvaluator``). FedJAX's per-example losses there take a random
key that flips the sign of the cluster's center per batch; fedjx's loss
takes none. Flipping every cluster's sign on a batch is the same as negating
that batch's ``x``, so clients ``near0``, ``near-1`` and ``near2`` are
rebuilt with those batches negated; ``near1`` (only cluster 1 flipped) has
no such form and is left out. FedJAX's ``expectation_step`` test assigns
client ``4`` to a cluster that is not its lowest-loss one, which fedjx's
choice does not do; its part with a cluster no client chose is rebuilt.

Tolerances: FedJAX's numbers are float32 results of a few operations:
``rtol = ft.rtol(16)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
import linreg_oracle as ref
from fedjx.algorithms.hyp_cluster_lib import cluster_losses
from fedjx.algorithms.hyp_cluster_lib import kmeans_init
from fedjx.algorithms.hyp_cluster_lib import personalize_fn
from fedjx.algorithms.hyp_cluster_lib import select
from fedjx.algorithms.hyp_cluster_lib import stack
from test_algorithms_util import CHAIN, KEY, assert_trees_close
from test_algorithms_util import linreg_loss, make_cohort

RTOL = ft.rtol(16)


def square_loss(p, batch):
  return jnp.square(p - batch['x'])


def scalars(*values):
  return [{'x': np.asarray(v, np.float32)} for v in values]


FEDJAX_CLIENTS = scalars([1.1], [0.9, 0.9], [-1.1], [-0.9, -0.9, -0.9])


def fedjax_algorithm(**kw):
  return algos.hyp_cluster(square_loss, kw.pop('k', 2),
                           client_optimizer=optax.sgd(0.5),
                           server_optimizer=kw.pop('server', optax.sgd(0.25)),
                           local_epochs=5, **kw)


@pytest.mark.parametrize('strategy,chunk', [
    ('vmap', None), pytest.param('chunked', 3, marks=pytest.mark.slow),
    pytest.param('sequential', None, marks=pytest.mark.slow),
    pytest.param('auto', None, marks=pytest.mark.slow)])
def test_fedjax_hyp_cluster_numbers_under_every_map_strategy(strategy, chunk):
  algo = fedjax_algorithm(client_metrics=True).compile(
      map_strategy=strategy, chunk_size=chunk)
  state = algo.init([jnp.array(1.), jnp.array(-1.)])
  state, metrics = algo.round(state, make_cohort(FEDJAX_CLIENTS, batch_size=1),
                              KEY)
  np.testing.assert_array_equal(metrics['client_cluster'], [0, 0, 1, 1])
  np.testing.assert_allclose(state.extras,
                             [1. - 0.25 * 0.1 / 3, -1. + 0.25 * 0.2 / 4], rtol=RTOL)
  # Cluster 1 carries 4 of the 7 examples: the one-model view is its model.
  np.testing.assert_allclose(state.params, -1. + 0.25 * 0.2 / 4, rtol=RTOL)
  assert [float(metrics[f'cluster_clients_{k}']) for k in range(2)] == [2., 2.]


@pytest.mark.slow
def test_fedjax_no_op_on_empty_data():
  algo = fedjax_algorithm()
  empty = make_cohort(scalars([]), batch_size=1)
  state, metrics = algo.round(algo.init([jnp.array(1.), jnp.array(-1.)]), empty, KEY)
  np.testing.assert_array_equal(state.extras, [1., -1.])
  assert float(metrics['clients']) == 0.0


def test_fedjax_an_unchosen_cluster_is_kept():
  # FedJAX's expectation_step: a cluster at 3.14 no client chooses keeps its
  # model and (here, momentum) optimizer state.
  algo = fedjax_algorithm(k=3, server=optax.sgd(0.25, momentum=0.9))
  state = algo.init([jnp.array(1.), jnp.array(-1.), jnp.array(3.14)])
  cohort = make_cohort(FEDJAX_CLIENTS + scalars([-0.1]), batch_size=1)
  for _ in range(2):
    state, _ = algo.round(state, cohort, KEY)
  np.testing.assert_allclose(state.extras[2], 3.14, rtol=RTOL)
  np.testing.assert_array_equal(state.opt_state[0].trace[2], 0.0)
  assert float(state.opt_state[0].trace[0]) != 0.0


def test_fedjax_maximization_step_numbers():
  def l1_loss(p, batch):  # FedJAX's L1 distance plus its regularizer 0.01 |p|.
    return jnp.abs(p - batch['x']) + 0.01 * jnp.abs(p)

  centers = stack([jnp.array(0.), jnp.array(-1.), jnp.array(2.)])
  # FedJAX's flips folded into the data (module docstring), batches of 2.
  clients = scalars([0.1], [-0.9, -1.1, -1.3], [1.9, 2.1, 2.1])
  cohort = make_cohort(clients, batch_size=2)
  want = [[0.1, 1.1 + 0.01, 1.9 + 0.02],
          [1.1, 0.5 / 3 + 0.01, 3.1 + 0.02],
          [6.1 / 3, 9.1 / 3 + 0.01, 0.1 + 0.02]]
  for i, (w, k) in enumerate(zip(want, [0, 1, 2])):
    b, m = jax.tree.map(lambda a: a[i], (cohort.batches, cohort.mask))
    np.testing.assert_allclose(cluster_losses(l1_loss, centers, b, m), w, rtol=RTOL)
    assert int(select(l1_loss, centers, b, m)) == k


def test_fedjax_kmeans_init_numbers():
  def loss(p, batch):
    return jnp.square(p - batch['x']) + batch['bias']
  clients = [{'x': np.array([x], np.float32), 'bias': np.array([b], np.float32)}
             for x, b in [(1.01, -2.), (3.02, -1.), (3.03, 1.), (1.04, 2.)]]
  cohort = make_cohort(clients, batch_size=1)
  opt = optax.sgd(0.5)
  # FedJAX's two keys make clients 0 and 2 the first center.
  got = kmeans_init(loss, jnp.array(0.3), cohort, 3, client_optimizer=opt,
                    local_epochs=5, first=0)
  np.testing.assert_allclose(got, [1.01, 3.03, 1.04], rtol=RTOL)
  got = kmeans_init(loss, jnp.array(0.3), cohort, 3, client_optimizer=opt,
                    local_epochs=5, first=2)
  np.testing.assert_allclose(got, [3.03, 1.04, 1.04], rtol=RTOL)
  drawn = kmeans_init(loss, jnp.array(0.3), cohort, 1, client_optimizer=opt,
                      local_epochs=5, key=jax.random.key(3))
  assert np.isclose(float(drawn[0]), [1.01, 3.02, 3.03, 1.04], rtol=RTOL).any()


def test_fedjax_evaluator_numbers_through_personalize_fn():
  def loss(p, batch):
    return jnp.abs(batch['y'] * 2.0 - 1.0 - p * batch['x'])

  state = algos.hyp_cluster(loss, 2).init([jnp.array(1.), jnp.array(-1.)])
  train = [{'x': np.array([3., 2., 1.], np.float32), 'y': np.array([1., 1., 0.], np.float32)},
           {'x': np.array([0.9, -0.9, 0.8, -0.8, -0.3], np.float32),
            'y': np.array([0., 1., 0., 1., 0.], np.float32)}]
  test = [(np.array([0.9, -0.9, 0.8, -0.8, -0.3]), np.array([1, 0, 1, 0, 1])),
          (np.array([3., 2., 1.]), np.array([0, 0, 1]))]
  personalize = personalize_fn(loss)
  for batch_size in [1, 2, 4]:
    cohort = make_cohort(train, batch_size=batch_size)
    for i, (acc, k) in enumerate(zip([4 / 5, 2 / 3], [0, 1])):
      split = {'batches': jax.tree.map(lambda a: a[i], cohort.batches),
               'mask': cohort.mask[i]}
      p = float(personalize(state, None, split))
      assert p == float(state.extras[k])
      # FedJAX's model: logits [-p x, p x], accuracy of the argmax.
      x, y = test[i]
      assert np.mean((p * x > 0).astype(int) == y) == pytest.approx(acc)


# ----------------------------------------------------- float64 NumPy oracle

B, LR, SERVER_LR = 3, 0.1, 0.6


def _two_groups(seed):
  """Clients 0, 2, 4 around one linear model, 1, 3, 5 around another."""
  rng = np.random.default_rng(50 + seed)
  truth = [np.array([2., -1., 0.5]), np.array([-2., 1., -0.5])]
  out = []
  for i, n in enumerate([6, 4, 5, 7, 3, 5]):
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ truth[i % 2] + 0.05 * rng.normal(size=n)).astype(np.float32)
    out.append({'x': x, 'y': y})
  return out


def reference_round(models, clients):
  """One HypCluster round in float64 (the module docstring's equations)."""
  k_of = [int(np.argmin([ref.mean_loss(h, d) for h in models])) for d in clients]
  new = []
  for k, h in enumerate(models):
    members = [i for i, kk in enumerate(k_of) if kk == k]
    if not members:
      new.append(h)
      continue
    n = np.array([len(clients[i]['y']) for i in members], np.float64)
    deltas = [ref.sub(h, ref.sgd(h, clients[i], B, LR)) for i in members]
    new.append({p: h[p] - SERVER_LR * sum(ni * d[p] for ni, d in zip(n, deltas))
                / n.sum() for p in h})
  return new, k_of


def test_two_rounds_match_numpy_with_a_padding_client():
  models = [{'w': np.array([1., -0.5, 0.], np.float32), 'b': np.float32(0.)},
            {'w': np.array([-1., 0.5, 0.], np.float32), 'b': np.float32(0.)}]
  algo = algos.hyp_cluster(linreg_loss, 2, client_optimizer=algos.default_sgd(LR),
                           server_optimizer=algos.default_sgd(SERVER_LR),
                           client_metrics=True)
  state = algo.init([jax.tree.map(jnp.asarray, m) for m in models])
  want = [ref.as64(m) for m in models]
  pad = {'x': np.zeros((0, 3), np.float32), 'y': np.zeros(0, np.float32)}
  for r in range(2):
    data = _two_groups(r)
    cohort = make_cohort(data + [pad], batch_size=B, steps=3,
                         client_ids=list(range(6)) + [-1])
    state, metrics = algo.round(state, cohort, KEY)
    want, k_of = reference_round(want, data)
    np.testing.assert_array_equal(metrics['client_cluster'][:6], k_of)
    assert sorted(set(k_of)) == [0, 1]  # Both clusters trained.
    for k in range(2):
      assert_trees_close(jax.tree.map(lambda a: a[k], state.extras),
                         want[k], n=CHAIN * (r + 1))
    assert float(metrics['clients']) == 6.0


def test_errors_are_one_line():
  with pytest.raises(ValueError, match=r'hyp_cluster: aggregator gaussian \(central DP\) is refused'):
    algos.hyp_cluster(linreg_loss, 2, aggregator=algos.aggregators.gaussian(clip_norm=1.0))
  with pytest.raises(ValueError, match=r'hyp_cluster: num_clusters=0 must be'):
    algos.hyp_cluster(linreg_loss, 0)
  with pytest.raises(ValueError, match=r'hyp_cluster: init_noise=-1.0 is not allowed'):
    algos.hyp_cluster(linreg_loss, 2, init_noise=-1.0)
  with pytest.raises(ValueError, match=r'hyp_cluster: init got 1 models but'):
    algos.hyp_cluster(square_loss, 2).init([jnp.array(1.)])
  cohort = make_cohort(FEDJAX_CLIENTS, batch_size=1)
  with pytest.raises(ValueError, match=r'kmeans_init: first=7 must be the index'):
    kmeans_init(square_loss, jnp.array(0.), cohort, 2, first=7)
  with pytest.raises(ValueError, match=r'kmeans_init: give first'):
    kmeans_init(square_loss, jnp.array(0.), cohort, 2)


def test_one_model_init_spreads_clusters_by_seeded_noise():
  params = {'w': jnp.arange(3, dtype=jnp.float32), 'b': jnp.float32(0.5)}
  state = algos.hyp_cluster(linreg_loss, 3, init_noise=0.1, init_seed=4).init(params)
  leaves = jax.tree.leaves(params)
  for i, (x, got) in enumerate(zip(leaves, jax.tree.leaves(state.extras))):
    np.testing.assert_array_equal(got[0], x)
    for k in (1, 2):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(4), i), k)
      want = np.asarray(x) + 0.1 * np.asarray(jax.random.normal(key, jnp.shape(x)))
      np.testing.assert_allclose(got[k], want, rtol=ft.rtol(2), atol=ft.atol(2, 1.0))
  same = algos.hyp_cluster(linreg_loss, 3, init_noise=0.0).init(params)
  for got in jax.tree.leaves(same.extras):
    np.testing.assert_array_equal(got[1], got[0])
