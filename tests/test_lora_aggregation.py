"""Federated LoRA aggregation rules against float64 NumPy oracles.

Each oracle is written from the paper's equation on the clients' unpadded
adapters (``a_k[..., :r_k]``, ``b_k[..., :r_k, :]``), independently of the
module's zero padding, stacking and reductions.

Tolerances: the values are O(1) and every compared entry is a float32 sum of
at most C * r_max * 2 = 24 products (a weighted mean of C = 4 clients of
adapters, or of products of inner dimension r_max = 3), so the float32
result differs from the float64 oracle by at most about
gamma_24 * sum|terms| ~ 1.4e-6 * 10 (Higham, Lemma 3.1); RTOL = ATOL = 1e-5
covers that with the divisions by the total weight (one more rounding each).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx
from fedjx.algorithms.aggregators import lora as la

RTOL = ATOL = 1e-5
N_IN, N_OUT, R_MAX = 6, 5, 3
SCALE = 16.0 / R_MAX
KEY = jax.random.key(7)


def _clients(seed, num_clients=4, layers=(), names=('q', 'v'), ranks=None):
  """Random clients of heterogeneous ranks, the global adapters, counts, ranks.

  Returns ``(client_pairs, global_pairs, num_examples, ranks, raw)``: the
  stacked, truncated float32 client adapters; ``raw`` holds the untruncated
  float64 arrays for the oracles.
  """
  rng = np.random.default_rng(seed)
  if ranks is None:
    ranks = rng.integers(1, R_MAX + 1, size=num_clients)
    ranks[0] = R_MAX
  raw, client_pairs, global_pairs = {}, {}, {}
  for name in names:
    a = rng.normal(size=(num_clients,) + layers + (N_IN, R_MAX)).astype(np.float32)
    b = rng.normal(size=(num_clients,) + layers + (R_MAX, N_OUT)).astype(np.float32)
    raw[name] = {'a': a.astype(np.float64), 'b': b.astype(np.float64)}
    per_client = [la.truncate({name: {'a': a[k], 'b': b[k]}}, int(ranks[k]))[name]
                  for k in range(num_clients)]
    client_pairs[name] = {p: jnp.stack([c[p] for c in per_client]) for p in ('a', 'b')}
    global_pairs[name] = {
        'a': rng.normal(size=layers + (N_IN, R_MAX)).astype(np.float32),
        'b': rng.normal(size=layers + (R_MAX, N_OUT)).astype(np.float32)}
  num_examples = rng.integers(1, 50, size=num_clients).astype(np.float32)
  return client_pairs, global_pairs, num_examples, [int(r) for r in ranks], raw


def _np_pair(raw, name, k, r):
  """Client ``k``'s unpadded float64 adapters of rank ``r``."""
  return raw[name]['a'][k][..., :r], raw[name]['b'][k][..., :r, :]


def _np_pad(x, axis):
  """Zero-pads ``x`` to ``R_MAX`` along ``axis``."""
  width = [(0, 0)] * x.ndim
  width[axis] = (0, R_MAX - x.shape[axis])
  return np.pad(x, width)


def _np_mean_product(raw, name, ranks, n):
  """``sum_k n_k s a_k b_k / sum_k n_k`` from the unpadded adapters."""
  total = 0.0
  for k, r in enumerate(ranks):
    a, b = _np_pair(raw, name, k, r)
    total = total + n[k] * SCALE * (a @ b)
  return total / np.sum(n, dtype=np.float64)


def _best_rank(p, r):
  """NumPy's best rank-``r`` approximation of ``p`` (batched)."""
  u, s, vt = np.linalg.svd(p, full_matrices=False)
  return (u[..., :, :r] * s[..., None, :r]) @ vt[..., :r, :]


# ----------------------------------------------------------------- helpers

