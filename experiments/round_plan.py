"""The round ``fedjx-run`` would run, compiled and costed before it runs.

:func:`plan_config` takes a config as ``fedjx-run`` takes it and builds its
experiment the runner's way (:func:`fedjx.experiments.runner.build_experiment`:
the dataset, the model and its initial parameters, the algorithm, the mesh
of ``config.mesh``), takes the first round's cohort as the runner's first
round gets it, and lowers and compiles the round the runner would run first
(the algorithm without its non-finite guard where rounds run unguarded
first, :func:`fedjx.experiments.experiment.round_algorithms`) from the
server state's shapes, as ``execution='auto'`` does to decide whether to
stream (:class:`fedjx.execution.RoundRunner`). Nothing is trained and
nothing is written. It reports, per device:

* **memory by kind**: the server model (``state.params``), the rest of the
  server state (optimizer moments, DiLoCo's replicas' inner optimizer
  states, aggregator state), the cohort's data (and per-client rows), each
  counted from the arrays' shapes and shardings (the bytes of one shard);
  the outputs that do not reuse a donated argument; XLA's temporaries
  (activations, gradients, and the rest of the working set). Their sum is
  XLA's peak ``arguments + outputs - aliased + temporaries``. These are the
  figures of the compiler of the devices JAX sees (the CPU's where there is
  no accelerator); a TPU's are planned by ``--tpu``
  (:mod:`fedjx.experiments.topology_plan`).
* **FLOPs of the round**: for a ``llama_lm`` model the model FLOPs,
  ``(6 N_matmul + 12 L H h T) T`` per example
  (:func:`fedjx.models.llama_config.train_flops_per_token`) times the
  cohort's ``C x S x B`` examples (padding included: the round computes
  it), two thirds of that for LoRA (no gradient of the frozen weights); for
  other models three times XLA's count of one batch's forward
  pass (a backward pass costs about two forward ones; Kaplan et al. 2020,
  arXiv 2001.08361) times ``C x S``.
* **bytes on the wire**: each client downloads the server model and uploads
  one message, ``message_bytes(params)`` of the round's aggregator (the
  float32 update, or its encoding: ``fedjx.algorithms.aggregators``);
  aggregators that count their encoded bits as they go
  (``wire_bits``) report them in the run's ``upload_bits`` instead.
* whether ``config.execution='auto'`` would compile or stream the round on
  the target device (the same test: XLA's ``arguments + outputs +
  temporaries`` against 80 % of its memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from typing import Any

import jax
import numpy as np

from fedjx import execution
from fedjx.algorithms import aggregators
from fedjx.experiments import attack as attack_lib
from fedjx.experiments import client_states
from fedjx.experiments import config as config_lib
from fedjx.experiments import experiment
from fedjx.experiments import lm_metrics
from fedjx.experiments import parts
from fedjx.experiments import privacy as privacy_lib
from fedjx.experiments import processes
from fedjx.experiments import registry
from fedjx.experiments import run_trainer
from fedjx.experiments import runner
from fedjx.experiments import topology_plan
from fedjx.models import llama_config
from fedjx.models import lora


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  """The figures of one planned round (bytes per device)."""

  algorithm: str
  model: str
  dataset: str
  params: int
  clients: int
  steps: int
  batch: int
  mesh: str
  devices: int
  platform: str
  param_bytes: int
  state_bytes: int
  data_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  flops: float
  flops_method: str
  upload_bytes: float | None
  download_bytes: float
  execution: str
  chunk_size: int
  compile_seconds: float
  seq_len: int | None = None

  @property
  def new_output_bytes(self) -> int:
    """Outputs that do not reuse a donated argument's buffer."""
    return self.output_bytes - self.alias_bytes

  @property
  def peak_bytes(self) -> int:
    """``arguments + outputs - aliased + temporaries``."""
    return self.argument_bytes + self.new_output_bytes + self.temp_bytes

  @property
  def auto_bytes(self) -> int:
    """What ``execution='auto'`` holds against the device: ``arguments + outputs + temporaries``."""
    return self.argument_bytes + self.output_bytes + self.temp_bytes

  def streams(self, memory_bytes: float | None) -> bool:
    """Whether ``config.execution`` streams the round on a device of ``memory_bytes``."""
    if self.execution != 'auto':
      return self.execution == 'streaming'
    return memory_bytes is not None and self.auto_bytes > execution.HEADROOM * memory_bytes

  def to_json(self) -> dict[str, Any]:
    return {'kind': 'round', **dataclasses.asdict(self), 'peak_bytes': self.peak_bytes,
            'new_output_bytes': self.new_output_bytes}


