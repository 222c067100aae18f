"""The training loop: config in, trained model, metrics, checkpoints and plot out.

:func:`run` builds the dataset, model and algorithm that a config names (see
:mod:`fedjx.experiments.registry`) and trains for ``config.rounds`` rounds:

* round ``r`` (numbered from 0) trains on the cohort ``sampler.sample(r)``
  with the key ``fold_in(round_key, r)``, where ``round_key`` comes from
  ``config.seed``: everything random in a round is a function of
  ``(seed, r)``, so a resumed run repeats the uninterrupted one exactly;
* after round ``r`` the step is ``r + 1`` (rounds completed); metrics of that
  step go to ``workdir/metrics.jsonl`` (or ``.csv``) and TensorBoard;
* every ``eval_every`` steps (and at steps 0 and ``rounds``) the server model
  is evaluated on held-out data (``eval_loss``, ``eval_accuracy``);
* every ``checkpoint_every`` steps (and at the end, and on SIGINT or
  SIGTERM) an Orbax checkpoint holds the algorithm state and the step; a
  save runs in the background during the next round, which waits for it
  before its metrics are written, so a crash redoes at most
  ``checkpoint_every`` rounds;
* after every round the server parameters are checked to be finite
  (``config.nonfinite``), inside the round's compiled program: a non-finite
  state, or a round in which every client's update was non-finite (nothing
  to aggregate), stops the run with :class:`NonFiniteError` and is never
  checkpointed. Non-finite clients are skipped by the algorithms' guard;
  synchronous algorithms run each round without it first and redo a round
  with it only when the result is not finite
  (:mod:`fedjx.experiments.guarded_rounds`);
* at the end ``workdir/learning_curve.png`` plots the metrics.

Starting again with the same workdir resumes from the newest intact
checkpoint (see :mod:`fedjx.experiments.checkpointing`). One process at a
time may run in a workdir (:mod:`fedjx.experiments.workdir_lock`). Only
process 0 writes metrics and plots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from fedjx import datasets
from fedjx import execution as execution_lib
from fedjx import models
from fedjx.algorithms import nonfinite
from fedjx.experiments import checkpointing
from fedjx.experiments import compile_progress
from fedjx.experiments import config as config_schema
from fedjx.experiments import evaluation
from fedjx.experiments import guarded_rounds
from fedjx.experiments import metrics_writers
from fedjx.experiments import privacy as privacy_lib
from fedjx.experiments import registry
# The config schema lives in fedjx.experiments.config; these names stay
# importable from the runner, where they were documented first.
from fedjx.experiments.config import DEFAULTS  # pylint: disable=unused-import
from fedjx.experiments.config import NONFINITE  # pylint: disable=unused-import
from fedjx.experiments.config import REQUIRED  # pylint: disable=unused-import
from fedjx.experiments.config import RESUMABLE_CHANGES
from fedjx.experiments.config import config_hash  # pylint: disable=unused-import
from fedjx.experiments.config import fingerprint as _fingerprint
from fedjx.experiments.config import flatten as _flatten
from fedjx.experiments.config import validate
from fedjx.experiments.config import with_defaults
from fedjx.experiments.evaluation import make_evaluator  # pylint: disable=unused-import
from fedjx.experiments import workdir_lock

TRAIN_LOSS_KEYS = ('train_loss', 'train_loss_before', 'train_loss_during',
                   'loss')

Hook = Callable[[int, Any, Mapping[str, float]], None]


class NonFiniteError(RuntimeError):
  """The server state (or, with ``nonfinite='stop'``, a client) became NaN/Inf."""


@dataclasses.dataclass
class RunResult:
  """What :func:`run` returns.

  Attributes:
    state: the final algorithm state (``state.params`` is the model).
    step: rounds completed.
    interrupted: True when SIGINT or SIGTERM stopped the run early (a
      checkpoint of ``step`` was saved; running again continues).
    history: the metric rows of the whole run, resumed parts included.
    workdir: the run directory.
    signal: the signal number that interrupted the run, or None.
  """

  state: Any
  step: int
  interrupted: bool
  history: list[dict[str, Any]]
  workdir: str
  signal: int | None = None


@dataclasses.dataclass
class Experiment:
  """The built pieces of a config (see :func:`build`)."""

  config: ml_collections.ConfigDict
  data: registry.ExperimentData
  model: models.Model
  algorithm: Any
  init_params: Any
  round_key: jax.Array
  evaluate: Callable[[Any], dict[str, float]] | None
  systems: datasets.SystemModel | None = None  # config.systems, if any
  # The simulated schedule of an asynchronous algorithm (else None).
  scheduler: datasets.AsyncScheduler | None = None
  # config.sampling's sampler (None: uniform) and the DP accounting plan.
  sampler: Any = None
  privacy: privacy_lib.Plan | None = None

  def cohorts(self, start: int, stop: int) -> Iterator[Any]:
    """Placed cohorts of rounds ``start .. stop - 1`` (prefetched)."""
    c = self.config
    if self.scheduler is not None:
      return datasets.async_cohort_iterator(
          self.data.train, self.scheduler, c.batch_size, start_round=start,
          num_rounds=stop - start, num_epochs=c.local_epochs,
          num_steps=c.local_steps, max_steps=c.max_local_steps,
          bucket=c.bucket_steps, prefetch=c.prefetch)
    return datasets.cohort_iterator(
        self.data.train, c.cohort_size, c.batch_size, seed=c.seed,
        start_round=start, num_rounds=stop - start, num_epochs=c.local_epochs,
        num_steps=c.local_steps, max_steps=c.max_local_steps,
        bucket=c.bucket_steps, prefetch=c.prefetch, sampler=self.sampler,
        order_by_steps=c.map_strategy == 'chunked')

  def system_rounds(self, start: int, stop: int, start_time: float) -> Iterator[Any]:
    """``(cohort, report)`` of rounds ``start .. stop - 1`` under ``config.systems``,
    round ``start`` starting at simulated time ``start_time`` (seconds)."""
    c = self.config
    return datasets.system_cohort_iterator(
        self.data.train, self.systems, c.cohort_size, c.batch_size,
        start_round=start, start_time=start_time, num_rounds=stop - start,
        num_epochs=c.local_epochs, num_steps=c.local_steps,
        max_steps=c.max_local_steps, bucket=c.bucket_steps, prefetch=c.prefetch)

  def lazy_cohorts(self, start: int, stop: int,
                   whole: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Rounds ``start .. stop - 1`` as unloaded cohorts, for streamed rounds.

    Each is a ``fedjx.streaming.Clients`` that reads its clients a chunk at a
    time (``datasets.prefetch.lazy_cohort_iterator``); where ``whole(it)``
    is True the round's cohort is loaded and placed ahead, as
    :meth:`cohorts` gives it.
    """
    c = self.config
    return datasets.prefetch.lazy_cohort_iterator(
        self.data.train, c.cohort_size, c.batch_size, seed=c.seed,
        start_round=start, num_rounds=stop - start, num_epochs=c.local_epochs,
        num_steps=c.local_steps, max_steps=c.max_local_steps,
        bucket=c.bucket_steps, prefetch=c.prefetch, whole=whole,
        sampler=self.sampler)

  def round_key_for(self, r: int) -> jax.Array:
    key = jax.random.fold_in(self.round_key, r)
    mesh = jax.sharding.get_mesh()
    if mesh is not None and not mesh.empty:
      from fedjx import distributed  # pylint: disable=g-import-not-at-top
      key = distributed.put_global(key, mesh)
    return key


