"""Max pooling over windows that tile the input, as a reshape and a max.

With windows of ``k_1 x ... x k_d`` that step by their own size (strides equal
to the window, ``'VALID'`` padding),

    y[n, i_1, ..., i_d, c] = max_{0 <= a_j < k_j} x[n, k_1 i_1 + a_1, ..., k_d i_d + a_d, c],

which is ``x`` (its trailing rows and columns that fill no window dropped)
reshaped to ``[N, H_1 / k_1, k_1, ..., H_d / k_d, k_d, C]`` and reduced by
``max`` over the ``k_j`` axes. ``flax.linen.max_pool`` computes the same
values with ``lax.reduce_window``, whose derivative is XLA's
``select_and_scatter``; on XLA:CPU that costs about 8x the reshaped max's
derivative (benchmarks/results/HISTORY.md, "Pooling as a reshape"), about
a fifth of a small CNN's local step.

The derivative differs only where a window holds its maximum more than once:
JAX's ``max`` splits the cotangent equally among the tied entries, and
``select_and_scatter`` gives it all to the first. Both are subgradients of
the same function. After a ReLU the commonest ties are windows of zeros,
whose shares the ReLU's derivative zeroes either way.

Other windows, strides or paddings run ``flax.linen.max_pool`` unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax


def max_pool(x: jax.Array, window_shape: Sequence[int],
             strides: Sequence[int] | None = None,
             padding: str | Sequence[tuple[int, int]] = 'VALID') -> jax.Array:
  """``flax.linen.max_pool``'s values, by a reshape where the windows tile ``x``.

  Args:
    x: ``[batch..., spatial..., features]``, one spatial axis per window axis.
    window_shape: the window, e.g. ``(2, 2)``.
    strides: the step between windows; None means ``window_shape``.
    padding: ``'VALID'`` takes the reshape (as does ``'SAME'`` where every
      spatial size is a multiple of its window); anything else runs
      ``flax.linen.max_pool``.
  """
  window = tuple(int(k) for k in window_shape)
  strides = window if strides is None else tuple(int(s) for s in strides)
  d = len(window)
  if x.ndim < d + 1:
    raise ValueError(f'max_pool: x of shape {x.shape} has no room for a '
                     f'{d}-d window and a feature axis.')
  if any(k < 1 for k in window):
    raise ValueError(f'max_pool: window_shape={window} must be positive.')
  spatial = x.shape[-d - 1:-1]
  tiles = strides == window and (
      padding == 'VALID' or
      (padding == 'SAME' and all(n % k == 0 for n, k in zip(spatial, window))))
  if not tiles:
    return nn.max_pool(x, window, strides, padding)
  lead = x.shape[:-d - 1]
  kept = tuple(slice(0, n - n % k) for n, k in zip(spatial, window))
  x = x[(..., *kept, slice(None))]
  split = [m for n, k in zip(spatial, window) for m in (n // k, k)]
  x = x.reshape(*lead, *split, x.shape[-1])
  window_axes = tuple(len(lead) + 2 * j + 1 for j in range(d))
  return x.max(axis=window_axes)
