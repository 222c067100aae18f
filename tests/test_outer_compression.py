"""SparseLoCo and MuLoCo-style quantized DiLoCo against NumPy oracles; bits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import compression
from fedjx.algorithms import outer_compression as oc
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
                                               beta=beta),
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
  agg = oc.sparseloco(4, k=k, chunk_size=chunk, beta=beta)
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
