"""SparseLoCo and MuLoCo-style quantized DiLoCo against NumPy oracles; bits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.compression import compressors as compression
from fedjx.algorithms.compression import outer as oc
from test_algorithms_util import KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort
from test_compression import aggregate

SIZES = [8, 4, 8]  # Three replicas; batches of 4: 2, 1 and 2 real steps.
DIM = 7            # d = 8 coordinates: b, then w (ravel order of the dict).
H = 3              # Inner steps, cycling through each replica's real steps.
LR = 0.05          # Inner SGD.
ROUNDS = 3
# Tolerance. Every float32 result below is a chain of sums: per round, each
# of H = 3 inner steps is an (8-term) prediction, a (4-example) mean and an
# update (2 terms); the compressor takes a mean and a variance of at most 8
# values, bin sums of at most 8; the server a mean over 3 replicas; the
# accumulator and outer step add 3 terms: < 3 * 14 + 3 * 8 + 3 + 3 = 72
# terms a round, 216 over the 3 rounds. Inner SGD is stable (learning rate
# times curvature well below 2) and the outer steps are contractions or
# plain additions, so earlier errors are not amplified and float32 agrees
# with the float64 oracle to 2 gamma_n, n = 216 (float_tolerance), relative
# to each leaf's scale. The discrete choices (top-k picks, bin codes) are
# the same in both precisions when no value lies within that tolerance of a
# tie or a bin boundary: the oracle asserts so (MARGIN).
N_TERMS = ROUNDS * 72
MARGIN = 1e-4


def _setup():
  data = linreg_data(np.random.default_rng(7), SIZES, dim=DIM, shift=2.0)
  cohort = make_cohort(data, batch_size=4)
  return data, cohort, linreg_params(DIM)


def _flat(params):
  return np.concatenate([np.reshape(np.asarray(params['b'], np.float64), 1),
                         np.asarray(params['w'], np.float64)])


def _inner_np(theta, data):
  """H steps of SGD on the replica's real batches of 4, float64."""
  x_all, y_all = data['x'].astype(np.float64), data['y'].astype(np.float64)
  batches = [(x_all[i:i + 4], y_all[i:i + 4]) for i in range(0, len(y_all), 4)]
  t = theta.copy()
  for s in range(H):
    x, y = batches[s % len(batches)]
    r = x @ t[1:] + t[0] - y
    t = t - LR * np.concatenate([[r.mean()], x.T @ r / len(r)])
  return t


def _quantize_np(v, bits=2, r=6.0):
  """Statistical quantization (module docstring) in float64."""
  levels = 2 ** bits
  mu = v.mean()
  c = v - mu
  scale = r * np.sqrt(np.sum(c ** 2) / (len(v) - 1)) / levels
  pos = c / scale + levels // 2
  # Cells meet at the half-integers 0.5 .. L - 1.5 of pos.
  edges = np.arange(levels - 1) + 0.5
  assert np.min(np.abs(pos[:, None] - edges)) > MARGIN, 'a value on a cell edge'
  codes = np.clip(np.round(pos), 0, levels - 1).astype(int)
  lookup = np.array([c[codes == i].mean() if np.any(codes == i) else 0.0
                     for i in range(levels)])
  return mu + lookup[codes]


