"""Fused map-reduce: reductions of ``map_fn`` outputs carried through its loop.

A round ``y = map_fn(f, xs); g = reduce_weighted_mean(y, w)`` with clients run
in ``m`` chunks of ``k`` would stack all ``n`` outputs ``y_i`` before the
reduction reads them: for 10,000 clients of a 1.2M-parameter model, 48 GB.
When a ``map_fn`` output is read *only* by fedjx reductions of the same
placement, the loop over chunks instead carries the partial sums

    S_c = S_{c-1} + sum_{i in chunk c} w_i y_i,      W_c = W_{c-1} + sum w_i

(``w_i = 1`` for ``reduce_sum`` and ``reduce_mean``), and the reductions are
``S_m`` (sum), ``S_m / n`` (mean) and ``S_m / W_m`` (weighted mean, zero when
``W_m = 0``), so memory holds one chunk of outputs, never the cohort's.
Outputs read by anything else (SCAFFOLD's new controls, per-client metrics)
stay stacked. This is the map-reduce fusion of MapReduce combiners (Dean and
Ghemawat, OSDI 2004), applied to DrJAX's ``map_fn`` (arXiv 2403.07128).

Where it happens: :func:`fedjx.program` traces its function once with
``map_fn`` recording each call as an opaque ``fedjx_fusable_map`` equation
(the per-client jaxpr, its chunking and its inputs), then evaluates that
traced program with :func:`evaluate`, which runs each recorded map together
with the reductions that read its outputs. The evaluation binds ordinary JAX
operations (``lax.scan`` over chunks, ``vmap`` inside one), so ``jit``,
``grad``, ``jvp`` and ``vmap`` of the program see plain JAX and differentiate
it as they would any loop; algorithm code is unchanged.

On an Auto mesh axis named after the placement whose other axes have size
1 (:func:`fedjx.mapping.device_blocks`: each device holds whole models), the
loop runs under ``jax.shard_map``: each of the ``d`` devices runs its block
of ``n / d`` members as one device would (its own chunks, its own control
flow) and carries its own ``S^(dev)``; one ``psum`` gives
``S = sum_dev S^(dev)``.

It is skipped (the program runs exactly as written) when the program is
nested in another or declares several placements, when the placement is
sharded over any other mesh, when the map runs as a single chunk (``vmap``: all
outputs exist at once anyway), and while interpreters trace plans
(:func:`fedjx.frames.force_map_strategy`), so plans for Beam and export are
unchanged.

Sums accumulate in float32 (or the inputs' dtype when wider) whatever the
inputs' floating dtype, and are cast to the reduction's dtype at the end.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from fedjx import frames
from fedjx import mapping
from fedjx import primitives
from fedjx import reductions
from fedjx import sharding as sharding_lib

P = jax.sharding.PartitionSpec



class MapSpec:
  """One recorded ``map_fn`` call (hashed by identity, as an equation parameter).

  Attributes:
    jaxpr: the per-member computation, a jaxpr with constants ``consts`` and
      inputs ``(*placed_member, *shared)``, with flat outputs.
    num_consts: values the mapped function closed over.
    num_placed: placed inputs (sliced per member); the rest are shared.
    n: members of the placement.
    k: members per chunk.
    placement: the placement's name.
    out_avals: the stacked outputs' avals (leading axis ``n``).
    by_cost: whether the last operand is each member's cost, from which the
      chunks are formed (:func:`fedjx.mapping.chunk_widths`).
    sort: with ``by_cost``, whether the chunks are the members in
      descending cost, ``k`` at a time (:func:`fedjx.mapping.run_sorted`)
      rather than the windows of :func:`fedjx.mapping.chunk_widths`.
    devices: ``(mesh, d)`` when the members run as ``d`` blocks of ``n / d``,
      one per device of the mesh axis named after the placement
      (:func:`fedjx.mapping.device_blocks`); ``k`` and the chunks are then
      each block's. None otherwise.
    num_rows: the leaves of a store of per-member rows updated in place
      (:class:`fedjx.mapping.Rows`, members one at a time): the operands
      after the constants are the store's leaves, the ids (and the write
      flags, with ``write``); the member takes its row's leaves first and
      gives its new row's first, and the map's first outputs are the new
      store. 0 without one.
    write: whether the store's rows come with write flags.
    cost_bound: with ``sort``, the largest cost possible (the cohort mask's
      steps, for :func:`fedjx.mapping.descending_order`), or None.
  """

  def __init__(self, jaxpr, num_consts, num_placed, n, k, placement, out_avals,
               by_cost=False, devices=None, sort=False, num_rows=0, write=False,
               cost_bound=None):
    self.jaxpr = jaxpr
    self.num_consts = num_consts
    self.num_placed = num_placed
    self.n = n
    self.k = k
    self.placement = placement
    self.out_avals = tuple(out_avals)
    self.by_cost = by_cost
    self.devices = devices
    self.sort = sort
    self.num_rows = num_rows
    self.write = write
    self.cost_bound = cost_bound
    self.alone = None  # The member's jaxpr outside a chunk, for chunks of 1.
    self.num_alone_consts = 0

  def __repr__(self):
    return f'MapSpec(placement={self.placement}, n={self.n}, k={self.k})'


fusable_map_p = Primitive('fedjx_fusable_map')
fusable_map_p.multiple_results = True


def _fusable_map_abstract_eval(*args, spec):
  del args
  return spec.out_avals


def _fusable_map_impl(*args, spec):
  # The equation lives only between call_program's tracing and evaluate(),
  # which never binds it; bound any other way it runs unfused.
  return run(spec, args, [], range(len(spec.out_avals)))[0]


def _fusable_map_jvp(primals, tangents, *, spec):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return jax.jvp(lambda *a: _fusable_map_impl(*a, spec=spec), tuple(primals),
                 tuple(tangents))


def _fusable_map_batch(args, dims, *, spec):
  args = [x if d is None else jnp.moveaxis(x, d, 0)
          for x, d in zip(args, dims)]
  axes = [None if d is None else 0 for d in dims]
  outs = jax.vmap(lambda *a: _fusable_map_impl(*a, spec=spec), in_axes=axes)(*args)
  return outs, [0] * len(outs)


# The equation never outlives evaluate(); should one be bound anywhere else
# (in a trace that fusion does not walk), it lowers, differentiates and
# batches as the unfused loop over chunks, never raising NotImplementedError.
fusable_map_p.def_abstract_eval(_fusable_map_abstract_eval)
fusable_map_p.def_impl(_fusable_map_impl)
mlir.register_lowering(fusable_map_p, mlir.lower_fun(_fusable_map_impl,
                                                     multiple_results=True))
ad.primitive_jvps[fusable_map_p] = _fusable_map_jvp
batching.primitive_batchers[fusable_map_p] = _fusable_map_batch


chunk_axis_name = frames.chunk_axis_name


class Recorder:
  """Per-program-call switch: whether ``map_fn`` records fusable maps now.

  On only while :func:`call_program` traces the program, and off while a
  recorded map's own per-member function is traced, so maps nested inside
  it, and programs run as written, are never recorded.
  """

  def __init__(self):
    self.active = False
    self.trace = None

  def records_here(self) -> bool:
    """Whether a ``map_fn`` called now is in the program's own trace.

    A map inside ``lax.scan``, ``cond``, ``while_loop``, ``checkpoint``,
    ``custom_vjp``, an inner ``jit`` or ``vmap`` is traced in a trace of its
    own, whose jaxpr :func:`evaluate` never reaches: such a map runs unfused.
    """
    return self.active and jex_core.get_opaque_trace_state() == self.trace

  def record(self, fn: Callable[[list, list], Any], placed: Sequence[Any],
             shared: Sequence[Any], n: int, k: int, placement: str,
             cost: Any = None, devices: Any = None, sort: bool = False,
             rows: Any = None, cost_bound: int | None = None) -> Any:
    """Traces ``fn(placed_member, shared)`` once and binds the opaque map
    (whose chunks are formed from ``cost``, each member's, when given:
    sorted by it with ``sort``; run in one block per device when
    ``devices`` is ``(mesh, d)``). With ``rows``, ``(store leaves, ids,
    write)`` of a store updated in place (one member at a time, ``k = 1``):
    ``fn`` takes the member's row leaves before its placed values and
    returns ``(new_row, out)``, and the map returns ``(new store, out)``."""
    store, ids, write = rows if rows is not None else ([], None, None)
    if rows is not None and (k != 1 or cost is not None or devices is not None):
      raise ValueError('Recorder.record: rows are updated in place one member '
                       'at a time only (k = 1, no cost, no device blocks).')
    member = [jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x),
                                   weak_type=jax.typeof(x).weak_type)
              for x in list(store) + list(placed)]
    # Traced as one member of a chunk of k (vmapped on the chunk's axis when
    # run), so mapping.any_in_chunk sees the axis it reduces over.
    axis = chunk_axis_name(placement) if k > 1 else None
    self.active = False
    # A member run in a device's block is traced as shard_map's body sees it:
    # the placement's mesh axis manual.
    context = (contextlib.nullcontext() if devices is None else
               jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())))
    if devices is not None:  # Shared values enter the block whole.
      shared_in = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                                        weak_type=jax.typeof(x).weak_type)
                   for x in shared]
    else:
      shared_in = list(shared)
    try:
      with frames.chunk_axis(axis), context:
        closed, out_shape = jax.make_jaxpr(
            fn, return_shape=True, axis_env=[(axis, k)] if axis else ())(
                member, shared_in)
      if cost is not None and axis and not sort:
        # The same member traced alone, for the chunks of one member
        # (vmapped on an axis of size 1, XLA:CPU runs its products slower).
        with frames.chunk_axis(None), context:
          alone = jax.make_jaxpr(fn)(member, shared_in)
    finally:
      self.active = True
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    out_avals = [jax.core.ShapedArray((n,) + s.shape, s.dtype,
                                      weak_type=getattr(s, 'weak_type', False))
                 for s in out_leaves]
    for j, x in enumerate(store):  # The new store, where the new rows go.
      out_avals[j] = jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x))
    spec = MapSpec(closed.jaxpr, len(closed.consts), len(placed), n, k, placement,
                   out_avals, by_cost=cost is not None, devices=devices,
                   sort=sort and cost is not None, num_rows=len(store),
                   write=write is not None, cost_bound=cost_bound)
    extra = [] if cost is None else [cost]
    if cost is not None and axis and not sort:
      spec.alone = alone.jaxpr
      spec.num_alone_consts = len(alone.consts)
      extra = list(alone.consts) + extra
    row_operands = [] if rows is None else [*store, ids] + (
        [] if write is None else [write])
    outs = fusable_map_p.bind(*closed.consts, *row_operands, *placed, *shared,
                              *extra, spec=spec)
    return jax.tree.unflatten(out_tree, outs)


def _manual_mesh(mesh: Any, axis: str) -> Any:
  """``mesh``'s abstract mesh with ``axis`` manual (inside ``shard_map``)."""
  abstract = getattr(mesh, 'abstract_mesh', mesh)
  return abstract.update_axis_types({axis: jax.sharding.AxisType.Manual})