def _sample_batch(config: ml_collections.ConfigDict,
                  data: registry.ExperimentData) -> dict[str, np.ndarray]:
  """One client's first batch ``[B, ...]``: shapes and dtypes for model init."""
  cohort = datasets.make_cohort(
      data.train, datasets.CohortSampler(data.train, 1, config.seed).sample(0),
      config.batch_size, num_steps=1, shuffle_seed=None, bucket=False)
  return {k: v[0, 0] for k, v in cohort.batches.items()}


def build_algorithm(config: ml_collections.ConfigDict, model: models.Model,
                    num_clients: int, guarded: bool | None = None) -> Any:
  """The algorithm of ``config`` (defaults filled) for ``model`` and a population.

  ``guarded`` overrides ``config.nonfinite`` for the builder's
  ``skip_nonfinite`` (the runner also builds the unguarded algorithm, see
  :mod:`fedjx.experiments.guarded_rounds`).
  """
  if guarded is None:
    guarded = config.nonfinite != 'off'
  return registry.build_algorithm(
      privacy_lib.algorithm_spec(config, num_clients), model,
      map_strategy=config.map_strategy,
      chunk_size=config.chunk_size, num_clients=num_clients,
      skip_nonfinite=guarded)


def round_algorithms(config: ml_collections.ConfigDict,
                     exp: Experiment) -> tuple[Any, Any | None]:
  """``(guarded, unguarded)``: what the loop runs rounds with.

  ``guarded`` is the experiment's algorithm, whose round also checks the new
  server model when ``config.nonfinite`` is not ``'off'``; ``unguarded`` is
  the same algorithm built without its guard, whose round checks its new
  server model and metrics, where rounds run unguarded first (else None; see
  :mod:`fedjx.experiments.guarded_rounds`).
  """
  if config.nonfinite == 'off':
    return exp.algorithm, None
  guarded = checking_finiteness(exp.algorithm)
  name = config.algorithm.name
  entry = registry.algorithm_entry(name)
  reach = entry.updates_reach_params and 'skip_nonfinite' in entry.runner_options
  if not guarded_rounds.runs_unguarded(exp.algorithm, reach):
    return guarded, None
  unguarded = build_algorithm(config, exp.model, exp.data.train.num_clients,
                              guarded=False)
  return guarded, checking_finiteness(unguarded, whole=True)


