"""Running fedjx programs as Apache Beam pipelines.

A program written with the fedjx primitives is a MapReduce program, so a batch
system can run it (the third promise of DrJAX, arXiv 2403.07128). This module
traces the program into a plan (:mod:`fedjx.interpreters.plan`) and builds a
Beam pipeline from it:

* client work (the per-client body of ``map_fn``) runs as a ``ParDo`` over a
  ``PCollection`` of clients; each element is ``(index, {value id: array})``,
  the values that client holds;
* ``reduce_sum``, ``reduce_mean`` and ``reduce_weighted_mean`` run as
  combiners that accumulate in 64 bits (``float64``/``int64``), so the order in
  which workers merge partial results barely matters;
* broadcast values and other server values reach clients as side inputs;
* server code between stages runs as JAX functions on singleton
  ``PCollection`` s.

Every JAX computation is shipped to workers serialised with ``jax.export``
(StableHLO), not pickled as Python. Client data is read *inside* the pipeline by
:class:`ClientData`'s loader, so a cohort never has to fit in the driver's
memory (``fedjx.datasets.beam_client_data`` makes one from a dataset).

The DirectRunner (in-process) is the default. The same pipeline runs on
Dataflow, Flink or Spark by passing ``pipeline_options`` (for example
``PipelineOptions(runner='DataflowRunner', project=..., region=...,
temp_location='gs://...')`` or ``runner='FlinkRunner'`` /
``runner='SparkRunner'`` with their job endpoints), with ``output_dir`` on a
filesystem every worker can reach (``gs://...``, ``hdfs://...``) and fedjx and
jax installed on the workers (``--requirements_file`` or a container image).
See docs/beam.md.

Requires the ``beam`` extra: ``pip install -e '.[beam]'``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import apache_beam as beam
import jax
import numpy as np
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from fedjx.interpreters import plan as plan_lib

__all__ = ['ClientData', 'StableReduce', 'run']


@dataclasses.dataclass(frozen=True)
class ClientData:
  """Placed values that the clients hold, read inside the pipeline.

  Attributes:
    client_ids: the clients, in the order of the placed axis.
    load: ``load(client_id) -> pytree`` of one client's arrays (what the
      program sees as the ``i``-th slice of this argument). It runs on the
      workers, so it must be picklable (a module-level function or a
      ``functools.partial`` of one).
    spec: the pytree of one client's ``jax.ShapeDtypeStruct`` s (or example
      arrays) that ``load`` returns.
  """

  client_ids: Sequence[Any]
  load: Callable[[Any], Any]
  spec: Any

  def placed_spec(self) -> Any:
    n = len(self.client_ids)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((n,) + tuple(np.shape(s)), np.asarray(s).dtype
                                       if not hasattr(s, 'dtype') else s.dtype),
        self.spec)

  @classmethod
  def from_arrays(cls, placed: Any) -> 'ClientData':
    """Wraps in-memory placed arrays (leading axis = clients)."""
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), placed)
    placed = jax.tree.map(plan_lib.to_host, placed)
    n = jax.tree.leaves(placed)[0].shape[0]
    return cls(list(range(n)), _IndexLoader(placed), spec)


class _IndexLoader:
  def __init__(self, placed):
    self.placed = placed

  def __call__(self, i):
    return jax.tree.map(lambda a: a[i], self.placed)


def _export(fn: Callable[..., Any], avals: Sequence[Any]) -> bytes:
  """``fn`` as StableHLO bytes, on host values (typed keys as key data)."""
  specs = [plan_lib.host_spec(a) for a in avals]
  wrapped = plan_lib.on_host_values(fn, avals)
  return bytes(jax.export.export(jax.jit(wrapped))(*specs).serialize())


class _Computation:
  """A serialised JAX computation, deserialised and compiled once per worker."""

  def __init__(self, serialized: bytes):
    self.serialized = serialized
    self._call = None

  def __call__(self, *args):
    if self._call is None:
      self._call = jax.jit(jax.export.deserialize(bytearray(self.serialized)).call)
    return self._call(*args)

  def __getstate__(self):
    return {'serialized': self.serialized}

  def __setstate__(self, state):
    self.serialized = state['serialized']
    self._call = None


class _LoadClient(beam.DoFn):

  def __init__(self, load, leaf_ids):
    self.load = load
    self.leaf_ids = leaf_ids

  def process(self, element):
    index, client_id = element
    leaves = jax.tree.leaves(self.load(client_id))
    if len(leaves) != len(self.leaf_ids):
      raise ValueError(
          f'fedjx.beam: ClientData.load({client_id!r}) returned {len(leaves)} '
          f'arrays; its spec has {len(self.leaf_ids)}.')
    yield index, {i: plan_lib.to_host(x) for i, x in zip(self.leaf_ids, leaves)}


def _merge(grouped):
  index, parts = grouped
  merged = {}
  for part in parts:
    merged.update(part)
  return index, merged


def _merged(side):
  values = {}
  for part in side:
    values.update(part)
  return values


def _client_value(ref, index, columns, server):
  """Client ``index``'s view of value ``ref = (kind, id)``.

  Its own column for a client value, the server value for a broadcast, and
  row ``index`` of the server value for a value placed by the server.
  """
  kind, i = ref
  if kind == plan_lib.CLIENT:
    return columns[i]
  if kind == plan_lib.BROADCAST:
    return server[i]
  return np.asarray(server[i])[index]


class _ClientWork(beam.DoFn):
  """Runs one map step for a client and keeps the values needed later."""

  def __init__(self, body, const_ids, x_refs, out_ids, keep):
    self.body = body
    self.const_ids = const_ids
    self.x_refs = x_refs    # (kind, id): a 'client' column, else a server value
    self.out_ids = out_ids
    self.keep = keep

  def process(self, element, *side):
    index, columns = element
    server = _merged(side)
    args = [server[i] for i in self.const_ids]
    args += [_client_value(ref, index, columns, server) for ref in self.x_refs]
    outs = self.body(*args)
    columns = {i: v for i, v in columns.items() if i in self.keep}
    for i, v in zip(self.out_ids, outs):
      if i in self.keep:
        columns[i] = np.asarray(v)
    yield index, columns


class _Gather(beam.DoFn):
  """Extracts ``(x_i, w_i)`` for a reduction from a client's values."""

  def __init__(self, refs):
    self.refs = refs

  def process(self, element, *side):
    index, columns = element
    server = _merged(side)
    yield tuple(None if ref is None else _client_value(ref, index, columns, server)
                for ref in self.refs)


