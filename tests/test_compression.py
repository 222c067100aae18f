"""The compressors of fedjx.algorithms.compression against their papers.

Unbiasedness and variance are checked empirically over K independent keys:
each coordinate's sample mean lies within Z standard errors of the input
(``|mean_j - x_j| <= Z s_j / sqrt(K)``, ``s_j`` the sample standard
deviation), and the sample mean squared error within Z standard errors of
its exact value (where the paper gives it in closed form) or below the
paper's bound. With Z = 6 a correct compressor fails one of the 64
coordinates of a test with probability below 64 * 2e-9 (normal tails; K =
4000 makes the sample means normal to well within that).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.compression import compressors as C
from fedjx.algorithms import nonfinite
from fedjx.experiments import parts
import float_tolerance as ft
from test_algorithms_util import (KEY, linreg_data, linreg_loss, linreg_params,
                                  make_cohort)

K, Z, D = 4000, 6.0, 64


def vector(seed=0, d=D):
  return np.random.default_rng(seed).normal(size=d).astype(np.float32)


def samples(comp, x, n=None):
  """``[K, d]`` decoded vectors, one per key (float64)."""
  x = jnp.asarray(x)
  n = x.shape[0] if n is None else n

  @jax.jit
  def one(key):
    return comp.decode(key, comp.encode(key, x)[0], n)

  keys = jax.random.split(jax.random.PRNGKey(5), K)
  return np.asarray(jax.lax.map(one, keys), np.float64)


def assert_unbiased(y, x, var=None):
  """Each coordinate's mean within Z standard errors of ``x``: the exact
  per-coordinate variance ``var`` where the paper gives it (a rare rounding
  makes the sample deviation unreliable), else the sample one."""
  mean = y.mean(0)
  sd = np.sqrt(var) if var is not None else y.std(0, ddof=1)
  se = sd / math.sqrt(y.shape[0])
  # + float32 rounding of the decode: at most a 64-term sum per coordinate.
  slack = ft.gamma(2 * D) * np.abs(y).max()
  bad = np.abs(mean - x) > Z * se + slack
  assert not bad.any(), (mean[bad], np.asarray(x)[bad], se[bad])


def mse_interval(y, x):
  err = np.sum((y - np.asarray(x, np.float64)) ** 2, axis=1)
  return err.mean(), Z * err.std(ddof=1) / math.sqrt(err.size)


# ------------------------------------------------------------------ bits

@pytest.mark.parametrize('width', [1, 2, 3, 5, 8, 13, 16, 32])
def test_pack_unpack_round_trip_and_word_count(width):
  rng = np.random.default_rng(width)
  n = 101
  v = rng.integers(0, 2 ** width, size=n, dtype=np.uint64).astype(np.uint32)
  words = C.pack_bits(jnp.asarray(v), width)
  assert words.dtype == jnp.uint32 and words.shape == (math.ceil(n * width / 32),)
  np.testing.assert_array_equal(np.asarray(C.unpack_bits(words, width, n)), v)


def test_elias_omega_lengths_match_the_code_itself():
  def code(n):  # Elias 1975: prepend binary groups, end with 0.
    out = '0'
    while n > 1:
      b = bin(n)[2:]
      out = b + out
      n = len(b) - 1
    return out
  n = np.arange(1, 3000)
  got = np.asarray(C.elias_omega_length(jnp.asarray(n, jnp.uint32)))
  np.testing.assert_array_equal(got, [len(code(int(i))) for i in n])


def test_uniform_bits_are_those_of_the_packed_message():
  comp = C.uniform_levels(2)
  message, bits = jax.jit(comp.encode)(KEY, jnp.asarray(vector(d=100)))
  # 100 codes of 2 bits -> 7 words of 32, plus min and max in float32.
  assert message['levels'].shape == (7,) and message['range'].dtype == jnp.float32
  assert float(bits) == 7 * 32 + 2 * 32 == C.representation_bits(message)


def test_qsgd_elias_bits_count_gaps_signs_and_levels():
  s, x = 4, jnp.asarray(vector(3, d=200))
  message, bits = jax.jit(C.qsgd_levels(s, 'elias').encode)(KEY, x)
  level = np.asarray(C.unpack_bits(message['levels'], 3, 200), np.int64)
  nz = np.flatnonzero(level)
  gaps = np.diff(np.concatenate([[-1], nz]))
  omega = lambda v: np.asarray(C.elias_omega_length(jnp.asarray(v, jnp.uint32)))
  expect = 32 + omega(gaps).sum() + nz.size + omega(level[nz]).sum()
  assert float(bits) == expect
  fixed = jax.jit(C.qsgd_levels(s, 'fixed').encode)(KEY, x)[1]
  assert float(fixed) == 32 + 32 * math.ceil(200 / 32) + 32 * math.ceil(600 / 32)


def test_sparse_index_dtype_and_random_k_sends_values_only():
  x = jnp.asarray(vector(d=300))
  top = jax.jit(C.sparse(10, 'top', False).encode)(KEY, x)
  assert top[0]['indices'].dtype == jnp.uint16 and float(top[1]) == 10 * (32 + 16)
  rand = jax.jit(C.sparse(10, 'random', False).encode)(KEY, x)
  assert set(rand[0]) == {'values'} and float(rand[1]) == 10 * 32


# -------------------------------------------------------------- rotation

@pytest.mark.parametrize('n', [16, 512])  # one factor; 2^7 (x) 2^2
def test_walsh_hadamard_is_sylvesters_matrix_and_rotation_inverts(n):
  h = np.array([[1.0]])
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  x = vector(1, d=n)
  np.testing.assert_allclose(np.asarray(C.walsh_hadamard(jnp.asarray(x))),
                             h @ x.astype(np.float64),
                             atol=ft.atol(n, np.abs(x).sum()))
  x = jnp.asarray(vector(2, d=13))  # padded to 16
  y = jax.jit(C.rotate)(KEY, x)
  assert y.shape == (16,)
  # Orthogonal: norms agree to float32 rounding of log2(16) = 4 stages.
  np.testing.assert_allclose(float(jnp.linalg.norm(y)), float(jnp.linalg.norm(x)),
                             rtol=ft.rtol(8 * 16))
  np.testing.assert_allclose(np.asarray(jax.jit(C.unrotate, static_argnums=2)(KEY, y, 13)),
                             np.asarray(x),
                             atol=ft.atol(8 * 16, float(jnp.abs(x).sum())))


# -------------------------------------------------- unbiasedness, variance

@pytest.mark.parametrize('bits', [1, 2, 4])
def test_stochastic_uniform_is_unbiased_with_the_exact_variance(bits):
  x = vector(4)
  y = samples(C.uniform_levels(bits), x)
  k = 2 ** bits
  lo, hi = x.min(), x.max()
  step = (np.float64(hi) - lo) / (k - 1)
  t = (x - np.float64(lo)) / step
  below = lo + np.floor(t) * step
  var = (below + step - x) * (x - below)  # (B_{r+1} - x)(x - B_r)
  assert_unbiased(y, x, var)
  exact = np.sum(var)
  mean, half = mse_interval(y, x)
  assert abs(mean - exact) <= half + 1e-6 * exact
  assert exact <= D * (hi - lo) ** 2 / (4 * (k - 1) ** 2)  # Suresh et al. Lemma


def test_rotated_uniform_is_unbiased_and_within_suresh_theorem_3():
  bits, x = 1, vector(6)
  comp = C.uniform_levels(bits)

  def rotated():  # R shared; a fresh R for every key, as rounds draw them.
    def encode(key, v):
      return comp.encode(key, C.rotate(jax.random.fold_in(key, 9), v))
    def decode(key, m, n):
      return C.unrotate(jax.random.fold_in(key, 9), comp.decode(key, m, D), n)
    return C.Compressor(encode, decode)

  y = samples(rotated(), x)
  assert_unbiased(y, x)
  mean, half = mse_interval(y, x)
  k = 2 ** bits
  bound = (2 * math.log(D) + 2) * float(np.sum(x.astype(np.float64) ** 2)) / (k - 1) ** 2
  assert mean - half <= bound


@pytest.mark.parametrize('levels', [1, 4])
def test_qsgd_is_unbiased_with_the_exact_variance_below_lemma_3_1(levels):
  x = vector(7)
  y = samples(C.qsgd_levels(levels, 'elias'), x)
  norm = np.linalg.norm(x.astype(np.float64))
  r = np.abs(x) * levels / norm
  p = r - np.floor(r)
  var = (norm / levels) ** 2 * p * (1 - p)
  assert_unbiased(y, x, var)
  exact = np.sum(var)
  mean, half = mse_interval(y, x)
  assert abs(mean - exact) <= half + 1e-6 * exact
  assert exact <= min(D / levels ** 2, math.sqrt(D) / levels) * norm ** 2


def test_terngrad_is_unbiased_with_the_exact_variance():
  x = vector(8)
  y = samples(C.ternary(), x)
  s = np.abs(x).max().astype(np.float64)
  var = s * np.abs(x) - x.astype(np.float64) ** 2
  assert_unbiased(y, x, var)
  exact = np.sum(var)
  mean, half = mse_interval(y, x)
  assert abs(mean - exact) <= half + 1e-6 * exact


def test_random_k_rescaled_is_unbiased():
  x = vector(9)
  y = samples(C.sparse(16, 'random', True), x)
  assert_unbiased(y, x, x.astype(np.float64) ** 2 * (D / 16 - 1))
  # Each coordinate is kept with probability k / d: E||Y - x||^2 = (d/k - 1)||x||^2.
  exact = (D / 16 - 1) * np.sum(x.astype(np.float64) ** 2)
  mean, half = mse_interval(y, x)
  assert abs(mean - exact) <= half + 1e-5 * exact


def test_lloyd_max_centroids_of_the_normal():
  c1, _ = C.lloyd_max_normal(1)
  np.testing.assert_allclose(c1, [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)],
                             rtol=1e-12)
  c2, _ = C.lloyd_max_normal(2)  # Max (1960), Table I, four levels.
  np.testing.assert_allclose(c2, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)


@pytest.mark.parametrize('bits', [1, 2])
def test_eden_preserves_the_inner_product_and_drive_its_error(bits):
  x = jnp.asarray(vector(10, d=128))  # a power of two: no padding
  comp = C.eden_codes(bits)
  key = jax.random.PRNGKey(3)
  x_hat = jax.jit(lambda k, v: comp.decode(k, comp.encode(k, v)[0], 128))(key, x)
  sq = float(jnp.sum(jnp.square(x)))
  # <x_hat, x> = S <q, z> = ||x||^2; float32 sums over D_pad = 128 terms.
  np.testing.assert_allclose(float(jnp.vdot(x_hat, x)), sq, rtol=ft.rtol(40 * 128))
  if bits == 1:  # DRIVE: ||x_hat - x||^2 / ||x||^2 = D_pad ||x||^2 / ||R x||_1^2 - 1
    z = jax.jit(C.rotate)(jax.random.fold_in(key, 0), x)
    nmse = float(jnp.sum(jnp.square(x_hat - x))) / sq
    expect = 128 * sq / float(jnp.sum(jnp.abs(z))) ** 2 - 1
    np.testing.assert_allclose(nmse, expect, rtol=ft.rtol(40 * 128) / expect)


# ------------------------------------------------------------- exactness

def roundtrip(comp, x, key):
  x = jnp.asarray(x)
  return jax.jit(lambda k, v: comp.decode(k, comp.encode(k, v)[0], x.shape[0]))(key, x)


def test_decode_of_encode_is_exact_where_nothing_is_rounded():
  key = jax.random.PRNGKey(11)
  grid = jnp.asarray(np.random.default_rng(0).integers(0, 4, D), jnp.float32)
  grid = grid.at[0].set(0.0).at[1].set(3.0)  # min 0, max 3: the 2-bit levels
  uniform = C.uniform_levels(2)
  np.testing.assert_array_equal(roundtrip(uniform, grid, key), grid)
  x = jnp.asarray(vector(12))
  top = C.sparse(D, 'top', False)
  np.testing.assert_array_equal(roundtrip(top, x, key), x)
  ident = C.identity()
  np.testing.assert_array_equal(roundtrip(ident, x, key), x)
  pm = jnp.where(x < 0, -0.5, 0.5)  # |x_j| = max: TernGrad keeps every one
  tern = C.ternary()
  np.testing.assert_array_equal(roundtrip(tern, pm, key), pm)
  q = jnp.asarray([3.0, -4.0])  # |x_j| s / ||x|| = (3, 4) with s = 5
  qs = C.qsgd_levels(5, 'fixed')
  np.testing.assert_allclose(roundtrip(qs, q, key), q,
                             rtol=ft.rtol(4))


# ------------------------------------------------------------ aggregators

def aggregate(agg, updates, weights, ids=None, state=None, key=KEY):
  """One combine of ``agg`` over placed ``updates`` ([C, ...] pytree)."""
  c = weights.shape[0]
  params = jax.tree.map(lambda u: u[0], updates)
  state = agg.init(params) if state is None else state
  hparams = aggregators.init_hparams(agg)
  ids = jnp.arange(c, dtype=jnp.int32) if ids is None else ids

  @fedjx.program(clients=c)
  def run(state, updates, weights):
    clients = aggregators.map_clients(
        agg, hparams, lambda u: nonfinite.ClientOutput(u, {}), (updates,),
        weights, 'num_examples', False, aggregator_state=state, client_ids=ids)
    return aggregators.aggregate(agg, state, hparams, clients, key)

  return run(state, updates, weights)


def test_round_key_is_shared_by_clients_and_server():
  """16-bit rotated quantization decodes to the weighted mean: the server's
  rotation is the clients' (another rotation would scramble every
  coordinate). The error is at most half... one level per rotated
  coordinate: ||err|| <= sqrt(D_pad) max_i (range_i) / (2^16 - 1)."""
  rng = np.random.default_rng(13)
  u = {'w': jnp.asarray(rng.normal(size=(5, 6, 2)), jnp.float32),
       'b': jnp.asarray(rng.normal(size=(5,)), jnp.float32)}
  w = jnp.asarray([1.0, 2.0, 0.0, 3.0, 1.0])
  agg = C.stochastic_quantization(bits=16, rotation=True)
  mean, state, metrics = aggregate(agg, u, w)
  expect = jax.tree.map(lambda a: np.tensordot(np.asarray(w, np.float64),
                                               np.asarray(a, np.float64), 1) / 7.0, u)
  err = math.sqrt(sum(float(np.sum((np.asarray(m) - e) ** 2))
                      for m, e in zip(jax.tree.leaves(mean), jax.tree.leaves(expect))))
  flat = np.concatenate([np.asarray(u['b'])[:, None],
                         np.asarray(u['w']).reshape(5, -1)], 1)
  ranges = 2 * np.linalg.norm(flat, axis=1)  # |rotated coordinates| <= ||x||
  assert err <= math.sqrt(16) * ranges.max() / (2 ** 16 - 1)
  assert float(metrics['upload_bits']) == 16 * 16 + 64  # 16 padded coords, min/max
  assert float(metrics['download_bits']) == 13 * 32 + 64
  assert not np.array_equal(np.asarray(state.key), np.asarray(agg.init(u).key))


def test_top_k_error_feedback_keeps_each_clients_residual():
  rng = np.random.default_rng(14)
  n_pop, k = 6, 2
  agg = C.top_k(k=k, num_clients=n_pop)
  ids = jnp.asarray([4, 1, 2], jnp.int32)
  w = jnp.asarray([1.0, 1.0, 0.0])  # client 2 has no data: keeps its residual
  state = None
  residual = np.zeros((n_pop, 5))
  for r in range(2):
    u = rng.normal(size=(3, 5)).astype(np.float32)
    mean, state, _ = aggregate(agg, jnp.asarray(u), w, ids, state)
    a = u + residual[np.asarray(ids)]
    sent = np.zeros_like(a)
    for i in range(3):
      top = np.argsort(-np.abs(a[i]))[:k]
      sent[i, top] = a[i, top]
    np.testing.assert_allclose(np.asarray(mean), sent[:2].mean(0), rtol=ft.rtol(4))
    for i, cid in enumerate(np.asarray(ids)):
      if w[i] > 0:
        residual[cid] = a[i] - sent[i]
    np.testing.assert_allclose(np.asarray(state.residual), residual,
                               atol=ft.atol(4, np.abs(a).max()))


def test_sign_majority_is_the_vote():
  u = jnp.asarray([[1.0, -2.0, 3.0], [-1.0, -1.0, 2.0], [2.0, 1.0, -1.0],
                   [-5.0, 5.0, -5.0]])
  w = jnp.asarray([1.0, 3.0, 1.0, 0.0])  # unweighted vote; client 3 has no data
  mean, _, metrics = aggregate(C.sign_majority(step_size=0.5), u, w)
  np.testing.assert_array_equal(np.asarray(mean),
                                0.5 * np.sign(np.sign(np.asarray(u[:3])).sum(0)))
  assert float(metrics['upload_bits']) == 32  # 3 sign bits in one word


def test_rescaled_random_k_converges_to_the_least_squares_solution():
  """FedAvg (one full-batch step per client, server SGD 1) through rescaled
  random-k (k = 1 of d = 4: unbiased, ``E||C(x) - x||^2 = 3 ||x||^2``) on a
  consistent least-squares problem reaches the closed-form solution.

  The default is no error feedback for an unbiased compressor (with it the
  residual grows threefold a round and the run diverges). The bound: with
  ``Delta_i = eta H_i e`` (``e = x - x*``, ``H_i`` client ``i``'s Hessian),
  ``e <- A e``, ``A = I - eta sum_i p_i S_i H_i``, ``S_i`` the rescaled
  coordinate sample (``E S_i = I``, ``E S_i^T S_i = (d / k) I``), so
  ``E||A e||^2 <= rho^2 ||e||^2`` with ``rho^2 = lambda_max((I - eta
  H)^2 + eta^2 (d / k - 1) sum_i p_i^2 H_i^2)``. Each round's float32
  rounding adds at most ``eps`` (the update ``x - y_i`` and the server step
  to ``u ||x||`` each, the update amplified by ``d / k``; the gradient's
  rounding and its value at ``x*`` from the float32 data, times ``eta d /
  k``), so ``sqrt(E||e_R||^2) <= rho^R ||e_0|| + eps / (1 - rho) = B``
  (Minkowski), and ``||e_R|| <= 100 B`` but with probability ``1e-4``
  (Chebyshev)."""
  c, n, dim, eta, rounds, k = 4, 8, 3, 0.15, 300, 1
  u = 2.0 ** -24
  rng = np.random.default_rng(7)
  w_true = np.array([1.0, -2.0, 0.5], np.float32)
  data = []
  for i in range(c):
    x = (rng.normal(size=(n, dim)) + 0.5 * i).astype(np.float32)
    data.append({'x': x, 'y': (x @ w_true + np.float32(0.3)).astype(np.float32)})
  # The closed form of the pooled problem (float64, on the float32 data);
  # parameters in ravel order: b, then w.
  design = [np.c_[np.ones(n), c_['x'].astype(np.float64)] for c_ in data]
  targets = [c_['y'].astype(np.float64) for c_ in data]
  solution = np.linalg.lstsq(np.concatenate(design), np.concatenate(targets),
                             rcond=None)[0]
  hessians = [a.T @ a / n for a in design]
  d, p = dim + 1, 1.0 / c
  mean_h = sum(hessians) * p
  a = np.eye(d) - eta * mean_h
  rho = math.sqrt(np.linalg.eigvalsh(
      a @ a + eta ** 2 * (d / k - 1) * p ** 2 * sum(h @ h for h in hessians)).max())
  assert rho < 0.95
  x_norm = np.linalg.norm(solution)
  grad_at_solution = max(np.linalg.norm(a_.T @ (a_ @ solution - t) / n)
                         for a_, t in zip(design, targets))
  # A residual x~ . theta - y in float32: 5 terms of magnitude |x~||theta| + |y|.
  grad_rounding = max(np.linalg.norm(
      np.abs(a_).T @ (ft.gamma(d + 1) * (np.abs(a_) @ np.abs(solution) + np.abs(t)))
      / n) for a_, t in zip(design, targets))
  eps = (d / k) * (2 * u * x_norm + eta * (grad_rounding + grad_at_solution)) \
      + u * x_norm
  x0 = linreg_params(dim)
  e0 = np.linalg.norm(np.concatenate([[float(x0['b'])], np.asarray(x0['w'])])
                      - solution)
  bound = rho ** rounds * e0 + eps / (1 - rho)

  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(eta),
                      aggregator=C.random_k(k=k, rescale=True, num_clients=c))
  cohort = make_cohort(data, batch_size=n)
  cohorts = jax.tree.map(lambda v: jnp.stack([v] * rounds), cohort)
  keys = jax.random.split(KEY, rounds)
  state, _ = algo.run_rounds(algo.init(x0), cohorts, keys)
  got = np.concatenate([[float(state.params['b'])],
                        np.asarray(state.params['w'], np.float64)])
  assert np.linalg.norm(got - solution) <= 100 * bound, (got, solution, bound)


def test_error_feedback_follows_the_compressors_bias():
  """Biased sparsifiers keep error feedback by default; the unbiased
  rescaled random-k has none and refuses it in one line."""
  assert C.random_k(k=1, rescale=True).init({'w': jnp.zeros(4)}).residual == ()
  assert C.random_k(k=1, num_clients=3).init({'w': jnp.zeros(4)}).residual.shape == (3, 4)
  assert C.top_k(k=1, num_clients=3).init({'w': jnp.zeros(4)}).residual.shape == (3, 4)
  with pytest.raises(ValueError) as e:
    C.random_k(k=1, rescale=True, error_feedback=True, num_clients=3)
  assert '\n' not in str(e.value)
  assert str(e.value).startswith(
      'random_k: error_feedback=True with rescale=True is refused')
  with pytest.raises(ValueError, match='error_feedback=True is refused for an unbiased'):
    C.compressed_mean(C.uniform_levels(2), fn='sq', error_feedback=True,
                      num_clients=3)


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match='bits=3'):
    C.stochastic_quantization(bits=3)
  with pytest.raises(ValueError, match='num_clients=None'):
    C.top_k(k=2)
  with pytest.raises(ValueError, match='exactly one of fraction'):
    C.random_k(error_feedback=False)
  with pytest.raises(ValueError, match="coding='huffman'"):
    C.qsgd(coding='huffman')
  with pytest.raises(ValueError, match='k=9 exceeds'):
    aggregate(C.top_k(k=9, error_feedback=False), jnp.ones((2, 4)), jnp.ones(2))


# ------------------------------------------------------------ composition

def built(spec):
  """The aggregator a config spec names (None: the algorithm's default)."""
  return None if spec is None else parts.build_aggregator(spec)


BUILDERS = {
    'fedavg': lambda agg: algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1),
                                       aggregator=built(agg)),
    'fedprox': lambda agg: algos.fedprox(linreg_loss, mu=0.1,
                                         client_optimizer=optax.sgd(0.1),
                                         aggregator=built(agg)),
    'scaffold': lambda agg: algos.scaffold(linreg_loss, num_clients=3,
                                           client_learning_rate=0.1, aggregator=built(agg)),
    'diloco': lambda agg: algos.diloco(linreg_loss, num_replicas=3,
                                       inner_optimizer=optax.sgd(0.1),
                                       aggregator=built(agg)),
}


