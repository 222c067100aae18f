"""Splitting a round into the four pieces a cross-device system runs.

Cross-device systems run client work on phones, aggregation in a (possibly
secure) aggregation service, and server work in a data centre; they need
these as separate, portable programs. :func:`split_round` traces a round
written with the fedjx primitives (:mod:`fedjx.interpreters.plan`) and returns one
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
   ``k`` is the ``op`` (``'sum'``, ``'mean'``, ``'weighted_mean'`` or
   ``'collect'``) over clients of ``client_outputs[value]``, weighted by
   ``client_outputs[weight]`` for a weighted mean (``sum_i w_i x_i / sum_i
   w_i``, zero when the weights sum to zero). Sums and means are the part
   to hand to a secure-aggregation service; ``'collect'`` (per-client values
   stacked for the server to index by, as SCAFFOLD's client ids and control
   variates) reveals each client's value.
4. ``server_update(*residuals, *aggregates) -> outputs`` (a
   ``jax.export.Exported``): the server code after aggregation; its flat
   outputs unflatten with ``SplitRound.out_tree`` to the round's outputs.

Each ``Exported`` ``.serialize()`` s to bytes that ``jax.export.deserialize``
turns back into a callable wherever JAX (or an XLA/StableHLO runtime) runs.
:meth:`SplitRound.run` composes the four by hand, aggregating in NumPy.

A program of several stages (a value computed from an aggregate reaches the
clients again, as in ``jax.grad`` of a round) is split by
:func:`split_program` into a :class:`SplitProgram`: a sequence of
:class:`Stage` s, each a ``server_prepare``, a ``client_work`` and its
aggregations, with server and per-client values carried between stages, and
a final ``server_update``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjx.interpreters import plan as plan_lib

__all__ = ['AGGREGATION_OPS', 'Aggregation', 'SplitProgram', 'SplitRound',
           'Stage', 'aggregate', 'split_program', 'split_round']

AGGREGATION_OPS = ('sum', 'mean', 'weighted_mean', 'collect')


@dataclasses.dataclass(frozen=True)
class Aggregation:
  """One aggregate over clients of an output of ``client_work``.

  Attributes:
    op: ``'sum'`` (``sum_i x_i``), ``'mean'`` (``(1/n) sum_i x_i``),
      ``'weighted_mean'`` (``sum_i w_i x_i / sum_i w_i``, 0 if the weights
      sum to 0), or ``'collect'`` (``[x_0, ..., x_{n-1}]`` stacked in client
      order: per-client values the server indexes by, e.g. client ids, or
      writes to per-client state, as in SCAFFOLD; not private).
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
    """Computes :attr:`aggregations` in NumPy (see :func:`aggregate`)."""
    return aggregate(self.aggregations, client_outputs)

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


@dataclasses.dataclass
class Stage:
  """One broadcast-map-aggregate stage of a :class:`SplitProgram`.

  Attributes:
    server_prepare: ``(*carry, *previous_aggregates) -> (*to_clients,
      *placed, *carry')`` (stage 0 takes the flat server inputs).
    client_work: ``(*to_clients, *placed_i, *client_inputs_i,
      *client_carry_i) -> (*client_outputs, *client_carry_i')`` for one client.
    aggregations: the aggregates of ``client_outputs`` (see :class:`Aggregation`).
    num_to_clients, num_placed: how ``server_prepare``'s outputs begin.
    num_client_carry: how many of ``client_work``'s outputs (at the end) the
      client keeps for the next stage.
  """

  server_prepare: Any
  client_work: Any
  aggregations: tuple[Aggregation, ...]
  num_to_clients: int
  num_placed: int
  num_client_carry: int


@dataclasses.dataclass
class SplitProgram:
  """A program of any number of stages, then ``server_update``.

  Between stages the server keeps its carry (what later stages read) and
  each client keeps its client carry (e.g. the residuals a gradient's
  backward pass reads), so the same clients take part in every stage.
  """

  stages: tuple[Stage, ...]
  server_update: Any
  num_clients: int
  out_tree: Any

  def run(self, server_inputs: Sequence[Any], client_inputs: Sequence[Any]) -> Any:
    """Runs the stages by hand, aggregating in NumPy (64-bit accumulators)."""
    carry, aggregates = list(server_inputs), []
    client_carry = [[] for _ in range(self.num_clients)]
    for stage in self.stages:
      prepared = list(stage.server_prepare.call(*carry, *aggregates))
      a, b = stage.num_to_clients, stage.num_to_clients + stage.num_placed
      to_clients, placed, carry = prepared[:a], prepared[a:b], prepared[b:]
      outputs = []
      for c in range(self.num_clients):
        outs = list(stage.client_work.call(
            *to_clients, *[x[c] for x in placed], *[x[c] for x in client_inputs],
            *client_carry[c]))
        cut = len(outs) - stage.num_client_carry
        outputs.append(outs[:cut])
        client_carry[c] = outs[cut:]
      aggregates = aggregate(stage.aggregations, outputs)
    outs = self.server_update.call(*carry, *aggregates)
    return jax.tree.unflatten(self.out_tree, list(outs))


