"""Hugging Face ``LlamaForCausalLM`` checkpoints in and out of :mod:`fedjx.models.llama`.

A Hugging Face model folder holds ``config.json`` and its tensors in
safetensors files: one ``model.safetensors``, or shards
``model-00001-of-0000n.safetensors`` ... listed by
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
"weight_map": {name: file}}``). The architecture is that of Llama (Touvron et
al. 2023, "LLaMA: Open and Efficient Foundation Language Models", arXiv
2302.13971), as :mod:`fedjx.models.llama` states it.

**Names and layout.** A Hugging Face linear layer stores ``weight`` as
``[out, in]`` and computes ``y = x W^T``; a Flax ``Dense`` stores ``kernel``
as ``[in, out]`` and computes ``y = x K``, so::

  K = W^T                      (every *_proj and lm_head)
  E = embed_tokens.weight      (embedding, [V, d], as is)
  g = *_layernorm.weight       (RMSNorm scale, [d], as is)

with the name mapping of :mod:`fedjx.models.llama`'s docstring
(``model.layers.{i}.self_attn.q_proj.weight`` <->
``layers/self_attn/q_proj/kernel[i]``). With ``scan_layers`` the ``L`` layers'
tensors are stacked on a leading axis: ``kernel = stack_i(W_i^T)``, ``[L, in,
out]``; without it they are ``layers_{i}/.../kernel = W_i^T``.

**Configuration.** ``hidden_size`` is ``width``, ``intermediate_size``
``mlp_width``, ``num_hidden_layers`` ``num_layers``, ``num_attention_heads``
``num_heads``, ``num_key_value_heads`` ``num_kv_heads`` (default: the query
heads), ``rms_norm_eps`` ``norm_eps``, ``rope_theta`` ``rope_theta`` (also read
from transformers' newer ``rope_parameters``), ``tie_word_embeddings``
``tie_embeddings``, ``max_position_embeddings`` ``seq_len``. What the model
cannot compute is refused: RoPE scaling, attention or MLP biases, a hidden
activation other than SiLU, attention dropout, another ``model_type``.

Tensors that Hugging Face derives rather than learns
(``model.layers.{i}.self_attn.rotary_emb.inv_freq`` of old checkpoints) are
skipped on loading; so is a tied checkpoint's ``lm_head.weight`` when it
equals the embedding.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import flax
from flax import traverse_util
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
import safetensors.numpy

from fedjx.models import llama
from fedjx.models.llama_config import DTYPES
from fedjx.models.llama_config import LlamaConfig

__all__ = ['config_from_hf', 'hf_module_name', 'hf_tensor_shapes', 'load_pretrained',
           'read_safetensors', 'save_pretrained', 'to_hf_config', 'tokenizer_from_folder',
           'write_safetensors']

CONFIG_FILE = 'config.json'
SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
TOKENIZER_FILE = 'tokenizer.json'

LAYER_MODULES = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'self_attn.o_proj',
                 'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj', 'input_layernorm',
                 'post_attention_layernorm')
"""Modules of one decoder layer, by their Hugging Face names (``.`` for ``/``)."""

_SHARD_RE = re.compile(r'model-\d{5}-of-\d{5}\.safetensors')
_DERIVED_RE = re.compile(r'model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq')
_LEAF_NAMES = {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight'}
_NP_DTYPES = {'float32': np.dtype(np.float32), 'float16': np.dtype(np.float16),
              'bfloat16': np.dtype(ml_dtypes.bfloat16)}


# ----------------------------------------------------------------------------- configuration


def _required(hf_config: Mapping[str, Any], key: str) -> Any:
  if key not in hf_config:
    raise ValueError(f'config_from_hf: hf_config lacks the key {key!r}, which a Llama '
                     'config must give.')
  return hf_config[key]


def _rope_theta(hf_config: Mapping[str, Any]) -> float:
  """RoPE base from ``rope_theta`` or ``rope_parameters``; refuses any RoPE scaling."""
  scaling = hf_config.get('rope_scaling')
  if scaling is not None and (not isinstance(scaling, Mapping)
                              or scaling.get('rope_type', scaling.get('type')) != 'default'):
    raise ValueError(f'config_from_hf: rope_scaling={scaling!r} is not supported; the model '
                     'computes plain RoPE (rope_scaling null).')
  params = hf_config.get('rope_parameters')
  if params is not None:
    if not isinstance(params, Mapping) or params.get('rope_type', 'default') != 'default':
      raise ValueError(f'config_from_hf: rope_parameters={params!r} is not supported; the '
                       'model computes plain RoPE (rope_type "default").')
    if 'rope_theta' in params:
      return float(params['rope_theta'])
  return float(hf_config.get('rope_theta', 10000.0))


def _refuse_unsupported(hf_config: Mapping[str, Any]) -> None:
  model_type = hf_config.get('model_type', 'llama')
  if model_type != 'llama':
    raise ValueError(f'config_from_hf: model_type={model_type!r} is not supported; only '
                     "'llama' is.")
  architectures = hf_config.get('architectures')
  if architectures and 'LlamaForCausalLM' not in architectures:
    raise ValueError(f'config_from_hf: architectures={architectures!r} does not include '
                     "'LlamaForCausalLM'.")
  for key in ('attention_bias', 'mlp_bias'):
    if hf_config.get(key, False):
      raise ValueError(f'config_from_hf: {key}={hf_config[key]!r} is not supported; the '
                       'model has no biases (false).')
  act = hf_config.get('hidden_act', 'silu')
  if act != 'silu':
    raise ValueError(f'config_from_hf: hidden_act={act!r} is not supported; only "silu" '
                     '(SwiGLU) is.')
  dropout = hf_config.get('attention_dropout', 0.0)
  if dropout:
    raise ValueError(f'config_from_hf: attention_dropout={dropout!r} is not supported; the '
                     'model has no dropout (0.0).')


def config_from_hf(hf_config: Mapping[str, Any], **changes) -> LlamaConfig:
  """The :class:`LlamaConfig` of a Hugging Face Llama ``config.json`` (as a dict).

  Args:
    hf_config: the parsed ``config.json``.
    **changes: other :class:`LlamaConfig` fields (``dtype``, ``param_dtype``,
      ``scan_layers``, ``remat``, ...).

  Raises:
    ValueError: a required key is absent, or the config asks for what the
      model cannot compute (RoPE scaling, biases, another activation or model).
  """
  _refuse_unsupported(hf_config)
  width = _required(hf_config, 'hidden_size')
  heads = _required(hf_config, 'num_attention_heads')
  head_dim = hf_config.get('head_dim')
  if isinstance(width, int) and isinstance(heads, int) and heads and head_dim == width // heads \
      and width % heads == 0:
    head_dim = None  # The default d / H.
  fields = dict(
      vocab_size=_required(hf_config, 'vocab_size'), width=width,
      num_layers=_required(hf_config, 'num_hidden_layers'), num_heads=heads,
      num_kv_heads=hf_config.get('num_key_value_heads') or heads,
      mlp_width=_required(hf_config, 'intermediate_size'), head_dim=head_dim,
      tie_embeddings=bool(hf_config.get('tie_word_embeddings', False)),
      rope_theta=_rope_theta(hf_config), norm_eps=float(hf_config.get('rms_norm_eps', 1e-6)))
  if hf_config.get('max_position_embeddings') is not None:
    fields['seq_len'] = hf_config['max_position_embeddings']
  fields.update(changes)
  return LlamaConfig(**fields)


def to_hf_config(config: LlamaConfig, torch_dtype: str | None = None) -> dict[str, Any]:
  """The Hugging Face ``LlamaForCausalLM`` ``config.json`` dict of ``config``.

  ``torch_dtype`` is the dtype the tensors are stored in (default the
  config's ``param_dtype``).
  """
  torch_dtype = config.param_dtype if torch_dtype is None else torch_dtype
  if torch_dtype not in DTYPES:
    raise ValueError(f'to_hf_config: torch_dtype={torch_dtype!r} is not one of '
                     f'{", ".join(map(repr, DTYPES))}.')
  return {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
      'hidden_size': config.width, 'intermediate_size': config.mlp_width,
      'num_hidden_layers': config.num_layers, 'num_attention_heads': config.num_heads,
      'num_key_value_heads': config.num_kv_heads, 'head_dim': config.head_width,
      'vocab_size': config.vocab_size, 'rms_norm_eps': config.norm_eps,
      'rope_theta': config.rope_theta, 'rope_scaling': None,
      'tie_word_embeddings': config.tie_embeddings,
      'max_position_embeddings': config.seq_len, 'hidden_act': 'silu',
      'attention_bias': False, 'mlp_bias': False, 'attention_dropout': 0.0,
      'torch_dtype': torch_dtype,
  }


# ----------------------------------------------------------------------------- names


def hf_module_name(module_path: tuple[str, ...], layer: int | None = None) -> str:
  """The Hugging Face module name of the Flax module at ``module_path``.

  ``('layers', 'self_attn', 'q_proj')`` with ``layer=i`` (scanned) or
  ``('layers_3', 'self_attn', 'q_proj')`` (unscanned) is
  ``model.layers.{i}.self_attn.q_proj``; ``('embed_tokens',)``,
  ``('norm',)`` and ``('lm_head',)`` are ``model.embed_tokens``,
  ``model.norm`` and ``lm_head``.
  """
  top, rest = module_path[0], '.'.join(module_path[1:])
  match = re.fullmatch(r'layers_(\d+)', top)
  if (top == 'layers' and layer is not None) or match:
    if rest in LAYER_MODULES:
      return f'model.layers.{int(match.group(1)) if match else layer}.{rest}'
  elif top in ('embed_tokens', 'norm') and not rest:
    return f'model.{top}'
  elif top == 'lm_head' and not rest:
    return 'lm_head'
  raise ValueError(f'hf_module_name: module_path={"/".join(module_path)!r} (layer={layer}) '
                   'is not a module of the Llama model.')


def _leaf_names(path: tuple[str, ...], shape: tuple[int, ...]) -> list[str]:
  """Hugging Face tensor names of one Flax leaf: one per layer when scanned."""
  if path[-1] not in _LEAF_NAMES:
    raise ValueError(f'hf_checkpoint: the parameter {"/".join(path)!r} has no Hugging Face '
                     'name (adapters must be merged first: peft_adapters.merge_adapters).')
  leaf = _LEAF_NAMES[path[-1]]
  if path[0] == 'layers':
    return [f'{hf_module_name(path[:-1], i)}.{leaf}' for i in range(shape[0])]
  return [f'{hf_module_name(path[:-1])}.{leaf}']


def _hf_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
  """The Hugging Face shape of one layer's slice of a Flax leaf."""
  shape = tuple(shape[1:]) if path[0] == 'layers' else tuple(shape)
  return shape[::-1] if path[-1] == 'kernel' else shape


def hf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor of ``config``'s Hugging Face checkpoint, name -> shape."""
  out = {}
  for path, leaf in traverse_util.flatten_dict(llama.param_shapes(config)).items():
    for name in _leaf_names(path, leaf.shape):
      out[name] = _hf_shape(path, leaf.shape)
  return out


# ----------------------------------------------------------------------------- safetensors files


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of one safetensors file as NumPy arrays (bfloat16 via ``ml_dtypes``)."""
  out = {}
  with safe_open(path, framework='numpy') as f:
    names = list(f.keys())
    bf16 = [n for n in names if f.get_slice(n).get_dtype() == 'BF16']
    for name in names:
      if name not in bf16:
        out[name] = f.get_tensor(name)
  if bf16:
    with safe_open(path, framework='flax') as f:
      for name in bf16:
        out[name] = np.asarray(f.get_tensor(name))
  return out


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes ``tensors`` to one safetensors file with PyTorch's metadata (``format: pt``)."""
  arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
  safetensors.numpy.save_file(arrays, path, metadata={'format': 'pt'})


def _read_json(folder: str, name: str, caller: str) -> Any:
  path = os.path.join(folder, name)
  if not os.path.isfile(path):
    raise ValueError(f'{caller}: {path!r} does not exist.')
  with open(path) as f:
    return json.load(f)


def _read_checkpoint(folder: str) -> dict[str, np.ndarray]:
  """The tensors of a single-file or sharded checkpoint in ``folder``."""
  if os.path.isfile(os.path.join(folder, INDEX_FILE)):
    weight_map = _read_json(folder, INDEX_FILE, 'load_pretrained').get('weight_map')
    if not isinstance(weight_map, dict):
      raise ValueError(f'load_pretrained: {INDEX_FILE} in folder={folder!r} has no '
                       '"weight_map" object (tensor name -> shard file).')
    tensors = {}
    for shard in sorted(set(weight_map.values())):
      path = os.path.join(folder, shard)
      if not os.path.isfile(path):
        raise ValueError(f'load_pretrained: the shard {path!r} named by {INDEX_FILE} does '
                         'not exist.')
      tensors.update(read_safetensors(path))
    absent = sorted(n for n in weight_map if n not in tensors)
    if absent:
      raise ValueError(f'load_pretrained: {INDEX_FILE} lists tensors that are not in their '
                       f'shards: {", ".join(absent)}.')
    return tensors
  path = os.path.join(folder, SINGLE_FILE)
  if not os.path.isfile(path):
    raise ValueError(f'load_pretrained: folder={folder!r} has neither {SINGLE_FILE} nor '
                     f'{INDEX_FILE}.')
  return read_safetensors(path)


# ----------------------------------------------------------------------------- loading


def _drop_derived(tensors: dict[str, np.ndarray], config: LlamaConfig) -> None:
  """Removes RoPE buffers and a tied checkpoint's copy of the embedding as the head."""
  for name in [n for n in tensors if _DERIVED_RE.fullmatch(n)]:
    del tensors[name]
  if config.tie_embeddings and 'lm_head.weight' in tensors:
    head, embed = tensors['lm_head.weight'], tensors.get('model.embed_tokens.weight')
    if embed is not None and head.shape == embed.shape and np.array_equal(head, embed):
      del tensors['lm_head.weight']


def _check_names(tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple]) -> None:
  missing = [n for n in expected if n not in tensors]
  unexpected = sorted(n for n in tensors if n not in expected)
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f'missing tensors: {", ".join(missing)}')
    if unexpected:
      parts.append(f'unexpected tensors: {", ".join(unexpected)}')
    raise ValueError(f'load_pretrained: the checkpoint does not match the config; '
                     f'{"; ".join(parts)}.')
  for name, shape in expected.items():
    if tuple(tensors[name].shape) != tuple(shape):
      raise ValueError(f'load_pretrained: tensor {name} has shape '
                       f'{list(tensors[name].shape)}, expected {list(shape)}.')