def call_program(f: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  """Calls ``f`` inside the current (entered) program frame, fusing if it can."""
  stack = frames.current_frames()
  frame = stack[-1]
  if (frame.recorder is None or len(stack) > 1 or len(frame.placements) > 1
      or frames.forced_map_strategy() is not None
      or not frames.fusion_enabled()):
    return f(*args, **kwargs)
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)
             or hasattr(x, '__jax_array__') or hasattr(x, 'dtype') and hasattr(x, 'shape')]

  def flat(*values):
    filled = list(leaves)
    for i, v in zip(dynamic, values):
      filled[i] = v
    a, kw = jax.tree.unflatten(treedef, filled)
    return f(*a, **kw)

  recorder = frame.recorder

  def traced(*values):
    recorder.trace = jex_core.get_opaque_trace_state()
    recorder.active = True
    try:
      return flat(*values)
    finally:
      recorder.active = False
      recorder.trace = None

  values = [leaves[i] for i in dynamic]
  closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*values)
  outs = evaluate(closed.jaxpr, closed.consts, values)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


# ------------------------------------------------------------------ evaluate

class _Reduction:
  """A reduction fused into a map: ``kind`` of output ``index``."""

  def __init__(self, eqn, index, kind, weights):
    self.eqn = eqn
    self.index = index
    self.kind = kind
    # ('value', array) for weights computed before the map, ('out', j) for
    # weights that are the map's output j, None for sum and mean.
    self.weights = weights


