"""The MapReduce primitives against NumPy, and their composition with JAX."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import fedjx

N = 4


def _tree(rng):
  return {
      'w': rng.normal(size=(N, 3, 2)).astype(np.float32),
      'b': rng.integers(-5, 5, size=(N,)).astype(np.int32),
      'nested': (rng.normal(size=(N, 5)).astype(np.float32),),
  }


def test_reductions_match_numpy_on_mixed_pytree():
  rng = np.random.default_rng(0)
  tree = _tree(rng)
  weights = rng.uniform(0.5, 2.0, size=N).astype(np.float32)

  @fedjx.program(clients=N)
  def reduce_all(t, w):
    return (fedjx.reduce_sum(t), fedjx.reduce_mean(t),
            fedjx.reduce_weighted_mean(t, w))

  for fn in (reduce_all, jax.jit(reduce_all)):
    total, mean, wmean = fn(tree, weights)
    for leaf, s, m, wm in zip(jax.tree.leaves(tree), jax.tree.leaves(total),
                              jax.tree.leaves(mean), jax.tree.leaves(wmean)):
      np.testing.assert_allclose(s, leaf.sum(0), rtol=1e-6)
      assert s.dtype == leaf.dtype
      np.testing.assert_allclose(m, leaf.astype(np.float64).mean(0), rtol=1e-6)
      expected = np.tensordot(weights.astype(np.float64), leaf, axes=1) / weights.sum()
      np.testing.assert_allclose(wm, expected, rtol=1e-5)


def test_integer_mean_is_float_in_abstract_eval_and_execution():
  ints = jnp.arange(N * 2, dtype=jnp.int32).reshape(N, 2)
  f = fedjx.program(fedjx.reduce_mean, clients=N)
  g = fedjx.program(lambda x: fedjx.reduce_weighted_mean(x, jnp.arange(N)), clients=N)
  for fn in (f, g):
    shape = jax.eval_shape(fn, ints)
    value = fn(ints)
    assert jnp.issubdtype(shape.dtype, jnp.floating)
    assert value.dtype == shape.dtype
  np.testing.assert_allclose(f(ints), [3.0, 4.0])
  np.testing.assert_allclose(g(ints), (np.arange(N)[:, None] * np.asarray(ints)).sum(0) / 6)


def test_cpu_reductions_of_floats_are_vector_products_and_match_numpy():
  """On CPU, float reductions lower to dot_general (fast); integer ones to sums."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(N, 5, 3)).astype(np.float32)
  w = rng.uniform(size=N).astype(np.float32)
  ops = {'sum': (fedjx.reduce_sum, x.sum(0)), 'mean': (fedjx.reduce_mean, x.mean(0)),
         'weighted': (lambda v: fedjx.reduce_weighted_mean(v, w),
                      np.tensordot(w, x, axes=1) / w.sum())}
  for name, (op, expected) in ops.items():
    f = jax.jit(fedjx.program(op, clients=N))
    assert 'dot_general' in f.lower(x).as_text(), name
    np.testing.assert_allclose(f(x), expected, rtol=1e-5, atol=1e-6)
  ints = jnp.arange(N * 2, dtype=jnp.int32).reshape(N, 2)
  f = jax.jit(fedjx.program(fedjx.reduce_sum, clients=N))
  assert 'dot_general' not in f.lower(ints).as_text()
  np.testing.assert_array_equal(f(ints), np.asarray(ints).sum(0))
  halves = x.astype(jnp.bfloat16)
  mean = jax.jit(fedjx.program(fedjx.reduce_mean, clients=N))(halves)
  assert mean.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(mean, np.float32),
                             np.asarray(halves, np.float32).mean(0), rtol=1e-2, atol=1e-2)


def test_broadcast_and_map_match_numpy():
  rng = np.random.default_rng(1)
  server = {'a': rng.normal(size=(3,)).astype(np.float32), 'k': np.int32(7)}
  data = rng.normal(size=(N, 3)).astype(np.float32)

  @fedjx.program(clients=N)
  def f(server, data):
    placed = fedjx.broadcast(server)
    return placed, fedjx.map_fn(lambda s, d: s['a'] * d + s['k'], (placed, data))

  placed, mapped = f(server, data)
  np.testing.assert_array_equal(placed['a'], np.tile(server['a'], (N, 1)))
  np.testing.assert_array_equal(placed['k'], np.full((N,), 7))
  np.testing.assert_allclose(mapped, server['a'] * data + 7, rtol=1e-6)