class StableReduce(beam.CombineFn):
  """Sum, mean or weighted mean of per-client arrays in 64-bit accumulators.

  Accumulator: ``(sum of w x, sum of w, count)`` with ``w = 1`` for ``sum``
  and ``mean``. Merging adds accumulators, so the result does not depend on
  how a runner splits the clients beyond 64-bit rounding.
  """

  def __init__(self, op: str, dtype):
    self.op = op
    self.dtype = np.dtype(dtype)

  def create_accumulator(self):
    return None, None, 0

  def add_input(self, acc, pair):
    total, weight, count = acc
    x, w = pair
    x = np.asarray(x)
    if self.op == 'weighted_mean':
      w = np.asarray(w, np.float64)
      term = w.reshape(w.shape + (1,) * (x.ndim - w.ndim)) * x.astype(np.float64)
    else:
      term = x.astype(plan_lib.accumulator_dtype(x.dtype))
      w = None
    total = term if total is None else total + term
    if w is not None:
      weight = w if weight is None else weight + w
    return total, weight, count + 1

  def merge_accumulators(self, accs):
    total, weight, count = None, None, 0
    for t, w, c in accs:
      if t is not None:
        total = t if total is None else total + t
      if w is not None:
        weight = w if weight is None else weight + w
      count += c
    return total, weight, count

  def extract_output(self, acc):
    total, weight, count = acc
    if self.op == 'sum':
      return total.astype(self.dtype)
    if self.op == 'mean':
      return (total / count).astype(self.dtype)
    return plan_lib.weighted_mean_result(total, weight, self.dtype)


class _RunServer:
  """Runs a server step on the merged server values; returns its outputs."""

  def __init__(self, computation, in_ids, out_ids):
    self.computation = computation
    self.in_ids = in_ids
    self.out_ids = out_ids

  def __call__(self, _, *side):
    server = _merged(side)
    outs = self.computation(*[server[i] for i in self.in_ids])
    return {i: np.asarray(o) for i, o in zip(self.out_ids, outs)}


