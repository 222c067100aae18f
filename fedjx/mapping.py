"""``map_fn``: apply a function to each member of a placement.

``map_fn(fn, args)`` computes ``out_i = fn(args_i)`` for every member ``i`` of
the placement, where ``args_i`` is the ``i``-th slice of the leading axis of
each placed input. It is the "map" of the MapReduce model of DrJAX
(arXiv 2403.07128). How the members are run is a *strategy*; all give the same
numbers, and they differ only in speed and memory:

* ``vmap``: all members at once with ``jax.vmap``. Fastest for small client
  computations, but memory grows with the cohort and large batched
  convolutions can be slow.
* ``chunked``: ``k`` members at a time (``vmap`` inside a chunk, a loop
  over chunks): memory bounded by ``k`` clients. A chunk computes its
  largest member's steps, so the chunks are formed from each member's step
  count (:func:`chunk_widths`): a member that would waste more than 5% of a
  chunk runs alone, and the map computes at most 1.05 times the real steps.
* ``sequential``: one member at a time per device (``lax.map``).
* ``auto``: picks one of the above from the backend, cohort size and the size
  of the per-client inputs (see :func:`choose_chunk_size`). On a TPU or GPU
  it runs vmapped chunks of members ordered by their step counts
  (:func:`run_sorted`), as wide as :mod:`fedjx.chunk_cost`'s model of a
  local step says: many tiny steps one after another leave an accelerator
  idle, and sorted chunks pad little.

When a mesh with an axis named after the placement is active, each strategy
keeps that axis sharded: the members are laid out as ``[k, n / k]`` with the
``k`` axis sharded over the mesh (``jax.vmap(..., spmd_axis_name=...)``), so a
chunk runs one slice per device and no data moves between devices. Where
each device holds whole models (:func:`device_blocks`) and the map's outputs
are only reduced, the fused map instead runs one block of ``n / d`` members
per device, each with the strategy chosen for ``n / d`` members on one
device (:mod:`fedjx.fusion`).

Per-member state kept in a store (``rows=Rows(store, ids)``: member ``i``
reads row ``ids[i]`` of every leaf ``[N, ...]`` of ``store`` and gives its
new row back) is updated in place when members run one at a time: the loop
over members carries the store and writes each member's row where it read
it, so memory holds the store once, not also the cohort's rows gathered and
their new values stacked (DiLoCo's replicas' AdamW states: ``M x 8N``
bytes). Other strategies gather the rows, map, and write them back.

The mapped computation is wrapped in a ``jax.jit`` named
``fedjx_map_<placement>``, so it stays recognisable in a traced program (the
``sequential`` strategy keeps the per-client computation as the body of a
``scan`` inside it, which is how :mod:`fedjx.beam` recovers client work).
Jit the program that calls ``map_fn``: called eagerly, each call compiles its
mapped computation afresh.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjx import chunk_cost
from fedjx import distributed
from fedjx import frames
from fedjx import indexed
from fedjx import options as options_lib
from fedjx import sharding as sharding_lib

# How each map runs (a debug record per traced map: its members, chunks and
# order), and maps that fusion does not reach.
_LOG = logging.getLogger('fedjx.fusion')
PLAN_MESSAGE = 'fedjx.map_fn over %r: %d members, %s in chunks of %d%s'

# Per-device memory budget for the inputs of one chunk of clients under the
# ``auto`` strategy; the activations of client training are several times this.
_AUTO_CHUNK_INPUT_BYTES = {'cpu': 64 << 20, 'gpu': 512 << 20, 'tpu': 512 << 20}
# CPU (measured on 2 cores, docs/benchmarks.md): vmap wins only for tiny client
# computations (logistic regression); mid-sized ones (a 135k-parameter
# transformer) run best a few clients at a time; large ones (the 1.2M-parameter
# EMNIST CNN, whose vmapped convolutions are 3x slower) one at a time.
_CPU_VMAP_MAX_CLIENT_BYTES = 256 << 10
_CPU_SMALL_CHUNK_MAX_CLIENT_BYTES = 2 << 20
_CPU_SMALL_CHUNK = 4
# Accelerators: ``map_fn`` runs sorted chunks as wide as the cost model of
# fedjx.chunk_cost says, from one member's step. Where no step is known
# (fedjx.streaming's chunks of a streamed round), the rules measured before:
# GPUs (an H200, EMNIST CNN) vmap up to ~128 clients, chunks of 64 beyond
# (4.8 s vmap vs 0.84 s chunks of 64 at 1024 clients) ...
_ACCELERATOR_VMAP_MAX_CLIENTS = 128
_ACCELERATOR_CHUNK = 64
# ... TPUs (one v5e chip, docs/benchmarks.md) vmap only tiny client
# computations (logistic regression: 1.38 ms vmapped vs 7.85 ms one at a
# time, 128 clients) and run anything larger one client at a time (the
# 135k-parameter transformer 104 ms vs 230 ms in chunks of 64 whose steps
# took a tree of branches; the EMNIST CNN 504 vs 970 ms).
_TPU_VMAP_MAX_CLIENT_BYTES = 256 << 10


def _client_bytes(leaves: list[Any]) -> int:
  return sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize for x in leaves)


def _mesh_axis_size(placement: str, mesh: Any) -> int:
  mesh = sharding_lib.active_mesh(mesh)
  if sharding_lib.placement_axis_type(mesh, placement) is None:
    return 1
  return int(mesh.shape[placement])


def sorts_by_cost(strategy: str, backend: str | None = None) -> bool:
  """Whether a chunked map runs its members in descending cost, ``k`` at a
  time (:func:`run_sorted`): ``auto`` on a TPU or GPU. Elsewhere the chunks
  are the cost-aware windows of :func:`chunk_widths`."""
  return strategy == 'auto' and (backend or jax.default_backend()) in ('tpu', 'gpu')


def choose_chunk_size(strategy: str, n: int, client_bytes: int, devices: int,
                      chunk_size: int | None = None,
                      backend: str | None = None,
                      step: chunk_cost.StepCost | None = None,
                      device_kind: str = '') -> int:
  """How many clients run at once (per step of the loop over chunks).

  Args:
    strategy: ``'vmap'``, ``'chunked'``, ``'sequential'`` or ``'auto'``.
    n: number of clients.
    client_bytes: bytes of one client's inputs (model, data, state).
    devices: devices on the placement's mesh axis (1 with no mesh).
    chunk_size: requested chunk size for ``'chunked'``.
    backend: ``jax.default_backend()`` unless given.
    step: what one member's local step moves and computes; under ``'auto'``
      on a TPU or GPU the chunk is :func:`fedjx.chunk_cost.chunk_width` of
      it (of each device's ``n / devices`` members).
    device_kind: the device's kind (``jax.Device.device_kind``), for its
      speeds in the cost model.

  Returns:
    The chunk size ``k``: a multiple of ``devices`` (each device runs ``k /
    devices`` clients at a time), at most ``n`` rounded up to ``devices``. On
    one device, a divisor of ``n`` above 3/4 of the chosen size replaces it
    when there is one (no padding members).
  """
  full = devices * math.ceil(n / devices)
  if strategy == 'vmap':
    k = full
  elif strategy == 'sequential':
    k = devices
  elif strategy == 'chunked':
    k = chunk_size or min(n, _ACCELERATOR_CHUNK)
  elif strategy == 'auto':
    backend = backend or jax.default_backend()
    budget = _AUTO_CHUNK_INPUT_BYTES.get(backend, _AUTO_CHUNK_INPUT_BYTES['gpu'])
    by_memory = max(1, budget // max(client_bytes, 1)) * devices
    if step is not None:  # Sorted chunks, as wide as the cost model says.
      k = devices * chunk_cost.chunk_width(math.ceil(n / devices), step, backend,
                                           device_kind)
    elif backend == 'cpu':
      if client_bytes <= _CPU_VMAP_MAX_CLIENT_BYTES:
        k = full
      elif client_bytes <= _CPU_SMALL_CHUNK_MAX_CLIENT_BYTES:
        k = _CPU_SMALL_CHUNK * devices
      else:
        k = devices
    elif backend == 'tpu':
      k = full if client_bytes <= _TPU_VMAP_MAX_CLIENT_BYTES else devices
    elif n <= _ACCELERATOR_VMAP_MAX_CLIENTS:
      k = full
    else:
      k = _ACCELERATOR_CHUNK
    k = min(k, by_memory)
  else:
    raise ValueError(f'fedjx.map_fn: strategy={strategy!r} is not one of '
                     f'{frames.MAP_STRATEGIES}.')
  k = devices * math.ceil(min(k, full) / devices)
  if devices == 1 and k < n:
    k = _divisor_near(n, k)
  return max(k, devices)


def _divisor_near(n: int, k: int) -> int:
  """The largest divisor of ``n`` in ``(3k / 4, k]``, else ``k``.

  Chunks that divide the cohort need no padding members, and then the
  stacked outputs of the chunks are the result as they lie in memory; with
  padding they are copied once more (10,000 clients of a 1.2M-parameter
  model in chunks of 64: a 48 GB copy, avoided by chunks of 50).
  """
  for d in range(k, (3 * k) // 4, -1):
    if n % d == 0:
      return d
  return k


def _pad_leading(x: jax.Array, total: int) -> jax.Array:
  """Pads the leading axis to ``total`` by repeating the last member."""
  extra = total - x.shape[0]
  if extra == 0:
    return x
  tail = jnp.broadcast_to(x[-1:], (extra,) + x.shape[1:])
  return jnp.concatenate([x, tail], axis=0)


def run_mapped(fn: Callable[..., Any], args: Any, n: int, k: int,
               placement: str, mesh: Any) -> Any:
  """Runs ``fn`` over the leading axis of ``args`` in chunks of ``k`` clients.

  On a mesh axis, members are laid out as ``[k, m]`` (``m = ceil(n / k)``;
  member ``r * m + c`` at row ``r``, column ``c``) after padding to ``k * m``
  members; the ``k`` rows are vmapped (and sharded over the mesh axis, so each
  device keeps its own contiguous block of members), the ``m`` columns looped
  over. Without one, they are laid out ``[m, k]`` and the loop runs over
  consecutive chunks.
  """
  m = math.ceil(n / k)
  axis_name = sharding_lib.spmd_axis_name(placement, mesh)

  def to_grid(x):
    x = _pad_leading(x, k * m).reshape((k, m) + x.shape[1:])
    return sharding_lib.place_leading_axis(x, placement, mesh)

  def from_grid(y):
    y = sharding_lib.place_leading_axis(y, placement, mesh)
    return y.reshape((k * m,) + y.shape[2:])[:n]

  chunk = frames.chunk_axis_name(placement)
  # JAX cannot psum over a vmap axis sharded on an Explicit mesh axis (an
  # internal assertion, even outside a cond), so there any_in_chunk gathers
  # the members' predicates instead (lax.all_gather, which it accepts).
  explicit = (axis_name is not None and sharding_lib.placement_axis_type(
      sharding_lib.active_mesh(mesh), placement) == jax.sharding.AxisType.Explicit)

  def vmapped(f, **kwargs):
    """``jax.vmap(f)`` over a chunk's members, traced as one chunk."""
    def run(x):
      with frames.chunk_axis(chunk, explicit=explicit):
        return jax.vmap(f, axis_name=chunk, **kwargs)(x)
    return run

  if k == 1 and axis_name is None:  # One member at a time.
    return jax.lax.map(fn, args)
  if axis_name is None and m > 1:
    # No device axis to keep members on: chunk c is members c*k .. c*k+k-1,
    # laid out [m, k], so the stacked outputs need no transpose.
    grid = jax.tree.map(
        lambda x: _pad_leading(x, k * m).reshape((m, k) + x.shape[1:]), args)
    out = jax.lax.map(vmapped(fn), grid)
    return jax.tree.map(lambda y: y.reshape((k * m,) + y.shape[2:])[:n], out)
  if m == 1:  # One chunk: every member at once.
    padded = jax.tree.map(lambda x: sharding_lib.place_leading_axis(
        _pad_leading(x, k), placement, mesh), args)
    out = vmapped(fn, spmd_axis_name=axis_name)(padded)
    return jax.tree.map(lambda y: y[:n], out)
  grid = jax.tree.map(to_grid, args)
  out = vmapped(lambda row: jax.lax.map(fn, row), spmd_axis_name=axis_name)(grid)
  return jax.tree.map(from_grid, out)


# A chunk of k clients runs as one vmap, so it computes its largest member's
# steps: k * max(c) for real work sum(c). Under ``chunked`` (and ``auto`` with
# chunks), a window of k clients runs as one chunk only if that wastes at most
# this fraction of its real work; otherwise its first client runs alone.
CHUNK_WASTE = 0.05


def member_cost(leaves: list[Any]) -> jax.Array | None:
  """Each member's step count, derived from the cohort mask among ``leaves``.

  A placed boolean leaf of rank 3 or more is read as a cohort's ``[n, S, B,
  ...]`` mask: member ``i`` costs ``c_i``, the number of its steps with a real
  example (the most over several such leaves). None if there is none.
  """
  steps = [jnp.sum(jnp.any(x.reshape(x.shape[:2] + (-1,)), -1), -1, dtype=jnp.int32)
           for x in leaves
           if jnp.ndim(x) >= 3 and jnp.result_type(x) == jnp.bool_]
  if not steps:
    return None
  out = steps[0]
  for s in steps[1:]:
    out = jnp.maximum(out, s)
  return out


def cost_bound(leaves: list[Any]) -> int | None:
  """The largest cost :func:`member_cost` can give for ``leaves``: the steps
  ``S`` of the cohort masks among them (None if there is none)."""
  steps = [jnp.shape(x)[1] for x in leaves
           if jnp.ndim(x) >= 3 and jnp.result_type(x) == jnp.bool_]
  return max(steps) if steps else None


def descending_order(cost: Any, bound: int | None = None) -> jax.Array:
  """The members in descending ``cost``, ties in member order (``int32 [n]``).

  With a static ``bound`` (every cost an integer in ``[0, bound]``, as
  :func:`member_cost`'s are) and ``(bound + 1) n < 2^31``, one sort of the
  distinct keys ``(bound - c_i) n + i``, whose ascending order is that order
  (then ``i = key mod n``); otherwise a stable ``argsort`` of ``-cost``. The
  same order either way; compiled for a TPU v5e the one-key sort takes
  under half the compile time of the two-operand stable sort at 10,000 and
  100,000 members (0.75 s against 1.7 s, 3.2 s against 7.1 s).
  """
  cost = jnp.asarray(cost)
  n = cost.shape[0]
  if bound is None or (bound + 1) * n >= 2**31 or not jnp.issubdtype(
      cost.dtype, jnp.integer):
    return jnp.argsort(-cost, stable=True).astype(jnp.int32)
  c = jnp.clip(cost.astype(jnp.int32), 0, bound)
  key = (bound - c) * n + jnp.arange(n, dtype=jnp.int32)
  return jax.lax.sort(key, is_stable=False) % n


def _wide(window: Any, k: int, waste: float, xp: Any = jnp) -> Any:
  """Whether a window of ``k`` costs runs as one chunk: ``k max(c) <=
  (1 + waste) sum(c)``, in float32 on the host as in the program."""
  window = xp.asarray(window).astype(xp.float32)
  return k * xp.max(window) <= xp.float32(1 + waste) * xp.sum(window)


def chunk_widths(cost: Any, k: int, waste: float = CHUNK_WASTE) -> list[int]:
  """The widths of the chunks that a cost-aware chunked map runs, in order.

  From member ``j`` on (``j = 0`` first): the ``k`` members ``j .. j+k-1``
  run as one chunk if they all exist and ``k max(c) <= (1 + waste) sum(c)``
  over them; otherwise member ``j`` runs alone. Every width-``k`` chunk so
  wastes at most ``waste`` of its real work, and a member alone wastes none,
  so the map computes at most ``(1 + waste) sum(c)``: on a cohort ordered by
  descending cost (``make_cohort(order_by_steps=True)``) the large, unequal
  members run alone and the many similar small ones in chunks; unordered,
  the bound still holds, with more members alone (slower, same numbers).
  The host twin of the program's loop, for benchmarks and tests.
  """
  cost = np.asarray(cost)
  n, j, widths = len(cost), 0, []
  while j < n:
    w = k if j + k <= n and bool(_wide(cost[j:j + k], k, waste, np)) else 1
    widths.append(w)
    j += w
  return widths


def sorted_chunks(cost: Any, k: int) -> list[np.ndarray]:
  """The members of each chunk of :func:`run_sorted`, in the order it runs
  them: the members in descending cost (ties in member order), ``k`` at a
  time; where ``k`` does not divide ``n`` the last chunk is the ``k``
  cheapest, some of whose members the chunk before ran already (their
  results are kept once). The host twin of the program's loop."""
  cost = np.asarray(cost)
  n = len(cost)
  order = np.argsort(-cost, kind='stable')
  return [order[min(c * k, n - k):min(c * k, n - k) + k] for c in range(-(-n // k))]


def computed_steps(cost: Any, k: int, strategy: str = 'chunked',
                   waste: float = CHUNK_WASTE) -> int:
  """Steps a map computes when each chunk runs its largest member's steps.

  ``sequential``: ``sum(c)``; ``vmap``: ``n max(c)``; ``chunked`` of ``k``
  (the cost-aware chunks of :func:`chunk_widths`) and ``sorted`` (the
  chunks of :func:`sorted_chunks`, ``auto`` on an accelerator): ``sum over
  chunks of width x max(c)``. Divided by ``sum(c)`` it is the round's
  ``computed / real`` steps.
  """
  cost = np.asarray(cost, np.int64)
  if strategy == 'sequential' or k == 1:
    return int(cost.sum())
  if strategy == 'vmap' or k >= len(cost):
    return int(len(cost) * cost.max(initial=0))
  if strategy == 'sorted':
    return int(sum(k * cost[chunk].max() for chunk in sorted_chunks(cost, k)))
  total, j = 0, 0
  for w in chunk_widths(cost, k, waste):
    total += w * int(cost[j:j + w].max())
    j += w
  return total


# Members per block of :func:`run_by_cost`: a block whose members all run
# alone runs them in a loop with no branch per member.
BY_COST_BLOCK = 16


def chunk_roles(cost: jax.Array, n: int, k: int,
                waste: float = CHUNK_WASTE) -> jax.Array:
  """The traced twin of :func:`chunk_widths`, one role per member: ``[n]``
  int32, 1 for a member that runs alone, 2 for the first member of a chunk
  of ``k``, 0 for the other members of a chunk.

  A ``scan`` over the members carries the first member not yet placed;
  member ``j``, if it is that member, starts a chunk when the window ``j ..
  j+k-1`` exists and ``k max(c) <= (1 + waste) sum(c)`` over it, else runs
  alone (the rule of :func:`chunk_widths`, in the same float32 arithmetic).
  """
  cost = jnp.asarray(cost)

  def body(next_member, j):
    window = jax.lax.dynamic_slice_in_dim(cost, jnp.minimum(j, n - k), k)
    wide = jnp.logical_and(j + k <= n, _wide(window, k, waste))
    placed = j >= next_member  # Not inside a chunk started before.
    role = jnp.where(placed, jnp.where(wide, 2, 1), 0)
    width = jnp.where(wide, k, 1)
    return jnp.where(placed, j + width, next_member), role.astype(jnp.int32)

  _, roles = jax.lax.scan(body, jnp.zeros((), jnp.int32),
                          jnp.arange(n, dtype=jnp.int32))
  return roles


def run_by_cost(step: Callable[[Any, jax.Array, int], Any], carry: Any,
                cost: jax.Array, n: int, k: int,
                waste: float = CHUNK_WASTE, block: int = BY_COST_BLOCK) -> Any:
  """Runs the chunks of :func:`chunk_widths` from the traced ``cost``.

  ``step(carry, start, width)`` runs members ``start .. start + width - 1``
  (``width`` static: 1 or ``k``) and returns the new carry, in the order of
  :func:`chunk_widths`. The members' roles come from the costs
  (:func:`chunk_roles`; traced: one program for every cohort), and the
  members are run in blocks of ``block``: a ``scan`` over the blocks takes,
  in a ``lax.cond`` on an unbatched flag, either the block's loop with no
  branch per member (every member of the block runs alone) or a loop that
  chooses per member between the branches of a ``lax.switch`` (skip: inside
  a chunk started before or past ``n``; run alone; run a chunk of ``k``).
  Only the chosen branches run and the loops stay reverse-differentiable.
  XLA copies a loop's carry (e.g. the sums of fused reductions) out of a
  branch once per iteration, so a cohort whose members mostly run alone
  (unordered, of unequal sizes) copies it about once a block rather than
  once a member. The members run in the order of :func:`chunk_widths`, so
  the results are those of one member or chunk at a time, bit for bit.
  Memory is one chunk's.
  """
  roles = chunk_roles(cost, n, k, waste)
  blocks = -(-n // block)
  # Past n: skipped, so the last partial block takes the per-member loop.
  padded = jnp.concatenate([roles, jnp.zeros((blocks * block - n,), jnp.int32)])
  padded = padded.reshape(blocks, block)
  alone = jnp.all(padded == 1, axis=1)

  def one(carry, j):
    return step(carry, j, 1), None

  def chosen(carry, jr):
    j, role = jr
    return jax.lax.switch(role, [lambda c: c, lambda c: step(c, j, 1),
                                 lambda c: step(c, j, k)], carry), None

  def body(carry, xs):
    b, all_alone, role = xs
    members = b * block + jnp.arange(block, dtype=jnp.int32)
    carry = jax.lax.cond(
        all_alone, lambda c: jax.lax.scan(one, c, members)[0],
        lambda c: jax.lax.scan(chosen, c, (members, role))[0], carry)
    return carry, None

  carry, _ = jax.lax.scan(
      body, carry, (jnp.arange(blocks, dtype=jnp.int32), alone, padded))
  return carry


def run_sorted(step: Callable[[Any, jax.Array, jax.Array], Any], carry: Any,
               cost: jax.Array, n: int, k: int, bound: int | None = None) -> Any:
  """Runs the chunks of :func:`sorted_chunks` from the traced ``cost``.

  ``step(carry, members, fresh)`` runs the ``k`` members ``members``
  (``int32 [k]``) as one chunk and returns the new carry; ``fresh[j]`` is
  False for a member of the last chunk that a chunk before ran already
  (whose results it must not count again). The order is one sort of
  the costs in the program (:func:`descending_order`, ``bound`` the largest
  cost possible where known), so a cohort in any order runs in chunks of
  members with similar costs: a chunk computes its largest member's steps,
  and sorted, the chunks of a cohort compute at most ``sum(c) + k (max(c)
  - min(c))`` member-steps (each chunk's largest member is at most the
  smallest of the chunk before). A ``scan`` over the ``ceil(n / k)``
  chunks: one chunk's memory, reverse-differentiable.
  """
  order = descending_order(cost, bound)
  m = -(-n // k)
  firsts = jnp.arange(m, dtype=jnp.int32) * k
  starts = jnp.minimum(firsts, n - k)

  def body(carry, xs):
    start, first = xs
    members = jax.lax.dynamic_slice_in_dim(order, start, k)
    fresh = start + jnp.arange(k, dtype=jnp.int32) >= first
    return step(carry, members, fresh), None

  carry, _ = jax.lax.scan(body, carry, (starts, firsts))
  return carry


def gather_members(tree: Any, members: jax.Array) -> Any:
  """The members ``members`` of each placed leaf of ``tree`` (a chunk)."""
  return jax.tree.map(lambda x: jnp.take(x, members, axis=0, mode='clip'), tree)


def run_mapped_by_cost(fn: Callable[..., Any], args: Any, cost: jax.Array,
                       n: int, k: int, placement: str, sort: bool = False,
                       bound: int | None = None) -> Any:
  """:func:`run_mapped` without a mesh axis, in the chunks of
  :func:`chunk_widths` (or of :func:`sorted_chunks`, with ``sort``): each
  chunk's outputs are written into ``[n, ...]`` buffers at its members'
  places."""
  chunk = frames.chunk_axis_name(placement)
  if sort:
    def vmapped(part):
      with frames.chunk_axis(chunk):
        return jax.vmap(fn, axis_name=chunk)(part)

    shapes = jax.eval_shape(lambda: vmapped(gather_members(
        args, jnp.zeros((k,), jnp.int32))))
    buffers = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape[1:], s.dtype), shapes)

    def sorted_step(buffers, members, fresh):
      del fresh  # A member run twice writes the same values twice.
      out = vmapped(gather_members(args, members))
      return jax.tree.map(lambda b, y: b.at[members].set(
          y.astype(b.dtype), unique_indices=True), buffers, out)

    return run_sorted(sorted_step, buffers, cost, n, k, bound)

  def run(width, start):
    part = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, width), args)
    if width == 1:  # Alone, not vmapped (XLA:CPU runs batched products slower).
      one = fn(jax.tree.map(lambda x: x[0], part))
      return jax.tree.map(lambda y: jnp.asarray(y)[None], one)
    with frames.chunk_axis(chunk):
      return jax.vmap(fn, axis_name=chunk)(part)

  shapes = jax.eval_shape(lambda: run(k, jnp.zeros((), jnp.int32)))
  buffers = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape[1:], s.dtype), shapes)

  def step(buffers, start, width):
    out = run(width, start)
    return jax.tree.map(lambda b, y: jax.lax.dynamic_update_slice_in_dim(
        b, y.astype(b.dtype), start, 0), buffers, out)

  return run_by_cost(step, buffers, cost, n, k)


