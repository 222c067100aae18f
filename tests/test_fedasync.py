"""FedAsync against a float64 NumPy reading of Xie et al. 2019, Algorithm 1.

Each round is one arrival: a client trained (local SGD on ``f + (rho/2)
||y - x_tau||^2``) from the version ``x_tau`` it received ``tau`` server
updates ago; the server mixes ``x <- (1 - alpha s(tau)) x + alpha s(tau) y``.

Tolerance: per arrival the float32 work is local SGD (the chain of
``test_algorithms_util.CHAIN`` terms) and a mix (3 terms); the references
run in float64, over ``R`` arrivals ``n = R * CHAIN``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
import linreg_oracle as ref
from fedjx import datasets
from fedjx.algorithms import aggregators
from fedjx.algorithms.fedbuff_lib import AsyncCohort
from fedjx.algorithms.fedbuff_lib import staleness_weight
from fedjx.datasets import async_schedule as sched
from test_algorithms_util import CHAIN, KEY, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

B, LR, ALPHA, RHO = 4, 0.1, 0.6, 0.5
STALENESS = [0, 1, 2, 1, 3]
SIZES = [7, 5, 3, 6, 8]


def _clients():
  return linreg_data(np.random.default_rng(4), SIZES)


def _arrival(data, tau):
  # Two steps for every client (sizes <= 8): one compiled round.
  return AsyncCohort(make_cohort([data], batch_size=B, steps=2),
                     jnp.asarray([tau], jnp.int32))


def s_ref(tau, weighting, a, b):
  """The paper's staleness functions, float64."""
  if weighting == 'constant':
    return 1.0
  if weighting == 'polynomial':
    return (tau + 1.0) ** -a
  return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


def reference(weighting, a, b, rho=RHO, alpha=ALPHA, clip=None):
  """The arrivals of STALENESS in float64: versions x_0, x_1, ... kept."""
  versions = [ref.as64(linreg_params())]
  for t, (data, tau) in enumerate(zip(_clients(), STALENESS)):
    x_tau, x_t = versions[max(t - tau, 0)], versions[t]
    y = ref.sgd(x_tau, data, B, LR, mu=rho)
    delta = {k: s_ref(tau, weighting, a, b) * (x_t[k] - y[k]) for k in x_t}
    if clip is not None:
      delta = {k: v * min(1.0, clip / np.sqrt(ref.sq_norm(delta)))
               for k, v in delta.items()}
    versions.append({k: x_t[k] - alpha * delta[k] for k in x_t})
  return versions[1:]


@pytest.mark.parametrize('weighting,a,b', [
    ('hinge', 2.0, 1.0),
    pytest.param('polynomial', 0.5, 0.0, marks=pytest.mark.slow),
    pytest.param('constant', 0.5, 0.0, marks=pytest.mark.slow)])
def test_arrivals_match_numpy(weighting, a, b):
  algo = algos.fedasync(linreg_loss, alpha=ALPHA, rho=RHO, max_staleness=3,
                        staleness_weighting=weighting, staleness_exponent=a,
                        staleness_hinge=b, client_optimizer=algos.default_sgd(LR))
  state = algo.init(linreg_params())
  want = reference(weighting, a, b)
  for t, (data, tau) in enumerate(zip(_clients(), STALENESS)):
    state, metrics = algo.round(state, _arrival(data, tau), KEY)
    assert_trees_close(state.params, want[t], n=CHAIN * (t + 1))
    np.testing.assert_allclose(metrics['mixing_weight'],
                               ALPHA * s_ref(tau, weighting, a, b),
                               rtol=4 * ft.U32)  # pow and divide: a few ulps.
    assert float(metrics['mean_staleness']) == tau


def test_staleness_functions_are_the_papers():
  tau = np.arange(0, 30)
  np.testing.assert_allclose(
      staleness_weight(tau, 'hinge', 10.0, 4.0),
      [s_ref(t, 'hinge', 10.0, 4.0) for t in tau], rtol=4 * ft.U32)
  np.testing.assert_allclose(staleness_weight(tau, 'polynomial', 0.5),
                             (tau + 1.0) ** -0.5, rtol=4 * ft.U32)
  assert float(staleness_weight(4, 'hinge', 10.0, 4.0)) == 1.0


@pytest.mark.slow
def test_fresh_constant_full_mixing_is_fedavg_of_one_client():
  # alpha = 1, s = 1, tau = 0: x <- y, FedAvg's round on the one client.
  kw = dict(client_optimizer=algos.default_sgd(LR))
  a = algos.fedasync(linreg_loss, alpha=1.0, staleness_weighting='constant', **kw)
  b = algos.fedavg(linreg_loss, **kw)
  sa, sb = a.init(linreg_params()), b.init(linreg_params())
  for data in _clients()[:3]:
    sa, _ = a.round(sa, _arrival(data, 0), KEY)
    sb, _ = b.round(sb, make_cohort([data], batch_size=B, steps=2), KEY)
  assert_trees_close(sa.params, sb.params, n=3 * CHAIN)


