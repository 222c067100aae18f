"""The client-training loop that every algorithm shares.

One client runs ``T`` local steps of an optax optimizer on its data,

    g_t = grad_w (1/|b_t|) sum_{e in b_t} loss(w_t, e)
    (u_t, s_{t+1}) = opt.update(g_t, s_t, w_t);   w_{t+1} = w_t + u_t,

with a ``lax.scan`` over steps (client-side variants such as FedProx's
proximal term or SCAFFOLD's correction are transformations chained into
``opt``, :mod:`fedjx.algorithms.transforms.core`), where ``b_t`` are the real (mask True)
examples of the step's batch. A step whose mask is all False is padding and
changes nothing (``jnp.where`` on parameters and optimizer state), so a client
padded to the cohort's ``[S, B]`` shape gives exactly the result of its
unpadded batches. A step that is padding for every client run together with
this one (the whole cohort under ``vmap``, a chunk under ``chunked``, the
client alone under ``sequential``) is not computed at all
(:func:`scan_steps`; ``scripts/benchmark_padding.py``): the steps some client
of the chunk needs run in a ``while`` loop, each client masking those that
are padding for it; a round that is differentiated takes the steps as the
leaves of a binary tree of ``lax.cond`` branches whose padding costs at most
``log2(S) + 1`` skipped branches.

The schedule of steps (:class:`LocalSchedule`) is either ``epochs`` passes
over the cohort's ``S`` steps (McMahan et al. 2017, ``E`` local epochs), or a
fixed number of ``steps`` that cycles through the client's real steps (the
"local steps" variant and DiLoCo's ``H`` inner steps).

Everything here is per client: it runs inside ``fedjx.map_fn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx.indexed
import fedjx.mapping
from fedjx.algorithms.base import LossFn
from fedjx.algorithms.base import MetricsFn
from fedjx.algorithms.base import Params
from fedjx.algorithms.base import PyTree
from fedjx.algorithms.base import check_positive_int


class LocalSchedule(NamedTuple):
  """What a client does locally (static, part of the compiled program).

  Attributes:
    epochs: passes over the cohort's ``S`` steps (used when ``steps`` is None).
    steps: if set, exactly this many steps, cycling through the client's real
      (not all-padding) steps in order; a client with no data takes none.
    evaluate: whether to evaluate the loss and metrics on all of the client's
      data before and after training (two extra forward passes over it; the
      ``*_before`` / ``*_after`` statistics). If False, the only statistic is
      the training loss of the local steps themselves, which is free.
  """

  epochs: int = 1
  steps: int | None = None
  evaluate: bool = True


class ClientUpdate(NamedTuple):
  """What local training returns for one client.

  Attributes:
    params: the trained parameters ``w_T``.
    opt_state: the optimizer state after the last step.
    num_steps: the number of real steps taken (int32).
    stats: per-client sums for the round's metrics: ``loss_before`` and
      ``loss_after`` (sums of per-example losses at ``w_0`` and ``w_T`` over
      the client's cohort data), the same for each ``metrics_fn`` output, and
      ``count`` (the number of real examples they sum over); without
      evaluation, ``loss_during`` (the sum of the losses of the examples of
      the local steps) and its ``count``.
  """

  params: Params
  opt_state: optax.OptState
  num_steps: jax.Array
  stats: dict[str, jax.Array]


def masked_mean_loss(loss_fn: LossFn, params: Params,
                     batch: Mapping[str, jax.Array], mask: jax.Array) -> jax.Array:
  """``(1/|b|) sum_{e in b} loss(params, e)`` over the real examples ``b``.

  Zero for a batch with no real examples.
  """
  return _masked_mean_and_sums(loss_fn, params, batch, mask)[0]


def _masked_mean_and_sums(loss_fn, params, batch, mask):
  """The masked mean loss, and (sum of losses, number of real examples)."""
  losses = loss_fn(params, batch)
  total = jnp.sum(jnp.where(mask, losses, 0.0))
  count = jnp.sum(mask).astype(total.dtype)
  return total / jnp.maximum(count, 1), (total, count)


def step_schedule(mask: jax.Array, schedule: LocalSchedule) -> tuple[jax.Array, jax.Array]:
  """Indices into the client's ``S`` steps and whether each is real.

  Args:
    mask: the client's ``[S, B]`` mask.
    schedule: the local schedule.

  Returns:
    ``(index [T], active [T])``: step ``t`` uses batch ``index[t]`` and
    changes the model only if ``active[t]``.
  """
  real = jnp.any(mask, axis=-1)
  s = real.shape[0]
  if schedule.steps is None:
    index = jnp.tile(jnp.arange(s), schedule.epochs)
    return index, real[index]
  order = jnp.argsort(jnp.logical_not(real), stable=True)  # Real steps first.
  n = jnp.sum(real)
  t = jnp.arange(schedule.steps)
  index = order[t % jnp.maximum(n, 1)]
  return index, jnp.broadcast_to(n > 0, t.shape)


def scan_steps(step: Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree]],
               carry: PyTree, xs: PyTree, active: jax.Array) -> tuple[PyTree, PyTree]:
  """``lax.scan`` of ``step(carry, x_t, active_t)`` over ``S = len(active)``
  steps, where a step no member of the chunk needs is never entered.

  An evaluated round runs the steps as a ``while`` loop over exactly the
  steps some member of the chunk needs (:func:`fedjx.mapping.any_in_chunk`
  of the members' ``[S]`` flags, combined once, before the loop: no
  collective inside it), in order: no branch per step, and padding costs
  nothing wherever it is. One member at a time (not
  :func:`fedjx.mapping.members_together`) that is exactly its own active
  steps; members run together (a vmapped chunk) take the steps any of them
  needs, each member's own ``active_t`` masking the steps that are padding
  for it (``step`` keeps its carry there). A chunk of members with similar
  step counts (ordered by cost, :mod:`fedjx.mapping`) so computes its
  largest member's steps, as a vmapped ``fori_loop`` over each member's own
  steps would, with one loop for the chunk.

  A ``while`` loop with a data-dependent trip count has no reverse-mode
  derivative, so the loop is a ``jax.custom_jvp`` whose derivative rule is
  the JVP of the same steps as a tree of ``lax.scan`` and ``lax.cond``
  (:func:`_tree_steps`), which both modes differentiate to any order: a
  round that is differentiated gets the tree's derivatives, and its forward
  pass is the tree. Members under a mesh with an Explicit axis take the
  tree in both forms (values typed by an Explicit mesh do not survive
  re-tracing the step on its own).

  ``step`` must leave ``carry`` unchanged and return zeros when ``active_t``
  is False (as a skipped node does; it is entered so only when
  :func:`fedjx.mapping.members_together`), so the result is the plain
  ``scan``'s, step for step: the same ``carry`` and the same stacked outputs
  ``[S, ...]``, with inactive steps anywhere.
  """
  active = jnp.asarray(active)
  needed = fedjx.mapping.any_in_chunk(active)  # [S], the same for the chunk.
  mesh = jax.sharding.get_abstract_mesh()
  if jax.sharding.AxisType.Explicit in getattr(mesh, 'axis_types', ()):
    return _tree_steps(step, carry, xs, active, needed)
  together = fedjx.mapping.members_together()
  # The step as a jaxpr whose closed-over values (the client's data, traced
  # values of the round) are explicit operands: the derivative rule may be
  # traced after the trace that called this one has ended.
  x0 = fedjx.indexed.take(xs, jnp.zeros((), jnp.int32))
  flat, in_tree = jax.tree.flatten((carry, x0, jnp.ones((), bool)))
  closed, out_shape = jax.make_jaxpr(
      lambda *a: step(*jax.tree.unflatten(in_tree, a)), return_shape=True)(*flat)
  out_tree = jax.tree.structure(out_shape)

  def converted(c, x, a, consts):
    # A gathered table's SGD update touches only the rows gathered.
    out = fedjx.fused_updates.eval_jaxpr(closed.jaxpr, consts,
                                          *jax.tree.leaves((c, x, a)))
    return jax.tree.unflatten(out_tree, out)

  return _steps(converted, together, carry, xs, active, needed,
                list(closed.consts))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _steps(step, together, carry, xs, active, needed, consts):
  """:func:`scan_steps` evaluated: a ``while`` loop over the needed steps
  (``together``: members of a chunk, each masked by its own ``active``)."""
  s = needed.shape[0]
  order = jnp.argsort(jnp.logical_not(needed), stable=True)  # Needed first.
  count = jnp.sum(needed, dtype=jnp.int32)
  take = lambda i: fedjx.indexed.take(xs, i)
  shapes = jax.eval_shape(lambda c, x: step(c, x, jnp.ones((), bool), consts)[1],
                          carry, take(jnp.zeros((), jnp.int32)))
  never = count < 0  # False, placed as the client's data is.
  ys = jax.tree.map(lambda y: jnp.broadcast_to(
      never.reshape((1,) * (len(y.shape) + 1)), (s,) + y.shape).astype(y.dtype), shapes)

  def body(j, state):
    carry, ys = state
    i = order[j]
    # One member alone takes only its own active steps: nothing to mask.
    real = active[i] if together else jnp.ones((), bool)
    carry, y = step(carry, take(i), real, consts)
    ys = jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(
        b, jnp.asarray(v, b.dtype), i, 0), ys, y)
    return carry, ys

  return jax.lax.fori_loop(0, count, body, (carry, ys))


@_steps.defjvp
def _steps_jvp(step, together, primals, tangents):
  del together
  carry, xs, active, needed, consts = primals
  dcarry, dxs, _, _, dconsts = tangents
  tree = lambda c, x, k: _tree_steps(lambda c_, x_, a_: step(c_, x_, a_, k),
                                     c, x, active, needed)
  return jax.jvp(tree, (carry, xs, consts), (dcarry, dxs, dconsts))


def _tree_steps(step, carry, xs, active, needed):
  """The steps of :func:`scan_steps` as the leaves of a binary tree.

  A node of level ``d`` covers ``2^d`` consecutive steps and runs as a
  ``lax.scan`` over its two children, each in a ``lax.cond`` on whether any
  member of the chunk (``needed``) has an active step at or after the
  child's first step; a leaf ``t`` is entered only if a member is active at
  ``t``. A member whose last active step is ``c - 1`` enters about ``2c``
  nodes and skips at most ``D + 1`` (one per level, beside its path to step
  ``c - 1``), where ``D = ceil(log2 S)``, so padding costs ``O(log S)``
  branches for any ``S`` and carry, and the step's body is compiled once.
  Every level is ``scan`` and ``cond``, so the steps stay differentiable in
  both modes.
  """
  s = active.shape[0]
  depth = max(s - 1, 0).bit_length()
  # One past the last needed step (0 for none); placed as the client's data.
  end = jnp.max(jnp.where(needed, jnp.arange(1, s + 1), 0))

  def leaf(carry, t):
    i = jnp.minimum(t, s - 1)
    x = fedjx.indexed.take(xs, i)
    carry, y = step(carry, x, jnp.logical_and(t < s, active[i]))
    return carry, jax.tree.map(lambda v: v[None], y)

  shapes = jax.eval_shape(leaf, carry, jnp.zeros((), jnp.int32))[1]
  never = end < 0  # False, placed as the client's data is.

  def zeros(steps):
    return jax.tree.map(lambda y: jnp.broadcast_to(
        never.reshape((1,) * len(y.shape)), (steps,) + y.shape[1:]).astype(y.dtype),
                        shapes)

  def guarded(run, steps, enter):
    """``run`` from step ``first`` if ``enter(first)``, else zeros."""
    def node(carry, first):
      return jax.lax.cond(enter(first), lambda c: run(c, first),
                          lambda c: (c, zeros(steps)), carry)
    return node

  run = guarded(leaf, 1, lambda t: jnp.logical_and(t < s, needed[jnp.minimum(t, s - 1)]))
  for d in range(1, depth + 1):
    half, child = 1 << (d - 1), run

    def pair(carry, first, child=child, half=half):
      carry, ys = jax.lax.scan(lambda c, j: child(c, first + j * half), carry,
                               jnp.arange(2))
      return carry, jax.tree.map(lambda y: y.reshape((2 * half,) + y.shape[2:]), ys)

    run = guarded(pair, 1 << d, lambda first: first < end)
  carry, ys = run(carry, jnp.zeros((), jnp.int32))
  return carry, jax.tree.map(lambda y: y[:s], ys)


def tie_to(tree: PyTree, mask: jax.Array) -> PyTree:
  """``tree`` unchanged, but computed from the client's data.

  Inside ``vmap`` over clients sharded on an Explicit mesh axis, JAX cannot
  broadcast a ``lax.scan`` carry that does not depend on the mapped inputs
  (e.g. an optimizer's step count); a carry tied to the data is mapped
  already.
  """
  never = jnp.logical_and(mask.reshape(-1)[0], False)
  return jax.tree.map(lambda x: jnp.where(never, jnp.zeros_like(x), x), tree)


def train(loss_fn: LossFn, optimizer: optax.GradientTransformation,
          params: Params, opt_state: optax.OptState,
          batches: Mapping[str, jax.Array], mask: jax.Array,
          schedule: LocalSchedule) -> tuple[Params, optax.OptState, jax.Array, dict[str, jax.Array]]:
  """Local training of one client.

  Returns ``(params, opt_state, num_steps, sums)``, where ``sums`` holds
  ``loss`` (the sum of the per-example losses of every real example of every
  local step, at the parameters of that step) and ``count`` (how many there
  were): the client's training loss, at no extra cost.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    optimizer: the client optimizer.
    params: the starting point ``w_0``.
    opt_state: the optimizer's starting state.
    batches: the client's data, leaves ``[S, B, ...]``.
    mask: ``[S, B]``, True for real examples.
    schedule: which steps to take.
  """
  grad_fn = jax.grad(_masked_mean_and_sums, argnums=1, has_aux=True)

  def real_step(carry, batch, m, is_real):
    # The running sums ride in the carry rather than as per-step outputs: a
    # step then writes no [S] slot, which a loop of many tiny steps feels.
    params, opt_state, sums = carry
    grads, (total, count) = grad_fn(loss_fn, params, batch, m)
    updates, new_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_sums = {'loss': sums['loss'] + jnp.where(is_real, total, 0.0).astype(jnp.float32),
                'count': sums['count'] + jnp.where(is_real, count, 0.0).astype(jnp.float32)}
    cast = lambda new, old: new.astype(jnp.result_type(old))
    if not fedjx.mapping.members_together():
      # This branch runs only for a real step of this client: nothing to mask.
      return (jax.tree.map(cast, new_params, params),
              jax.tree.map(cast, new_state, opt_state), new_sums), None
    keep = lambda new, old: cast(jnp.where(is_real, new, old), old)
    return (jax.tree.map(keep, new_params, params),
            jax.tree.map(keep, new_state, opt_state), new_sums), None

  def step(carry, x, is_real):
    # A step that is padding for every client run with this one is never
    # entered (scan_steps); a client whose own step is padding keeps its
    # state (jnp.where in real_step).
    return real_step(carry, *x, is_real)

  zeros = {'loss': jnp.zeros((), jnp.float32), 'count': jnp.zeros((), jnp.float32)}
  carry = tie_to((params, opt_state, zeros), mask)
  if schedule.steps is None:  # Epochs: scan over the steps as they are.
    active = jnp.any(mask, axis=-1)
    epoch = lambda c, _: scan_steps(step, c, (batches, mask), active)
    carry, _ = jax.lax.scan(epoch, carry, None, length=schedule.epochs)
    num_steps = schedule.epochs * jnp.sum(active, dtype=jnp.int32)
  else:  # A fixed number of steps: gather each step's batch.
    index, active = step_schedule(mask, schedule)
    take = lambda i: fedjx.indexed.take((batches, mask), i)
    indexed_step = lambda carry, i, is_real: step(carry, take(i), is_real)
    carry, _ = scan_steps(indexed_step, carry, index, active)
    num_steps = jnp.sum(active, dtype=jnp.int32)
  params, opt_state, sums = carry
  return params, opt_state, num_steps, sums


def evaluate(loss_fn: LossFn, metrics_fn: MetricsFn | None, params: Params,
             batches: Mapping[str, jax.Array], mask: jax.Array) -> dict[str, jax.Array]:
  """Sums of per-example loss and metrics over the client's real examples.

  Returns ``{'loss': ..., <metric>: ..., 'count': number of real examples}``.
  """
  def real_batch(sums, batch, m):
    out = {'loss': loss_fn(params, batch)}
    if metrics_fn is not None:
      out.update(metrics_fn(params, batch))
    new = {k: sums[k] + jnp.sum(jnp.where(m, v, 0.0)).astype(jnp.float32)
           for k, v in out.items() if k != 'count'}
    new['count'] = sums['count'] + jnp.sum(m, dtype=jnp.float32)
    return new

  # Padding batches of every client run with this one are not evaluated; the
  # chunk's flags are combined before the loop (no collective in a branch).
  needed = fedjx.mapping.any_in_chunk(jnp.any(mask, axis=-1))

  def step(sums, t):
    batch, m = fedjx.indexed.take((batches, mask), t)
    return jax.lax.cond(needed[t], real_batch,
                        lambda sums, *unused: sums, sums, batch, m), None

  keys = ['loss'] + ([] if metrics_fn is None else list(jax.eval_shape(
      metrics_fn, params, fedjx.indexed.take(batches, 0))))
  zeros = tie_to({k: jnp.zeros((), jnp.float32) for k in keys + ['count']}, mask)
  sums, _ = jax.lax.scan(step, zeros, jnp.arange(jnp.shape(mask)[0]))
  return sums


def local_update(loss_fn: LossFn, metrics_fn: MetricsFn | None,
                 optimizer: optax.GradientTransformation, params: Params,
                 opt_state: optax.OptState, batches: Mapping[str, jax.Array],
                 mask: jax.Array, schedule: LocalSchedule) -> ClientUpdate:
  """:func:`train` plus the client's statistics.

  With ``schedule.evaluate`` (the default), the statistics are the sums of
  the loss and metrics over the client's data before and after training
  (:class:`ClientUpdate`); otherwise they are ``loss_during`` and ``count``
  from :func:`train`, the training loss of the local steps.
  """
  if not schedule.evaluate:
    new_params, opt_state, num_steps, sums = train(
        loss_fn, optimizer, params, opt_state, batches, mask, schedule)
    stats = {'loss_during': sums['loss'], 'count': sums['count']}
    return ClientUpdate(new_params, opt_state, num_steps, stats)
  before = evaluate(loss_fn, metrics_fn, params, batches, mask)
  new_params, opt_state, num_steps, _ = train(
      loss_fn, optimizer, params, opt_state, batches, mask, schedule)
  after = evaluate(loss_fn, metrics_fn, new_params, batches, mask)
  stats = {'count': before.pop('count')}
  after.pop('count')
  stats.update({f'{k}_before': v for k, v in before.items()})
  stats.update({f'{k}_after': v for k, v in after.items()})
  return ClientUpdate(new_params, opt_state, num_steps, stats)


def check_schedule(fn: str, local_epochs: int, local_steps: int | None,
                   client_evaluation: bool = True) -> LocalSchedule:
  """Validates the builder arguments and returns the schedule."""
  check_positive_int(fn, 'local_epochs', local_epochs)
  check_positive_int(fn, 'local_steps', local_steps, allow_none=True)
  if local_steps is not None and local_epochs != 1:
    raise ValueError(f'{fn}: pass local_steps={local_steps!r} or '
                     f'local_epochs={local_epochs!r}, not both.')
  if not isinstance(client_evaluation, bool):
    raise ValueError(f'{fn}: client_evaluation={client_evaluation!r}; it must '
                     'be True or False.')
  return LocalSchedule(epochs=local_epochs, steps=local_steps,
                       evaluate=client_evaluation)