def _top_k_np(e, k, chunk):
  n = len(e)
  chunks = -(-n // chunk)
  blocks = np.pad(e, (0, chunks * chunk - n)).reshape(chunks, chunk)
  order = np.argsort(-np.abs(blocks), axis=1)
  index = order[:, :k]
  mags = np.sort(np.abs(blocks), axis=1)[:, ::-1]
  assert np.all(mags[:, k - 1] - mags[:, k] > MARGIN * mags[:, 0]), 'a tie'
  values = np.take_along_axis(blocks, index, 1).reshape(-1)
  q = _quantize_np(values)
  dense = np.zeros_like(blocks)
  np.put_along_axis(dense, index, q.reshape(chunks, k), 1)
  return dense.reshape(-1)[:n]


def _sparseloco_np(data, theta, k, chunk, beta, alpha):
  """SparseLoCo (Sarfi et al. 2025, Algorithm 1) in float64."""
  e = np.zeros((len(data), len(theta)))
  for _ in range(ROUNDS):
    sent = []
    for i, d in enumerate(data):
      e[i] = beta * e[i] + (theta - _inner_np(theta, d))
      m = _top_k_np(e[i], k, chunk)
      e[i] -= m
      sent.append(m)
    theta = theta - alpha * np.mean(sent, 0)
  return theta, e


def _muloco_np(data, theta, lr=0.7, mu=0.9):
  """Quantized outer gradient with error feedback, outer Nesterov, float64."""
  e = np.zeros((len(data), len(theta)))
  trace = np.zeros_like(theta)
  for _ in range(ROUNDS):
    sent = []
    for i, d in enumerate(data):
      a = (theta - _inner_np(theta, d)) + e[i]
      m = _quantize_np(a)
      e[i] = a - m
      sent.append(m)
    g = np.mean(sent, 0)
    trace = g + mu * trace
    theta = theta - lr * (g + mu * trace)
  return theta, e


def _run(algo, params, cohort):
  state = algo.init(params)
  for r in range(ROUNDS):
    state, metrics = algo.round(state, cohort, jax.random.fold_in(KEY, r))
  return state, metrics


def _as_tree(flat):
  return {'b': flat[0], 'w': flat[1:]}


def test_sparseloco_matches_the_papers_algorithm_and_counts_its_bits():
  data, cohort, params = _setup()
  k, chunk, beta = 2, 4, 0.95
  algo = algos.diloco(linreg_loss, 3, inner_optimizer=optax.sgd(LR),
                      inner_steps=H, weighting='uniform',
                      aggregator=oc.sparseloco(3, k=k, chunk_size=chunk,
                                               beta=beta, chunk_shape='1d'),
                      outer_momentum=0.0, outer_learning_rate=1.0)
  state, metrics = _run(algo, params, cohort)
  theta, e = _sparseloco_np(data, _flat(params), k, chunk, beta, 1.0)
  assert_trees_close(state.params, _as_tree(theta), n=N_TERMS)
  np.testing.assert_allclose(np.asarray(state.aggregator_state.residual), e,
                             rtol=2 * N_TERMS * 2 ** -24,
                             atol=2 * N_TERMS * 2 ** -24 * np.abs(e).max())
  # m = 2 chunks x 2 = 4 values: 4 indices of 2 bits and 4 codes of 2 bits
  # (a word each), 4 float32 lookup entries and the float32 mean.
  bits = oc.sparseloco_upload_bits(8, k, chunk)
  assert bits == 32 + 32 + 5 * 32
  assert float(metrics['upload_bits']) == bits
  assert float(metrics['communicated_bytes']) == 3 * bits / 8


def test_muloco_quantized_matches_its_oracle_and_counts_its_bits():
  data, cohort, params = _setup()
  algo = algos.diloco(linreg_loss, 3, inner_optimizer=optax.sgd(LR),
                      inner_steps=H, weighting='uniform',
                      aggregator=oc.muloco_quantized(3))
  state, metrics = _run(algo, params, cohort)
  theta, e = _muloco_np(data, _flat(params))
  assert_trees_close(state.params, _as_tree(theta), n=N_TERMS)
  np.testing.assert_allclose(np.asarray(state.aggregator_state.residual), e,
                             rtol=2 * N_TERMS * 2 ** -24,
                             atol=2 * N_TERMS * 2 ** -24 * np.abs(e).max())
  bits = oc.muloco_upload_bits(8)
  assert bits == 32 + 5 * 32  # 8 codes of 2 bits in a word, the table, the mean
  assert float(metrics['upload_bits']) == bits
  assert float(metrics['communicated_bytes']) == 3 * bits / 8


def test_sparseloco_decays_only_the_accumulators_of_replicas_with_data():
  """One combine over replicas [3, 1, 0] of 4 from nonzero accumulators,
  replica 0 without data: it keeps its accumulator as it was (undecayed);
  the others follow ``e <- beta e + Delta - m`` and the mean is that of
  their two messages."""
  rng = np.random.default_rng(21)
  k, chunk, beta = 2, 4, 0.5
  agg = oc.sparseloco(4, k=k, chunk_size=chunk, beta=beta, chunk_shape='1d')
  ids = jnp.asarray([3, 1, 0], jnp.int32)
  w = jnp.asarray([1.0, 1.0, 0.0])
  u = rng.normal(size=(3, 6)).astype(np.float32)
  e = rng.normal(size=(4, 6)).astype(np.float32)
  state = agg.init(jnp.zeros(6))._replace(residual=jnp.asarray(e))
  mean, state, _ = aggregate(agg, jnp.asarray(u), w, ids, state)
  e = e.astype(np.float64)
  sent = []
  for i, rid in enumerate(np.asarray(ids)[:2]):
    a = beta * e[rid] + u[i]
    m = _top_k_np(a, k, chunk)
    e[rid] = a - m
    sent.append(m)
  # Float32 sums of at most 4 terms (the kept values' mean and variance, a
  # bucket), then the accumulator's 3 terms: n = 7 (float_tolerance).
  tol = 2 * 7 * 2 ** -24
  np.testing.assert_allclose(np.asarray(mean), np.mean(sent, 0), rtol=tol,
                             atol=tol * np.abs(sent).max())
  np.testing.assert_allclose(np.asarray(state.residual), e, rtol=tol,
                             atol=tol * (np.abs(u).max() + np.abs(e).max()))


@pytest.mark.parametrize('d,k,chunk,bits', [(5000, 64, 4096, 2),
                                            (4096, 32, 4096, 2),
                                            (300, 3, 100, 4)])
def test_the_message_bits_equal_the_formula(d, k, chunk, bits):
  """The message's shapes (traced, not run: the counted bits depend on them
  only) give the formula; one small message is also encoded for real."""
  x = jax.ShapeDtypeStruct((d,), jnp.float32)
  m = math.ceil(d / chunk) * k
  w = math.ceil(math.log2(chunk))
  expect = (32 * math.ceil(m * w / 32) + 32 * math.ceil(m * bits / 32)
            + 32 * (2 ** bits + 1))
  encode = oc.chunked_top_k(k, chunk, bits).encode
  message = jax.eval_shape(lambda v: encode(None, v)[0], x)
  assert compression.representation_bits(message) == expect
  assert oc.sparseloco_upload_bits(d, k, chunk, bits) == expect
  encode = oc.statistical_levels(bits).encode
  message = jax.eval_shape(lambda v: encode(None, v)[0], x)
  expect = 32 * math.ceil(d * bits / 32) + 32 * (2 ** bits + 1)
  assert compression.representation_bits(message) == expect
  assert oc.muloco_upload_bits(d, bits) == expect


def test_the_counted_bits_are_the_messages_and_it_decodes_its_top_k():
  x = jnp.asarray([0.5, -3.0, 0.1, 2.0, -0.2, 0.3, 4.0, -1.0, 0.05, 7.0],
                  jnp.float32)
  comp = oc.chunked_top_k(2, 4)
  message, counted = jax.jit(lambda v: comp.encode(None, v))(x)
  assert float(counted) == compression.representation_bits(message) == \
      oc.sparseloco_upload_bits(10, 2, 4)
  decoded = np.asarray(comp.decode(None, message, 10))
  # Chunks [0.5 -3 0.1 2], [-0.2 0.3 4 -1], [0.05 7 (pad pad)]: two kept each.
  np.testing.assert_array_equal(decoded != 0, [0, 1, 0, 1, 0, 0, 1, 1, 1, 1])


def test_diloco_takes_muon_as_its_inner_optimizer():
  """MuLoCo: Muon inside, 2-bit error feedback outside, on a matrix model."""
  rng = np.random.default_rng(3)
  data = []
  for n in SIZES:
    x = rng.normal(size=(n, 4)).astype(np.float32)
    data.append({'x': x, 'y': (x @ rng.normal(size=(4, 2))).astype(np.float32)})
  cohort = make_cohort(data, batch_size=4)

  def loss(p, batch):
    return 0.5 * jnp.sum(jnp.square(batch['x'] @ p['w'] + p['b'] - batch['y']), -1)

  params = {'w': jnp.zeros((4, 2), jnp.float32), 'b': jnp.zeros(2, jnp.float32)}
  algo = algos.diloco(loss, 3, inner_optimizer=oc.muon_inner_optimizer(0.05),
                      inner_steps=H, aggregator=oc.muloco_quantized(3))
  state = algo.init(params)
  assert 'learning_rate' in state.hparams['inner_optimizer']
  first = None
  for r in range(ROUNDS):
    state, metrics = algo.round(state, cohort, jax.random.fold_in(KEY, r))
    first = first if first is not None else float(metrics['train_loss_before'])
  assert np.all(np.isfinite(np.asarray(state.params['w'])))
  assert float(metrics['train_loss_after']) < first


@pytest.mark.parametrize('build,match', [
    (lambda: oc.sparseloco(3, k=0), r'sparseloco: k=0 is not allowed; it must be an int >= 1'),
    (lambda: oc.sparseloco(3, k=9, chunk_size=8), r'k=9 is not allowed; it must be <= chunk_size=8'),
    (lambda: oc.sparseloco(3, chunk_size=2.5), r'chunk_size=2.5 is not allowed'),
    (lambda: oc.sparseloco(3, beta=1.5), r'sparseloco: beta=1.5 is not allowed; it must be a number in \[0, 1\]'),
    (lambda: oc.sparseloco(3, bits=5), r'bits=5 is not allowed; it must be one of'),
    (lambda: oc.sparseloco(0), r'num_replicas'),
    (lambda: oc.muloco_quantized(3, range_sigmas=0), r'muloco_quantized: range_sigmas=0 is not allowed'),
    (lambda: oc.muloco_quantized(3, range_sigmas=-1.0), r'range_sigmas=-1.0 is not allowed'),
    (lambda: oc.muloco_quantized(3, bits=True), r'bits=True is not allowed'),
])
def test_bad_arguments_name_argument_value_and_what_is_allowed(build, match):
  with pytest.raises(ValueError, match=match):
    build()


# ------------------------------------------------------- 2-D tiles ('2d')

def _tile_np(n, chunk):
  """The largest divisor of n not above chunk (n when n <= chunk)."""
  return n if n <= chunk else max(t for t in range(1, chunk + 1) if n % t == 0)


def _quantize_any_np(v):
  """:func:`_quantize_np`, with a single value sent exactly (its mean)."""
  return v.copy() if len(v) == 1 else _quantize_np(v)


def _tile_slices(shape, chunk):
  """(layer, rows, cols) of every tile of a leaf, in row-major grid order,
  the leaf viewed as [L, r, c] (a vector or scalar as [1, 1, size])."""
  if len(shape) < 2:
    layers, r, c = 1, 1, math.prod(shape)
    tr, tc = 1, _tile_np(c, chunk)
  else:
    layers, (r, c) = math.prod(shape[:-2]), shape[-2:]
    tr, tc = _tile_np(r, chunk), _tile_np(c, chunk)
  return [(layer, slice(i, i + tr), slice(j, j + tc)) for layer in range(layers)
          for i in range(0, r, tr) for j in range(0, c, tc)]


def _as3(x):
  return x.reshape(1, 1, -1) if x.ndim < 2 else x.reshape(-1, *x.shape[-2:])


def _tiled_top_k_np(leaf, k, chunk):
  """SparseLoCo's '2d' chunks of one leaf by an explicit loop over its tiles:
  the top min(k, tile size) magnitudes of each, then the leaf's kept values
  quantized together (one table per leaf), float64."""
  x = _as3(np.asarray(leaf, np.float64))
  picks = []
  for where in _tile_slices(np.shape(leaf), chunk):
    flat = x[where].reshape(-1)
    kk = min(k, flat.size)
    order = np.argsort(-np.abs(flat), kind='stable')
    if kk < flat.size:
      mags = np.abs(flat)[order]
      assert mags[kk - 1] - mags[kk] > MARGIN * mags[0], 'a tie'
    picks.append((where, order[:kk]))
  sent = _quantize_any_np(np.concatenate([x[w].reshape(-1)[i] for w, i in picks]))
  out, start = np.zeros_like(x), 0
  for where, index in picks:
    tile = np.zeros(x[where].size)
    tile[index] = sent[start:start + len(index)]
    out[where] = tile.reshape(x[where].shape)
    start += len(index)
  return out.reshape(np.shape(leaf))


# A stacked [L, m, n] leaf with axes 64 does not divide (12 = 3 x 4, 10 = 5 x
# 2 for chunk 4), a matrix with a prime axis (7: tiles of 1 row), a vector,
# and a scalar.
SHAPES = ((2, 12, 10), (7, 6), (10,), ())
CHUNK = 4  # Tiles of at most 4 x 4: 4 x 2 (first leaf), 1 x 3, 1-D 2, 1.


def _tree(rng, shapes=SHAPES, lead=()):
  return {f'p{i}': rng.normal(size=lead + s).astype(np.float32)
          for i, s in enumerate(shapes)}


def _flatten(tree):  # ravel_pytree's order: the keys sorted.
  return np.concatenate([np.reshape(tree[key], -1) for key in sorted(tree)])


def test_tile_length_is_the_largest_divisor_not_above_the_chunk():
  cases = [(100, 64), (128, 64), (97, 64), (30, 64), (64, 64), (12, 4), (7, 4),
           (1, 4), (4096, 64), (50257, 64)]
  for n, chunk in cases:
    assert oc.tile_length(n, chunk) == _tile_np(n, chunk), (n, chunk)
  assert oc.tile_shape((3, 100, 70), 64) == (50, 35)
  assert oc.tile_shape((70,), 64) == (35,)
  assert oc.tile_shape((), 64) == (1,)


def test_tiles_round_trip_in_row_major_grid_order():
  x = np.arange(2 * 12 * 10, dtype=np.float32).reshape(2, 12, 10)
  tiles = np.asarray(oc.to_tiles(jnp.asarray(x), (4, 2)))
  assert tiles.shape == (2 * 3 * 5, 4, 2)
  # Tile (layer 1, grid row 2, grid column 3) is number 1 * 15 + 2 * 5 + 3.
  np.testing.assert_array_equal(tiles[15 + 10 + 3], x[1, 8:12, 6:8])
  np.testing.assert_array_equal(np.asarray(oc.from_tiles(jnp.asarray(tiles), x.shape)), x)


def test_tiled_top_k_is_a_numpy_loop_over_tiles_and_counts_its_bits():
  rng = np.random.default_rng(5)
  tree = _tree(rng)
  shapes = tuple(tree[key].shape for key in sorted(tree))
  k = 3
  comp = oc.tiled_top_k(shapes, k, CHUNK)
  x = jnp.asarray(_flatten(tree))
  message, counted = jax.jit(lambda v: comp.encode(None, v))(x)
  decoded = np.asarray(jax.jit(lambda m: comp.decode(None, m, x.shape[0]))(message))
  want = np.concatenate([_tiled_top_k_np(tree[key], k, CHUNK).reshape(-1)
                         for key in sorted(tree)])
  np.testing.assert_array_equal(decoded != 0, want != 0)
  # Float32 mean, variance and bucket means of at most 60 kept values of a
  # leaf (n = 3 * 60 sums), then one addition: relative to the largest value.
  tol = 2 * 181 * 2 ** -24
  np.testing.assert_allclose(decoded, want, rtol=tol, atol=tol * np.abs(want).max())
  # Kept values and their index widths, counted from the layout by hand:
  # leaf (2, 12, 10): 30 tiles of 4 x 2 = 8, 3 kept, 3-bit indices;
  # (7, 6): 14 tiles of 1 x 3, 3 kept, 2-bit; (10,): 5 chunks of 2, 2 kept,
  # 1-bit; (): 1 of 1, 1 kept, 1-bit (at least one bit per index).
  kept = {(2, 12, 10): (90, 3), (7, 6): (42, 2), (10,): (10, 1), (): (1, 1)}
  expect = sum(32 * math.ceil(m * w / 32) + 32 * math.ceil(m * 2 / 32) + 32 * 5
               for m, w in kept.values())
  assert float(counted) == compression.representation_bits(message) == expect
  assert oc.tiled_top_k_bits(shapes, k, CHUNK) == expect
  assert int(np.sum(decoded != 0)) == sum(m for m, _ in kept.values())


def test_a_stacked_leaf_is_tiled_layer_by_layer():
  """``[L, m, n]`` picks, per layer, the tiles and values of an ``[m, n]``
  leaf: the same kept positions (the values differ only by the quantization
  table, which is per leaf)."""
  rng = np.random.default_rng(6)
  stack = rng.normal(size=(3, 12, 10)).astype(np.float32)
  k = 3
  def round_trip(shape):
    comp = oc.tiled_top_k((shape,), k, CHUNK)
    return jax.jit(lambda v: comp.decode(None, comp.encode(None, v)[0], v.shape[0]))

  got = np.asarray(round_trip(stack.shape)(stack.reshape(-1))).reshape(stack.shape)
  one = round_trip((12, 10))
  for layer in range(3):
    alone = np.asarray(one(stack[layer].reshape(-1))).reshape(12, 10)
    np.testing.assert_array_equal(got[layer] != 0, alone != 0)
  # 3 layers x 15 tiles x 3 kept values of 3-bit indices, one table.
  assert oc.tiled_top_k_bits((stack.shape,), k, CHUNK) == \
      32 * math.ceil(135 * 3 / 32) + 32 * math.ceil(135 * 2 / 32) + 32 * 5


def test_sparseloco_2d_one_combine_follows_the_tiled_oracle():
  """The default layout through the aggregator: replicas [2, 0, 1] with
  accumulators, replica 1 without data; the mean, the residuals, the
  upload bits and the bytes of one message."""
  rng = np.random.default_rng(9)
  k, beta = 3, 0.5
  agg = oc.sparseloco(3, k=k, chunk_size=CHUNK * CHUNK, beta=beta)
  updates = _tree(rng, lead=(3,))
  params = jax.tree.map(lambda u: u[0], updates)
  d = sum(math.prod(s) for s in SHAPES)
  e = rng.normal(size=(3, d)).astype(np.float32)
  state = agg.init(params)._replace(residual=jnp.asarray(e))
  ids = jnp.asarray([2, 0, 1], jnp.int32)
  w = jnp.asarray([1.0, 2.0, 0.0])
  mean, state, metrics = aggregate(agg, jax.tree.map(jnp.asarray, updates), w, ids, state)
  e = e.astype(np.float64)
  keys = sorted(updates)
  offsets = np.cumsum([0] + [updates[key][0].size for key in keys])
  sent = []
  for i, rid in enumerate([2, 0]):
    a = beta * e[rid] + _flatten({key: updates[key][i] for key in keys})
    m = np.concatenate([
        _tiled_top_k_np(a[offsets[j]:offsets[j + 1]].reshape(updates[key].shape[1:]),
                        k, CHUNK).reshape(-1) for j, key in enumerate(keys)])
    e[rid] = a - m
    sent.append(m)
  want = (sent[0] + 2 * sent[1]) / 3
  # Float32: the accumulator's 2 terms, the quantizer's sums of at most 60
  # values (3 per kept value), a 3-term weighted mean: n = 2 + 180 + 3.
  tol = 2 * 185 * 2 ** -24
  got = _flatten(jax.tree.map(np.asarray, mean))
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
  np.testing.assert_allclose(np.asarray(state.residual), e, rtol=tol,
                             atol=tol * np.abs(e).max())
  bits = oc.tiled_top_k_bits(SHAPES, k, CHUNK)
  assert float(metrics['upload_bits']) == bits
  assert agg.message_bytes(params) == math.ceil(bits / 8)


def test_sparseloco_2d_needs_a_square_chunk_and_a_known_chunk_shape():
  with pytest.raises(ValueError, match=r"^sparseloco: chunk_size=200 is not allowed "
                     r"with chunk_shape='2d'; it must be a square s\^2"):
    oc.sparseloco(3, k=4, chunk_size=200)
  oc.sparseloco(3, k=4, chunk_size=200, chunk_shape='1d')
  with pytest.raises(ValueError, match=r"^sparseloco: chunk_shape='3d' is not allowed; "
                     r"it must be '2d'"):
    oc.sparseloco(3, chunk_shape='3d')