def aggregate(aggregations: Sequence[Aggregation],
              client_outputs: Sequence[Sequence[Any]]) -> list[np.ndarray]:
  """Computes ``aggregations`` in NumPy with 64-bit accumulators.

  Args:
    aggregations: the stage's :class:`Aggregation` s.
    client_outputs: for each client, the outputs of its ``client_work``.
  """
  out = []
  for agg in aggregations:
    xs = [outs[agg.value] for outs in client_outputs]
    ws = None if agg.weight is None else [outs[agg.weight] for outs in client_outputs]
    out.append(plan_lib.combine(agg.op, xs, ws, jnp.dtype(agg.dtype)))
  return out


def split_program(fn: Callable[..., Any], *args: Any,
                  client_args: Sequence[int] = ()) -> SplitProgram:
  """Exports ``fn`` as stages of (``server_prepare``, ``client_work``,
  aggregations), then ``server_update``.

  A value's stage is the number of aggregations it (transitively) depends
  on: server code of stage ``k`` runs in stage ``k``'s ``server_prepare``
  (``server_update`` after the last), client work of stage ``k`` in its
  ``client_work``, and a reduction of stage-``k`` values is an aggregation
  of stage ``k``. A gradient of a round has two stages: the forward
  aggregation, then the cotangent broadcast back to the clients.

  Args:
    fn: a function that calls a ``fedjx.program`` and returns server values.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    client_args: positions of the arguments the clients hold (e.g. the
      cohort); the others are server inputs.
  """
  plan = plan_lib.trace_plan_with_clients(fn, args, client_args)
  client_leaf_ids = list(plan.client_in_ids)
  server_leaf_ids = list(plan.server_in_ids)

  # The stage of every value and step.
  level = {i: 0 for i in list(server_leaf_ids) + list(plan.consts) + client_leaf_ids}
  is_client = set(client_leaf_ids)
  broadcast_source = plan.broadcast_sources
  source = plan.source
  server_steps, client_steps, reductions = [], [], []

  def level_of(ids):
    return max((level[source(i)] for i in ids), default=0)

  for step in plan.steps:
    if isinstance(step, plan_lib.BroadcastStep):
      continue  # A broadcast value is its source, at the source's stage.
    k = level_of(step.reads)
    if isinstance(step, plan_lib.ServerStep):
      server_steps.append((k, step))
      level.update({i: k for i in step.writes})
    elif isinstance(step, plan_lib.MapStep):
      client_steps.append((k, step))
      level.update({i: k for i in step.writes})
      is_client.update(step.writes)
    else:
      reductions.append((k, step))
      level[step.out_id] = k + 1
  for i in plan.out_ids:
    if i in is_client:
      raise ValueError(
          'fedjx.export: the program returns a value placed at the clients; '
          'only server values (aggregates and what the server computes from '
          'them) can be outputs. Reduce it first.')
  num_stages = max((k + 1 for k, _ in reductions), default=1)

  # Who reads what, at which stage (``num_stages``: server_update).
  reads: list[tuple[int, int]] = []   # (stage, id)
  for k, step in server_steps:
    reads += [(min(k, num_stages), i) for i in step.reads]
  for k, step in client_steps + reductions:
    reads += [(k, i) for i in step.reads]
  reads += [(num_stages, i) for i in plan.out_ids]

  def aggregates_of(k):
    return [s.out_id for j, s in reductions if j == k]

  def value(env, i):
    return env[i] if i in env else plan.consts[i]

  def spec(i, drop_leading=False):
    aval = plan.avals[i]
    shape = aval.shape[1:] if drop_leading else aval.shape
    return jax.ShapeDtypeStruct(shape, aval.dtype)

  def server_carry(into):
    """The server values ``server_prepare`` of stage ``into`` receives, besides
    the previous stage's aggregates."""
    if into == 0:
      return list(server_leaf_ids)
    previous = set(aggregates_of(into - 1))
    ids = []
    for k, i in reads:
      i = source(i)
      if (k >= into and i not in is_client and i not in plan.consts
          and i not in previous and level[i] < into and i not in ids):
        ids.append(i)
    return ids

  def client_carry(into):
    ids = []
    for k, i in reads:
      if (k >= into and i in is_client and i not in client_leaf_ids
          and level[i] < into and i not in ids):
        ids.append(i)
    return ids

  stages = []
  for k in range(num_stages):
    carry_in = server_carry(k)
    new_aggregates = aggregates_of(k - 1) if k else []
    carry_out = server_carry(k + 1)
    mine_in = client_carry(k)
    mine_out = client_carry(k + 1)
    steps_here = [s for j, s in client_steps if j == k]
    reduce_here = [s for j, s in reductions if j == k]
    to_clients, placed = [], []

    def needs(i):
      if i in broadcast_source:
        if source(i) not in to_clients:
          to_clients.append(source(i))
      elif i not in is_client and i not in placed:
        placed.append(i)

    for step in steps_here:
      for i in step.const_ids:
        if i not in to_clients:
          to_clients.append(i)
      for i in step.x_ids:
        needs(i)
    client_outputs = []
    for step in reduce_here:
      for i in step.reads:
        if i not in client_outputs:
          client_outputs.append(i)
          needs(i)

    def prepare(*inputs, k=k, carry_in=carry_in, new_aggregates=new_aggregates,
                carry_out=carry_out, to_clients=to_clients, placed=placed):
      env = dict(zip(carry_in + new_aggregates, inputs))
      for j, step in server_steps:
        if j == k:
          env.update(zip(step.out_ids, step.function()(
              *[value(env, i) for i in step.in_ids])))
      return tuple(value(env, i) for i in to_clients + placed + carry_out)

    def client_work(*inputs, steps_here=steps_here, to_clients=to_clients,
                    placed=placed, mine_in=mine_in, mine_out=mine_out,
                    client_outputs=client_outputs):
      whole = dict(zip(to_clients, inputs[:len(to_clients)]))
      mine = dict(zip(placed + client_leaf_ids + mine_in, inputs[len(to_clients):]))

      def local(i):
        return value(whole, source(i)) if i in broadcast_source else mine[i]

      for step in steps_here:
        outs = step.function()(*[value(whole, i) for i in step.const_ids],
                               *[local(i) for i in step.x_ids])
        mine.update(zip(step.out_ids, outs))
      return tuple(local(i) for i in client_outputs + mine_out)

    output_index = {i: n for n, i in enumerate(client_outputs)}
    aggregations = tuple(
        Aggregation(s.op, output_index[s.x_id],
                    None if s.weight_id is None else output_index[s.weight_id],
                    str(plan.avals[s.out_id].dtype))
        for s in reduce_here)
    stages.append(Stage(
        server_prepare=jax.export.export(jax.jit(prepare))(
            *[spec(i) for i in carry_in + new_aggregates]),
        client_work=jax.export.export(jax.jit(client_work))(
            *[spec(i) for i in to_clients],
            *[spec(i, drop_leading=True) for i in placed + client_leaf_ids + mine_in]),
        aggregations=aggregations,
        num_to_clients=len(to_clients),
        num_placed=len(placed),
        num_client_carry=len(mine_out)))

  final_carry = server_carry(num_stages)
  final_aggregates = aggregates_of(num_stages - 1)

  def update(*inputs):
    env = dict(zip(final_carry + final_aggregates, inputs))
    for j, step in server_steps:
      if j >= num_stages:
        env.update(zip(step.out_ids, step.function()(
            *[value(env, i) for i in step.in_ids])))
    outs = []
    for i in plan.out_ids:
      if i in broadcast_source:
        v = value(env, source(i))
        outs.append(jnp.broadcast_to(v, (plan.num_clients,) + jnp.shape(v)))
      else:
        outs.append(value(env, i))
    return tuple(outs)

  server_update = jax.export.export(jax.jit(update))(
      *[spec(i) for i in final_carry + final_aggregates])
  return SplitProgram(tuple(stages), server_update, plan.num_clients, plan.out_tree)


