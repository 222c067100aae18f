"""Max pooling as a reshape and a max, against NumPy loops and flax."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from fedjx import models
from fedjx.models import pool


def _numpy_max_pool(x, window):
  """Direct loops over the windows that fit (VALID, strides = window)."""
  d = len(window)
  spatial = x.shape[-d - 1:-1]
  out_shape = [n // k for n, k in zip(spatial, window)]
  y = np.empty(x.shape[:-d - 1] + tuple(out_shape) + x.shape[-1:], x.dtype)
  for index in itertools.product(*map(range, out_shape)):
    region = tuple(slice(i * k, (i + 1) * k) for i, k in zip(index, window))
    block = x[(..., *region, slice(None))]
    y[(..., *index, slice(None))] = block.reshape(
        block.shape[:-d - 1] + (-1,) + block.shape[-1:]).max(axis=-2)
  return y


def _numpy_max_pool_grad(x, window, cotangent):
  """Each window's cotangent split equally among the entries holding its max."""
  d = len(window)
  spatial = x.shape[-d - 1:-1]
  out_shape = [n // k for n, k in zip(spatial, window)]
  g = np.zeros_like(x)
  lead = x.shape[:-d - 1]
  for index in itertools.product(*map(range, out_shape)):
    region = tuple(slice(i * k, (i + 1) * k) for i, k in zip(index, window))
    block = x[(..., *region, slice(None))]
    top = block.max(axis=tuple(range(len(lead), len(lead) + d)), keepdims=True)
    ties = block == top
    count = ties.sum(axis=tuple(range(len(lead), len(lead) + d)), keepdims=True)
    share = cotangent[(..., *[slice(i, i + 1) for i in index], slice(None))] / count
    g[(..., *region, slice(None))] += np.where(ties, share, 0)
  return g


@pytest.mark.parametrize('shape,window', [
    ((3, 8, 8, 4), (2, 2)),
    ((2, 9, 7, 3), (2, 2)),        # trailing row and column fill no window
    ((2, 12, 9, 5), (3, 3)),
    ((4, 10, 2), (2,)),            # one spatial axis
    ((2, 4, 6, 4, 3), (2, 3, 2)),  # three
    ((6, 6, 2), (2, 3)),           # no batch axis
    ((2, 3, 8, 8, 2), (4, 4)),     # two batch axes
])
def test_values_equal_numpy_and_flax(shape, window):
  x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  got = pool.max_pool(jnp.asarray(x), window)
  # A max selects one of its inputs: the results are exact.
  np.testing.assert_array_equal(np.asarray(got), _numpy_max_pool(x, window))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(nn.max_pool(x, window, window)))


def test_same_padding_on_tiled_sizes_is_valid():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 6, 3)), jnp.float32)
  np.testing.assert_array_equal(
      np.asarray(pool.max_pool(x, (2, 3), padding='SAME')),
      np.asarray(nn.max_pool(x, (2, 3), (2, 3), 'SAME')))


@pytest.mark.parametrize('window,strides,padding,shape', [
    ((3, 3), (2, 2), 'VALID', (2, 9, 9, 3)),   # overlapping windows
    ((2, 2), (2, 2), 'SAME', (2, 7, 8, 3)),    # padding needed
    ((2, 2), (1, 1), 'VALID', (2, 6, 6, 3)),
    ((2, 2), (2, 2), ((1, 0), (0, 1)), (2, 6, 6, 3)),
])
def test_other_windows_run_flax(window, strides, padding, shape):
  x = jnp.asarray(np.random.default_rng(2).normal(size=shape), jnp.float32)
  np.testing.assert_array_equal(
      np.asarray(pool.max_pool(x, window, strides, padding)),
      np.asarray(nn.max_pool(x, window, strides, padding)))