def build(config: Any) -> Experiment:
  """Builds the dataset, model, algorithm and evaluator a config names."""
  config = with_defaults(config)
  data = registry.build_dataset(config.dataset, config.seed)
  model = registry.build_model(config.model, data.info)
  if config.cohort_size > data.train.num_clients:
    raise registry.ConfigError(
        f'config.cohort_size={config.cohort_size} is larger than the training '
        f'population of {data.train.num_clients} clients; it must be at most '
        f'{data.train.num_clients}.')
  plan = privacy_lib.plan(config, data.train.num_clients)
  sampler = privacy_lib.make_sampler(config, data.train)
  algorithm = build_algorithm(config, model, data.train.num_clients)
  init_key, round_key = jax.random.split(jax.random.key(config.seed))
  params = model.init(init_key, _sample_batch(config, data))
  examples = evaluation.pool_examples(data.test, config.eval_max_examples)
  evaluate = (evaluation.make_evaluator(model, examples, config.eval_batch_size)
              if examples is not None else None)
  system_model = _system_model(config, data.train.num_clients, params)
  scheduler = async_scheduler(config, data.train, system_model)
  if scheduler is not None:  # The system model supplies its durations only.
    system_model = None
  _check_sampling(config, plan, sampler, system_model, scheduler)
  return Experiment(config, data, model, algorithm, params, round_key, evaluate,
                    systems=system_model, scheduler=scheduler, sampler=sampler,
                    privacy=plan)


def _check_sampling(config: ml_collections.ConfigDict, plan: Any, sampler: Any,
                    system_model: Any, scheduler: Any) -> None:
  """One sampler per run: config.sampling (and DP accounting), the system
  model's availability, or an asynchronous schedule; never two at once."""
  if plan is None and sampler is None:
    return
  if scheduler is not None:
    raise registry.ConfigError(
        f'config.algorithm.name={config.algorithm.name!r} is asynchronous: its '
        'clients come from its schedule, so config.sampling and differential '
        "privacy's accounting do not apply; leave config.sampling uniform and "
        'use a synchronous algorithm for a DP run.')
  if system_model is not None:
    raise registry.ConfigError(
        'config.systems chooses clients by availability and drops some, which '
        'config.sampling and the privacy accountant do not model; use '
        'config.systems={} for a DP run or a non-DP algorithm with '
        'config.sampling uniform.')


def _system_model(config: ml_collections.ConfigDict, num_clients: int,
                  params: Any) -> datasets.SystemModel | None:
  """``config.systems`` as a system model (its model bytes: ``params``'), or None."""
  try:
    model = datasets.systems.from_config(
        config.systems, num_clients, config.seed,
        model_bytes=sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)))
  except ValueError as e:
    raise registry.ConfigError(f'config.{e}') from None
  if model is None:
    return None
  if jax.process_count() > 1:
    raise registry.ConfigError('config.systems is set; the system model runs '
                               'in single-process runs only.')
  algo = registry.split_name('algorithm', config.algorithm)[1]
  if model.deadline.late == 'partial' and (
      algo.get('local_steps') is not None or algo.get('local_epochs', 1) != 1):
    raise registry.ConfigError(
        "config.systems.deadline.late='partial' masks a client's later steps "
        'in the cohort, so the algorithm must run each cohort step once: '
        'leave algorithm.local_steps and local_epochs unset and give '
        'config.local_epochs or config.local_steps instead.')
  return model


