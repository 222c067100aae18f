"""Splitting a round into the four pieces a cross-device system runs.

Cross-device systems run client work on phones, aggregation in a (possibly
secure) aggregation service, and server work in a data centre; they need
these as separate, portable programs. :func:`split_round` traces a round
written with the fedjx primitives (:mod:`fedjx.plan`) and returns one
broadcast-map-aggregate-update stage, with aggregation a stage of its own as
in TensorFlow Federated's MapReduceForm (``tff.backends.mapreduce``):

1. ``server_prepare(*server_inputs) -> (*to_clients, *placed, *residuals)``
   (a ``jax.export.Exported``): the server code before client work.
   ``to_clients`` go whole to every client; ``placed`` are server arrays
   with a leading client axis, of which client ``i`` receives slice ``i``;
   ``residuals`` stay on the server for step 4.
2. ``client_work(*to_clients, *placed_i, *client_inputs_i) -> client_outputs``
   (a ``jax.export.Exported``): one client's computation. ``placed_i`` and
   ``client_inputs_i`` are the client's slices of ``placed`` and of every
   flat client input (e.g. the leaves of its cohort), in order.
3. ``aggregations``: a tuple of :class:`Aggregation` (plain data): aggregate
   ``k`` is the ``op`` (``'sum'``, ``'mean'`` or ``'weighted_mean'``) over
   clients of ``client_outputs[value]``, weighted by ``client_outputs[weight]``
   for a weighted mean (``sum_i w_i x_i / sum_i w_i``, zero when the weights
   sum to zero). This is the part to hand to a secure-aggregation service.
4. ``server_update(*residuals, *aggregates) -> outputs`` (a
   ``jax.export.Exported``): the server code after aggregation; its flat
   outputs unflatten with ``SplitRound.out_tree`` to the round's outputs.

Each ``Exported`` ``.serialize()`` s to bytes that ``jax.export.deserialize``
turns back into a callable wherever JAX (or an XLA/StableHLO runtime) runs.
:meth:`SplitRound.run` composes the four by hand, aggregating in NumPy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjx import plan as plan_lib

AGGREGATION_OPS = ('sum', 'mean', 'weighted_mean')


@dataclasses.dataclass(frozen=True)
class Aggregation:
  """One aggregate over clients of an output of ``client_work``.

  Attributes:
    op: ``'sum'`` (``sum_i x_i``), ``'mean'`` (``(1/n) sum_i x_i``) or
      ``'weighted_mean'`` (``sum_i w_i x_i / sum_i w_i``, 0 if the weights
      sum to 0).
    value: the index of ``x`` among ``client_work``'s outputs.
    weight: the index of ``w`` among ``client_work``'s outputs
      (``'weighted_mean'`` only; ``w_i`` has shape ``[]``), else None.
    dtype: the aggregate's dtype, as ``server_update`` takes it.
  """

  op: str
  value: int
  weight: int | None
  dtype: str

  def to_dict(self) -> dict[str, Any]:
    """The aggregation as JSON-compatible data."""
    return dataclasses.asdict(self)


@dataclasses.dataclass
class SplitRound:
  """A round as four pieces (see the module docstring for their signatures).

  Attributes:
    server_prepare, client_work, server_update: ``jax.export.Exported``.
    aggregations: one :class:`Aggregation` per input of ``server_update``
      after the residuals, in order.
    num_clients: the cohort size the round was traced for.
    num_to_clients, num_placed, num_residuals: how ``server_prepare``'s
      outputs divide into ``to_clients``, ``placed`` and ``residuals``.
    out_tree: the pytree structure of the round's outputs.
  """

  server_prepare: Any
  client_work: Any
  aggregations: tuple[Aggregation, ...]
  server_update: Any
  num_clients: int
  num_to_clients: int
  num_placed: int
  num_residuals: int
  out_tree: Any

  def prepare(self, server_inputs: Sequence[Any]) -> tuple[list, list, list]:
    """Runs ``server_prepare``: ``(to_clients, placed, residuals)``."""
    prepared = list(self.server_prepare.call(*server_inputs))
    a, b = self.num_to_clients, self.num_to_clients + self.num_placed
    return prepared[:a], prepared[a:b], prepared[b:]

  def aggregate(self, client_outputs: Sequence[Sequence[Any]]) -> list[np.ndarray]:
    """Computes :attr:`aggregations` in NumPy (64-bit accumulators).

    Args:
      client_outputs: for each client, the outputs of its ``client_work``.
    """
    out = []
    for agg in self.aggregations:
      xs = [outs[agg.value] for outs in client_outputs]
      ws = None if agg.weight is None else [outs[agg.weight] for outs in client_outputs]
      out.append(plan_lib.combine(agg.op, xs, ws, jnp.dtype(agg.dtype)))
    return out

  def run(self, server_inputs: Sequence[Any], client_inputs: Sequence[Any]) -> Any:
    """Composes the four pieces by hand, client by client.

    Args:
      server_inputs: the flat server arguments, in order.
      client_inputs: the flat placed client arguments, in order.

    Returns:
      The round's outputs.
    """
    to_clients, placed, residuals = self.prepare(server_inputs)
    client_outputs = []
    for c in range(self.num_clients):
      mine = [x[c] for x in placed] + [x[c] for x in client_inputs]
      client_outputs.append(self.client_work.call(*to_clients, *mine))
    aggregates = self.aggregate(client_outputs)
    outs = self.server_update.call(*residuals, *aggregates)
    return jax.tree.unflatten(self.out_tree, list(outs))


_PREPARE, _CLIENT, _UPDATE = 'prepare', 'client', 'update'


def _stage_error(what: str) -> ValueError:
  return ValueError(
      f'fedjx.export.split_round: {what}, so the program has more than one '
      'broadcast-map-aggregate stage; a round to split must have one (split '
      'it into several rounds, or run it with fedjx.beam).')


def split_round(fn: Callable[..., Any], *args: Any,
                client_args: Sequence[int] = ()) -> SplitRound:
  """Exports ``fn`` as ``server_prepare``, ``client_work``, aggregations and
  ``server_update``.

  Args:
    fn: a function that calls a ``fedjx.program`` with one MapReduce stage:
      server code, then client work (any number of ``map_fn`` s and
      elementwise operations on client values), then reductions, then server
      code that no longer reaches clients.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    client_args: positions of the arguments the clients hold (e.g. the
      cohort); the others are server inputs.

  Returns:
    The :class:`SplitRound`.
  """
  plan = plan_lib.trace_plan_with_clients(fn, args, client_args)
  client_leaf_ids, server_leaf_ids = [], []
  position = 0
  for k, arg in enumerate(args):
    count = len(jax.tree.leaves(arg))
    ids = plan.in_ids[position:position + count]
    (client_leaf_ids if k in client_args else server_leaf_ids).extend(ids)
    position += count

  # Assign every step to a stage by what it reads.
  stage = {i: _PREPARE for i in list(server_leaf_ids) + list(plan.consts)}
  stage.update({i: _CLIENT for i in client_leaf_ids})
  broadcast_source: dict[int, int] = {}
  prepare_steps, client_steps, reductions, update_steps = [], [], [], []
  for step in plan.steps:
    if isinstance(step, plan_lib.ServerStep):
      where = _UPDATE if any(stage.get(i) == _UPDATE for i in step.in_ids) else _PREPARE
      (update_steps if where == _UPDATE else prepare_steps).append(step)
      stage.update({i: where for i in step.out_ids})
    elif isinstance(step, plan_lib.BroadcastStep):
      source = broadcast_source.get(step.in_id, step.in_id)
      if stage.get(source) == _UPDATE:
        raise _stage_error('a value computed from an aggregate is broadcast')
      broadcast_source[step.out_id] = source
      stage[step.out_id] = _PREPARE
    elif isinstance(step, plan_lib.MapStep):
      if any(stage.get(i) == _UPDATE for i in list(step.const_ids) + list(step.x_ids)):
        raise _stage_error('client work reads a value computed from an aggregate')
      client_steps.append(step)
      stage.update({i: _CLIENT for i in step.out_ids})
    else:
      operands = [step.x_id] + ([step.weight_id] if step.weight_id is not None else [])
      if any(stage.get(i) == _UPDATE for i in operands):
        raise _stage_error('an aggregate is aggregated again')
      reductions.append(step)
      stage[step.out_id] = _UPDATE
  for i in plan.out_ids:
    if stage.get(i) == _CLIENT:
      raise ValueError(
          'fedjx.export.split_round: the round returns a value placed at the '
          'clients; only server values (aggregates and what the server '
          'computes from them) can be outputs. Reduce it first.')

  # What client work reads: whole server values, slices of server-placed
  # values, slices of client inputs.
  def is_client_local(i):
    return stage.get(i) == _CLIENT

  to_clients, placed = [], []
  for step in client_steps:
    for i in step.const_ids:
      if i not in to_clients:
        to_clients.append(i)
    for i in step.x_ids:
      if i in broadcast_source:
        if broadcast_source[i] not in to_clients:
          to_clients.append(broadcast_source[i])
      elif not is_client_local(i) and i not in placed:
        placed.append(i)
  client_outputs = []
  for step in reductions:
    for i in (step.x_id, step.weight_id):
      if i is None or i in client_outputs:
        continue
      client_outputs.append(i)
      if i in broadcast_source:
        if broadcast_source[i] not in to_clients:
          to_clients.append(broadcast_source[i])
      elif not is_client_local(i) and i not in placed:
        placed.append(i)

  # What the server keeps for the update.
  update_reads = [i for s in update_steps for i in s.in_ids] + list(plan.out_ids)
  residuals = []
  for i in update_reads:
    i = broadcast_source.get(i, i)
    if stage.get(i) == _PREPARE and i not in plan.consts and i not in residuals:
      residuals.append(i)
  aggregate_ids = [s.out_id for s in reductions]

  def value(env, i):
    return env[i] if i in env else plan.consts[i]

  def prepare(*server_inputs):
    env = dict(zip(server_leaf_ids, server_inputs))
    for step in prepare_steps:
      env.update(zip(step.out_ids, step.function()(*[value(env, i) for i in step.in_ids])))
    return tuple(value(env, i) for i in to_clients + placed + residuals)

  def client_work(*inputs):
    whole = dict(zip(to_clients, inputs[:len(to_clients)]))
    mine = dict(zip(placed + client_leaf_ids, inputs[len(to_clients):]))

    def local(i):
      if i in broadcast_source:
        return value(whole, broadcast_source[i])
      return mine[i]

    for step in client_steps:
      outs = step.function()(*[value(whole, i) for i in step.const_ids],
                             *[local(i) for i in step.x_ids])
      mine.update(zip(step.out_ids, outs))
    return tuple(local(i) for i in client_outputs)

  def update(*inputs):
    env = dict(zip(residuals + aggregate_ids, inputs))
    for step in update_steps:
      env.update(zip(step.out_ids, step.function()(*[value(env, i) for i in step.in_ids])))
    outs = []
    for i in plan.out_ids:
      if i in broadcast_source:
        v = value(env, broadcast_source[i])
        outs.append(jnp.broadcast_to(v, (plan.num_clients,) + jnp.shape(v)))
      else:
        outs.append(value(env, i))
    return tuple(outs)

  def spec(i, drop_leading=False):
    aval = plan.avals[i]
    return jax.ShapeDtypeStruct(aval.shape[1:] if drop_leading else aval.shape, aval.dtype)

  output_index = {i: k for k, i in enumerate(client_outputs)}
  aggregations = tuple(
      Aggregation(s.op, output_index[s.x_id],
                  None if s.weight_id is None else output_index[s.weight_id],
                  str(plan.avals[s.out_id].dtype))
      for s in reductions)
  exported_prepare = jax.export.export(jax.jit(prepare))(
      *[spec(i) for i in server_leaf_ids])
  exported_client = jax.export.export(jax.jit(client_work))(
      *[spec(i) for i in to_clients],
      *[spec(i, drop_leading=True) for i in placed + client_leaf_ids])
  exported_update = jax.export.export(jax.jit(update))(
      *[spec(i) for i in residuals + aggregate_ids])
  return SplitRound(
      server_prepare=exported_prepare,
      client_work=exported_client,
      aggregations=aggregations,
      server_update=exported_update,
      num_clients=plan.num_clients,
      num_to_clients=len(to_clients),
      num_placed=len(placed),
      num_residuals=len(residuals),
      out_tree=plan.out_tree)
