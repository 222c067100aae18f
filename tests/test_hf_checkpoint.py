"""Hugging Face Llama checkpoints in and out, against tensors written by hand.

A tiny random checkpoint is written in Hugging Face's names and layout
(``[out, in]`` weights) with the safetensors package directly, as one file and
as shards with an index, tied and untied. Loading must give exactly those
arrays (transposed, stacked over layers when scanned); the loaded model's
logits must equal a NumPy float64 forward pass written in Hugging Face's own
convention (``y = W x``, "rotate half" RoPE, repeated key/value heads); saving
and loading again must give identical parameters and logits; and bad
checkpoints must be refused with every offending tensor named. When
``torch`` and ``transformers`` are installed, a slow test loads the saved
folder with ``transformers.LlamaForCausalLM`` and compares logits.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from fedjx.models import hf_checkpoint as hc
from fedjx.models import llama

import float_tolerance as ft

V, D, L, H, K, F = 64, 32, 2, 4, 2, 48
HD = D // H
HF_CONFIG = {
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': D,
    'intermediate_size': F, 'num_hidden_layers': L, 'num_attention_heads': H,
    'num_key_value_heads': K, 'head_dim': HD, 'vocab_size': V, 'rms_norm_eps': 1e-6,
    'rope_theta': 500.0, 'max_position_embeddings': 128, 'hidden_act': 'silu',
    'attention_bias': False, 'mlp_bias': False, 'rope_scaling': None,
    'torch_dtype': 'float32',
}
TOKENS = np.array([[1, 5, 9, 63, 0, 17, 33, 2], [7, 7, 40, 12, 3, 60, 21, 8]], np.int32)


def _hf_config(tie: bool) -> dict:
  return dict(HF_CONFIG, tie_word_embeddings=tie)


def _hf_tensors(tie: bool, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors of a tiny Llama in Hugging Face names and shapes."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
  scale = lambda: (1.0 + 0.3 * rng.standard_normal(D)).astype(np.float32)
  out = {'model.embed_tokens.weight': normal(V, D)}
  for i in range(L):
    p = f'model.layers.{i}.'
    out.update({
        p + 'self_attn.q_proj.weight': normal(H * HD, D),
        p + 'self_attn.k_proj.weight': normal(K * HD, D),
        p + 'self_attn.v_proj.weight': normal(K * HD, D),
        p + 'self_attn.o_proj.weight': normal(D, H * HD),
        p + 'mlp.gate_proj.weight': normal(F, D),
        p + 'mlp.up_proj.weight': normal(F, D),
        p + 'mlp.down_proj.weight': normal(D, F),
        p + 'input_layernorm.weight': scale(),
        p + 'post_attention_layernorm.weight': scale(),
    })
  out['model.norm.weight'] = scale()
  if not tie:
    out['lm_head.weight'] = normal(V, D)
  return out


def _write(folder, hf_config, tensors, num_shards=1):
  """A Hugging Face model folder written with the safetensors package directly."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    json.dump(hf_config, f)
  names = list(tensors)
  if num_shards == 1:
    safetensors.numpy.save_file(tensors, os.path.join(folder, 'model.safetensors'),
                                metadata={'format': 'pt'})
    return
  weight_map = {}
  for s, chunk in enumerate(np.array_split(np.arange(len(names)), num_shards)):
    file = f'model-{s + 1:05d}-of-{num_shards:05d}.safetensors'
    part = {names[j]: tensors[names[j]] for j in chunk}
    safetensors.numpy.save_file(part, os.path.join(folder, file), metadata={'format': 'pt'})
    weight_map.update({n: file for n in part})
  with open(os.path.join(folder, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {'total_size': sum(t.nbytes for t in tensors.values())},
               'weight_map': weight_map}, f)


# ------------------------------------------------------------ the NumPy reference


def _np_norm(x, g, eps):
  return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _np_rope(x, theta):
  """Hugging Face's ``x cos + rotate_half(x) sin`` on ``x [B, T, N, h]``."""
  t, h = x.shape[1], x.shape[-1]
  inv = theta ** (-np.arange(0, h, 2) / h)
  ang = np.arange(t)[:, None] * inv[None, :]
  cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None, :]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None, :]
  half = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], -1)
  return x * cos + half * sin


