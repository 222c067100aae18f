"""A streaming executor: rounds whose cohort never has to fit on the device.

The third interpreter of a round's plan (:mod:`fedjx.plan`), beside Apache
Beam (:mod:`fedjx.beam`) and export (:mod:`fedjx.export`). It runs on the
local devices:

* server code runs once, as compiled JAX functions, when its inputs exist;
* the clients' work runs in *passes*: all the map and reduce steps that can
  run on what the server already holds. A pass loads the cohort's clients
  in chunks of ``chunk_size`` from the host (:class:`Clients`: never the
  whole cohort in host memory), transfers chunk ``c + 1`` while chunk ``c``
  computes, runs the chunk's client work (one compiled function) and folds
  the results into on-device partial reductions. Inside a chunk, clients
  run as ``map_fn``'s ``'auto'`` strategy would run them (on CPU: large
  clients one at a time, small ones vmapped), and each client's terms are
  added to the chunk's sums as soon as they exist, as in the fused compiled
  round (:mod:`fedjx.fusion`): a chunk's outputs are never stacked (64
  updates of a 1.2M-parameter CNN would be 307 MB written and read again
  per chunk);
* ``collect`` steps (per-client state, as in SCAFFOLD) are written to a host
  array chunk by chunk, each chunk's values copied to the host while the
  next chunk computes; so is each per-client output of the program (the
  new rows of a store-backed round, ``docs/client_state.md``), which comes
  back as that NumPy array, or, where the :class:`Clients` source has a
  ``keep``, is handed to it chunk by chunk instead (the runner stages a
  store's rows so: nothing the size of the cohort on the host). A
  store-backed round's rows come in through its :class:`Clients` source
  (``cohort.client_states``, loaded chunk by chunk with the data, e.g. from
  ``fedjx.ClientStore.read`` into memory reused from chunk to chunk: a chunk
  is on the device before the next one loads).

Device memory is that of the server state, one chunk's work, the next
chunk's inputs, the previous chunk's collected values (freed once on the
host) and the partial sums, whatever the cohort size. A client input of the
shape and dtype of a collected value (a DiLoCo replica's optimizer state
in, its new state out) is donated to the chunk's work, so the new values
may take its memory.

Under a mesh set with ``jax.set_mesh`` whose axis named after the placement
(``clients``) spans ``d > 1`` devices, of type Auto, every other axis of size
1 (as ``config.mesh='auto'`` makes on a CPU host split into one device per
core), each chunk's clients are split over the devices as
``map_fn`` splits a cohort (:func:`fedjx.mapping.device_blocks`): the chunk
(rounded up to a multiple of ``d`` clients) arrives laid out over them, each
device runs its ``k / d`` clients under ``jax.shard_map`` and one ``psum``
joins their partial sums. The plan itself is traced with no mesh
(:func:`fedjx.interpreters.plan.trace_plan_with_clients`).

Sums of floats are *compensated* across chunks (Neumaier's variant of Kahan
summation, Higham, "Accuracy and Stability of Numerical Algorithms", 2002,
section 4.3): within a chunk they are float32 (or wider) sums of ``k`` terms;
across ``m`` chunks the running error would otherwise grow as ``m * eps``
(1,563 chunks of 64 for 100,000 clients: up to ~1e-4 relative, which is
measurable against the compiled round's pairwise sums). With compensation
the error is that of one chunk's sum plus ``2 eps``, independent of ``m``,
for two extra additions per element per chunk.

A client value that a later pass reads again (after a reduction that
depends on it, e.g. a variance around the cohort's mean, or each update in
every iteration of Weiszfeld's geometric median) is not kept: the client
work that computes it runs again in that pass, from the client's inputs,
which are reloaded (the same values: client work is a function of its
inputs and keys). A plan streams when no server code reads every client's
value at once (:func:`fedjx.plan.gather_to_server`, e.g. a coordinate-wise
median of the updates: refused with the reason it gives); otherwise
:class:`NotStreamableError` says why.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjx import mapping
from fedjx.interpreters import plan as plan_lib
from fedjx import primitives
from fedjx import reductions


class NotStreamableError(ValueError):
  """A round's plan needs per-client values that streaming does not keep."""