def _to_flax(tensors: Mapping[str, np.ndarray], config: LlamaConfig) -> Any:
  """The Flax parameter tree of ``config`` filled from Hugging Face ``tensors``."""
  dtype = jnp.dtype(config.param_dtype)
  flat = {}
  for path, leaf in traverse_util.flatten_dict(llama.param_shapes(config)).items():
    parts = [tensors[n] for n in _leaf_names(path, leaf.shape)]
    if path[-1] == 'kernel':
      parts = [p.T for p in parts]
    value = np.stack(parts) if path[0] == 'layers' else parts[0]
    flat[path] = jnp.asarray(value, dtype=dtype)
  return traverse_util.unflatten_dict(flat)


def load_pretrained(folder: str, *, scan_layers: bool = True, dtype: str | None = None,
                    param_dtype: str = 'float32') -> tuple[LlamaConfig, Any]:
  """Reads a Hugging Face ``LlamaForCausalLM`` folder into ``(config, params)``.

  Args:
    folder: holds ``config.json`` and ``model.safetensors`` or shards with
      ``model.safetensors.index.json``.
    scan_layers: stack the layers on a leading axis (``layers``) or keep them
      apart (``layers_{i}``); sets the config's ``scan_layers``.
    dtype: the compute dtype of the returned config (``None``: float32).
    param_dtype: the dtype the parameters are cast to (and the config's).

  Returns:
    The :class:`LlamaConfig` and the parameters of
    ``llama.LlamaLM(config)``.

  Raises:
    ValueError: a file is absent; the config is not representable; tensors
      are missing or unexpected (all listed); a tensor's shape is wrong.
  """
  changes = {'scan_layers': bool(scan_layers), 'param_dtype': param_dtype}
  if dtype is not None:
    changes['dtype'] = dtype
  config = config_from_hf(_read_json(folder, CONFIG_FILE, 'load_pretrained'), **changes)
  tensors = _read_checkpoint(folder)
  _drop_derived(tensors, config)
  _check_names(tensors, hf_tensor_shapes(config))
  return config, _to_flax(tensors, config)