def members_together() -> bool:
  """Whether :func:`any_in_chunk` combines the predicates of several members.

  True inside a chunk vmapped on a named axis; then a ``lax.cond`` on
  ``any_in_chunk(p)`` runs its work for members whose own ``p`` is False,
  and each must mask its result. False for one member at a time (and for
  members vmapped on no named axis, where the ``cond`` becomes a select per
  member): the ``cond`` on ``p`` alone already leaves such a member as it
  was, and a mask would only copy the values once more.
  """
  axes = frames.chunk_axes()
  return bool(axes) and '' not in axes


def any_in_chunk(pred: Any) -> jax.Array:
  """Whether ``pred`` holds for any member of the chunk being run now.

  Inside a function given to :func:`map_fn`, the members of a chunk run
  together (``vmap``), so work that only some of them need is computed for
  all of them. ``lax.cond(any_in_chunk(p), work, skip, ...)`` skips it when
  no member of the chunk needs it: the predicate is the same for every
  member (a ``psum`` over the chunk's vmap axis; on an Explicit mesh axis,
  where JAX refuses that psum, ``any`` of the ``lax.all_gather`` of the
  members' predicates), so the ``cond`` stays a
  branch instead of becoming a select that computes both sides. With one
  member at a time (``sequential``), it is ``pred`` itself. Each member must
  still mask its own result (``jnp.where(p, new, old)``). An array ``pred``
  is combined elementwise.

  The combination is a collective across the devices the chunk spans: call
  it outside every ``lax.cond`` branch (once, on all the predicates a loop
  will need, as :func:`fedjx.algorithms.client_update.scan_steps` does).
  One per branch of the tree of local steps, nested in its scans, deadlocked
  runs of two processes on XLA:CPU, and it costs a collective per step.
  """
  pred = jnp.asarray(pred, bool)
  axes = frames.chunk_axes()
  if not axes or '' in axes:
    return pred
  gather = frames.gather_axes()
  summed = tuple(a for a in axes if a not in gather)
  if summed:
    pred = jax.lax.psum(pred.astype(jnp.int32), summed) > 0
  for axis in gather:
    # On an Explicit mesh axis JAX refuses the psum; the gathered [k]
    # predicates of the chunk reduce to the same unbatched value.
    pred = jnp.any(jax.lax.all_gather(pred, axis), axis=0)
  return pred