def evaluate(jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """Evaluates a traced program, each recorded map fused with its reductions.

  Equations are bound in order, as ``jax.core.eval_jaxpr`` does. A recorded
  map runs when one of its outputs is first needed; the reductions that read
  an output fuse into it when every use of that output is the value operand
  of a fedjx reduction of the map's placement, the output is not returned,
  and each such reduction's weights are known by then (computed earlier, or
  another output of the same map).
  """
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  def known(v):
    return isinstance(v, jex_core.Literal) or v in env

  uses: dict[Any, list[tuple[int, int]]] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for pos, v in enumerate(eqn.invars):
      if not isinstance(v, jex_core.Literal):
        uses.setdefault(v, []).append((i, pos))
  returned = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  # A layout equation's output -> its input (the values are the same).
  layout_of = {eqn.outvars[0]: eqn.invars[0] for eqn in jaxpr.eqns
               if eqn.primitive.name in LAYOUT_PRIMITIVES
               and not isinstance(eqn.invars[0], jex_core.Literal)}
  pending: dict[Any, int] = {}
  done: set[int] = set()

  def run_group(m):
    eqn = jaxpr.eqns[m]
    spec = eqn.params['spec']
    for v in eqn.invars:  # An input made by another map not yet run.
      if not isinstance(v, jex_core.Literal) and v in pending:
        run_group(pending[v])
    outs = list(eqn.outvars)
    found, keep = [], []
    for j, o in enumerate(outs):
      if j < spec.num_rows:  # The new store of rows updated in place.
        keep.append(j)
        continue
      fused = _fusable_uses(jaxpr.eqns, o, uses, returned, spec, outs,
                            known, layout_of)
      if fused is None:
        keep.append(j)
      else:
        found.extend(_Reduction(jaxpr.eqns[i], j, kind, w)
                     for i, kind, w in fused if kind is not None)
        done.update(i for i, _, _ in fused)
    resolved = [r if r.weights is None or r.weights[0] == 'out'
                else _Reduction(r.eqn, r.index, r.kind, ('value', read(r.weights[1])))
                for r in found]
    stacked, reduced = run(spec, [read(v) for v in eqn.invars], resolved, keep)
    for j, value in zip(keep, stacked):
      env[outs[j]] = value
    for r, value in zip(resolved, reduced):
      env[r.eqn.outvars[0]] = value
    for o in outs:
      pending.pop(o, None)

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for i, eqn in enumerate(jaxpr.eqns):
    if i in done:
      continue
    if eqn.primitive is fusable_map_p:
      for o in eqn.outvars:
        pending[o] = i
      continue
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal) and v in pending:
        run_group(pending[v])
    if i in done:
      continue
    _bind(eqn, [read(v) for v in eqn.invars], env)
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal) and v in pending:
      run_group(pending[v])
  return [read(v) for v in jaxpr.outvars]