@pytest.mark.parametrize('name', [
    'fedavg', *[pytest.param(n, marks=pytest.mark.slow) for n in sorted(BUILDERS)
                if n != 'fedavg']])
def test_lossless_compressors_give_the_uncompressed_round(name):
  """top-k with k = d (error feedback on) and the float32 baseline decode
  exactly: two rounds equal the default weighted mean's to float32 rounding
  of sums over the 3 clients (and the model's 4 coordinates)."""
  data = linreg_data(np.random.default_rng(80), [6, 4, 5], dim=3, shift=4.0)
  cohort = make_cohort(data, batch_size=3)
  finals = []
  for agg in (None, dict(name='top_k', k=4, num_clients=3),
              dict(name='uncompressed')):
    algo = BUILDERS[name](agg)
    state = algo.init(linreg_params(3))
    for r in range(2):
      state, metrics = algo.round(state, cohort, jax.random.fold_in(KEY, r))
    finals.append(state.params)
    if agg is not None:
      # top-k: 4 float32 values and 4 uint8 indices; the baseline 4 float32.
      assert float(metrics['upload_bits']) == (4 * (32 + 8) if agg['name'] == 'top_k'
                                               else 4 * 32)
  for other in finals[1:]:
    for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(other)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                 rtol=ft.rtol(64), atol=ft.atol(64, 10.0))


