"""Convolution as patches times a kernel matrix, against NumPy and XLA."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

from fedjx import models
from fedjx.models import conv as conv_lib

import float_tolerance as ft


def _numpy_conv_nhwc(x, w, strides, padding):
  """Direct loops: y[n, i, j, o] = sum_{a, b, c} x_pad[n, s i + a, s j + b, c] w[a, b, c, o]."""
  x = np.pad(x, [(0, 0), padding[0], padding[1], (0, 0)])
  kh, kw, _, out = w.shape
  rows = (x.shape[1] - kh) // strides[0] + 1
  cols = (x.shape[2] - kw) // strides[1] + 1
  y = np.zeros((x.shape[0], rows, cols, out))
  for i, j in itertools.product(range(rows), range(cols)):
    window = x[:, i * strides[0]:i * strides[0] + kh, j * strides[1]:j * strides[1] + kw]
    y[:, i, j] = np.einsum('nabc,abco->no', window, w)
  return y


def _assert_conv_close(got, want, x, w, *args, feature_group_count=1, one_exact=False):
  """|got - want| <= 2 gamma_K conv(|x|, |w|), K the products summed per output.

  K is the kernel's spatial size times its input channels per group; Y =
  conv(|x|, |w|) (float64) bounds the sum of the products' magnitudes. With
  ``one_exact`` the reference is float64 and only ``got`` rounds (gamma_K).
  """
  dims = args[-1] if len(args) == 5 else None
  kernel_spec = dims[1] if dims else 'OIHW'
  spatial = [n for n, c in zip(np.shape(w), kernel_spec) if c not in 'IO']
  k = int(np.prod(spatial)) * np.shape(w)[kernel_spec.index('I')]
  with jax.enable_x64():
    y_abs = lax.conv_general_dilated(
        jnp.abs(jnp.asarray(x, jnp.float64)), jnp.abs(jnp.asarray(w, jnp.float64)),
        *args, feature_group_count=feature_group_count)
  # (+2 with a float64 reference: x and w are rounded to float32 first.)
  bound = (ft.gamma(k + 2) if one_exact else ft.atol(k, 1.0)) * np.asarray(y_abs)
  np.testing.assert_array_less(np.abs(np.float64(got) - np.float64(want)), bound + 1e-300)


def test_patch_conv_matches_direct_numpy_loops():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 9, 8, 2))
  w = rng.normal(size=(3, 2, 2, 4))
  got = conv_lib.patch_conv(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                            (2, 1), ((1, 2), (0, 1)),
                            dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  _assert_conv_close(got, _numpy_conv_nhwc(x, w, (2, 1), ((1, 2), (0, 1))), x, w,
                     (2, 1), ((1, 2), (0, 1)), None, None, ('NHWC', 'HWIO', 'NHWC'),
                     one_exact=True)


@pytest.mark.parametrize('dims', [('NHWC', 'HWIO', 'NHWC'), None, ('NCHW', 'OIHW', 'NHWC')])
@pytest.mark.parametrize('strides,padding,lhs_dilation,rhs_dilation', [
    ((1, 1), 'VALID', None, None),
    ((2, 1), 'SAME', None, (1, 2)),
    ((1, 2), ((1, 2), (0, 1)), (2, 1), None),
    ((2, 3), ((0, 0), (2, 2)), (1, 2), (2, 1)),
])
def test_patch_conv_matches_lax_conv(dims, strides, padding, lhs_dilation, rhs_dilation):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(4, 12, 11, 3)).astype(np.float32)   # NHWC
  w = rng.normal(size=(3, 2, 3, 5)).astype(np.float32)     # HWIO
  if dims is None or dims[0] == 'NCHW':
    x, w = x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1)
  args = (x, w, strides, padding, lhs_dilation, rhs_dilation, dims)
  want = lax.conv_general_dilated(*args, precision='highest')
  got = conv_lib.patch_conv(*args, precision='highest')
  assert got.shape == want.shape
  _assert_conv_close(got, want, x, w, *args[2:])


@pytest.mark.parametrize('shape,dims', [((2, 9, 3), ('NWC', 'WIO', 'NWC')),
                                        ((2, 5, 4, 6, 2), ('NDHWC', 'DHWIO', 'NDHWC'))])
def test_patch_conv_in_one_and_three_dimensions(shape, dims):
  rng = np.random.default_rng(2)
  spatial = len(shape) - 2
  x = rng.normal(size=shape).astype(np.float32)
  w = rng.normal(size=(2,) * spatial + (shape[-1], 3)).astype(np.float32)
  args = (x, w, (1,) * spatial, 'SAME', None, None, dims)
  _assert_conv_close(conv_lib.patch_conv(*args, precision='highest'),
                     lax.conv_general_dilated(*args, precision='highest'), x, w, *args[2:])


def test_patch_conv_second_order_gradients_match_finite_differences():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 5, 4, 2)))
  w = jnp.asarray(rng.normal(size=(2, 3, 2, 3)))

  def f(x, w):
    y = conv_lib.patch_conv(x, w, (2, 1), 'SAME', rhs_dilation=(1, 2),
                            dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    return jnp.sum(jnp.tanh(y))

  with jax.enable_x64():
    check_grads(f, (x.astype(jnp.float64), w.astype(jnp.float64)), order=2,
                modes=('fwd', 'rev'))


def test_vmapped_per_client_kernels_become_a_batched_matrix_product():
  """One kernel per client: values and gradients equal XLA's, with no grouped conv."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(6, 4, 10, 10, 3)), jnp.float32)  # [clients, N, H, W, C]
  w = jnp.asarray(rng.normal(size=(6, 3, 3, 3, 8)), jnp.float32)    # [clients, H, W, I, O]
  dims = ('NHWC', 'HWIO', 'NHWC')

  def client_loss(conv):
    def loss(w, x):
      y = conv(x, w, (1, 1), 'VALID', dimension_numbers=dims, precision='highest')
      return jnp.sum(y ** 2)
    return jax.vmap(jax.value_and_grad(loss))

  got = client_loss(conv_lib.patch_conv)(w, x)
  want = client_loss(lax.conv_general_dilated)(w, x)
  # Tolerance. Each output y = conv(x, w) sums K = 3*3*3 = 27 products, so
  # either implementation is within gamma_27 * Y of the exact value, where
  # Y = conv(|x|, |w|). The loss sum(y**2) adds the 4*8*8*8 = 2048 squares,
  # and dL/dw = 2 sum y x sums M = 4*8*8 = 256 products per weight; to first
  # order their errors are at most (2 gamma_27 + gamma_2048) sum Y**2 and
  # (gamma_27 + gamma_256) G, with G = 2 sum Y |x| (the same gradient with
  # absolute values). Two implementations: twice that (float_tolerance.atol).
  with jax.enable_x64():
    ax = jnp.abs(jnp.asarray(x, jnp.float64))
    aw = jnp.abs(jnp.asarray(w, jnp.float64))
    conv = lambda w, x: lax.conv_general_dilated(x, w, (1, 1), 'VALID',
                                                 dimension_numbers=dims)
    y_abs = jax.vmap(conv)(aw, ax)
    g_abs = jax.vmap(lambda w, x, ct: jax.vjp(lambda w: conv(w, x), w)[1](ct)[0])(
        aw, ax, 2 * y_abs)
    loss_abs = jnp.sum(y_abs ** 2, axis=(1, 2, 3, 4))
  (loss_a, grad_a), (loss_b, grad_b) = got, want
  assert np.all(np.abs(np.float64(loss_a) - np.float64(loss_b))
                <= ft.atol(2 * 27 + 2048, np.asarray(loss_abs)))
  assert np.all(np.abs(np.float64(grad_a) - np.float64(grad_b))
                <= ft.atol(27 + 256, np.asarray(g_abs)))
  jaxpr = str(jax.make_jaxpr(client_loss(conv_lib.patch_conv))(w, x))
  assert 'conv_general_dilated' not in jaxpr
  assert 'dot_general' in jaxpr


