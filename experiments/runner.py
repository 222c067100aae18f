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
* every ``checkpoint_every`` steps (and at the end, and on SIGINT) an Orbax
  checkpoint holds the algorithm state and the step;
* at the end ``workdir/learning_curve.png`` plots the metrics.

Starting again with the same workdir resumes from the latest checkpoint.
Only process 0 writes metrics and plots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjx import datasets
from fedjx import execution as execution_lib
from fedjx import models
from fedjx.experiments import checkpointing
from fedjx.experiments import metrics_writers
from fedjx.experiments import plotting
from fedjx.experiments import registry

# Top-level config fields and their defaults. ``dataset``, ``model`` and
# ``algorithm`` are required.
DEFAULTS: dict[str, Any] = {
    'seed': 0,
    'rounds': 100,
    'cohort_size': 10,
    'batch_size': 20,
    'local_epochs': None,       # passes over each client's data per round
    'local_steps': None,        # or exactly this many batches per round
    'max_local_steps': None,    # upper bound on batches per client
    'bucket_steps': True,       # pad steps to a power of two (fewer compiles)
    'eval_every': 10,
    'eval_batch_size': 256,
    'eval_max_examples': 100_000,
    'checkpoint_every': 50,
    'checkpoints_to_keep': 2,
    'map_strategy': 'auto',
    'chunk_size': None,
    'execution': 'auto',        # 'jit' | 'streaming' | 'auto' (fedjx.execution)
    'metrics_format': 'jsonl',
    'tensorboard': True,
    'plot': True,
    'progress': True,
    'prefetch': 1,
    'mesh': '',                 # e.g. 'clients=-1': shard cohorts over devices
    'param_sharding': 'replicated',  # or 'fsdp': server state sharded on 'model'
    'coordinator_address': '',  # multi-process runs: 'host:port' of process 0
    'num_processes': None,
    'process_id': None,
}
REQUIRED = ('dataset', 'model', 'algorithm')
# Fields a resumed run may change without changing its results.
RESUMABLE_CHANGES = ('rounds', 'eval_every', 'checkpoint_every', 'progress',
                     'plot', 'tensorboard', 'prefetch', 'checkpoints_to_keep',
                     'mesh', 'param_sharding', 'coordinator_address',
                     'num_processes', 'process_id', 'execution')

TRAIN_LOSS_KEYS = ('train_loss', 'train_loss_before', 'train_loss_during',
                   'loss')

Hook = Callable[[int, Any, Mapping[str, float]], None]


@dataclasses.dataclass
class RunResult:
  """What :func:`run` returns.

  Attributes:
    state: the final algorithm state (``state.params`` is the model).
    step: rounds completed.
    interrupted: True when SIGINT stopped the run early (a checkpoint of
      ``step`` was saved; running again continues).
    history: the metric rows of the whole run, resumed parts included.
    workdir: the run directory.
  """

  state: Any
  step: int
  interrupted: bool
  history: list[dict[str, Any]]
  workdir: str


def with_defaults(config: Any) -> ml_collections.ConfigDict:
  """A copy of ``config`` with every default filled in, checked for unknown fields."""
  config = ml_collections.ConfigDict(
      config.to_dict() if hasattr(config, 'to_dict') else dict(config))
  valid = sorted(set(DEFAULTS) | set(REQUIRED))
  for key in config.keys():
    if key not in valid:
      raise registry.ConfigError(
          f'unknown config field {key!r}.{registry._suggest(key, valid)} '  # pylint: disable=protected-access
          f'Valid top-level fields: {valid}.')
  for key in REQUIRED:
    if key not in config:
      raise registry.ConfigError(f'config.{key} is required (a dict with a "name" '
                                 f'key); valid names: {_names(key)}.')
  with config.unlocked():
    for key, value in DEFAULTS.items():
      if key not in config:
        setattr(config, key, value)
  for key in ('rounds', 'cohort_size', 'batch_size', 'eval_every',
              'checkpoint_every', 'eval_batch_size'):
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < (
        0 if key == 'rounds' else 1):
      raise registry.ConfigError(f'config.{key}={value!r}; it must be a '
                                 f'{"non-negative" if key == "rounds" else "positive"} int.')
  if config.param_sharding not in ('replicated', 'fsdp'):
    raise registry.ConfigError(f'config.param_sharding={config.param_sharding!r} '
                               "is not one of ('replicated', 'fsdp').")
  if config.metrics_format not in metrics_writers.FORMATS:
    raise registry.ConfigError(f'config.metrics_format={config.metrics_format!r} '
                               f'is not one of {metrics_writers.FORMATS}.')
  return config


