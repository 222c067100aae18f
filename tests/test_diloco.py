"""DiLoCo and Streaming DiLoCo against hand-written loops; quantization."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.compression import quantization
from fedjx.algorithms.streaming_diloco_lib import fragment_leaves
import float_tolerance as ft
from test_algorithms_util import CHAIN, KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

SIZES = [8, 4]  # Two replicas; batches of 4: 2 and 1 real steps.
H = 3           # Inner steps, cycling through each replica's real steps.


def _setup():
  data = linreg_data(np.random.default_rng(40), SIZES, shift=2.0)
  batches = [[{k: jnp.asarray(v[i:i + 4]) for k, v in d.items()}
              for i in range(0, len(d['y']), 4)] for d in data]
  return data, batches, make_cohort(data, batch_size=4), linreg_params()


def _inner(params, opt, opt_state, batches):
  """H steps of ``opt`` cycling through ``batches``, in plain JAX."""
  grad = jax.grad(lambda p, b: jnp.mean(linreg_loss(p, b)))
  for t in range(H):
    updates, opt_state = opt.update(grad(params, batches[t % len(batches)]),
                                    opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, opt_state


def _nesterov(x, g, trace, lr=0.7, mu=0.9):
  trace = jax.tree.map(lambda t, g: g + mu * t, trace, g)
  x = jax.tree.map(lambda x, g, t: x - lr * (g + mu * t), x, g, trace)
  return x, trace


def test_diloco_with_outer_sgd_1_is_fedavg():
  _, _, cohort, params = _setup()
  inner = optax.adamw(0.05, weight_decay=0.1)
  diloco = algos.diloco(linreg_loss, 2, inner_optimizer=inner,
                        outer_optimizer=optax.sgd(1.0), inner_steps=H,
                        reset_inner_state=True)
  fedavg = algos.fedavg(linreg_loss, client_optimizer=inner,
                        server_optimizer=optax.sgd(1.0), local_steps=H)
  a, b = diloco.init(params), fedavg.init(params)
  for _ in range(2):
    a, ma = diloco.round(a, cohort, KEY)
    b, mb = fedavg.round(b, cohort, KEY)
    assert_trees_close(a.params, b.params)
    np.testing.assert_allclose(ma['train_loss_after'], mb['train_loss_after'],
                               rtol=ft.rtol(CHAIN))


def test_diloco_and_streaming_with_one_fragment_match_reference():
  _, batches, cohort, params = _setup()
  inner = optax.adamw(0.05, weight_decay=0.1)
  diloco = algos.diloco(linreg_loss, 2, inner_optimizer=inner, inner_steps=H)
  streaming = algos.streaming_diloco(linreg_loss, 2, num_fragments=1,
                                     quantization_format='float32',
                                     inner_optimizer=inner, inner_steps=H)
  a, b = diloco.init(params), streaming.init(params)
  # Reference: persistent per-replica AdamW, outer Nesterov (0.7, 0.9).
  x, trace = params, jax.tree.map(jnp.zeros_like, params)
  states = [inner.init(params) for _ in SIZES]
  for _ in range(2):
    a, ma = diloco.round(a, cohort, KEY)
    b, mb = streaming.round(b, cohort, KEY)
    ys = []
    for k, bs in enumerate(batches):
      y, states[k] = _inner(x, inner, states[k], bs)
      ys.append(y)
    g = jax.tree.map(lambda x, *ys: x - sum(n * y for n, y in zip(SIZES, ys))
                     / sum(SIZES), x, *ys)
    x, trace = _nesterov(x, g, trace)
    assert_trees_close(a.params, x)
    assert_trees_close(b.params, x)
  assert float(ma['communicated_bytes']) == 2 * 4 * 4  # 2 replicas, 4 floats.
  assert float(mb['communicated_bytes']) == 2 * 4 * 4


def _int4(x):
  s = np.max(np.abs(x)) / 7
  return np.clip(np.round(x / s), -7, 7) * s if s > 0 else x


def test_streaming_diloco_staggered_fragments_with_int4():
  _, batches, cohort, params = _setup()
  inner = optax.sgd(0.05)
  alpha = 0.25
  algo = algos.streaming_diloco(linreg_loss, 2, num_fragments=2,
                                quantization_format='int4', mixing_factor=alpha,
                                inner_optimizer=inner, inner_steps=H)
  state = algo.init(params)
  # Leaves in order: 'b' (fragment 0), 'w' (fragment 1).
  assert fragment_leaves(params, 2, 'strided') == ((0,), (1,))
  x = {k: np.asarray(v, np.float64) for k, v in params.items()}
  replicas = [dict(x) for _ in SIZES]
  traces = {k: np.zeros_like(v) for k, v in x.items()}
  grad = jax.grad(lambda p, b: jnp.mean(linreg_loss(p, b)))
  for r in range(4):
    state, metrics = algo.round(state, cohort, KEY)
    for k, bs in enumerate(batches):
      y = {n: jnp.asarray(v, jnp.float32) for n, v in replicas[k].items()}
      for t in range(H):
        y = jax.tree.map(lambda p, g: p - 0.05 * g, y, grad(y, bs[t % len(bs)]))
      replicas[k] = {n: np.asarray(v, np.float64) for n, v in y.items()}
    leaf = ['b', 'w'][r % 2]
    outer = [_int4((x[leaf] - rep[leaf]).astype(np.float32)) for rep in replicas]
    g = sum(n * o for n, o in zip(SIZES, outer)) / sum(SIZES)
    traces[leaf] = g + 0.9 * traces[leaf]
    x[leaf] = x[leaf] - 0.7 * (g + 0.9 * traces[leaf])
    for rep in replicas:
      rep[leaf] = alpha * rep[leaf] + (1 - alpha) * x[leaf]
    assert int(metrics['synced_fragment']) == r % 2
    # int4: ceil(n / 2) bytes plus a 4-byte scale, from each of 2 replicas.
    assert float(metrics['communicated_bytes']) == [10, 12][r % 2]
    for n in ('b', 'w'):
      assert_trees_close(state.params[n], x[n])
      assert_trees_close(state.extras[n],
                         np.stack([rep[n] for rep in replicas]))


def test_quantization_formats():
  quantize = jax.jit(quantization.quantize, static_argnums=1)
  x = jnp.asarray(np.random.default_rng(41).normal(size=(64,)), jnp.float32)
  np.testing.assert_array_equal(quantize(x, 'float32'), x)
  np.testing.assert_array_equal(quantize(x, 'bfloat16'),
                                x.astype(jnp.bfloat16).astype(jnp.float32))
  # round(x / s) * s: a division and a product (2 roundings).
  np.testing.assert_allclose(quantize(x, 'int4'), _int4(np.asarray(x)),
                             rtol=ft.rtol(2))
  q8 = quantize(x, 'int8')
  # Half a step of 127 levels, plus the roundings of x / s and of q * s.
  assert np.max(np.abs(q8 - x)) <= np.max(np.abs(x)) / 127 * (0.5 + ft.rtol(2))
  q = np.asarray(quantize(x, 'e3m0'))
  s = float(np.max(np.abs(x)))
  levels = s * 2.0 ** -np.arange(7)
  for v, xv in zip(q, np.asarray(x)):
    if v == 0:
      assert abs(xv) < s * 2 ** -6.5
    else:
      assert np.sign(v) == np.sign(xv)
      k = np.argmin(np.abs(np.log2(abs(xv)) - np.log2(levels)))
      np.testing.assert_allclose(abs(v), levels[k], rtol=ft.rtol(2))
  # Straight-through: the gradient of quantize is the identity.
  g = jax.jit(jax.grad(lambda x: jnp.sum(quantize(x, 'int4') * 3.0)))(x)
  np.testing.assert_array_equal(g, np.full(64, 3.0))
  tree = {'a': jnp.zeros((3, 5)), 'b': jnp.zeros(())}
  assert quantization.num_bytes(tree, 'float32') == 64
  assert quantization.num_bytes(tree, 'bfloat16') == 32
  assert quantization.num_bytes(tree, 'e3m0') == 8 + 4 + 1 + 4
  with pytest.raises(ValueError, match='fmt'):
    quantization.quantize(x, 'int3')


def test_fragments_and_arguments():
  params = {'a': jnp.zeros(10), 'b': jnp.zeros(1), 'c': jnp.zeros(10),
            'd': jnp.zeros(1)}
  assert fragment_leaves(params, 2, 'sequential') == ((0, 1), (2, 3))
  assert fragment_leaves(params, 3, 'strided') == ((0, 3), (1,), (2,))
  assert fragment_leaves(params, 4, 'sequential') == ((0,), (1,), (2,), (3,))
  with pytest.raises(ValueError, match='num_fragments'):
    fragment_leaves(params, 5, 'strided')
  with pytest.raises(ValueError, match='quantization_format'):
    algos.streaming_diloco(linreg_loss, 2, quantization_format='fp4')
  with pytest.raises(ValueError, match='fragment_pattern'):
    algos.streaming_diloco(linreg_loss, 2, fragment_pattern='random')
  with pytest.raises(ValueError, match='mixing_factor'):
    algos.streaming_diloco(linreg_loss, 2, mixing_factor=1.5)
  with pytest.raises(ValueError, match='outer_learning_rate'):
    algos.diloco(linreg_loss, 2, outer_learning_rate=-0.7)
  with pytest.raises(ValueError, match='not both'):
    algos.diloco(linreg_loss, 2, outer_optimizer=optax.sgd(1.0),
                 outer_momentum=0.5)
  with pytest.raises(ValueError, match='num_replicas'):
    algos.diloco(linreg_loss, 0)
