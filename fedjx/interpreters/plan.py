"""Recovering the MapReduce structure of a traced fedjx program.

A fedjx program traced with ``jax.make_jaxpr`` is a sequence of equations on
*server* values (unplaced) and *placed* values. :func:`trace_plan` turns it into
a :class:`Plan`: a list of steps that an interpreter outside JAX can run,

* :class:`ServerStep`: a block of ordinary JAX equations on server values
  (server code between MapReduce stages);
* :class:`BroadcastStep`: a server value made available to every client;
* :class:`MapStep`: the per-client computation of a ``map_fn`` (recovered from
  the body of the ``scan`` that the ``sequential`` strategy produces), or an
  operation on client values outside ``map_fn`` that acts on each client's
  slice alone (elementwise, or a reshape keeping the client axis first);
* :class:`ReduceStep`: ``sum``, ``mean`` or ``weighted_mean`` over clients,
  or ``collect`` (the per-client values stacked on the server, for a gather
  or scatter of a server array at client-held indices, as in SCAFFOLD).

Every step carries what it reads and writes (``reads``, ``writes``, and
``placed_reads``: the values it reads one slice per client), set once when
it is made; the plan carries which inputs the clients hold (``arg_ids``,
``client_args``), which server value each broadcast value is
(``broadcast_sources``) and which values are read after each step
(``live_after``). The interpreters (:mod:`fedjx.interpreters.beam`,
:mod:`fedjx.interpreters.export`, :mod:`fedjx.streaming` and
:func:`evaluate`) read these instead of working them out again.

Every value has an integer id. A value's *kind* says where it lives:
``'server'`` (an array on the server; it may still be used as a placed value
whose leading axis indexes the clients, for example per-client random keys),
``'broadcast'`` (a server value seen by every client), or ``'client'`` (one
slice per client, held by the clients).

Other computation on client values outside ``map_fn`` cannot be placed:
tracing raises :class:`UnplaceableOperationError` naming the operation and the
lines that made it. Transformed programs (``jax.grad`` or ``jax.jvp`` of a
round) are plans too: the rules of the primitives are written with the
primitives (the transpose of ``broadcast`` is ``reduce_sum``) and the
backward pass of a map is a map.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util  # No public API reads an eqn's frames.
from jax.extend import core as jex_core

from fedjx import frames
from fedjx import primitives
from fedjx import reductions

__all__ = [
    'BROADCAST', 'BroadcastStep', 'CLIENT', 'MAP_NAME_PREFIX', 'MapStep',
    'Plan', 'REDUCTIONS', 'ReduceStep', 'SERVER', 'ServerStep', 'Step',
    'GATHER_SCOPE', 'UnplaceableOperationError', 'accumulator_dtype', 'combine',
    'evaluate', 'from_host', 'gather_to_server', 'host_spec', 'is_key',
    'on_host_values', 'to_host',
    'trace_plan', 'trace_plan_with_clients', 'weighted_mean_result',
]

SERVER, BROADCAST, CLIENT = 'server', 'broadcast', 'client'
REDUCTIONS = primitives.REDUCTIONS
MAP_NAME_PREFIX = 'fedjx_map_'


class UnplaceableOperationError(ValueError):
  """An operation mixes client values outside ``map_fn``."""


# What a step reads and writes, set once when the step is made: ``reads``
# (every value it uses), ``writes`` (the values it defines) and
# ``placed_reads`` (those it reads one slice per client). Every interpreter
# and analysis (liveness, Beam, export's stages, streaming's passes) uses
# these instead of working them out from the step's type.
_ACCESS = dataclasses.field(init=False, repr=False)


def _set_access(step, reads, writes, placed_reads=()) -> None:
  object.__setattr__(step, 'reads', tuple(reads))
  object.__setattr__(step, 'writes', tuple(writes))
  object.__setattr__(step, 'placed_reads', tuple(placed_reads))


def _as_tuples(step, *names) -> None:
  for name in names:
    object.__setattr__(step, name, tuple(getattr(step, name)))


@dataclasses.dataclass(frozen=True, eq=False)
class ServerStep:
  """Runs JAX equations on server values: ``outs = fn(*ins)``.

  ``in_ids`` are the values it reads that earlier steps (or the inputs)
  define, ``out_ids`` those it defines that later steps or the outputs read,
  ``consts`` the constants its equations use.
  """
  eqns: tuple[Any, ...]      # (eqn, in_ids, out_ids) triples, in order
  in_ids: tuple[int, ...]
  out_ids: tuple[int, ...]
  consts: dict[int, Any]
  reads: tuple[int, ...] = _ACCESS
  writes: tuple[int, ...] = _ACCESS
  placed_reads: tuple[int, ...] = _ACCESS

  def __post_init__(self):
    _as_tuples(self, 'eqns', 'in_ids', 'out_ids')
    _set_access(self, self.in_ids, self.out_ids)

  def function(self) -> Callable[..., tuple[Any, ...]]:
    eqns, in_ids, out_ids, consts = self.eqns, self.in_ids, self.out_ids, self.consts

    def run(*ins):
      env = dict(consts)
      env.update(zip(in_ids, ins))
      for eqn, eqn_in, eqn_out in eqns:
        _bind(eqn, [env[i] for i in eqn_in], eqn_out, env)
      return tuple(env[i] for i in out_ids)
    return run


@dataclasses.dataclass(frozen=True, eq=False)
class BroadcastStep:
  """The server value ``in_id``, seen by every client as ``out_id``."""
  in_id: int
  out_id: int
  reads: tuple[int, ...] = _ACCESS
  writes: tuple[int, ...] = _ACCESS
  placed_reads: tuple[int, ...] = _ACCESS

  def __post_init__(self):
    _set_access(self, (self.in_id,), (self.out_id,))


@dataclasses.dataclass(frozen=True, eq=False)
class MapStep:
  """``outs_i = body(*consts, *[x[i] for x in xs])`` for each client ``i``."""
  body: Any                   # ClosedJaxpr of one client's computation
  const_ids: tuple[int, ...]  # server values passed whole
  x_ids: tuple[int, ...]      # placed inputs (any kind)
  out_ids: tuple[int, ...]    # client values
  lifted: bool = False        # an op lifted from outside map_fn (elementwise
                              # on client values), not a map_fn body
  reads: tuple[int, ...] = _ACCESS
  writes: tuple[int, ...] = _ACCESS
  placed_reads: tuple[int, ...] = _ACCESS

  def __post_init__(self):
    _as_tuples(self, 'const_ids', 'x_ids', 'out_ids')
    _set_access(self, self.const_ids + self.x_ids, self.out_ids, self.x_ids)

  def function(self) -> Callable[..., Any]:
    return jex_core.jaxpr_as_fun(self.body)


@dataclasses.dataclass(frozen=True, eq=False)
class ReduceStep:
  """``out = op_i x_i`` over the clients (``w_i``-weighted for a weighted mean)."""
  op: str                    # 'sum' | 'mean' | 'weighted_mean' | 'collect'
  x_id: int
  weight_id: int | None
  out_id: int
  why: str | None = None     # a 'collect' of gather_to_server: why it stacks
  reads: tuple[int, ...] = _ACCESS
  writes: tuple[int, ...] = _ACCESS
  placed_reads: tuple[int, ...] = _ACCESS

  def __post_init__(self):
    operands = (self.x_id,) if self.weight_id is None else (self.x_id, self.weight_id)
    _set_access(self, operands, (self.out_id,), operands)


Step = ServerStep | BroadcastStep | MapStep | ReduceStep


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """A fedjx program as steps over ids (see the module docstring).

  Attributes:
    steps: the steps, in an order that runs them.
    in_ids: the flat inputs' ids, in order; ``arg_ids[k]`` are those of
      positional argument ``k``, and the arguments at ``client_args`` are
      held by the clients (``client_in_ids``; the others are
      ``server_in_ids``).
    out_ids, in_tree, out_tree: the flat outputs and the pytrees.
    avals, kinds: every value's abstract value and kind.
    consts: values known when tracing (literals, closed-over arrays).
    broadcast_sources: for each broadcast value, the server value it is.
    live_after: for each step index, the values that later steps or the
      outputs read.
    num_clients: the size of the placement.
    placement: its name (e.g. ``'clients'``), from the program's maps,
      broadcasts and reductions; None when it has none of them.
  """
  steps: tuple[Step, ...]
  in_ids: tuple[int, ...]
  out_ids: tuple[int, ...]
  in_tree: Any
  out_tree: Any
  avals: dict[int, Any]
  kinds: dict[int, str]
  consts: dict[int, Any]
  num_clients: int
  arg_ids: tuple[tuple[int, ...], ...] = ()
  client_args: tuple[int, ...] = ()
  broadcast_sources: dict[int, int] = dataclasses.field(default_factory=dict)
  live_after: tuple[frozenset[int], ...] = ()
  placement: str | None = None

  @property
  def client_in_ids(self) -> tuple[int, ...]:
    """The flat inputs the clients hold, in argument order."""
    return tuple(i for k in self.client_args for i in self.arg_ids[k])

  @property
  def server_in_ids(self) -> tuple[int, ...]:
    """The flat server inputs, in argument order."""
    return tuple(i for k, ids in enumerate(self.arg_ids)
                 if k not in self.client_args for i in ids)

  def source(self, i: int) -> int:
    """The server value a broadcast value ``i`` is (else ``i``)."""
    return self.broadcast_sources.get(i, i)


def _bind(eqn, invals, out_ids, env):
  params = eqn.primitive.get_bind_params(eqn.params)
  ctx = getattr(eqn, 'ctx', None)
  if ctx is not None:
    with ctx.manager:
      outs = eqn.primitive.bind(*invals, **params)
  else:
    outs = eqn.primitive.bind(*invals, **params)
  if not eqn.primitive.multiple_results:
    outs = [outs]
  env.update(zip(out_ids, outs))


class _Builder:
  """Linearises a jaxpr into steps, inlining jitted calls that touch clients."""

  def __init__(self):
    self.next_id = 0
    self.avals: dict[int, Any] = {}
    self.kinds: dict[int, str] = {}
    self.consts: dict[int, Any] = {}
    self.steps: list[Step] = []
    self.server_block: list[Any] = []
    self.num_clients: int | None = None
    self.placement: str | None = None
    self.broadcast_source: dict[int, int] = {}
    self.collected: dict[int, int] = {}

  def new_id(self, aval, kind):
    i = self.next_id
    self.next_id += 1
    self.avals[i] = aval
    self.kinds[i] = kind
    return i

  def read(self, env, var):
    if isinstance(var, jex_core.Literal):
      i = self.new_id(var.aval, SERVER)
      self.consts[i] = var.val
      return i
    return env[var]

  def set_clients(self, n, what, placement=None):
    if placement is not None and self.placement is None:
      self.placement = placement
    if self.num_clients is None:
      self.num_clients = n
    elif n != self.num_clients:
      raise UnplaceableOperationError(
          f'fedjx: {what} has {n} clients but the program already uses '
          f'{self.num_clients}; interpreters support one placement.')

  def flush(self):
    if self.server_block:
      # In and out ids are set by _liveness, once the whole program is seen.
      self.steps.append(ServerStep(self.server_block, (), (), {}))
      self.server_block = []

  def server_eqn(self, eqn, in_ids):
    out_ids = [self.new_id(v.aval, SERVER) for v in eqn.outvars]
    self.server_block.append((eqn, in_ids, out_ids))
    return out_ids

  def collect(self, i, why=None):
    """A client value gathered to the server as an array of shape [n, ...]."""
    if self.kinds[i] != CLIENT:
      return i
    if i not in self.collected:
      self.flush()
      self.collected[i] = self.new_id(self.avals[i], SERVER)
      self.steps.append(ReduceStep('collect', i, None, self.collected[i], why))
    return self.collected[i]

  def materialize(self, i):
    """A broadcast value as a server array of shape [n, ...]."""
    if self.kinds[i] != BROADCAST:
      return i
    src = self.broadcast_source[i]
    out = self.new_id(self.avals[i], SERVER)
    self.server_block.append((_BroadcastToEqn(self.num_clients), [src], [out]))
    return out

  def run(self, jaxpr, in_ids):
    env = dict(zip(jaxpr.invars, in_ids))
    for eqn in jaxpr.eqns:
      ids = [self.read(env, v) for v in eqn.invars]
      kinds = [self.kinds[i] for i in ids]
      prim = eqn.primitive
      name = eqn.params.get('name', '') if 'jaxpr' in eqn.params else ''
      if prim is primitives.broadcast_p:
        if kinds[0] != SERVER:
          raise UnplaceableOperationError(
              'fedjx: broadcast of a placed value (nested placements) cannot be '
              'interpreted; interpreters support one placement.')
        self.set_clients(eqn.params['n'], 'broadcast', eqn.params['placement'])
        out = self.new_id(eqn.outvars[0].aval, BROADCAST)
        self.broadcast_source[out] = ids[0]
        self.flush()
        self.steps.append(BroadcastStep(ids[0], out))
        outs = [out]
      elif prim in REDUCTIONS:
        self.set_clients(eqn.invars[0].aval.shape[0], prim.name,
                         eqn.params['placement'])
        if all(k != CLIENT for k in kinds):
          outs = self.server_eqn(eqn, [self.materialize(i) for i in ids])
        else:
          self.flush()
          out = self.new_id(eqn.outvars[0].aval, SERVER)
          self.steps.append(ReduceStep(REDUCTIONS[prim], ids[0],
                                       ids[1] if len(ids) > 1 else None, out))
          outs = [out]
      elif name.startswith(MAP_NAME_PREFIX):
        outs = self.map_eqn(eqn, ids)
      elif prim.name in _INLINED and _uses_fedjx(_inlined_jaxpr(eqn)):
        # jax.checkpoint and custom derivative rules compute their primal
        # function's values: the plan runs that function.
        body = _inlined_jaxpr(eqn)
        outs = (self.run(body, ids) if isinstance(body, jex_core.Jaxpr)
                else self.run_closed(body, ids))
      elif any(_uses_fedjx(sub) for sub in jex_core.jaxprs_in_params(eqn.params)
               ) and not name:
        raise _control_flow(eqn)
      elif 'jaxpr' in eqn.params and name and (
          any(k != SERVER for k in kinds) or _uses_fedjx(eqn.params['jaxpr'].jaxpr)):
        outs = self.run_closed(eqn.params['jaxpr'], ids)
      elif all(k != CLIENT for k in kinds):
        outs = self.server_eqn(eqn, [self.materialize(i) for i in ids])
      elif (form := _per_client_form(eqn, kinds, self.num_clients)) is not None:
        outs = self.lift_per_client(eqn, ids, form)
      elif prim.name in _INDEXING:
        why = _gathered_why(eqn)
        outs = self.server_eqn(eqn, [self.materialize(self.collect(i, why))
                                     for i in ids])
      else:
        raise _unplaceable(eqn)
      for v, i in zip(eqn.outvars, outs):
        env[v] = i
    return [self.read(env, v) for v in jaxpr.outvars]

  def run_closed(self, closed, in_ids):
    const_ids = []
    for c, v in zip(closed.consts, closed.jaxpr.constvars):
      i = self.new_id(v.aval, SERVER)
      self.consts[i] = c
      const_ids.append(i)
    jaxpr = closed.jaxpr
    env_ids = const_ids + list(in_ids)
    wrapper = jex_core.Jaxpr([], list(jaxpr.constvars) + list(jaxpr.invars),
                             jaxpr.outvars, jaxpr.eqns, jaxpr.effects)
    return self.run(wrapper, env_ids)

  def map_eqn(self, eqn, ids):
    """A ``fedjx_map_*`` call: its scan's body is the per-client computation.

    Besides the scan over clients, the traced map may hold computations on
    server values only (e.g. loop invariants hoisted by differentiation);
    those run as server code.
    """
    name = eqn.params['name']
    inner = eqn.params['jaxpr']
    env = dict(zip(inner.jaxpr.invars, ids))
    for c, v in zip(inner.consts, inner.jaxpr.constvars):
      i = self.new_id(v.aval, SERVER)
      self.consts[i] = c
      env[v] = i
    found_scan = False
    client_scans = [e for e in inner.jaxpr.eqns
                    if e.primitive.name == 'scan' and _scan_counts(e)[1] == 0]
    n = self.num_clients
    if n is None and client_scans:
      n = client_scans[-1].params['length']
    for e in inner.jaxpr.eqns:
      e_ids = [self.read(env, v) for v in e.invars]
      kinds = [self.kinds[i] for i in e_ids]
      if (e.primitive.name == 'scan' and _scan_counts(e)[1] == 0 and
          e.params['length'] == n and
          (any(k != SERVER for k in kinds) or
           any(v.aval.ndim and v.aval.shape[0] == n
               for v in e.invars[_scan_counts(e)[0]:]))):
        outs = self.scan_over_clients(e, e_ids, name)
        found_scan = True
      elif all(k != CLIENT for k in kinds):
        outs = self.server_eqn(e, [self.materialize(i) for i in e_ids])
      else:
        outs = None
      if outs is None:
        raise UnplaceableOperationError(
            f'fedjx: cannot recover the per-client computation of {name!r} '
            f'(found {e.primitive.name!r} on client values); trace the program '
            "under fedjx.frames.force_map_strategy('sequential') with no "
            'mesh.')
      for v, i in zip(e.outvars, outs):
        env[v] = i
    if not found_scan:
      raise UnplaceableOperationError(
          f'fedjx: {name!r} has no scan over clients; trace the program under '
          "fedjx.frames.force_map_strategy('sequential') with no mesh.")
    return [self.read(env, v) for v in inner.jaxpr.outvars]

  def lift_per_client(self, eqn, ids, form):
    """An op that acts on each client's slice alone, run per client.

    Operands with a leading axis of the number of clients are sliced (client
    values, and server arrays of that shape); server operands of the output's
    rank with a leading axis of 1 (implicit broadcasting) lose that axis;
    others (scalars, literals) are passed whole.
    """
    prim, params, modes = form
    const_ids = [i for i, m in zip(ids, modes) if m != _PLACED]
    x_ids = [i for i, m in zip(ids, modes) if m == _PLACED]

    def one_client(*args):
      consts = iter(args[:len(const_ids)])
      xs = iter(args[len(const_ids):])
      operands = []
      for m in modes:
        if m == _PLACED:
          operands.append(next(xs))
        else:
          c = next(consts)
          operands.append(c[0] if m == _SQUEEZED else c)
      out = prim.bind(*operands, **params)
      return out if prim.multiple_results else [out]

    specs = ([jax.ShapeDtypeStruct(self.avals[i].shape, self.avals[i].dtype)
              for i in const_ids] +
             [jax.ShapeDtypeStruct(self.avals[i].shape[1:], self.avals[i].dtype)
              for i in x_ids])
    body = jax.make_jaxpr(one_client)(*specs)
    self.flush()
    out_ids = [self.new_id(v.aval, CLIENT) for v in eqn.outvars]
    self.steps.append(MapStep(body, [self.materialize(i) for i in const_ids],
                              x_ids, out_ids, lifted=True))
    return out_ids

  def scan_over_clients(self, scan, scan_ids, name):
    num_consts, _ = _scan_counts(scan)
    const_ids, x_ids = scan_ids[:num_consts], scan_ids[num_consts:]
    for i in const_ids:
      if self.kinds[i] == CLIENT:
        raise UnplaceableOperationError(
            'fedjx: a function given to map_fn closes over a client value; pass '
            "placed values through map_fn's arguments instead.")
    self.set_clients(scan.params['length'], name, name[len(MAP_NAME_PREFIX):])
    const_ids = [self.materialize(i) for i in const_ids]
    self.flush()
    out_ids = [self.new_id(v.aval, CLIENT) for v in scan.outvars]
    body = scan.params['jaxpr']
    self.steps.append(MapStep(body, const_ids, x_ids, out_ids))
    return out_ids


def _scan_counts(scan):
  """``(number of constants, number of carries)`` of a scan equation.

  JAX releases name them ``num_consts``/``num_carry``; later ones pack the
  operands as a flat tree ``ft_in`` of (constants, carries, scanned inputs).
  """
  params = scan.params
  if 'num_consts' in params:
    return params['num_consts'], params['num_carry']
  consts, carry, _ = params['ft_in'].unpack()
  return len(consts), len(carry)


# Elementwise primitives: on placed operands, each client's output depends on
# its own slice only.
_ELEMENTWISE = frozenset((
    'abs', 'acos', 'acosh', 'add', 'add_any', 'and', 'asin', 'asinh', 'atan',
    'atan2', 'atanh', 'cbrt', 'ceil', 'clamp', 'convert_element_type', 'copy', 'copy_p',
    'cos', 'cosh', 'div', 'eq', 'erf', 'erf_inv', 'exp', 'exp2', 'expm1',
    'floor', 'ge', 'gt', 'integer_pow', 'is_finite', 'le', 'log', 'log1p',
    'logistic', 'lt', 'max', 'min', 'mul', 'ne', 'neg', 'nextafter', 'not',
    'or', 'pow', 'reduce_precision', 'rem', 'round', 'rsqrt', 'select_n',
    'shift_left', 'shift_right_arithmetic', 'shift_right_logical', 'sign',
    'sin', 'sinh', 'sqrt', 'square', 'stop_gradient', 'sub', 'tan', 'tanh',
    'xor'))
_AXIS_REDUCTIONS = frozenset(('reduce_sum', 'reduce_max', 'reduce_min',
                              'reduce_prod', 'reduce_and', 'reduce_or',
                              'argmax', 'argmin'))
# How an operand reaches the per-client form of a lifted op.
_PLACED, _WHOLE, _SQUEEZED = 'placed', 'whole', 'squeezed'


def _per_client_form(eqn, kinds, n):
  """``(primitive, params, operand modes)`` computing ``eqn`` on one client's
  slice, or None if the op mixes clients.

  Lifted: elementwise ops (with implicit broadcasting of size-1 axes),
  reductions over non-client axes, and reshapes, ``broadcast_in_dim`` s, transposes and
  squeezes that keep the client axis first.
  """
  name = eqn.primitive.name
  params = dict(eqn.params)
  avals = [v.aval for v in eqn.invars]
  out = eqn.outvars[0].aval
  if n is None or not out.ndim or out.shape[0] != n:
    return None

  def leading_n(aval):
    return aval.ndim > 0 and aval.shape[0] == n

  if name in _ELEMENTWISE:
    modes = []
    for aval, kind in zip(avals, kinds):
      if aval.ndim == 0:
        modes.append(_WHOLE)
      elif aval.ndim != out.ndim:
        return None
      elif leading_n(aval):
        modes.append(_PLACED)
      elif kind == SERVER and aval.shape[0] == 1:
        modes.append(_SQUEEZED)
      else:
        return None
    return eqn.primitive, params, modes
  if len(avals) != 1 or not leading_n(avals[0]) or kinds[0] == SERVER:
    return None
  if name in _AXIS_REDUCTIONS:
    axes = tuple(params['axes'])
    if 0 in axes:
      return None
    params['axes'] = tuple(a - 1 for a in axes)
  elif name == 'reshape':
    if params.get('dimensions') is not None or params['new_sizes'][0] != n:
      return None
    params['new_sizes'] = tuple(params['new_sizes'][1:])
  elif name == 'broadcast_in_dim':
    dims = tuple(params['broadcast_dimensions'])
    if not dims or dims[0] != 0 or params['shape'][0] != n:
      return None
    params['shape'] = tuple(params['shape'][1:])
    params['broadcast_dimensions'] = tuple(d - 1 for d in dims[1:])
  elif name == 'transpose':
    perm = tuple(params['permutation'])
    if perm[0] != 0:
      return None
    params['permutation'] = tuple(p - 1 for p in perm[1:])
  elif name == 'squeeze':
    if 0 in params['dimensions']:
      return None
    params['dimensions'] = tuple(d - 1 for d in params['dimensions'])
  else:
    return None
  if 'sharding' in params:
    params['sharding'] = None
  return eqn.primitive, params, [_PLACED]


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _where(eqn, depth: int = 3) -> str:
  """`` at file:line (function) <- ...``: the innermost frames (outside JAX)
  of the code that made ``eqn``, so an error names what the user wrote."""
  try:
    frames = [f for f in source_info_util.user_frames(eqn.source_info.traceback)
              if not f.file_name.startswith(_PACKAGE_DIR)][:depth]
  except Exception:  # pragma: no cover - a JAX without it
    return ''
  if not frames:
    return ''
  return ' at ' + ' <- '.join(
      f'{os.path.basename(f.file_name)}:{f.start_line} ({f.function_name})'
      for f in frames)


# Indexing with client-held indices (per-client state looked up or written by
# client id, as in SCAFFOLD): the client operands are collected to the server
# (a 'collect' step, which stacks them in client order) and the op runs there.
_INDEXING = frozenset(('gather', 'scatter', 'scatter-add', 'scatter-sub',
                       'scatter-mul', 'scatter-min', 'scatter-max'))


# The named scope of gather_to_server: ``fedjx_gather[<why>]``.
GATHER_SCOPE = 'fedjx_gather'
_GATHER_WHY = re.compile(re.escape(GATHER_SCOPE) + r'\[([^\]]*)\]')


def gather_to_server(x: Any, why: str) -> Any:
  """Placed values as server arrays ``[n, ...]``, for rules reading all at once.

  Server code that needs every client's value at the same time (order
  statistics over the cohort, pairwise distances) reads them stacked: this is
  ``x[arange(n)]`` for each leaf (a gather, which XLA compiles to nothing),
  traced in the named scope ``fedjx_gather[why]``. A plan makes it a
  ``'collect'`` step (:class:`ReduceStep`) carrying ``why``: Beam and
  :func:`evaluate` stack the values, and the streaming executor, which never
  holds every client, refuses the plan with ``why`` in its message. ``why``
  says what needs them, e.g. ``"the aggregator 'median' needs every update
  at once (a coordinate-wise order statistic)"``; it holds no ``]``.
  """
  if not isinstance(why, str) or not why or ']' in why:
    raise ValueError(f'fedjx.plan.gather_to_server: why={why!r} must be a '
                     'non-empty string without "]".')
  mesh = jax.sharding.get_abstract_mesh()
  explicit = not (mesh is None or mesh.empty) and (
      jax.sharding.AxisType.Explicit in mesh.axis_types)

  def gather(a):
    if explicit:  # Stacked on the server: replicated, then indexed.
      a = jax.sharding.reshard(a, jax.sharding.PartitionSpec())
    return a[jnp.arange(jnp.shape(a)[0])]

  with jax.named_scope(f'{GATHER_SCOPE}[{why}]'):
    return jax.tree.map(gather, x)


def _gathered_why(eqn) -> str | None:
  """The ``why`` of the :func:`gather_to_server` that made ``eqn``, if any."""
  found = _GATHER_WHY.search(str(getattr(eqn.source_info, 'name_stack', '')))
  return found.group(1) if found else None


def _unplaceable(eqn) -> UnplaceableOperationError:
  name = eqn.primitive.name
  hint = ('Outside map_fn, client values may only go through elementwise '
          'operations, reductions over non-client axes, reshapes, broadcasts, '
          'transposes or squeezes that keep the client axis first, and '
          'gathers/scatters of server arrays at client-held indices '
          '(docs/beam.md).')
  return UnplaceableOperationError(
      f'fedjx: the operation {name!r}{_where(eqn)} combines client values '
      f'outside map_fn, so it cannot be placed. Move it into the function given '
      f'to fedjx.map_fn. {hint}')


_FEDJX_PRIMITIVES = (primitives.broadcast_p, *REDUCTIONS)
# Equations whose value is that of one sub-jaxpr, run as it is.
_INLINED = {'remat2': 'jaxpr', 'checkpoint': 'jaxpr',
            'custom_jvp_call': 'call_jaxpr', 'custom_vjp_call': 'call_jaxpr'}


def _inlined_jaxpr(eqn):
  return eqn.params[_INLINED[eqn.primitive.name]]


def _control_flow(eqn) -> UnplaceableOperationError:
  """The one-line refusal of a fedjx primitive inside a loop or a branch."""
  return UnplaceableOperationError(
      f'fedjx: {eqn.primitive.name!r}{_where(eqn)} runs fedjx primitives '
      '(map_fn, broadcast or a reduction) inside a loop or a branch, which a '
      'plan cannot interpret: Beam, export and streaming run a round as a '
      'fixed sequence of steps. Keep the control flow outside the program (a '
      'loop over rounds around it), or run the program compiled.')


def _uses_fedjx(jaxpr) -> bool:
  """Whether a jaxpr (or one nested in it) calls a fedjx primitive or map."""
  for eqn in jaxpr.eqns:
    if eqn.primitive in _FEDJX_PRIMITIVES:
      return True
    if str(eqn.params.get('name', '')).startswith(MAP_NAME_PREFIX):
      return True
    for sub in jex_core.jaxprs_in_params(eqn.params):
      if _uses_fedjx(sub):
        return True
  return False


class _BroadcastToEqn:
  """Duck-typed equation: ``jnp.broadcast_to(x, (n, ...))``."""

  def __init__(self, n):
    self.n = n
    self.primitive = self
    self.params = {}
    self.multiple_results = False

  def get_bind_params(self, params):
    return {}

  def bind(self, x):
    return jnp.broadcast_to(x, (self.n,) + jnp.shape(x))


def _liveness(steps: Sequence[Step], consts: dict[int, Any],
              out_ids: Sequence[int]) -> tuple[list[Step], list[frozenset[int]]]:
  """The steps with each server block's inputs and the outputs used after it
  set (blocks whose outputs nobody reads are dropped), and for each kept
  step the values read after it."""
  needed = set(out_ids)
  kept, after = [], []
  for step in reversed(steps):
    if isinstance(step, ServerStep):
      defined = {o for _, _, outs in step.eqns for o in outs}
      used = {i for _, ins, _ in step.eqns for i in ins}
      step_consts = {i: consts[i] for i in used if i in consts}
      step = ServerStep(step.eqns, sorted((used - defined) - set(step_consts)),
                        sorted(defined & needed), step_consts)
      if not step.out_ids:
        continue
    kept.append(step)
    after.append(frozenset(needed))
    needed = (needed - set(step.writes)) | set(step.reads)
  return kept[::-1], after[::-1]


def trace_plan(fn: Callable[..., Any], *args: Any) -> Plan:
  """Traces ``fn(*args)`` (a fedjx program) into a :class:`Plan`.

  Args:
    fn: a function that calls a ``fedjx.program`` (or is one).
    *args: example arguments or ``jax.ShapeDtypeStruct`` pytrees, all taken
      as server values.

  Returns:
    The plan. Its inputs are all server values; use
    :func:`trace_plan_with_clients` to mark inputs that clients hold.
  """
  return trace_plan_with_clients(fn, args, client_args=())


# The empty mesh: a plan is traced with none, whatever mesh is set.
_NO_MESH = jax.sharding.Mesh(np.empty((), dtype=object), ())


def _unplaced_spec(x: Any) -> jax.ShapeDtypeStruct:
  """``x``'s shape and dtype (weak or not), without the mesh its type names."""
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def trace_plan_with_clients(fn: Callable[..., Any], args: Sequence[Any],
                            client_args: Sequence[int]) -> Plan:
  """Like :func:`trace_plan`; ``args[i]`` for ``i`` in ``client_args`` are
  placed values held by the clients (e.g. a cohort).

  The program is traced from the shapes and dtypes of ``args`` (not their
  shardings), with ``map_fn``'s ``'sequential'`` strategy and no mesh,
  whatever mesh is set (``jax.set_mesh``): a plan is the program's MapReduce
  structure, not a layout on devices. On a mesh, ``map_fn`` would
  lay the clients over the devices (vmapped rows of clients, sharding
  constraints on them), and the per-client computation could not be read
  from the scan's body; each interpreter places the plan's steps on its own
  devices (:mod:`fedjx.streaming` splits a chunk's clients over the mesh).
  """
  # The forced strategy and the mesh are part of JAX's cache keys, so a
  # jitted ``fn`` traced here neither reuses nor replaces its ordinary traces.
  # The plan's own traces (per-client forms of operations) see no mesh either.
  with frames.force_map_strategy('sequential'), jax.set_mesh(_NO_MESH):
    return _trace_plan(fn, tuple(args), client_args)


