"""Every map strategy gives the same numbers on a CNN client update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx
import float_tolerance as ft
from fedjx import mapping
from fedjx import frames


def _cnn_params(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {'conv1': jax.random.normal(k1, (3, 3, 1, 4)) * 0.3,
          'conv2': jax.random.normal(k2, (3, 3, 4, 8)) * 0.2,
          'dense': jax.random.normal(k3, (8 * 8 * 8, 10)) * 0.05}


def _cnn(params, x):
  dn = ('NHWC', 'HWIO', 'NHWC')
  h = jax.nn.relu(jax.lax.conv_general_dilated(x, params['conv1'], (1, 1), 'SAME',
                                               dimension_numbers=dn))
  h = jax.nn.relu(jax.lax.conv_general_dilated(h, params['conv2'], (1, 1), 'SAME',
                                               dimension_numbers=dn))
  h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), 'VALID')
  return h.reshape(h.shape[0], -1) @ params['dense']


def _client_update(params, data):
  def loss(p, x, y):
    logits = _cnn(p, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

  def step(p, batch):
    g = jax.grad(loss)(p, *batch)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), None

  return jax.lax.scan(step, params, (data['x'], data['y']))[0]


@pytest.mark.parametrize('clients', [5, 8])
@pytest.mark.slow
def test_all_strategies_agree_on_cnn_client_update(clients):
  params = _cnn_params(jax.random.key(0))
  rng = np.random.default_rng(0)
  data = {'x': jnp.asarray(rng.normal(size=(clients, 2, 4, 16, 16, 1)), jnp.float32),
          'y': jnp.asarray(rng.integers(0, 10, size=(clients, 2, 4)))}

  def run(strategy, chunk_size=None):
    @jax.jit
    @fedjx.program(clients=clients, map_strategy=strategy, chunk_size=chunk_size)
    def f(params, data):
      return fedjx.map_fn(_client_update, (fedjx.broadcast(params), data))
    return f(params, data)

  reference = [_client_update(params, jax.tree.map(lambda a: a[i], data))
               for i in range(clients)]
  for strategy, chunk in [('vmap', None), ('sequential', None), ('chunked', 2),
                          ('chunked', 3), ('auto', None)]:
    got = run(strategy, chunk)
    # Per step, the longest chain of float32 sums is the backward pass of the
    # convolutions (4 * 16 * 16 = 1024 positions) after the dense layer (512),
    # the convolutions (36, 9), the softmax (10) and the batch mean (4): about
    # 1600 terms; two steps: n = 3200, relative to each leaf's scale.
    tol = ft.rtol(3200)
    for i in range(clients):
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(reference[i])):
        np.testing.assert_allclose(g[i], w, rtol=tol, atol=tol * float(jnp.max(jnp.abs(w))),
                                   err_msg=f'{strategy} chunk={chunk} client {i}')


def test_chunk_size_choice():
  assert mapping.choose_chunk_size('vmap', 10, 100, 1) == 10
  assert mapping.choose_chunk_size('sequential', 10, 100, 1) == 1
  assert mapping.choose_chunk_size('sequential', 16, 100, 4) == 4
  assert mapping.choose_chunk_size('chunked', 10, 100, 1, chunk_size=3) == 3
  # Chunks are a multiple of the devices on the clients axis.
  assert mapping.choose_chunk_size('chunked', 16, 100, 4, chunk_size=3) == 4
  # Auto on CPU: tiny clients vmapped, mid-sized ones in chunks of 4, large
  # ones one at a time per device.
  assert mapping.choose_chunk_size('auto', 16, 1000, 1, backend='cpu') == 16
  assert mapping.choose_chunk_size('auto', 16, 600 << 10, 1, backend='cpu') == 4
  assert mapping.choose_chunk_size('auto', 16, 5 << 20, 1, backend='cpu') == 1
  assert mapping.choose_chunk_size('auto', 16, 5 << 20, 2, backend='cpu') == 2
  # Auto on an accelerator: chunks for large cohorts.
  assert mapping.choose_chunk_size('auto', 1024, 1 << 20, 1, backend='gpu') == 64
  # Auto on a TPU: tiny clients vmapped (up to the memory budget), the rest
  # one at a time per device.
  assert mapping.choose_chunk_size('auto', 128, 40 << 10, 1, backend='tpu') == 128
  assert mapping.choose_chunk_size('auto', 1024, 600 << 10, 1, backend='tpu') == 1
  assert mapping.choose_chunk_size('auto', 1024, 5 << 20, 4, backend='tpu') == 4
  # One device: a divisor of the cohort near the chunk size avoids padding.
  assert mapping.choose_chunk_size('chunked', 10_000, 100, 1, chunk_size=64) == 50
  assert mapping.choose_chunk_size('chunked', 10_007, 100, 1, chunk_size=64) == 64
  with pytest.raises(ValueError, match='strategy'):
    mapping.choose_chunk_size('fast', 4, 1, 1)


def test_broadcast_inputs_reach_the_mapped_function_without_copies():
  """map_fn(f, (broadcast(x), d)) passes x itself, not n copies of it."""
  x = jnp.arange(3.0)
  d = jnp.arange(15.0).reshape(5, 3)
  prog = fedjx.program(
      lambda x, d: fedjx.map_fn(lambda s, di: s * di, (fedjx.broadcast(x), d)),
      clients=5)

  def map_input_shapes(jaxpr):
    (eqn,) = [e for e in jaxpr.eqns if e.params.get('name') == 'fedjx_map_clients']
    return sorted(v.aval.shape for v in eqn.invars)

  trace = lambda: jax.make_jaxpr(lambda *a: prog(*a))(x, d)  # Uncached.
  assert map_input_shapes(trace()) == [(3,), (5, 3)]
  with frames.force_map_strategy('sequential'):  # Interpreters see copies.
    assert map_input_shapes(trace()) == [(5, 3), (5, 3)]
  np.testing.assert_allclose(prog(x, d), x * d)
  # d/dx sum_i sum_j x_j d_ij = sum_i d_i: the broadcast's transpose, a sum.
  np.testing.assert_allclose(jax.grad(lambda x: prog(x, d).sum())(x), d.sum(0))