@dataclasses.dataclass(frozen=True)
class Clients:
  """The clients of a round, loaded chunk by chunk from the host.

  Attributes:
    client_ids: the clients, in the order of the placed axis.
    load: ``load(ids) -> pytree`` of NumPy arrays with leading axis
      ``len(ids)``: the slices of the placed argument for those clients.
      A chunk is on the device before ``load`` is called for the next one,
      so ``load`` may return memory it reuses on its next call.
    spec: one client's pytree of ``jax.ShapeDtypeStruct`` (what the program
      sees as the ``i``-th slice of this argument).
    keep: if given, ``keep(ids, outputs)`` receives each chunk's per-client
      outputs as they reach the host, in chunk order: ``outputs`` is a
      pytree like the program's outputs, with each per-client output's rows
      of clients ``ids`` (NumPy arrays, valid only during the call) and
      None elsewhere. The program then returns None in place of its
      per-client outputs: nothing the size of the cohort is gathered on the
      host (a store-backed round's new rows go straight to the store).
  """

  client_ids: Sequence[Any]
  load: Callable[[Sequence[Any]], Any]
  spec: Any
  keep: Callable[[Sequence[Any], Any], None] | None = None

  def placed_spec(self) -> Any:
    n = len(self.client_ids)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((n,) + tuple(s.shape), s.dtype),
                        self.spec)

  @classmethod
  def from_arrays(cls, placed: Any) -> 'Clients':
    """In-memory placed arrays (leading axis = clients)."""
    placed = jax.tree.map(plan_lib.to_host, placed)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), placed)
    n = jax.tree.leaves(placed)[0].shape[0]
    return cls(range(n), lambda ids: jax.tree.map(lambda a: a[np.asarray(ids)], placed),
               spec)

  def with_keep(self, keep: Callable[[Sequence[Any], Any], None]) -> 'Clients':
    """These clients, their per-client outputs given to ``keep`` chunk by chunk."""
    return dataclasses.replace(self, keep=keep)


@dataclasses.dataclass
class _Pass:
  maps: list[plan_lib.MapStep]
  reduces: list[plan_lib.ReduceStep]


def run(fn: Callable[..., Any], *args: Any, chunk_size: int = 64) -> Any:
  """Runs the fedjx program ``fn(*args)`` with its clients streamed in chunks.

  Args:
    fn: a function that calls (or is) a ``fedjx.program``, e.g. an
      algorithm's ``apply``; it may be jitted.
    *args: its arguments; a :class:`Clients` stands for placed values the
      clients hold, loaded ``chunk_size`` clients at a time.
    chunk_size: clients per chunk (a last, shorter chunk is padded with
      copies of its last client, which carry zero weight).

  Returns:
    ``fn``'s outputs (device arrays), the same pytree as ``fn(*args)``.
    Per-client outputs come back as host NumPy arrays, gathered chunk by
    chunk, or as None where a :class:`Clients` argument's ``keep`` took
    them chunk by chunk.

  Raises:
    NotStreamableError: server code of the round reads every client's
      value at once.

  Each call traces and compiles afresh; :class:`Streamer` keeps both between
  rounds.
  """
  return Streamer(fn, chunk_size)(*args)


class Streamer:
  """``Streamer(fn, chunk_size)(*args)`` is :func:`run`, keeping the plan and
  the compiled server and chunk work between calls with the same shapes."""

  def __init__(self, fn: Callable[..., Any], chunk_size: int = 64):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
      raise ValueError(f'fedjx.streaming.run: chunk_size={chunk_size!r}; it must '
                       'be a positive int.')
    self.fn = fn
    self.chunk_size = chunk_size
    self._cache: dict[str, dict[Any, Any]] = {}

  def __call__(self, *args: Any) -> Any:
    return _run(self.fn, args, self.chunk_size, self._cache)


def _shapes_key(args) -> str:
  specs = [a.placed_spec() if isinstance(a, Clients) else a for a in args]
  return str((jax.tree.structure(specs),
              [(np.shape(x), str(getattr(x, 'dtype', type(x)))) for x in jax.tree.leaves(specs)]))