def test_map_fn_with_single_non_tuple_argument():
  f = fedjx.program(lambda d: fedjx.map_fn(lambda x: x['u'] ** 2, d), clients=3)
  np.testing.assert_allclose(f({'u': jnp.arange(3.0)}), [0.0, 1.0, 4.0])


def test_weighted_mean_with_zero_total_weight_is_zero_with_finite_grads():
  x = jnp.arange(N * 2.0).reshape(N, 2)
  f = fedjx.program(lambda x, w: fedjx.reduce_weighted_mean(x, w).sum(), clients=N)
  assert f(x, jnp.zeros(N)) == 0.0
  gx, gw = jax.grad(f, argnums=(0, 1))(x, jnp.zeros(N))
  assert np.all(np.isfinite(gx)) and np.all(np.isfinite(gw))


def test_jaxpr_shows_the_primitives_by_name():
  @fedjx.program(clients=N)
  def round_(params, data):
    client = fedjx.map_fn(lambda p, d: p - 0.1 * d, (fedjx.broadcast(params), data))
    return (fedjx.reduce_mean(client) + fedjx.reduce_sum(client) +
            fedjx.reduce_weighted_mean(client, jnp.ones(N)))

  text = str(jax.make_jaxpr(round_)(jnp.ones(2), jnp.ones((N, 2))))
  for name in ('fedjx_broadcast[n=4 placement=clients]', 'fedjx_map_clients',
               'fedjx_reduce_mean', 'fedjx_reduce_sum', 'fedjx_reduce_weighted_mean'):
    assert name in text


# ------------------------------------------------------------------ gradients

def _fedavg_like_round(params, data, weights, lr, steps=3, strategy='vmap'):
  """A FedAvg round with ``steps`` local SGD steps on a least-squares loss."""

  def client_train(p, d):
    def loss(p):
      pred = jnp.tanh(d['x'] @ p['w'] + p['b'])
      return jnp.mean((pred - d['y']) ** 2)
    for _ in range(steps):
      p = jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p))
    return p

  @fedjx.program(clients=data['x'].shape[0], map_strategy=strategy, chunk_size=2)
  def run(params, data, weights):
    clients = fedjx.map_fn(client_train, (fedjx.broadcast(params), data))
    return fedjx.reduce_weighted_mean(clients, weights)

  return run(params, data, weights)


def _reference_round(params, data, weights, lr, steps=3):
  """The same round as a hand-written loop over clients (no fedjx)."""
  outs = []
  for i in range(data['x'].shape[0]):
    p = params
    d = jax.tree.map(lambda a: a[i], data)
    def loss(p):
      pred = jnp.tanh(d['x'] @ p['w'] + p['b'])
      return jnp.mean((pred - d['y']) ** 2)
    for _ in range(steps):
      p = jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p))
    outs.append(p)
  total = sum(weights)
  return jax.tree.map(lambda *ps: sum(w * q for w, q in zip(weights, ps)) / total, *outs)


def _problem(seed=0, n=N):
  rng = np.random.default_rng(seed)
  params = {'w': jnp.asarray(rng.normal(size=(3,)) * 0.5),
            'b': jnp.asarray(0.1)}
  data = {'x': jnp.asarray(rng.normal(size=(n, 5, 3))),
          'y': jnp.asarray(rng.normal(size=(n, 5)))}
  weights = jnp.asarray(rng.uniform(1, 3, size=n))
  return params, data, weights


@pytest.mark.parametrize('strategy', ['vmap', 'sequential', 'chunked'])
def test_fedavg_like_round_matches_hand_written_loop(strategy):
  params, data, weights = _problem()
  got = _fedavg_like_round(params, data, weights, 0.3, strategy=strategy)
  want = _reference_round(params, data, weights, 0.3)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_check_grads_order_two_through_fedavg_like_round():
  with jax.enable_x64():
    params, data, weights = _problem(seed=1)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    data = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), data)
    weights = jnp.asarray(weights, jnp.float64)

    def objective(params, lr, weights):
      out = _fedavg_like_round(params, data, weights, lr, steps=2)
      return jnp.sum(out['w'] ** 2) + out['b']

    check_grads(objective, (params, jnp.float64(0.2), weights), order=2,
                modes=['fwd', 'rev'], atol=1e-5, rtol=1e-5)


