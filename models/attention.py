"""Causal grouped-query attention through the backend's fused kernel.

For queries ``q [B, T, H, h]`` and keys and values ``k, v [B, T, K, h]``
(``H`` a multiple of ``K``; query head ``j`` reads key/value head
``floor(j K / H)``)::

  out[b, s, j] = sum_{t <= s} softmax_t(q[b, s, j] . k[b, t, g] / sqrt(h)) v[b, t, g]

One function, :func:`causal_attention`, computes it with one of
:data:`IMPLEMENTATIONS`:

* ``'xla'``: ``jax.nn.dot_product_attention`` lowered by XLA, which builds the
  ``[B, H, T, T]`` score matrix (float32 softmax).
* ``'splash'``: the Pallas TPU "splash" kernel shipped with JAX
  (``jax.experimental.pallas.ops.tpu.splash_attention``), a flash-attention
  kernel (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact
  Attention with IO-Awareness", arXiv 2205.14135) that skips the blocks the
  causal mask removes. Grouped-query attention is its multi-query form run
  once per key/value head: the ``H / K`` query heads of a group share one
  key/value head, with no copy of ``k`` and ``v``. The score matrix is never
  stored: memory is ``O(T)`` per head, not ``O(T^2)``.
* ``'flash'``: the Pallas TPU flash-attention kernel shipped with JAX
  (``jax.experimental.pallas.ops.tpu.flash_attention``); it has no
  grouped-query form, so ``k`` and ``v`` are repeated to ``H`` heads.
* ``'cudnn'``: ``jax.nn.dot_product_attention(implementation='cudnn')``,
  cuDNN's fused kernel on NVIDIA GPUs (bfloat16 or float16 inputs).
* ``'auto'``: :func:`resolve` picks from the backend: ``'splash'`` on a TPU
  when the sequence length is a multiple of 128 (the kernel's tile), ``'cudnn'``
  on a GPU for bfloat16/float16 inputs, ``'xla'`` otherwise.

The Pallas kernels run on other backends in Pallas' interpret mode (slow,
exact): that is how the tests check them on a CPU against ``'xla'`` and a
float64 reference. Under a mesh with ``fsdp`` or ``tensor`` axes (or a
``clients`` axis) the kernels run inside ``jax.shard_map``: each device
attends over its own sequences (``fsdp``, ``clients``) and heads
(``tensor``), since XLA cannot partition a custom kernel by itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import flash_attention as flash
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from fedjx import sharding

IMPLEMENTATIONS = ('auto', 'xla', 'splash', 'flash', 'cudnn')
"""The ways :func:`causal_attention` can compute (module docstring)."""

TILE = 128
"""The Pallas kernels' tile along the sequence: their ``T`` must be a multiple."""

DEFAULT_BLOCK = 512
"""The Pallas kernels' query and key blocks (``min(DEFAULT_BLOCK, T)``)."""