def async_scheduler(config: ml_collections.ConfigDict, train: Any,
                    systems: datasets.SystemModel | None = None
                    ) -> datasets.AsyncScheduler | None:
  """The schedule of an asynchronous algorithm (its registry entry's ``asynchronous``).

  ``K = config.cohort_size`` updates per server step; the concurrency ``M``
  (``config.algorithm.concurrency``, default ``K``) and the duration model
  (``config.algorithm.client_durations``) come from the algorithm's entry,
  or the durations from ``config.systems`` (``systems``): a client's
  communication time plus its local steps (as its cohort would hold them)
  times its step time. ``train`` is the training population (or, without
  ``systems``, its number of clients).
  """
  name, spec = registry.split_name('algorithm', config.algorithm)
  if not registry.is_asynchronous(name):
    return None
  num_clients = train if isinstance(train, int) else train.num_clients
  k = config.cohort_size
  config_schema.check_asynchronous(config, name, spec)
  if spec.get('buffer_size') not in (None, k):
    raise registry.ConfigError(
        f'config.algorithm.buffer_size={spec["buffer_size"]} differs from '
        f'config.cohort_size={k}; a server step takes cohort_size updates.')
  if systems is not None and spec.get('client_durations') is not None:
    raise registry.ConfigError(
        f'config.algorithm.client_durations and config.systems are both set '
        f'for {name!r}; give one of them.')
  try:
    if systems is not None:
      duration = _system_durations(config, train, systems)
    else:
      duration = datasets.async_schedule.make_durations(
          spec.get('client_durations'), num_clients, config.seed)
    return datasets.AsyncScheduler(num_clients, spec.get('concurrency') or k, k,
                                   duration, seed=config.seed)
  except ValueError as e:
    raise registry.ConfigError(f'config.algorithm ({name}): {e}') from None


def _system_durations(config: ml_collections.ConfigDict, train: Any,
                      systems: datasets.SystemModel) -> Callable[[int, float], float]:
  """``duration(client_id, start_time)`` of ``systems`` for the cohort steps
  each client gets under ``config``."""
  def duration(client_id: int, start_time: float) -> float:
    steps = datasets.cohort_steps(
        train, [client_id], config.batch_size, num_epochs=config.local_epochs,
        num_steps=config.local_steps, max_steps=config.max_local_steps,
        bucket=False)
    return systems.duration(client_id, start_time, steps)
  return duration


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
  """Turns the first SIGINT or SIGTERM into a flag the loop polls.

  SIGTERM is how clusters and preemptible VMs stop a job; it is treated like
  Ctrl-C: the current round finishes, a checkpoint is saved, the run ends. A
  second signal aborts at once (KeyboardInterrupt).
  """

  def __init__(self):
    self.signum: int | None = None

  @property
  def raised(self) -> bool:
    return self.signum is not None

  def _handle(self, signum, frame):
    del frame
    if self.raised:
      raise KeyboardInterrupt
    self.signum = signum

  @contextlib.contextmanager
  def installed(self) -> Iterator[StopFlag]:
    import threading  # pylint: disable=g-import-not-at-top
    if threading.current_thread() is not threading.main_thread():
      yield self  # Signals reach only the main thread.
      return
    previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
    try:
      yield self
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)


# The runner's checks of finiteness (see fedjx.experiments.guarded_rounds).
_all_finite = guarded_rounds.all_finite
PARAMS_FINITE = guarded_rounds.PARAMS_FINITE
checking_finiteness = guarded_rounds.checking_finiteness


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  from fedjx import distributed  # pylint: disable=g-import-not-at-top
  out = {}
  for k, v in distributed.to_host(dict(metrics)).items():
    arr = np.asarray(v)
    if arr.size == 1:
      out[k] = float(arr.reshape(()))
  return out


def _train_loss(row: Mapping[str, Any]) -> float | None:
  for key in TRAIN_LOSS_KEYS:
    if key in row:
      return row[key]
  return None


def _log_above(bar: Any, log: Callable[[str], None], msg: str) -> None:
  """``log(msg)`` with the progress bar cleared first and drawn again after."""
  bar.clear()
  log(msg)
  bar.refresh()


def _progress(total: int, initial: int, enabled: bool):
  from tqdm import auto as tqdm  # pylint: disable=g-import-not-at-top
  return tqdm.tqdm(total=total, initial=initial, unit='round', disable=not enabled,
                   dynamic_ncols=True, file=sys.stderr)


