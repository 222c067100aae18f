"""Row-sparse updates: a gathered parameter's gradient added where it lands.

The gradient of a gather (``jnp.take(w, tokens, axis=0)``: an embedding
lookup, a bag-of-words logistic regression) is a scatter-add into zeros,

    g = scatter_add(0, I, U),

dense in ``w``'s shape although only the rows ``I`` are non-zero. An SGD
step then rewrites every row of ``w``, ``w + (-eta) g``: three passes over
the whole table per local step (write ``g``, scale it, add it), where the
rows touched are a few hundred of ten thousand. XLA adds a scatter into
zeros to its target in place (``w + scatter_add(0, I, U)`` becomes
``scatter_add(w, I, U)``), but not when a scale stands between them, and
every optimizer's update is the gradient scaled.

:func:`eval_jaxpr` evaluates a jaxpr as ``jax.core.eval_jaxpr`` does, with
the scatter-add into zeros kept unbuilt while it only flows through the
linear steps of an update, and moved onto its updates ``U``:

    c * scatter_add(0, I, U)  ->  scatter_add(0, I, c * U)    (c a scalar)
    -scatter_add(0, I, U)     ->  scatter_add(0, I, -U)
    w + scatter_add(0, I, U)  ->  scatter_add(w, I, U)
    w - scatter_add(0, I, U)  ->  scatter_add(w, I, -U)

So a step of ``optax.sgd`` (without momentum; with a constant rate or a
schedule) through ``optax.apply_updates`` touches only the gathered rows,
and XLA updates the table in place inside a loop of steps. Any other use
(a gradient norm, a clip, the square in Adam's second moment) builds the
dense scatter-add where it is used, so those optimizers compute what they
did, in the same other order where a scale or a sum came first (Adam's
first moment becomes ``scatter_add(b1 m, I, (1 - b1) U)``). Calls (``jax.jit`` inside the step, as ``jnp.take`` is) are
inlined when they place nothing (no shardings, layouts or donations), so a
scatter made inside one reaches the update outside it.

The results are the same sums in another order: ``c * (u_1 + u_2)``
becomes ``c u_1 + c u_2`` and ``w + (u_1 + u_2)`` becomes
``(w + u_1) + u_2`` for rows gathered more than once, a difference of a
few units in the last place of each such row (float addition is not
associative), as any reordering compiler may make. Rows not gathered keep
their values exactly (the dense form adds ``c * 0``; it differs only when
``c`` is not finite, where the dense form writes NaN into every row).
Derivatives through the result are those of the same sums: scatter-add is
linear in its operand and updates.

Used by :func:`fedjx.algorithms.client_update.scan_steps` for a client's
local steps when they run as a ``while`` loop (one client at a time).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import primitives as p


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


def _built(x: Any) -> Any:
  return x.build() if isinstance(x, (_Scatter, _Zeros)) else x


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
  return (not isinstance(x, _Scatter) and np.shape(x) == tuple(aval.shape) and
          jax.numpy.result_type(x) == aval.dtype)


def _rewrite(eqn, ins: list[Any]) -> list[Any] | None:
  """The outputs of ``eqn`` with a scatter kept unbuilt, or None for a plain bind."""
  prim = eqn.primitive
  if prim is p.broadcast_in_dim_p and _is_zero_literal(eqn.invars[0]):
    return [_Zeros(eqn)]
  if prim is p.scatter_add_p and isinstance(ins[0], _Zeros) and not any(
      isinstance(x, (_Scatter, _Zeros)) for x in ins[1:]):
    return [_Scatter(eqn.outvars[0].aval, ins[1], ins[2], dict(eqn.params))]
  ins = [x.build() if isinstance(x, _Zeros) else x for x in ins]
  lazy = [i for i, x in enumerate(ins) if isinstance(x, _Scatter)]
  if len(lazy) != 1:
    return None
  (i,), s = lazy, ins[lazy[0]]
  other = ins[1 - i] if len(ins) == 2 else None
  in_place_of_s = lambda u: [u if j == i else x for j, x in enumerate(ins)]
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


def _eval(jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  env: dict = {}
  read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
  for v, x in (*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    with eqn.ctx.manager:
      outs = _rewrite(eqn, ins)
      if outs is None and eqn.primitive is p.jit_p and places_nothing(eqn.params):
        inner = eqn.params['jaxpr']
        outs = _eval(inner.jaxpr, inner.consts, ins)
      if outs is None:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(_built, ins), **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def eval_jaxpr(jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
  """``jax.core.eval_jaxpr(jaxpr, consts, *args)`` with row-sparse updates.

  A scatter-add into zeros (a gather's gradient) that is scaled by a scalar,
  negated, or added to (or subtracted from) an array of its shape is added
  into that array directly: ``w - eta * scatter_add(0, I, U)`` is computed
  as ``scatter_add(w, I, -eta * U)``. Everything else is evaluated as
  written. See the module's docstring for what changes in the results.
  """
  return [_built(x) for x in _eval(jaxpr, consts, args)]