class Rows(NamedTuple):
  """A store of per-member state that :func:`map_fn` reads and writes by row.

  Attributes:
    store: a pytree whose leaves are ``[N, ...]``: row ``r`` is the state of
      population member ``r``.
    ids: ``[n]`` integers, the row of each member of the placement (a
      negative id counts from the end, as in NumPy indexing); the ids of
      written members must be distinct.
    write: ``[n]`` booleans, whether each member's new row is written (a
      padding member's is not), or None: every member's.
  """

  store: Any
  ids: Any
  write: Any = None


def _check_rows(rows: Any) -> tuple[list[Any], Any, jax.Array, jax.Array | None]:
  """``(store leaves, store treedef, ids, write)`` of ``rows``, checked."""
  if not isinstance(rows, Rows):
    raise ValueError(f'fedjx.map_fn: rows={rows!r} must be a fedjx.mapping.Rows.')
  leaves, tree = jax.tree.flatten(rows.store)
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError('fedjx.map_fn: the leaves of rows.store must share a '
                     'leading axis (the rows); got shapes '
                     f'{[jnp.shape(x) for x in leaves]}.')
  ids = jnp.asarray(rows.ids)
  if jnp.ndim(ids) != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f'fedjx.map_fn: rows.ids has shape {jnp.shape(ids)} and dtype '
                     f'{ids.dtype}; it must be [n] integers, one row per member.')
  write = rows.write
  if write is not None:
    write = jnp.asarray(write)
    if jnp.shape(write) != jnp.shape(ids) or write.dtype != jnp.bool_:
      raise ValueError(f'fedjx.map_fn: rows.write has shape {jnp.shape(write)} and '
                       f'dtype {write.dtype}; it must be {jnp.shape(ids)} booleans, '
                       'like rows.ids, or None.')
  return leaves, tree, ids.astype(jnp.int32), write