def run(config: Any, workdir: str, *, hooks: Sequence[Hook] = (),
        log: Callable[[str], None] | None = None) -> RunResult:
  """Trains the experiment of ``config`` in ``workdir``, resuming if possible.

  Args:
    config: an ``ml_collections.ConfigDict`` (or dict) with ``dataset``,
      ``model``, ``algorithm`` and the fields of :data:`DEFAULTS`.
    workdir: where checkpoints, metrics, event files and the plot go. If it
      holds a checkpoint of the same experiment, training continues from it.
    hooks: ``hook(step, state, row)`` called after every round (after its
      metrics are written and any checkpoint is started).
    log: where to print one-line messages (default: stderr on process 0).

  Returns:
    A :class:`RunResult`.
  """
  config = validate(config)
  from fedjx import distributed  # pylint: disable=g-import-not-at-top
  _check_coordinator_port(config)
  distributed.initialize(config.coordinator_address or None, config.num_processes,
                         config.process_id)
  lead = jax.process_index() == 0
  if log is None:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if lead else (
        lambda msg: None)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  mesh = make_mesh(config)
  with contextlib.ExitStack() as stack:
    if lead:
      stack.enter_context(workdir_lock.hold(workdir))
    if mesh is not None:
      stack.enter_context(jax.set_mesh(mesh))
    return _run(config, workdir, hooks, log, lead)


def make_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh | None:
  """The device mesh of ``config.mesh``, e.g. ``'clients=-1'`` or ``'clients=4,model=2'``.

  Axis names and sizes over all devices (-1: the devices left over). With a
  ``clients`` axis, cohorts are sharded over it (each device trains its slice
  of the clients); ``cohort_size`` must be a multiple of its size.
  """
  if not config.mesh:
    return None
  from fedjx import distributed  # pylint: disable=g-import-not-at-top
  _check_devices_per_process(config.mesh)
  axes = {}
  for item in str(config.mesh).split(','):
    name, sep, size = item.partition('=')
    try:
      axes[name.strip()] = int(size)
    except ValueError:
      raise registry.ConfigError(
          f'config.mesh={config.mesh!r}: write axis sizes as '
          "'clients=-1' or 'clients=4,model=2'.") from None
  return distributed.make_mesh(axes)


def _check_coordinator_port(config: ml_collections.ConfigDict) -> None:
  """Process 0 of a multi-process run serves the coordinator: refuses a port
  on this machine that another program holds, before JAX tries to bind it."""
  import socket  # pylint: disable=g-import-not-at-top
  from fedjx import distributed  # pylint: disable=g-import-not-at-top
  address = config.coordinator_address or os.environ.get(distributed.ENV_COORDINATOR, '')
  pid = config.process_id
  if pid is None:
    pid = os.environ.get(distributed.ENV_PROCESS_ID, '0')
  host, _, port = address.rpartition(':')
  if str(pid) != '0' or not port.isdigit() or host not in (
      'localhost', '127.0.0.1', '0.0.0.0', '[::]', socket.gethostname()):
    return
  with socket.socket() as s:
    try:
      s.bind(('' if host in ('0.0.0.0', '[::]') else host, int(port)))
    except OSError as e:
      raise registry.ConfigError(
          f'the coordinator address {address!r} (config.coordinator_address or '
          f'{distributed.ENV_COORDINATOR}) cannot be served by process 0: port '
          f'{port} is in use on this machine ({e.strerror}); choose a free '
          'port.') from None


def _check_devices_per_process(mesh: str) -> None:
  """A mesh spans every process's devices alike: refuses processes whose
  device counts differ, naming each process's count."""
  counts: dict[int, int] = {}
  for device in jax.devices():
    counts[device.process_index] = counts.get(device.process_index, 0) + 1
  if len(set(counts.values())) > 1:
    each = ', '.join(f'process {p} has {n}' for p, n in sorted(counts.items()))
    raise registry.ConfigError(
        f'config.mesh={mesh!r} spans {sum(counts.values())} devices of '
        f'{len(counts)} processes whose device counts differ ({each}); start '
        'every process with the same number of devices (e.g. the same '
        '--xla_force_host_platform_device_count, or as many GPUs each).')


def _run(config: ml_collections.ConfigDict, workdir: str, hooks: Sequence[Hook],
         log: Callable[[str], None], lead: bool) -> RunResult:
  """The body of :func:`run`, inside the mesh context if there is one."""
  exp = build(config)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                    max_to_keep=max(2, config.checkpoints_to_keep))
  try:
    return _train(config, workdir, hooks, log, lead, exp, ckpt)
  finally:
    ckpt.close()


