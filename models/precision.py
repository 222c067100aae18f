"""Mixed precision: compute in bfloat16, keep float32 master weights.

``mixed_precision(loss_fn)`` casts the parameters and the floating-point
inputs of a batch to ``compute_dtype`` before calling ``loss_fn`` and returns
float32 losses. Gradients flow back through the casts, so they arrive in the
parameters' own dtype (float32): optimizers, client updates and aggregation
stay in float32 while the model's matrix products run in bfloat16
(Micikevicius et al. 2018, "Mixed Precision Training", without loss scaling,
which bfloat16's float32 exponent range makes unnecessary).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp


def _cast_floats(tree: Any, dtype) -> Any:
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x,
      tree)


def mixed_precision(fn: Callable[[Any, Mapping[str, jax.Array]], Any],
                    compute_dtype=jnp.bfloat16,
                    output_dtype=jnp.float32) -> Callable[[Any, Mapping[str, jax.Array]], Any]:
  """Wraps ``fn(params, batch)`` to compute in ``compute_dtype``.

  Works for ``loss_fn`` (``[B]`` losses) and ``metrics_fn`` (a dict of
  ``[B]`` arrays) alike; floating outputs are cast to ``output_dtype``.
  """
  def wrapped(params, batch):
    out = fn(_cast_floats(params, compute_dtype), _cast_floats(batch, compute_dtype))
    return _cast_floats(out, output_dtype)

  wrapped.__name__ = f'mixed_precision_{getattr(fn, "__name__", "fn")}'
  return wrapped
