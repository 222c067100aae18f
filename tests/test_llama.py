"""The Llama-family decoder against independent references.

One layer's forward pass against a NumPy float64 reference written from the
equations (RoPE as a rotation matrix per position, grouped-query attention by
repeating the key/value heads, an explicit causal softmax, SwiGLU, RMSNorm);
parameter counts of every preset (``jax.eval_shape``, nothing allocated)
against the analytic formula; causality; scanned against unscanned layers
(and a scanned program the same size at any depth); every remat
policy against none; bfloat16 compute over float32 parameters; the preset
table of the docs against the code.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjx.models import llama
from fedjx.models import llama_config as lc

import float_tolerance as ft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = lc.LlamaConfig(vocab_size=50, width=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, mlp_width=48, seq_len=16)


def _random_params(config, seed=0, length=8):
  """Parameters of the model's shapes, drawn with NumPy (norm scales not 1)."""
  rng = np.random.default_rng(seed)
  shapes = llama.param_shapes(config, length=length)

  def draw(path, s):
    name = jax.tree_util.keystr(path)
    if 'scale' in name:
      return (1.0 + 0.3 * rng.standard_normal(s.shape)).astype(s.dtype)
    return (0.2 * rng.standard_normal(s.shape)).astype(s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


# ------------------------------------------------------------ the reference

def _np_rms_norm(x, g, eps):
  return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _np_rotation(p, h, theta):
  """The ``h x h`` matrix turning each pair ``(i, i + h/2)`` by ``p theta^(-2i/h)``."""
  r = np.zeros((h, h))
  for i in range(h // 2):
    a = p * theta ** (-2.0 * i / h)
    j = i + h // 2
    r[i, i], r[i, j] = np.cos(a), -np.sin(a)
    r[j, i], r[j, j] = np.sin(a), np.cos(a)
  return r


def _np_layer(p, x, c):
  """One decoder layer on ``x [B, T, d]`` in float64, from the equations."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, nh, nk = c.head_width, c.num_heads, c.num_kv_heads
  attn = p['self_attn']
  u = _np_rms_norm(x, p['input_layernorm']['scale'], c.norm_eps)
  q = (u @ attn['q_proj']['kernel']).reshape(b, t, nh, h)
  k = (u @ attn['k_proj']['kernel']).reshape(b, t, nk, h)
  v = (u @ attn['v_proj']['kernel']).reshape(b, t, nk, h)
  rot = np.stack([_np_rotation(s, h, c.rope_theta) for s in range(t)])  # [T, h, h]
  q = np.einsum('tij,btnj->btni', rot, q)
  k = np.einsum('tij,btnj->btni', rot, k)
  # Grouped-query attention: query head j reads key/value head j // (H / K).
  k = np.repeat(k, nh // nk, axis=2)
  v = np.repeat(v, nh // nk, axis=2)
  scores = np.einsum('bsnh,btnh->bnst', q, k) / np.sqrt(h)
  causal = np.tril(np.ones((t, t), bool))
  scores = np.where(causal, scores, -np.inf)
  w = np.exp(scores - scores.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  o = np.einsum('bnst,btnh->bsnh', w, v).reshape(b, t, nh * h)
  a = x + o @ attn['o_proj']['kernel']
  m = p['mlp']
  z = _np_rms_norm(a, p['post_attention_layernorm']['scale'], c.norm_eps)
  gate = z @ m['gate_proj']['kernel']
  hidden = gate / (1.0 + np.exp(-gate)) * (z @ m['up_proj']['kernel'])
  out = a + hidden @ m['down_proj']['kernel']
  # The magnitudes the last sums add up: |x| + |o| |W_o| + |hidden| |W_down|.
  magnitude = (np.abs(x) + np.abs(o) @ np.abs(attn['o_proj']['kernel']) +
               np.abs(hidden) @ np.abs(m['down_proj']['kernel']))
  return out, magnitude


def test_one_layer_equals_the_reference_written_from_the_equations():
  c = SMALL
  params = llama.unstack_layers(_random_params(c))['layers_0']
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 8, c.width)).astype(np.float32)
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  got, _ = jax.jit(llama.DecoderLayer(c).apply)({'params': params}, x, positions)
  want, magnitude = _np_layer(params, x, c)
  # A chain of float32 sums, their lengths added (float_tolerance.py): the
  # norm's mean (d), the projections (d), a score (h), the softmax's
  # normalizer and the weighted sum of values (2 T), the output projection
  # (H h), the second norm (d), gate/up (d) and down (f); a few roundings of
  # rsqrt, exp, sin/cos and division besides (16).
  n = (c.width + c.width + c.head_width + 2 * 8 + c.num_heads * c.head_width +
       c.width + c.width + c.mlp_width + 16)
  np.testing.assert_allclose(got, want, rtol=0, atol=ft.atol(n, magnitude.max()))


def test_the_whole_model_is_embedding_layers_norm_and_head():
  for tie in (True, False):
    c = SMALL.replace(tie_embeddings=tie, num_layers=1)
    params = _random_params(c, seed=2)
    tokens = np.random.default_rng(3).integers(0, c.vocab_size, (2, 8)).astype(np.int32)
    got = jax.jit(llama.LlamaLM(c).apply)({'params': params}, tokens)
    layer = llama.unstack_layers(params)['layers_0']
    table = np.asarray(params['embed_tokens']['embedding'], np.float64)
    x, _ = _np_layer(layer, table[tokens], c)
    z = _np_rms_norm(x, np.asarray(params['norm']['scale'], np.float64), c.norm_eps)
    head = table.T if tie else np.asarray(params['lm_head']['kernel'], np.float64)
    want = z @ head
    assert ('lm_head' in params) == (not tie)
    n = 4 * c.width + c.head_width + 16 + c.num_heads * c.head_width + c.mlp_width + 16
    n += 2 * c.width  # The final norm and the head.
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=ft.atol(n, (np.abs(z) @ np.abs(head)).max() +
                                            np.abs(want).max()))


def test_rope_scores_depend_only_on_the_offset_of_the_positions():
  rng = np.random.default_rng(4)
  q = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
  k = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
  score = lambda s, t: float(jnp.sum(llama.rope(q, jnp.array([[s]])) *
                                     llama.rope(k, jnp.array([[t]]))))
  # Dot products of 16 rotated terms, each rotation a sum of 2: n = 16 + 2 * 2.
  atol = ft.atol(20 + 8, 2 * np.abs(q).sum() * np.abs(k).max() * 2)
  for s, t in [(3, 1), (10, 8), (102, 100)]:
    np.testing.assert_allclose(score(s, t), score(s - t, 0), rtol=0, atol=atol)
  assert abs(score(2, 0) - score(0, 2)) > 1e-3  # It sees the sign of the offset.


# ----------------------------------------------------- counts of the presets

@pytest.mark.parametrize('name', list(lc.PRESETS))
def test_counted_parameters_equal_the_analytic_count(name):
  shapes = llama.param_shapes(name)  # jax.eval_shape: nothing is allocated.
  counted = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
  assert counted == lc.num_params(name)
  assert {s.dtype for s in jax.tree.leaves(shapes)} == {jnp.dtype('float32')}
  assert abs(counted / lc.NOMINAL[name] - 1) < 0.05
  c = lc.preset(name)
  assert ('lm_head' in shapes) == (not c.tie_embeddings)
  assert shapes['layers']['self_attn']['k_proj']['kernel'].shape == (
      c.num_layers, c.width, c.num_kv_heads * c.head_width)


def test_the_counts_follow_the_shape_by_hand():
  # 1.3b: d 2048, 24 layers, 16 heads of 128, 8 key/value heads, f 5888,
  # 32,000 tokens, untied.
  d, f, v = 2048, 5888, 32000
  per_layer = 2 * d * d + 2 * d * 8 * 128 + 3 * d * f + 2 * d
  assert lc.num_params('1.3b') == 2 * v * d + 24 * per_layer + d == 1_301_383_168
  matmul = 24 * (per_layer - 2 * d) + v * d
  assert lc.matmul_params('1.3b') == matmul
  assert lc.train_flops_per_token('1.3b') == 6 * matmul + 12 * 24 * d * 2048
  assert lc.train_flops_per_token('1.3b', seq_len=1024) == 6 * matmul + 12 * 24 * d * 1024
  # Tied, a head width apart from d / H, unscanned: the same formula.
  c = SMALL.replace(tie_embeddings=True, head_dim=6, scan_layers=False)
  counted = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(llama.param_shapes(c)))
  assert counted == lc.num_params(c)


def test_the_docs_show_the_preset_table_the_code_computes():
  with open(os.path.join(REPO, 'docs', 'language_models.md'), encoding='utf-8') as f:
    text = f.read()
  assert lc.preset_table() in text, (
      'docs/language_models.md: the preset table differs from the code; paste the '
      'output of `python -c "from fedjx.models import llama_config; '
      'print(llama_config.preset_table())"`.')
  assert re.search(r'\| `1\.3b` \| 32,000 \| 2,048 \| 24 \|', text)


# ------------------------------------------- the same function, other programs

def test_scanned_and_unscanned_layers_give_the_same_logits():
  c = SMALL
  params = _random_params(c, seed=5)
  tokens = np.random.default_rng(6).integers(0, c.vocab_size, (2, 12)).astype(np.int32)
  scanned = jax.jit(llama.LlamaLM(c).apply)({'params': params}, tokens)
  loop = llama.LlamaLM(c.replace(scan_layers=False))
  unstacked = llama.unstack_layers(params)
  looped = jax.jit(loop.apply)({'params': unstacked}, tokens)
  # The same operations in the same order; only XLA's fusion may differ.
  n = 2 * (5 * c.width + c.head_width + 24 + c.mlp_width) + 2 * c.width
  np.testing.assert_allclose(looped, scanned, rtol=0,
                             atol=ft.atol(n, 4 * np.abs(scanned).max()))
  restacked = llama.stack_layers(unstacked, c.num_layers)
  jax.tree.map(np.testing.assert_array_equal, restacked, params)


def test_a_token_sees_only_itself_and_the_past():
  c = SMALL
  params = _random_params(c, seed=10)
  tokens = np.random.default_rng(11).integers(1, c.vocab_size, (1, 10)).astype(np.int32)
  later = tokens.copy()
  later[0, 6:] = (later[0, 6:] + 7) % c.vocab_size  # Only positions 6.. change.
  apply = jax.jit(llama.LlamaLM(c).apply)
  a, b = apply({'params': params}, tokens), apply({'params': params}, later)
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


def test_the_scanned_program_does_not_grow_with_depth():
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)

  def program(num_layers, scan):
    c = SMALL.replace(num_layers=num_layers, scan_layers=scan)
    shapes = llama.param_shapes(c)
    return len(jax.jit(llama.LlamaLM(c).apply).lower({'params': shapes}, tokens).as_text())

  assert program(8, True) == program(2, True)  # One layer body, whatever L.
  assert program(8, False) > 3 * program(2, False) / 2


def _grads(c, params, tokens):
  model = llama.llama_lm(c)
  loss = lambda p: jnp.mean(model.loss_fn(p, {'x': tokens}))
  return jax.jit(jax.value_and_grad(loss))(params)


_NO_REMAT = {}


@pytest.mark.parametrize('scan,policy', [(True, p) for p in lc.REMAT_POLICIES[1:]] +
                         [(False, 'dots_saveable')])
@pytest.mark.slow
def test_a_remat_policy_gives_the_gradients_of_none(scan, policy):
  c = SMALL.replace(scan_layers=scan)
  params = _random_params(c, seed=7)
  tokens = np.random.default_rng(8).integers(1, c.vocab_size, (2, 12)).astype(np.int32)
  if scan not in _NO_REMAT:
    _NO_REMAT[scan] = _grads(c, params, tokens)
  loss0, g0 = _NO_REMAT[scan]
  loss, g = _grads(c.replace(remat=policy), params, tokens)
  # Recomputation repeats the forward pass's own operations: the backward
  # pass's sums (over B T = 22 tokens and the widths) may be fused apart.
  n = 2 * 11 + 2 * (5 * c.width + c.head_width + 24 + c.mlp_width)
  np.testing.assert_allclose(loss, loss0, rtol=ft.rtol(n))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=0, atol=ft.atol(n, 4 * np.abs(b).max() + 1e-30)), g, g0)


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_parameters_and_gradients():
  c = SMALL
  c16 = c.replace(dtype='bfloat16')
  shapes = llama.param_shapes(c16)
  assert {p.dtype for p in jax.tree.leaves(shapes)} == {jnp.dtype('float32')}
  tokens = np.random.default_rng(8).integers(1, c.vocab_size, (2, 12)).astype(np.int32)
  logits = jax.eval_shape(llama.LlamaLM(c16).apply, {'params': shapes}, tokens)
  assert logits.dtype == jnp.bfloat16
  params = _random_params(c, seed=7)  # Those of the remat tests: one compile fewer.
  if True not in _NO_REMAT:
    _NO_REMAT[True] = _grads(c, params, tokens)
  loss32, g32 = _NO_REMAT[True]
  loss16, g16 = _grads(c16, params, tokens)
  assert {g.dtype for g in jax.tree.leaves(g16)} == {jnp.dtype('float32')}
  assert loss16.dtype == jnp.float32
  # bfloat16 keeps 8 significant bits (u = 2^-9): the loss agrees to about
  # that, and the gradients point the same way.
  np.testing.assert_allclose(loss16, loss32, rtol=2e-2)
  flat16 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(g16)])
  flat32 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(g32)])
  cosine = flat16 @ flat32 / np.linalg.norm(flat16) / np.linalg.norm(flat32)
  assert cosine > 0.99


def test_the_smallest_preset_learns_a_repeated_sequence():
  model = llama.llama_lm('500k', remat='full')
  tokens = np.tile(np.arange(1, 17, dtype=np.int32), (4, 2))  # [4, 32]
  batch = {'x': tokens}
  params = jax.jit(model.init)(jax.random.key(0), batch)
  opt = optax.adamw(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    loss, g = jax.value_and_grad(lambda p: jnp.mean(model.loss_fn(p, batch)))(params)
    updates, state = opt.update(g, state, params)
    return optax.apply_updates(params, updates), state, loss

  first = None
  for _ in range(30):
    params, state, loss = step(params, state)
    first = loss if first is None else first
  assert float(first) > np.log(256) - 0.5
  assert float(loss) < 0.5 * float(first)


# ------------------------------------------------------------------ errors

def test_bad_shapes_and_names_are_refused_with_the_allowed_values():
  with pytest.raises(ValueError, match=r"preset='1B' is not one of '500k', '1m'"):
    llama.llama_lm('1B')
  with pytest.raises(ValueError, match=r'num_heads=6 is not a multiple of num_kv_heads=4'):
    SMALL.replace(num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match=r"remat='dots' is not one of 'auto', 'none', 'full'"):
    llama.llama_lm('1m', remat='dots')
  with pytest.raises(ValueError, match=r"dtype='bf16' is not one of 'float32', 'bfloat16'"):
    llama.llama_lm('1m', dtype='bf16')
  with pytest.raises(ValueError, match=r'unknown field\(s\) hidden_size'):
    llama.llama_lm('1m', hidden_size=3)
  with pytest.raises(ValueError, match=r'width=30 is not divisible by num_heads=4'):
    SMALL.replace(width=30)
  with pytest.raises(ValueError, match=r'lack layers_1'):
    llama.stack_layers({'layers_0': {}}, 2)