def tokenizer_from_folder(folder: str):
  """The ``tokenizers.Tokenizer`` of ``folder/tokenizer.json``."""
  import tokenizers  # deferred: optional dependency tokenizers
  path = os.path.join(folder, TOKENIZER_FILE)
  if not os.path.isfile(path):
    raise ValueError(f'tokenizer_from_folder: {path!r} does not exist (a Hugging Face '
                     'tokenizer folder holds tokenizer.json).')
  return tokenizers.Tokenizer.from_file(path)


# ----------------------------------------------------------------------------- saving


def _check_params(config: LlamaConfig, params: Any) -> dict[tuple[str, ...], Any]:
  """Flattened ``params``, checked against the tree ``config`` implies."""
  scanned = 'layers' in params
  expected = traverse_util.flatten_dict(llama.param_shapes(config.replace(scan_layers=scanned)))
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  missing = ['/'.join(p) for p in expected if p not in flat]
  unexpected = sorted('/'.join(p) for p in flat if p not in expected)
  if missing or unexpected:
    hint = (' (adapters must be merged first: peft_adapters.merge_adapters)'
            if any('lora' in u for u in unexpected) else '')
    raise ValueError(f'save_pretrained: params do not match the config; missing: '
                     f'{", ".join(missing) or "none"}; unexpected: '
                     f'{", ".join(unexpected) or "none"}{hint}.')
  for path, leaf in expected.items():
    if tuple(flat[path].shape) != tuple(leaf.shape):
      raise ValueError(f'save_pretrained: parameter {"/".join(path)} has shape '
                       f'{list(flat[path].shape)}, expected {list(leaf.shape)}.')
  return flat