def row_index(ids: jax.Array, rows: int) -> jax.Array:
  """``ids`` as rows of a store of ``rows`` rows: negative ids from the end
  (NumPy's indexing), others clipped into ``[0, rows)``."""
  return jnp.clip(jnp.where(ids < 0, ids + rows, ids), 0, rows - 1)


def read_row(store: list[jax.Array], i: jax.Array) -> list[jax.Array]:
  """Row ``i`` (an index from :func:`row_index`) of each leaf of ``store``."""
  return [jax.lax.dynamic_index_in_dim(s, i, keepdims=False) for s in store]


def write_row(store: list[jax.Array], i: jax.Array, new: list[jax.Array],
              old: list[jax.Array], write: jax.Array | None) -> list[jax.Array]:
  """``store`` with row ``i`` set to ``new`` (``old``, the row read, when
  ``write`` is False): one ``dynamic_update_slice`` per leaf, in place in a
  loop's carry."""
  if write is not None:
    new = [jnp.where(write, y.astype(o.dtype), o) for y, o in zip(new, old)]
  return [jax.lax.dynamic_update_index_in_dim(s, y.astype(s.dtype), i, 0)
          for s, y in zip(store, new)]


def _gathered_rows(store: list[jax.Array], ids: jax.Array) -> list[jax.Array]:
  """The members' rows of ``store``, gathered (``store[ids]``)."""
  index = _replicated(row_index(ids, jnp.shape(store[0])[0]))
  return [jnp.take(s, index, axis=0) for s in store]