def _run(fn, args, chunk_size, cache) -> Any:
  client_positions = [k for k, a in enumerate(args) if isinstance(a, Clients)]
  if not client_positions:
    raise ValueError('fedjx.streaming.run: no argument is a fedjx.streaming.Clients; '
                     'pass the cohort as Clients.from_arrays(...) or '
                     'fedjx.datasets.streaming_clients(...).')
  trace_args = [a.placed_spec() if isinstance(a, Clients) else a for a in args]
  entry = cache.setdefault(_shapes_key(args), {})
  if 'plan' not in entry:
    entry['plan'] = plan_lib.trace_plan_with_clients(fn, trace_args, client_positions)
  plan = entry['plan']
  n = plan.num_clients
  env: dict[int, Any] = {i: jnp.asarray(v) for i, v in plan.consts.items()}
  sources: list[tuple[Clients, tuple[int, ...]]] = []
  for arg, ids in zip(args, plan.arg_ids):
    if isinstance(arg, Clients):
      if len(arg.client_ids) != n:
        raise ValueError(f'fedjx.streaming.run: Clients has {len(arg.client_ids)} '
                         f'clients but the program places {n}.')
      sources.append((arg, ids))
    else:
      env.update(zip(ids, jax.tree.leaves(arg)))
  client_inputs = {i for _, ids in sources for i in ids}
  keeps = [a for a, _ in sources if a.keep is not None]
  if len(keeps) > 1:
    raise ValueError('fedjx.streaming.run: more than one Clients argument has a '
                     'keep; give it to one of them.')
  keep = None if not keeps else _Keep(keeps[0].keep, plan, keeps[0].client_ids)
  for step in plan.steps:  # Values that gather_to_server stacks on the server.
    if isinstance(step, plan_lib.ReduceStep) and step.why:
      raise NotStreamableError(
          f'fedjx.streaming.run: {step.why}, and a streamed round holds one '
          "chunk of clients at a time, never all of them: run it with "
          "execution='jit'.")
  if 'client_outputs' not in entry:
    entry['client_outputs'] = _client_outputs(plan, client_inputs)
  client_outputs = entry['client_outputs']  # out id -> its 'collect' step
  bcast: dict[int, int] = {}
  remaining = list(plan.steps) + list(client_outputs.values())
  done_maps: list[plan_lib.MapStep] = []  # Client work of earlier passes.
  while remaining:
    progressed = True
    while progressed:
      progressed = False
      for step in list(remaining):
        if isinstance(step, plan_lib.ServerStep) and all(i in env for i in step.in_ids):
          if id(step) not in entry:
            entry[id(step)] = jax.jit(step.function())
          outs = entry[id(step)](*[env[i] for i in step.in_ids])
          env.update(zip(step.out_ids, outs))
        elif isinstance(step, plan_lib.BroadcastStep) and step.in_id in env:
          bcast[step.out_id] = step.in_id
        else:
          continue
        remaining.remove(step)
        progressed = True
    if not remaining:
      break
    one_pass = _next_pass(plan, remaining, env, bcast, client_inputs, done_maps)
    for step in one_pass.maps + one_pass.reduces:
      if step in remaining:  # Not a map of an earlier pass, computed again.
        remaining.remove(step)
        if isinstance(step, plan_lib.MapStep):
          done_maps.append(step)
    env.update(_run_pass(plan, one_pass, env, bcast, sources, n, chunk_size, entry, keep))
  outs = [None if keep is not None and i in client_outputs else
          env[client_outputs[i].out_id] if i in client_outputs else
          jnp.broadcast_to(env[bcast[i]], (n,) + jnp.shape(env[bcast[i]]))
          if i in bcast else env[i] for i in plan.out_ids]
  return jax.tree.unflatten(plan.out_tree, outs)


def _aliasable(plan, input_ids, collect) -> set[int]:
  """Client inputs each of the same shape and dtype as a distinct collected value."""
  wanted = [(plan.avals[r.x_id].shape, plan.avals[r.x_id].dtype) for r in collect
            if not plan_lib.is_key(plan.avals[r.x_id].dtype)]
  chosen = set()
  for i in input_ids:
    like = (plan.avals[i].shape, plan.avals[i].dtype)
    if like in wanted:
      wanted.remove(like)
      chosen.add(i)
  return chosen