def _np_logits(t, tokens, tie, eps=1e-6, theta=500.0):
  """Logits of ``LlamaForCausalLM`` in float64, from its tensors ``t`` (``y = x W^T``)."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  x = t['model.embed_tokens.weight'][tokens]
  b, n = tokens.shape
  mask = np.tril(np.ones((n, n), bool))
  for i in range(L):
    w = lambda name, i=i: t[f'model.layers.{i}.{name}.weight']
    u = _np_norm(x, w('input_layernorm'), eps)
    q = _np_rope((u @ w('self_attn.q_proj').T).reshape(b, n, H, HD), theta)
    k = _np_rope((u @ w('self_attn.k_proj').T).reshape(b, n, K, HD), theta)
    v = (u @ w('self_attn.v_proj').T).reshape(b, n, K, HD)
    k, v = np.repeat(k, H // K, 2), np.repeat(v, H // K, 2)  # repeat_kv
    s = np.where(mask, np.einsum('bsnh,btnh->bnst', q, k) / np.sqrt(HD), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x = x + np.einsum('bnst,btnh->bsnh', p, v).reshape(b, n, H * HD) @ w('self_attn.o_proj').T
    z = _np_norm(x, w('post_attention_layernorm'), eps)
    g = z @ w('mlp.gate_proj').T
    x = x + (g / (1 + np.exp(-g)) * (z @ w('mlp.up_proj').T)) @ w('mlp.down_proj').T
  z = _np_norm(x, t['model.norm.weight'], eps)
  head = t['model.embed_tokens.weight'] if tie else t['lm_head.weight']
  return z @ head.T, np.abs(z) @ np.abs(head).T


def _logits(config, params, tokens=TOKENS):
  return np.asarray(jax.jit(llama.LlamaLM(config).apply)({'params': params}, tokens))


def _tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------ configuration


def test_config_from_hf_and_back():
  c = hc.config_from_hf(_hf_config(tie=False))
  assert (c.vocab_size, c.width, c.num_layers, c.num_heads, c.num_kv_heads, c.mlp_width) == (
      V, D, L, H, K, F)
  assert c.head_dim is None and c.head_width == HD  # d / H: kept as the default.
  assert (c.norm_eps, c.rope_theta, c.seq_len, c.tie_embeddings) == (1e-6, 500.0, 128, False)
  hf = hc.to_hf_config(c)
  for key in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
              'num_key_value_heads', 'head_dim', 'vocab_size', 'rms_norm_eps', 'rope_theta',
              'max_position_embeddings', 'torch_dtype', 'architectures', 'model_type'):
    assert hf[key] == HF_CONFIG[key], key
  assert hf['tie_word_embeddings'] is False
  assert hc.config_from_hf(hf) == c
  assert hc.to_hf_config(c, 'bfloat16')['torch_dtype'] == 'bfloat16'
  # Defaults of Hugging Face's LlamaConfig, and a head width other than d / H.
  minimal = {k: HF_CONFIG[k] for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers',
                                        'num_attention_heads', 'vocab_size')}
  m = hc.config_from_hf(dict(minimal, head_dim=16))
  assert (m.num_kv_heads, m.head_width, m.norm_eps, m.rope_theta) == (H, 16, 1e-6, 10000.0)
  assert hc.config_from_hf(dict(minimal, rope_parameters={'rope_type': 'default',
                                                          'rope_theta': 7.0})).rope_theta == 7.0


@pytest.mark.parametrize('key, value', [
    ('rope_scaling', {'rope_type': 'llama3', 'factor': 8.0}),
    ('attention_bias', True),
    ('mlp_bias', True),
    ('model_type', 'mistral'),
    ('hidden_act', 'gelu'),
    ('rope_parameters', {'rope_type': 'yarn', 'factor': 4.0}),
])
def test_config_from_hf_refuses_what_the_model_cannot_compute(key, value):
  with pytest.raises(ValueError, match=key) as err:
    hc.config_from_hf(dict(HF_CONFIG, **{key: value}))
  assert 'config_from_hf' in str(err.value) and repr(value) in str(err.value)


def test_config_from_hf_names_a_missing_key():
  with pytest.raises(ValueError, match="'intermediate_size'"):
    hc.config_from_hf({k: v for k, v in HF_CONFIG.items() if k != 'intermediate_size'})


# ------------------------------------------------------------ loading


@pytest.mark.parametrize('tie', [False, True])
@pytest.mark.parametrize('num_shards', [1, 3])
def test_load_gives_the_written_arrays_transposed(tmp_path, tie, num_shards):
  tensors = _hf_tensors(tie)
  _write(tmp_path, _hf_config(tie), tensors, num_shards)
  config, params = hc.load_pretrained(str(tmp_path))
  assert config.scan_layers and config.tie_embeddings == tie
  assert jax.tree.structure(params) == jax.tree.structure(llama.param_shapes(config))
  layers = params['layers']
  for i in range(L):
    p = f'model.layers.{i}.'
    for module in ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj',
                   'self_attn.o_proj', 'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj'):
      sub, proj = module.split('.')
      np.testing.assert_array_equal(layers[sub][proj]['kernel'][i],
                                    tensors[p + module + '.weight'].T)
    for norm in ('input_layernorm', 'post_attention_layernorm'):
      np.testing.assert_array_equal(layers[norm]['scale'][i], tensors[p + norm + '.weight'])
  np.testing.assert_array_equal(params['embed_tokens']['embedding'],
                                tensors['model.embed_tokens.weight'])
  np.testing.assert_array_equal(params['norm']['scale'], tensors['model.norm.weight'])
  assert ('lm_head' in params) == (not tie)
  if not tie:
    np.testing.assert_array_equal(params['lm_head']['kernel'], tensors['lm_head.weight'].T)
  # Unscanned: the same arrays as layers_{i}.
  config_u, params_u = hc.load_pretrained(str(tmp_path), scan_layers=False)
  assert not config_u.scan_layers
  _tree_equal(llama.stack_layers(params_u, L), params)


@pytest.mark.parametrize('tie', [False, True])
def test_loaded_logits_equal_the_hugging_face_equations(tmp_path, tie):
  tensors = _hf_tensors(tie, seed=1)
  _write(tmp_path, _hf_config(tie), tensors)
  config, params = hc.load_pretrained(str(tmp_path))
  want, magnitude = _np_logits(tensors, TOKENS, tie)
  # A chain of float32 sums per layer (float_tolerance.py): the norm's mean
  # (d), q/k/v (d), a score (h), softmax and weighted values (2 T), o_proj
  # (H h), the second norm (d), gate/up (d), down (f), ~16 roundings of
  # rsqrt/exp/sin/cos/division; L layers of it, then the final norm and the
  # head (2 d). The bound scales with the head's sum of magnitudes, times 4
  # for what the earlier layers' errors grow to through the residual stream.
  per_layer = 4 * D + HD + 2 * TOKENS.shape[1] + H * HD + F + 16
  n = L * per_layer + 2 * D
  np.testing.assert_allclose(_logits(config, params), want, rtol=0,
                             atol=ft.atol(n, 4 * magnitude.max()))


def test_bfloat16_tensors_load_and_cast_to_param_dtype(tmp_path):
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in _hf_tensors(False).items()}
  _write(tmp_path, dict(_hf_config(False), torch_dtype='bfloat16'), tensors)
  _, params = hc.load_pretrained(str(tmp_path))
  q = params['layers']['self_attn']['q_proj']['kernel']
  assert q.dtype == jnp.float32
  np.testing.assert_array_equal(
      q[1], tensors['model.layers.1.self_attn.q_proj.weight'].astype(np.float32).T)
  config, params16 = hc.load_pretrained(str(tmp_path), param_dtype='bfloat16', dtype='bfloat16')
  assert (config.param_dtype, config.dtype) == ('bfloat16', 'bfloat16')
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params16))


def test_missing_and_unexpected_tensors_are_all_named(tmp_path):
  tensors = _hf_tensors(False)
  del tensors['model.layers.1.mlp.up_proj.weight'], tensors['model.norm.weight']
  tensors['model.layers.0.self_attn.q_proj.bias'] = np.zeros(D, np.float32)
  tensors['model.extra.weight'] = np.zeros(3, np.float32)
  _write(tmp_path, _hf_config(False), tensors)
  with pytest.raises(ValueError) as err:
    hc.load_pretrained(str(tmp_path))
  message = str(err.value)
  assert 'load_pretrained' in message and '\n' not in message
  for name in ('model.layers.1.mlp.up_proj.weight', 'model.norm.weight',
               'model.layers.0.self_attn.q_proj.bias', 'model.extra.weight'):
    assert name in message
  assert message.index('missing') < message.index('model.norm.weight') < message.index(
      'unexpected') < message.index('model.extra.weight')


def test_a_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
  tensors = _hf_tensors(False)
  tensors['model.layers.1.self_attn.k_proj.weight'] = np.zeros((K * HD + 2, D), np.float32)
  _write(tmp_path, _hf_config(False), tensors)
  with pytest.raises(ValueError, match=r'model\.layers\.1\.self_attn\.k_proj\.weight has shape '
                     r'\[18, 32\], expected \[16, 32\]'):
    hc.load_pretrained(str(tmp_path))


def test_derived_buffers_and_a_tied_copy_of_the_embedding_are_skipped(tmp_path):
  tensors = _hf_tensors(True)
  tensors['model.layers.0.self_attn.rotary_emb.inv_freq'] = np.ones(HD // 2, np.float32)
  tensors['lm_head.weight'] = tensors['model.embed_tokens.weight'].copy()
  _write(tmp_path, _hf_config(True), tensors)
  _, params = hc.load_pretrained(str(tmp_path))
  assert 'lm_head' not in params
  tensors['lm_head.weight'] = tensors['lm_head.weight'] + 1.0  # Not a copy: refused.
  _write(tmp_path, _hf_config(True), tensors)
  with pytest.raises(ValueError, match=r'unexpected tensors: lm_head\.weight'):
    hc.load_pretrained(str(tmp_path))


def test_absent_files_are_named(tmp_path):
  with pytest.raises(ValueError, match='config.json'):
    hc.load_pretrained(str(tmp_path))
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump(HF_CONFIG, f)
  with pytest.raises(ValueError, match=r'model\.safetensors'):
    hc.load_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match='tokenizer.json'):
    hc.tokenizer_from_folder(str(tmp_path))


def test_tokenizer_from_folder(tmp_path):
  tokenizers = pytest.importorskip('tokenizers')
  vocab = {'[UNK]': 0, 'hello': 1, 'world': 2}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / 'tokenizer.json'))
  assert hc.tokenizer_from_folder(str(tmp_path)).encode('hello there world').ids == [1, 0, 2]


# ------------------------------------------------------------ saving


def _random_params(config, seed=3):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape), s.dtype),
                      llama.param_shapes(config))


@pytest.mark.parametrize('tie, scan', [(False, True), (True, False)])
def test_save_then_load_gives_identical_params_and_logits(tmp_path, tie, scan):
  config = hc.config_from_hf(_hf_config(tie), scan_layers=scan)
  params = _random_params(config)
  assert hc.save_pretrained(str(tmp_path), config, params) == ['model.safetensors']
  with open(tmp_path / 'config.json') as f:
    assert json.load(f) == dict(hc.to_hf_config(config))
  loaded_config, loaded = hc.load_pretrained(str(tmp_path), scan_layers=scan)
  assert loaded_config == config
  _tree_equal(loaded, params)
  np.testing.assert_array_equal(_logits(config, loaded), _logits(config, params))
  # The file holds Hugging Face's names and [out, in] layout.
  stored = hc.read_safetensors(str(tmp_path / 'model.safetensors'))
  assert set(stored) == set(_hf_tensors(tie))
  q = (params['layers']['self_attn']['q_proj']['kernel'][1] if scan
       else params['layers_1']['self_attn']['q_proj']['kernel'])
  np.testing.assert_array_equal(stored['model.layers.1.self_attn.q_proj.weight'], np.asarray(q).T)


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
  config = hc.config_from_hf(_hf_config(False))
  params = _random_params(config, seed=4)
  limit = 3 * D * F * 4  # Room for three of the MLP matrices per shard.
  files = hc.save_pretrained(str(tmp_path), config, params, max_shard_bytes=limit)
  n = len(files)
  assert n > 1 and files == [f'model-{i:05d}-of-{n:05d}.safetensors' for i in range(1, n + 1)]
  with open(tmp_path / 'model.safetensors.index.json') as f:
    index = json.load(f)
  sizes = {}
  for file in files:
    part = hc.read_safetensors(str(tmp_path / file))
    sizes[file] = sum(t.nbytes for t in part.values())
    assert all(index['weight_map'][name] == file for name in part)
    # A shard exceeds the limit only when it holds one tensor larger than it.
    assert sizes[file] <= limit or len(part) == 1
  assert set(index['weight_map']) == set(_hf_tensors(False))
  assert index['metadata']['total_size'] == sum(sizes.values())
  assert not (tmp_path / 'model.safetensors').exists()
  _, loaded = hc.load_pretrained(str(tmp_path))
  _tree_equal(loaded, params)
  # Saving again unsharded replaces the shards and the index.
  hc.save_pretrained(str(tmp_path), config, params)
  assert sorted(os.listdir(tmp_path)) == ['config.json', 'model.safetensors']


def test_save_in_bfloat16(tmp_path):
  config = hc.config_from_hf(_hf_config(True))
  params = _random_params(config, seed=5)
  hc.save_pretrained(str(tmp_path), config, params, dtype='bfloat16')
  with open(tmp_path / 'config.json') as f:
    assert json.load(f)['torch_dtype'] == 'bfloat16'
  _, loaded = hc.load_pretrained(str(tmp_path))
  want = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                      params)
  _tree_equal(loaded, jax.tree.map(jnp.asarray, want))


def test_save_refuses_bad_params_and_arguments(tmp_path):
  config = hc.config_from_hf(_hf_config(False))
  params = _random_params(config)
  lora = jax.tree.map(lambda x: x, params)
  lora['layers']['self_attn']['q_proj']['kernel_lora_a'] = jnp.zeros((L, D, 2))
  with pytest.raises(ValueError, match=r'unexpected: layers/self_attn/q_proj/kernel_lora_a.*'
                     'merge_adapters'):
    hc.save_pretrained(str(tmp_path), config, lora)
  wrong = jax.tree.map(lambda x: x, params)
  wrong['norm']['scale'] = jnp.ones(D + 1)
  with pytest.raises(ValueError, match=r'norm/scale has shape \[33\], expected \[32\]'):
    hc.save_pretrained(str(tmp_path), config, wrong)
  with pytest.raises(ValueError, match="dtype='int8'"):
    hc.save_pretrained(str(tmp_path), config, params, dtype='int8')
  with pytest.raises(ValueError, match='max_shard_bytes=0'):
    hc.save_pretrained(str(tmp_path), config, params, max_shard_bytes=0)


# ------------------------------------------------------------ transformers itself


@pytest.mark.slow
@pytest.mark.parametrize('tie', [False, True])
def test_transformers_loads_the_saved_folder_with_the_same_logits(tmp_path, tie):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  config = hc.config_from_hf(_hf_config(tie))
  params = _random_params(config, seed=6)
  hc.save_pretrained(str(tmp_path), config, params, max_shard_bytes=16 * 1024)
  model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
  model.eval()
  with torch.no_grad():
    theirs = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  ours = _logits(config, params)
  # Two float32 forward passes, each within the bound of
  # test_loaded_logits_equal_the_hugging_face_equations of the exact logits.
  stored = {}
  for file in os.listdir(tmp_path):
    if file.endswith('.safetensors'):
      stored.update(hc.read_safetensors(str(tmp_path / file)))
  _, magnitude = _np_logits(stored, TOKENS, tie)
  per_layer = 4 * D + HD + 2 * TOKENS.shape[1] + H * HD + F + 16
  n = L * per_layer + 2 * D
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=2 * ft.atol(n, 4 * magnitude.max()))