def _trace_plan(fn, args, client_args) -> Plan:
  specs = jax.tree.map(_unplaced_spec, args)
  closed, out_shape = jax.make_jaxpr(lambda *a: fn(*a), return_shape=True)(*specs)
  _, in_tree = jax.tree.flatten(args)
  arg_leaves = [len(jax.tree.leaves(arg)) for arg in args]
  client_leaf = []
  for position, count in enumerate(arg_leaves):
    client_leaf += [position in client_args] * count
  builder = _Builder()
  in_ids = [builder.new_id(v.aval, CLIENT if is_client else SERVER)
            for v, is_client in zip(closed.jaxpr.invars, client_leaf)]
  for v, is_client in zip(closed.jaxpr.invars, client_leaf):
    if is_client:
      builder.set_clients(v.aval.shape[0], 'a client argument')
  out_ids = builder.run_closed(closed, in_ids)
  builder.flush()
  if builder.num_clients is None:
    raise ValueError('fedjx: the program has no placed values to interpret.')
  steps, live_after = _liveness(builder.steps, builder.consts, out_ids)
  arg_ids, position = [], 0
  for count in arg_leaves:
    arg_ids.append(tuple(in_ids[position:position + count]))
    position += count
  return Plan(tuple(steps), tuple(in_ids), tuple(out_ids), in_tree,
              jax.tree.structure(out_shape), builder.avals, builder.kinds,
              builder.consts, builder.num_clients, arg_ids=tuple(arg_ids),
              client_args=tuple(sorted(set(client_args))),
              broadcast_sources=dict(builder.broadcast_source),
              live_after=tuple(live_after), placement=builder.placement)


