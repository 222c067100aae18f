"""Laying placed values onto the mesh axis named after their placement.

A value placed at ``clients`` has the clients on its leading axis. When a mesh
with an axis called ``clients`` is active (passed as ``mesh=`` or set with
``jax.set_mesh``), that leading axis is sharded over it, so each device holds
and computes for its own slice of the clients. Values that arrive replicated or
sharded another way are resharded, not rejected. With no such mesh, nothing
happens. Both Auto and Explicit mesh axis types are supported: Auto axes get a
sharding constraint, Explicit axes a ``jax.sharding.reshard``.

:func:`llama_param_specs` lays one Llama replica's parameters (and any tree
of the same paths, such as AdamW's moments) over an ``fsdp`` and a ``tensor``
mesh axis: Megatron-style tensor parallelism (Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", arXiv 1909.08053, Section 3) on ``tensor``, FSDP on ``fsdp``
along the matrices' other dimension.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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


def replicate(x: jax.Array, mesh: Any = None) -> jax.Array:
  """``x`` laid out whole on every device of an Explicit mesh (unchanged on
  an Auto one, where the compiler places it)."""
  mesh = active_mesh(mesh)
  if mesh is None or not any(t == AxisType.Explicit for t in mesh.axis_types):
    return x
  spec = P(*([None] * jnp.ndim(x)))
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return jax.sharding.reshard(x, spec)


def place_tree(tree: Any, placement: str, mesh: Any = None, axis: int = 0) -> Any:
  return jax.tree.map(lambda x: place_leading_axis(x, placement, mesh, axis), tree)


def spmd_axis_name(placement: str, mesh: Any = None) -> str | None:
  """The axis name to give ``jax.vmap(spmd_axis_name=...)``, if a mesh has it."""
  mesh = active_mesh(mesh)
  return placement if placement_axis_type(mesh, placement) is not None else None


COLUMN_PARALLEL = ('q_proj', 'k_proj', 'v_proj', 'gate_proj', 'up_proj')
"""Llama kernels ``[in, out]`` split on their output (heads, MLP width) over ``tensor``."""

ROW_PARALLEL = ('o_proj', 'down_proj')
"""Llama kernels ``[in, out]`` split on their input (heads, MLP width) over ``tensor``."""


def _path_names(path: Any) -> list[str]:
  names = []
  for key in path:
    name = getattr(key, 'key', getattr(key, 'name', None))
    if isinstance(name, str):
      names.append(name)
  return names


def _matrix_axes(names: list[str], ndim: int) -> tuple[int, int] | None:
  """``(tensor_axis, fsdp_axis)`` of a Llama leaf, None for a replicated one.

  Axes count from the end, so a scanned leaf's leading layer axis is skipped.
  """
  if 'scale' in names[-1:]:
    return None  # RMSNorm gains: d (or [L, d]) floats, replicated.
  module = next((n for n in reversed(names) if n in COLUMN_PARALLEL + ROW_PARALLEL), None)
  if names[-1:] == ['kernel'] and module in COLUMN_PARALLEL:
    return ndim - 1, ndim - 2
  if names[-1:] == ['kernel'] and module in ROW_PARALLEL:
    return ndim - 2, ndim - 1
  if names[-2:] == ['embed_tokens', 'embedding']:
    return ndim - 2, ndim - 1  # [V, d]: the vocabulary on tensor.
  if names[-2:] == ['lm_head', 'kernel']:
    return ndim - 1, ndim - 2  # [d, V]: the vocabulary on tensor.
  raise ValueError(f'llama_param_specs: the leaf {"/".join(names) or "<root>"} is not a Llama '
                   'parameter (q/k/v/o_proj, gate/up/down_proj, embed_tokens, lm_head or a '
                   'norm scale).')


def llama_param_spec(path: Any, shape: tuple[int, ...], fsdp: int = 1,
                     tensor: int = 1) -> P:
  """The ``PartitionSpec`` of one Llama leaf at ``path`` over ``('fsdp', 'tensor')``.

  Megatron-LM's layout (Shoeybi et al. 2019, arXiv 1909.08053, Section 3):
  with ``Y = X W`` and ``W = [W_1, ..., W_T]`` split by columns over the
  ``T`` devices of ``tensor``, device ``t`` computes ``X W_t`` with no
  communication; the next matrix, split by rows ``W' = [W'_1; ...; W'_T]``,
  gives ``Y W' = sum_t Y_t W'_t``, one all-reduce over ``tensor``. Hence:

  * ``q_proj, k_proj, v_proj, gate_proj, up_proj`` (``[d, out]``): ``out``
    (the heads, the MLP width) on ``tensor``, ``d`` on ``fsdp``;
  * ``o_proj, down_proj`` (``[in, d]``): ``in`` on ``tensor``, ``d`` on ``fsdp``;
  * ``embed_tokens/embedding`` ``[V, d]`` and ``lm_head/kernel`` ``[d, V]``:
    ``V`` on ``tensor``, ``d`` on ``fsdp``. The paper splits the vocabulary
    (its Section 3, "parallelize the input embedding weight matrix along the
    vocabulary dimension"): the logits ``[B, T, V]``, the largest activation,
    are split with it, and a tied embedding is one matrix for both ends;
  * RMSNorm scales: replicated.

  A scanned leaf's leading layer axis ``L`` is not sharded. Leaves without
  a Llama name (an optimizer's step count) are replicated if scalar.

  Raises:
    ValueError: if the leaf is not a Llama parameter, or ``fsdp`` or
      ``tensor`` does not divide the dimension it would shard.
  """
  for arg, value in (('fsdp', fsdp), ('tensor', tensor)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'llama_param_spec: {arg}={value!r} must be a positive integer.')
  names = _path_names(path)
  if not shape:
    return P()
  axes = _matrix_axes(names, len(shape))
  if axes is None:
    return P(*([None] * len(shape)))
  spec: list[Any] = [None] * len(shape)
  for axis, name, size in zip(axes, ('tensor', 'fsdp'), (tensor, fsdp)):
    if size == 1:
      continue
    if shape[axis] % size:
      raise ValueError(f'llama_param_spec: {name}={size} does not divide dimension {axis} '
                       f'(size {shape[axis]}) of {"/".join(names)} {tuple(shape)}; choose a '
                       'divisor of it.')
    spec[axis] = name
  return P(*spec)


def llama_param_specs(tree: Any, fsdp: int = 1, tensor: int = 1) -> Any:
  """:func:`llama_param_spec` of every leaf of ``tree`` (parameters or optimizer state)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: llama_param_spec(path, tuple(np.shape(x)), fsdp, tensor), tree)


REPLICA_AXES = ('fsdp', 'tensor')
"""The mesh axes one replica (one client's model) spans, beside ``clients``."""

LAYOUTS = ('fsdp', 'llama')
"""How a model's parameters lie on :data:`REPLICA_AXES` (:func:`replica_spec`)."""


def fsdp_spec(shape: tuple[int, ...], fsdp: int, min_size: int = 1024) -> P:
  """``'fsdp'`` on the largest dimension of ``shape`` that ``fsdp`` divides.

  FSDP / ZeRO stage 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models", arXiv 1910.02054; Zhao et al.
  2023, "PyTorch FSDP", arXiv 2304.11277): each of the ``fsdp`` devices
  stores ``1/fsdp`` of every parameter and of its optimizer state, and the
  whole matrix is gathered only where a product needs it. Arrays of fewer
  than ``min_size`` elements, and arrays no dimension of which ``fsdp``
  divides, stay replicated (ties go to the first dimension).
  """
  shape = tuple(shape)
  if fsdp <= 1 or int(np.prod(shape)) < min_size:
    return P(*([None] * len(shape)))
  axes = [i for i, n in enumerate(shape) if n % fsdp == 0]
  if not axes:
    return P(*([None] * len(shape)))
  best = max(axes, key=lambda i: (shape[i], -i))
  return P(*('fsdp' if i == best else None for i in range(len(shape))))


def replica_spec(path: Any, shape: tuple[int, ...], fsdp: int = 1, tensor: int = 1,
                 layout: str = 'fsdp') -> P:
  """The ``PartitionSpec`` over ``('fsdp', 'tensor')`` of one leaf of a replica's state.

  ``layout='llama'``: a Llama parameter (or a leaf of the same path, such as
  an optimizer moment) follows :func:`llama_param_spec` (Megatron-LM, Shoeybi
  et al. 2019, arXiv 1909.08053, Section 3, on ``tensor``; FSDP on ``fsdp``
  along the other dimension); any other leaf (a LoRA adapter, a per-leaf
  statistic of another shape) falls back to :func:`fsdp_spec`.
  ``layout='fsdp'``: every leaf follows :func:`fsdp_spec`, whatever the model
  (``tensor`` is then not used). Scalars are replicated.

  Raises:
    ValueError: ``layout`` is not one of :data:`LAYOUTS`, or a Llama leaf has
      a dimension that ``fsdp`` or ``tensor`` does not divide.
  """
  if layout not in LAYOUTS:
    raise ValueError(f'replica_spec: layout={layout!r} is not one of {LAYOUTS}.')
  shape = tuple(shape)
  if not shape:
    return P()
  if layout == 'llama' and (fsdp > 1 or tensor > 1):
    names = _path_names(path)
    try:
      axes = _matrix_axes(names, len(shape))
    except ValueError:
      axes = False  # Not a Llama parameter.
    if axes is not False:
      return llama_param_spec(path, shape, fsdp, tensor)
  return fsdp_spec(shape, fsdp)


def replica_specs(tree: Any, fsdp: int = 1, tensor: int = 1, layout: str = 'fsdp') -> Any:
  """:func:`replica_spec` of every leaf of ``tree`` (a state, parameters, moments)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: replica_spec(path, tuple(np.shape(x)), fsdp, tensor, layout), tree)


def replica_axis_sizes(mesh: Any = None) -> tuple[int, int]:
  """``(fsdp, tensor)``: the sizes of those axes of ``mesh`` (or the active mesh), 1 if absent."""
  mesh = active_mesh(mesh)
  if mesh is None:
    return 1, 1
  shape = dict(mesh.shape)
  return int(shape.get('fsdp', 1)), int(shape.get('tensor', 1))


def constrain_replica(tree: Any, layout: str = 'fsdp', mesh: Any = None) -> Any:
  """Inside a traced computation: lays ``tree`` on :func:`replica_specs`.

  Called on one replica's parameters (by :meth:`fedjx.models.Model.apply`),
  so a model's products, gradients and optimizer state keep the layout of the
  server state. Inside :func:`fedjx.map_fn` on a mesh with a ``clients``
  axis, ``vmap``'s ``spmd_axis_name`` adds ``clients`` on the replica axis:
  a stacked leaf ``[M, ...]`` lies on ``P('clients', *spec)``. A no-op
  without an active mesh that has an ``fsdp`` or ``tensor`` axis.
  """
  fsdp, tensor = replica_axis_sizes(mesh)
  if fsdp == 1 and tensor == 1:
    return tree
  mesh = active_mesh(mesh)
  specs = replica_specs(tree, fsdp, tensor, layout)
  def one(x, spec):
    if not isinstance(mesh, jax.sharding.Mesh):
      return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.tree.map(one, tree, specs)


def constrain_batch(x: jax.Array, mesh: Any = None) -> jax.Array:
  """Inside a traced computation: one replica's batch ``[B, ...]`` split on ``fsdp``.

  FSDP is data parallelism inside a replica (ZeRO, arXiv 1910.02054): each of
  the ``fsdp`` devices computes the loss of ``B / fsdp`` examples with the
  gathered parameters, and the gradient's sum over them is reduce-scattered
  back onto the parameters' shards. The ``tensor`` devices of a group see
  the same examples (Megatron-LM). A no-op without an ``fsdp`` axis, or
  when ``fsdp`` does not divide ``B``.
  """
  fsdp, _ = replica_axis_sizes(mesh)
  if fsdp == 1 or not np.ndim(x) or np.shape(x)[0] % fsdp:
    return x
  mesh = active_mesh(mesh)
  spec = P('fsdp', *([P.UNCONSTRAINED] * (np.ndim(x) - 1)))
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.lax.with_sharding_constraint(x, spec)