def _train(config: ml_collections.ConfigDict, workdir: str, hooks: Sequence[Hook],
           log: Callable[[str], None], lead: bool, exp: Experiment,
           ckpt: checkpointing.Checkpointer) -> RunResult:
  """Restores the newest intact checkpoint (if any) and trains to the end."""
  from fedjx import distributed  # pylint: disable=g-import-not-at-top

  def initial_state() -> Any:
    fresh = exp.algorithm.init(exp.init_params)
    mesh = jax.sharding.get_mesh()
    if mesh is not None and not mesh.empty:
      # Global arrays over every process's devices: replicated, or FSDP-sharded
      # on the 'model' axis (each client's model spans the model axis).
      fresh = distributed.put_global(
          fresh, mesh, distributed.state_specs(fresh, mesh, config.param_sharding))
    return fresh

  state = initial_state()
  fingerprint = _fingerprint(config)
  start, elapsed_before = 0, 0.0
  clock = 0.0  # config.systems: the simulated time (s) at the start of `start`
  try:
    restored = ckpt.restore_latest_intact(
        state, lambda m: _check_same_experiment(m.get('config', {}), fingerprint,
                                                workdir), warn=log)
  except checkpointing.StructureMismatch as e:
    raise registry.ConfigError(f'{e} Use a new --workdir, or delete '
                               f'{workdir}.') from None
  if restored is not None:
    state, saved_meta = restored
    start = int(saved_meta['step'])
    elapsed_before = float(saved_meta.get('elapsed_s', 0.0))
    clock = float(saved_meta.get('simulated_time', 0.0))
    log(f'fedjx: resuming {workdir} from the checkpoint after round {start}.')
  if lead:
    metrics_writers.write_atomically(
        os.path.join(workdir, 'config.json'),
        config.to_json_best_effort(indent=2, sort_keys=True) + '\n')
  writer = metrics_writers.make_writer(
      workdir, config.metrics_format, config.tensorboard and lead,
      resume_round=start if restored is not None else None) if lead else (
          metrics_writers.MultiWriter([]))
  history = _previous_rows(workdir, config.metrics_format, start) if (
      lead and restored is not None) else []
  t0 = time.perf_counter()
  elapsed = lambda: elapsed_before + time.perf_counter() - t0

  def meta(step: int) -> dict[str, Any]:
    return {'step': step, 'next_round': step, 'seed': config.seed,
            'round_key': np.asarray(jax.random.key_data(exp.round_key)).tolist(),
            'elapsed_s': elapsed(), 'config': fingerprint,
            **({'simulated_time': clock} if exp.systems is not None else {})}

  def emit(step: int, row: dict[str, float]) -> None:
    row = dict(row, elapsed_s=round(elapsed(), 4))
    writer.write(step, row)
    history.append({'round': step, **row})

  plan = exp.privacy
  # The last round to run: config.rounds, or the last within the budget.
  stop = config.rounds if plan is None else plan.stop_round()
  if plan is not None and lead:
    privacy_lib.write_statement(workdir, plan, stop)
    log(f'fedjx: privacy: {plan.summary(stop)}.')

  interrupted = False
  audit = None  # config.privacy.audit's, after the last round
  step = start
  saved = start if restored is not None else None  # the last good checkpoint
  pending = False  # a save is being written in the background
  last_row: dict[str, float] = {}
  bar = _progress(config.rounds, start, lead and config.progress)
  try:
    with StopFlag().installed() as sigint:
      if start == 0 and exp.evaluate is not None:
        emit(0, dict(exp.evaluate(state.params), **(
            {'simulated_time': 0.0} if exp.systems is not None or
            exp.scheduler is not None else {})))
      if start < stop:
        # Rounds run unguarded first where that is cheaper, and are redone
        # guarded when their result is not finite (guarded_rounds).
        checked = config.nonfinite != 'off'
        guarded, unguarded = round_algorithms(config, exp)
        make_runner = lambda algorithm: execution_lib.round_runner(
            algorithm, config.execution, config_schema.streaming_chunk(config), log)
        run_round, run_guarded = make_runner(unguarded or guarded), None
        redone: set[int] = set()  # rounds of this process redone guarded

        def cohorts_from(first: int, last: int, at: float, like: Any) -> Iterator[Any]:
          """Cohorts of rounds ``first .. last - 1``, the first at simulated time ``at``."""
          if exp.systems is not None:  # Cohorts closed by the system model.
            return exp.system_rounds(first, last, at)
          if getattr(run_round, 'may_stream', False) and exp.scheduler is None:
            # Clients are read a chunk at a time.
            return exp.lazy_cohorts(first, last, run_round.loads_whole(
                like, exp.round_key_for(first)))
          return exp.cohorts(first, last)

        def state_before(r: int) -> Any:
          """The state before round ``r``, rebuilt as a resumed run rebuilds it:
          the last checkpoint (or the initial state), then the rounds since,
          each run as it was (unguarded, or redone guarded)."""
          nonlocal pending
          if pending:
            ckpt.wait()
            pending = False
          base, first, at = initial_state(), 0, 0.0
          if saved is not None:
            base, base_meta = ckpt.restore(saved, base)
            first, at = saved, float(base_meta.get('simulated_time', 0.0))
          replay = cohorts_from(first, r, at, base)
          try:
            for rr, again in zip(range(first, r), replay):
              again = again[0] if exp.systems is not None else again
              base, _ = (run_guarded if rr in redone else run_round)(
                  base, again, exp.round_key_for(rr))
          finally:
            replay.close()
          return base

        # The first cohort's fetch (execution='auto': the memory plan) and
        # the first round compile.
        # Progress, like the bar: shown with config.progress (a quiet run
        # logs only what happened to it).
        announce = (lambda m: _log_above(bar, log, m)) if (
            lead and config.progress) else (lambda m: None)
        announce(compile_progress.compiling_message(config))
        compile_t0 = time.perf_counter()
        compiling = contextlib.ExitStack()  # closed after the first round
        compiling.enter_context(compile_progress.slow_compile_notice_as_progress())
        cohorts = cohorts_from(start, stop, clock, state)
        try:
          for r, cohort in zip(range(start, stop), cohorts):
            report = None
            if exp.systems is not None:
              cohort, report = cohort
            if r == start:  # The first round compiles: timed.
              state, metrics = run_round(state, cohort, exp.round_key_for(r))
              jax.block_until_ready(metrics)
              compiling.close()
              announce(compile_progress.compiled_message(
                  time.perf_counter() - compile_t0))
            else:
              state, metrics = run_round(state, cohort, exp.round_key_for(r))
            if checked and PARAMS_FINITE not in metrics and (
                guarded_rounds.RESULT_FINITE not in metrics):  # Not compiled.
              metrics = dict(metrics, **{PARAMS_FINITE: _all_finite(state.params)})
            if pending:  # The round runs meanwhile (JAX dispatch is async).
              ckpt.wait()
              pending = False
            step = r + 1
            row = _scalars(metrics)
            if row.pop(guarded_rounds.RESULT_FINITE, 1.0) != 1.0:
              # Not finite unguarded: the round again, with the guard.
              run_guarded = run_guarded or make_runner(guarded)
              state, metrics = run_guarded(state_before(r), cohort,
                                           exp.round_key_for(r))
              redone.add(r)
              row = _scalars(metrics)
            elif unguarded is not None:  # No client would have been skipped.
              row = dict(sorted({**row, nonfinite.METRIC: 0.0}.items()))
            finite = not checked or row.pop(PARAMS_FINITE, 1.0) == 1.0
            if report is not None:  # The system model's clock and counts.
              row.update(report.metrics())
              clock = report.end_time
            if exp.scheduler is not None:
              row['simulated_time'] = exp.scheduler.step(r).time
            if exp.evaluate is not None and finite and (
                step % config.eval_every == 0 or step in (config.rounds, stop)):
              row.update(exp.evaluate(state.params))
            if plan is not None and (plan.accountant == 'rdp' or step == stop
                                     or step % config.eval_every == 0):
              row['epsilon'] = plan.epsilon(step)  # PLD: at evaluations only
            if plan is not None and plan.canaries is not None and (
                step == stop and finite):
              audit = privacy_lib.run_audit(plan, step, exp.init_params,
                                            state.params)
              row.update(privacy_lib.audit_metrics(audit))
            emit(step, row)
            bad = row.get('nonfinite_clients', 0)
            if bool(guarded_rounds.must_stop(finite, bad, row.get('clients', bad),
                                             config.nonfinite)):
              writer.flush()
              raise NonFiniteError(_nonfinite_message(step, row, finite, saved))
            last_row.update(row)
            postfix = {'loss': _train_loss(last_row)}
            if 'eval_accuracy' in last_row:
              postfix['eval_acc'] = last_row['eval_accuracy']
            bar.set_postfix({k: f'{v:.4f}' for k, v in postfix.items()
                             if v is not None}, refresh=False)
            bar.update(1)
            if step % config.checkpoint_every == 0 or step in (config.rounds, stop):
              writer.flush()
              ckpt.save(step, state, meta(step))
              saved, pending = step, True
            for hook in hooks:
              hook(step, state, row)
            if sigint.raised:
              interrupted = step < stop
              break
        finally:
          compiling.close()
          cohorts.close()
      if stop < config.rounds and step == stop and not interrupted:
        log(privacy_lib.budget_message(plan, stop))
      if plan is not None and lead and step != stop:
        privacy_lib.write_statement(workdir, plan, step)  # interrupted early
      if plan is not None and plan.canaries is not None and step == stop:
        if audit is None:  # Resumed after the last round: the saved model.
          audit = privacy_lib.run_audit(plan, step, exp.init_params,
                                        state.params)
        if lead:
          privacy_lib.write_statement(workdir, plan, step, audit)
          log(f"fedjx: privacy audit: {audit['statement']}")
      if interrupted:
        writer.flush()
        ckpt.save(step, state, meta(step), force=True)
        ckpt.wait()
        name = signal.Signals(sigint.signum).name
        log(f'fedjx: interrupted after round {step} ({name}); checkpoint saved in '
            f'{workdir}. Run the same command again to continue.')
  finally:
    bar.close()
    writer.close()
    ckpt.wait()
  if lead and config.plot and not interrupted and history:
    from fedjx.experiments import plotting  # pylint: disable=g-import-not-at-top  # matplotlib is slow to import
    plotting.plot_curves({os.path.basename(workdir): history},
                         os.path.join(workdir, 'learning_curve.png'),
                         title=_title(config))
  return RunResult(state, step, interrupted, history, workdir,
                   sigint.signum if interrupted else None)