def check_implementation(fn: str, implementation: str) -> None:
  """Refuses an ``implementation`` that is not one of :data:`IMPLEMENTATIONS`."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'{fn}: attention={implementation!r} is not one of '
                     f'{", ".join(map(repr, IMPLEMENTATIONS))}.')


def resolve(implementation: str, seq_len: int, dtype, backend: str | None = None) -> str:
  """The implementation ``'auto'`` stands for on ``backend`` (default: JAX's).

  ``'splash'`` on a TPU for ``seq_len`` a multiple of :data:`TILE`;
  ``'cudnn'`` on a GPU for bfloat16 or float16; ``'xla'`` otherwise. A name
  other than ``'auto'`` is returned as it is.
  """
  check_implementation('causal_attention', implementation)
  if implementation != 'auto':
    return implementation
  backend = backend or jax.default_backend()
  if backend == 'tpu' and seq_len % TILE == 0:
    return 'splash'
  if backend in ('gpu', 'cuda', 'rocm') and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return 'cudnn'
  return 'xla'


def _block(seq_len: int, block: int | None) -> int:
  block = min(DEFAULT_BLOCK if block is None else block, seq_len)
  if seq_len % block or block % TILE:
    raise ValueError(f'causal_attention: block={block} must be a multiple of {TILE} '
                     f'that divides the sequence length {seq_len}.')
  return block


def _splash_kernel(seq_len: int, group: int, block: int, interpret: bool):
  """The multi-query splash kernel for ``group`` query heads over one key/value head.

  Made afresh in each trace: its block tables are arrays of that trace.
  """
  mask = splash.MultiHeadMask([splash.CausalMask((seq_len, seq_len))] * group)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block,
                            block_kv_dkv_compute=block, block_q_dq=block,
                            block_kv_dq=block)
  return splash.make_splash_mqa_single_device(mask=mask, block_sizes=sizes,
                                              interpret=interpret)


def _splash(q, k, v, block, interpret):
  """``q [B, T, H, h]``, ``k, v [B, T, K, h]`` through the multi-query kernel per group."""
  batch, seq_len, heads, width = q.shape
  groups = k.shape[2]
  kernel = _splash_kernel(seq_len, heads // groups, block, interpret)
  # [B, K, H/K, T, h]: the query heads of each key/value head together.
  qg = (q * (width ** -0.5)).astype(q.dtype)
  qg = qg.reshape(batch, seq_len, groups, heads // groups, width).transpose(0, 2, 3, 1, 4)
  kg = k.transpose(0, 2, 1, 3)  # [B, K, T, h]
  vg = v.transpose(0, 2, 1, 3)
  out = jax.vmap(jax.vmap(kernel))(qg, kg, vg)  # [B, K, H/K, T, h]
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq_len, heads, width)


def _flash(q, k, v, block, interpret):
  """``q [B, T, H, h]``, ``k, v [B, T, K, h]`` through the flash kernel, ``k, v`` repeated."""
  del interpret  # The flash kernel has no interpret mode of its own.
  heads, width = q.shape[2], q.shape[3]
  repeat = heads // k.shape[2]
  qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  if repeat > 1:
    kh = jnp.repeat(kh, repeat, axis=1)
    vh = jnp.repeat(vh, repeat, axis=1)
  sizes = flash.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                           block_q_major_dkv=block, block_k_major_dkv=block,
                           block_k_dkv=block, block_q_dkv=block, block_k_major_dq=block,
                           block_k_dq=block, block_q_dq=block)
  out = flash.flash_attention(qh, kh, vh, causal=True, sm_scale=width ** -0.5,
                              block_sizes=sizes)
  return out.transpose(0, 2, 1, 3)


def _sharded(kernel, q, k, v):
  """Runs ``kernel`` per device under the active mesh's batch and head axes."""
  mesh = sharding.active_mesh()
  if mesh is None:
    return kernel(q, k, v)
  sizes = dict(mesh.shape)
  batch_axes = tuple(a for a in ('clients', 'fsdp') if sizes.get(a, 1) > 1)
  divides = int(np.prod([sizes[a] for a in batch_axes])) if batch_axes else 1
  tensor = sizes.get('tensor', 1)
  if batch_axes and q.shape[0] % divides:
    batch_axes = tuple(a for a in batch_axes if q.shape[0] % sizes[a] == 0)[:1]
  heads = 'tensor' if tensor > 1 and k.shape[2] % tensor == 0 else None
  if not batch_axes and heads is None:
    return kernel(q, k, v)
  spec = P(batch_axes or None, None, heads, None)
  return jax.shard_map(kernel, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       check_vma=False)(q, k, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     implementation: str = 'auto', block: int | None = None) -> jax.Array:
  """Causal grouped-query attention, ``[B, T, H, h]`` out (module docstring).

  Args:
    q: queries ``[B, T, H, h]``.
    k, v: keys and values ``[B, T, K, h]``, ``K`` dividing ``H``.
    implementation: one of :data:`IMPLEMENTATIONS`.
    block: the Pallas kernels' query/key block (a multiple of 128 dividing
      ``T``; default ``min(512, T)``).
  """
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[:2] != k.shape[:2] or \
      q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
    raise ValueError(f'causal_attention: q {q.shape} must be [B, T, H, h] and k, v '
                     f'{k.shape}, {v.shape} [B, T, K, h] with K dividing H.')
  implementation = resolve(implementation, q.shape[1], q.dtype)
  if implementation in ('xla', 'cudnn'):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=implementation)
  seq_len = q.shape[1]
  if seq_len % TILE:
    raise ValueError(f'causal_attention: attention={implementation!r} needs a sequence '
                     f'length that is a multiple of {TILE}; got {seq_len} (use '
                     "attention='xla').")
  interpret = jax.default_backend() != 'tpu'
  block = _block(seq_len, block)
  fn = _splash if implementation == 'splash' else _flash
  if interpret and implementation == 'flash':
    raise ValueError("causal_attention: attention='flash' runs on a TPU only; "
                     "attention='splash' runs elsewhere in Pallas' interpret mode.")
  return _sharded(functools.partial(fn, block=block, interpret=interpret), q, k, v)