def _scattered_rows(store: list[jax.Array], ids: jax.Array, new: list[jax.Array],
                    write: jax.Array | None) -> list[jax.Array]:
  """``store`` with the members' ``new`` rows written at ``ids`` (where ``write``)."""
  n_rows = jnp.shape(store[0])[0]
  index = row_index(ids, n_rows)
  if write is not None:
    index = jnp.where(write, index, n_rows)  # Dropped.
  index = _replicated(index)
  new = _replicated(new)
  return [s.at[index].set(y.astype(s.dtype), mode='drop') for s, y in zip(store, new)]


def _replicated(tree: Any) -> Any:
  """``tree`` replicated under an Explicit mesh (where indexing a
  replicated store with member-sharded ids is ambiguous), else as it is."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return tree
  return jax.tree.map(lambda x: jax.sharding.reshard(x, jax.sharding.PartitionSpec()),
                      tree)


def run_rows(fn: Callable[..., Any], store: list[jax.Array], ids: jax.Array,
             write: jax.Array | None, args: Any) -> tuple[list[jax.Array], Any]:
  """One member at a time, updating ``store``'s rows in place.

  ``fn(row, args_i) -> (new_row, out_i)`` (``row`` a list of leaves); a
  ``scan`` over the members carries ``store``, reads member ``i``'s row
  ``ids[i]`` and writes its new row there (:func:`write_row`), so XLA keeps
  one buffer per leaf (the donated argument's, in a round). Returns the new
  store and the stacked ``out_i``.
  """
  n_rows = jnp.shape(store[0])[0]

  def body(store, xs):
    i, w, a = xs
    i = row_index(i, n_rows)
    old = read_row(store, i)
    new, out = fn(old, a)
    return write_row(store, i, list(new), old, w), out

  return jax.lax.scan(body, store, (ids, write, args))


def map_fn(fn: Callable[..., Any], args: Any, *, placement: str | None = None,
           mesh: Any = None, strategy: str | None = None,
           chunk_size: int | None = None, cost: Any = None,
           rows: Rows | None = None) -> Any:
  """Applies ``fn`` to each member's slice of placed ``args``.

  Args:
    fn: the per-member function. If ``args`` is a tuple it is called as
      ``fn(*args_i)``, else as ``fn(args_i)``.
    args: a pytree of placed arrays (leading axis = placement size). An
      :class:`fedjx.IndexedBatches` among them (a cohort of a population on
      the device) is placed by its ``index``; its ``table`` is not placed:
      each member receives it whole, with its own slice of the index, and
      reads its rows with :func:`fedjx.indexed.take` (no per-member copy of
      the table is made).
    placement: which placement to map over (default: the innermost declared).
    mesh: a mesh to shard the placement axis over (default: the program's, or
      the one set with ``jax.set_mesh``).
    strategy: ``'auto'``, ``'vmap'``, ``'chunked'`` or ``'sequential'``
      (default: the program's ``map_strategy``).
    chunk_size: at most this many clients per chunk for ``'chunked'`` (default:
      the program's); see :func:`choose_chunk_size`.
    cost: the placed ``[n]`` work of each member, in steps (default: derived
      from the mask among ``args``, :func:`member_cost`: a boolean leaf of
      shape ``[n, S, B, ...]`` gives each member its count of steps with a
      real example). With several chunks and no mesh axis over the
      placement, the chunks are formed from it in the program
      (:func:`chunk_widths`): a member that would waste more than
      :data:`CHUNK_WASTE` of a width-``k`` chunk's work runs alone, so the
      map computes at most 1.05 times the real steps for any sizes, the
      same numbers, in memory of one chunk. Without a cost, or on a mesh
      axis, chunks are ``k`` consecutive members.
    rows: a :class:`Rows` store of per-member state, or None. With it, ``fn``
      takes member ``i``'s row (``store[ids[i]]``, in the store's structure)
      before its args and returns ``(new_row, out_i)``; each new row is
      written where it was read (not where ``write`` is False). Members run
      one at a time (``sequential``, or ``auto`` choosing it) with no mesh
      axis over the placement update the store in place, in the loop over
      members (:func:`run_rows`); otherwise the rows are gathered, mapped
      and written back. The numbers are the same.

  Returns:
    The placed pytree ``[fn(args_0), ..., fn(args_{n-1})]`` stacked on a new
    leading axis, sharded over the placement's mesh axis when there is one;
    with ``rows``, ``(new store, that pytree)``.
  """
  p, frame = frames.lookup(placement, 'map_fn')
  num_rows = 0
  if isinstance(rows, Rows) and not jax.tree.leaves(rows.store):
    # No arrays in the rows (an optimizer without state): nothing to read or write.
    empty = rows.store
    out = map_fn(lambda *a: fn(empty, *a)[1], args, placement=placement,
                 mesh=mesh, strategy=strategy, chunk_size=chunk_size, cost=cost)
    return empty, out
  if rows is not None:
    # The members' rows stand in the args as shapes until the strategy says
    # whether they are gathered or read in place.
    store_leaves, store_tree, row_ids, row_write = _check_rows(rows)
    num_rows = len(store_leaves)
    stand_in = store_tree.unflatten([
        jax.ShapeDtypeStruct(jnp.shape(row_ids) + jnp.shape(x)[1:], jnp.result_type(x))
        for x in store_leaves])
    user_fn = fn

    def written_back(out):
      new, stacked = out
      return store_tree.unflatten(_scattered_rows(
          store_leaves, row_ids, _row_leaves(new, store_tree), row_write)), stacked

    if isinstance(args, tuple):
      fn, args = (lambda row, *a: user_fn(row, *a)), (stand_in, *args)
    else:
      fn, args = (lambda row, a: user_fn(row, a)), (stand_in, args)
  leaves, treedef = jax.tree.flatten(_mark_tables(args))
  # The tables of IndexedBatches are read whole by every member.
  tables = {i: leaf.value for i, leaf in enumerate(leaves)
            if isinstance(leaf, _Table)}
  leaves = [leaf.value if i in tables else leaf for i, leaf in enumerate(leaves)]
  if len(tables) == len(leaves):
    raise ValueError('fedjx.map_fn: args has no arrays; pass placed values '
                     '(e.g. the output of fedjx.broadcast or a cohort).')
  for i, leaf in enumerate(leaves):
    if i in tables:
      continue
    if jnp.ndim(leaf) == 0:
      raise ValueError(
          f'fedjx.map_fn: got a scalar of shape () in args, which is not placed '
          f'at {p.name!r}. Broadcast server values with fedjx.broadcast first.')
    frames.resolve_size(p, jnp.shape(leaf)[0], 'map_fn')
  n = p.size
  mesh = mesh if mesh is not None else frame.mesh
  options = frame.map_options  # checked where the program was declared
  if strategy is not None or chunk_size is not None:
    # This call's own options enter here.
    options = options_lib.MapOptions(strategy or options.strategy,
                                     chunk_size or options.chunk_size,
                                     'fedjx.map_fn: ')
  strategy = frames.forced_map_strategy() or options.strategy
  chunk_size = options.chunk_size
  devices = _mesh_axis_size(p.name, mesh)
  member_leaves = [leaf for i, leaf in enumerate(leaves) if i not in tables]
  cost_leaves = member_leaves[num_rows:]  # Not the rows' stand-ins.
  shared = ({} if frames.forced_map_strategy()
            else _broadcast_sources(frame, leaves, p.name))
  broadcast = sorted(shared)
  shared.update(tables)
  placed = [leaf for i, leaf in enumerate(leaves) if i not in shared]

  def call(placed, shared):
    filled = iter(placed)
    full = treedef.unflatten([shared[i] if i in shared else next(filled)
                              for i in range(len(leaves))])
    return fn(*full) if isinstance(args, tuple) else fn(full)

  client_bytes = _client_bytes(member_leaves) + _gathered_bytes(args)
  sort = sorts_by_cost(strategy) and not frames.forced_map_strategy()
  step = (_step_cost(call, placed, shared, broadcast, client_bytes, frame.recorder)
          if sort else None)
  kind = jax.devices()[0].device_kind if sort else ''
  k = choose_chunk_size(strategy, n, client_bytes, devices, chunk_size,
                        step=step, device_kind=kind)
  user_cost = cost
  # The largest derived cost (a cohort mask's steps); none for a given cost.
  bound = cost_bound(cost_leaves) if cost is None else None
  by_cost = (1 < k < n and sharding_lib.spmd_axis_name(p.name, mesh) is None
             and not frames.forced_map_strategy())
  if by_cost:
    cost = member_cost(cost_leaves) if cost is None else jnp.asarray(cost)
    if cost is not None and jnp.shape(cost) != (n,):
      raise ValueError(f'fedjx.map_fn: cost has shape {jnp.shape(cost)}; it '
                       f'must be ({n},), one value per member.')
  else:
    cost = None

  def mapped(placed, shared, cost):
    placed = sharding_lib.place_tree(placed, p.name, mesh)
    if cost is None:
      out = run_mapped(lambda a: call(a, shared), placed, n, k, p.name, mesh)
    else:
      out = run_mapped_by_cost(lambda a: call(a, shared), placed, cost, n, k,
                               p.name, sort, bound)
    return sharding_lib.place_tree(out, p.name, mesh)

  mapped.__name__ = f'fedjx_map_{p.name}'
  recorder = frame.recorder
  spread = device_blocks(p.name, mesh, n)
  if (spread is None and sharding_lib.active_mesh(mesh) is None and
      recorder is not None and recorder.records_here() and
      not frames.forced_map_strategy()):
    spread = _cpu_blocks(p.name, n, call, placed, shared, broadcast, recorder)
  record_k, record_cost = k, cost
  if spread is not None:
    # One block of n / d members per device, each run as on one device.
    block = n // spread[1]
    record_k = choose_chunk_size(strategy, block, client_bytes, 1, chunk_size,
                                 step=step, device_kind=kind)
    record_cost = None
    if 1 < record_k < block:
      record_cost = (member_cost(cost_leaves) if user_cost is None
                     else jnp.asarray(user_cost))
  chunked = record_cost is not None
  _LOG.debug(PLAN_MESSAGE, p.name, n, strategy,
             record_k, (' sorted by cost' if sort and chunked else
                        ' formed by cost' if chunked else '') + (
                            f', one block of {n // spread[1]} per device'
                            if spread is not None else ''))
  fusable = (recorder is not None and recorder.active and
             not frames.forced_map_strategy() and
             (record_k < block if spread is not None else
              k < n and sharding_lib.spmd_axis_name(p.name, mesh) is None))
  in_place = (num_rows > 0 and k == 1 and spread is None and
              sharding_lib.spmd_axis_name(p.name, mesh) is None and
              not frames.forced_map_strategy())
  if num_rows and not in_place:  # Gathered, mapped, written back.
    placed = _gathered_rows(store_leaves, row_ids) + placed[num_rows:]
  if fusable and not recorder.records_here():
    _LOG.debug('fedjx.map_fn over %r runs unfused in chunks of %d: it is '
               'traced inside control flow or a transformation (scan, cond, '
               'while_loop, checkpoint, custom_vjp, jit, vmap) that fusion '
               'does not reach into.', p.name, k)
  elif fusable:
    # Several chunks: record the map so fedjx.fusion can carry the
    # reductions of its outputs through the loop over chunks.
    keys = sorted(shared)
    out = recorder.record(
        lambda one, values: call(one, dict(zip(keys, values))),
        placed[num_rows:] if in_place else placed, [shared[i] for i in keys], n,
        record_k, p.name, cost=record_cost, cost_bound=bound, devices=spread, sort=sort,
        rows=(store_leaves, row_ids, row_write) if in_place else None)
    return out if in_place or not num_rows else written_back(out)
  if in_place:
    def mapped_rows(store, ids, write, placed, shared):
      def one(row, a):
        new, out = call(list(row) + list(a), shared)
        return _row_leaves(new, store_tree), out
      store, out = run_rows(one, store, ids, write, placed)
      return store_tree.unflatten(store), out

    mapped_rows.__name__ = f'fedjx_map_{p.name}'
    return jax.jit(mapped_rows)(store_leaves, row_ids, row_write,
                                placed[num_rows:], shared)
  out = jax.jit(mapped)(placed, shared, cost)
  return written_back(out) if num_rows else out


def _row_leaves(row: Any, tree: Any) -> list[Any]:
  """The leaves of a member's new row, which must have the store's structure."""
  leaves, got = jax.tree.flatten(row)
  if got != tree:
    raise ValueError(f'fedjx.map_fn: the new row {got} does not have the '
                     f'structure of rows.store {tree}.')
  return leaves


def _member_jaxpr(call: Callable[..., Any], placed: list[Any],
                  shared: dict[int, Any], recorder: Any) -> Any:
  """One member's computation traced alone (a closed jaxpr)."""
  member = [jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)) for x in placed]
  active = recorder is not None and recorder.active
  if active:  # Maps inside the member are not the program's.
    recorder.active = False
  try:
    with frames.chunk_axis(None):
      return jax.make_jaxpr(lambda one: call(one, shared))(member)
  finally:
    if active:
      recorder.active = True