def is_key(dtype) -> bool:
  """Whether ``dtype`` is a typed PRNG key dtype (``jax.random.key``)."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def host_spec(aval) -> jax.ShapeDtypeStruct:
  """How a value of ``aval`` travels outside JAX: keys as their key data."""
  spec = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
  return jax.eval_shape(jax.random.key_data, spec) if is_key(aval.dtype) else spec


def to_host(x: Any) -> np.ndarray:
  """A NumPy array of ``x``; a typed key array becomes its key data."""
  if is_key(getattr(x, 'dtype', None) or np.asarray(x).dtype):
    x = jax.random.key_data(x)
  return np.asarray(x)


def from_host(x: Any, aval) -> Any:
  """Inverse of :func:`to_host` for a value of ``aval``."""
  if is_key(aval.dtype):
    # The key's implementation is only reachable from its dtype.
    return jax.random.wrap_key_data(x, impl=aval.dtype._impl)
  return x


def on_host_values(fn: Callable[..., Any], avals: Sequence[Any]) -> Callable[..., Any]:
  """``fn`` taking and returning host values (key data for typed keys)."""
  def wrapped(*args):
    outs = fn(*[from_host(a, v) for a, v in zip(args, avals)])
    return tuple(jax.random.key_data(o) if is_key(o.dtype) else o for o in outs)
  return wrapped


def evaluate(plan: Plan, *flat_args: Any) -> list[Any]:
  """Runs a plan in-process, client by client (a reference interpreter)."""
  env: dict[int, Any] = dict(plan.consts)
  env.update(zip(plan.in_ids, flat_args))
  n = plan.num_clients
  bcast = plan.broadcast_sources

  def per_client(i, c):
    return env[bcast[i]] if i in bcast else env[i][c]

  for step in plan.steps:
    if isinstance(step, ServerStep):
      env.update(zip(step.out_ids, jax.jit(step.function())(
          *[env[i] for i in step.in_ids])))
    elif isinstance(step, MapStep):
      body = jax.jit(step.function())
      outs = [body(*[env[i] for i in step.const_ids],
                   *[per_client(i, c) for i in step.x_ids]) for c in range(n)]
      for k, o in enumerate(step.out_ids):
        env[o] = jnp.stack([out[k] for out in outs])
    elif isinstance(step, ReduceStep):
      xs = [per_client(step.x_id, c) for c in range(n)]
      ws = ([per_client(step.weight_id, c) for c in range(n)]
            if step.weight_id is not None else None)
      env[step.out_id] = combine(step.op, xs, ws, plan.avals[step.out_id].dtype)
    # A BroadcastStep computes nothing: its value is its source's.
  outs = []
  for i in plan.out_ids:
    outs.append(jnp.broadcast_to(env[bcast[i]], (n,) + jnp.shape(env[bcast[i]]))
                if i in bcast else env[i])
  return outs


def combine(op: str, xs: Sequence[Any], ws: Sequence[Any] | None, dtype) -> np.ndarray:
  """Sum, mean or weighted mean of per-client arrays, accumulated in 64 bits
  (:mod:`fedjx.reductions`), or, for ``'collect'``, the arrays stacked in
  client order."""
  if op == 'collect':
    return np.stack([np.asarray(x) for x in xs]).astype(dtype)
  if op != 'weighted_mean':
    acc = accumulator_dtype(np.asarray(xs[0]).dtype)
    total = np.sum([np.asarray(x, acc) for x in xs], axis=0)
    return reductions.finish(op, total, None, len(xs), dtype, xp=np)
  w = np.asarray([np.asarray(v, np.float64) for v in ws])
  numer = np.sum([reductions.expand_weights(wi, np.asarray(x, np.float64)) *
                  np.asarray(x, np.float64) for wi, x in zip(w, xs)], axis=0)
  return weighted_mean_result(numer, w.sum(axis=0), dtype)


accumulator_dtype = reductions.host_accumulator_dtype


def weighted_mean_result(numer, denom, dtype) -> np.ndarray:
  """``numer / denom``, zero where ``denom`` is (:func:`fedjx.reductions.finish`)."""
  return reductions.finish('weighted_mean', np.asarray(numer), denom, None, dtype,
                           xp=np)
