"""``jax.jit`` with the arrays a function closes over passed as arguments.

A round closes over whatever its ``loss_fn`` closes over: a frozen
pretrained model (the base under LoRA adapters), a fixed feature extractor,
a lookup table. ``jax.jit`` embeds such arrays in the compiled program as
constants: XLA copies them into the executable and may fold computations
through them, so compile time and memory grow with their size (a frozen
base of 1.1B parameters in bfloat16 is 2.2 GB of constants).

:func:`jit` traces ``fn`` once per signature of its arguments (their
shapes, dtypes and, under an Explicit mesh, shardings), takes the arrays its
jaxpr closes over, and compiles that jaxpr with them as leading arguments:

    jit(fn)(*args) = jax.jit(lambda consts, *a: eval(jaxpr, consts, *a))(consts, *args)

Arrays closed over inside a nested ``jax.jit`` call (``fedjx.map_fn`` runs
its members in one) are the constants of that call's own jaxpr; such a
call, where it fixes no sharding, layout or donation, is evaluated inline
so that its constants are arguments too. (``lax.scan``, ``cond`` and
``while_loop`` already pass what their bodies close over as operands.)

The same operations on the same values, so the same numbers as
``jax.jit(fn)`` wherever XLA does not fold a computation on a constant; the
executable neither holds nor depends on the constants' values, and the
constants stay on the device where they are (a NumPy constant is put on the
default device once).

A program whose maps chose a mesh of CPU devices by themselves (a round
with no mesh set on a CPU split into one device per core,
:func:`fedjx.distributed.cpu_blocks`) gets its uncommitted arguments and
constants laid out replicated on that mesh before each call, as its
outputs are: every call then takes the same layout, so the program is
compiled once (not again for the second round, whose state the first
left on the mesh), and an argument passed again (a population's table)
is laid out once and reused while it lives.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.api_util
import jax.core
import numpy as np
from jax.extend import core as jex_core
from jax.extend.core import Literal
from jax.extend.core import primitives

from fedjx import fused_updates


class HoistedJit:
  """The callable :func:`jit` returns: ``fn`` compiled, its constants as arguments.

  ``lower(*args)`` works as ``jax.jit``'s (arguments may be
  ``jax.ShapeDtypeStruct``); what ``lower(...).compile()`` returns is called
  with ``fn``'s arguments alone.
  """

  def __init__(self, fn: Callable[..., Any], donate_argnums: Sequence[int]):
    self._fn = fn
    self._donate = tuple(donate_argnums)
    self._entries: dict[Any, tuple[Any, list[Any], Any]] = {}
    # Arguments laid out on a program's own CPU mesh: id -> (source, laid out).
    self._laid: dict[int, tuple[Any, Any]] = {}
    functools.update_wrapper(self, fn)

  def _entry(self, args: tuple[Any, ...]) -> tuple[Any, list[Any], Any] | None:
    """``(jitted, consts, mesh)`` for this signature (``mesh``: the CPU mesh
    the program's maps chose by themselves, or None); None where ``fn``
    closes over values of an enclosing trace (those cannot be kept).

    Raises:
      DeletedArgumentError: an argument holds an array whose buffer is
        deleted (donated to an earlier call), checked before XLA sees it.
    """
    leaves, tree = jax.tree.flatten(args)
    key = (tree, tuple(_signature(x) for x in leaves),
           jax.sharding.get_abstract_mesh())
    if any(k is _DELETED for k in key[1]):
      raise DeletedArgumentError(self._deleted_message(args))
    entry = self._entries.get(key)
    if entry is None:
      closed, out_shape = jax.make_jaxpr(self._fn, return_shape=True)(*args)
      found = {id(c): c for c in closed.consts}
      _nested_constants(closed.jaxpr, found)
      if any(isinstance(c, jax.core.Tracer) for c in found.values()):
        return None
      consts = [jax.device_put(c) if isinstance(c, np.ndarray) else c
                for c in found.values()]
      run = functools.partial(_evaluate, closed.jaxpr, [id(c) for c in closed.consts],
                              list(found), jax.tree.structure(out_shape))
      run.__name__ = getattr(self._fn, '__name__', 'hoisted')
      jitted = jax.jit(run, donate_argnums=tuple(i + 1 for i in self._donate))
      mesh = None if key[2].axis_names else _own_cpu_mesh(closed.jaxpr)
      entry = self._entries[key] = (jitted, consts, mesh)
    return entry

  def _deleted_message(self, args: tuple[Any, ...]) -> str:
    name = getattr(self._fn, '__name__', 'the function')
    where = [i for i, a in enumerate(args)
             if any(_signature(x) is _DELETED for x in jax.tree.leaves(a))]
    which = ', '.join(map(str, where))
    if any(i in self._donate for i in where):
      return (f'{name}: argument {which} holds arrays that an earlier call '
              'consumed (a compiled round donates the state it is given, so '
              'its buffers are deleted). Continue from the state that call '
              'returned; to run rounds from one state more than once use '
              'algo.apply(state, ...), or algo.compile(donate=False).')
    return (f'{name}: argument {which} holds arrays whose buffers were deleted '
            '(donated to another call, or .delete()d); pass live arrays.')

  def __call__(self, *args: Any) -> Any:
    entry = self._entry(args)
    if entry is None:
      return jax.jit(self._fn, donate_argnums=self._donate)(*args)
    jitted, consts, mesh = entry
    if mesh is not None:
      consts, args = self._lay_out((consts, args), mesh)
    return jitted(consts, *args)

  def _lay_out(self, tree: Any, mesh: Any) -> Any:
    """``tree`` with its uncommitted arrays replicated on ``mesh`` (an
    array seen before: its copy laid out then)."""
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self._laid = {i: (src, out) for i, (src, out) in self._laid.items()
                  if src() is not None}

    def one(x):
      if isinstance(x, np.ndarray):
        return jax.device_put(x, where)
      if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or
          x.committed):
        return x
      seen = self._laid.get(id(x))
      if seen is not None and seen[0]() is x and seen[1].sharding == where:
        return seen[1]
      out = jax.device_put(x, where)
      self._laid[id(x)] = (weakref.ref(x), out)
      return out

    return jax.tree.map(one, tree)

  def lower(self, *args: Any) -> '_Lowered':
    """``fn`` lowered for ``args`` (arrays or ``jax.ShapeDtypeStruct``)."""
    entry = self._entry(args)
    if entry is None:
      raise ValueError('HoistedJit.lower: the function closes over values of an '
                       'enclosing trace; lower it outside that trace.')
    jitted, consts, _ = entry
    return _Lowered(jitted.lower(consts, *args), consts)

  def _cache_size(self) -> int:
    """Executables compiled by calls (not by ``lower(...).compile()``)."""
    return sum(jitted._cache_size() for jitted, _, _ in self._entries.values())  # pylint: disable=protected-access


def _signature(x: Any) -> Any:
  """What a program traced for ``x`` depends on: its shape, dtype and weak
  type, and its sharding only where typed by an Explicit mesh axis (an
  array laid out on an Auto mesh traces as one on a single device);
  :data:`_DELETED` for an array whose buffer is deleted."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
    return _DELETED
  aval = jax.api_util.shaped_abstractify(x)
  mesh = getattr(getattr(aval, 'sharding', None), 'mesh', None)
  if jax.sharding.AxisType.Explicit in getattr(mesh, 'axis_types', ()):
    return aval
  return (aval.shape, aval.dtype, aval.weak_type)


def _own_cpu_mesh(jaxpr: Any) -> Any:
  """The mesh of CPU devices of the first ``shard_map`` in ``jaxpr`` (or a
  jaxpr in it), traced with no mesh set: one that the program's maps chose
  by themselves; None if there is none."""
  for eqn in jaxpr.eqns:
    mesh = eqn.params.get('mesh') if eqn.primitive.name == 'shard_map' else None
    if (isinstance(mesh, jax.sharding.Mesh) and
        all(d.platform == 'cpu' for d in mesh.devices.flat)):
      return mesh
    for sub in jex_core.jaxprs_in_params(eqn.params):
      found = _own_cpu_mesh(getattr(sub, 'jaxpr', sub))
      if found is not None:
        return found
  return None


class DeletedArgumentError(ValueError):
  """An argument's array was deleted, e.g. a state donated to an earlier round."""


_DELETED = object()  # The signature entry of an array whose buffer is deleted.


def _inlined(eqn) -> bool:
  """Whether ``eqn`` is a ``jit`` call with constants that is evaluated inline."""
  return (eqn.primitive is primitives.jit_p and bool(eqn.params['jaxpr'].consts)
          and fused_updates.places_nothing(eqn.params))


def _nested_constants(jaxpr, found: dict[int, Any]) -> None:
  """Adds to ``found`` (by ``id``) the constants of inlined ``jit`` calls."""
  for eqn in jaxpr.eqns:
    if _inlined(eqn):
      inner = eqn.params['jaxpr']
      for c in inner.consts:
        found.setdefault(id(c), c)
      _nested_constants(inner.jaxpr, found)


def _evaluate(jaxpr, top_ids, ids, out_tree, consts, *args):
  """``jaxpr`` on ``args``, reading each constant from ``consts`` (by the
  ``id`` of the value it stands for)."""
  by_id = dict(zip(ids, consts))
  out = _run(jaxpr, [by_id[i] for i in top_ids], jax.tree.leaves(args), by_id)
  return jax.tree.unflatten(out_tree, out)


def _run(jaxpr, consts, args, by_id):
  env: dict[Any, Any] = {}
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  for v, x in (*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    with eqn.ctx.manager:
      if _inlined(eqn):
        inner = eqn.params['jaxpr']
        outs = _run(inner.jaxpr, [by_id[id(c)] for c in inner.consts], ins, by_id)
      else:
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
        outs = outs if eqn.primitive.multiple_results else [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


class _Lowered:
  """``jax.stages.Lowered`` whose compiled form takes ``fn``'s arguments."""

  def __init__(self, lowered: Any, consts: list[Any]):
    self._lowered = lowered
    self._consts = consts

  def compile(self, *args: Any, **kwargs: Any) -> '_Compiled':
    return _Compiled(self._lowered.compile(*args, **kwargs), self._consts)

  def __getattr__(self, name: str) -> Any:  # as_text, cost_analysis, ...
    return getattr(self._lowered, name)


class _Compiled:
  """``jax.stages.Compiled`` called with ``fn``'s arguments alone."""

  def __init__(self, compiled: Any, consts: list[Any]):
    self._compiled = compiled
    self._consts = consts

  def __call__(self, *args: Any) -> Any:
    return self._compiled(self._consts, *args)

  def __getattr__(self, name: str) -> Any:  # memory_analysis, as_text, ...
    return getattr(self._compiled, name)


def jit(fn: Callable[..., Any], *, donate_argnums: Sequence[int] = ()) -> HoistedJit:
  """``jax.jit(fn, donate_argnums=...)``, but the arrays ``fn`` closes over
  are arguments of the compiled program, not constants embedded in it.

  Args:
    fn: a function of arrays (pytrees of arrays) to arrays.
    donate_argnums: positions of ``fn``'s arguments whose buffers the call
      may reuse, as for ``jax.jit``; the closed-over arrays are never
      donated.
  """
  return HoistedJit(fn, donate_argnums)


__all__ = ['DeletedArgumentError', 'HoistedJit', 'jit']