def test_gradient_without_ties_equals_flax_and_numpy():
  """Distinct values: one entry per window holds the max, and both
  derivatives route the window's cotangent to it alone (exact)."""
  rng = np.random.default_rng(3)
  x = rng.permutation(2 * 9 * 8 * 3).reshape(2, 9, 8, 3).astype(np.float32)
  cotangent = rng.normal(size=(2, 4, 4, 3)).astype(np.float32)
  ours = jax.vjp(lambda v: pool.max_pool(v, (2, 2)), jnp.asarray(x))[1](cotangent)[0]
  flax_ = jax.vjp(lambda v: nn.max_pool(v, (2, 2), (2, 2)), jnp.asarray(x))[1](cotangent)[0]
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(flax_))
  np.testing.assert_array_equal(np.asarray(ours), _numpy_max_pool_grad(x, (2, 2), cotangent))


def test_ties_share_the_cotangent_equally():
  """A window holding its max k times gives each of them 1/k of the
  cotangent: one division per entry, so within one rounding of NumPy's."""
  x = np.array([[1, 1, 0, 2], [1, 0, 2, 2], [5, 5, 3, 4], [5, 5, 4, 1]],
               np.float32)[None, :, :, None]
  cotangent = np.array([[3.0, 7.0], [1.5, -2.0]], np.float32)[None, :, :, None]
  got = jax.vjp(lambda v: pool.max_pool(v, (2, 2)), jnp.asarray(x))[1](cotangent)[0]
  want = _numpy_max_pool_grad(x.astype(np.float64), (2, 2), cotangent.astype(np.float64))
  np.testing.assert_allclose(np.asarray(got), want, rtol=np.finfo(np.float32).eps, atol=0)
  assert want[0, 0, 0, 0] == 1.0 and want[0, 2, 0, 0] == 1.5 / 4


def test_relu_then_pool_gradient_equals_flax_at_tied_zeros():
  """After a ReLU a window of non-positive inputs ties at zero; the ReLU's
  derivative there is zero, so the composite derivative equals flax's."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(3, 8, 8, 4)) - 0.8, jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=(3, 4, 4, 4)), jnp.float32)

  def grad(pool_fn):
    return jax.vjp(lambda v: pool_fn(jax.nn.relu(v)), x)[1](cotangent)[0]

  ours = grad(lambda v: pool.max_pool(v, (2, 2)))
  theirs = grad(lambda v: nn.max_pool(v, (2, 2), (2, 2)))
  assert int(jnp.sum(pool.max_pool(jax.nn.relu(x), (2, 2)) == 0)) > 0  # tied windows exist
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_check_grads():
  x = jnp.asarray(np.random.default_rng(5).permutation(96).reshape(2, 4, 4, 3) / 7.0)
  check_grads(lambda v: pool.max_pool(v, (2, 2)), (x,), order=2, modes=('fwd', 'rev'),
              eps=1e-3)


def test_under_vmap_equals_per_example():
  x = jnp.asarray(np.random.default_rng(6).normal(size=(5, 2, 6, 6, 3)), jnp.float32)
  batched = jax.vmap(lambda v: pool.max_pool(v, (2, 2)))(x)
  for i in range(x.shape[0]):
    np.testing.assert_array_equal(np.asarray(batched[i]),
                                  np.asarray(pool.max_pool(x[i], (2, 2))))


@pytest.mark.parametrize('kwargs,match', [
    (dict(x=np.zeros((4, 3)), window_shape=(2, 2)), 'no room'),
    (dict(x=np.zeros((2, 4, 4, 1)), window_shape=(0, 2)), 'window_shape'),
])
def test_bad_input_is_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    pool.max_pool(**kwargs)


def test_emnist_cnn_pools_by_reshape():
  """The CNN's program pools by a max reduction, not ``reduce_window``."""
  model = models.emnist_cnn(num_classes=10, dropout=False)
  x = jnp.asarray(np.random.default_rng(7).random((3, 28, 28, 1)), jnp.float32)
  params = model.module.init(jax.random.key(0), x)['params']
  jaxpr = str(jax.make_jaxpr(lambda p: model.module.apply({'params': p}, x))(params))
  assert 'reduce_window' not in jaxpr and 'reduce_max' in jaxpr