def test_an_update_staler_than_the_ring_is_dropped():
  algo = algos.fedasync(linreg_loss, max_staleness=1)
  state = algo.init(linreg_params())
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = algo.round(state, _arrival(_clients()[0], 2), KEY)
  jax.tree.map(np.testing.assert_array_equal, state.params, before)
  assert float(metrics['stale_dropped']) == 1 and int(state.round_index) == 1


def test_a_dp_aggregator_clips_and_noises_the_mixing_step():
  # Gaussian mechanism on Delta = s (x_t - y): clip to C, noise z C, D = 1.
  clip, z = 0.05, 0.5
  algo = algos.fedasync(linreg_loss, alpha=ALPHA, rho=RHO, max_staleness=3,
                        staleness_weighting='hinge', staleness_exponent=2.0,
                        staleness_hinge=1.0, client_optimizer=algos.default_sgd(LR),
                        aggregator=aggregators.gaussian(clip, 0.0))
  state = algo.init(linreg_params())
  want = reference('hinge', 2.0, 1.0, clip=clip)
  for t, (data, tau) in enumerate(zip(_clients(), STALENESS)):
    state, metrics = algo.round(state, _arrival(data, tau), KEY)
    assert_trees_close(state.params, want[t], n=CHAIN * (t + 1))
  assert float(metrics['clipped_fraction']) == 1.0
  # With noise (z is state.hparams['noise_multiplier'], no recompiling): the
  # same step plus alpha N(0, (z C)^2), drawn from the round's key.
  arrival = _arrival(_clients()[0], 0)
  quiet, _ = algo.round(algo.init(linreg_params()), arrival, KEY)
  state = algo.init(linreg_params())
  state = state._replace(hparams=dict(state.hparams, noise_multiplier=jnp.float32(z)))
  noisy, _ = algo.round(state, arrival, KEY)
  zeros = jax.tree.map(jnp.zeros_like, linreg_params())
  noise = aggregators.add_gaussian_noise(zeros, jnp.float32(z * clip), KEY)
  assert_trees_close(noisy.params, jax.tree.map(lambda p, e: p - ALPHA * e,
                                                quiet.params, noise), n=CHAIN)


@pytest.mark.slow
def test_the_schedule_feeds_one_arrival_per_round():
  rng = np.random.default_rng(1)
  sizes = rng.integers(2, 9, size=12)
  data = datasets.from_arrays(
      {'x': rng.normal(size=(sizes.sum(), 3)).astype(np.float32),
       'y': rng.normal(size=sizes.sum()).astype(np.float32)},
      groups=np.split(np.arange(sizes.sum()), np.cumsum(sizes)[:-1]))
  scheduler = sched.AsyncScheduler(12, 4, 1, sched.lognormal_durations(12), seed=2)
  algo = algos.fedasync(linreg_loss, max_staleness=8)
  state = algo.init(linreg_params())
  seen = []
  with sched.async_cohort_iterator(data, scheduler, 4, num_rounds=6,
                                   prefetch=0) as cohorts:
    for r, cohort in enumerate(cohorts):
      state, metrics = algo.round(state, cohort, jax.random.key(r))
      seen.append(float(metrics['mean_staleness']))
  # M = 4 clients in flight, one reports per step: after the first three
  # arrivals the staleness of the rest is positive.
  assert seen[0] == 0 and max(seen) > 0 and int(state.round_index) == 6


STRATEGIES = [('chunked', 2), ('sequential', None), ('auto', None)]


@functools.lru_cache(maxsize=None)
def _arrivals(strategy, chunk):
  algo = algos.fedasync(linreg_loss, rho=RHO, max_staleness=3)
  algo = algo.compile(map_strategy=strategy, chunk_size=chunk)
  state = algo.init(linreg_params())
  for data, tau in zip(_clients()[:3], STALENESS):
    state, _ = algo.round(state, _arrival(data, tau), KEY)
  return state.params


@pytest.mark.slow
@pytest.mark.parametrize('strategy,chunk', STRATEGIES)
def test_every_map_strategy_gives_the_vmap_rounds(strategy, chunk):
  assert_trees_close(_arrivals(strategy, chunk), _arrivals('vmap', None),
                     n=3 * CHAIN)


def test_bad_options_and_cohorts_are_one_line_errors():
  with pytest.raises(ValueError, match=r'fedasync: alpha=0\.0 is not allowed'):
    algos.fedasync(linreg_loss, alpha=0.0)
  with pytest.raises(ValueError, match=r"staleness_weighting='linear' is not one of"):
    algos.fedasync(linreg_loss, staleness_weighting='linear')
  algo = algos.fedasync(linreg_loss)
  two = AsyncCohort(make_cohort(_clients()[:2], batch_size=B),
                    jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match='the cohort has 2 clients; FedAsync mixes in one arrival'):
    algo.round(algo.init(linreg_params()), two, KEY)
