"""What a reduction computes, for every executor that computes one.

A reduction of placed values ``x_i`` (weights ``w_i``) over ``n`` members is

* ``'sum'``:           ``sum_i x_i``
* ``'mean'``:          ``(1 / n) sum_i x_i``
* ``'weighted_mean'``: ``sum_i w_i x_i / sum_i w_i``, and ``0`` when
  ``sum_i w_i = 0`` (the zero-weight rule: a round whose clients all carry
  zero weight aggregates to zeros, never NaN).

Result dtypes follow ``jnp.sum``, ``jnp.mean`` and ``jnp.average`` under the
current ``jax_enable_x64`` (:func:`result_dtype`).

Four executors compute these, and differ only in how they accumulate:

| executor | where | accumulates in |
|---|---|---|
| compiled (``fedjx.primitives``) | one XLA reduction (on CPU a dot with ones or weights) | the result dtype, float32 products for narrower floats |
| fused chunks (``fedjx.fusion``) | XLA within a chunk, a carry across chunks | :func:`carry_dtype` (float32 or wider) |
| streaming (``fedjx.streaming``) | as fused, the carry compensated (:func:`compensated_add`) | :func:`carry_dtype` plus its compensation |
| host (``plan.evaluate``, Beam, export) | NumPy, client by client | :func:`host_accumulator_dtype` (64 bits) |

Each is a sum of the same ``n`` terms in some order, so (Higham, "Accuracy
and Stability of Numerical Algorithms", 2nd ed., eq. 4.4) each differs from
the exact sum by at most ``gamma_n sum_i |w_i x_i|`` in its accumulator's
unit roundoff ``u`` (``gamma_n = n u / (1 - n u)``), and two executors'
results by at most the sum of their two bounds plus one rounding to the
result dtype each. For float32 values: ``2 gamma_n sum_i |w_i x_i|`` between
any two of them (the host's float64 term is negligible), divided by
``|sum_i w_i|`` for the weighted mean.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ('sum', 'mean', 'weighted_mean')


# ---------------------------------------------------------------- dtypes

def _jnp_dtype(reduction, *dtypes) -> jnp.dtype:
  """The dtype ``reduction`` (a ``jnp`` function over axis 0) gives ``dtypes``.

  Asked of ``jnp`` itself (under the current ``jax_enable_x64`` setting), so
  that the primitives follow NumPy-style promotion exactly as ``jnp.sum``,
  ``jnp.mean`` and ``jnp.average`` do.
  """
  x64 = jax.dtypes.canonicalize_dtype(jnp.int64) == jnp.int64
  return _jnp_dtype_cached(reduction, tuple(jnp.dtype(d) for d in dtypes), x64)


@functools.lru_cache(maxsize=None)
def _jnp_dtype_cached(reduction, dtypes, x64):
  del x64  # Part of the cache key only.
  specs = [jax.ShapeDtypeStruct((1,), d) for d in dtypes]
  return jnp.dtype(jax.eval_shape(reduction, *specs).dtype)


def _sum0(x):
  return jnp.sum(x, axis=0)


def _mean0(x):
  return jnp.mean(x, axis=0)


def _average0(x, w):
  return jnp.average(x, axis=0, weights=w)


def sum_dtype(dtype) -> jnp.dtype:
  """The dtype of ``reduce_sum``: ``jnp.sum``'s (booleans count as ints, small
  ints widen to the default int)."""
  return _jnp_dtype(_sum0, dtype)


def mean_dtype(dtype) -> jnp.dtype:
  """The dtype of ``reduce_mean``: ``jnp.mean``'s (a mean of ints is a float)."""
  return _jnp_dtype(_mean0, dtype)


def weighted_mean_dtype(x_dtype, w_dtype) -> jnp.dtype:
  """The dtype of ``reduce_weighted_mean``: ``jnp.average``'s, the promoted
  dtype of values and weights, made inexact."""
  return _jnp_dtype(_average0, x_dtype, w_dtype)


def result_dtype(kind: str, x_dtype, w_dtype=None) -> jnp.dtype:
  """The dtype of reduction ``kind`` of values ``x_dtype`` (weights ``w_dtype``)."""
  if kind == 'sum':
    return sum_dtype(x_dtype)
  if kind == 'mean':
    return mean_dtype(x_dtype)
  if kind == 'weighted_mean':
    return weighted_mean_dtype(x_dtype, w_dtype)
  raise ValueError(f'fedjx.reductions: kind={kind!r} is not one of {KINDS}.')


def carry_dtype(dtype) -> jnp.dtype:
  """A device accumulator: float32 for narrower floats, else ``dtype``."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.promote_types(dtype, jnp.float32)
  return dtype


def host_accumulator_dtype(dtype) -> np.dtype:
  """A host (NumPy) accumulator: the 64-bit type of ``dtype``'s kind."""
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.complexfloating):
    return np.dtype(np.complex128)
  if np.issubdtype(dtype, np.floating):
    return np.dtype(np.float64)
  if np.issubdtype(dtype, np.bool_):
    return np.dtype(np.int64)
  return np.dtype(np.int64) if np.issubdtype(dtype, np.signedinteger) else np.dtype(np.uint64)


# ------------------------------------------------------------ arithmetic

def expand_weights(w, x):
  """Weights of shape ``x.shape[:w.ndim]``, broadcast against ``x``."""
  return w.reshape(w.shape + (1,) * (x.ndim - w.ndim))


def inverse_total(total, xp: Any = jnp):
  """``1 / total``, or 0 where ``total`` is 0 (the zero-weight rule)."""
  nonzero = total != 0
  return xp.where(nonzero, 1 / xp.where(nonzero, total, xp.ones_like(total)),
                  xp.zeros_like(total))


def finish(kind: str, total, weight_total, count: int, dtype, xp: Any = jnp):
  """A reduction's value from its accumulated ``total`` (``sum_i w_i x_i``,
  or ``sum_i x_i``), ``weight_total`` (``sum_i w_i``) and member ``count``."""
  if kind == 'sum':
    return total.astype(dtype)
  if kind == 'mean':
    return (total / count).astype(dtype)
  inverse = inverse_total(xp.asarray(weight_total), xp)
  return (total * expand_weights(inverse, total)).astype(dtype)


def compensated_add(state: tuple[Any, Any], x) -> tuple[Any, Any]:
  """Adds ``x`` to the compensated sum ``state = (s, c)`` (Neumaier 1974).

  The value of the sum is ``s + c``; its error no longer grows with the
  number of additions (integer sums are exact and carry no compensation).
  """
  s, c = state
  if not jnp.issubdtype(s.dtype, jnp.inexact):
    return s + x, c
  t = s + x
  big = jnp.abs(s) >= jnp.abs(x)
  c = c + jnp.where(big, (s - t) + x, (x - t) + s)
  return t, c