def split_round(fn: Callable[..., Any], *args: Any,
                client_args: Sequence[int] = ()) -> SplitRound:
  """Exports a one-stage ``fn`` as ``server_prepare``, ``client_work``,
  aggregations and ``server_update`` (see :func:`split_program` for several).

  Args:
    fn: a function that calls a ``fedjx.program`` with one stage: server
      code, then client work (any number of ``map_fn`` s and elementwise
      operations on client values), then reductions, then server code that
      no longer reaches clients.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    client_args: positions of the arguments the clients hold (e.g. the
      cohort); the others are server inputs.

  Returns:
    The :class:`SplitRound`.
  """
  program = split_program(fn, *args, client_args=client_args)
  if len(program.stages) != 1:
    raise ValueError(
        f'fedjx.export.split_round: the program has {len(program.stages)} '
        'broadcast-map-aggregate stages, more than one (a value computed from '
        'an aggregate reaches the clients again, as in a gradient of a round); '
        'a round to split must have one. Use fedjx.export.split_program for '
        'several.')
  (stage,) = program.stages
  prepare_outs = stage.server_prepare.out_avals
  return SplitRound(
      server_prepare=stage.server_prepare,
      client_work=stage.client_work,
      aggregations=stage.aggregations,
      server_update=program.server_update,
      num_clients=program.num_clients,
      num_to_clients=stage.num_to_clients,
      num_placed=stage.num_placed,
      num_residuals=len(prepare_outs) - stage.num_to_clients - stage.num_placed,
      out_tree=program.out_tree)