def _itemsize(dtype: Any) -> int:
  try:
    return np.dtype(dtype).itemsize
  except TypeError:  # A key array's extended dtype: its key data.
    return 8


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of ``tree`` (arrays or ``ShapeDtypeStruct``): its largest shard."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = tuple(np.shape(leaf))
    sharding = getattr(leaf, 'sharding', None)
    if sharding is not None:
      shape = tuple(sharding.shard_shape(shape))
    total += int(np.prod(shape)) * _itemsize(leaf.dtype)
  return total


def _state_spec(config, exp, algorithm) -> Any:
  """The server state's shapes, laid on the mesh as the runner places it."""
  shapes = jax.eval_shape(algorithm.init, exp.init_params)
  mesh = jax.sharding.get_mesh()
  if mesh is None or mesh.empty:
    return shapes
  specs = run_trainer.state_specs(config, exp.model, shapes, mesh)
  return jax.tree.map(
      lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                        sharding=jax.sharding.NamedSharding(mesh, p)),
      shapes, specs)


def _first_cohort(exp) -> Any:
  """Round 0's cohort, placed, as the runner's first round gets it."""
  if exp.systems is not None:
    rounds = exp.system_rounds(0, 1, 0.0)
    first = next(iter(rounds))[0]
  else:
    rounds = exp.cohorts(0, 1)
    first = next(iter(rounds))
  close = getattr(rounds, 'close', None)
  if close is not None:
    close()
  return first


def _flops(config, exp, cohort, params) -> tuple[float, str, int | None]:
  """``(FLOPs of the round, how they were counted, T or None)``."""
  clients, steps, batch = cohort.shape
  base = getattr(exp.model, 'base', None) if isinstance(exp.model, lora.LoraModel) else None
  shape = lm_metrics.llama_shape(base if base is not None else exp.model)
  seq_len = (exp.data.info or {}).get('max_len')
  if shape is not None and seq_len:
    per_example = llama_config.train_flops_per_token(shape, int(seq_len)) * int(seq_len)
    rule = '6 N_matmul + 12 L H h T'
    if base is not None:  # No gradient of the frozen weights: forward and one backward.
      per_example, rule = per_example * 2 / 3, '4 N_matmul + 8 L H h T (LoRA)'
    return (per_example * clients * steps * batch,
            f'{rule} per token x {clients} x {steps} x {batch} x {int(seq_len):,} tokens',
            int(seq_len))
  one = experiment.sample_batch(config, exp.data)
  cost = jax.jit(exp.model.eval_loss_fn).lower(params, one).cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  forward = float((cost or {}).get('flops', 0.0))
  return (3 * forward * clients * steps,
          f"3 x XLA's forward pass of a batch of {batch} x {clients} clients x {steps} steps",
          None)


def _upload_bytes(config: Any, params: Any, clients: int, num_clients: int) -> float | None:
  """``clients x message_bytes(params)`` of the round's aggregator (None: counted as it runs)."""
  spec = attack_lib.algorithm_spec(config, privacy_lib.algorithm_spec(config, num_clients),
                                   num_clients)
  named = registry.split_name('algorithm', spec)[1].get('aggregator')
  aggregator = aggregators.mean() if named is None else parts.build_aggregator(named)
  if aggregator.traits.wire_bits:
    return None
  return clients * float(aggregator.message_bytes(params))


