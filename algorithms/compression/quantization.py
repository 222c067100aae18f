"""Lossy number formats for what clients send: quantize, then dequantize.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) sends outer
gradients in 4 bits and still matches full precision; this module simulates
such formats. ``quantize(x, fmt)`` returns the value the server receives,
``Q(x)``, in ``x``'s dtype, and the reduction then runs in full precision.

| format | bits | values |
|---|---|---|
| ``float32`` | 32 | ``x`` unchanged |
| ``bfloat16`` | 16 | ``x`` rounded to bfloat16 |
| ``int8`` | 8 | ``s round(x / s)``, ``s = max|x| / 127`` |
| ``int4`` | 4 | ``s round(x / s)``, ``s = max|x| / 7`` (levels -7..7) |
| ``e3m0`` | 4 | ``sign(x) s 2^-k``, ``s = max|x|``, ``k = 0..6``, or 0: a sign bit and 3 exponent bits, rounded to the nearest power of two in log scale; magnitudes below ``s 2^-6.5`` become 0 |

Scaled formats (``int8``, ``int4``, ``e3m0``) use one float32 scale per
tensor, counted in :func:`num_bytes`. Rounding is to nearest. The gradient
of ``quantize`` is the identity (straight-through), so rounds stay
differentiable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedjx.algorithms.base import PyTree

FORMATS = ('float32', 'bfloat16', 'int8', 'int4', 'e3m0')
BITS = {'float32': 32, 'bfloat16': 16, 'int8': 8, 'int4': 4, 'e3m0': 4}
_SCALED = ('int8', 'int4', 'e3m0')
_E3M0_MIN_EXPONENT = -6


def check_format(fn: str, name: str, fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f'{fn}: {name}={fmt!r} is not one of {FORMATS}.')


def _quantize_leaf(x: jax.Array, fmt: str) -> jax.Array:
  if fmt == 'float32':
    return x
  if fmt == 'bfloat16':
    return x.astype(jnp.bfloat16).astype(x.dtype)
  absmax = jnp.max(jnp.abs(x))
  safe = jnp.where(absmax > 0, absmax, 1.0)
  if fmt in ('int8', 'int4'):
    levels = 127.0 if fmt == 'int8' else 7.0
    s = safe / levels
    return (jnp.clip(jnp.round(x / s), -levels, levels) * s).astype(x.dtype)
  # e3m0: nearest power of two (in log2) among s 2^0 .. s 2^-6, else zero.
  r = jnp.abs(x) / safe
  k = jnp.round(jnp.log2(jnp.where(r > 0, r, 1.0)))
  mag = jnp.where(k < _E3M0_MIN_EXPONENT - 0.5, 0.0, jnp.exp2(jnp.clip(k, _E3M0_MIN_EXPONENT, 0)))
  mag = jnp.where(r > 0, mag, 0.0)
  return (jnp.sign(x) * mag * safe).astype(x.dtype)


def quantize(tree: PyTree, fmt: str) -> PyTree:
  """``Q(x)`` for every leaf (one scale per leaf); straight-through gradient."""
  check_format('quantize', 'fmt', fmt)

  def one(x):
    x = jnp.asarray(x)
    q = _quantize_leaf(x, fmt)
    return x + jax.lax.stop_gradient(q - x)

  return jax.tree.map(one, tree)


def num_bytes(tree: PyTree, fmt: str) -> int:
  """Bytes to send ``tree`` in ``fmt``: packed values plus per-tensor scales."""
  check_format('num_bytes', 'fmt', fmt)
  total = 0
  for x in jax.tree.leaves(tree):
    total += math.ceil(math.prod(jnp.shape(x)) * BITS[fmt] / 8)
    total += 4 if fmt in _SCALED else 0
  return total