@pytest.mark.slow
@pytest.mark.parametrize('spec', [
    dict(name='qsgd', levels=4),
    pytest.param(dict(name='stochastic_quantization', bits=2, rotation=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(name='top_k', k=2, num_clients=3), marks=pytest.mark.slow),
    pytest.param(dict(name='secure_sum', threshold=1, bits=20),
                 marks=pytest.mark.slow)], ids=lambda s: s['name'])
def test_every_map_strategy_gives_the_same_compressed_round(spec):
  """The client keys follow the cohort position, not the strategy: chunked
  and sequential maps give vmap's round (float32 rounding of the local
  steps may differ; the decoded values then move by that, far below one
  quantization level, so the levels chosen agree)."""
  data = linreg_data(np.random.default_rng(81), [6, 4, 5], dim=3, shift=4.0)
  cohort = make_cohort(data, batch_size=3)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1),
                      aggregator=built(spec))
  out = {}
  for strategy, chunk in (('vmap', None), ('chunked', 2), ('sequential', None)):
    run = algo.compile(map_strategy=strategy, chunk_size=chunk, donate=False)
    state = algo.init(linreg_params(3))
    for r in range(2):
      state, metrics = run.round(state, cohort, jax.random.fold_in(KEY, r))
    out[strategy] = (state.params, float(metrics['upload_bits']))
  for strategy in ('chunked', 'sequential'):
    assert out[strategy][1] == out['vmap'][1]
    for a, b in zip(jax.tree.leaves(out['vmap'][0]), jax.tree.leaves(out[strategy][0])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                 rtol=ft.rtol(256), atol=ft.atol(256, 10.0))


