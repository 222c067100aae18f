"""Splitting a round into server and client computations with ``jax.export``.

Cross-device systems run client work on phones and server work in a data
centre; they need the two as separate, portable programs. :func:`split_round`
traces a round written with the fedjx primitives (:mod:`fedjx.plan`) and
exports three StableHLO computations:

1. ``server_prepare(*server_inputs) -> (to_clients, residuals)``: server code
   before client work; ``to_clients`` are the values sent to every client
   (broadcasts and values the client function closes over), ``residuals``
   the server values kept for step 3.
2. ``client_work(*to_clients, *client_inputs) -> client_outputs``: one
   client's computation, run once per client.
3. ``server_update(*residuals, *stacked_client_values) -> outputs``: the
   aggregations (sum, mean, weighted mean over the stacked per-client values,
   the part a secure-aggregation service would take over) and the server code
   after them.

Each is a ``jax.export.Exported``; ``.serialize()`` gives bytes that
``jax.export.deserialize`` turns back into a callable anywhere JAX (or an
XLA/StableHLO runtime) runs. :meth:`SplitRound.run` composes them by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fedjx import plan as plan_lib
from fedjx import primitives


@dataclasses.dataclass
class SplitRound:
  """A round as three exported computations (see the module docstring).

  Attributes:
    server_prepare, client_work, server_update: ``jax.export.Exported``.
    client_input_kinds: for each input of ``client_work`` after the
      ``to_clients`` values: ``'client'`` (a slice of a client argument) or
      ``'server'`` (a slice of a placed value computed by the server, taken
      from ``to_clients_placed``).
    num_clients: the cohort size the round was traced for.
  """

  server_prepare: Any
  client_work: Any
  server_update: Any
  num_clients: int
  _client_sources: list[tuple[str, int]]
  _stacked_sources: list[tuple[str, int]]
  _out_tree: Any
  _num_to_clients: int
  _num_placed_from_server: int

  def run(self, server_inputs: Sequence[Any], client_inputs: Sequence[Any]) -> Any:
    """Composes the three computations by hand, client by client.

    Args:
      server_inputs: the flat server arguments, in order.
      client_inputs: the flat placed client arguments, in order.

    Returns:
      The round's outputs.
    """
    prepared = self.server_prepare.call(*server_inputs)
    to_clients = prepared[:self._num_to_clients]
    placed = prepared[self._num_to_clients:
                      self._num_to_clients + self._num_placed_from_server]
    residuals = prepared[self._num_to_clients + self._num_placed_from_server:]
    per_client = []
    for c in range(self.num_clients):
      xs = [client_inputs[i][c] if kind == 'client' else placed[i][c]
            for kind, i in self._client_sources]
      per_client.append(self.client_work.call(*to_clients, *xs))
    stacked = []
    for kind, i in self._stacked_sources:
      if kind == 'output':
        stacked.append(jnp.stack([outs[i] for outs in per_client]))
      else:
        stacked.append(client_inputs[i])
    outs = self.server_update.call(*residuals, *stacked)
    return jax.tree.unflatten(self._out_tree, list(outs))


def _lifted_operands(step, consts, xs):
  """The operands of a lifted equation, in its own order."""
  _, placed = step.lifted
  consts, xs = iter(consts), iter(xs)
  return [next(xs) if p else next(consts) for p in placed]


def split_round(fn: Callable[..., Any], *args: Any,
                client_args: Sequence[int] = ()) -> SplitRound:
  """Exports ``fn`` (a round with one ``map_fn``) as three computations.

  Args:
    fn: a function that calls a ``fedjx.program`` with exactly one
      ``map_fn`` whose outputs are only reduced after it.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    client_args: positions of the arguments the clients hold (e.g. the
      cohort); the others are server inputs.
  """
  plan = plan_lib.trace_plan_with_clients(fn, args, client_args)
  maps = [k for k, s in enumerate(plan.steps)
          if isinstance(s, plan_lib.MapStep) and s.lifted is None]
  if len(maps) != 1:
    raise ValueError(f'fedjx.export.split_round: the program has {len(maps)} '
                     'map_fn calls; a round to split must have exactly one.')
  m = maps[0]
  # Elementwise ops on client values outside map_fn apply to stacked values
  # too: the server runs them while aggregating.
  lifted = [s for s in plan.steps[:m]
            if isinstance(s, plan_lib.MapStep) and s.lifted is not None]
  before = [s for s in plan.steps[:m] if not any(s is l for l in lifted)]
  map_step = plan.steps[m]
  after = lifted + plan.steps[m + 1:]
  lifted_outs = {o for s in lifted for o in s.out_ids}
  if lifted_outs & set(map_step.x_ids):
    raise ValueError('fedjx.export.split_round: client values computed outside '
                     'map_fn feed client work; compute them inside map_fn.')
  for step in before:
    if isinstance(step, plan_lib.ReduceStep):
      raise ValueError('fedjx.export.split_round: a reduction before client work '
                       'is not supported; reduce after map_fn.')
  for step in after:
    if (isinstance(step, plan_lib.BroadcastStep) or
        isinstance(step, plan_lib.MapStep) and step.lifted is None):
      raise ValueError('fedjx.export.split_round: broadcasts after client work '
                       'are not supported.')

  flat_leaves_per_arg = [len(jax.tree.leaves(a)) for a in args]
  client_leaf_ids, server_leaf_ids = [], []
  position = 0
  for k, count in enumerate(flat_leaves_per_arg):
    ids = plan.in_ids[position:position + count]
    (client_leaf_ids if k in client_args else server_leaf_ids).extend(ids)
    position += count

  broadcast_source = {s.out_id: s.in_id for s in before
                      if isinstance(s, plan_lib.BroadcastStep)}
  # Inputs of client work.
  to_clients = list(map_step.const_ids)
  client_sources, placed_from_server = [], []
  for i in map_step.x_ids:
    if i in broadcast_source:
      to_clients.append(broadcast_source[i])
      client_sources.append(None)  # Filled below: broadcasts go with consts.
    elif plan.kinds[i] == plan_lib.CLIENT:
      client_sources.append(('client', client_leaf_ids.index(i)))
    else:
      placed_from_server.append(i)
      client_sources.append(('server', len(placed_from_server) - 1))
  # client_work takes (consts, broadcasts) then per-client slices, in x order.
  x_broadcast = [i for i in map_step.x_ids if i in broadcast_source]
  x_sliced = [(i, src) for i, src in zip(map_step.x_ids, client_sources) if src is not None]

  # What server_update needs.
  map_out = {o: k for k, o in enumerate(map_step.out_ids)}
  defined_after = set()
  needed_server, stacked_sources, stacked_ids = [], [], []
  for step in after:
    if isinstance(step, plan_lib.ReduceStep):
      reads = [step.x_id] + ([step.weight_id] if step.weight_id is not None else [])
      defined = [step.out_id]
    elif isinstance(step, plan_lib.MapStep):
      reads, defined = list(step.const_ids) + list(step.x_ids), step.out_ids
    else:
      reads, defined = step.in_ids, step.out_ids
    for i in reads:
      if i in defined_after or i in stacked_ids or i in needed_server:
        continue
      if i in map_out:
        stacked_ids.append(i)
        stacked_sources.append(('output', map_out[i]))
      elif plan.kinds.get(i) == plan_lib.CLIENT:
        stacked_ids.append(i)
        stacked_sources.append(('input', client_leaf_ids.index(i)))
      else:
        needed_server.append(i)
    defined_after.update(defined)
  for i in plan.out_ids:
    if i not in defined_after and i not in needed_server and i not in stacked_ids:
      if i in map_out:
        stacked_ids.append(i)
        stacked_sources.append(('output', map_out[i]))
      else:
        needed_server.append(i)

  def resolve(env, i):
    if i in env:
      return env[i]
    if i in broadcast_source:
      src = env[broadcast_source[i]] if broadcast_source[i] in env else plan.consts[broadcast_source[i]]
      return jnp.broadcast_to(src, (plan.num_clients,) + jnp.shape(src))
    return plan.consts[i]

  def prepare(*server_inputs):
    env = dict(zip(server_leaf_ids, server_inputs))
    for step in before:
      if isinstance(step, plan_lib.ServerStep):
        env.update(zip(step.out_ids, step.function()(*[resolve(env, i) for i in step.in_ids])))
    return (tuple(resolve(env, i) for i in map_step.const_ids) +
            tuple(resolve(env, broadcast_source[i]) for i in x_broadcast) +
            tuple(resolve(env, i) for i in placed_from_server) +
            tuple(resolve(env, i) for i in needed_server))

  body = map_step.function()
  n_consts = len(map_step.const_ids)
  x_order = {i: k for k, i in enumerate(map_step.x_ids)}

  def client_work(*inputs):
    consts = inputs[:n_consts]
    broadcasts = inputs[n_consts:n_consts + len(x_broadcast)]
    sliced = inputs[n_consts + len(x_broadcast):]
    xs = [None] * len(map_step.x_ids)
    for i, v in zip(x_broadcast, broadcasts):
      xs[x_order[i]] = v
    for (i, _), v in zip(x_sliced, sliced):
      xs[x_order[i]] = v
    return tuple(body(*consts, *xs))

  reduce_fns = {'sum': primitives.reduce_sum_p, 'mean': primitives.reduce_mean_p,
                'weighted_mean': primitives.reduce_weighted_mean_p}

  def update(*inputs):
    env = dict(zip(needed_server, inputs[:len(needed_server)]))
    env.update(zip(stacked_ids, inputs[len(needed_server):]))
    for step in after:
      if isinstance(step, plan_lib.ReduceStep):
        operands = [resolve(env, step.x_id)]
        if step.weight_id is not None:
          operands.append(resolve(env, step.weight_id))
        prim = reduce_fns[step.op]
        env[step.out_id] = prim.impl(*operands, placement='clients')
      elif isinstance(step, plan_lib.MapStep):
        ordered = _lifted_operands(step, [resolve(env, i) for i in step.const_ids],
                                   [resolve(env, i) for i in step.x_ids])
        eqn = step.lifted[0]
        outs = eqn.primitive.bind(*ordered, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(step.out_ids, outs if eqn.primitive.multiple_results else [outs]))
      else:
        env.update(zip(step.out_ids, step.function()(*[resolve(env, i) for i in step.in_ids])))
    return tuple(resolve(env, i) for i in plan.out_ids)

  def spec(i, drop_leading=False):
    aval = plan.avals[i]
    shape = aval.shape[1:] if drop_leading else aval.shape
    return jax.ShapeDtypeStruct(shape, aval.dtype)

  server_specs = [spec(i) for i in server_leaf_ids]
  to_client_specs = ([spec(i) for i in map_step.const_ids] +
                     [spec(broadcast_source[i]) for i in x_broadcast])
  sliced_specs = [spec(i, drop_leading=True) for i, _ in x_sliced]
  update_specs = [spec(i) for i in needed_server] + [spec(i) for i in stacked_ids]
  exported_prepare = jax.export.export(jax.jit(prepare))(*server_specs)
  exported_client = jax.export.export(jax.jit(client_work))(*to_client_specs, *sliced_specs)
  exported_update = jax.export.export(jax.jit(update))(*update_specs)
  return SplitRound(
      server_prepare=exported_prepare,
      client_work=exported_client,
      server_update=exported_update,
      num_clients=plan.num_clients,
      _client_sources=[src for _, src in x_sliced],
      _stacked_sources=stacked_sources,
      _out_tree=plan.out_tree,
      _num_to_clients=len(to_client_specs),
      _num_placed_from_server=len(placed_from_server))
