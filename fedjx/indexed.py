"""Batches as rows of a table: a cohort's data without its padded copy.

``IndexedBatches(table, index)`` stands for the batches

    batches[k][..., s, b] = table[k][index[..., s, b]]

where ``table`` holds examples once (``[N, ...]`` leaves, e.g. a whole
population on the device) and ``index`` is the cohort's ``[C, S, B]`` int32
layout of example rows. A cohort built this way moves ``5 C S B`` bytes (the
index and the mask) to the device per round instead of the padded
``[C, S, B, ...]`` arrays, and nothing about a row is copied twice.

:func:`fedjx.map_fn` keeps ``table`` whole for every member (it is not
placed: like a broadcast value, each member reads it as it is) and slices
``index``, so a member's function receives ``IndexedBatches(table, index_i)``
with ``index_i`` of shape ``[S, B]``. Per-step code reads one step's batch
with :func:`take` (``{k: table[k][index_i[s]]}``: a gather of ``B`` rows),
and code that wants the member's arrays whole calls :func:`dense`; both
accept plain dicts of ``[S, B, ...]`` arrays too, so the same client code
runs on either kind of cohort, with the same numbers (a gather copies
values exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


class IndexedBatches(NamedTuple):
  """Batches ``{k: table[k][index]}`` kept as a table and an index.

  Attributes:
    table: dict of ``[N, ...]`` arrays, the examples (not placed).
    index: int32 rows of ``table``: ``[C, S, B]`` for a cohort, ``[S, B]``
      for one member inside :func:`fedjx.map_fn`; a row outside ``[0, N)``
      (a cohort's padding, mask False) reads as zeros.
  """

  table: Mapping[str, Any]
  index: Any

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the batches' leading axes (``index.shape``)."""
    return tuple(jnp.shape(self.index))

  def rows(self, index: Any) -> dict[str, jax.Array]:
    """``{k: table[k][index]}``: the examples at ``index`` (any shape);
    zeros where ``index`` is outside ``[0, N)`` (a cohort's padding slots
    hold ``N``: zeros, as a host cohort pads)."""
    index = jnp.asarray(index)
    spec = _explicit_spec(index)
    if spec is None:
      return {k: jnp.take(v, index, axis=0, mode='fill', fill_value=0)
              for k, v in self.table.items()}
    # Under an Explicit mesh the rows are laid out as the index is (a
    # cohort's clients on their axis), each example's features whole.
    return {k: v.at[index].get(mode='fill', fill_value=0, out_sharding=P(
        *spec, *([None] * (jnp.ndim(v) - 1)))) for k, v in self.table.items()}

  def dense(self) -> dict[str, jax.Array]:
    """The batches as arrays, ``[*index.shape, ...]`` per feature."""
    return self.rows(self.index)

  def example_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape and dtype of one example of each feature."""
    return {k: jax.ShapeDtypeStruct(jnp.shape(v)[1:], jnp.result_type(v))
            for k, v in self.table.items()}


def _explicit_spec(index: jax.Array) -> tuple[Any, ...] | None:
  """The ``PartitionSpec`` entries of ``index`` where it is typed by a mesh
  with Explicit axes, else None."""
  sharding = getattr(jax.typeof(index), 'sharding', None)
  mesh = getattr(sharding, 'mesh', None)
  if jax.sharding.AxisType.Explicit not in getattr(mesh, 'axis_types', ()):
    return None
  return tuple(sharding.spec) + (None,) * (jnp.ndim(index) - len(sharding.spec))


def is_indexed(x: Any) -> bool:
  """Whether ``x`` is an :class:`IndexedBatches`."""
  return isinstance(x, IndexedBatches)


def take(tree: Any, i: Any) -> Any:
  """Entry ``i`` of the leading axis of every leaf of ``tree``.

  An :class:`IndexedBatches` inside ``tree`` gives the rows of ``index[i]``
  (for a member's ``[S, B]`` index: step ``i``'s batch, ``B`` rows of the
  table), not a slice of its table.
  """
  return jax.tree.map(
      lambda x: x.rows(jnp.asarray(x.index)[i]) if is_indexed(x)
      else jnp.asarray(x)[i], tree, is_leaf=is_indexed)


def dense(tree: Any) -> Any:
  """``tree`` with every :class:`IndexedBatches` replaced by its arrays."""
  return jax.tree.map(lambda x: x.dense() if is_indexed(x) else x, tree,
                      is_leaf=is_indexed)


def leading_shape(tree: Any, axes: int) -> tuple[int, ...] | None:
  """The first ``axes`` dimensions of ``tree``'s batches (None if empty)."""
  for x in jax.tree.leaves(tree, is_leaf=is_indexed):
    shape = x.shape if is_indexed(x) else jnp.shape(x)
    return tuple(int(d) for d in shape[:axes])
  return None


def row_bytes(batches: IndexedBatches) -> int:
  """Bytes of one example of every feature of the table."""
  return sum(int(jnp.size(v) // max(jnp.shape(v)[0], 1)) *
             jnp.result_type(v).itemsize for v in batches.table.values())


def batch_spec(tree: Any) -> Any:
  """Shape and dtype of one ``[B, ...]`` batch of ``tree`` (a cohort's
  ``[C, S, B, ...]`` batches or an :class:`IndexedBatches`), from shapes
  alone: nothing is sliced, so a sharded cohort needs no resharding."""
  def spec(x):
    if is_indexed(x):
      b = jnp.shape(x.index)[2]
      return {k: jax.ShapeDtypeStruct((b,) + s.shape, s.dtype)
              for k, s in x.example_spec().items()}
    return jax.ShapeDtypeStruct(jnp.shape(x)[2:], jnp.result_type(x))
  return jax.tree.map(spec, tree, is_leaf=is_indexed)


__all__ = ['IndexedBatches', 'batch_spec', 'dense', 'is_indexed',
           'leading_shape', 'row_bytes', 'take']
