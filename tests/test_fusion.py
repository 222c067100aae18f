"""Fused map-reduce (fedjx.fusion): same numbers and derivatives, no stacking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import fedjx
from fedjx import fusion
from fedjx import plan as plan_lib

EPS = 2.0**-24  # float32 unit roundoff.


def _data(n=10, d=3, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 4, d)).astype(np.float32)
  y = rng.normal(size=(n, 4)).astype(np.float32)
  w = rng.uniform(0.5, 2.0, size=(n,)).astype(np.float32)
  return x, y, w


def _round(fuse, strategy='chunked', chunk_size=3, n=10):
  """A FedAvg-like round: two local steps of least squares, reductions of all kinds."""

  @fedjx.program(clients=n, map_strategy=strategy, chunk_size=chunk_size, fuse=fuse)
  def round_fn(theta, x, y, w):
    def client(theta, x, y):
      def loss(t):
        return jnp.mean((x @ t - y) ** 2)
      t = theta
      for _ in range(2):
        t = t - 0.1 * jax.grad(loss)(t)
      return theta - t, loss(t), (loss(t) > 0.5).astype(jnp.int32)
    delta, after, count = fedjx.map_fn(client, (fedjx.broadcast(theta), x, y))
    g = fedjx.reduce_weighted_mean(delta, w)
    return (theta - g, fedjx.reduce_mean(after), fedjx.reduce_sum(count),
            fedjx.reduce_sum(delta))
  return round_fn


def _numpy_round(theta, x, y, w):
  """The same round in float64 NumPy: the independent reference."""
  theta = theta.astype(np.float64)
  deltas, afters = [], []
  for xi, yi in zip(x.astype(np.float64), y.astype(np.float64)):
    t = theta.copy()
    for _ in range(2):
      t = t - 0.1 * (2 / len(yi)) * xi.T @ (xi @ t - yi)
    deltas.append(theta - t)
    afters.append(np.mean((xi @ t - yi) ** 2))
  deltas = np.stack(deltas)
  g = (w[:, None] * deltas).sum(0) / w.sum()
  afters = np.array(afters)
  return theta - g, afters.mean(), int((afters > 0.5).sum()), deltas.sum(0)


@pytest.mark.parametrize('strategy,chunk_size', [('chunked', 3), ('chunked', 5),
                                                 ('sequential', None)])
def test_fused_round_matches_numpy_and_unfused(strategy, chunk_size):
  x, y, w = _data()
  theta = np.array([0.3, -0.2, 0.5], np.float32)
  fused = jax.jit(_round(True, strategy, chunk_size))(theta, x, y, w)
  plain = jax.jit(_round(False, strategy, chunk_size))(theta, x, y, w)
  expected = _numpy_round(theta, x, y, w)
  n = x.shape[0]
  # Sums of n float32 terms of size ~1: error below n * eps relative.
  tol = 4 * n * EPS
  for got, ref, exp in zip(fused, plain, expected):
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
  assert fused[2].dtype == plain[2].dtype == jnp.result_type(jnp.sum(jnp.ones(2, jnp.int32)))


def test_fused_round_carries_sums_instead_of_stacking():
  jaxpr = jax.make_jaxpr(_round(True))(*_example()).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  assert 'scan' in names
  assert not any(n.startswith('fedjx_reduce') for n in names)
  # No [n, ...] client output of the map leaves the loop: the scan's outputs
  # are the carried sums only.
  scan = next(e for e in jaxpr.eqns if e.primitive.name == 'scan')
  assert all(v.aval.shape[:1] != (4,) for v in scan.outvars[scan.params['num_carry']:])
  assert len(scan.outvars) == scan.params['num_carry']


def _example():
  x, y, w = _data()
  return np.array([0.3, -0.2, 0.5], np.float32), x, y, w


def test_outputs_used_per_client_stay_stacked():
  n = 6

  @fedjx.program(clients=n, map_strategy='chunked', chunk_size=2)
  def round_fn(theta, x):
    a, b = fedjx.map_fn(lambda t, x: (t * x.sum(), x.sum() ** 2),
                        (fedjx.broadcast(theta), x))
    return fedjx.reduce_sum(a), b  # b is returned per client.

  theta = jnp.float32(1.5)
  x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
  total, b = jax.jit(round_fn)(theta, x)
  np.testing.assert_allclose(total, 1.5 * x.sum(), rtol=4 * n * EPS)
  np.testing.assert_allclose(b, x.sum(1) ** 2, rtol=EPS)


def test_weights_from_the_map_and_zero_weights():
  n = 7

  @fedjx.program(clients=n, map_strategy='chunked', chunk_size=3)
  def round_fn(x):
    v, w = fedjx.map_fn(lambda x: (x * 2.0, x[0] * 0.0), x)
    return fedjx.reduce_weighted_mean(v, w), fedjx.reduce_weighted_mean(
        v, jnp.arange(n, dtype=jnp.float32))

  x = np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 1
  zero, mean = jax.jit(round_fn)(x)
  np.testing.assert_array_equal(zero, np.zeros(2))  # Weights sum to zero.
  wts = np.arange(n)
  np.testing.assert_allclose(mean, (wts[:, None] * 2 * x).sum(0) / wts.sum(),
                             rtol=4 * n * EPS)


@pytest.mark.slow
def test_grad_and_jvp_through_a_fused_round():
  x, y, w = _data(n=6)

  def loss(fuse):
    program = _round(fuse, 'chunked', 4, n=6)  # Padded: 2 chunks of 4.

    def f(theta, w):
      new, after, _, total = program(theta, x, y, w)
      return jnp.sum(new ** 2) + after + jnp.sum(total)
    return jax.jit(f)

  with jax.enable_x64(True):
    theta64 = np.array([0.3, -0.2, 0.5])
    w64 = w.astype(np.float64)
    check_grads(loss(True), (theta64, w64), order=2, modes=('fwd', 'rev'))
    g_fused = jax.grad(loss(True), argnums=(0, 1))(theta64, w64)
    g_plain = jax.grad(loss(False), argnums=(0, 1))(theta64, w64)
    for a, b in zip(g_fused, g_plain):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    t_fused = jax.jvp(loss(True), (theta64, w64), (np.ones(3), np.ones(6)))
    t_plain = jax.jvp(loss(False), (theta64, w64), (np.ones(3), np.ones(6)))
    np.testing.assert_allclose(t_fused, t_plain, rtol=1e-12, atol=1e-12)


def test_plans_are_unchanged_by_fusion():
  args = _example()
  fused = plan_lib.trace_plan(_round(True), *args)
  plain = plan_lib.trace_plan(_round(False), *args)
  assert [type(s).__name__ for s in fused.steps] == [type(s).__name__ for s in plain.steps]
  assert 'MapStep' in [type(s).__name__ for s in fused.steps]


def test_single_chunk_maps_are_not_fused():
  jaxpr = jax.make_jaxpr(_round(True, 'vmap', None))(*_example()).jaxpr
  assert any(e.primitive.name == 'fedjx_reduce_weighted_mean' for e in jaxpr.eqns)


def test_program_fuse_must_be_bool():
  with pytest.raises(ValueError, match='fuse=1'):
    fedjx.program(clients=2, fuse=1)


def test_carry_dtype():
  assert fusion.carry_dtype(jnp.bfloat16) == jnp.float32
  assert fusion.carry_dtype(jnp.int32) == jnp.int32


@pytest.mark.parametrize('name', ['fedavg', 'scaffold'])
def test_algorithms_fused_equal_unfused(name):
  import optax  # pylint: disable=g-import-not-at-top
  from fedjx import algorithms, datasets, frames  # pylint: disable=g-import-not-at-top
  n = 10
  rng = np.random.default_rng(0)

  def loss(params, batch):
    logits = batch['x'] @ params['w']
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])

  batches = {'x': rng.normal(size=(n, 2, 4, 5)).astype(np.float32),
             'y': rng.integers(0, 3, size=(n, 2, 4)).astype(np.int32)}
  mask = np.ones((n, 2, 4), bool)
  cohort = datasets.Cohort(batches, mask, mask.sum((1, 2)).astype(np.float32),
                           np.arange(n, dtype=np.int32))
  kwargs = dict(client_optimizer=optax.sgd(0.1))
  algo = (algorithms.fedavg(loss, **kwargs) if name == 'fedavg'
          else algorithms.scaffold(loss, n, **kwargs)).compile(
              map_strategy='chunked', chunk_size=3)
  state, key = algo.init({'w': jnp.full((5, 3), 0.1)}), jax.random.key(0)
  fused = jax.jit(algo.apply)(state, cohort, key)
  with frames.without_fusion():
    plain = jax.jit(algo.apply)(state, cohort, key)
    plain_eqns = jax.make_jaxpr(algo.apply)(state, cohort, key).jaxpr.eqns
  fused_eqns = jax.make_jaxpr(algo.apply)(state, cohort, key).jaxpr.eqns
  # The reductions of the map's outputs (the update w_i Delta_i and its
  # weights) are carried in the chunk loop: fewer reductions stay outside it.
  count = lambda eqns: sum(e.primitive.name.startswith('fedjx_reduce') for e in eqns)
  assert count(fused_eqns) < count(plain_eqns)
  tol = 4 * n * EPS  # Sums of n float32 terms in another order.
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