def _nbytes(values: Any) -> int:
  return sum(int(np.size(x)) * jnp.result_type(x).itemsize
             for x in jax.tree.leaves(values))


def _step_cost(call: Callable[..., Any], placed: list[Any], shared: dict[int, Any],
               broadcast: list[int], client_bytes: int,
               recorder: Any) -> chunk_cost.StepCost:
  """One member's :class:`fedjx.chunk_cost.StepCost`: the bytes of what is
  broadcast to it (the model it trains; its inputs' bytes where nothing
  is), and the flops of its computation traced alone, each loop body once."""
  closed = _member_jaxpr(call, placed, shared, recorder)
  model = _nbytes([shared[i] for i in broadcast])
  return chunk_cost.StepCost(model or client_bytes,
                             chunk_cost.loop_flops(closed.jaxpr))


def _cpu_blocks(placement: str, n: int, call: Callable[..., Any],
                placed: list[Any], shared: dict[int, Any], broadcast: list[int],
                recorder: Any) -> tuple[Any, int] | None:
  """:func:`fedjx.distributed.cpu_blocks` of a map with no mesh set: the
  members' shared model is what is broadcast to them and what their
  computation closes over (a frozen base model, which every device would
  need a copy of)."""
  model = _nbytes([shared[i] for i in broadcast])
  if distributed.cpu_blocks(placement, n, model) is None:
    return None
  closed = _member_jaxpr(call, placed, shared, recorder)
  given = {id(x) for x in jax.tree.leaves(list(shared.values()))}
  closed_over = [c for c in closed.consts if id(c) not in given]
  return distributed.cpu_blocks(placement, n, model + _nbytes(closed_over))