class _Outputs:
  """Collects the program's outputs from server values and client lists."""

  def __init__(self, out_refs, num_clients):
    self.out_refs = out_refs
    self.num_clients = num_clients

  def __call__(self, _, *side):
    server = _merged(side)
    outs = []
    for kind, i in self.out_refs:
      if kind == plan_lib.CLIENT:
        pairs = server[('clients', i)]
        outs.append(_stack(pairs))
      elif kind == plan_lib.BROADCAST:
        v = np.asarray(server[i])
        outs.append(np.broadcast_to(v, (self.num_clients,) + v.shape))
      else:
        outs.append(np.asarray(server[i]))
    return outs


def _stack(pairs, dtype=None):
  """``(client index, array)`` pairs stacked in client order."""
  stacked = np.stack([v for _, v in sorted(pairs, key=lambda p: p[0])])
  return stacked if dtype is None else stacked.astype(dtype)


def _write_outputs(outs, path):
  buffer = io.BytesIO()
  np.savez(buffer, *[np.asarray(o) for o in outs])
  with FileSystems.create(path) as f:
    f.write(buffer.getvalue())


def _read_outputs(path, dtypes):
  """The outputs, in ``dtypes`` (``.npz`` keeps ``bfloat16`` only as raw bytes)."""
  with FileSystems.open(path) as f:
    data = np.load(io.BytesIO(f.read()), allow_pickle=False)
    return [data[f'arr_{k}'].view(dtype) for k, dtype in enumerate(dtypes)]


