"""AFL against FedJAX's agnostic_fed_avg test scenarios and a float64 NumPy round.

FedJAX (``fedjax/algorithms/agnostic_fed_avg_test.py``): the per-example
loss ``x w`` of one scalar parameter, two clients with domain ids, FedJAX's
expected numbers rebuilt with fedjx's API. FedJAX steps on batch sums
divided by ``beta_k``; fedjx on batch means of ``s_d l`` with ``s_d =
alpha_d n_k / beta_k``. For this loss (linear in ``w``) both are one step
along the client's whole alpha-weighted mean, so each client is given one
batch holding all its examples and the numbers are FedJAX's.

Tolerances: FedJAX's numbers are float32 results printed to 7-8 digits;
ours are sums of at most 9 terms and an exp, in another order: ``rtol =
ft.rtol(16)`` (about 2e-6) covers both roundings.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
import linreg_oracle as ref
from fedjx.algorithms.afl_lib import domain_sums
from fedjx.algorithms.afl_lib import project_simplex
from fedjx.algorithms.afl_lib import update_domain_weights
from test_algorithms_util import CHAIN, KEY, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

RTOL = ft.rtol(16)


def fedjax_loss(params, batch):
  return batch['x'] * params['w']


FEDJAX_CLIENTS = [
    {'x': np.array([1., 2., 4., 3., 6., 1.], np.float32),
     'domain': np.array([1, 0, 0, 0, 2, 2], np.int32)},
    {'x': np.array([8., 10., 5.], np.float32),
     'domain': np.array([1, 3, 1], np.int32)},
]


def test_fedjax_agnostic_federated_averaging_numbers():
  algo = algos.afl(fedjax_loss, client_optimizer=optax.sgd(1.0),
                   server_optimizer=optax.sgd(0.1),
                   init_domain_weights=[0.1, 0.2, 0.3, 0.4],
                   domain_learning_rate=0.01, domain_algorithm='eg',
                   domain_window_size=2, init_domain_window=[1., 2., 3., 4.],
                   client_metrics=True)
  state = algo.init({'w': jnp.array(4.)})
  np.testing.assert_allclose(state.extras['domain_weights'], [0.1, 0.2, 0.3, 0.4])
  np.testing.assert_array_equal(state.extras['domain_window'], [[1., 2., 3., 4.]] * 2)
  cohort = make_cohort(FEDJAX_CLIENTS, batch_size=6)
  state, metrics = algo.round(state, cohort, KEY)
  np.testing.assert_allclose(state.params['w'], 3.5555556, rtol=RTOL)
  np.testing.assert_allclose(state.extras['domain_weights'],
                             [0.08702461, 0.18604803, 0.2663479, 0.46057943],
                             rtol=RTOL)
  np.testing.assert_array_equal(state.extras['domain_window'],
                                [[1., 2., 3., 4.], [3., 3., 2., 1.]])
  # FedJAX's delta_l2_norm of each client.
  np.testing.assert_allclose(metrics['client_update_norm'], [2.8333335, 7.666667],
                             rtol=RTOL)


def test_fedjax_update_domain_weights_numbers():
  lam = jnp.array([0.1, 0.2, 0.3, 0.4])
  loss = jnp.array([10., 0., 5., 0.])
  np.testing.assert_allclose(update_domain_weights(lam, loss, 0.1, 'eg'),
                             [0.198931, 0.14636526, 0.36197326, 0.2927305],
                             rtol=RTOL)
  np.testing.assert_array_equal(
      update_domain_weights(lam, loss, 0.1, 'none'), lam)


def test_fedjax_domain_metrics_numbers():
  # FedJAX's padded batches of 3, the last example of each client padding.
  batches = {'x': jnp.array([[[1., 2., 4.], [3., 6., 1.]],
                             [[8., 10., 5.], [0., 0., 0.]]]),
             'domain': jnp.array([[[1, 0, 0], [0, 2, 2]],
                                  [[1, 3, 1], [0, 0, 0]]])}
  mask = jnp.array([[[True, True, True], [True, True, False]],
                    [[True, True, False], [False, False, False]]])
  params = {'w': jnp.array(4.)}
  for k, (loss, num, beta) in enumerate([([36., 4., 24., 0.], [3., 1., 1., 0.], 0.8),
                                         ([0., 32., 0., 40.], [0., 1., 0., 1.], 0.6)]):
    got_loss, got_num = domain_sums(fedjax_loss, params,
                                            jax.tree.map(lambda a: a[k], batches),
                                            mask[k], batches['domain'][k], 4)
    np.testing.assert_allclose(got_loss, loss, rtol=RTOL)
    np.testing.assert_array_equal(got_num, num)
    alpha = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(alpha @ np.asarray(got_num), beta, rtol=RTOL)


# ----------------------------------------------------- float64 NumPy round

D, B, LR, SERVER_LR, ETA = 3, 4, 0.1, 0.5, 0.5
SIZES = [8, 5, 3, 6]


def _data(seed):
  rng = np.random.default_rng(100 + seed)
  out = linreg_data(rng, SIZES)
  for i, d in enumerate(out):  # Client i mostly of domain i mod D.
    d['domain'] = np.where(rng.random(len(d['y'])) < 0.7, i % D,
                           rng.integers(0, D, len(d['y']))).astype(np.int32)
  return out


def reference_round(params, lam, window, clients, algorithm, eta):
  """One AFL round in float64 (the module docstring's equations)."""
  alpha = lam / window.mean(axis=0)
  loss_sum, count = np.zeros(D), np.zeros(D)
  num = {k: np.zeros_like(v) for k, v in params.items()}
  den = 0.0
  for data in clients:
    d = data['domain']
    n_d = np.bincount(d, minlength=D).astype(np.float64)
    loss_sum += np.bincount(d, ref.losses(params, data), minlength=D)
    count += n_d
    beta = alpha @ n_d
    if beta == 0:  # Only domains of weight 0: the client counts for nothing.
      continue
    scales = (alpha * len(d) / beta)[d]
    trained = ref.sgd(params, data, B, LR, scales=scales)
    for k in num:
      num[k] += beta * (params[k] - trained[k])
    den += beta
  new = {k: params[k] - SERVER_LR * num[k] / den for k in params}
  domain_loss = loss_sum / count
  if algorithm == 'eg':
    lam = lam * np.exp(eta * domain_loss)
    lam = lam / lam.sum()
  else:
    lam = _simplex_by_bisection(lam + eta * domain_loss)
  window = np.concatenate([window[1:], count[None]])
  return new, lam, window, domain_loss


def _simplex_by_bisection(v):
  """argmin_{p in simplex} ||p - v||: p = max(v - theta, 0), sum p = 1."""
  lo, hi = v.min() - 1.0, v.max()
  for _ in range(200):
    theta = 0.5 * (lo + hi)
    lo, hi = (theta, hi) if np.maximum(v - theta, 0).sum() > 1 else (lo, theta)
  return np.maximum(v - 0.5 * (lo + hi), 0)


# pgd's step is additive: a smaller one keeps lambda inside the simplex for
# the first round and puts one domain's weight at 0 in the second.
@pytest.mark.parametrize('algorithm,eta', [
    ('eg', ETA), pytest.param('pgd', 0.1, marks=pytest.mark.slow)])
def test_two_rounds_match_numpy(algorithm, eta):
  lam0 = np.array([0.5, 0.3, 0.2])
  window0 = np.array([10., 8., 6.])
  algo = algos.afl(linreg_loss, client_optimizer=algos.default_sgd(LR),
                   server_optimizer=algos.default_sgd(SERVER_LR),
                   init_domain_weights=lam0.tolist(), domain_learning_rate=eta,
                   domain_algorithm=algorithm, domain_window_size=2,
                   init_domain_window=window0.tolist())
  state = algo.init(linreg_params())
  params, lam, window = ref.as64(linreg_params()), lam0, np.tile(window0, (2, 1))
  for r in range(2):
    state, metrics = algo.round(state, make_cohort(_data(r), batch_size=B), KEY)
    params, lam, window, domain_loss = reference_round(params, lam, window,
                                                       _data(r), algorithm, eta)
    # The model: CHAIN (local SGD, a weighted mean, a server step) a round.
    assert_trees_close(state.params, params, n=CHAIN * (r + 1))
    # Domain losses: sums of <= 22 non-negative terms of the float32 model.
    np.testing.assert_allclose([metrics[f'domain_loss_{d}'] for d in range(D)],
                               domain_loss, rtol=ft.rtol(CHAIN * (r + 1)))
    # lambda: the losses' relative error times the step eta L it enters
    # (exponent or addend), then a normalisation or projection (3 terms).
    tol = ft.rtol(CHAIN * (r + 1) + 3) * (1.0 + eta * max(domain_loss))
    np.testing.assert_allclose(state.extras['domain_weights'], lam, rtol=tol, atol=tol)
    np.testing.assert_array_equal(state.extras['domain_window'], window)
    assert float(metrics['worst_domain_loss']) == pytest.approx(
        max(domain_loss), rel=ft.rtol(CHAIN * (r + 1)))


def test_project_simplex_is_the_euclidean_projection():
  rng = np.random.default_rng(0)
  for v in [rng.normal(size=5) * 3, np.array([0.2, 0.3, 0.5]),
            np.array([5., -5., 0.]), np.array([0.1, 0.1, 0.1, 0.1])]:
    got = np.asarray(jax.jit(project_simplex)(jnp.asarray(v, jnp.float32)))
    # float32 of entries up to |v| ~ 10: sums of <= 5 terms.
    np.testing.assert_allclose(got, _simplex_by_bisection(v), atol=ft.atol(8, 20))
    assert got.min() >= 0 and abs(got.sum() - 1) < ft.atol(8, 20)


STRATEGIES = [('chunked', 2), ('sequential', None), ('auto', None)]


@functools.lru_cache(maxsize=None)
def _two_rounds(strategy, chunk):
  algo = algos.afl(linreg_loss, num_domains=D, domain_learning_rate=ETA)
  algo = algo.compile(map_strategy=strategy, chunk_size=chunk)
  state = algo.init(linreg_params())
  for r in range(2):
    state, _ = algo.round(state, make_cohort(_data(r), batch_size=B), KEY)
  return state.params, state.extras['domain_weights']


@pytest.mark.slow
@pytest.mark.parametrize('strategy,chunk', STRATEGIES)
def test_every_map_strategy_gives_the_vmap_rounds(strategy, chunk):
  got, want = _two_rounds(strategy, chunk), _two_rounds('vmap', None)
  assert_trees_close(got[0], want[0], n=2 * CHAIN)
  np.testing.assert_allclose(got[1], want[1], rtol=ft.rtol(2 * CHAIN) * 10)


@pytest.mark.slow
def test_domain_ids_outside_the_range_count_in_no_domain():
  data = _data(0)
  data[0]['domain'][:3] = [-1, D, 7]
  algo = algos.afl(linreg_loss, num_domains=D)
  _, metrics = algo.round(algo.init(linreg_params()),
                          make_cohort(data, batch_size=B), KEY)
  counts = sum(np.bincount(d['domain'][(d['domain'] >= 0) & (d['domain'] < D)],
                           minlength=D) for d in data)
  assert all(np.isfinite(float(v)) for v in metrics.values())
  assert counts.sum() == sum(SIZES) - 3


def test_dp_aggregators_and_bad_options_are_refused():
  with pytest.raises(ValueError, match=r'afl: aggregator gaussian \(central DP\) is refused: .*per-domain losses'):
    algos.afl(linreg_loss, num_domains=2,
              aggregator=algos.aggregators.gaussian(clip_norm=1.0))
  with pytest.raises(ValueError, match='give num_domains'):
    algos.afl(linreg_loss)
  with pytest.raises(ValueError, match='summing to 1'):
    algos.afl(linreg_loss, init_domain_weights=[0.5, 0.6])
  with pytest.raises(ValueError, match=r"domain_algorithm='sgd' is not one of"):
    algos.afl(linreg_loss, num_domains=2, domain_algorithm='sgd')
  with pytest.raises(ValueError, match=r'init_domain_window=.*2 positive counts'):
    algos.afl(linreg_loss, num_domains=2, init_domain_window=[1.0])
  algo = algos.afl(linreg_loss, num_domains=2, domain_key='group')
  cohort = make_cohort(_data(0), batch_size=B)
  with pytest.raises(ValueError, match=r"domain_key='group' is not a feature"):
    algo.round(algo.init(linreg_params()), cohort, KEY)
