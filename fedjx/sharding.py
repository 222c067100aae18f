"""Laying placed values onto the mesh axis named after their placement.

A value placed at ``clients`` has the clients on its leading axis. When a mesh
with an axis called ``clients`` is active (passed as ``mesh=`` or set with
``jax.set_mesh``), that leading axis is sharded over it, so each device holds
and computes for its own slice of the clients. Values that arrive replicated or
sharded another way are resharded, not rejected. With no such mesh, nothing
happens. Both Auto and Explicit mesh axis types are supported: Auto axes get a
sharding constraint, Explicit axes a ``jax.sharding.reshard``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def active_mesh(mesh: Any = None) -> Any:
  """The mesh to place on: ``mesh`` if given, else the context mesh, else None."""
  if mesh is not None:
    return mesh
  abstract = jax.sharding.get_abstract_mesh()
  if abstract is None or abstract.empty:
    return None
  return abstract


def placement_axis_type(mesh: Any, placement: str) -> Any:
  """The ``AxisType`` of the mesh axis named ``placement``, or None if absent."""
  if mesh is None or placement not in mesh.axis_names:
    return None
  return mesh.axis_types[mesh.axis_names.index(placement)]


def _current_spec(x: jax.Array) -> tuple[Any, ...]:
  sharding = getattr(jax.typeof(x), 'sharding', None)
  spec = tuple(getattr(sharding, 'spec', ()) or ())
  return spec + (None,) * (x.ndim - len(spec))


def place_leading_axis(x: jax.Array, placement: str, mesh: Any = None,
                       axis: int = 0) -> jax.Array:
  """Shards ``x``'s axis ``axis`` over the mesh axis ``placement``, if any."""
  mesh = active_mesh(mesh)
  axis_type = placement_axis_type(mesh, placement)
  if axis_type is None or x.ndim <= axis:
    return x
  if axis_type == AxisType.Explicit:
    spec = list(_current_spec(x))
    # The placement axis may shard only one dimension.
    spec = [None if s == placement or (isinstance(s, tuple) and placement in s)
            else s for s in spec]
    spec[axis] = placement
    if isinstance(mesh, jax.sharding.Mesh):
      return jax.sharding.reshard(x, NamedSharding(mesh, P(*spec)))
    return jax.sharding.reshard(x, P(*spec))
  spec = [P.UNCONSTRAINED] * x.ndim
  spec[axis] = placement
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))
  return jax.lax.with_sharding_constraint(x, P(*spec))


def place_tree(tree: Any, placement: str, mesh: Any = None, axis: int = 0) -> Any:
  return jax.tree.map(lambda x: place_leading_axis(x, placement, mesh, axis), tree)


def spmd_axis_name(placement: str, mesh: Any = None) -> str | None:
  """The axis name to give ``jax.vmap(spmd_axis_name=...)``, if a mesh has it."""
  mesh = active_mesh(mesh)
  return placement if placement_axis_type(mesh, placement) is not None else None
