"""DeMo as DiLoCo's outer-step compressor (``fedjx.algorithms.compression.dct``).

The oracle is NumPy float64 with its own DCT-II matrix, independent of
``jax.scipy.fft``: the recursion of Peng, Quesnelle, Kingma 2024 (arXiv
2411.19870, Algorithm 1) on DiLoCo's outer gradients, replica by replica.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.compression import dct as demo_lib
import float_tolerance as ft
import linreg_oracle as lo
from test_algorithms_util import KEY, linreg_data, linreg_loss, linreg_params, make_cohort
from test_compression import aggregate


def dct_matrix(s: int) -> np.ndarray:
  """The orthonormal DCT-II, ``C[f, j] = a_f cos(pi (2 j + 1) f / (2 s))``."""
  f, j = np.meshgrid(np.arange(s), np.arange(s), indexing='ij')
  a = np.where(f == 0, np.sqrt(1.0 / s), np.sqrt(2.0 / s))
  return a * np.cos(np.pi * (2 * j + 1) * f / (2 * s))


def wire_bits(d: int, s: int, k: int) -> int:
  """``32 c k + 32 ceil(c k w / 32)``, ``c = ceil(d / s)``, ``w = ceil(log2 s)``."""
  c, w = math.ceil(d / s), math.ceil(math.log2(s))
  return 32 * c * k + 32 * math.ceil(c * k * w / 32)


def flat(p):  # ravel_pytree's order: the dict's keys sorted, 'b' then 'w'.
  return np.concatenate([np.reshape(p['b'], -1), p['w']])


def unflat(v):
  return {'b': v[0], 'w': v[1:]}


def fast_components(m, s, k, margins):
  """``IDCT(top_k(DCT(m)))`` per chunk of ``s`` (zero-padded), float64."""
  d = m.shape[0]
  c = math.ceil(d / s)
  mat = dct_matrix(s)
  y = np.pad(m, (0, c * s - d)).reshape(c, s) @ mat.T
  order = np.argsort(-np.abs(y), axis=1, kind='stable')
  kept = np.zeros_like(y)
  rows = np.arange(c)[:, None]
  kept[rows, order[:, :k]] = y[rows, order[:, :k]]
  if k < s:  # The gap at the k-th component: how far the choice is from a tie.
    sorted_abs = np.take_along_axis(np.abs(y), order, axis=1)
    margins.append(np.min(sorted_abs[:, k - 1] - sorted_abs[:, k]))
  return (kept @ mat).reshape(-1)[:d]


def demo_oracle(data, params, rounds, *, s, k, beta, sign, inner_lr, outer_lr,
                batch_size):
  """DiLoCo with SGD inside and outside, DeMo between (float64)."""
  theta = flat(lo.as64(params))
  n = np.array([len(c['y']) for c in data], np.float64)
  m = np.zeros((len(data), theta.shape[0]))
  margins, magnitudes = [], []
  for _ in range(rounds):
    q = np.zeros_like(m)
    for i, client in enumerate(data):
      local = lo.sgd(unflat(theta), client, batch_size, inner_lr)
      m[i] = beta * m[i] + (theta - flat(local))  # Delta_k = theta - theta_k.
      q[i] = fast_components(m[i], s, k, margins)
      m[i] = m[i] - q[i]
    mean = n @ q / n.sum()
    magnitudes.append(np.min(np.abs(mean)))
    theta = theta - outer_lr * (np.sign(mean) if sign else mean)
  return theta, m, min(margins), min(magnitudes)


def run_diloco(aggregator, data, rounds, inner_lr, outer, batch_size):
  algo = algos.diloco(linreg_loss, 3, inner_optimizer=optax.sgd(inner_lr),
                      outer_optimizer=outer, aggregator=aggregator)
  state = algo.init(linreg_params(DIM))
  cohort = make_cohort(data, batch_size=batch_size)
  for r in range(rounds):
    state, metrics = algo.round(state, cohort, jax.random.fold_in(KEY, r))
  return flat(lo.as64(state.params)), metrics, state


DIM = 5  # d = 6 coordinates (w and b): two chunks of 4, the second padded.


def test_three_replicas_follow_the_numpy_oracle_and_report_the_wire_bits():
  """The paper's update, ``sign(Q)`` (``sign=False`` is checked by the
  ``k = s`` test below, where ``Q`` is applied itself)."""
  s, k, beta, rounds, inner_lr, outer_lr, batch = 4, 2, 0.9, 3, 0.05, 0.05, 3
  data = linreg_data(np.random.default_rng(7), [6, 4, 5], dim=DIM, shift=2.0)
  want, momenta, margin, magnitude = demo_oracle(
      data, linreg_params(DIM), rounds, s=s, k=k, beta=beta, sign=True,
      inner_lr=inner_lr, outer_lr=outer_lr, batch_size=batch)
  agg = demo_lib.demo(3, chunk_size=s, k=k, beta=beta, chunk_shape='1d')
  got, metrics, state = run_diloco(agg, data, rounds, inner_lr, optax.sgd(outer_lr),
                                   batch)
  # Tolerance: float32 against float64 is a chain of float32 sums per round
  # (two local steps' dot products of DIM + 1 terms, a DCT and an IDCT of s
  # terms, a mean of 3), three rounds of them through the momentum: well
  # under 256 sums in all, of terms whose magnitudes (parameters, steps,
  # DCT components) sum to less than 10. The oracle checks that the top-k
  # choice and the signs sit beyond twice that error (no near-ties: two
  # magnitudes each off by atol cannot swap, nor a mean off by atol flip).
  atol = ft.atol(256, 10.0)
  assert margin > 4 * atol and magnitude > 4 * atol
  np.testing.assert_allclose(got, want, rtol=ft.rtol(256), atol=atol)
  # Each replica's momentum m_k after its subtraction, in the state.
  np.testing.assert_allclose(np.asarray(state.aggregator_state.residual), momenta,
                             rtol=ft.rtol(256), atol=atol)
  d = DIM + 1
  # 2 chunks x 2 values (float32) and 4 indices of 2 bits in one uint32 word.
  assert wire_bits(d, s, k) == 4 * 32 + 32
  assert float(metrics['upload_bits']) == wire_bits(d, s, k)
  assert float(metrics['download_bits']) == 32 * d + 64
  assert float(metrics['communicated_bytes']) == 3 * wire_bits(d, s, k) / 8


@pytest.mark.parametrize('d,s,k', [(300, 64, 32), (13, 5, 3)])
def test_the_message_holds_the_formulas_bits(d, s, k):
  """``32 c k`` bits of float32 values and ``c k`` indices of ``ceil(log2 s)``
  bits packed in ``uint32`` words; decoding gives the sparse IDCT."""
  x = np.random.default_rng(d).normal(size=d).astype(np.float32)
  comp = demo_lib.dct_top_k(s, k)
  message, bits = jax.jit(comp.encode)(KEY, jax.numpy.asarray(x))
  c, w = math.ceil(d / s), math.ceil(math.log2(s))
  assert message['values'].dtype == np.float32 and message['values'].shape == (c * k,)
  assert message['indices'].dtype == np.uint32
  assert message['indices'].shape == (math.ceil(c * k * w / 32),)
  assert float(bits) == wire_bits(d, s, k)
  margins = []
  want = fast_components(x.astype(np.float64), s, k, margins)
  # One DCT and one IDCT of s terms each (the round-trip test's bound, for
  # the largest chunk's ||x||_1); no near-tie in top-k.
  l1 = np.abs(np.pad(x, (0, -d % s)).reshape(-1, s)).sum(axis=1).max()
  atol = ft.atol(s + 1, 2.0 * l1)
  assert min(margins) > 2 * atol
  decode = jax.jit(comp.decode, static_argnums=2)
  np.testing.assert_allclose(np.asarray(decode(KEY, message, d)), want, atol=atol)


@pytest.mark.parametrize('s', [5, 64])
def test_dct_is_the_orthonormal_dct_ii_and_inverts(s):
  """``IDCT(DCT(x)) = x`` and ``DCT`` is the NumPy matrix, within float32.

  Bound: a chunk's DCT is ``s`` products with ``|C| <= sqrt(2 / s)``, so its
  error is at most ``gamma_{s+1} sqrt(2 / s) ||x||_1`` per component; the
  IDCT adds its own and carries that one, together under
  ``(2 + sqrt 2) gamma_{s+1} ||x||_1 <= ft.atol(s + 1, 2 ||x||_1)``.
  """
  x = np.random.default_rng(s).normal(size=3 * s - 1).astype(np.float32)
  l1 = 2.0 * np.abs(x).sum()
  y = np.asarray(jax.jit(demo_lib.chunked_dct, static_argnums=1)(x, s))
  ref = np.pad(x.astype(np.float64), (0, 1)).reshape(3, s) @ dct_matrix(s).T
  np.testing.assert_allclose(y, ref, atol=ft.atol(s + 1, l1))
  back = np.asarray(jax.jit(demo_lib.chunked_idct, static_argnums=1)(y, x.shape[0]))
  np.testing.assert_allclose(back, x, atol=ft.atol(s + 1, l1))
  np.testing.assert_allclose(dct_matrix(s) @ dct_matrix(s).T, np.eye(s), atol=1e-12)


def momentum_diloco_oracle(data, params, rounds, inner_lr, outer_lr, momentum,
                           batch_size):
  """DiLoCo's uncompressed weighted mean under outer momentum SGD (optax's
  ``trace``: ``v <- mu v + Delta``, ``theta <- theta - eta v``), float64."""
  theta = flat(lo.as64(params))
  n = np.array([len(c['y']) for c in data], np.float64)
  v = np.zeros_like(theta)
  for _ in range(rounds):
    deltas = np.stack([theta - flat(lo.sgd(unflat(theta), c, batch_size, inner_lr))
                       for c in data])
    v = momentum * v + n @ deltas / n.sum()
    theta = theta - outer_lr * v
  return theta


def test_k_equal_to_the_chunk_size_is_uncompressed_momentum_sgd():
  """With ``k = s`` every component is sent and ``m_k`` is emptied each
  round (to the DCT round trip's float32 error), so ``sign=False`` gives
  DiLoCo's uncompressed mean: under an outer momentum SGD, momentum SGD on
  the outer gradients, three rounds of it against NumPy."""
  data = linreg_data(np.random.default_rng(8), [6, 4, 5], dim=DIM, shift=2.0)
  agg = demo_lib.demo(3, chunk_size=4, k=4, beta=0.9, sign=False, chunk_shape='1d')
  got, metrics, _ = run_diloco(agg, data, 3, 0.05, optax.sgd(0.5, momentum=0.9), 3)
  want = momentum_diloco_oracle(data, linreg_params(DIM), 3, 0.05, 0.5, 0.9, 3)
  # The same chain of float32 sums as the oracle test, the DCT's included.
  np.testing.assert_allclose(got, want, rtol=ft.rtol(256), atol=ft.atol(256, 10.0))
  assert float(metrics['upload_bits']) == wire_bits(DIM + 1, 4, 4)


@pytest.mark.parametrize('kwargs,match', [
    (dict(chunk_size=1), r'chunk_size=1 must be an int >= 2'),
    (dict(chunk_size=4.0), r'chunk_size=4.0 must be an int >= 2'),
    (dict(chunk_size=True), r'chunk_size=True must be an int >= 2'),
    (dict(chunk_size=8, k=0), r'k=0 must be an int in \[1, chunk_size\*\*2=64\]'),
    (dict(chunk_size=8, k=9, chunk_shape='1d'), r'k=9 must be an int in \[1, chunk_size=8\]'),
    (dict(chunk_size=8, k=65), r'k=65 must be an int in \[1, chunk_size\*\*2=64\]'),
    (dict(chunk_shape='3d'), r"chunk_shape='3d' is not allowed; it must be '2d'"),
    (dict(beta=1.5), r'beta=1.5 must be a number in \[0, 1\]'),
    (dict(beta=-0.1), r'beta=-0.1 must be a number in \[0, 1\]'),
    (dict(beta=float('nan')), r'beta=nan must be a number in \[0, 1\]'),
    (dict(sign='yes'), r"sign='yes' must be True"),
    (dict(num_replicas=None), r'num_replicas=None must be a positive int'),
    (dict(num_replicas=0), r'num_replicas=0 must be a positive int'),
    (dict(num_replicas=2.0), r'num_replicas=2.0 must be a positive int'),
])
def test_errors_name_the_argument_its_value_and_what_is_allowed(kwargs, match):
  kwargs = {'num_replicas': 3, **kwargs}
  with pytest.raises(ValueError, match=r'^demo: ' + match):
    demo_lib.demo(**kwargs)


# ------------------------------------------------------- 2-D tiles ('2d')

def tile_np(n, chunk):
  """The largest divisor of n not above chunk (n when n <= chunk)."""
  return n if n <= chunk else max(t for t in range(1, chunk + 1) if n % t == 0)


def tiles_np(x, chunk):
  """The tiles of a leaf, row-major over (layer, grid row, grid column),
  float64: [n, t_r, t_c] of a matrix's last two axes, [n, t] of a vector."""
  x = np.asarray(x, np.float64)
  if x.ndim < 2:
    t = tile_np(x.size, chunk)
    return x.reshape(-1, t)
  r, c = x.shape[-2:]
  tr, tc = tile_np(r, chunk), tile_np(c, chunk)
  return np.stack([layer[i:i + tr, j:j + tc] for layer in x.reshape(-1, r, c)
                   for i in range(0, r, tr) for j in range(0, c, tc)])


def dct_tiles_np(x, chunk):
  """``C_r X C_c^T`` of each tile (``C x`` of a 1-D chunk), the NumPy matrices."""
  t = tiles_np(x, chunk)
  if t.ndim == 2:
    return t @ dct_matrix(t.shape[1]).T
  return dct_matrix(t.shape[1]) @ t @ dct_matrix(t.shape[2]).T


def untile_np(t, shape):
  if len(shape) < 2:
    return t.reshape(shape)
  r, c = shape[-2:]
  tr, tc = t.shape[1:]
  out = np.zeros((math.prod(shape[:-2]), r, c))
  n = 0
  for layer in range(out.shape[0]):
    for i in range(0, r, tr):
      for j in range(0, c, tc):
        out[layer, i:i + tr, j:j + tc] = t[n]
        n += 1
  return out.reshape(shape)


def tiled_fast_components(x, chunk, k, margins):
  """``IDCT(top_k(DCT(x)))`` tile by tile, ``min(k, tile size)`` kept, float64."""
  y = dct_tiles_np(x, chunk)
  flat = y.reshape(y.shape[0], -1)
  kk = min(k, flat.shape[1])
  order = np.argsort(-np.abs(flat), axis=1, kind='stable')
  kept = np.zeros_like(flat)
  rows = np.arange(flat.shape[0])[:, None]
  kept[rows, order[:, :kk]] = flat[rows, order[:, :kk]]
  if kk < flat.shape[1]:
    mags = np.take_along_axis(np.abs(flat), order, axis=1)
    margins.append(np.min(mags[:, kk - 1] - mags[:, kk]))
  kept = kept.reshape(y.shape)
  if kept.ndim == 2:
    back = kept @ dct_matrix(kept.shape[1])
  else:
    back = dct_matrix(kept.shape[1]).T @ kept @ dct_matrix(kept.shape[2])
  return untile_np(back, np.shape(x))


# A stacked [L, m, n] leaf (12 = 3 x 4 rows, 10 = 5 x 2 columns at chunk 4),
# a matrix with a prime axis (7: tiles of one row; 6: of 3 columns), a vector
# and a scalar.
SHAPES = ((2, 12, 10), (7, 6), (10,), ())
CHUNK = 4


def leaf_tree(rng, lead=()):
  return {f'p{i}': rng.normal(size=lead + s).astype(np.float32)
          for i, s in enumerate(SHAPES)}


def flatten(tree):  # ravel_pytree's order: the keys sorted.
  return np.concatenate([np.reshape(tree[key], -1) for key in sorted(tree)])


def test_tiled_dct_is_c_x_c_transpose_per_tile_and_inverts():
  """Against the NumPy DCT matrices, for tiles 4 x 2 of a stacked leaf,
  1 x 3 of a matrix with a prime axis, and 1-D chunks. Bound: a 2-D tile's
  component is a sum of t_r t_c products with |C_r C_c| <= 2 / sqrt(t_r t_c)
  (at most 8 terms here), the inverse the same: ft.atol(9, 2 ||x||_1) with
  ||x||_1 of the largest tile, as the 1-D test's bound."""
  rng = np.random.default_rng(11)
  for shape in SHAPES[:3]:
    x = rng.normal(size=shape).astype(np.float32)
    t = tiles_np(x, CHUNK)
    atol = ft.atol(9, 4.0 * np.abs(t).reshape(t.shape[0], -1).sum(1).max())
    y = np.asarray(jax.jit(demo_lib.tiled_dct, static_argnums=1)(x, CHUNK))
    np.testing.assert_allclose(y, dct_tiles_np(x, CHUNK), atol=atol)
    back = np.asarray(jax.jit(demo_lib.tiled_idct, static_argnums=1)(y, shape))
    np.testing.assert_allclose(back, x, atol=atol)
  # A full 64 x 64 tile of a 128 x 64 matrix: the paper's size.
  x = rng.normal(size=(128, 64)).astype(np.float32)
  y = np.asarray(jax.jit(demo_lib.tiled_dct, static_argnums=1)(x, 64))
  assert y.shape == (2, 64, 64)
  l1 = np.abs(tiles_np(x, 64)).reshape(2, -1).sum(1).max()
  np.testing.assert_allclose(y, dct_tiles_np(x, 64), atol=ft.atol(64 * 64 + 1, 2.0 * l1))


def test_tiled_dct_top_k_is_a_numpy_loop_over_tiles_and_counts_its_bits():
  rng = np.random.default_rng(12)
  tree = leaf_tree(rng)
  shapes = tuple(tree[key].shape for key in sorted(tree))
  k = 3
  comp = demo_lib.tiled_dct_top_k(shapes, CHUNK, k)
  x = jax.numpy.asarray(flatten(tree))
  message, bits = jax.jit(comp.encode)(KEY, x)
  got = np.asarray(jax.jit(comp.decode, static_argnums=2)(KEY, message, x.shape[0]))
  margins = []
  want = np.concatenate([tiled_fast_components(tree[key], CHUNK, k, margins).reshape(-1)
                         for key in sorted(tree)])
  # A DCT and an IDCT of at most 8 terms per tile (the round-trip bound), no
  # near-tie among the kept components.
  atol = ft.atol(9, 4.0 * np.abs(flatten(tree)).max() * 8)
  assert min(margins) > 2 * atol
  np.testing.assert_allclose(got, want, atol=atol)
  # Sent per leaf: (2, 12, 10) 30 tiles of 8, 3 values, 3-bit indices;
  # (7, 6) 14 tiles of 3, 3 values (all), 2-bit; (10,) 5 chunks of 2, 2
  # values (all), 1-bit; () one value, 0-bit indices (no word).
  sent = {(2, 12, 10): (90, 3), (7, 6): (42, 2), (10,): (10, 1), (): (1, 0)}
  expect = sum(32 * m + 32 * math.ceil(m * w / 32) for m, w in sent.values())
  assert float(bits) == expect == demo_lib.tiled_dct_bits(shapes, CHUNK, k)
  values = [v for key, v in message.items() if key.startswith('values.')]
  assert sum(v.size for v in values) == sum(m for m, _ in sent.values())
  assert all(v.dtype == np.float32 for v in values)


def test_a_stacked_leaf_is_tiled_layer_by_layer():
  """A ``[L, m, n]`` leaf compresses as its ``L`` layers each on its own."""
  rng = np.random.default_rng(13)
  stack = rng.normal(size=(3, 12, 10)).astype(np.float32)
  def round_trip(shape):
    comp = demo_lib.tiled_dct_top_k((shape,), CHUNK, 3)

    @jax.jit
    def run(v):
      message, bits = comp.encode(KEY, v)
      return comp.decode(KEY, message, v.shape[0]), bits
    return run

  got, bits = round_trip(stack.shape)(stack.reshape(-1))
  got = np.asarray(got).reshape(stack.shape)
  one = round_trip((12, 10))
  layers = [np.asarray(one(layer.reshape(-1))[0]).reshape(12, 10) for layer in stack]
  # The same float32 operations on each tile, so equal up to rounding; at
  # most the round-trip bound of a tile (8 terms, ||x||_1 <= 8 max |x|).
  atol = ft.atol(9, 4.0 * 8 * np.abs(stack).max())
  np.testing.assert_allclose(got, np.stack(layers), atol=atol)
  assert float(bits) == 3 * 32 * 45 + 32 * math.ceil(135 * 3 / 32)
  dct = jax.jit(demo_lib.tiled_dct, static_argnums=1)
  y = np.asarray(dct(stack, CHUNK))
  per_layer = [np.asarray(dct(a, CHUNK)) for a in stack]
  np.testing.assert_allclose(y, np.concatenate(per_layer), atol=atol)


def test_demo_2d_one_combine_follows_the_tiled_oracle():
  """The default layout through the aggregator, ``sign=True``: replicas
  [1, 2, 0] with momenta, replica 2 without data."""
  rng = np.random.default_rng(14)
  k, beta = 3, 0.9
  agg = demo_lib.demo(3, chunk_size=CHUNK, k=k, beta=beta)
  updates = leaf_tree(rng, lead=(3,))
  params = jax.tree.map(lambda u: u[0], updates)
  d = sum(math.prod(s) for s in SHAPES)
  mom = rng.normal(size=(3, d)).astype(np.float32)
  state = agg.init(params)._replace(residual=jax.numpy.asarray(mom))
  ids = jax.numpy.asarray([1, 2, 0], jax.numpy.int32)
  w = jax.numpy.asarray([2.0, 0.0, 1.0])
  mean, state, metrics = aggregate(agg, jax.tree.map(jax.numpy.asarray, updates), w, ids,
                                   state)
  mom = mom.astype(np.float64)
  keys = sorted(updates)
  offsets = np.cumsum([0] + [updates[key][0].size for key in keys])
  q, margins = {}, []
  for i, rid in [(0, 1), (2, 0)]:
    a = beta * mom[rid] + flatten({key: updates[key][i] for key in keys})
    q[rid] = np.concatenate([
        tiled_fast_components(a[offsets[j]:offsets[j + 1]].reshape(updates[key].shape[1:]),
                              CHUNK, k, margins).reshape(-1) for j, key in enumerate(keys)])
    mom[rid] = a - q[rid]
  avg = (2 * q[1] + q[0]) / 3
  # The momentum's 2 terms, a DCT and an IDCT of at most 8 terms per tile,
  # a 3-term mean: n = 2 + 9 + 9 + 3, over magnitudes under 8 times the
  # largest input. The signs and the choices are beyond it.
  scale = 8 * (np.abs(mom).max() + np.abs(flatten(updates)).max())
  atol = ft.atol(23, scale)
  assert min(margins) > 2 * atol and np.min(np.abs(avg)) > 2 * atol
  np.testing.assert_array_equal(flatten(jax.tree.map(np.asarray, mean)), np.sign(avg))
  np.testing.assert_allclose(np.asarray(state.residual), mom, atol=atol)
  bits = demo_lib.tiled_dct_bits(SHAPES, CHUNK, k)
  assert float(metrics['upload_bits']) == bits
  assert agg.message_bytes(params) == math.ceil(bits / 8)