# Equations that only lay a value out on the devices (the reductions place
# their operands on the placement's mesh axis first): fusion looks through them.
LAYOUT_PRIMITIVES = ('sharding_constraint', 'reshard')


def _fusable_uses(eqns, o, uses, returned, spec, map_outs, known, layout_of):
  """``[(eqn index, kind, weights)]`` if output ``o`` can be fused, else None.

  A use by a layout equation (:data:`LAYOUT_PRIMITIVES`) is followed to its
  output's uses and listed with kind None (skipped once the map runs).
  """
  if o in returned or not uses.get(o):
    return None
  fused = []
  for i, pos in uses[o]:
    eqn = eqns[i]
    if eqn.primitive.name in LAYOUT_PRIMITIVES and pos == 0:
      inner = _fusable_uses(eqns, eqn.outvars[0], uses, returned, spec,
                            map_outs, known, layout_of)
      if inner is None:
        return None
      fused.append((i, None, None))
      fused.extend(inner)
      continue
    kind = primitives.REDUCTIONS.get(eqn.primitive)
    if kind is None or pos != 0 or eqn.params['placement'] != spec.placement:
      return None
    weights = None
    if kind == 'weighted_mean':
      w = eqn.invars[1]
      while not isinstance(w, jex_core.Literal) and w not in map_outs and w in layout_of:
        w = layout_of[w]
      if not isinstance(w, jex_core.Literal) and w in map_outs:
        weights = ('out', map_outs.index(w))
      elif known(eqn.invars[1]):
        weights = ('var', eqn.invars[1])
      else:
        return None
    fused.append((i, kind, weights))
  return fused


