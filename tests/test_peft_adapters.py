"""LoRA adapters of the Llama model to and from PEFT's format, and merged into the base.

A tiny Llama gets qwix LoRA adapters on ``q_proj`` and ``v_proj`` (nonzero
``b`` so that the adapters change the output). The exported
``adapter_model.safetensors`` must hold PEFT's names with ``lora_A = a^T [r,
in]`` and ``lora_B = b^T [out, r]``; reading it back must give the same tree;
:func:`merge_adapters` must equal ``K + (alpha / r) a b`` computed in NumPy
float64, and the merged dense model must compute the LoRA model's logits.
When ``torch``, ``transformers`` and ``peft`` are installed, a slow test
loads the saved base and the exported adapter with ``peft.PeftModel`` and
compares logits.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
import safetensors.numpy

from fedjx.models import hf_checkpoint as hc
from fedjx.models import llama
from fedjx.models import peft_adapters as pa
from fedjx.models.llama_config import LlamaConfig

import float_tolerance as ft

RANK, ALPHA = 4, 8.0
TARGETS = ('q_proj', 'v_proj')
CONFIG = LlamaConfig(vocab_size=64, width=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     mlp_width=48, seq_len=16, norm_eps=1e-6)
TOKENS = np.array([[3, 1, 4, 1, 5, 9, 2, 6], [60, 5, 3, 5, 8, 9, 7, 9]], np.int32)


def _lora_model(config, targets=TARGETS, rank=RANK):
  provider = qwix.LoraProvider(module_path=f'.*({"|".join(targets)})', rank=rank, alpha=ALPHA)
  return qwix.apply_lora_to_model(llama.LlamaLM(config), provider)


def _lora_params(config, targets=TARGETS, rank=RANK, seed=0):
  """qwix LoRA parameters with every leaf drawn at random (``b`` not zero)."""
  shapes = jax.eval_shape(_lora_model(config, targets, rank).init, jax.random.key(0),
                          jnp.zeros((1, 8), jnp.int32))['params']
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape), s.dtype), shapes)


def _lora_logits(config, params):
  return np.asarray(jax.jit(_lora_model(config).apply)({'params': params}, TOKENS))


def _atol(params, config=CONFIG):
  """Float32 bound on two evaluations of the logits that order their sums differently.

  A chain of float32 sums per layer (float_tolerance.py): the norm's mean
  (d), q/k/v with their adapters (d + r), a score (h), softmax and weighted
  values (2 T), o_proj (H h), the second norm (d), gate/up (d), down (f), ~16
  roundings of rsqrt/exp/sin/cos/division; L layers of it, then the final norm
  and the head (2 d). The bound scales with the head's sum of magnitudes
  ``sum_j |z_j| |W_jv| <= ||z||_2 ||W_:v||_2 <= max|g| sqrt(d) ||W_:v||_2``
  (``z`` the final RMSNorm's output, of RMS ``|g|``), times 4 for what the
  earlier layers' errors grow to through the residual stream.
  """
  d, h = config.width, config.head_width
  per_layer = 4 * d + RANK + h + 2 * TOKENS.shape[1] + config.num_heads * h + config.mlp_width + 16
  n = config.num_layers * per_layer + 2 * d
  g = np.abs(np.asarray(params['norm']['scale'], np.float64)).max()
  head = (np.asarray(params['embed_tokens']['embedding'], np.float64).T if config.tie_embeddings
          else np.asarray(params['lm_head']['kernel'], np.float64))
  return ft.atol(n, 4 * g * np.sqrt(d) * np.linalg.norm(head, axis=0).max())


def _tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('scan', [True, False])
def test_export_writes_peft_names_shapes_and_config(tmp_path, scan):
  config = CONFIG.replace(scan_layers=scan)
  params = _lora_params(config)
  shapes = pa.export_peft(str(tmp_path), params, rank=RANK, alpha=ALPHA, target_modules=TARGETS,
                          base_model_name_or_path='tiny-llama', dropout=0.05)
  stored = safetensors.numpy.load_file(str(tmp_path / 'adapter_model.safetensors'))
  d, kv = CONFIG.width, CONFIG.num_kv_heads * CONFIG.head_width
  want = {}
  for i in range(CONFIG.num_layers):
    p = f'base_model.model.model.layers.{i}.self_attn.'
    want.update({p + 'q_proj.lora_A.weight': (RANK, d), p + 'q_proj.lora_B.weight': (d, RANK),
                 p + 'v_proj.lora_A.weight': (RANK, d), p + 'v_proj.lora_B.weight': (kv, RANK)})
  assert shapes == want
  assert {k: v.shape for k, v in stored.items()} == want
  for i in range(CONFIG.num_layers):
    for proj in TARGETS:
      module = (params['layers']['self_attn'][proj] if scan
                else params[f'layers_{i}']['self_attn'][proj])
      a, b = module['kernel_lora_a'], module['kernel_lora_b']
      if scan:
        a, b = a[i], b[i]
      p = f'base_model.model.model.layers.{i}.self_attn.{proj}'
      np.testing.assert_array_equal(stored[p + '.lora_A.weight'], np.asarray(a).T)
      np.testing.assert_array_equal(stored[p + '.lora_B.weight'], np.asarray(b).T)
  with open(tmp_path / 'adapter_config.json') as f:
    cfg = json.load(f)
  assert {k: cfg[k] for k in ('peft_type', 'task_type', 'r', 'lora_alpha', 'lora_dropout',
                              'target_modules', 'bias', 'fan_in_fan_out', 'inference_mode',
                              'base_model_name_or_path')} == {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': RANK, 'lora_alpha': ALPHA,
      'lora_dropout': 0.05, 'target_modules': ['q_proj', 'v_proj'], 'bias': 'none',
      'fan_in_fan_out': False, 'inference_mode': True, 'base_model_name_or_path': 'tiny-llama'}


@pytest.mark.parametrize('scan', [True, False])
def test_load_peft_reads_back_what_export_wrote(tmp_path, scan):
  config = CONFIG.replace(scan_layers=scan)
  params = _lora_params(config, seed=1)
  pa.export_peft(str(tmp_path), params, rank=RANK, alpha=ALPHA, target_modules=TARGETS)
  template = _lora_params(config, seed=2)
  loaded = pa.load_peft(str(tmp_path), template)
  # Adapters from the file, everything else from the template.
  want = jax.tree_util.tree_map_with_path(
      lambda path, t, p: p if 'lora' in jax.tree_util.keystr(path) else t, template, params)
  _tree_equal(loaded, want)
  # With the template's base weights those of params: the very tree exported.
  _tree_equal(pa.load_peft(str(tmp_path), pa.load_peft(str(tmp_path), params)), params)


def test_load_peft_refuses_a_mismatched_rank_names_and_shapes(tmp_path):
  params = _lora_params(CONFIG)
  pa.export_peft(str(tmp_path), params, rank=RANK, alpha=ALPHA, target_modules=TARGETS)
  with pytest.raises(ValueError, match=r'load_peft: .*q_proj has rank 2 .*rank=4'):
    pa.load_peft(str(tmp_path), _lora_params(CONFIG, rank=2))
  with pytest.raises(ValueError, match=r'missing: base_model\.model\.model\.layers\.0\.self_attn'
                     r'\.k_proj\.lora_A\.weight'):
    pa.load_peft(str(tmp_path), _lora_params(CONFIG, targets=('q_proj', 'k_proj', 'v_proj')))
  with pytest.raises(ValueError, match=r'unexpected: .*layers\.1\.self_attn\.v_proj\.lora_B'):
    pa.load_peft(str(tmp_path), _lora_params(CONFIG, targets=('q_proj',)))
  path = str(tmp_path / 'adapter_model.safetensors')
  stored = safetensors.numpy.load_file(path)
  name = 'base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight'
  stored[name] = np.zeros((5, RANK), np.float32)
  safetensors.numpy.save_file(stored, path)
  with pytest.raises(ValueError, match=rf'{name.replace(".", "[.]")} has shape \[5, 4\], '
                     r'expected \[16, 4\]'):
    pa.load_peft(str(tmp_path), params)


def test_export_refuses_wrong_targets_and_rank(tmp_path):
  params = _lora_params(CONFIG)
  with pytest.raises(ValueError, match=r"target_modules=\['q_proj'\] but the params adapt "
                     r"\['q_proj', 'v_proj'\]"):
    pa.export_peft(str(tmp_path), params, rank=RANK, alpha=ALPHA, target_modules=['q_proj'])
  with pytest.raises(ValueError, match=r'export_peft: .* has rank 4 .*rank=8'):
    pa.export_peft(str(tmp_path), params, rank=8, alpha=ALPHA, target_modules=TARGETS)
  # qwix adapts a tied head's embedding.attend too; PEFT names no such adapter.
  tied = jax.tree.map(lambda x: x, params)
  tied['embed_tokens']['embedding_lora_a'] = jnp.zeros((CONFIG.width, RANK))
  tied['embed_tokens']['embedding_lora_b'] = jnp.zeros((RANK, CONFIG.vocab_size))
  for call in (lambda: pa.export_peft(str(tmp_path), tied, rank=RANK, alpha=ALPHA,
                                      target_modules=TARGETS),
               lambda: pa.merge_adapters(tied, ALPHA, RANK)):
    with pytest.raises(ValueError, match='embed_tokens/embedding_lora_a is not on a linear'):
      call()
  with pytest.raises(ValueError, match='no kernel_lora_a'):
    pa.export_peft(str(tmp_path), pa.merge_adapters(params, ALPHA, RANK), rank=RANK,
                   alpha=ALPHA, target_modules=TARGETS)


@pytest.mark.parametrize('scan', [True, False])
def test_merge_adapters_is_the_dense_formula(scan):
  config = CONFIG.replace(scan_layers=scan)
  params = _lora_params(config, seed=3)
  merged = pa.merge_adapters(params, ALPHA, RANK)
  assert jax.tree.structure(merged) == jax.tree.structure(llama.param_shapes(config))
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  got = dict(jax.tree_util.tree_flatten_with_path(merged)[0])
  for path, leaf in flat:
    key = jax.tree_util.keystr(path)
    if 'lora' in key:
      continue
    if not any(p in key for p in TARGETS):
      np.testing.assert_array_equal(got[path], leaf)  # Untouched.
      continue
    module = params
    for k in path[:-1]:
      module = module[k.key]
    k64, a64, b64 = (np.asarray(module[n], np.float64)
                     for n in ('kernel', 'kernel_lora_a', 'kernel_lora_b'))
    want = k64 + (ALPHA / RANK) * np.matmul(a64, b64)
    # A float32 sum of r products plus the kernel: r + 1 terms of magnitudes
    # |K| + (alpha / r) |a| |b| (float_tolerance.py).
    magnitude = np.abs(k64) + (ALPHA / RANK) * np.matmul(np.abs(a64), np.abs(b64))
    np.testing.assert_allclose(got[path], want, rtol=0, atol=ft.atol(RANK + 2, magnitude.max()))


@pytest.mark.parametrize('scan', [True, False])
def test_merged_model_computes_the_lora_models_logits(tmp_path, scan):
  config = CONFIG.replace(scan_layers=scan)
  params = _lora_params(config, seed=4)
  lora = _lora_logits(config, params)
  merged = pa.merge_adapters(params, ALPHA, RANK)
  dense = np.asarray(jax.jit(llama.LlamaLM(config).apply)({'params': merged}, TOKENS))
  # x (K + s a b) against x K + s (x a) b: the same terms summed in another
  # order, d + r of them per projection.
  np.testing.assert_allclose(dense, lora, rtol=0, atol=_atol(params))
  # Saved as a Hugging Face checkpoint and loaded again: the same dense logits.
  hc.save_pretrained(str(tmp_path), config, merged)
  loaded_config, loaded = hc.load_pretrained(str(tmp_path), scan_layers=scan)
  np.testing.assert_array_equal(
      np.asarray(jax.jit(llama.LlamaLM(loaded_config).apply)({'params': loaded}, TOKENS)), dense)


def test_merge_refuses_a_wrong_rank():
  with pytest.raises(ValueError, match=r'merge_adapters: .* has rank 4 .*rank=2'):
    pa.merge_adapters(_lora_params(CONFIG), ALPHA, 2)


@pytest.mark.slow
def test_peft_loads_the_exported_adapter_with_the_same_logits(tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  peft = pytest.importorskip('peft')
  params = _lora_params(CONFIG, seed=5)
  hc.save_pretrained(str(tmp_path / 'base'), CONFIG, _strip(params))
  pa.export_peft(str(tmp_path / 'adapter'), params, rank=RANK, alpha=ALPHA,
                 target_modules=TARGETS, base_model_name_or_path=str(tmp_path / 'base'))
  model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / 'base'),
                                                        torch_dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model, str(tmp_path / 'adapter'))
  model.eval()
  with torch.no_grad():
    theirs = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  ours = _lora_logits(CONFIG, params)
  # Two float32 forward passes, each within _atol of the exact logits.
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=2 * _atol(params))
  # The adapters matter: without them the logits differ.
  with torch.no_grad(), model.disable_adapter():
    plain = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  assert np.abs(plain - theirs).max() > 1e-3


def _strip(params):
  """``params`` without the adapter leaves (the frozen base weights)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  out = {}
  for path, leaf in flat:
    keys = [k.key for k in path]
    if keys[-1].startswith('kernel_lora'):
      continue
    node = out
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = leaf
  return out
