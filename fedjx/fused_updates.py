"""Updates fused into their parameter: a gradient added where it lands.

Two kinds of gradient are much cheaper to add than to build.

**Row-sparse.** The gradient of a gather (``jnp.take(w, tokens, axis=0)``:
an embedding lookup, a bag-of-words logistic regression) is a scatter-add
into zeros,

    g = scatter_add(0, I, U),

dense in ``w``'s shape although only the rows ``I`` are non-zero. An SGD
step then rewrites every row of ``w``, ``w + (-eta) g``: three passes over
the whole table per local step (write ``g``, scale it, add it), where the
rows touched are a few hundred of ten thousand. XLA adds a scatter into
zeros to its target in place (``w + scatter_add(0, I, U)`` becomes
``scatter_add(w, I, U)``), but not when a scale stands between them, and
every optimizer's update is the gradient scaled.

**Low-rank.** The gradient of a dense layer's weight is a product
contracted over the batch, ``g = X^T R`` (``[D, K]`` from ``X [B, D]`` and
``R [B, K]``): with a small batch, rank ``B``. Computing it costs
``2 B D K`` flops but writes ``D K`` values, and the step reads them back
to scale and add them: for a large weight (a 10,000 x 500 logistic
regression: 20 MB) and a batch of 10, the step is memory-bound, and
``g`` is two of its five passes over ``D K`` values (the forward pass
reads ``w``; the update reads ``w`` and ``g`` and writes ``w``). Added by
blocks of rows, ``w[r] + c X[:, r]^T R`` for row blocks ``r`` of about
:data:`BLOCK_BYTES`, each block of ``g`` is made in the cache and added
at once: ``w`` is read and written once, ``g`` never reaches memory.
Only XLA:CPU gains (a GPU or TPU kernel per block would cost more than
the pass it saves), so the blocks are chosen per platform
(``jax.lax.platform_dependent``): elsewhere the product is built as
written. Products of at least :data:`MIN_BLOCKED_BYTES`, contracted over
at most :data:`MAX_BLOCKED_RANK` values, are blocked, where no mesh axis
partitions them (one device, or a device's block of clients under
``shard_map``).

:func:`eval_jaxpr` evaluates a jaxpr as ``jax.core.eval_jaxpr`` does, with
such a gradient kept unbuilt while it only flows through the linear steps
of an update, and then added into its target:

    c * scatter_add(0, I, U)  ->  scatter_add(0, I, c * U)    (c a scalar)
    -scatter_add(0, I, U)     ->  scatter_add(0, I, -U)
    w + scatter_add(0, I, U)  ->  scatter_add(w, I, U)
    w - scatter_add(0, I, U)  ->  scatter_add(w, I, -U)
    w + c * (X^T R)           ->  w[r] + c * (X[:, r]^T R), per row block r

(the product also through a transpose, a negation or a cast to its own
dtype). So a step of ``optax.sgd`` (without momentum; with a constant rate
or a schedule) through ``optax.apply_updates`` touches only the gathered
rows, or passes once over a dense weight, and XLA updates the parameter in
place inside a loop of steps. Any other use (a gradient norm, a clip, the
square in Adam's second moment) builds the gradient where it is used, so
those optimizers compute what they did, in the same other order where a
scale or a sum came first for a scatter (Adam's first moment becomes
``scatter_add(b1 m, I, (1 - b1) U)``). Calls (``jax.jit`` inside the
step, as ``jnp.take`` is) are inlined when they place nothing (no
shardings, layouts or donations), so a gradient made inside one reaches
the update outside it.

The results of a scatter are the same sums in another order:
``c * (u_1 + u_2)`` becomes ``c u_1 + c u_2`` and ``w + (u_1 + u_2)``
becomes ``(w + u_1) + u_2`` for rows gathered more than once, a difference
of a few units in the last place of each such row (float addition is not
associative), as any reordering compiler may make. Rows not gathered keep
their values exactly (the dense form adds ``c * 0``; it differs only when
``c`` is not finite, where the dense form writes NaN into every row). A
blocked product computes each entry of ``g`` as the same dot product of
``B`` terms and then the same scale and add: equal to the dense form but
for the order a matrix-product kernel sums those ``B`` terms in.
Derivatives through the result are those of the same sums: scatter-add, a
product and a block's update are linear in what they add.

Used by :func:`fedjx.algorithms.client_update.scan_steps` for a client's
local steps when they run as a ``while`` loop (one client at a time).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import primitives as p

# A dense product is added by row blocks of about this many bytes (a block of
# the gradient stays in a core's cache until it is added) ...
BLOCK_BYTES = 1 << 20
# ... when it has at least this many bytes (smaller ones are cache-resident
# already: the 2NN's 0.6 MB layer gains nothing) ...
MIN_BLOCKED_BYTES = 4 << 20
# ... and is contracted over at most this many values (a batch: each entry
# of the gradient costs so few flops that writing it is what costs).
MAX_BLOCKED_RANK = 256


@dataclasses.dataclass(frozen=True)
class _Scatter:
  """``scatter_add(zeros(shape, dtype), indices, updates, **params)``, unbuilt."""
  aval: Any
  indices: Any
  updates: Any
  params: dict

  def build(self, operand: Any = None) -> jax.Array:
    if operand is None:
      operand = jax.lax.full(self.aval.shape, 0, self.aval.dtype)
    return p.scatter_add_p.bind(operand, self.indices, self.updates, **self.params)

  def scaled(self, fn) -> _Scatter:
    return dataclasses.replace(self, updates=fn(self.updates))


@dataclasses.dataclass(frozen=True)
class _Zeros:
  """A broadcast zero, unbuilt: the operand of a scatter-add needs none."""
  eqn: Any

  def build(self) -> jax.Array:
    return self.eqn.primitive.bind(self.eqn.invars[0].val, **self.eqn.params)


@dataclasses.dataclass(frozen=True)
class _Product:
  """``post(transpose(dot_general(lhs, rhs, **params), perm))``, unbuilt: a
  low-rank gradient, with the elementwise scalar steps ``post`` (a scale, a
  negation) applied to it in order."""
  aval: Any
  lhs: Any
  rhs: Any
  params: dict
  perm: tuple[int, ...] | None = None
  post: tuple[Any, ...] = ()
  block_bytes: int = BLOCK_BYTES

  def _rows(self, lhs: Any, rhs: Any) -> jax.Array:
    g = p.dot_general_p.bind(lhs, rhs, **self.params)
    if self.perm is not None:
      g = p.transpose_p.bind(g, permutation=self.perm)
    for fn in self.post:
      g = fn(g)
    return g

  def build(self, operand: Any = None) -> jax.Array:
    if operand is None:
      return self._rows(self.lhs, self.rhs)
    dense = lambda w, lhs, rhs: p.add_p.bind(w, self._rows(lhs, rhs))
    return jax.lax.platform_dependent(operand, self.lhs, self.rhs,
                                      cpu=self._blocked, default=dense)

  def _source(self) -> tuple[int, int]:
    """Which operand (0: lhs, 1: rhs) and axis make the result's rows."""
    (lc, rc), _ = self.params['dimension_numbers']
    axis = 0 if self.perm is None else self.perm[0]
    free_lhs = [a for a in range(np.ndim(self.lhs)) if a not in lc]
    if axis < len(free_lhs):
      return 0, free_lhs[axis]
    return 1, [a for a in range(np.ndim(self.rhs)) if a not in rc][axis - len(free_lhs)]

  def _blocked(self, w: Any, lhs: Any, rhs: Any) -> jax.Array:
    """``w + g``, a block of rows of ``g`` at a time, ``w`` updated in place."""
    which, axis = self._source()
    rows = int(self.aval.shape[0])
    row_bytes = max(int(np.prod(self.aval.shape[1:], dtype=np.int64)) *
                    self.aval.dtype.itemsize, 1)
    # Blocks of equal size, as close to block_bytes as that allows.
    blocks = -(-rows // max(1, min(rows, self.block_bytes // row_bytes)))
    size = -(-rows // blocks)
    operands = (lhs, rhs)

    def add_block(w, start, size):
      part = list(operands)
      part[which] = jax.lax.dynamic_slice_in_dim(operands[which], start, size, axis)
      block = jax.lax.dynamic_slice_in_dim(w, start, size, 0)
      return jax.lax.dynamic_update_slice_in_dim(
          w, p.add_p.bind(block, self._rows(*part)), start, 0)

    full = rows // size
    w, _ = jax.lax.scan(lambda w, j: (add_block(w, j * size, size), None), w,
                        np.arange(full, dtype=np.int32))
    if rows % size:
      w = add_block(w, full * size, rows % size)
    return w

  def scaled(self, fn) -> _Product:
    return dataclasses.replace(self, post=self.post + (fn,))


def _built(x: Any) -> Any:
  return x.build() if isinstance(x, (_Scatter, _Zeros, _Product)) else x


def _low_rank(eqn, ins: list[Any], limits: tuple[int, int]) -> _Product | None:
  """``eqn`` (a ``dot_general``) as a :class:`_Product`, if it is large and of
  low rank."""
  block_bytes, min_bytes = limits
  (lc, _), (lb, _) = eqn.params['dimension_numbers']
  out = eqn.outvars[0].aval
  rank = int(np.prod([np.shape(ins[0])[a] for a in lc], dtype=np.int64))
  if (lb or not out.shape or rank > MAX_BLOCKED_RANK or
      out.size * out.dtype.itemsize < min_bytes or not _unpartitioned() or
      any(isinstance(x, (_Scatter, _Zeros, _Product)) for x in ins)):
    return None
  return _Product(out, ins[0], ins[1], dict(eqn.params), block_bytes=block_bytes)


def _unpartitioned() -> bool:
  """Whether no mesh axis partitions values here (every axis of the current
  mesh has size 1 or is manual, as inside ``shard_map``): blocks of rows of
  a sharded weight would move data between devices."""
  mesh = jax.sharding.get_abstract_mesh()
  return all(size == 1 or kind == jax.sharding.AxisType.Manual
             for size, kind in zip(mesh.axis_sizes, mesh.axis_types))


def _is_zero_literal(v: Any) -> bool:
  return (isinstance(v, jax.extend.core.Literal) and np.shape(v.val) == () and
          np.asarray(v.val) == 0)


def places_nothing(params: dict) -> bool:
  """A ``jit`` call that inlining leaves unchanged."""
  shardings = (*params.get('in_shardings', ()), *params.get('out_shardings', ()))
  layouts = (*params.get('in_layouts', ()), *params.get('out_layouts', ()))
  return (not any(isinstance(s, jax.sharding.Sharding) for s in shardings) and
          not any(params.get('donated_invars', ())) and
          all(x is None for x in layouts) and not params.get('compiler_options_kvs'))


def _same_aval(x: Any, aval: Any) -> bool:
  return (not isinstance(x, (_Scatter, _Product)) and
          np.shape(x) == tuple(aval.shape) and
          jax.numpy.result_type(x) == aval.dtype)


def _rewrite(eqn, ins: list[Any], limits: tuple[int, int]) -> list[Any] | None:
  """The outputs of ``eqn`` with a gradient kept unbuilt, or None for a plain bind."""
  prim = eqn.primitive
  if prim is p.broadcast_in_dim_p and _is_zero_literal(eqn.invars[0]):
    return [_Zeros(eqn)]
  if prim is p.dot_general_p:
    product = _low_rank(eqn, ins, limits)
    return None if product is None else [product]
  if prim is p.scatter_add_p and isinstance(ins[0], _Zeros) and not any(
      isinstance(x, (_Scatter, _Zeros)) for x in ins[1:]):
    return [_Scatter(eqn.outvars[0].aval, ins[1], ins[2], dict(eqn.params))]
  ins = [x.build() if isinstance(x, _Zeros) else x for x in ins]
  lazy = [i for i, x in enumerate(ins) if isinstance(x, (_Scatter, _Product))]
  if len(lazy) != 1:
    return None
  (i,), s = lazy, ins[lazy[0]]
  other = ins[1 - i] if len(ins) == 2 else None
  in_place_of_s = lambda u: [u if j == i else x for j, x in enumerate(ins)]
  if (prim is p.transpose_p and isinstance(s, _Product) and s.perm is None
      and not s.post):
    perm = tuple(eqn.params['permutation'])
    return [dataclasses.replace(s, aval=eqn.outvars[0].aval, perm=perm)]
  if prim is p.mul_p and np.shape(other) == ():
    return [s.scaled(lambda u: prim.bind(*in_place_of_s(u), **eqn.params))]
  if prim is p.neg_p:
    return [s.scaled(lambda u: prim.bind(u, **eqn.params))]
  if prim is p.convert_element_type_p and eqn.params['new_dtype'] == s.aval.dtype:
    return [s]
  if prim in (p.add_p, p.add_jaxvals_p) and _same_aval(other, s.aval):
    return [s.build(other)]
  if prim is p.sub_p and i == 1 and _same_aval(other, s.aval):
    return [s.scaled(lambda u: p.neg_p.bind(u)).build(other)]
  return None


def _eval(jaxpr, consts: Sequence[Any], args: Sequence[Any],
          limits: tuple[int, int]) -> list[Any]:
  env: dict = {}
  read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
  for v, x in (*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    with eqn.ctx.manager:
      outs = _rewrite(eqn, ins, limits)
      if outs is None and eqn.primitive is p.jit_p and places_nothing(eqn.params):
        inner = eqn.params['jaxpr']
        outs = _eval(inner.jaxpr, inner.consts, ins, limits)
      if outs is None:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(_built, ins), **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def eval_jaxpr(jaxpr, consts: Sequence[Any], *args: Any,
               block_bytes: int = BLOCK_BYTES,
               min_blocked_bytes: int = MIN_BLOCKED_BYTES) -> list[Any]:
  """``jax.core.eval_jaxpr(jaxpr, consts, *args)`` with fused updates.

  A scatter-add into zeros (a gather's gradient), or a large product of low
  rank (a dense layer's), that is scaled by a scalar, negated, or added to
  (or subtracted from) an array of its shape is added into that array
  directly: ``w - eta * scatter_add(0, I, U)`` is computed as
  ``scatter_add(w, I, -eta * U)``, and ``w - eta * X^T R`` (of at least
  ``min_blocked_bytes``) by row blocks of about ``block_bytes`` on a CPU.
  Everything else is evaluated as written.
  See the module's docstring for what changes in the results.
  """
  limits = (block_bytes, min_blocked_bytes)
  return [_built(x) for x in _eval(jaxpr, consts, args, limits)]


__all__ = ['BLOCK_BYTES', 'MAX_BLOCKED_RANK', 'MIN_BLOCKED_BYTES', 'eval_jaxpr',
           'places_nothing']