def _bind(eqn, invals, env):
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    ans = eqn.primitive.bind(*invals, **params)
  if eqn.primitive.multiple_results:
    for v, a in zip(eqn.outvars, ans):
      env[v] = a
  else:
    env[eqn.outvars[0]] = ans


# ----------------------------------------------------------------------- run

carry_dtype = reductions.carry_dtype


def run(spec: MapSpec, operands: Sequence[Any], fused: Sequence[_Reduction],
        keep: Sequence[int]) -> tuple[list[Any], list[Any]]:
  """Runs a recorded map in chunks, carrying the fused reductions.

  Returns the stacked outputs ``keep`` (leading axis ``n``) and the value of
  each reduction.
  """
  if spec.devices is not None:
    stacked, carry = _run_on_devices(spec, operands, fused, keep)
  else:
    stacked, carry = _run_here(spec, operands, fused, keep)
  reduced = []
  for r, (total, *rest) in zip(fused, carry):
    reduced.append(reductions.finish(r.kind, total, rest[0] if rest else None,
                                     spec.n, _reduction_dtype(spec, r)))
  return stacked, reduced


def _reduction_dtype(spec: MapSpec, r: _Reduction) -> Any:
  x_dtype = spec.out_avals[r.index].dtype
  w_dtype = None
  if r.kind == 'weighted_mean':
    w_dtype = (spec.out_avals[r.weights[1]].dtype if r.weights[0] == 'out'
               else jnp.result_type(r.weights[1]))
  return reductions.result_dtype(r.kind, x_dtype, w_dtype)


def _run_on_devices(spec: MapSpec, operands: Sequence[Any],
                    fused: Sequence[_Reduction], keep: Sequence[int]
                    ) -> tuple[list[Any], list[Any]]:
  """:func:`_run_here` on each device's block of ``n / d`` members under
  ``jax.shard_map``, the partial sums joined by one ``psum``:
  ``S = sum_devices sum_{i in block} w_i y_i``."""
  mesh, d = spec.devices
  axis = spec.placement
  n = spec.n // d
  local = MapSpec(spec.jaxpr, spec.num_consts, spec.num_placed, n,
                  spec.k, axis, [jax.core.ShapedArray(
                      (n,) + a.shape[1:], a.dtype, weak_type=a.weak_type)
                      for a in spec.out_avals], by_cost=spec.by_cost,
                  sort=spec.sort, cost_bound=spec.cost_bound)
  local.alone, local.num_alone_consts = spec.alone, spec.num_alone_consts
  c, p = spec.num_consts, spec.num_placed
  split = [False] * len(operands)
  split[c:c + p] = [True] * p
  if spec.by_cost:
    split[-1] = True
  values = [r.weights[1] for r in fused
            if r.weights is not None and r.weights[0] == 'value']
  inputs = list(operands) + [jnp.asarray(v) for v in values]
  split += [True] * len(values)
  explicit = sharding_lib.placement_axis_type(mesh, axis) == jax.sharding.AxisType.Explicit
  if explicit:  # shard_map takes Explicit inputs only as its specs lay them.
    inputs = [sharding_lib.place_leading_axis(x, axis, mesh) if s
              else sharding_lib.replicate(x, mesh) for x, s in zip(inputs, split)]

  def block(*args):
    ops, ws = list(args[:len(operands)]), iter(args[len(operands):])
    here = [_Reduction(r.eqn, r.index, r.kind, ('value', next(ws)))
            if r.weights is not None and r.weights[0] == 'value' else r
            for r in fused]
    stacked, carry = _run_here(local, ops, here, keep)
    return stacked, jax.lax.psum(carry, axis)

  specs = tuple(P(axis) if s else P() for s in split)
  return jax.shard_map(block, mesh=mesh, in_specs=specs,
                       out_specs=([P(axis)] * len(keep), P()),
                       check_vma=False)(*inputs)


