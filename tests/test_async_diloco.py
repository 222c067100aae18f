"""Asynchronous DiLoCo: the equal-speed case is DiLoCo; Delayed Nesterov and
a stale outer step against hand-written loops."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.async_diloco import delayed_nesterov
from fedjx.algorithms.fedbuff import AsyncCohort
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
    jax.tree.map(np.testing.assert_array_equal, a.inner_opt_states,
                 b.inner_opt_states)
    for k in ma:
      np.testing.assert_array_equal(ma[k], mb[k], err_msg=k)


def test_delayed_nesterov_against_a_loop():
  lr, beta, c, n = 0.7, 0.9, 0.3, 3
  opt = delayed_nesterov(lr, beta, period=n, gradient_scale=c)
  rng = np.random.default_rng(5)
  grads = rng.normal(size=(8, 4)).astype(np.float32)
  x = jnp.zeros(4)
  state = opt.init(x)
  ref, m, buffer = np.zeros(4), np.zeros(4), []
  for t, g in enumerate(grads):
    updates, state = opt.update(jnp.asarray(g), state, x)
    x = optax.apply_updates(x, updates)
    buffer.append(g.astype(np.float64))
    if (t + 1) % n == 0:
      mean = np.mean(buffer, axis=0)
      m = beta * m + mean
      ref = ref - lr * (beta * m + mean)
      buffer = []
    else:
      ref = ref - lr * c * g
    # A running mean of <= 3 terms, a momentum sum over <= 3 periods and
    # <= 8 parameter updates: n < 40 roundings of terms of magnitude <~ 30.
    np.testing.assert_allclose(x, ref, rtol=0, atol=ft.atol(40, 30.0))


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
      versions=jax.tree.map(lambda a, b: jnp.stack([a, b]), version[2], version[1]),
      inner_opt_states=inner_states)
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
    assert_trees_close(trace_of(new.inner_opt_states, k), trace)
  expected = jax.tree.map(lambda x, g: x - lr * g / weight, version[2], total)
  assert_trees_close(new.params, expected)
  # The dropped replica kept its inner state.
  assert_trees_close(trace_of(new.inner_opt_states, 1), traces[1])
  assert float(metrics['stale_dropped']) == 1.0
  assert float(metrics['clients']) == 2.0


@pytest.mark.parametrize('kwargs, match', [
    (dict(delay_period=0), r'delay_period=0'),
    (dict(gradient_scale=-1.0), r'gradient_scale=-1.0'),
    (dict(outer_optimizer=optax.sgd(1.0), delay_period=2), r'delay_period=2'),
    (dict(max_staleness=1.5), r'max_staleness=1.5'),
    (dict(buffer_size=3, concurrency=2), r'concurrency=2'),
])
def test_errors_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match):
    algos.async_diloco(linreg_loss, 3, **kwargs)
