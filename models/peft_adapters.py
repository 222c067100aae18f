"""LoRA adapters of the Llama model exported to and read from Hugging Face PEFT's format.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv 2106.09685) adds to a frozen weight a product of rank ``r`` scaled by
``alpha / r``. The qwix library (``qwix.apply_lora_to_model``) keeps, next to
a Flax ``kernel K [in, out]``, ``kernel_lora_a a [in, r]`` and
``kernel_lora_b b [r, out]`` (each with a leading layer axis when the layers
are scanned) and computes::

  y = x K + (alpha / r) (x a) b = x (K + (alpha / r) a b)

PEFT (Mangrulkar et al. 2022, "PEFT: State-of-the-art Parameter-Efficient
Fine-Tuning methods") keeps, next to a PyTorch ``weight W [out, in]`` (``W =
K^T``), ``lora_A.weight A [r, in]`` and ``lora_B.weight B [out, r]`` and
computes ``y = W x + (alpha / r) B A x``. Both are the same map when::

  A = a^T,   B = b^T,   since (alpha / r) B A = ((alpha / r) a b)^T

The adapter of ``model.layers.{i}.self_attn.q_proj`` is stored as
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (and
``lora_B``), with ``adapter_config.json`` giving ``r``, ``lora_alpha`` and the
``target_modules``. :func:`merge_adapters` folds the adapters into the base
weights, ``K' = K + (alpha / r) a b``, for
:func:`fedjx.models.hf_checkpoint.save_pretrained`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import flax
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from fedjx.models import hf_checkpoint

__all__ = ['export_peft', 'load_peft', 'merge_adapters', 'peft_config']

CONFIG_FILE = 'adapter_config.json'
WEIGHTS_FILE = 'adapter_model.safetensors'
PREFIX = 'base_model.model.'
LORA_A, LORA_B = 'kernel_lora_a', 'kernel_lora_b'


def _adapters(params: Any) -> dict[tuple[str, ...], tuple[Any, Any]]:
  """Module path -> ``(a, b)`` for every module with LoRA leaves."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  out = {}
  for path, a in flat.items():
    if path[-1].endswith(('_lora_a', '_lora_b')) and path[-1] not in (LORA_A, LORA_B):
      raise ValueError(f'peft_adapters: the adapter {"/".join(path)} is not on a linear '
                       "layer's kernel; only kernel_lora_a/kernel_lora_b are supported.")
    if path[-1] == LORA_A:
      b = flat.get(path[:-1] + (LORA_B,))
      if b is None:
        raise ValueError(f'peft_adapters: {"/".join(path)} has no {LORA_B} beside it.')
      out[path[:-1]] = (a, b)
  return out


def _check_rank(caller: str, path: tuple[str, ...], a: Any, b: Any, rank: int) -> None:
  if a.shape[-1] != rank or b.shape[-2] != rank:
    raise ValueError(f'{caller}: the adapter of {"/".join(path)} has rank {a.shape[-1]} '
                     f'(a {list(a.shape)}, b {list(b.shape)}), but rank={rank}.')


def _peft_names(module_path: tuple[str, ...], shape: tuple[int, ...]) -> list[str]:
  """PEFT module names of one adapted Flax module (one per layer when scanned)."""
  if module_path[0] == 'layers':
    return [PREFIX + hf_checkpoint.hf_module_name(module_path, i) for i in range(shape[0])]
  return [PREFIX + hf_checkpoint.hf_module_name(module_path)]


def _check_targets(modules: Sequence[tuple[str, ...]], target_modules: Sequence[str]) -> None:
  adapted = {m[-1] for m in modules}
  targets = set(target_modules)
  if adapted != targets:
    raise ValueError(f'export_peft: target_modules={sorted(targets)} but the params adapt '
                     f'{sorted(adapted)}; they must be the same modules.')


def export_peft(folder: str, params_with_lora: Any, *, rank: int, alpha: float,
                target_modules: Sequence[str], base_model_name_or_path: str = '',
                dropout: float = 0.0) -> dict[str, tuple[int, ...]]:
  """Writes the LoRA adapters of ``params_with_lora`` as a PEFT adapter folder.

  Args:
    folder: receives ``adapter_config.json`` and ``adapter_model.safetensors``
      (created if absent).
    params_with_lora: parameters of a qwix-LoRA Llama model (scanned or not).
    rank: the LoRA rank ``r`` of every adapter.
    alpha: the LoRA ``alpha`` (the update is scaled by ``alpha / r``).
    target_modules: the adapted modules' short names (``'q_proj'``,
      ``'v_proj'``, ...); must be exactly those that carry adapters.
    base_model_name_or_path: recorded in the config for PEFT's loader.
    dropout: recorded as ``lora_dropout``.

  Returns:
    The tensors written, name -> shape.
  """
  if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
    raise ValueError(f'export_peft: rank={rank!r} must be a positive integer.')
  if isinstance(target_modules, str):
    target_modules = [target_modules]
  adapters = _adapters(params_with_lora)
  if not adapters:
    raise ValueError('export_peft: params_with_lora has no kernel_lora_a/kernel_lora_b leaves.')
  _check_targets(list(adapters), target_modules)
  tensors = {}
  for path, (a, b) in adapters.items():
    _check_rank('export_peft', path, a, b, rank)
    a, b = np.asarray(a), np.asarray(b)
    per_layer = zip(a, b) if path[0] == 'layers' else [(a, b)]
    for name, (a_i, b_i) in zip(_peft_names(path, a.shape), per_layer):
      tensors[f'{name}.lora_A.weight'] = np.ascontiguousarray(a_i.T)
      tensors[f'{name}.lora_B.weight'] = np.ascontiguousarray(b_i.T)
  os.makedirs(folder, exist_ok=True)
  hf_checkpoint.write_safetensors(os.path.join(folder, WEIGHTS_FILE), tensors)
  with open(os.path.join(folder, CONFIG_FILE), 'w') as f:
    json.dump(peft_config(rank=rank, alpha=alpha, target_modules=target_modules,
                          base_model_name_or_path=base_model_name_or_path,
                          dropout=dropout), f, indent=2)
  return {k: tuple(v.shape) for k, v in tensors.items()}