def plan_config(config: Any, log=lambda msg: None) -> RoundPlan:
  """Builds ``config``'s experiment as ``fedjx-run`` does and plans its first round.

  ``log`` receives the runner's one-line notes (the mesh ``'auto'`` chose).
  Raises :class:`fedjx.experiments.config.ConfigError` (one line) for a
  config ``fedjx-run`` would refuse, or an algorithm whose round is not one
  compiled program.
  """
  config = config_lib.validate(config)
  split = processes.split_cpu(config)
  mesh = None if config.mesh == 'auto' else processes.make_mesh(config)
  with contextlib.ExitStack() as stack:
    if mesh is not None:
      stack.enter_context(jax.set_mesh(mesh))
    exp = runner.build_experiment(config, split, log, stack)
    guarded, unguarded = experiment.round_algorithms(config, exp)
    algorithm = unguarded if unguarded is not None else guarded
    round_fn = getattr(algorithm, 'round', None)
    if not hasattr(round_fn, 'lower'):
      raise config_lib.ConfigError(
          f'config.algorithm.name={config.algorithm.name!r}: its round is not one compiled '
          'program, so fedjx-plan cannot compile it.')
    state = _state_spec(config, exp, algorithm)
    cohort = _first_cohort(exp)
    with tempfile.TemporaryDirectory() as scratch:
      store = client_states.make_store(config, exp.algorithm, exp.init_params,
                                       exp.data.train.num_clients, scratch)
      try:
        cohort = client_states.attach(store, cohort)
      finally:
        if store is not None:
          store.close()
    key = exp.round_key_for(0)
    spec = execution._spec  # pylint: disable=protected-access
    start = time.perf_counter()
    compiled = round_fn.lower(jax.tree.map(spec, state), jax.tree.map(spec, cohort),
                              spec(key)).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    flops, method, seq_len = _flops(config, exp, cohort, exp.init_params)
    clients, steps, batch = cohort.shape
    params_spec = state.params
    chunk = config_lib.streaming_chunk(config)
    client_bytes = sum(int(np.size(x)) * _itemsize(x.dtype)
                       for x in jax.tree.leaves(cohort)) // max(clients, 1)
    chunk = (min(chunk, clients) if chunk is not None
             else execution.streaming_chunk(client_bytes, clients))
    active = jax.sharding.get_mesh()
    devices = 1 if active is None or active.empty else int(active.size)
    return RoundPlan(
        algorithm=config.algorithm.name,
        model=registry.split_name('model', config.model)[0],
        dataset=registry.split_name('dataset', config.dataset)[0],
        params=int(sum(np.size(x) for x in jax.tree.leaves(exp.init_params))),
        clients=clients, steps=steps, batch=batch, mesh=config.mesh or '',
        devices=devices, platform=jax.devices()[0].platform,
        param_bytes=device_bytes(params_spec),
        state_bytes=device_bytes(state) - device_bytes(params_spec),
        data_bytes=device_bytes(cohort),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes), flops=flops, flops_method=method,
        upload_bytes=_upload_bytes(config, exp.init_params, clients,
                                   exp.data.train.num_clients),
        download_bytes=clients * float(device_bytes(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), exp.init_params))),
        execution=config.execution, chunk_size=chunk, compile_seconds=seconds,
        seq_len=seq_len)




DILOCO = ('diloco', 'diloco_recipe')
"""Algorithms :func:`plan_config_pod` plans as DiLoCo: AdamW inner steps, a Nesterov outer step."""
FEDAVG = ('fedavg',)
"""Algorithms it plans as FedAvg: SGD inner steps, the mean of the models as the new one."""