def _to_hf(flat: Mapping[tuple[str, ...], Any], np_dtype: np.dtype) -> dict[str, np.ndarray]:
  """Hugging Face tensors (name -> ``[out, in]`` array in ``np_dtype``) of flat params."""
  out = {}
  for path, value in flat.items():
    value = np.asarray(value)
    parts = list(value) if path[0] == 'layers' else [value]
    for name, part in zip(_leaf_names(path, value.shape), parts):
      out[name] = np.ascontiguousarray((part.T if path[-1] == 'kernel' else part)
                                       .astype(np_dtype))
  return out


def _ordered(names: list[str]) -> list[str]:
  """Checkpoint order: embedding, layers by index, final norm, head."""
  def key(name):
    match = re.match(r'model\.layers\.(\d+)\.', name)
    if match:
      return (1, int(match.group(1)), name)
    return (0 if 'embed_tokens' in name else 2 if name.startswith('model.') else 3, 0, name)
  return sorted(names, key=key)


def _shards(tensors: Mapping[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
  """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor stands alone)."""
  shards, current, size = [], [], 0
  for name in _ordered(list(tensors)):
    nbytes = tensors[name].nbytes
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += nbytes
  if current:
    shards.append(current)
  return shards


def _remove_old_checkpoint(folder: str) -> None:
  for name in os.listdir(folder):
    if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(name):
      os.remove(os.path.join(folder, name))


def save_pretrained(folder: str, config: LlamaConfig, params: Any, *,
                    max_shard_bytes: int | None = None, dtype: str | None = None) -> list[str]:
  """Writes ``params`` of ``llama.LlamaLM(config)`` as a Hugging Face ``LlamaForCausalLM`` folder.

  Args:
    folder: created if absent; an earlier checkpoint in it (``model.safetensors``,
      shards, index) is replaced.
    config: the model's config (scanned or not is read from ``params``).
    params: scanned (``layers``) or unscanned (``layers_{i}``) parameters
      without adapter leaves.
    max_shard_bytes: split the tensors into ``model-0000i-of-0000n.safetensors``
      of at most this many bytes each, with ``model.safetensors.index.json``
      (a single shard is written as ``model.safetensors``).
    dtype: the stored dtype (``'float32'``, ``'bfloat16'``, ``'float16'``);
      ``None`` keeps the config's ``param_dtype``.

  Returns:
    The names of the safetensors files written.
  """
  dtype = config.param_dtype if dtype is None else dtype
  if dtype not in _NP_DTYPES:
    raise ValueError(f'save_pretrained: dtype={dtype!r} is not one of '
                     f'{", ".join(map(repr, _NP_DTYPES))}.')
  if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int)
                                      or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1):
    raise ValueError(f'save_pretrained: max_shard_bytes={max_shard_bytes!r} must be a positive '
                     'integer or None.')
  tensors = _to_hf(_check_params(config, params), _NP_DTYPES[dtype])
  os.makedirs(folder, exist_ok=True)
  _remove_old_checkpoint(folder)
  with open(os.path.join(folder, CONFIG_FILE), 'w') as f:
    json.dump(to_hf_config(config, dtype), f, indent=2)
  groups = _shards(tensors, max_shard_bytes) if max_shard_bytes else [_ordered(list(tensors))]
  if len(groups) == 1:
    write_safetensors(os.path.join(folder, SINGLE_FILE), tensors)
    return [SINGLE_FILE]
  files = [f'model-{i + 1:05d}-of-{len(groups):05d}.safetensors' for i in range(len(groups))]
  for file, names in zip(files, groups):
    write_safetensors(os.path.join(folder, file), {n: tensors[n] for n in names})
  index = {'metadata': {'total_size': int(sum(t.nbytes for t in tensors.values()))},
           'weight_map': {n: file for file, names in zip(files, groups) for n in names}}
  with open(os.path.join(folder, INDEX_FILE), 'w') as f:
    json.dump(index, f, indent=2)
  return files