# Every aggregator that counts its messages' bits in the wire format
# (Aggregator.traits.wire_bits), with the options it needs for three clients.
WIRE_SPECS = {
    'uncompressed': {}, 'stochastic_quantization': dict(bits=2, rotation=True),
    'eden': dict(bits=2), 'drive': {}, 'qsgd': dict(coding='elias'),
    'terngrad': {}, 'sign_majority': {},
    'top_k': dict(k=2, num_clients=3), 'random_k': dict(k=2, num_clients=3),
    'secure_sum': dict(bits=20), 'distributed_skellam': dict(bits=16,
                                                             clients_per_round=3),
    'sparseloco': dict(num_replicas=3, k=2, chunk_size=4),
    'muloco_quantized': dict(num_replicas=3), 'demo': dict(num_replicas=3, chunk_size=4, k=2),
}
def test_every_wire_bits_aggregator_is_listed():
  wire = []
  for name in parts.AGGREGATORS:
    try:
      agg = parts.build_aggregator(dict(WIRE_SPECS.get(name, {}), name=name))
    except ValueError:  # Options it needs (top_k's k, dp_defense's defense).
      assert name not in WIRE_SPECS
      continue
    if agg.traits.wire_bits:
      wire.append(name)
  assert sorted(wire) == sorted(WIRE_SPECS)


@pytest.mark.parametrize('name', sorted(WIRE_SPECS))
def test_communicated_bytes_are_the_upload_bits_of_the_round(name):
  """DiLoCo's ``communicated_bytes`` (bytes of the round, all replicas with
  data) is ``clients * upload_bits / 8``: ``upload_bits`` is each client's
  count of its own message, averaged over the clients with data."""
  data = linreg_data(np.random.default_rng(40), [8, 4, 6], shift=2.0)
  algo = algos.diloco(linreg_loss, 3, inner_optimizer=optax.sgd(0.05),
                      inner_steps=2,
                      aggregator=built(dict(WIRE_SPECS[name], name=name)))
  state, metrics = algo.round(algo.init(linreg_params()),
                              make_cohort(data, batch_size=4), KEY)
  bits, clients = float(metrics['upload_bits']), float(metrics['clients'])
  assert clients == 3 and bits > 0
  # upload_bits is a float32 mean (a sum of integers, one division); times
  # the clients and over 8: two more roundings.
  assert float(metrics['communicated_bytes']) == pytest.approx(
      clients * bits / 8, rel=ft.rtol(3))