def _run_here(spec: MapSpec, operands: Sequence[Any], fused: Sequence[_Reduction],
              keep: Sequence[int]) -> tuple[list[Any], list[Any]]:
  """The loop of :func:`run` on this device: the stacked outputs ``keep``
  and each reduction's carried sums (``(S,)`` or ``(S, W)``)."""
  if spec.num_rows:
    return _run_rows(spec, operands, fused, keep)
  c, p = spec.num_consts, spec.num_placed
  cost = operands[-1] if spec.by_cost else None
  operands = operands[:-1] if spec.by_cost else operands
  a = spec.num_alone_consts
  alone_consts = operands[len(operands) - a:]
  operands = operands[:len(operands) - a]
  consts, placed, shared = operands[:c], operands[c:c + p], operands[c + p:]
  n, k = spec.n, spec.k
  m = math.ceil(n / k)

  def member(*values):
    return jax.core.eval_jaxpr(spec.jaxpr, values[:c], *values[c:])

  def outputs(chunk, width=k):
    if width == 1 and cost is None:
      return member(*consts, *chunk, *shared)
    if width == 1 and spec.alone is not None:
      one = [x[0] for x in chunk]
      outs = jax.core.eval_jaxpr(spec.alone, alone_consts, *one, *shared)
      return [y[None] for y in outs]
    return jax.vmap(lambda *one: member(*consts, *one, *shared),
                    axis_name=chunk_axis_name(spec.placement))(*chunk)

  out_avals = spec.out_avals
  w_values = [r.weights[1] if r.weights is not None and r.weights[0] == 'value'
              else None for r in fused]
  dtypes = [_reduction_dtype(spec, r) for r in fused]
  # Chunk c covers members [start_c, start_c + k) with start_c = min(c k, n - k):
  # the inputs are sliced in place (no padded or reshaped copy of the
  # cohort's data), and in a last chunk that overlaps the one before, the
  # members counted already get zero weight.
  overlap = k > 1 and n % k != 0
  on_cpu = jax.default_backend() == 'cpu'
  if k == 1:
    xs = (placed, [None if w is None else jnp.asarray(w) for w in w_values])
  else:
    starts = jnp.minimum(jnp.arange(m) * k, n - k)
    xs = (starts, jnp.arange(m) * k)

  def init(r, dtype):
    acc = carry_dtype(dtype)
    total = jnp.zeros(out_avals[r.index].shape[1:], acc)
    return (total, jnp.zeros((), acc)) if r.kind == 'weighted_mean' else (total,)

  def body(carry, xs):
    if k == 1:
      chunk, ws = xs
      ok = None
    else:
      start, first = xs
      chunk = [jax.lax.dynamic_slice_in_dim(x, start, k) for x in placed]
      ws = [None if w is None else jax.lax.dynamic_slice_in_dim(jnp.asarray(w), start, k)
            for w in w_values]
      ok = start + jnp.arange(k) >= first if overlap else None
    outs = outputs(chunk)
    new = []
    for r, dtype, (total, *rest), w in zip(fused, dtypes, carry, ws):
      acc = total.dtype
      x = outs[r.index].astype(dtype).astype(acc)
      if r.kind == 'weighted_mean':
        w = outs[r.weights[1]] if r.weights[0] == 'out' else w
        w = w.astype(dtype).astype(acc)
        if ok is not None:
          w = jnp.where(ok, w, jnp.zeros_like(w))
        if k == 1:
          new.append((total + w * x, rest[0] + w))
        else:
          new.append((total + primitives.sum_leading_axis(x, w, on_cpu=on_cpu), rest[0] + jnp.sum(w)))
      elif k == 1:
        new.append((total + x,))
      else:
        mask = None if ok is None else ok.astype(acc)
        if mask is not None and not jnp.issubdtype(acc, jnp.floating):
          x, mask = jnp.where(reductions.expand_weights(ok, x), x, 0), None
        new.append((total + primitives.sum_leading_axis(x, mask, on_cpu=on_cpu),))
    return new, [outs[j] for j in keep]

  carry0 = [init(r, d) for r, d in zip(fused, dtypes)]
  if cost is not None and spec.sort:
    carry, stacked = _run_sorted(spec, placed, cost, outputs, fused, dtypes,
                                 w_values, keep, carry0, on_cpu)
  elif cost is not None:
    carry, stacked = _run_by_cost(spec, placed, cost, outputs, fused, dtypes,
                                  w_values, keep, carry0, on_cpu)
  else:
    carry, ys = jax.lax.scan(body, carry0, xs)
    stacked = [_unchunk(y, n, k, m) for y in ys]
  return stacked, carry