def _nonfinite_message(step: int, row: Mapping[str, Any], finite: bool,
                       saved: int | None) -> str:
  """One line: the round (as in the metrics file), what was non-finite, and
  the last good checkpoint."""
  count = int(row.get('nonfinite_clients', 0))
  if finite and count and row.get('clients', 0) == 0:
    what = (f'every client ({count}) had a NaN or Inf update or weight, so '
            'nothing could be aggregated')
  elif finite:
    what = (f"{count} client(s) had a non-finite update or weight "
            "(config.nonfinite='stop')")
  else:
    what = 'the server parameters became NaN or Inf'
    if count:
      what += f' ({count} non-finite client(s) were skipped)'
  where = ('no checkpoint was saved' if saved is None else
           f'the last good checkpoint is the one after round {saved}')
  return f'round {step}: {what}; stopped without saving this state; {where}.'


def _title(config: ml_collections.ConfigDict) -> str:
  return (f'{config.algorithm.name} / {config.dataset.name} / '
          f'{config.model.name}')


def _previous_rows(workdir: str, fmt: str, upto: int) -> list[dict[str, Any]]:
  path = metrics_writers.metrics_path(workdir, fmt)
  if not os.path.exists(path):
    return []
  return [r for r in metrics_writers.read_metrics(path) if r['round'] <= upto]