class _Keep:
  """A :attr:`Clients.keep` called with the program's output pytree."""

  def __init__(self, keep, plan, client_ids):
    self.keep, self.plan, self.client_ids = keep, plan, client_ids

  def __call__(self, start: int, stop: int, pieces: dict[int, np.ndarray]) -> None:
    outs = [pieces.get(i) for i in self.plan.out_ids]
    self.keep(self.client_ids[start:stop], jax.tree.unflatten(self.plan.out_tree, outs))


def _client_outputs(plan, client_inputs) -> dict[int, plan_lib.ReduceStep]:
  """A ``'collect'`` step for each per-client output of the program.

  A per-client output (e.g. the new rows of per-client state a store-backed
  round returns) is computed by client work: it is gathered chunk by chunk
  into a host array, which is what the program returns for it (NumPy, never
  on the device as a whole). Its step's ``out_id`` is negative, outside the
  plan's ids.
  """
  computed = set(client_inputs) | {
      i for step in plan.steps if isinstance(step, plan_lib.MapStep)
      for i in step.out_ids}
  steps = {}
  for i in plan.out_ids:
    if plan.kinds.get(i) != plan_lib.CLIENT or i in steps:
      continue
    if i not in computed:
      raise NotStreamableError(
          'fedjx.streaming.run: the program returns a per-client value '
          f'({plan.avals[i].str_short()}) that no client work computes; '
          'run the round with execution="jit".')
    steps[i] = plan_lib.ReduceStep('collect', i, None, _VALID - 1 - len(steps))
  return steps


def _next_pass(plan, remaining, env, bcast, client_inputs, done_maps) -> _Pass:
  """The client steps that can run on what the server holds now, in order.

  A client value that an earlier pass computed is not kept (streaming keeps
  no per-client values): the map steps of that pass that produce it run
  again in this one. Client work is a function of its inputs (its keys
  included), so it gives the same values, at the price of its compute once
  more per pass that reads it (Weiszfeld's iterations read each update
  after every weighted mean: the clients' training runs once per
  iteration).
  """
  producers = {i: step for step in done_maps for i in step.out_ids}
  produced = set(client_inputs)
  again: list[plan_lib.MapStep] = []

  def ready(i):
    if i in produced or i in env or (i in bcast and bcast[i] in env):
      return True
    step = producers.get(i)
    if step is None or not all(j in env for j in step.const_ids) or not all(
        ready(j) for j in step.x_ids):
      return False
    again.append(step)
    produced.update(step.out_ids)
    return True

  maps, reduces = [], []
  for step in remaining:
    if isinstance(step, plan_lib.MapStep):
      if all(i in env for i in step.const_ids) and all(ready(i) for i in step.x_ids):
        maps.append(step)
        produced.update(step.out_ids)
    elif isinstance(step, plan_lib.ReduceStep):
      if ready(step.x_id) and (step.weight_id is None or ready(step.weight_id)):
        reduces.append(step)
  if not maps and not reduces:
    step = remaining[0]
    raise NotStreamableError(
        f'fedjx.streaming.run: no step can run; the next is {type(step).__name__} '
        f'needing values that are never computed ({step}).')
  order = {id(step): k for k, step in enumerate(plan.steps)}
  chosen = {id(step): step for step in again + maps}
  return _Pass(sorted(chosen.values(), key=lambda step: order[id(step)]), reduces)


def _devices(placement: str | None, k: int) -> tuple[Any, int]:
  """``(mesh, d)``: the set mesh and the ``d`` devices a chunk of about ``k``
  clients is split over (``(None, 1)``: the default device runs it)."""
  mesh = jax.sharding.get_mesh()
  if placement is None or mesh.empty or placement not in mesh.axis_names:
    return None, 1
  d = int(mesh.shape[placement])
  spread = mapping.device_blocks(placement, mesh, d * math.ceil(k / d))
  return (None, 1) if spread is None else spread