def _run_rows(spec: MapSpec, operands: Sequence[Any], fused: Sequence[_Reduction],
              keep: Sequence[int]) -> tuple[list[Any], list[Any]]:
  """:func:`_run_here` for a map with a store of rows updated in place
  (:func:`fedjx.mapping.run_rows`): one member at a time, the loop carrying
  the store and the reductions' sums (``S + w_i y_i``, as ``k = 1`` adds
  them); the kept outputs are the new store's leaves and the stacked rest."""
  c, r, p = spec.num_consts, spec.num_rows, spec.num_placed
  consts, store = operands[:c], list(operands[c:c + r])
  ids = operands[c + r]
  write = operands[c + r + 1] if spec.write else None
  rest = operands[c + r + 1 + int(spec.write):]
  placed, shared = rest[:p], rest[p:]
  w_values = [None if x.weights is None or x.weights[0] != 'value'
              else jnp.asarray(x.weights[1]) for x in fused]
  dtypes = [_reduction_dtype(spec, x) for x in fused]
  stacked_keep = [j for j in keep if j >= r]

  def init(x, dtype):
    acc = carry_dtype(dtype)
    total = jnp.zeros(spec.out_avals[x.index].shape[1:], acc)
    return (total, jnp.zeros((), acc)) if x.kind == 'weighted_mean' else (total,)

  sums = [init(x, d) for x, d in zip(fused, dtypes)]

  def body(carry, xs):
    sums, store = carry
    chunk, ws, i, w_flag = xs
    i = mapping.row_index(i, jnp.shape(store[0])[0])
    old = mapping.read_row(store, i)
    outs = jax.core.eval_jaxpr(spec.jaxpr, consts, *old, *chunk, *shared)
    store = mapping.write_row(store, i, outs[:r], old, w_flag)
    new = []
    for x, dtype, (total, *more), w in zip(fused, dtypes, sums, ws):
      acc = total.dtype
      y = outs[x.index].astype(dtype).astype(acc)
      if x.kind == 'weighted_mean':
        w = outs[x.weights[1]] if x.weights[0] == 'out' else w
        w = w.astype(dtype).astype(acc)
        new.append((total + w * y, more[0] + w))
      else:
        new.append((total + y,))
    return (new, store), [outs[j] for j in stacked_keep]

  (sums, store), ys = jax.lax.scan(body, (sums, store), (placed, w_values, ids, write))
  ys = iter(ys)
  return [store[j] if j < r else next(ys) for j in keep], sums