def _mesh_sizes(config: Any, replicas: int, chips: int) -> tuple[int, int]:
  """``(fsdp, tensor)`` of ``config.mesh`` on ``chips`` chips, ``fsdp`` filling what is left."""
  axes = (config_lib.mesh_axes(config.mesh)
          if config.mesh and config.mesh != 'auto' else {})
  clients = axes.get('clients', -1)
  if clients not in (-1, replicas):
    raise config_lib.ConfigError(
        f'config.mesh={config.mesh!r}: a pod plan puts each of the '
        f'config.cohort_size={replicas} replicas on its own slot of the clients axis; '
        f"give clients={replicas} or -1.")
  tensor = axes.get('tensor', 1)
  tensor = 1 if tensor == -1 else tensor
  fsdp = axes.get('fsdp', -1)
  if fsdp == -1:
    streamed = (replicas * tensor > chips and chips % tensor == 0
                and replicas % (chips // tensor) == 0)
    if chips % (replicas * tensor) and not streamed:
      raise config_lib.ConfigError(
          f'config.cohort_size={replicas} replicas x tensor={tensor} do not divide the '
          f'{chips} chips of the topology, nor are they a multiple of them; choose sizes '
          f'whose product is {chips} or a multiple of it.')
    fsdp = 1 if streamed else chips // (replicas * tensor)
  return fsdp, tensor


def plan_config_pod(config: Any, top: Any, replica_states: str | None = None) -> Any:
  """Plans ``config``'s round on the TPU topology ``top`` (:func:`fedjx.experiments.topology_plan.plan_pod`).

  The model (a ``llama_lm``: only its layout is planned for a pod) is built
  from ``config.model`` and the dataset's ``info`` as ``fedjx-run`` builds
  it; the round is ``config.cohort_size`` replicas of ``config.batch_size``
  sequences of the dataset's length, ``H`` inner steps
  (:func:`fedjx.experiments.experiment.churn_inner_steps`: the network
  section's, ``local_steps`` or the algorithm's), on ``config.mesh``'s
  ``fsdp`` and ``tensor`` (``fsdp`` unset or -1: the chips left; where the replicas
  outnumber the chips, each chip trains several of them one after another,
  as on one chip). DiLoCo
  (:data:`DILOCO`) and FedAvg (:data:`FEDAVG`) are planned. DiLoCo's
  replicas' optimizer states are planned where ``config.client_state.placement``
  puts them (``'auto'``: on the chips), or where ``replica_states`` says
  (``'device'`` or ``'store'``, the host).
  """
  config = config_lib.validate(config)
  name, options = registry.split_name('algorithm', config.algorithm)
  if name not in DILOCO + FEDAVG:
    raise config_lib.ConfigError(
        f'config.algorithm.name={name!r}: --tpu plans the rounds of '
        f'{", ".join(DILOCO + FEDAVG)}.')
  if dict(config.lora or {}).get('rank', 0):
    raise config_lib.ConfigError('config.lora.rank is set: --tpu plans full training '
                                 'of a llama_lm model; plan LoRA without --tpu.')
  data = registry.build_dataset(config.dataset, config.seed)
  model = registry.build_model(config.model, data.info)
  shape = lm_metrics.llama_shape(model)
  seq_len = (data.info or {}).get('max_len')
  if shape is None or not seq_len:
    raise config_lib.ConfigError(
        f'config.model.name={registry.split_name("model", config.model)[0]!r}: --tpu '
        'plans llama_lm models (their layout on fsdp and tensor is known).')
  top = topology_plan.topology(top) if isinstance(top, str) else top
  replicas = int(config.cohort_size)
  fsdp, tensor = _mesh_sizes(config, replicas, top.chips)
  if replica_states is None:
    replica_states = registry.resolve_placement(name, config.client_state.placement)
  outer = dict(options.get('outer_optimizer') or {})
  momentum = outer.get('momentum', options.get('outer_momentum', 0.9))
  return topology_plan.plan_pod(
      shape, top, replicas=replicas, fsdp=fsdp, tensor=tensor,
      batch=int(config.batch_size), seq_len=int(seq_len),
      inner_steps=experiment.churn_inner_steps(config),
      algorithm='diloco' if name in DILOCO else 'fedavg',
      outer_learning_rate=float(outer.get('learning_rate',
                                          options.get('outer_learning_rate', 0.7))),
      outer_momentum=float(momentum) if momentum else None,
      name=dict(config.model).get('preset') or 'custom',
      replica_states='store' if name in DILOCO and replica_states == 'store' else 'device')


__all__ = ['DILOCO', 'FEDAVG', 'RoundPlan', 'device_bytes', 'plan_config', 'plan_config_pod']