def device_blocks(placement: str, mesh: Any, n: int) -> tuple[Any, int] | None:
  """``(mesh, d)`` when a fused map over the placement runs one block of
  ``n / d`` members per device.

  That is when the placement is an Auto mesh axis of ``d > 1`` devices, every
  other axis of the mesh has size 1 (each device holds whole models) and
  ``d`` divides ``n``. The map then runs under ``jax.shard_map``
  (:mod:`fedjx.fusion`): each device runs its block as one device would (its
  own steps and cost-formed chunks, its own control flow, no lockstep with
  the others) and carries its partial sums, and one ``psum`` joins them. On
  a CPU host split into one device per core
  (:func:`fedjx.distributed.split_cpu`), that is one training loop per core.
  """
  mesh = sharding_lib.active_mesh(mesh)
  if sharding_lib.placement_axis_type(mesh, placement) != jax.sharding.AxisType.Auto:
    return None
  sizes = dict(mesh.shape)
  d = int(sizes[placement])
  if d < 2 or n % d or any(int(v) != 1 for a, v in sizes.items() if a != placement):
    return None
  return mesh, d


class _Table:
  """A leaf of an :class:`~fedjx.indexed.IndexedBatches` table, marked so
  that :func:`map_fn` hands it to every member whole."""

  def __init__(self, value: Any):
    self.value = value


