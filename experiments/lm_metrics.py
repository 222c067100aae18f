"""Throughput and model-FLOPs utilization of a language model's training rounds.

For a run of :func:`fedjx.models.llama.llama_lm`, every round's row gets

    round_tokens = examples T                 (sequences trained x tokens each)
    tokens_per_s = round_tokens / round_s
    mfu          = C tokens_per_s / (n peak)

``examples`` is the round's own count of training sequences (over all
clients and inner steps), ``T`` the sequence length, ``round_s`` the wall
seconds from dispatching the round to its metrics on the host (the round
that compiles gets none), ``C`` the training FLOPs per token of
:func:`fedjx.models.llama_config.train_flops_per_token` (``6 N_matmul + 12 L
H h T``, PaLM's convention: Chowdhery et al. 2022, arXiv 2204.02311,
Appendix B), ``n`` the devices and ``peak`` one device's peak FLOP/s:

* a GPU or TPU named in :data:`fedjx.experiments.lm_cost.PEAK_BF16_FLOPS`:
  the vendor's dense bfloat16 peak;
* a CPU: measured once per process by :func:`measure_matmul_flops` (the best
  of a few ``float32`` ``[1024, 1024] x [1024, 1024]`` products, ``2 n^3``
  FLOPs each, after a warm-up), with ``n = 1``: XLA's host devices share the
  machine's cores, so the machine is one device whatever the number of host
  devices it is split into;
* any other device: no ``mfu``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp

from fedjx.experiments import lm_cost
from fedjx.models import llama_config

MATMUL_SIZE = 1024

_DEVICE_KINDS = (  # (substring of jax's device_kind, lower-cased; lm_cost key)
    ('h200', 'h200'), ('h100', 'h100'), ('a100-sxm4-40gb', 'a100-40gb'),
    ('a100-pcie-40gb', 'a100-40gb'), ('a100', 'a100-80gb'), ('v6 lite', 'tpu-v6e'),
    ('v6e', 'tpu-v6e'), ('v5 lite', 'tpu-v5e'), ('v5e', 'tpu-v5e'), ('v5p', 'tpu-v5p'),
    ('tpu v5', 'tpu-v5p'), ('tpu v4', 'tpu-v4'),
)


def device_key(device_kind: str) -> str | None:
  """The :data:`fedjx.experiments.lm_cost.PEAK_BF16_FLOPS` key of a device kind."""
  kind = device_kind.lower()
  for part, key in _DEVICE_KINDS:
    if part in kind:
      return key
  return None


def measure_matmul_flops(size: int = MATMUL_SIZE, repeats: int = 5) -> float:
  """FLOP/s of the fastest of ``repeats`` float32 ``[size, size]`` products (``2 size^3``)."""
  for name, value in (('size', size), ('repeats', repeats)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'measure_matmul_flops: {name}={value!r} must be a positive integer.')
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.random.normal(key_a, (size, size), jnp.float32)
  b = jax.random.normal(key_b, (size, size), jnp.float32)
  product = jax.jit(jnp.matmul)
  product(a, b).block_until_ready()  # Compiles.
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    product(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 / best


@functools.cache
def _measured_cpu_peak() -> float:
  return measure_matmul_flops()


def peak_flops(device: Any | None = None) -> tuple[float | None, int]:
  """``(peak FLOP/s of one device, devices)`` for MFU (module docstring);
  ``(None, n)`` for a device with no figure."""
  device = jax.devices()[0] if device is None else device
  if device.platform == 'cpu':
    return _measured_cpu_peak(), 1
  key = device_key(device.device_kind)
  return (None if key is None else lm_cost.PEAK_BF16_FLOPS[key]), jax.device_count()


def llama_shape(model: Any) -> llama_config.LlamaConfig | None:
  """The :class:`~fedjx.models.llama_config.LlamaConfig` of a ``llama_lm`` model, else None."""
  config = getattr(getattr(model, 'module', None), 'config', None)
  return config if isinstance(config, llama_config.LlamaConfig) else None


class Throughput:
  """The throughput columns of a language model's rounds (module docstring)."""

  def __init__(self, shape: llama_config.LlamaConfig, seq_len: int):
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
      raise ValueError(f'Throughput: seq_len={seq_len!r} must be a positive integer.')
    self.seq_len = seq_len
    self.flops_per_token = llama_config.train_flops_per_token(shape, seq_len)
    self._peak: tuple[float | None, int] | None = None

  def row(self, examples: float, round_s: float) -> dict[str, float]:
    """``round_tokens``, ``round_s``, ``tokens_per_s`` and (with a peak) ``mfu``."""
    if not round_s > 0:
      return {}
    if self._peak is None:
      self._peak = peak_flops()
    tokens = float(examples) * self.seq_len
    out = {'round_tokens': tokens, 'round_s': round_s, 'tokens_per_s': tokens / round_s}
    peak, devices = self._peak
    if peak:
      out['mfu'] = self.flops_per_token * out['tokens_per_s'] / (devices * peak)
    return out


def throughput(model: Any, seq_len: int | None) -> Throughput | None:
  """A :class:`Throughput` for a ``llama_lm`` model of known sequence length, else None."""
  shape = llama_shape(model)
  if shape is None or not seq_len:
    return None
  return Throughput(shape, int(seq_len))


__all__ = ['MATMUL_SIZE', 'Throughput', 'device_key', 'llama_shape', 'measure_matmul_flops',
           'peak_flops', 'throughput']