def test_check_grads_through_each_primitive():
  with jax.enable_x64():
    x = jnp.linspace(-1.0, 1.0, N * 3, dtype=jnp.float64).reshape(N, 3)
    w = jnp.linspace(0.5, 2.0, N, dtype=jnp.float64)

    @fedjx.program(clients=N)
    def f(x, w, s):
      placed = fedjx.broadcast(s)
      y = fedjx.map_fn(lambda a, b: jnp.sin(a * b), (x, placed))
      return (fedjx.reduce_sum(y ** 2).sum() + fedjx.reduce_mean(jnp.exp(y)).sum() +
              (fedjx.reduce_weighted_mean(y, w) ** 3).sum())

    check_grads(f, (x, w, jnp.array([0.3, -0.2, 0.7])), order=2,
                modes=['fwd', 'rev'], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------ transformations

def test_vmap_of_a_program_matches_a_loop():
  params, data, weights = _problem()
  lrs = jnp.array([0.1, 0.2, 0.4])
  batched = jax.vmap(lambda lr: _fedavg_like_round(params, data, weights, lr))(lrs)
  for i, lr in enumerate(lrs):
    one = _reference_round(params, data, weights, lr)
    np.testing.assert_allclose(batched['w'][i], one['w'], rtol=1e-5, atol=1e-6)


def test_vmap_over_placed_data_and_weights():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(2, N, 3)).astype(np.float32)
  w = rng.uniform(1, 2, size=(2, N)).astype(np.float32)
  f = fedjx.program(lambda x, w: (fedjx.reduce_weighted_mean(x, w),
                                  fedjx.reduce_sum(x)), clients=N)
  wm, s = jax.vmap(f)(x, w)
  np.testing.assert_allclose(wm, np.einsum('bn,bnd->bd', w, x) / w.sum(1, keepdims=True),
                             rtol=1e-5)
  np.testing.assert_allclose(s, x.sum(1), rtol=1e-5)
  wm1, _ = jax.vmap(f, in_axes=(1, None))(np.moveaxis(x, 0, 1), w[0])
  np.testing.assert_allclose(wm1, np.einsum('n,bnd->bd', w[0], x) / w[0].sum(), rtol=1e-5)


def test_scan_over_rounds_with_checkpoint_and_jit():
  params, data, weights = _problem()

  def one_round(p, _):
    return _fedavg_like_round(p, data, weights, 0.2, steps=2), None

  @jax.jit
  def run(p):
    return jax.lax.scan(jax.checkpoint(one_round), p, None, length=3)[0]

  got = run(params)
  want = params
  for _ in range(3):
    want = _reference_round(want, data, weights, 0.2, steps=2)
  np.testing.assert_allclose(got['w'], want['w'], rtol=1e-5, atol=1e-6)
  # Reverse mode through the scanned, rematerialised rounds.
  g = jax.grad(lambda p: run(p)['w'].sum())(params)
  g_ref = jax.grad(lambda p: jax.lax.scan(one_round, p, None, length=3)[0]['w'].sum())(params)
  np.testing.assert_allclose(g['w'], g_ref['w'], rtol=1e-5, atol=1e-6)


def test_jit_outside_and_inside_the_decorator():
  f = lambda x: fedjx.reduce_sum(fedjx.broadcast(x))
  a = jax.jit(fedjx.program(f, clients=5))(2.0)
  b = fedjx.program(jax.jit(f), clients=5)(2.0)
  assert a == b == 10.0


# --------------------------------------------------------------- placements

def test_drjax_style_placements_and_inferred_cardinality():
  f = fedjx.program(lambda x: fedjx.reduce_sum(fedjx.broadcast(x)),
                    placements={'clients': 3})
  assert f(1.5) == 4.5
  g = fedjx.program(lambda d: fedjx.reduce_sum(fedjx.broadcast(fedjx.reduce_mean(d))),
                    placements={'clients': None})
  assert g(jnp.arange(6.0)) == 15.0