def validate(config: Any) -> ml_collections.ConfigDict:
  """Checks a config without loading data: fields, names and their options.

  Returns the config with defaults filled in; raises :class:`ConfigError`
  naming the first problem and listing what is valid.
  """
  config = with_defaults(config)
  for kind, table in (('dataset', registry.DATASETS), ('model', registry.MODELS)):
    name, kwargs = registry.split_name(kind, config[kind])
    registry.check_kwargs(kind, name, registry.lookup(kind, table, name), kwargs)
  name, kwargs = registry.split_name('algorithm', config.algorithm)
  fn = registry.lookup('algorithm', registry.ALGORITHMS, name)
  registry.check_kwargs('algorithm', name, fn, kwargs,
                        ('loss_fn', 'metrics_fn', 'map_strategy', 'chunk_size'),
                        registry.forwarded_builder(name))
  for key, value in kwargs.items():
    if key.endswith('optimizer') and isinstance(value, Mapping):
      registry.build_optimizer(value, where=f'algorithm.{key}')
  if config.execution not in execution_lib.EXECUTIONS:
    raise registry.ConfigError(f'config.execution={config.execution!r} is not one of '
                      f'{execution_lib.EXECUTIONS}.')
  return config


def _names(key: str) -> list[str]:
  table = {'dataset': registry.DATASETS, 'model': registry.MODELS,
           'algorithm': registry.ALGORITHMS}[key]
  return sorted(table)


def _fingerprint(config: ml_collections.ConfigDict) -> dict[str, Any]:
  d = json.loads(config.to_json_best_effort(sort_keys=True))
  for key in RESUMABLE_CHANGES:
    d.pop(key, None)
  return d