def _run_pass(plan, one_pass, env, bcast, sources, n, chunk_size, entry,
              keep) -> dict[int, Any]:
  """Runs one pass over the clients in chunks; returns the reductions (and
  the collected values, unless ``keep`` takes each chunk's per-client outputs)."""
  mesh, devices = _devices(plan.placement, min(chunk_size, n))
  k = devices * math.ceil(min(chunk_size, n) / devices)
  block = k // devices  # The clients of a chunk each device runs.
  m = math.ceil(n / k)
  maps, reduces = one_pass.maps, one_pass.reduces
  # Server values read per client (leading axis n): sliced per chunk on device.
  per_client_server = sorted({
      i for s in maps for i in s.x_ids if i in env and i not in bcast} | {
      i for r in reduces for i in (r.x_id, r.weight_id)
      if i is not None and i in env and i not in bcast})
  whole = sorted({i for s in maps for i in s.const_ids} |
                 {bcast[i] for s in maps for i in s.x_ids if i in bcast} |
                 {bcast[i] for r in reduces for i in (r.x_id, r.weight_id)
                  if i is not None and i in bcast})
  padded_server = {i: _pad(env[i], k * m) for i in per_client_server}
  collect = [r for r in reduces if r.op == 'collect']
  sums = [r for r in reduces if r.op != 'collect']
  dtypes = [_result_dtype(plan, r) for r in sums]
  on_cpu = jax.default_backend() == 'cpu'

  # Maps whose inputs are all the same for every client run once per chunk;
  # the others run per client, all of the pass's maps for one client in a
  # row, so that their outputs never stack for the whole chunk.
  shared_maps = [s for s in maps if all(i in bcast for i in s.x_ids)]
  client_maps = [s for s in maps if s not in shared_maps]
  inner = _inner_chunk(env, bcast, client_maps, plan, block)
  used_bcast = sorted({i for s in maps for i in s.x_ids if i in bcast} |
                      {i for r in reduces for i in (r.x_id, r.weight_id) if i in bcast})

  def chunk_work(whole_vals, server_chunk, client_chunk, valid):
    local = dict(zip(whole, whole_vals))
    shared = {i: local[bcast[i]] for i in used_bcast}
    for s in shared_maps:
      outs = s.function()(*[local[i] for i in s.const_ids],
                          *[shared[i] for i in s.x_ids])
      shared.update(zip(s.out_ids, outs))
    per_client = dict(server_chunk)
    per_client.update(client_chunk)
    per_client[_VALID] = valid

    def member(values):
      """One client: its maps, then its terms of each sum (and collected values)."""
      one = dict(values)
      for s in client_maps:
        outs = s.function()(*[local[i] for i in s.const_ids],
                            *[one[i] if i in one else shared[i] for i in s.x_ids])
        one.update(zip(s.out_ids, outs))

      def value(i):
        return one[i] if i in one else shared[i]

      terms = []
      for r, dtype in zip(sums, dtypes):
        acc = reductions.carry_dtype(dtype)
        x = value(r.x_id).astype(dtype).astype(acc)
        if r.op == 'weighted_mean':
          w = jnp.where(one[_VALID], value(r.weight_id).astype(dtype).astype(acc), 0)
          terms.append((x, w))
        else:
          terms.append((jnp.where(one[_VALID], x, jnp.zeros_like(x)),))
      return terms, [value(r.x_id) for r in collect]

    def add_inner(totals, values):
      """Adds the terms of ``inner`` clients (vmapped) to the chunk's sums."""
      if inner == 1:  # One client at a time, as map_fn's loop runs them.
        terms, collected = member(jax.tree.map(lambda x: x[0], values))
        new = [(t[0] + term[0] * term[1], t[1] + term[1]) if len(term) == 2
               else (t[0] + term[0],) for t, term in zip(totals, terms)]
        return new, [c[None] for c in collected]
      terms, collected = jax.vmap(member)(values)
      new = []
      for total, term in zip(totals, terms):
        if len(term) == 2:
          x, w = term
          dot = primitives.sum_leading_axis(x, w, on_cpu=on_cpu)
          new.append((total[0] + dot, total[1] + jnp.sum(w)))
        else:
          new.append((total[0] + jnp.sum(term[0], axis=0),))
      return new, collected

    zeros = [tuple(jnp.zeros_like(z[0]) for z in _zero_carry(plan, r, d))
             for r, d in zip(sums, dtypes)]
    grid = jax.tree.map(lambda x: x.reshape((block // inner, inner) + x.shape[1:]),
                        per_client)
    partial, collected = jax.lax.scan(add_inner, zeros, grid)
    collected = [c.reshape((block,) + c.shape[2:]) for c in collected]
    return partial, collected

  def on_devices(whole_vals, server_chunk, client_chunk, valid):
    """Each device's block of the chunk; one psum joins their sums."""
    def one_block(*args):
      partial, collected = chunk_work(*args)
      return jax.lax.psum(partial, plan.placement), collected
    clients = P(plan.placement)
    return jax.shard_map(one_block, mesh=mesh, in_specs=(P(), clients, clients, clients),
                         out_specs=(P(), clients), check_vma=False)(
                             whole_vals, server_chunk, client_chunk, valid)

  # A client input as large as a collected value (a replica's optimizer
  # state in, its new state out) is donated: the new values may take its
  # device memory instead of holding both.
  donated = _aliasable(plan, [i for _, ids in sources for i in ids], collect)

  def step(carry, whole_vals, server_chunk, client_chunk, donated_chunk, valid):
    work = chunk_work if mesh is None else on_devices
    partial, collected = work(whole_vals, server_chunk, {**client_chunk, **donated_chunk},
                              valid)
    return [_add(c, p) for c, p in zip(carry, partial)], collected

  # The chunk's work depends on the plan, the pass and the devices only:
  # compiled once.
  key = ('pass', mesh) + tuple(id(x) for x in maps + reduces)
  if key not in entry:
    entry[key] = jax.jit(step, donate_argnums=(0, 4))
  step = entry[key]
  carry = [_zero_carry(plan, r, d) for r, d in zip(sums, dtypes)]
  # Per-client outputs go to ``keep`` chunk by chunk; the rest (and all of
  # them without ``keep``) into host arrays of the cohort.
  kept = [keep is not None and r.out_id < _VALID for r in collect]
  collected_host = [None if k_ else
                    np.empty((n,) + plan_lib.host_spec(plan.avals[r.x_id]).shape[1:],
                             plan_lib.host_spec(plan.avals[r.x_id]).dtype)
                    for r, k_ in zip(collect, kept)]
  whole_vals = [env[i] for i in whole]

  # The chunk arrives laid out over the devices that run it.
  layout = None if mesh is None else NamedSharding(mesh, P(plan.placement))

  def load(c):
    """Host load and device transfer of chunk c (runs ahead on a thread)."""
    start, stop = c * k, min(n, (c + 1) * k)
    chunk = {}
    for source, ids in sources:
      values = jax.tree.leaves(source.load(source.client_ids[start:stop]))
      chunk.update(zip(ids, (jax.device_put(_host_chunk(v, k, on_cpu), layout)
                             for v in values)))
    valid = jax.device_put(np.arange(start, start + k) < stop, layout)
    # On the device before the next load: a source may reuse its memory.
    jax.block_until_ready(chunk)
    return chunk, valid

  def to_host(c, collected):
    stop = min(n, (c + 1) * k)
    pieces = {}
    for r, host, value in zip(collect, collected_host, collected):
      rows = plan_lib.to_host(value)[:stop - c * k]
      if host is None:
        pieces[r.x_id] = rows
      else:
        host[c * k:stop] = rows
    if pieces:
      keep(c * k, stop, pieces)

  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    ahead = pool.submit(load, 0)
    departing = None  # The previous chunk's collected values, on their way to the host.
    for c in range(m):
      client_chunk, valid = ahead.result()
      if c + 1 < m:
        ahead = pool.submit(load, c + 1)
      server_chunk = {i: jax.lax.dynamic_slice_in_dim(v, c * k, k)
                      for i, v in padded_server.items()}
      carry, collected = step(
          carry, whole_vals, server_chunk,
          {i: v for i, v in client_chunk.items() if i not in donated},
          {i: v for i, v in client_chunk.items() if i in donated}, valid)
      del client_chunk
      for value in collected:
        if isinstance(value, jax.Array) and not plan_lib.is_key(value.dtype):
          value.copy_to_host_async()
      # The previous chunk's values reach the host while this one computes
      # (a DiLoCo replica's new optimizer state: gigabytes).
      if departing is not None:
        to_host(*departing)
        departing = None  # Its device memory is free while this chunk computes.
      # One chunk computes while the next loads: waiting here keeps dispatch
      # from queueing every chunk's data at once (memory would grow with m).
      jax.block_until_ready(carry)
      departing = (c, collected)
    if departing is not None:
      to_host(*departing)
  out = {}
  for r, dtype, c in zip(sums, dtypes, carry):
    total = c[0][0] + c[0][1]  # The sum and its compensation.
    wsum = c[1][0] + c[1][1] if r.op == 'weighted_mean' else None
    out[r.out_id] = reductions.finish(r.op, total, wsum, n, dtype)
  for r, host in zip(collect, collected_host):
    if host is not None:
      out[r.out_id] = (host if r.out_id < _VALID else  # A per-client output.
                       plan_lib.from_host(jnp.asarray(host), plan.avals[r.out_id]))
  return out


_VALID = -1  # The key of the padding mask among a chunk's per-client values.


def _inner_chunk(env, bcast, client_maps, plan, k) -> int:
  """Clients run at once inside a chunk of ``k``: a divisor of ``k``.

  As ``map_fn``'s ``'auto'`` strategy would run them
  (:func:`fedjx.mapping.choose_chunk_size`; on CPU: large clients one at a
  time, small ones vmapped), from one client's inputs: the values every
  client reads (the server model) and one client's slice of the others.
  """
  if not client_maps:
    return k
  one = 0
  seen = set()
  for s in client_maps:
    for i in list(s.const_ids) + list(s.x_ids):
      if i in seen:
        continue
      seen.add(i)
      if i in bcast:
        one += _nbytes(env[bcast[i]])
      elif i in env and i in s.const_ids:
        one += _nbytes(env[i])
      elif i in plan.avals:
        aval = plan.avals[i]
        one += int(np.prod(aval.shape[1:])) * aval.dtype.itemsize
  inner = mapping.choose_chunk_size('auto', k, one, 1)
  while k % inner:  # A divisor of k, so the chunk reshapes into [k / inner, inner].
    inner -= 1
  return inner


def _result_dtype(plan, r):
  x_dtype = plan.avals[r.x_id].dtype
  w_dtype = None if r.weight_id is None else plan.avals[r.weight_id].dtype
  return reductions.result_dtype(r.op, x_dtype, w_dtype)


def _zero_carry(plan, r, dtype):
  acc = reductions.carry_dtype(dtype)
  shape = plan.avals[r.out_id].shape
  zero = (jnp.zeros(shape, acc), jnp.zeros(shape, acc))
  if r.op == 'weighted_mean':
    return (zero, (jnp.zeros((), acc), jnp.zeros((), acc)))
  return (zero,)


def _add(carry, partial):
  return tuple(reductions.compensated_add(c, p) for c, p in zip(carry, partial))


def _pad(x, total):
  extra = total - x.shape[0]
  if extra == 0:
    return x
  return jnp.concatenate([x, jnp.broadcast_to(x[-1:], (extra,) + x.shape[1:])])


def _host_chunk(x, total, on_cpu):
  """``x`` padded to ``total`` clients, never the source's own memory on a
  CPU, whose devices alias an aligned NumPy array (even under
  ``may_alias=False``, jax 0.10) where a source may reuse it for the next
  chunk; an accelerator's transfer is a copy."""
  x = np.asarray(x)
  padded = _pad_host(x, total)
  return padded.copy() if on_cpu and padded is x else padded


def _pad_host(x, total):
  extra = total - x.shape[0]
  if extra == 0:
    return x
  return np.concatenate([x, np.broadcast_to(x[-1:], (extra,) + x.shape[1:])])


def _nbytes(x) -> int:
  itemsize = getattr(getattr(x, 'dtype', None), 'itemsize', None) or 4
  return int(np.prod(jnp.shape(x))) * itemsize