def test_rank_mask_and_truncate_zero_the_tail():
  np.testing.assert_array_equal(la.rank_mask(4, 2), [1, 1, 0, 0])
  rng = np.random.default_rng(0)
  a = rng.normal(size=(2, N_IN, R_MAX)).astype(np.float32)
  b = rng.normal(size=(2, R_MAX, N_OUT)).astype(np.float32)
  for r in range(R_MAX + 1):
    out = la.truncate({'q': {'a': a, 'b': b}}, r)['q']
    np.testing.assert_array_equal(out['a'], _np_pad(a[..., :r], -1))
    np.testing.assert_array_equal(out['b'], _np_pad(b[..., :r, :], -2))
    np.testing.assert_allclose(la.product(out, SCALE), SCALE * a[..., :r] @ b[..., :r, :],
                               rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------- rules

@pytest.mark.parametrize('layers', [(), (2,)])
def test_fedit_averages_a_and_b_separately(layers):
  cp, gp, n, ranks, raw = _clients(1, layers=layers)
  out = la.aggregate(la.fedit(), cp, gp, n, scale=SCALE, key=KEY)
  assert out.merged == {}
  for name in gp:
    a = sum(n[k] * _np_pad(_np_pair(raw, name, k, r)[0], -1) for k, r in enumerate(ranks))
    b = sum(n[k] * _np_pad(_np_pair(raw, name, k, r)[1], -2) for k, r in enumerate(ranks))
    np.testing.assert_allclose(out.adapters[name]['a'], a / n.sum(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out.adapters[name]['b'], b / n.sum(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('layers', [(), (2,)])
def test_ffa_keeps_the_global_a_and_is_exact(layers):
  cp, gp, n, ranks, raw = _clients(2, layers=layers)
  out = la.aggregate(la.ffa(), cp, gp, n, scale=SCALE, key=KEY)
  for name in gp:
    # The clients' own a (random here) are not read: a stays the global one.
    np.testing.assert_array_equal(out.adapters[name]['a'], gp[name]['a'])
    b = sum(n[k] * _np_pad(_np_pair(raw, name, k, r)[1], -2) for k, r in enumerate(ranks))
    np.testing.assert_allclose(out.adapters[name]['b'], b / n.sum(), rtol=RTOL, atol=ATOL)
    # Exact: s a mean(b_k) = mean(s a b_k) with the shared a.
    a = gp[name]['a'].astype(np.float64)
    exact = sum(n[k] * SCALE * (a[..., :r] @ _np_pair(raw, name, k, r)[1])
                for k, r in enumerate(ranks)) / n.sum()
    np.testing.assert_allclose(la.product(out.adapters[name], SCALE), exact,
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('layers', [(), (2,)])
def test_flexlora_is_the_truncated_svd_with_nested_truncation(layers):
  cp, gp, n, ranks, raw = _clients(14, layers=layers)
  out = la.aggregate(la.flexlora(), cp, gp, n, scale=SCALE, key=KEY)
  assert out.merged == {}
  for name in gp:
    p = _np_mean_product(raw, name, ranks, n)
    sv = np.linalg.svd(p, compute_uv=False)
    # The float32 SVD has backward error ~ n u ||P||_2 (n = 6); a rank-r
    # truncation amplifies it by at most ||P||_2 / (s_r - s_{r+1}). This
    # seed's cases have relative gaps above 0.05 (asserted: a near-tie makes
    # the best approximation ill-posed), so the error is below
    # 6 * 6e-8 * 20 ~ 7e-6 of ||P||_2: atol = 1e-4 ||P||_2.
    gaps = (sv[..., :R_MAX] - sv[..., 1:R_MAX + 1]) / sv[..., :1]
    assert np.all(gaps > 0.05)
    tol = 1e-4 * sv[..., 0].max()
    for r in range(1, R_MAX + 1):
      got = la.product(la.truncate(out.adapters, r)[name], SCALE)
      np.testing.assert_allclose(got, _best_rank(p, r), rtol=0, atol=tol)


def test_flora_merges_the_exact_mean_and_reinitializes():
  cp, gp, n, ranks, raw = _clients(4, layers=(2,))
  out = la.aggregate(la.flora(), cp, gp, n, scale=SCALE, key=KEY)
  bound = np.sqrt(6.0 / N_IN)  # he_uniform: U(-sqrt(6 / fan_in), sqrt(6 / fan_in))
  for i, name in enumerate(sorted(gp)):
    np.testing.assert_allclose(out.merged[name], _np_mean_product(raw, name, ranks, n),
                               rtol=RTOL, atol=ATOL)
    a = out.adapters[name]['a']
    want = jax.nn.initializers.he_uniform(batch_axis=(0,))(
        jax.random.fold_in(KEY, i), a.shape, a.dtype)
    np.testing.assert_array_equal(a, want)
    assert a.shape == gp[name]['a'].shape and np.all(np.abs(a) <= bound)
    np.testing.assert_array_equal(out.adapters[name]['b'], 0)
  assert not np.allclose(out.adapters['q']['a'], out.adapters['v']['a'])


@pytest.mark.parametrize('layers', [(), (2,)])
def test_hetlora_sparsity_weights_per_matrix(layers):
  cp, gp, n, ranks, raw = _clients(5, layers=layers)
  out = la.aggregate(la.hetlora(), cp, gp, n, scale=SCALE, key=KEY)
  for name in gp:
    pairs = [_np_pair(raw, name, k, r) for k, r in enumerate(ranks)]
    norms = [np.sqrt(np.sum((SCALE * a @ b) ** 2, axis=(-2, -1))) for a, b in pairs]
    total = sum(norms)
    a = sum((s / total)[..., None, None] * _np_pad(a, -1) for s, (a, _) in zip(norms, pairs))
    b = sum((s / total)[..., None, None] * _np_pad(b, -2) for s, (_, b) in zip(norms, pairs))
    np.testing.assert_allclose(out.adapters[name]['a'], a, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out.adapters[name]['b'], b, rtol=RTOL, atol=ATOL)


def test_hetlora_sparsity_weights_per_client():
  cp, gp, n, ranks, raw = _clients(6, layers=(2,))
  out = la.aggregate(la.hetlora(weighting='client'), cp, gp, n, scale=SCALE, key=KEY)
  norms = np.array([
      np.sqrt(sum(np.sum((SCALE * np.matmul(*_np_pair(raw, name, k, r))) ** 2) for name in gp))
      for k, r in enumerate(ranks)])
  p = norms / norms.sum()
  for name in gp:
    a = sum(p[k] * _np_pad(_np_pair(raw, name, k, r)[0], -1) for k, r in enumerate(ranks))
    np.testing.assert_allclose(out.adapters[name]['a'], a, rtol=RTOL, atol=ATOL)


def test_hetlora_keeps_the_global_adapters_when_every_norm_is_zero():
  cp, gp, n, _, _ = _clients(7)
  cp = {name: {'a': pair['a'], 'b': jnp.zeros_like(pair['b'])} for name, pair in cp.items()}
  for weighting in ('matrix', 'client'):
    out = la.aggregate(la.hetlora(weighting=weighting), cp, gp, n, scale=SCALE, key=KEY)
    for name in gp:
      np.testing.assert_array_equal(out.adapters[name]['a'], gp[name]['a'])


def test_fedit_gap_is_large_where_the_exact_rules_are_exact():
  """Two rank-1 clients of orthogonal directions: s mean(a) mean(b) != mean(s a b)."""
  e, f = np.eye(N_IN, dtype=np.float32), np.eye(N_OUT, dtype=np.float32)
  a = np.zeros((2, N_IN, 2), np.float32)
  b = np.zeros((2, 2, N_OUT), np.float32)
  a[0, :, 0], a[1, :, 0] = e[0], e[1]
  b[0, 0], b[1, 0] = f[0], f[1]
  cp = {'q': {'a': a, 'b': b}}
  gp = {'q': {'a': np.zeros((N_IN, 2), np.float32), 'b': np.zeros((2, N_OUT), np.float32)}}
  n = np.ones(2, np.float32)
  exact = 0.5 * SCALE * (np.outer(e[0], f[0]) + np.outer(e[1], f[1]))
  norm = np.linalg.norm(exact)

  def gap(rule, cp, gp):
    out = la.aggregate(rule, cp, gp, n, scale=SCALE, key=KEY)
    return np.linalg.norm(np.asarray(la.effective_delta(out, SCALE)['q']) - exact) / norm

  # FedIT: s (e0 + e1)/2 (f0 + f1)/2, relative error ||(-1, 1; 1, -1)/4|| / ||I/2|| = 1/sqrt(2).
  np.testing.assert_allclose(gap(la.fedit(), cp, gp), 1 / np.sqrt(2), rtol=1e-6)
  for rule in (la.flexlora(), la.flora()):
    assert gap(rule, cp, gp) < 1e-6
  # FFA's premise: one shared a (the global), the clients' b in its directions.
  shared = np.stack([e[0], e[1]], axis=1)
  ffa_b = np.zeros((2, 2, N_OUT), np.float32)
  ffa_b[0, 0], ffa_b[1, 1] = f[0], f[1]
  ffa_cp = {'q': {'a': np.stack([shared, shared]), 'b': ffa_b}}
  assert gap(la.ffa(), ffa_cp, {'q': {'a': shared, 'b': gp['q']['b']}}) < 1e-6


# ------------------------------------------------------------ self-pruning

def _np_tail(a, b, r, gamma):
  t = int(np.floor(gamma * r))
  return np.linalg.norm(a[:, t:r]) * np.linalg.norm(b[t:r, :])


def test_self_prune_prunes_when_the_tail_shrank():
  rng = np.random.default_rng(8)
  received = {'a': rng.normal(size=(N_IN, R_MAX)), 'b': rng.normal(size=(R_MAX, N_OUT))}
  gamma = 0.5
  for r in (2, 3):
    ref = la.tail_norm(jax.tree.map(jnp.float32, received), r, decay=gamma)
    np.testing.assert_allclose(ref, _np_tail(received['a'], received['b'], r, gamma),
                               rtol=RTOL)
    for factor, pruned in ((0.5, True), (2.0, False)):
      trained = {k: v.copy() for k, v in received.items()}
      t = int(np.floor(gamma * r))
      trained['a'][:, t:r] *= factor
      trained = jax.tree.map(jnp.float32, trained)
      got = la.self_prune(trained, r, decay=gamma, threshold=ref)
      assert int(got) == (max(1, t) if pruned else r)
  # Several matrices: the scores add up; rank 1 is never pruned below 1.
  pairs = {'q': jax.tree.map(jnp.float32, received), 'v': jax.tree.map(jnp.float32, received)}
  np.testing.assert_allclose(
      la.tail_norm(pairs, 3, decay=0.7),
      2 * _np_tail(received['a'], received['b'], 3, 0.7), rtol=RTOL)
  assert int(la.self_prune(pairs, 1, decay=0.5, threshold=1e9)) == 1
  jitted = jax.jit(functools.partial(la.self_prune, decay=gamma))
  assert int(jitted(pairs, jnp.int32(3), threshold=1e9)) == 1


# ---------------------------------------------------------- bad arguments

def test_bad_inputs_name_the_argument():
  cp, gp, n, _, _ = _clients(9)
  with pytest.raises(ValueError, match='num_examples'):
    la.aggregate(la.fedit(), cp, gp, np.array([1.0, -2.0, 3.0, 4.0]), scale=SCALE, key=KEY)
  with pytest.raises(ValueError, match='num_examples'):
    la.aggregate(la.fedit(), cp, gp, n[:3], scale=SCALE, key=KEY)
  bad = {'q': {'a': cp['q']['a'], 'b': cp['q']['b'][:, :2]}, 'v': cp['v']}
  with pytest.raises(ValueError, match='client_pairs'):
    la.aggregate(la.fedit(), bad, gp, n, scale=SCALE, key=KEY)
  with pytest.raises(ValueError, match='client_pairs'):
    la.aggregate(la.fedit(), {'q': cp['q']}, gp, n, scale=SCALE, key=KEY)
  with pytest.raises(ValueError, match='rank=4'):
    la.truncate(gp, R_MAX + 1)
  with pytest.raises(ValueError, match='scale'):
    la.aggregate(la.fedit(), cp, gp, n, scale=-1.0, key=KEY)
  with pytest.raises(ValueError, match='decay'):
    la.self_prune(gp, 2, decay=2, threshold=0.0)
  with pytest.raises(ValueError, match='weighting'):
    la.hetlora(weighting='examples')


# -------------------------------------------- jit and the fedjx primitives

@pytest.mark.parametrize('build', [la.fedit, la.ffa, la.flexlora, la.flora, la.hetlora,
                                   functools.partial(la.hetlora, weighting='client')])
def test_rules_run_under_jit_and_in_a_fedjx_program(build):
  cp, gp, n, _, _ = _clients(10, layers=(2,))
  rule = build()
  want = la.aggregate(rule, cp, gp, n, scale=SCALE, key=KEY)
  jitted = jax.jit(functools.partial(la.aggregate, rule, scale=SCALE))(cp, gp, n, key=KEY)
  program = fedjx.program(functools.partial(la.federated_round, rule, scale=SCALE),
                          clients=len(n))
  for got in (jitted, jax.jit(program)(cp, gp, n, key=KEY)):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL),
                 got, want)