def run(fn: Callable[..., Any], *args: Any,
        pipeline_options: PipelineOptions | None = None,
        output_dir: str | None = None) -> Any:
  """Runs the fedjx program ``fn(*args)`` as one Apache Beam pipeline.

  Args:
    fn: a function that calls (or is) a ``fedjx.program``; it may be jitted.
    *args: its arguments. An argument that is a :class:`ClientData` stands for
      placed values the clients hold (read inside the pipeline); every other
      argument is a server value.
    pipeline_options: Beam options; the in-process DirectRunner by default.
    output_dir: where the result is written (default: a temporary folder);
      on a distributed runner, a path every worker can reach.

  Returns:
    ``fn``'s outputs as NumPy arrays, the same pytree as ``fn(*args)``.
  """
  client_positions = [k for k, a in enumerate(args) if isinstance(a, ClientData)]
  trace_args = [a.placed_spec() if isinstance(a, ClientData) else a for a in args]
  plan = plan_lib.trace_plan_with_clients(fn, trace_args, client_positions)
  sources = [(args[k], plan.arg_ids[k]) for k in plan.client_args]
  for source, _ in sources:
    if len(source.client_ids) != plan.num_clients:
      raise ValueError(
          f'fedjx.beam.run: ClientData has {len(source.client_ids)} clients but '
          f'the program places {plan.num_clients}.')
  server_inputs = {i: plan_lib.to_host(v) for i, v in plan.consts.items()}
  for k, arg in enumerate(args):
    if k not in plan.client_args:
      server_inputs.update(zip(plan.arg_ids[k],
                               (plan_lib.to_host(x) for x in jax.tree.leaves(arg))))

  output_dir = output_dir or tempfile.mkdtemp(prefix='fedjx_beam_')
  options = pipeline_options or PipelineOptions(runner='DirectRunner')
  kinds = plan.kinds
  source_of = plan.source
  n = plan.num_clients
  with beam.Pipeline(options=options) as pipeline:
    inputs = pipeline | 'server_inputs' >> beam.Create([server_inputs])
    # Each server value lives in a singleton dict {id: array}; `home` says which.
    home: dict[Any, Any] = {i: inputs for i in server_inputs}

    def side(ids):
      pcolls = list({id(home[source_of(i)]): home[source_of(i)] for i in ids}.values())
      return [beam.pvalue.AsSingleton(p) for p in pcolls]

    parts = []
    for k, (source, ids) in enumerate(sources):
      pairs = list(enumerate(source.client_ids))
      parts.append(pipeline | f'client_ids{k}' >> beam.Create(pairs)
                   | f'load{k}' >> beam.ParDo(_LoadClient(source.load, ids)))
    if not parts:
      table = (pipeline | 'clients' >> beam.Create(list(range(n)))
               | 'empty' >> beam.Map(lambda i: (i, {})))
    elif len(parts) == 1:
      table = parts[0]
    else:
      table = (parts | 'flatten' >> beam.Flatten() | 'by_client' >> beam.GroupByKey()
               | 'merge' >> beam.Map(_merge))

    for s, step in enumerate(plan.steps):
      if isinstance(step, plan_lib.ServerStep):
        avals = [plan.avals[i] for i in step.in_ids]
        computation = _Computation(_export(step.function(), avals))
        outs = (pipeline | f'start{s}' >> beam.Create([None])
                | f'server{s}' >> beam.Map(
                    _RunServer(computation, step.in_ids, step.out_ids),
                    *side(step.in_ids)))
        home.update({i: outs for i in step.out_ids})
      elif isinstance(step, plan_lib.BroadcastStep):
        home[step.out_id] = home[source_of(step.in_id)]
      elif isinstance(step, plan_lib.MapStep):
        x_refs = [(kinds[i], source_of(i)) for i in step.x_ids]
        const_avals = [plan.avals[i] for i in step.const_ids]
        x_avals = [jax.core.ShapedArray(plan.avals[i].shape[1:], plan.avals[i].dtype)
                   for i in step.x_ids]
        computation = _Computation(_export(step.function(), const_avals + x_avals))
        server_ids = list(step.const_ids) + [i for k, i in x_refs if k != plan_lib.CLIENT]
        table = table | f'client_work{s}' >> beam.ParDo(
            _ClientWork(computation, step.const_ids, x_refs, step.out_ids,
                        _client_values(plan, plan.live_after[s])),
            *side(server_ids))
      elif step.op == 'collect':
        # Per-client values to the server, stacked in client order.
        home[step.out_id] = (
            table | f'collect_values{s}' >> beam.Map(lambda e, i=step.x_id: (e[0], e[1][i]))
            | f'collect_list{s}' >> beam.combiners.ToList()
            | f'collect_stack{s}' >> beam.Map(
                lambda pairs, i=step.out_id, dtype=plan_lib.host_spec(
                    plan.avals[step.out_id]).dtype: {i: _stack(pairs, dtype)}))
      else:
        refs = [(kinds[i], source_of(i)) for i in step.reads]
        if step.weight_id is None:
          refs.append(None)
        server_ids = [r[1] for r in refs if r is not None and r[0] != plan_lib.CLIENT]
        home[step.out_id] = (
            table | f'gather{s}' >> beam.ParDo(_Gather(refs), *side(server_ids))
            | f'reduce{s}' >> beam.CombineGlobally(
                StableReduce(step.op, plan.avals[step.out_id].dtype))
            | f'named{s}' >> beam.Map(lambda v, i=step.out_id: {i: v}))

    out_refs = [(kinds[i], source_of(i)) for i in plan.out_ids]
    client_outs = sorted({i for k, i in out_refs if k == plan_lib.CLIENT})
    for i in client_outs:
      home[('clients', i)] = (
          table | f'collect{i}' >> beam.Map(lambda e, i=i: (e[0], e[1][i]))
          | f'list{i}' >> beam.combiners.ToList()
          | f'named_list{i}' >> beam.Map(lambda v, i=i: {('clients', i): v}))
    wanted = [('clients', i) if k == plan_lib.CLIENT else i for k, i in out_refs]
    pcolls = list({id(home[w]): home[w] for w in wanted}.values())
    path = os.path.join(output_dir, 'outputs.npz')
    _ = (pipeline | 'finish' >> beam.Create([None])
         | 'outputs' >> beam.Map(_Outputs(out_refs, n),
                                 *[beam.pvalue.AsSingleton(p) for p in pcolls])
         | 'write' >> beam.Map(_write_outputs, path))
  outs = _read_outputs(path, [plan_lib.host_spec(plan.avals[i]).dtype for i in plan.out_ids])
  outs = [plan_lib.from_host(o, plan.avals[i]) for o, i in zip(outs, plan.out_ids)]
  return jax.tree.unflatten(plan.out_tree, outs)


def _client_values(plan: plan_lib.Plan, ids) -> set[int]:
  """The client-held values among ``ids`` (what a client row keeps)."""
  return {i for i in ids if plan.kinds.get(i) == plan_lib.CLIENT}