def _check_same_experiment(saved: Mapping[str, Any], current: Mapping[str, Any],
                           workdir: str) -> None:
  if not saved:
    return
  a, b = _flatten(saved), _flatten(current)
  # Fields added to the runner after the checkpoint was written compare equal
  # when the current config leaves them at their default.
  defaults = {k: v for k, v in _flatten(DEFAULTS).items() if k not in a}
  diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                and not (k in defaults and b.get(k) == defaults[k]))
  if diff:
    details = ', '.join(f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in diff[:8])
    raise registry.ConfigError(
        f'{workdir} holds a checkpoint of a different experiment ({details}). '
        f'Use a new --workdir, or delete {workdir}. Fields that may change on '
        f'resumption: {list(RESUMABLE_CHANGES)}.')


def load_state(workdir: str, step: int | None = None) -> tuple[Any, int]:
  """The algorithm state saved in ``workdir`` (latest step unless given).

  Rebuilds the experiment from ``workdir/config.json`` for the state's
  structure, then restores the checkpoint. Returns ``(state, step)``.
  """
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  exp = build(config)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'{workdir} holds no checkpoint.')
    like = exp.algorithm.init(exp.init_params)
    state, meta = ckpt.restore(step, like)
    expected = meta.get('checksum')
    if expected is not None and checkpointing.checksum(state) != expected:
      raise checkpointing.CheckpointError(
          f'the checkpoint of step {step} in {workdir} does not match its '
          'checksum (the files were altered or damaged).')
  finally:
    ckpt.close()
  return state, step
