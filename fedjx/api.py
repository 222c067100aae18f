"""The public federated operations on pytrees (DrJAX's vocabulary).

Every function must be called inside a :func:`fedjx.program`. A *placed* value
has a leading axis with one entry per member of its placement; an *unplaced*
value is a server value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjx import frames
from fedjx import primitives
from fedjx import sharding as sharding_lib


def _leading(x: Any, name: str, caller: str, placement: str) -> int:
  if jnp.ndim(x) == 0:
    raise ValueError(
        f'fedjx.{caller}: {name} has a scalar leaf of shape (), which is not '
        f'placed at {placement!r} (a placed value has a leading axis of the '
        'placement size). Did you mean to reduce a value returned by map_fn or '
        'broadcast?')
  return jnp.shape(x)[0]


def broadcast(x: Any, *, placement: str | None = None, mesh: Any = None) -> Any:
  """Places an unplaced pytree at every member: ``out_i = x`` for each ``i``.

  The output has a new leading axis of the placement's size, sharded over the
  mesh axis of the same name when one is active. Its transpose is
  :func:`reduce_sum`.
  """
  p, frame = frames.lookup(placement, 'broadcast')
  n = frames.resolve_size(p, None, 'broadcast')
  mesh = mesh if mesh is not None else frame.mesh

  def one(leaf):
    leaf = jnp.asarray(leaf)
    out = primitives.broadcast_p.bind(leaf, placement=p.name, n=n)
    out = sharding_lib.place_leading_axis(out, p.name, mesh)
    frame.broadcasts[id(out)] = (out, leaf, p.name)
    return out

  return jax.tree.map(one, x)


def _reduce(prim, x, placement, mesh, caller):
  p, frame = frames.lookup(placement, caller)
  mesh = mesh if mesh is not None else frame.mesh

  def one(leaf):
    leaf = jnp.asarray(leaf)
    frames.resolve_size(p, _leading(leaf, 'x', caller, p.name), caller)
    leaf = sharding_lib.place_leading_axis(leaf, p.name, mesh)
    return prim.bind(leaf, placement=p.name)

  return jax.tree.map(one, x)


def reduce_sum(x: Any, *, placement: str | None = None, mesh: Any = None) -> Any:
  """Sums a placed pytree over members: ``sum_i x_i``. Transpose: broadcast."""
  return _reduce(primitives.reduce_sum_p, x, placement, mesh, 'reduce_sum')


def reduce_mean(x: Any, *, placement: str | None = None, mesh: Any = None) -> Any:
  """Averages a placed pytree over members: ``(1/n) sum_i x_i``.

  Integer and boolean inputs give a floating-point mean.
  """
  return _reduce(primitives.reduce_mean_p, x, placement, mesh, 'reduce_mean')


def reduce_weighted_mean(x: Any, weights: Any, *, placement: str | None = None,
                         mesh: Any = None) -> Any:
  """Weighted average over members: ``sum_i w_i x_i / sum_i w_i``.

  Args:
    x: a placed pytree.
    weights: a placed array of shape ``[n]`` (one weight per member), applied
      to every leaf of ``x``.
    placement: the placement to reduce over (default: innermost).
    mesh: optional mesh.

  Returns:
    The unplaced weighted mean. If the weights sum to zero the result is
    defined as zero (with zero derivative), never NaN.
  """
  caller = 'reduce_weighted_mean'
  p, frame = frames.lookup(placement, caller)
  mesh = mesh if mesh is not None else frame.mesh
  weights = jnp.asarray(weights)
  if weights.ndim != 1:
    raise ValueError(
        f'fedjx.reduce_weighted_mean: weights must have shape [n] with one '
        f'weight per member of {p.name!r}; got shape {weights.shape}.')
  if p.size is not None and weights.shape[0] != p.size:
    raise ValueError(
        f'fedjx.reduce_weighted_mean: weights have {weights.shape[0]} entries, '
        f'but placement {p.name!r} has {p.size} members; pass one weight per '
        'member.')
  n = frames.resolve_size(p, weights.shape[0], caller)
  weights = sharding_lib.place_leading_axis(weights, p.name, mesh)

  def one(leaf):
    leaf = jnp.asarray(leaf)
    lead = _leading(leaf, 'x', caller, p.name)
    if lead != n:
      raise ValueError(
          f'fedjx.reduce_weighted_mean: weights have {n} entries but a leaf of '
          f'x has leading dimension {lead}; both must equal the size of '
          f'placement {p.name!r}.')
    leaf = sharding_lib.place_leading_axis(leaf, p.name, mesh)
    return primitives.reduce_weighted_mean_p.bind(leaf, weights, placement=p.name)

  return jax.tree.map(one, x)
