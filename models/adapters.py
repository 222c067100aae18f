"""Adapter trees: LoRA factors inside a parameter tree, split from and joined to the rest.

qwix keeps the adapters of an adapted kernel ``.../q_proj/kernel`` beside it,
as ``kernel_lora_a [L?, n_in, r]`` and ``kernel_lora_b [L?, r, n_out]``; FLoRA's
merged deltas ``M [L?, n_in, n_out]`` are kept the same way, as
``kernel_lora_merged``. These functions move between that nested layout and
the flat *pairs* ``{'layers/self_attn/q_proj/kernel': {'a': a, 'b': b}}`` of
:mod:`fedjx.algorithms.aggregators.lora`, split a tree into what is trained
and what is frozen. They need nothing but jax
(:func:`fedjx.models.peft_adapters.merge_adapters` merges ``W + s a b``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

A_SUFFIX = '_lora_a'
B_SUFFIX = '_lora_b'
M_SUFFIX = '_lora_merged'

Params = Any


def is_adapter(path: tuple[str, ...]) -> bool:
  """Whether the parameter at ``path`` (dict keys) is an adapter ``a`` or ``b``."""
  return path[-1].endswith(A_SUFFIX) or path[-1].endswith(B_SUFFIX)


def _keys(path) -> tuple[str, ...]:
  return tuple(getattr(k, 'key', getattr(k, 'name', str(k))) for k in path)


def path_name(path) -> str:
  """``'layers/self_attn/q_proj/kernel'`` of a ``jax.tree_util`` key path."""
  return '/'.join(_keys(path))


def partition(params: Params, keep, prefix: tuple[str, ...] = ()) -> tuple[dict, dict]:
  """``params`` (nested dicts) into the leaves where ``keep(path)`` and the rest."""
  kept, rest = {}, {}
  for key, value in params.items():
    path = prefix + (key,)
    if isinstance(value, Mapping):
      k, r = partition(value, keep, path)
      if k:
        kept[key] = k
      if r:
        rest[key] = r
    elif keep(path):
      kept[key] = value
    else:
      rest[key] = value
  return kept, rest


def split(params: Params, train_a: bool = True) -> tuple[dict, dict]:
  """``(trainable, frozen)``: the adapters (only the ``b`` when not ``train_a``) and the rest."""
  if train_a:
    return partition(params, is_adapter)
  return partition(params, lambda path: path[-1].endswith(B_SUFFIX))


def join(frozen: Params, trainable: Params) -> dict:
  """The full parameter tree: ``frozen`` and ``trainable`` merged (disjoint leaves)."""
  out = dict(frozen)
  for key, value in trainable.items():
    if key in out and isinstance(value, Mapping):
      out[key] = join(out[key], value)
    elif key in out:
      raise ValueError(f'join: the parameter {key!r} is both frozen and trainable.')
    else:
      out[key] = value
  return out


def adapter_pairs(params: Params) -> dict[str, dict[str, jax.Array]]:
  """``{'layers/self_attn/q_proj/kernel': {'a': a, 'b': b}, ...}`` of a tree with adapters."""
  pairs: dict[str, dict[str, jax.Array]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = _keys(path)
    for suffix, part in ((A_SUFFIX, 'a'), (B_SUFFIX, 'b')):
      if keys[-1].endswith(suffix):
        name = '/'.join(keys[:-1] + (keys[-1][:-len(suffix)],))
        pairs.setdefault(name, {})[part] = leaf
  return pairs


def from_pairs(pairs: Mapping[str, Mapping[str, jax.Array]], parts: str = 'ab') -> dict:
  """The inverse of :func:`adapter_pairs` (``parts='b'``: only the ``b`` leaves)."""
  out: dict = {}
  for name, pair in pairs.items():
    *modules, kernel = name.split('/')
    node = out
    for m in modules:
      node = node.setdefault(m, {})
    for part in parts:
      node[kernel + (A_SUFFIX if part == 'a' else B_SUFFIX)] = pair[part]
  return out


def split_merged(params: Params) -> tuple[dict, dict]:
  """``(rest, merged)``: the merged-delta leaves (``*_lora_merged``) out of ``params``."""
  merged, rest = partition(params, lambda path: path[-1].endswith(M_SUFFIX))
  return rest, merged


def merged_tree(deltas: Mapping[str, jax.Array]) -> dict:
  """``{'layers/.../kernel': M}`` as a params tree of ``kernel_lora_merged`` leaves."""
  out: dict = {}
  for name, delta in deltas.items():
    *modules, kernel = name.split('/')
    node = out
    for m in modules:
      node = node.setdefault(m, {})
    node[kernel + M_SUFFIX] = delta
  return out


def merged_pairs(merged: Params) -> dict[str, jax.Array]:
  """The inverse of :func:`merged_tree`."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(merged)[0]:
    keys = _keys(path)
    if keys[-1].endswith(M_SUFFIX):
      out['/'.join(keys[:-1] + (keys[-1][:-len(M_SUFFIX)],))] = leaf
  return out


def adapter_bytes(adapters: Params) -> int:
  """Bytes of the adapter tree (what one client sends per round, uncompressed)."""
  return int(sum(np.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(adapters)))
