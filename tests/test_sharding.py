"""Placed values on 8 host devices, with Auto and Explicit mesh axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fedjx
import float_tolerance as ft

CLIENTS = 8
# tanh(d @ p) sums 3 products; the weighted mean and the sum add 8 clients, the
# gradient's sums 5 rows and 8 clients: chains of n < 30 float32 terms, relative
# to the magnitude of each result.
TOL = ft.rtol(30)


def _round(strategy):
  @fedjx.program(clients=CLIENTS, map_strategy=strategy, chunk_size=4)
  def f(params, data):
    placed = fedjx.broadcast(params)
    local = fedjx.map_fn(lambda p, d: jnp.tanh(d @ p), (placed, data))
    weights = jnp.arange(1.0, CLIENTS + 1)
    return placed, local, fedjx.reduce_weighted_mean(local, weights), fedjx.reduce_sum(local)
  return jax.jit(f)


def _inputs():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
          jnp.asarray(rng.normal(size=(CLIENTS, 5, 3)), jnp.float32))


def _leading_axis(sharding):
  spec = tuple(sharding.spec)
  return spec[0] if spec else None


@pytest.mark.parametrize('axis_type', [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize('strategy', ['vmap', 'chunked', 'sequential', 'auto'])
def test_placed_values_are_sharded_on_clients(axis_type, strategy):
  assert jax.device_count() == 8
  params, data = _inputs()
  want = _round(strategy)(params, data)  # no mesh
  mesh = jax.make_mesh((4, 2), ('clients', 'model'), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    # The data arrives replicated; it is laid onto the clients axis.
    placed, local, wmean, total = _round(strategy)(
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(data, NamedSharding(mesh, P())))
  assert _leading_axis(placed.sharding) == 'clients'
  assert _leading_axis(local.sharding) == 'clients'
  for reduced in (wmean, total):
    assert 'clients' not in jax.tree.leaves(tuple(reduced.sharding.spec))
  for got, ref in zip((placed, local, wmean, total), want):
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL * float(np.max(np.abs(ref))))


@pytest.mark.parametrize('axis_type', [AxisType.Auto, AxisType.Explicit])
def test_gradients_on_a_mesh_match_no_mesh(axis_type):
  params, data = _inputs()
  loss = lambda p, d: _round('chunked')(p, d)[2].sum()
  want = jax.grad(loss)(params, data)
  mesh = jax.make_mesh((4, 2), ('clients', 'model'), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss))(params, jax.device_put(data, NamedSharding(mesh, P('model'))))
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * float(np.max(np.abs(want))))


def test_explicit_mesh_argument_without_context():
  params, data = _inputs()
  mesh = jax.make_mesh((8,), ('clients',), axis_types=(AxisType.Auto,))

  @jax.jit
  @fedjx.program(clients=CLIENTS, mesh=mesh)
  def f(params, data):
    return fedjx.map_fn(lambda p, d: d @ p, (fedjx.broadcast(params), data))

  out = f(params, data)
  assert _leading_axis(out.sharding) == 'clients'
  bound = ft.atol(3, np.einsum('nij,jk->nik', np.abs(data), np.abs(params)))
  np.testing.assert_array_less(
      np.abs(out - np.einsum('nij,jk->nik', data, params)), bound + 1e-30)