def _mark_tables(args: Any) -> Any:
  """``args`` with each IndexedBatches table leaf wrapped in :class:`_Table`."""
  return jax.tree.map(
      lambda x: x._replace(table=jax.tree.map(_Table, x.table))
      if indexed.is_indexed(x) else x, args, is_leaf=indexed.is_indexed)


def _gathered_bytes(args: Any) -> int:
  """Bytes of one member's batches that its IndexedBatches gather."""
  return sum(int(np.prod(jnp.shape(x.index)[1:])) * indexed.row_bytes(x)
             for x in jax.tree.leaves(args, is_leaf=indexed.is_indexed)
             if indexed.is_indexed(x))


def _broadcast_sources(frame: Any, leaves: list[Any], placement: str) -> dict[int, Any]:
  """``{i: x}`` for the leaves that are ``broadcast(x)`` to ``placement``.

  The mapped function receives ``x`` itself for those (the same value for
  every member) rather than a slice of ``n`` materialized copies: a FedAvg
  round over 10,000 clients of a 1.2M-parameter model would otherwise hold
  48 GB of copies of the server model. At least one leaf stays placed, so
  the members are still counted by an input. Not done under
  :func:`fedjx.frames.force_map_strategy`, whose traced programs must show
  every client input placed.
  """
  sources = {}
  for i, leaf in enumerate(leaves):
    entry = frame.broadcasts.get(id(leaf))
    if entry is not None and entry[0] is leaf and entry[2] == placement:
      sources[i] = entry[1]
  if len(sources) == len(leaves):
    sources.pop(min(sources))
  return sources