def _accumulate(r, dtype, total, rest, x, w, on_cpu, counted=None):
  """One chunk's (leading axis: its members) part of reduction ``r``, of
  the members ``counted`` (``[k]`` bool; all when None)."""
  acc = total.dtype
  x = x.astype(dtype).astype(acc)
  if r.kind == 'weighted_mean':
    w = w.astype(dtype).astype(acc)
    if counted is not None:
      w = jnp.where(counted, w, jnp.zeros_like(w))
    return (total + primitives.sum_leading_axis(x, w, on_cpu=on_cpu),
            rest[0] + jnp.sum(w))
  mask = None
  if counted is not None:
    if jnp.issubdtype(acc, jnp.floating):
      mask = counted.astype(acc)
    else:
      x = jnp.where(reductions.expand_weights(counted, x), x, 0)
  return (total + primitives.sum_leading_axis(x, mask, on_cpu=on_cpu),)


def _run_sorted(spec, placed, cost, outputs, fused, dtypes, w_values, keep,
                carry0, on_cpu):
  """The loop over the chunks of members sorted by ``cost``
  (:func:`fedjx.mapping.run_sorted`), carrying the reductions (each member
  counted once) and writing the kept outputs into ``[n, ...]`` buffers at
  the members' places."""
  buffers = [jnp.zeros(spec.out_avals[j].shape, spec.out_avals[j].dtype)
             for j in keep]
  ws_all = [None if w is None else jnp.asarray(w) for w in w_values]
  overlap = spec.n % spec.k != 0

  def step(state, members, fresh):
    carry, buffers = state
    outs = outputs(mapping.gather_members(list(placed), members))
    counted = fresh if overlap else None
    new = []
    for r, dtype, (total, *rest), w in zip(fused, dtypes, carry, ws_all):
      if r.kind == 'weighted_mean':
        w = (outs[r.weights[1]] if r.weights[0] == 'out'
             else jnp.take(w, members, axis=0, mode='clip'))
      new.append(_accumulate(r, dtype, total, rest, outs[r.index], w, on_cpu,
                             counted))
    buffers = [b.at[members].set(outs[j].astype(b.dtype), unique_indices=True)
               for b, j in zip(buffers, keep)]
    return new, buffers

  return mapping.run_sorted(step, (carry0, buffers), cost, spec.n, spec.k,
                            spec.cost_bound)


def _run_by_cost(spec, placed, cost, outputs, fused, dtypes, w_values, keep,
                 carry0, on_cpu):
  """The loop over the chunks that ``cost`` forms
  (:func:`fedjx.mapping.run_by_cost`), carrying the reductions and writing
  the kept outputs into ``[n, ...]`` buffers."""
  n, k = spec.n, spec.k
  buffers = [jnp.zeros(spec.out_avals[j].shape, spec.out_avals[j].dtype)
             for j in keep]
  ws_all = [None if w is None else jnp.asarray(w) for w in w_values]

  def step(state, start, width):
    carry, buffers = state
    chunk = [jax.lax.dynamic_slice_in_dim(x, start, width) for x in placed]
    outs = outputs(chunk, width)
    new = []
    for r, dtype, (total, *rest), w in zip(fused, dtypes, carry, ws_all):
      if r.kind == 'weighted_mean':
        w = (outs[r.weights[1]] if r.weights[0] == 'out'
             else jax.lax.dynamic_slice_in_dim(w, start, width))
      new.append(_accumulate(r, dtype, total, rest, outs[r.index], w, on_cpu))
    buffers = [jax.lax.dynamic_update_slice_in_dim(b, outs[j].astype(b.dtype), start, 0)
               for b, j in zip(buffers, keep)]
    return new, buffers

  return mapping.run_by_cost(step, (carry0, buffers), cost, n, k)


def _unchunk(y, n, k, m):
  """Stacked chunk outputs ``[m, k, ...]`` (last chunk ending at ``n``) -> ``[n, ...]``."""
  if k == 1:
    return y
  if n % k == 0:
    return y.reshape((n,) + y.shape[2:])
  tail = n - (m - 1) * k  # New members in the last chunk, at its end.
  return jnp.concatenate([y[:-1].reshape(((m - 1) * k,) + y.shape[2:]), y[-1, k - tail:]])