def peft_config(*, rank: int, alpha: float, target_modules: Sequence[str],
                base_model_name_or_path: str = '', dropout: float = 0.0) -> dict[str, Any]:
  """The ``adapter_config.json`` dict of a LoRA adapter for a causal language model."""
  return {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': int(rank),
      'lora_alpha': float(alpha), 'lora_dropout': float(dropout),
      'target_modules': sorted(set(target_modules)), 'bias': 'none',
      'fan_in_fan_out': False, 'inference_mode': True, 'use_rslora': False,
      'use_dora': False, 'modules_to_save': None,
      'base_model_name_or_path': base_model_name_or_path,
  }


def _read_config(folder: str) -> dict[str, Any]:
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ValueError(f'load_peft: {path!r} does not exist.')
  with open(path) as f:
    config = json.load(f)
  for key, allowed in (('peft_type', 'LORA'), ('use_rslora', False), ('use_dora', False),
                       ('fan_in_fan_out', False), ('bias', 'none')):
    if config.get(key, allowed) != allowed:
      raise ValueError(f'load_peft: {CONFIG_FILE} has {key}={config[key]!r}; only '
                       f'{allowed!r} is supported.')
  return config


def _check_names(tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]]) -> None:
  missing = [n for n in expected if n not in tensors]
  unexpected = sorted(n for n in tensors if n not in expected)
  if missing or unexpected:
    raise ValueError(f'load_peft: {WEIGHTS_FILE} does not match params_template; missing: '
                     f'{", ".join(missing) or "none"}; unexpected: '
                     f'{", ".join(unexpected) or "none"}.')
  for name, shape in expected.items():
    if tuple(tensors[name].shape) != tuple(shape):
      raise ValueError(f'load_peft: tensor {name} has shape {list(tensors[name].shape)}, '
                       f'expected {list(shape)}.')


def load_peft(folder: str, params_template: Any) -> Any:
  """``params_template`` with its LoRA leaves read from a PEFT adapter folder.

  ``params_template`` is a qwix-LoRA Llama parameter tree (scanned or not);
  its base weights are returned as they are, its ``kernel_lora_a`` and
  ``kernel_lora_b`` replaced by the file's ``lora_A^T`` and ``lora_B^T``
  (stacked over layers when scanned) in the template's dtypes.

  Raises:
    ValueError: a file is absent; the config's ``r`` differs from the
      template's rank; tensors are missing, unexpected or of the wrong shape.
  """
  config = _read_config(folder)
  adapters = _adapters(params_template)
  if not adapters:
    raise ValueError('load_peft: params_template has no kernel_lora_a/kernel_lora_b leaves.')
  for path, (a, b) in adapters.items():
    _check_rank('load_peft', path, a, b, config.get('r'))
  path = os.path.join(folder, WEIGHTS_FILE)
  if not os.path.isfile(path):
    raise ValueError(f'load_peft: {path!r} does not exist.')
  tensors = hf_checkpoint.read_safetensors(path)
  expected = {}
  for module, (a, b) in adapters.items():
    for name in _peft_names(module, a.shape):
      expected[f'{name}.lora_A.weight'] = tuple(a.shape[-2:])[::-1]
      expected[f'{name}.lora_B.weight'] = tuple(b.shape[-2:])[::-1]
  _check_names(tensors, expected)
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params_template))
  for module, (a, b) in adapters.items():
    names = _peft_names(module, a.shape)
    for leaf, suffix, like in ((LORA_A, 'lora_A', a), (LORA_B, 'lora_B', b)):
      parts = [tensors[f'{n}.{suffix}.weight'].T for n in names]
      value = np.stack(parts) if module[0] == 'layers' else parts[0]
      flat[module + (leaf,)] = jnp.asarray(value, dtype=like.dtype)
  return traverse_util.unflatten_dict(flat)


def merge_adapters(params_with_lora: Any, alpha: float, rank: int) -> Any:
  """Base parameters with ``kernel + (alpha / rank) a b`` and no adapter leaves.

  The product is computed in float32 (batched over the layer axis when
  scanned) and cast back to the kernel's dtype.
  """
  if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
    raise ValueError(f'merge_adapters: rank={rank!r} must be a positive integer.')
  adapters = _adapters(params_with_lora)
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params_with_lora))
  for module, (a, b) in adapters.items():
    _check_rank('merge_adapters', module, a, b, rank)
    kernel = flat[module + ('kernel',)]
    delta = jnp.matmul(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    merged = jnp.asarray(kernel, jnp.float32) + (alpha / rank) * delta
    flat[module + ('kernel',)] = merged.astype(kernel.dtype)
    del flat[module + (LORA_A,)], flat[module + (LORA_B,)]
  return traverse_util.unflatten_dict(flat)
