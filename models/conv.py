"""Convolution as a matrix product of image patches (im2col).

``patch_conv`` computes exactly what ``jax.lax.conv_general_dilated`` computes,

    y[n, p, o] = sum_{f, c} x_pad[n, s * p + d * f, c] * w[f, c, o],

by gathering each output position's receptive field into a row (the
"im2col" lowering of Chellapilla et al. 2006, "High Performance Convolutional
Neural Networks for Document Processing") and multiplying the ``[N * P, F * C]``
patch matrix by the ``[F * C, O]`` kernel matrix. The patches are strided
slices of the padded input, so their derivative is a sum of padded slices.

Why federated learning wants it: under ``jax.vmap`` with one kernel per client
(every ``map_fn`` over clients that train a CNN), JAX lowers a convolution to a
*grouped* convolution with one group per client, which XLA runs slowly; its
weight gradient becomes a convolution with ``batch_group_count`` = clients,
slower still. Written as patches and ``dot_general``, the same vmapped
computation is a batched matrix product (one ``[N * P, F * C] x [F * C, O]``
product per client) that every backend runs at matrix-multiply speed, and the
slicing folds the client axis into the batch. On the 2-core CPU of
docs/benchmarks.md it is also faster for one client at a time.

The price is memory: the patch matrix is ``F`` times the input activation
(9x for a 3x3 kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CONV_IMPLEMENTATIONS = ('patches', 'xla')


def patch_conv(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int],
               padding: str | Sequence[tuple[int, int]],
               lhs_dilation: Sequence[int] | None = None,
               rhs_dilation: Sequence[int] | None = None,
               dimension_numbers=None, feature_group_count: int = 1,
               batch_group_count: int = 1, precision=None,
               preferred_element_type=None) -> jax.Array:
  """``lax.conv_general_dilated`` as patches times a kernel matrix.

  Same arguments and result as :func:`jax.lax.conv_general_dilated`, so it can
  be passed as ``flax.linen.Conv(conv_general_dilated=patch_conv)``. Grouped
  convolutions (``feature_group_count`` or ``batch_group_count`` above 1) are
  delegated to ``lax.conv_general_dilated``.
  """
  if feature_group_count != 1 or batch_group_count != 1:
    return lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
        dimension_numbers, feature_group_count, batch_group_count, precision,
        preferred_element_type)
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  spatial = lhs.ndim - 2
  ones = (1,) * spatial
  lhs_dilation = tuple(lhs_dilation or ones)
  rhs_dilation = tuple(rhs_dilation or ones)
  window_strides = tuple(window_strides)
  # Channels last: x is [N, spatial..., C], w is [spatial..., C, O].
  x = jnp.transpose(lhs, (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1]))
  w = jnp.transpose(rhs, (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0]))
  filter_shape = w.shape[:spatial]
  if isinstance(padding, str):
    if lhs_dilation != ones:
      raise ValueError(
          f'patch_conv: padding={padding!r} with lhs_dilation={lhs_dilation}; '
          'give explicit (low, high) pairs for transposed convolutions, as '
          'lax.conv_general_dilated requires.')
    dilated_filter = [(f - 1) * d + 1 for f, d in zip(filter_shape, rhs_dilation)]
    padding = lax.padtype_to_pads(x.shape[1:-1], dilated_filter, window_strides,
                                  padding)
  pad_config = [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in
                              zip(padding, lhs_dilation)] + [(0, 0, 0)]
  x = lax.pad(x, jnp.zeros((), x.dtype), pad_config)
  out_shape = [(size - (f - 1) * d - 1) // s + 1 for size, f, d, s in
               zip(x.shape[1:-1], filter_shape, rhs_dilation, window_strides)]
  columns = []
  for offset in np.ndindex(*filter_shape):
    start = [o * d for o, d in zip(offset, rhs_dilation)]
    limit = [b + (n - 1) * s + 1 for b, n, s in zip(start, out_shape, window_strides)]
    columns.append(lax.slice(x, (0, *start, 0), (x.shape[0], *limit, x.shape[-1]),
                             (1, *window_strides, 1)))
  # [N, out spatial..., F, C] -> [N, out spatial..., F * C], matching w's rows.
  patches = jnp.stack(columns, axis=-2)
  patches = patches.reshape(patches.shape[:-2] + (-1,))
  out = lax.dot_general(patches, w.reshape((-1, w.shape[-1])),
                        (((spatial + 1,), (0,)), ((), ())),
                        precision=precision,
                        preferred_element_type=preferred_element_type)
  # out is [N, spatial..., O]; place each axis where out_spec wants it.
  source_of = {dn.out_spec[0]: 0, dn.out_spec[1]: spatial + 1}
  source_of.update({d: 1 + i for i, d in enumerate(dn.out_spec[2:])})
  return jnp.transpose(out, [source_of[d] for d in range(out.ndim)])


def conv_function(implementation: str, owner: str):
  """The ``conv_general_dilated`` for ``flax.linen.Conv``: ``'patches'`` or ``'xla'``."""
  if implementation not in CONV_IMPLEMENTATIONS:
    raise ValueError(f'{owner}: conv={implementation!r} is not one of '
                     f'{CONV_IMPLEMENTATIONS}.')
  return patch_conv if implementation == 'patches' else lax.conv_general_dilated