def _flatten(d: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


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

  def cohorts(self, start: int, stop: int) -> Iterator[Any]:
    """Placed cohorts of rounds ``start .. stop - 1`` (prefetched)."""
    c = self.config
    return datasets.cohort_iterator(
        self.data.train, c.cohort_size, c.batch_size, seed=c.seed,
        start_round=start, num_rounds=stop - start, num_epochs=c.local_epochs,
        num_steps=c.local_steps, max_steps=c.max_local_steps,
        bucket=c.bucket_steps, prefetch=c.prefetch)

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


def _pool_examples(test: Any, limit: int) -> dict[str, np.ndarray] | None:
  """Held-out data as one dict of arrays (held-out clients are concatenated)."""
  if test is None:
    return None
  if isinstance(test, Mapping):
    out = {k: np.asarray(v)[:limit] for k, v in test.items()}
  else:  # A FederatedDataset of held-out clients.
    parts, total = [], 0
    for cid in range(test.num_clients):
      part = test.client_data(cid)
      parts.append(part)
      total += len(next(iter(part.values())))
      if total >= limit:
        break
    out = {k: np.concatenate([p[k] for p in parts])[:limit] for k in parts[0]}
  if not out or len(next(iter(out.values()))) == 0:
    return None
  return out


def make_evaluator(model: models.Model, examples: Mapping[str, np.ndarray],
                   batch_size: int) -> Callable[[Any], dict[str, float]]:
  """``evaluate(params) -> {'eval_loss', 'eval_<metric>'...}`` over ``examples``.

  Example-weighted means of the model's evaluation loss and metrics (no
  dropout) over every held-out example, computed batch by batch with
  ``lax.map`` in one compiled call.
  """
  n = len(next(iter(examples.values())))
  batch_size = min(batch_size, n)
  batches, mask = datasets.eval_batches(dict(examples), batch_size)
  batches = jax.device_put(batches)
  mask = jax.device_put(mask)

  @jax.jit
  def sums(params, batches, mask):
    def one(inputs):
      batch, m = inputs
      m = m.astype(jnp.float32)
      values = dict(model.metrics_fn(params, batch))
      values['loss'] = model.eval_loss_fn(params, batch)
      return {k: jnp.sum(v * m) for k, v in values.items()}, jnp.sum(m)
    totals, counts = jax.lax.map(one, (batches, mask))
    count = jnp.maximum(jnp.sum(counts), 1.0)
    return {k: jnp.sum(v) / count for k, v in totals.items()}

  def evaluate(params) -> dict[str, float]:
    from fedjx import distributed  # pylint: disable=g-import-not-at-top
    out = jax.device_get(sums(distributed.to_host(params), batches, mask))
    return {f'eval_{k}': float(v) for k, v in sorted(out.items())}

  return evaluate


def build(config: Any) -> Experiment:
  """Builds the dataset, model, algorithm and evaluator a config names."""
  config = with_defaults(config)
  data = registry.build_dataset(config.dataset, config.seed)
  model = registry.build_model(config.model, data.info)
  algorithm = registry.build_algorithm(
      config.algorithm, model, map_strategy=config.map_strategy,
      chunk_size=config.chunk_size, num_clients=data.train.num_clients)
  init_key, round_key = jax.random.split(jax.random.key(config.seed))
  params = model.init(init_key, _sample_batch(config, data))
  examples = _pool_examples(data.test, config.eval_max_examples)
  evaluate = (make_evaluator(model, examples, config.eval_batch_size)
              if examples is not None else None)
  return Experiment(config, data, model, algorithm, params, round_key, evaluate)


class _SigintFlag:
  """Turns the first SIGINT into a flag the loop polls; a second one aborts."""

  def __init__(self):
    self.raised = False
    self._previous = None

  def _handle(self, signum, frame):
    del signum, frame
    if self.raised:
      raise KeyboardInterrupt
    self.raised = True

  @contextlib.contextmanager
  def installed(self) -> Iterator[_SigintFlag]:
    import threading  # pylint: disable=g-import-not-at-top
    if threading.current_thread() is not threading.main_thread():
      yield self  # Signals reach only the main thread.
      return
    self._previous = signal.signal(signal.SIGINT, self._handle)
    try:
      yield self
    finally:
      signal.signal(signal.SIGINT, self._previous)


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
  config = with_defaults(config)
  from fedjx import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(config.coordinator_address or None, config.num_processes,
                         config.process_id)
  lead = jax.process_index() == 0
  if log is None:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if lead else (
        lambda msg: None)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  mesh = make_mesh(config)
  if mesh is not None:
    with jax.set_mesh(mesh):
      return _run(config, workdir, hooks, log, lead)
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


def _run(config: ml_collections.ConfigDict, workdir: str, hooks: Sequence[Hook],
         log: Callable[[str], None], lead: bool) -> RunResult:
  """The body of :func:`run`, inside the mesh context if there is one."""
  exp = build(config)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                    max_to_keep=config.checkpoints_to_keep)
  state = exp.algorithm.init(exp.init_params)
  mesh = jax.sharding.get_mesh()
  if mesh is not None and not mesh.empty:
    # Global arrays over every process's devices: replicated, or FSDP-sharded
    # on the 'model' axis (each client's model spans the model axis).
    from fedjx import distributed  # pylint: disable=g-import-not-at-top
    state = distributed.put_global(
        state, mesh, distributed.state_specs(state, mesh, config.param_sharding))
  fingerprint = _fingerprint(config)
  start, elapsed_before = 0, 0.0
  latest = ckpt.latest_step()
  if latest is not None:
    state, meta = ckpt.restore(latest, state)
    _check_same_experiment(meta.get('config', {}), fingerprint, workdir)
    start, elapsed_before = int(meta['step']), float(meta.get('elapsed_s', 0.0))
    log(f'fedjx: resuming {workdir} from the checkpoint after round {start}.')
  if lead:
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True) + '\n')
  writer = metrics_writers.make_writer(
      workdir, config.metrics_format, config.tensorboard and lead,
      resume_round=start if latest is not None else None) if lead else (
          metrics_writers.MultiWriter([]))
  history = _previous_rows(workdir, config.metrics_format, start) if (
      lead and latest is not None) else []
  t0 = time.perf_counter()
  elapsed = lambda: elapsed_before + time.perf_counter() - t0

  def meta(step: int) -> dict[str, Any]:
    return {'step': step, 'next_round': step, 'seed': config.seed,
            'round_key': np.asarray(jax.random.key_data(exp.round_key)).tolist(),
            'elapsed_s': elapsed(), 'config': fingerprint}

  def emit(step: int, row: dict[str, float]) -> None:
    row = dict(row, elapsed_s=round(elapsed(), 4))
    writer.write(step, row)
    history.append({'round': step, **row})

  interrupted = False
  step = start
  last_row: dict[str, float] = {}
  bar = _progress(config.rounds, start, lead and config.progress)
  try:
    with _SigintFlag().installed() as sigint:
      if start == 0 and exp.evaluate is not None:
        emit(0, exp.evaluate(state.params))
      if start < config.rounds:
        cohorts = exp.cohorts(start, config.rounds)
        run_round = execution_lib.round_runner(exp.algorithm, config.execution,
                                               config.chunk_size, log)
        try:
          for r, cohort in zip(range(start, config.rounds), cohorts):
            state, metrics = run_round(state, cohort, exp.round_key_for(r))
            step = r + 1
            row = _scalars(metrics)
            if exp.evaluate is not None and (step % config.eval_every == 0 or
                                             step == config.rounds):
              row.update(exp.evaluate(state.params))
            emit(step, row)
            last_row.update(row)
            postfix = {'loss': _train_loss(last_row)}
            if 'eval_accuracy' in last_row:
              postfix['eval_acc'] = last_row['eval_accuracy']
            bar.set_postfix({k: f'{v:.4f}' for k, v in postfix.items()
                             if v is not None}, refresh=False)
            bar.update(1)
            if step % config.checkpoint_every == 0 or step == config.rounds:
              writer.flush()
              ckpt.save(step, state, meta(step))
            for hook in hooks:
              hook(step, state, row)
            if sigint.raised:
              interrupted = step < config.rounds
              break
        finally:
          cohorts.close()
      if interrupted:
        writer.flush()
        ckpt.save(step, state, meta(step), force=True)
        ckpt.wait()
        log(f'fedjx: interrupted after round {step}; checkpoint saved in '
            f'{workdir}. Run the same command again to continue.')
  finally:
    bar.close()
    writer.close()
    ckpt.close()
  if lead and config.plot and not interrupted and history:
    plotting.plot_curves({os.path.basename(workdir): history},
                         os.path.join(workdir, 'learning_curve.png'),
                         title=_title(config))
  return RunResult(state, step, interrupted, history, workdir)


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
  diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  if diff:
    details = ', '.join(f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in diff[:8])
    raise registry.ConfigError(
        f'{workdir} holds a checkpoint of a different experiment ({details}). '
        f'Use a new --workdir, or delete {workdir}. Fields that may change on '
        f'resumption: {list(RESUMABLE_CHANGES)}.')


def config_hash(config: Any) -> str:
  """A short hash of a config's results-relevant fields (for run names)."""
  text = json.dumps(_fingerprint(with_defaults(config)), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:10]


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
    state, _ = ckpt.restore(step, exp.algorithm.init(exp.init_params))
  finally:
    ckpt.close()
  return state, step