def test_hierarchical_placements_silos_of_clients():
  silos, clients = 2, 3
  data = jnp.arange(silos * clients, dtype=jnp.float32).reshape(silos, clients)
  w = jnp.array([[1.0, 2.0, 3.0], [1.0, 1.0, 2.0]])

  @fedjx.program(placements={'silos': silos, 'clients': clients})
  def f(server, data, w):
    per_silo_model = fedjx.broadcast(server, placement='silos')

    def silo_work(model, silo_data, silo_w):
      at_clients = fedjx.broadcast(model, placement='clients')
      updates = fedjx.map_fn(lambda m, d: m + d, (at_clients, silo_data),
                             placement='clients')
      return fedjx.reduce_weighted_mean(updates, silo_w, placement='clients')

    silo_means = fedjx.map_fn(silo_work, (per_silo_model, data, w), placement='silos')
    return fedjx.reduce_mean(silo_means, placement='silos')

  expected = np.mean([10.0 + np.dot(w[s], data[s]) / w[s].sum() for s in range(silos)])
  np.testing.assert_allclose(f(10.0, data, w), expected, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(f)(10.0, data, w), 1.0, rtol=1e-6)


def test_program_context_is_thread_local():
  results, errors = {}, []
  barrier = threading.Barrier(2)

  def worker(n):
    try:
      @fedjx.program(clients=n)
      def f(x):
        barrier.wait(timeout=10)
        return fedjx.reduce_sum(fedjx.broadcast(x))
      results[n] = float(f(1.0))
    except Exception as e:  # pragma: no cover - reported below
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(n,)) for n in (3, 7)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert results == {3: 3.0, 7: 7.0}


# ---------------------------------------------------------------- bad input

def test_calls_outside_a_program_raise():
  for call in (lambda: fedjx.broadcast(1.0), lambda: fedjx.reduce_sum(jnp.ones(3)),
               lambda: fedjx.map_fn(lambda x: x, jnp.ones(3))):
    with pytest.raises(RuntimeError, match='outside a placement context'):
      call()


def test_wrong_leading_dimension_names_both_sizes():
  f = fedjx.program(fedjx.reduce_sum, clients=4)
  with pytest.raises(ValueError, match=r'leading dimension 4.*leading dimension 5'):
    f(jnp.ones((5, 2)))


def test_reducing_a_scalar_is_an_error():
  with pytest.raises(ValueError, match='not placed'):
    fedjx.program(fedjx.reduce_mean, clients=4)(1.0)


def test_weights_must_match_values():
  f = fedjx.program(fedjx.reduce_weighted_mean, clients=4)
  with pytest.raises(ValueError, match='weights'):
    f(jnp.ones((4, 2)), jnp.ones((3,)))
  with pytest.raises(ValueError, match='weights must have shape'):
    f(jnp.ones((4, 2)), jnp.ones((4, 2)))


def test_bad_program_arguments():
  with pytest.raises(ValueError, match='map_strategy'):
    fedjx.program(clients=2, map_strategy='fast')
  with pytest.raises(ValueError, match='positive int'):
    fedjx.program(clients=0)
  with pytest.raises(ValueError, match='already declared'):
    fedjx.program(fedjx.program(lambda: None, clients=2), clients=3)()
  with pytest.raises(ValueError, match="placement='silos' is not declared"):
    fedjx.program(lambda: fedjx.broadcast(1.0, placement='silos'), clients=2)()


@pytest.mark.parametrize('axis_type', ['Auto', 'Explicit'])
def test_weighted_mean_derivatives_on_a_mesh_match_no_mesh(axis_type):
  """Reverse and forward rules in values and weights keep client shardings."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec
  n = 8
  rng = np.random.default_rng(1)
  data = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
  weights = jnp.asarray(rng.uniform(0.5, 2.0, size=n), jnp.float32)

  @fedjx.program(clients=n)
  def f(theta, w, data):
    local = fedjx.map_fn(lambda t, d: jnp.tanh(t * d), (fedjx.broadcast(theta), data))
    return jnp.sum(fedjx.reduce_weighted_mean(local, w) ** 2)

  theta = jnp.asarray([0.5, -1.0, 2.0])
  want = jax.grad(f, argnums=(0, 1))(theta, weights, data)
  want_fwd = jax.jacfwd(f, argnums=(0, 1))(theta, weights, data)
  mesh = jax.make_mesh((n,), ('clients',), axis_types=(getattr(AxisType, axis_type),))
  placed = NamedSharding(mesh, PartitionSpec('clients'))
  with jax.set_mesh(mesh):
    args = (theta, jax.device_put(weights, placed), jax.device_put(data, placed))
    got = jax.jit(jax.grad(f, argnums=(0, 1)))(*args)
    got_fwd = jax.jit(jax.jacfwd(f, argnums=(0, 1)))(*args)
  for g, w in zip(jax.tree.leaves((got, got_fwd)), jax.tree.leaves((want, want_fwd))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
