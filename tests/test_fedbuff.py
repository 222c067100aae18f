"""FedBuff against FedAvg and against a hand-written NumPy server step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx import datasets
from fedjx.algorithms.fedbuff_lib import AsyncCohort
from fedjx.algorithms.fedbuff_lib import staleness_weight
from fedjx.datasets import async_schedule as sched
import float_tolerance as ft
from test_algorithms_util import CHAIN, KEY, assert_trees_close, copy
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

SIZES = [8, 5, 3, 6]  # Batches of 4: 2, 2, 1 and 2 real steps.


def _cohort(seed=0, sizes=SIZES):
  return make_cohort(linreg_data(np.random.default_rng(seed), sizes), batch_size=4)


def _zero_staleness(cohort):
  return AsyncCohort(cohort, jnp.zeros(cohort.mask.shape[0], jnp.int32))


@pytest.mark.parametrize('strategy', ['vmap', 'sequential', 'chunked'])
def test_zero_staleness_is_fedavg_exactly(strategy):
  # K = M: every client of a step started from the current version.
  kwargs = dict(client_optimizer=optax.sgd(0.1, momentum=0.5),
                server_optimizer=optax.sgd(1.0, momentum=0.9), local_epochs=2)
  chunk = 3 if strategy == 'chunked' else None
  fedavg = algos.fedavg(linreg_loss, **kwargs).compile(strategy, chunk)
  fedbuff = algos.fedbuff(linreg_loss, buffer_size=4, max_staleness=3,
                          **kwargs).compile(strategy, chunk)
  params = linreg_params()
  a, b = fedavg.init(params), fedbuff.init(params)
  for r in range(3):
    cohort = _cohort(r)
    a, ma = fedavg.round(a, cohort, jax.random.key(r))
    b, mb = fedbuff.round(b, _zero_staleness(cohort), jax.random.key(r))
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    for k in ma:
      np.testing.assert_array_equal(ma[k], mb[k], err_msg=k)
    assert float(mb['stale_dropped']) == 0 and float(mb['mean_staleness']) == 0


def test_schedule_with_buffer_equal_to_concurrency_is_fedavg():
  # End to end: the scheduler's cohorts (K = M) through both algorithms.
  rng = np.random.default_rng(1)
  sizes = rng.integers(2, 9, size=12)
  data = datasets.from_arrays(
      {'x': rng.normal(size=(sizes.sum(), 3)).astype(np.float32),
       'y': rng.normal(size=sizes.sum()).astype(np.float32)},
      groups=np.split(np.arange(sizes.sum()), np.cumsum(sizes)[:-1]))
  scheduler = sched.AsyncScheduler(12, 4, 4, sched.lognormal_durations(12), seed=2)
  fedavg = algos.fedavg(linreg_loss)
  fedbuff = algos.fedbuff(linreg_loss, buffer_size=4, max_staleness=0)
  a, b = fedavg.init(linreg_params()), fedbuff.init(linreg_params())
  with sched.async_cohort_iterator(data, scheduler, 4, num_rounds=4,
                                   prefetch=0) as cohorts:
    for r, cohort in enumerate(cohorts):
      a, _ = fedavg.round(a, cohort.cohort, jax.random.key(r))
      b, _ = fedbuff.round(b, cohort, jax.random.key(r))
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)


def test_staleness_weights_are_the_papers():
  tau = np.arange(0, 40)
  np.testing.assert_allclose(staleness_weight(tau), 1.0 / np.sqrt(1.0 + tau),
                             rtol=4 * ft.U32)  # pow: a few ulps.
  np.testing.assert_allclose(staleness_weight(tau, 'polynomial', 2.0),
                             (1.0 + tau) ** -2.0, rtol=4 * ft.U32)
  np.testing.assert_array_equal(staleness_weight(tau, 'constant'),
                                np.ones(40, np.float32))
  assert float(staleness_weight(0)) == 1.0


def _numpy_sgd(p, data, lr, batch_size=4):
  """Local SGD on the linear model, gradients by hand, in float64."""
  w, b = np.asarray(p['w'], np.float64), float(p['b'])
  x, y = data['x'].astype(np.float64), data['y'].astype(np.float64)
  for i in range(0, len(y), batch_size):
    xb, yb = x[i:i + batch_size], y[i:i + batch_size]
    err = xb @ w + b - yb
    w, b = w - lr * err @ xb / len(yb), b - lr * err.mean()
  return {'w': w, 'b': np.float64(b)}


@pytest.mark.parametrize('weighting', ['num_examples', 'uniform'])
def test_stale_step_against_numpy(weighting):
  # A ring of V = 3 versions at server step t = 4: versions 2, 3, 4 in
  # slots 2, 0, 1. Clients of staleness 0, 1, 2 train from versions 4, 3, 2;
  # the client of staleness 3 is dropped.
  lr, server_lr, a = 0.1, 0.7, 0.5
  data = linreg_data(np.random.default_rng(3), SIZES)
  cohort = make_cohort(data, batch_size=4)
  tau = np.array([1, 0, 3, 2], np.int32)
  algo = algos.fedbuff(linreg_loss, client_optimizer=optax.sgd(lr),
                       server_optimizer=optax.sgd(server_lr), max_staleness=2,
                       weighting=weighting, staleness_exponent=a)
  rng = np.random.default_rng(4)
  version = {v: {'w': rng.normal(size=3).astype(np.float32),
                 'b': np.float32(rng.normal())} for v in (2, 3, 4)}
  ring = jax.tree.map(lambda *xs: jnp.stack(xs), version[3], version[4], version[2])
  state = algo.init(linreg_params())._replace(
      params=jax.tree.map(jnp.asarray, version[4]), extras=ring,
      round_index=jnp.asarray(4, jnp.int32))
  new, metrics = algo.round(state, AsyncCohort(cohort, jnp.asarray(tau)), KEY)

  total = {'w': np.zeros(3), 'b': 0.0}
  weight_sum = 0.0
  for i, t in enumerate(tau):
    if t > 2:
      continue
    start = version[4 - t]
    trained = _numpy_sgd(start, data[i], lr)
    w = SIZES[i] if weighting == 'num_examples' else 1.0
    s = (1.0 + t) ** -a
    for k in total:
      total[k] = total[k] + w * s * (np.asarray(start[k], np.float64) - trained[k])
    weight_sum += w
  expected = {k: np.asarray(version[4][k], np.float64) - server_lr * v / weight_sum
              for k, v in total.items()}
  assert_trees_close(new.params, expected)
  assert float(metrics['stale_dropped']) == 1.0
  assert float(metrics['clients']) == 3.0
  np.testing.assert_allclose(metrics['mean_staleness'], 1.0, rtol=ft.rtol(3))
  np.testing.assert_allclose(metrics['examples'], 8 + 5 + 6, rtol=ft.rtol(4))
  # The new version 5 replaced version 2 (slot 5 mod 3 = 2).
  assert int(new.round_index) == 5
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(lambda r: r[2], new.extras), new.params)
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(lambda r: r[0], new.extras), version[3])


def test_ring_holds_the_last_versions():
  algo = algos.fedbuff(linreg_loss, max_staleness=2).compile(donate=False)
  state = algo.init(linreg_params())
  history = [state.params]
  for r in range(5):
    state, _ = algo.round(state, _zero_staleness(_cohort(r)), jax.random.key(r))
    history.append(state.params)
  for v in (3, 4, 5):
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(lambda x: x[v % 3], state.extras), history[v])


def test_all_dropped_changes_nothing():
  # Staleness past the ring, or negative (-1 would make s = 1/0): dropped,
  # not non-finite.
  algo = algos.fedbuff(linreg_loss, max_staleness=1)
  params = linreg_params()
  state = algo.init(params)
  cohort = AsyncCohort(_cohort(), jnp.asarray([2, -1, 5, -3], jnp.int32))
  new, metrics = algo.round(state, cohort, KEY)
  jax.tree.map(np.testing.assert_array_equal, new.params, params)
  assert float(metrics['stale_dropped']) == 4.0 and float(metrics['clients']) == 0.0
  assert float(metrics['nonfinite_clients']) == 0.0


def test_run_rounds_matches_rounds():
  algo = algos.fedbuff(linreg_loss, max_staleness=2,
                       server_optimizer=optax.sgd(0.5, momentum=0.9))
  taus = [[0, 0, 0, 0], [1, 0, 1, 0], [2, 1, 0, 3]]
  cohorts = [AsyncCohort(_cohort(r), jnp.asarray(t, jnp.int32))
             for r, t in enumerate(taus)]
  keys = jnp.stack([jax.random.key(r) for r in range(3)])
  a = algo.init(linreg_params())
  b = copy(a)
  for r, c in enumerate(cohorts):
    a, _ = algo.round(a, c, keys[r])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *cohorts)
  b, metrics = algo.run_rounds(b, stacked, keys)
  assert_trees_close(b.params, a.params, CHAIN)
  np.testing.assert_array_equal(metrics['stale_dropped'], [0, 0, 1])


@pytest.mark.parametrize('kwargs, match', [
    (dict(max_staleness=-1), r'max_staleness=-1'),
    (dict(staleness_weighting='hinge'), r"staleness_weighting='hinge'"),
    (dict(staleness_exponent=-0.5), r'staleness_exponent=-0.5'),
    (dict(buffer_size=0), r'buffer_size=0'),
    (dict(buffer_size=4, concurrency=2), r'concurrency=2'),
    (dict(buffer_sizes=4), r'buffer_sizes=4'),
])
def test_builder_errors_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match):
    algos.fedbuff(linreg_loss, **kwargs)


def test_round_errors_are_one_line():
  algo = algos.fedbuff(linreg_loss, buffer_size=3)
  state = algo.init(linreg_params())
  with pytest.raises(ValueError, match=r'takes an AsyncCohort'):
    algo.round(state, _cohort(), KEY)
  with pytest.raises(ValueError, match=r'4 clients but buffer_size=3'):
    algo.round(state, _zero_staleness(_cohort()), KEY)
  algo = algos.fedbuff(linreg_loss)
  state = algo.init(linreg_params())
  with pytest.raises(ValueError, match=r'staleness must be integers'):
    algo.round(state, AsyncCohort(_cohort(), jnp.zeros(4)), KEY)


def _runner_config(rounds):
  from fedjx.experiments.config_base import base_config, optimizer  # pylint: disable=import-outside-toplevel
  config = base_config()
  config.update(dict(seed=1, rounds=rounds, cohort_size=3, batch_size=16,
                     local_epochs=1, eval_every=4, checkpoint_every=2,
                     progress=False, plot=False, tensorboard=False))
  config.dataset = dict(name='digits', num_clients=20, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(
      name='fedbuff', concurrency=6, max_staleness=2,
      client_durations=dict(name='lognormal', median=10.0, sigma=1.0),
      client_optimizer=optimizer('sgd', learning_rate=0.1))
  return config


def test_runner_reports_the_simulated_time(tmp_path):
  from fedjx.experiments import runner  # pylint: disable=import-outside-toplevel
  config = _runner_config(4)
  config.checkpoint_every = 4
  result = runner.run(config, str(tmp_path))
  scheduler = sched.AsyncScheduler(
      20, 6, 3, sched.lognormal_durations(20, median=10.0, sigma=1.0, seed=1),
      seed=1)
  rows = [row for row in result.history if row['round'] > 0]
  assert [row['simulated_time'] for row in rows] == [
      scheduler.step(r).time for r in range(4)]
  assert [row['mean_staleness'] for row in rows] == pytest.approx(
      [np.mean(scheduler.step(r).staleness) for r in range(4)], rel=ft.rtol(3))


@pytest.mark.slow
def test_runner_resumes_exactly(tmp_path):
  from fedjx.experiments import runner  # pylint: disable=import-outside-toplevel
  straight = runner.run(_runner_config(6), str(tmp_path / 'straight'))
  workdir = str(tmp_path / 'resumed')
  runner.run(_runner_config(3), workdir)
  resumed = runner.run(_runner_config(6), workdir)
  jax.tree.map(np.testing.assert_array_equal, resumed.state, straight.state)


def test_runner_refuses_a_buffer_size_other_than_the_cohort_size(tmp_path):
  from fedjx.experiments import registry, runner  # pylint: disable=import-outside-toplevel
  config = _runner_config(1)
  config.algorithm.buffer_size = 4
  with pytest.raises(registry.ConfigError, match=r'buffer_size=4 differs from '
                     r'config.cohort_size=3'):
    runner.run(config, str(tmp_path))
  config = _runner_config(1)
  config.algorithm.concurrency = 30
  with pytest.raises(registry.ConfigError, match=r'concurrency=30'):
    runner.run(config, str(tmp_path / 'b'))


def test_streamed_round_is_the_compiled_round():
  from fedjx import execution  # pylint: disable=import-outside-toplevel
  algo = algos.fedbuff(linreg_loss, max_staleness=2).compile(donate=False)
  state = algo.init(linreg_params())
  cohort = AsyncCohort(_cohort(), jnp.asarray([0, 1, 2, 3], jnp.int32))
  a, ma = algo.round(state, cohort, KEY)
  b, mb = execution.round_runner(algo, 'streaming', 2)(state, cohort, KEY)
  # Two chunks of two clients: the sums over 4 clients in another order.
  assert_trees_close(b.params, a.params, CHAIN)
  assert float(mb['stale_dropped']) == float(ma['stale_dropped']) == 1.0


@pytest.mark.slow
def test_runner_on_a_mesh_gives_the_same_numbers(tmp_path):
  from fedjx.experiments import runner  # pylint: disable=import-outside-toplevel
  config = _runner_config(2)
  config.cohort_size, config.algorithm.concurrency = 8, 12
  plain = runner.run(config, str(tmp_path / 'plain'))
  config.mesh = 'clients=-1'  # The 8 host devices of tests/conftest.py.
  sharded = runner.run(config, str(tmp_path / 'mesh'))
  # Per-client work is the same; the means over 8 clients are summed in
  # another order (2 rounds).
  assert_trees_close(sharded.state.params, plain.state.params, 2 * 8 + CHAIN)
  assert [r['simulated_time'] for r in sharded.history if r['round']] == [
      r['simulated_time'] for r in plain.history if r['round']]


def test_round_is_a_mapreduce_plan():
  from fedjx import plan as plan_lib  # pylint: disable=import-outside-toplevel
  algo = algos.fedbuff(linreg_loss, max_staleness=2)
  state = algo.init(linreg_params())
  cohort = AsyncCohort(_cohort(), jnp.asarray([0, 1, 2, 3], jnp.int32))
  plan = plan_lib.trace_plan(algo.apply, state, cohort, KEY)
  kinds = [type(step).__name__ for step in plan.steps]
  assert kinds.count('MapStep') == 1  # One pass of client work.


@pytest.mark.parametrize('staleness,used', [([0, 0, 0, 0], True),
                                             ([0, 1, 5, 0], False)])
def test_without_the_guard_a_nan_client_reaches_the_model(staleness, used):
  """What lets the runner run FedBuff's rounds unguarded first
  (fedjx.experiments.guarded_rounds): a NaN client makes the unguarded
  step's model non-finite exactly when the guarded step skips and counts it
  (not when it is dropped as too stale: it takes no steps)."""
  from fedjx.algorithms import nonfinite  # pylint: disable=import-outside-toplevel
  cohort = _cohort()
  x = np.array(cohort.batches['x'])
  x[2, 0, 0, 0] = np.nan  # Client 2: 5 steps stale (past the ring) if not used.
  bad = AsyncCohort(cohort._replace(batches=dict(cohort.batches, x=jnp.asarray(x))),
                    jnp.asarray(staleness, jnp.int32))
  for skip in (False, True):
    algo = algos.fedbuff(linreg_loss, max_staleness=2, skip_nonfinite=skip)
    state, metrics = algo.round(algo.init(linreg_params()), bad, KEY)
    assert bool(nonfinite.all_finite((state.params, metrics))) is (skip or not used)
    if skip:
      assert float(metrics['nonfinite_clients']) == float(used)
