"""Asynchronous DiLoCo: the equal-speed case is DiLoCo; Delayed Nesterov and
a stale outer step against hand-written loops."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.async_diloco_lib import delayed_nesterov
from fedjx.algorithms.fedbuff_lib import AsyncCohort
from fedjx.datasets import async_schedule
import float_tolerance as ft
from test_algorithms_util import KEY, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

SIZES = [8, 4, 6]  # Three replicas; batches of 4: 2, 1 and 2 real steps.
H = 3              # Inner steps, cycling through each replica's real steps.


def _data(seed=40):
  data = linreg_data(np.random.default_rng(seed), SIZES, shift=2.0)
  batches = [[{k: jnp.asarray(v[i:i + 4]) for k, v in d.items()}
              for i in range(0, len(d['y']), 4)] for d in data]
  return data, batches


@pytest.mark.parametrize('strategy', ['vmap', 'sequential'])
def test_equal_speeds_are_diloco_exactly(strategy):
  # All replicas finish together (K = M = R): every staleness is 0.
  inner = optax.inject_hyperparams(optax.adamw)(learning_rate=0.05,
                                                weight_decay=0.1)
  diloco = algos.diloco(linreg_loss, 3, inner_optimizer=inner,
                        inner_steps=H).compile(strategy)
  async_ = algos.async_diloco(linreg_loss, 3, inner_optimizer=inner,
                              inner_steps=H, buffer_size=3).compile(strategy)
  params = linreg_params()
  a, b = diloco.init(params), async_.init(params)
  for r in range(4):
    cohort = make_cohort(_data(r)[0], batch_size=4)
    a, ma = diloco.round(a, cohort, jax.random.key(r))
    b, mb = async_.round(b, AsyncCohort(cohort, jnp.zeros(3, jnp.int32)),
                         jax.random.key(r))
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    jax.tree.map(np.testing.assert_array_equal, a.client_states,
                 b.client_states)
    for k in ma:
      np.testing.assert_array_equal(ma[k], mb[k], err_msg=k)


def _algorithm3(grads, lr, beta, c, n):
  """Liu et al. 2024, Algorithm 3 (Delayed Nesterov) in float64: the
  parameter updates of each outer gradient in turn (``grads`` [T, d])."""
  m, delta, steps = np.zeros(grads.shape[1]), np.zeros(grads.shape[1]), []
  for t, g in enumerate(grads.astype(np.float64)):
    delta = delta + g
    if (t + 1) % n == 0:
      m = beta * m + delta / n
      steps.append(-lr * ((1 - c * n + c) * beta * m + g / n))
      delta = np.zeros_like(delta)
    else:
      steps.append(-lr * (c * beta * m + g / n))
  return np.array(steps)


@pytest.mark.parametrize('n, c', [(3, 0.0), (3, 0.2), (3, 1 / 3), (1, 0.0)])
def test_delayed_nesterov_is_algorithm_3(n, c):
  lr, beta = 0.7, 0.9
  opt = delayed_nesterov(lr, beta, period=n, momentum_activation=c)
  grads = np.random.default_rng(5).normal(size=(10, 4)).astype(np.float32)
  state = opt.init(jnp.zeros(4))
  steps = []
  for g in grads:
    u, state = opt.update(jnp.asarray(g), state)
    steps.append(u)
  # Each step: m is a sum of <= 4 momentum terms (|g| <~ 3, |m| <~ 30),
  # plus two products: n < 10 roundings of terms of magnitude <~ 30 * 0.7.
  np.testing.assert_allclose(np.array(steps), _algorithm3(grads, lr, beta, c, n),
                             rtol=0, atol=ft.atol(10, 30.0))
  if n > 1:  # Derivation: the second period's steps add up to its mean
    # applied once plus beta times (N - 1) c m_1 + (1 - cN + c) m_2.
    g64 = grads.astype(np.float64)
    m1 = g64[:n].mean(0)
    m2 = beta * m1 + g64[n:2 * n].mean(0)
    total = np.array(steps)[n:2 * n].sum(0)
    np.testing.assert_allclose(
        total, -lr * (g64[n:2 * n].mean(0)
                      + beta * ((n - 1) * c * m1 + (1 - c * n + c) * m2)),
        rtol=0, atol=ft.atol(20, 30.0))


def test_delayed_nesterov_in_the_four_replica_scenario():
  # configs/async_diloco_text.py's schedule: 4 replicas whose jobs take 60,
  # 60, 120 and 240 s, K = 1, N = 4, c = 1/4. Replica k's outer gradient is
  # one gradient step (size h) on 0.5 |theta - x_k|^2 from the version it
  # trained from, scaled by s(tau) = (1 + tau)^-1/2.
  lr, beta, n, c, h = 0.7, 0.9, 4, 0.25, 0.5
  x = np.random.default_rng(3).normal(size=(4, 3))
  schedule = async_schedule.AsyncScheduler(
      4, 4, 1, async_schedule.fixed_durations(4, seconds=(60, 60, 120, 240)),
      seed=0)
  steps = [schedule.step(r) for r in range(8)]

  def run(update, theta0, grads=None):
    versions, state = [theta0], None
    for r, step in enumerate(steps):
      k, tau = int(step.client_ids[0]), int(step.staleness[0])
      start = versions[r - tau]
      g = (1 + tau) ** -0.5 * h * (start - x[k])
      if grads is not None:
        grads.append(g)
      u, state = update(g, state, r)
      versions.append(versions[r] + u)
    return np.array(versions[1:])

  def paper(g, state, r):       # Algorithm 3 in float64
    m, delta = state if state is not None else (0.0, 0.0)
    delta = delta + g
    if (r + 1) % n == 0:
      m = beta * m + delta / n
      return -lr * ((1 - c * n + c) * beta * m + g / n), (m, 0.0)
    return -lr * (c * beta * m + g / n), (m, delta)

  def old(g, state, r):         # fedjx <= 0.1.x's reading, float64
    m, buffer = state if state is not None else (0.0, [])
    buffer = buffer + [g]
    if (r + 1) % n == 0:
      mean = np.mean(buffer, axis=0)
      m = beta * m + mean
      return -lr * (beta * m + mean), (m, [])
    return -lr * c * g, (m, buffer)

  opt = delayed_nesterov(lr, beta, period=n, momentum_activation=c)

  def ours(g, state, r):
    state = opt.init(jnp.zeros(3, jnp.float32)) if state is None else state
    u, state = opt.update(jnp.asarray(g, jnp.float32), state)
    return np.asarray(u, np.float64), state

  theta0, g = np.zeros(3), []
  expected, before = run(paper, theta0, g), run(old, theta0)
  # By hand: at 60 s the two fast replicas report (tau 0, 1); at 120 s the
  # 120 s replica (started at 0, tau 2), then a fast one (started at step 1's
  # version 1 at 60 s, tau 2): the ring's older versions are read.
  assert [int(s.staleness[0]) for s in steps[:4]] == [0, 1, 2, 2]
  # The two readings agree while m = 0 and c = 1/N, and part at step 3,
  # where the old one applied g_0 .. g_2 a second time.
  np.testing.assert_allclose(before[:3], expected[:3], rtol=1e-12, atol=1e-15)
  # Exactly the doubled gradients and the momentum's missing (1 - c) share:
  # old - new = -eta ((g_0 + g_1 + g_2) / N + (1 - c) beta mean(g_0 .. g_3)).
  mean = np.mean(g[:4], axis=0)
  np.testing.assert_allclose(
      before[3] - expected[3],
      -lr * (np.sum(g[:3], axis=0) / n + (1 - c) * beta * mean), rtol=1e-12)
  assert np.max(np.abs(before[3] - expected[3])) > 1e-2
  # float32 against float64: 8 steps of a few products and sums each, the
  # iterates and gradients of magnitude <~ 3: n < 100 roundings of <~ 3.
  np.testing.assert_allclose(run(ours, theta0), expected, rtol=0,
                             atol=ft.atol(100, 3.0))


def test_gradient_scale_is_not_an_argument():
  with pytest.raises(TypeError, match='positional'):
    delayed_nesterov(0.7, 0.9, 4, 0.25)  # pylint: disable=too-many-function-args
  with pytest.raises(TypeError, match='gradient_scale'):
    delayed_nesterov(0.7, 0.9, 4, gradient_scale=0.25)  # pylint: disable=unexpected-keyword-arg
  with pytest.raises(ValueError, match='gradient_scale'):
    algos.async_diloco(linreg_loss, 3, delay_period=4, gradient_scale=0.25)


def test_stale_outer_step_against_a_loop():
  # Versions 1 and 2 in a ring of V = 2 at outer step t = 2. Replica 0
  # reports fresh (tau 0), replica 2 one step stale, replica 1 is dropped
  # (tau 2); inner SGD with momentum, so each replica's inner state matters.
  data, batches = _data()
  cohort = make_cohort(data, batch_size=4)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.5)
  lr = 0.6
  algo = algos.async_diloco(linreg_loss, 3, inner_optimizer=inner,
                            inner_steps=H, max_staleness=1,
                            outer_optimizer=optax.sgd(lr)).compile(donate=False)
  rng = np.random.default_rng(8)
  version = {v: {'w': jnp.asarray(rng.normal(size=3), jnp.float32),
                 'b': jnp.asarray(rng.normal(), jnp.float32)} for v in (1, 2)}
  traces = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape),
                                               jnp.float32), version[1])
            for _ in SIZES]
  state = algo.init(linreg_params())
  with_trace = lambda t: inner.init(version[1])._replace(
      inner_state=(optax.TraceState(trace=t), optax.EmptyState()))
  inner_states = jax.tree.map(lambda *xs: jnp.stack(xs),
                              *[with_trace(t) for t in traces])
  trace_of = lambda states, k: jax.tree.map(lambda x: x[k],
                                            states.inner_state[0].trace)
  state = state._replace(
      params=version[2], round_index=jnp.asarray(2, jnp.int32),
      extras=jax.tree.map(lambda a, b: jnp.stack([a, b]), version[2], version[1]),
      client_states=inner_states)
  tau = jnp.asarray([0, 2, 1], jnp.int32)
  new, metrics = algo.round(state, AsyncCohort(cohort, tau), KEY)

  grad = jax.grad(lambda p, b: jnp.mean(linreg_loss(p, b)))
  total, weight = None, 0.0
  for k, t in enumerate([0, 2, 1]):
    if t > 1:
      continue
    start = version[2 - t]
    y, trace = start, traces[k]
    for h in range(H):
      g = grad(y, batches[k][h % len(batches[k])])
      trace = jax.tree.map(lambda m, g: g + 0.5 * m, trace, g)
      y = jax.tree.map(lambda p, m: p - 0.05 * m, y, trace)
    s = SIZES[k] * (1.0 + t) ** -0.5
    d = jax.tree.map(lambda a, b: s * (a - b), start, y)
    total = d if total is None else jax.tree.map(jnp.add, total, d)
    weight += SIZES[k]
    # The replica's inner state after its steps is stored.
    assert_trees_close(trace_of(new.client_states, k), trace)
  expected = jax.tree.map(lambda x, g: x - lr * g / weight, version[2], total)
  assert_trees_close(new.params, expected)
  # The dropped replica kept its inner state.
  assert_trees_close(trace_of(new.client_states, 1), traces[1])
  assert float(metrics['stale_dropped']) == 1.0
  assert float(metrics['clients']) == 2.0


@pytest.mark.parametrize('kwargs, match', [
    (dict(delay_period=0), r'delay_period=0'),
    (dict(momentum_activation=-1.0), r'momentum_activation=-1.0'),
    (dict(delay_period=4, momentum_activation=0.3), r'momentum_activation=0.3'),
    (dict(outer_optimizer=optax.sgd(1.0), delay_period=2), r'delay_period=2'),
    (dict(max_staleness=1.5), r'max_staleness=1.5'),
    (dict(buffer_size=3, concurrency=2), r'concurrency=2'),
])
def test_errors_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match):
    algos.async_diloco(linreg_loss, 3, **kwargs)