def test_grouped_convolutions_are_delegated_to_xla():
  rng = np.random.default_rng(5)
  x = rng.normal(size=(2, 6, 6, 4)).astype(np.float32)
  w = rng.normal(size=(3, 3, 2, 6)).astype(np.float32)
  args = (x, w, (1, 1), 'SAME', None, None, ('NHWC', 'HWIO', 'NHWC'))
  # Delegated: the same XLA convolution, so the same numbers.
  np.testing.assert_array_equal(
      conv_lib.patch_conv(*args, feature_group_count=2),
      lax.conv_general_dilated(*args, feature_group_count=2))


def test_string_padding_with_lhs_dilation_is_refused():
  x, w = jnp.zeros((1, 4, 4, 1)), jnp.zeros((2, 2, 1, 1))
  with pytest.raises(ValueError, match=r"padding='SAME' with lhs_dilation=\(2, 2\)"):
    conv_lib.patch_conv(x, w, (1, 1), 'SAME', lhs_dilation=(2, 2),
                        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _perturbed(base, layers, record):
  """``base`` convolution of layer ``l`` (counted in ``record``) with additive
  perturbations: ``y + p_l`` forward, ``(dx + qx_l, dw + qw_l)`` backward.

  With ``record['bounds']`` a dict, the backward pass also stores, per layer,
  ``(conv(|x|, |w|), |dy| through conv(., |w|), |dy| through conv(|x|, .),
  w.shape, dy.shape)``: the magnitudes that bound each sum's rounding.
  """
  def conv(x, w, *args, **kwargs):
    l = record['calls']
    record['calls'] += 1
    f = lambda x, w: base(x, w, *args, **kwargs)

    @jax.custom_vjp
    def perturbed(x, w, p, qx, qw):
      return f(x, w) + p

    def fwd(x, w, p, qx, qw):
      return f(x, w) + p, (x, w, qx, qw)

    def bwd(res, ct):
      x, w, qx, qw = res
      dx, dw = jax.vjp(f, x, w)[1](ct)
      if record.get('bounds') is not None:
        y_abs, vjp_abs = jax.vjp(f, jnp.abs(x), jnp.abs(w))
        record['bounds'][l] = (y_abs, *vjp_abs(jnp.abs(ct)), w.shape, ct.shape)
      return dx + qx, dw + qw, ct, jnp.zeros_like(qx), jnp.zeros_like(qw)

    perturbed.defvjp(fwd, bwd)
    return perturbed(x, w, *layers[l])
  return conv


@pytest.mark.parametrize('build,batch_shape', [
    (lambda conv: models.emnist_cnn(10, dropout=False, conv=conv), (3, 28, 28)),
    pytest.param(  # ~11 s on 2 cores: with the slow tests.
        lambda conv: models.resnet(10, widths=(4, 8, 8), conv=conv), (3, 16, 16, 3),
        marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_models_give_the_same_numbers_with_either_convolution(build, batch_shape,
                                                              monkeypatch):
  rng = np.random.default_rng(6)
  batch = {'x': rng.normal(size=batch_shape).astype(np.float32),
           'y': rng.integers(0, 10, size=batch_shape[0]).astype(np.int32)}
  patches, xla = build('patches'), build('xla')
  params = jax.jit(patches.init)(jax.random.key(0), batch)
  assert (jax.tree.structure(params) ==
          jax.tree.structure(jax.eval_shape(xla.init, jax.random.key(0), batch)))
  loss = lambda model: jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch).mean()))
  (a, ga), (b, gb) = loss(patches)(params), loss(xla)(params)
  # Tolerance. The models run the same code except their convolutions, each
  # a sum of products: forward, K = kh kw C_in per output (within
  # gamma_K conv(|x|, |w|) of exact, either implementation); backward,
  # dx sums K' = kh kw C_out products per input (gamma_K' times dy through
  # conv(., |w|) with |dy|) and dw sums M = N H_out W_out (gamma_M times |dy|
  # through conv(|x|, .)). Two implementations differ by twice that
  # (float_tolerance.atol). To first order, these differences reach the loss
  # and any projection <grad, v> of the gradient through the sensitivities
  # of those to an error added at each place: d/dp_l (forward outputs),
  # d/dqx_l and d/dqw_l (backward outputs), computed exactly by
  # differentiating the round with the errors as inputs. Everything else is
  # the same float32 code on inputs that differ by these amounts, which only
  # adds second-order terms: a factor 2 covers them.
  original = conv_lib.conv_function
  record = {'calls': 0}

  def with_errors(layers, bounds=None):
    record.update(calls=0, bounds=bounds)
    monkeypatch.setattr(conv_lib, 'conv_function', lambda impl, owner: _perturbed(
        original(impl, owner), layers, record))
    value, grad = jax.value_and_grad(lambda p: xla.loss_fn(p, batch).mean())(params)
    return value, sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grad),
                                                     jax.tree.leaves(direction)))

  # The projection on the direction of the difference itself: <ga - gb, v>
  # is then |ga - gb| (2-norm), and the bound, sum |s| E over the places,
  # is at most the 2-norm of the error bounds E of the gradient's sums.
  diff = jax.tree.map(lambda x, y: np.float64(x) - np.float64(y), ga, gb)
  norm = np.sqrt(sum(np.sum(d ** 2) for d in jax.tree.leaves(diff))) or 1.0
  direction = jax.tree.map(lambda d: jnp.asarray(d / norm, jnp.float32), diff)
  shapes = []
  monkeypatch.setattr(conv_lib, 'conv_function', lambda impl, owner: (
      lambda x, w, *args, **kw: shapes.append((x, w, original(impl, owner)(
          x, w, *args, **kw))) or shapes[-1][2]))
  jax.eval_shape(lambda p: xla.loss_fn(p, batch).mean(), params)
  zeros = [tuple(jnp.zeros(v.shape, jnp.float32) for v in (y, x, w)) for x, w, y in shapes]
  def recorded():
    bounds = {}
    with_errors(zeros, bounds)  # Records the magnitudes, layer by layer.
    return bounds

  bounds = jax.jit(recorded)()
  sens_loss, sens_proj = jax.jit(jax.jacrev(lambda e: with_errors(e)))(zeros)

  def bound(sens):
    total = 0.0
    for l, (s_y, s_x, s_w) in enumerate(sens):
      y_abs, dx_abs, dw_abs, w_shape, dy_shape = bounds[l]
      k = int(np.prod(w_shape[:-1]))                         # kh kw C_in
      k_t = int(np.prod(w_shape[:-2])) * w_shape[-1]         # kh kw C_out
      m = int(np.prod(dy_shape[:-1]))                        # N H_out W_out
      total += float(jnp.sum(jnp.abs(s_y) * ft.atol(k, y_abs)) +
                     jnp.sum(jnp.abs(s_x) * ft.atol(k_t, dx_abs)) +
                     jnp.sum(jnp.abs(s_w) * ft.atol(m, dw_abs)))
    return total

  proj = lambda g: sum(np.vdot(np.float64(x), np.float64(d)) for x, d in zip(
      jax.tree.leaves(g), jax.tree.leaves(direction)))
  assert abs(float(a) - float(b)) <= 2 * bound(sens_loss)
  assert abs(proj(ga) - proj(gb)) <= 2 * bound(sens_proj)


def test_unknown_convolution_is_named():
  with pytest.raises(ValueError, match=r"emnist_cnn: conv='cudnn' is not one of \('patches', 'xla'\)"):
    models.emnist_cnn(conv='cudnn')
