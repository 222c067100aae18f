"""Sweeps: a grid of hyperparameters and seeds trained in one compiled program.

fedjx keeps every numeric hyperparameter of an algorithm as an array in
``state.hparams`` (that is what makes hypergradients work), so trials that
differ only in those values and in the seed run the *same* round program on
different inputs. :func:`run_sweep` therefore stacks the states of such
trials on two leading axes ``[seeds, settings]`` and trains them together,

    states[s, h] <- round(states[s, h], cohort_s(r), key_s(r))  for all s, h,

as ``vmap(vmap(round))``: one compiled call per round for the whole group,
instead of one process per trial. Every trial sees exactly the cohorts,
PRNG keys and initial model that ``fedjx-run`` would give its config, so a
trial's numbers equal the single run's (up to float32 summation order: a
batched matrix product may add in another order than an unbatched one).

Which swept fields are vectorized is decided by the program, not by a list
of names: a field is *traced* when changing it leaves the lowered round
(StableHLO) unchanged and only changes the initial state. Seeds are always
vectorized (they change data, keys and the initial model, never the code).
Everything else (model, cohort size, algorithm, local steps, ...) is
*structural*: each structural setting is its own group, trained after the
previous one.

Each trial writes ``trials/<name>/metrics.jsonl`` (or ``.csv``) and its own
TensorBoard events, exactly as a run would. A trial whose server model or
round metrics (e.g. its training loss) become non-finite is marked ``diverged`` at that round, frozen at its last
finite state, and stops writing; the others are untouched (trials share no
computation). Groups are checkpointed like runs (``checkpoint_every``,
SIGINT/SIGTERM save and stop); running the same sweep again resumes. At the
end :mod:`fedjx.experiments.sweep_summary` writes the summary tables and
plots.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjx import datasets
from fedjx.experiments import checkpointing
from fedjx.experiments import config as config_schema
from fedjx.experiments import guarded_rounds
from fedjx.experiments import metrics_writers
from fedjx.experiments import registry
from fedjx.experiments import runner
from fedjx.experiments import sweep_spec
from fedjx.experiments import sweep_summary
from fedjx.experiments import workdir_lock

SweepError = sweep_spec.SweepError


@dataclasses.dataclass(frozen=True)
class Trial:
  """One (setting, seed) pair of a sweep."""

  name: str
  setting: dict[str, Any]
  seed: int


@dataclasses.dataclass
class Group:
  """Trials that share one compiled program: ``[seeds, settings]``."""

  index: int
  settings: list[dict[str, Any]]
  seeds: tuple[int, ...]
  trials: list[list[Trial]]  # [seed][setting]

  @property
  def name(self) -> str:
    return f'group_{self.index:03d}'


@dataclasses.dataclass
class SweepResult:
  """What :func:`run_sweep` returns.

  Attributes:
    trials: every trial, in the order of the summary.
    traced: the swept fields that were vectorized (besides the seed).
    structural: the swept fields that made separate programs.
    groups: how many programs the sweep compiled (structural settings).
    interrupted: True when SIGINT/SIGTERM stopped it (run again to continue).
    summary: the per-trial summary rows (see :mod:`sweep_summary`).
    workdir: the sweep directory.
    signal: the signal that interrupted it (``signal.SIGINT`` or
      ``signal.SIGTERM``), or None.
  """

  trials: list[Trial]
  traced: list[str]
  structural: list[str]
  groups: int
  interrupted: bool
  summary: list[dict[str, Any]]
  workdir: str
  signal: int | None = None


def trial_config(config: Any, setting: Mapping[str, Any],
                 seed: int) -> ml_collections.ConfigDict:
  """``config`` with the setting's fields and the seed set (defaults filled)."""
  tree = (config.to_dict() if hasattr(config, 'to_dict') else
          json.loads(json.dumps(dict(config))))
  for path, value in setting.items():
    sweep_spec.set_path(tree, path, value)
  tree['seed'] = seed
  return config_schema.validate(ml_collections.ConfigDict(tree))


def _algorithm(config: ml_collections.ConfigDict, exp: runner.Experiment) -> Any:
  """The algorithm of ``config`` built for ``exp``'s model and data, as ``runner.build`` does."""
  return runner.build_algorithm(config, exp.model, exp.data.train.num_clients)


def _lowered_round(algorithm: Any, exp: runner.Experiment) -> str:
  state = algorithm.init(exp.init_params)
  cohorts = exp.cohorts(0, 1)
  try:
    cohort = next(cohorts)
  finally:
    cohorts.close()
  key = exp.round_key_for(0)
  return jax.jit(algorithm.apply).lower(state, cohort, key).as_text()


def _same_state_layout(a: Any, b: Any) -> bool:
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  return ta == tb and all(
      jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)
      for x, y in zip(la, lb))


def classify(config: Any, axes_values: Mapping[str, Sequence[Any]],
             seed: int = 0) -> tuple[list[str], list[str]]:
  """Splits swept fields into traced (vectorizable) and structural ones.

  A field under ``algorithm.`` is traced when the rounds built with its first
  and last value lower to the same StableHLO and their initial states have
  the same layout: the value then lives only in the state, and one program
  serves every value. Any other field is structural.
  """
  traced, structural = [], []
  base: dict[str, Any] = {p: v[0] for p, v in axes_values.items()}
  exp = None
  for path, values in axes_values.items():
    if len(values) < 2 or not path.startswith('algorithm.'):
      (traced if len(values) < 2 else structural).append(path)
      continue
    if exp is None:
      exp = runner.build(trial_config(config, base, seed))
    algos = [_algorithm(trial_config(config, {**base, path: v}, seed), exp)
             for v in (values[0], values[-1])]
    states = [a.init(exp.init_params) for a in algos]
    same = _same_state_layout(*states) and (
        _lowered_round(algos[0], exp) == _lowered_round(algos[1], exp))
    (traced if same else structural).append(path)
  return traced, structural


def plan(config: Any, settings: Sequence[Mapping[str, Any]],
         seeds: Sequence[int], settings_per_program: int | None = None
         ) -> tuple[list[Group], list[str], list[str]]:
  """Groups the trials by their structural fields.

  Settings that share their structural fields form one group, split into
  groups of at most ``settings_per_program`` settings when that is given
  (each group a compiled program over ``[seeds, settings]``).

  Returns ``(groups, traced_fields, structural_fields)``.
  """
  if settings_per_program is not None and (
      isinstance(settings_per_program, bool) or
      not isinstance(settings_per_program, int) or settings_per_program < 1):
    raise SweepError(f'settings_per_program={settings_per_program!r} must be a '
                     'positive int or None (all settings of a group at once).')
  paths = list(settings[0]) if settings else []
  values = {p: list(dict.fromkeys(
      (json.dumps(s[p], sort_keys=True) for s in settings))) for p in paths}
  values = {p: [json.loads(v) for v in vs] for p, vs in values.items()}
  for s in settings:
    for seed in seeds:
      trial_config(config, s, seed)  # Every trial's config is valid.
  traced, structural = classify(config, values, seeds[0])
  names = sweep_spec.short_names(paths)
  keyed: dict[str, list[dict[str, Any]]] = {}
  for s in settings:
    key = json.dumps({p: s[p] for p in structural}, sort_keys=True)
    keyed.setdefault(key, []).append(dict(s))
  chunks = []
  for group_settings in keyed.values():
    k = settings_per_program or len(group_settings)
    chunks += [group_settings[i:i + k] for i in range(0, len(group_settings), k)]
  groups = []
  for i, group_settings in enumerate(chunks):
    trials = [[Trial(sweep_spec.trial_name(s, seed, names), s, seed)
               for s in group_settings] for seed in seeds]
    groups.append(Group(i, group_settings, tuple(seeds), trials))
  return groups, traced, structural


# ------------------------------------------------------------------ running

def _stack(trees: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def _select(keep: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``keep[s, h]``, else ``old`` (leaves ``[S, H, ...]``)."""
  def one(n, o):
    if _is_key(n):
      impl = jax.random.key_impl(n)
      return jax.random.wrap_key_data(
          one(jax.random.key_data(n), jax.random.key_data(o)), impl=impl)
    k = keep.reshape(keep.shape + (1,) * (jnp.ndim(n) - keep.ndim))
    return jnp.where(k, n, o)
  return jax.tree.map(one, new, old)


def _finite(params: Any, batch_dims: int = 2) -> jax.Array:
  """Per trial: every parameter finite (``[S, H]`` booleans)."""
  leaves = [x for x in jax.tree.leaves(params)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  out = None
  for x in leaves:
    f = jnp.all(jnp.isfinite(x).reshape(x.shape[:batch_dims] + (-1,)), axis=-1)
    out = f if out is None else out & f
  return out


def make_sweep_round(algorithm: Any, policy: str = 'skip'
                     ) -> Callable[..., tuple[Any, dict[str, jax.Array], jax.Array]]:
  """``sweep_round(states, cohorts, keys, alive) -> (states, metrics, alive)``.

  ``states`` leaves are ``[S, H, ...]`` (seeds, settings), ``cohorts`` leaves
  ``[S, ...]`` (a cohort per seed, shared by its settings), ``keys`` ``[S]``
  and ``alive`` ``[S, H]``. A trial that is not alive, or that a run would
  stop after this round (:func:`guarded_rounds.must_stop`: its new server
  model or round metrics, e.g. its training loss, are non-finite, every
  client of its round was non-finite, or, with ``policy='stop'``, some
  was), keeps its state and is no longer alive. Jit-compiled,
  donating ``states``.
  """
  def per_seed(states_h, cohort, key):
    return jax.vmap(algorithm.apply, in_axes=(0, None, None))(states_h, cohort, key)

  def sweep_round(states, cohorts, keys, alive):
    new, metrics = jax.vmap(per_seed)(states, cohorts, keys)
    finite = _finite(new.params)
    for value in metrics.values():  # E.g. an infinite training loss.
      if jnp.issubdtype(value.dtype, jnp.inexact) and value.ndim == 2:
        finite = finite & jnp.isfinite(value)
    bad = metrics.get('nonfinite_clients', jnp.zeros_like(finite, jnp.float32))
    stop = guarded_rounds.must_stop(finite, bad, metrics.get('clients', bad), policy)
    keep = alive & jnp.logical_not(stop)
    return _select(keep, new, states), metrics, keep

  return jax.jit(sweep_round, donate_argnums=0)


def _stacked_cohort(exps: Sequence[runner.Experiment], config: ml_collections.ConfigDict,
                    round_num: int) -> datasets.Cohort:
  """The cohorts of every seed's run for ``round_num``, padded to one step count."""
  c = config
  samplers = [e.sampler if e.sampler is not None else
              datasets.CohortSampler(e.data.train, c.cohort_size, e.config.seed)
              for e in exps]
  ids = [datasets.padded_ids(s.sample(round_num), s.cohort_size)
         for s in samplers]
  steps = max(datasets.cohort_steps(
      e.data.train, i, c.batch_size, num_epochs=c.local_epochs,
      num_steps=c.local_steps, max_steps=c.max_local_steps, bucket=c.bucket_steps)
              for e, i in zip(exps, ids))
  cohorts = [datasets.make_cohort(
      e.data.train, i, c.batch_size, num_epochs=c.local_epochs,
      num_steps=c.local_steps, max_steps=c.max_local_steps,
      shuffle_seed=s.seed, round_num=round_num, bucket=c.bucket_steps,
      steps=steps, pad_to=len(i)) for e, i, s in zip(exps, ids, samplers)]
  return jax.tree.map(lambda *xs: np.stack(xs), *cohorts)


def _trial_sharding(shape: tuple[int, int]) -> jax.sharding.NamedSharding | None:
  """Trials spread over the local devices: on the settings axis, else the seeds axis."""
  devices = jax.local_devices()
  n = len(devices)
  if n < 2 or jax.process_count() > 1:
    return None
  mesh = jax.sharding.Mesh(np.array(devices), ('trials',))
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  if shape[1] % n == 0:
    return jax.sharding.NamedSharding(mesh, P(None, 'trials'))
  if shape[0] % n == 0:
    return jax.sharding.NamedSharding(mesh, P('trials'))
  return None


def _place(tree: Any, sharding: jax.sharding.NamedSharding | None) -> Any:
  if sharding is None:
    return tree
  def one(x):
    if _is_key(x):
      return jax.random.wrap_key_data(one(jax.random.key_data(x)),
                                      impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)
  return jax.tree.map(one, tree)


def _scalars_per_trial(metrics: Mapping[str, Any], s: int, h: int) -> dict[str, float]:
  return {k: float(np.asarray(v)[s, h]) for k, v in metrics.items()
          if np.asarray(v).ndim == 2}


def _check_memory(step_fn: Any, group: Group, args: tuple[Any, ...]) -> None:
  """Refuses a group whose compiled round would not fit the device's memory.

  Only where the backend reports a memory limit (GPUs, TPUs); XLA's memory
  plan of the compiled round (arguments, outputs and temporaries, less
  donated buffers) must fit in 90% of it.
  """
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get('bytes_limit')
  if not limit:
    return
  m = step_fn.lower(*args).compile().memory_analysis()
  if m is None:
    return
  need = (m.argument_size_in_bytes + m.output_size_in_bytes +
          m.temp_size_in_bytes - m.alias_size_in_bytes)
  if need > 0.9 * limit:
    per_setting = need / len(group.settings)
    k = max(1, int(0.9 * limit // per_setting))
    raise SweepError(
        f'{group.name}: {len(group.seeds)} seeds x {len(group.settings)} settings '
        f'need {need / 2**30:.1f} GiB of the device\'s {limit / 2**30:.1f} GiB; '
        f'rerun in a new workdir with --settings_per_program={k} (or fewer seeds).')


def _group_states(config: Any, group: Group
                  ) -> tuple[list[runner.Experiment], Any, Any, ml_collections.ConfigDict]:
  """Each seed's experiment, the group's algorithm and the ``[S, H]`` initial states."""
  seeds, settings = group.seeds, group.settings
  configs = [[trial_config(config, h, s) for h in settings] for s in seeds]
  exps = [runner.build(configs[i][0]) for i in range(len(seeds))]
  states = []
  for i, exp in enumerate(exps):
    row = [exp.algorithm.init(exp.init_params)]
    row += [_algorithm(configs[i][j], exp).init(exp.init_params)
            for j in range(1, len(settings))]
    states.append(_stack(row))
  return exps, exps[0].algorithm, _stack(states), configs[0][0]


def _run_group(config: Any, group: Group, workdir: str, flag: runner.StopFlag,
               log: Callable[[str], None], bar: Any, fingerprint: dict[str, Any]) -> bool:
  """Trains one group to ``config.rounds``; returns True when interrupted."""
  seeds, settings = group.seeds, group.settings
  exps, algorithm, states, c = _group_states(config, group)
  shape = (len(seeds), len(settings))
  alive = jnp.ones(shape, bool)
  sharding = _trial_sharding(shape)
  group_dir = os.path.join(workdir, 'groups', group.name)
  ckpt = checkpointing.Checkpointer(os.path.join(group_dir, 'checkpoints'),
                                    max_to_keep=max(2, c.checkpoints_to_keep))

  def same_sweep(meta: Mapping[str, Any]) -> None:
    if meta.get('sweep') != fingerprint:
      raise SweepError(f'{group_dir} holds a checkpoint of a different sweep; '
                       'use a new --workdir.')

  start, elapsed_before = 0, 0.0
  try:
    restored = ckpt.restore_latest_intact((states, alive), same_sweep, warn=log)
  except BaseException:
    ckpt.close()
    raise
  latest = None
  if restored is not None:
    (states, alive), meta = restored
    latest = start = int(meta['step'])
    elapsed_before = float(meta.get('elapsed_s', 0.0))
    log(f'fedjx-sweep: resuming {group.name} after round {start}.')
  states, alive = _place(states, sharding), _place(alive, sharding)
  alive_host = np.asarray(alive)
  resume = start if latest is not None else None
  for row in group.trials:
    for t in row:
      os.makedirs(os.path.join(workdir, 'trials', t.name), exist_ok=True)
  writers = [[metrics_writers.make_writer(
      os.path.join(workdir, 'trials', t.name), c.metrics_format, c.tensorboard,
      resume_round=resume) for t in row] for row in group.trials]
  for row in group.trials:
    for t in row:
      metrics_writers.write_atomically(
          os.path.join(workdir, 'trials', t.name, 'config.json'),
          trial_config(config, t.setting, t.seed).to_json_best_effort(
              indent=2, sort_keys=True) + '\n')
  step_fn = make_sweep_round(algorithm, c.nonfinite)
  _check_memory(step_fn, group, (states, jax.device_put(_stacked_cohort(exps, c, start)),
                                 jnp.stack([e.round_key_for(start) for e in exps]), alive))
  t0 = time.perf_counter()
  elapsed = lambda: elapsed_before + time.perf_counter() - t0

  def evaluate(step: int, rows: list[list[dict[str, float]]]) -> None:
    if exps[0].evaluate is None:
      return
    for i, exp in enumerate(exps):
      for j in range(len(settings)):
        if alive_host[i, j]:
          params = jax.tree.map(lambda x: x[i, j], states.params)
          rows[i][j].update(exp.evaluate(params))
    del step

  def emit(step: int, rows: list[list[dict[str, float]]], wrote: np.ndarray) -> None:
    for i in range(len(seeds)):
      for j in range(len(settings)):
        if wrote[i, j]:
          writers[i][j].write(step, dict(rows[i][j], elapsed_s=round(elapsed(), 4)))

  def meta(step: int) -> dict[str, Any]:
    return {'step': step, 'elapsed_s': elapsed(), 'sweep': fingerprint}

  interrupted = False
  try:
    if start == 0:
      rows = [[{} for _ in settings] for _ in seeds]
      evaluate(0, rows)
      emit(0, rows, np.ones(shape, bool) if exps[0].evaluate else np.zeros(shape, bool))
    cohorts = datasets.Prefetcher(
        lambda r: jax.device_put(_stacked_cohort(exps, c, r)),
        start, c.rounds, prefetch=c.prefetch)
    try:
      for r, cohort in zip(range(start, c.rounds), cohorts):
        keys = jnp.stack([e.round_key_for(r) for e in exps])
        was_alive = alive_host
        states, metrics, alive = step_fn(states, cohort, keys, alive)
        alive_host = np.asarray(alive)
        step = r + 1
        metrics = jax.device_get(metrics)
        rows = [[_scalars_per_trial(metrics, i, j) for j in range(len(settings))]
                for i in range(len(seeds))]
        for i, j in zip(*np.nonzero(was_alive & ~alive_host)):
          rows[i][j]['diverged'] = 1.0
          log(f'fedjx-sweep: trial {group.trials[i][j].name} diverged in round '
              f'{step} (non-finite model or metrics); it stops, the others go on.')
        if step % c.eval_every == 0 or step == c.rounds:
          evaluate(step, rows)
        emit(step, rows, was_alive)
        bar.update(1)
        if step % c.checkpoint_every == 0 or step == c.rounds:
          for row in writers:
            for w in row:
              w.flush()
          ckpt.save(step, (states, alive), meta(step))
        if flag.raised:
          interrupted = step < c.rounds
          break
    finally:
      cohorts.close()
    if interrupted:
      for row in writers:
        for w in row:
          w.flush()
      ckpt.save(step, (states, alive), meta(step), force=True)
      ckpt.wait()
  finally:
    for row in writers:
      for w in row:
        w.close()
    ckpt.close()
  return interrupted


def check_trials(config: Any, settings: Sequence[Mapping[str, Any]],
                 seeds: Sequence[int]) -> None:
  """Raises a one-line SweepError naming the first setting whose trial config
  is not valid (``config_schema.validate``: names, options, types, ranges),
  without loading data or writing anything."""
  names = sweep_spec.short_names(list(settings[0]) if settings else [])
  for setting in settings:
    for seed in seeds:
      try:
        trial_config(config, setting, seed)
      except (ValueError, TypeError) as e:
        shown = ', '.join(f'{names.get(p, p)}={sweep_spec.format_value(v)}'
                          for p, v in setting.items()) or 'the base config'
        text = ' '.join(str(e).split())
        raise SweepError(f'the setting {shown} (seed {seed}) is not a valid '
                         f'config: {text} Nothing was written; correct the '
                         'sweep and run it again.') from None


def _started(workdir: str) -> bool:
  """Whether a sweep in ``workdir`` has trained or written any trial."""
  return any(os.path.exists(os.path.join(workdir, d)) for d in ('groups', 'trials'))


def _fingerprint(config: Any, settings: Sequence[Mapping[str, Any]],
                 seeds: Sequence[int], settings_per_program: int | None
                 ) -> dict[str, Any]:
  base = json.loads(config_schema.validate(config).to_json_best_effort(sort_keys=True))
  for key in config_schema.RESUMABLE_CHANGES:  # As for runs: these may change on resume.
    base.pop(key, None)
  return {'config': base,
          'settings': json.loads(json.dumps(list(settings), sort_keys=True)),
          'seeds': list(seeds), 'settings_per_program': settings_per_program}


def _check_synchronous(config: Any) -> None:
  """Sweeps run synchronous rounds of perfect clients: refuse the rest."""
  name = registry.split_name('algorithm', config.algorithm)[0]
  if registry.is_asynchronous(name):
    raise SweepError(f'config.algorithm.name={name!r} is asynchronous; '
                     'fedjx-sweep runs synchronous rounds only: run each trial '
                     'with fedjx-run.')
  if dict(config.get('systems') or {}):
    raise SweepError('config.systems is set; fedjx-sweep simulates perfect '
                     'clients only: run each trial with fedjx-run, or set '
                     'config.systems={}.')


def run_sweep(config: Any, workdir: str, settings: Sequence[Mapping[str, Any]],
              seeds: Sequence[int] = (0,), *, target: str | None = None,
              settings_per_program: int | None = None, metric: str | None = None,
              log: Callable[[str], None] | None = None) -> SweepResult:
  """Trains every (setting, seed) trial of a sweep, vectorized where possible.

  Args:
    config: the base experiment config (as for ``fedjx-run``).
    workdir: the sweep directory; running again with the same sweep resumes.
    settings: the settings, e.g. from :func:`sweep_spec.settings`.
    seeds: the seeds every setting runs with.
    target: e.g. ``'eval_accuracy=0.9'``: the summary's rounds-to-target
      (first round at or above it; at or below it for a loss).
    settings_per_program: at most this many settings (times every seed) in
      one compiled program; None: every setting of a structural group at
      once. On a device with a memory limit, a program that would not fit
      stops the sweep with the value to use.
    metric: the main metric of ``summary.md`` and the plots (default:
      ``eval_accuracy`` if reported, else ``eval_loss``, else a training loss).
    log: where one-line messages go (default stderr).

  Returns:
    A :class:`SweepResult`; ``workdir`` then holds ``trials/``,
    ``summary.csv``, ``summary_trials.csv``, ``summary.md`` and plots.
  """
  log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
  _check_synchronous(config)
  settings = [dict(s) for s in settings] or [{}]
  seeds = sweep_spec.parse_seeds(list(seeds))
  target_spec = sweep_summary.parse_target(target)
  check_trials(config, settings, seeds)  # Before anything is written.
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  with workdir_lock.hold(workdir):
    return _sweep(config, workdir, settings, seeds, target_spec,
                  settings_per_program, metric, log)


def _sweep(config: Any, workdir: str, settings: list[dict[str, Any]],
           seeds: tuple[int, ...], target_spec: tuple[str, float] | None,
           settings_per_program: int | None, metric: str | None,
           log: Callable[[str], None]) -> SweepResult:
  """The body of :func:`run_sweep`, holding the workdir's lock."""
  fingerprint = _fingerprint(config, settings, seeds, settings_per_program)
  spec_path = os.path.join(workdir, 'sweep.json')
  if os.path.exists(spec_path) and _started(workdir):
    with open(spec_path, encoding='utf-8') as f:
      if json.load(f) != fingerprint:
        raise SweepError(f'{workdir} holds a different sweep (its sweep.json '
                         'differs); use a new --workdir or delete it.')
  else:  # A sweep.json of a sweep that never started training is replaced.
    metrics_writers.write_atomically(
        spec_path, json.dumps(fingerprint, indent=2, sort_keys=True) + '\n')
  groups, traced, structural = plan(config, settings, seeds, settings_per_program)
  n_trials = len(settings) * len(seeds)
  log(f'fedjx-sweep: {n_trials} trials in {len(groups)} program(s); vectorized: '
      f'seed{"".join(", " + p for p in traced)}; separate programs: '
      f'{", ".join(structural) or "none"}.')
  c = config_schema.validate(trial_config(config, settings[0], seeds[0]))
  from tqdm import auto as tqdm  # pylint: disable=g-import-not-at-top
  bar = tqdm.tqdm(total=c.rounds * len(groups), unit='round', dynamic_ncols=True,
                  disable=not c.progress, file=sys.stderr)
  stopped_by = None
  try:
    with runner.StopFlag().installed() as flag:
      for group in groups:
        if _run_group(config, group, workdir, flag, log, bar, fingerprint):
          stopped_by = flag.signum
          log(f'fedjx-sweep: interrupted ({signal.Signals(flag.signum).name}); '
              f'checkpoints saved in {workdir}. Run the same command again to '
              'continue.')
          break
  finally:
    bar.close()
  trials = [t for g in groups for row in g.trials for t in row]
  summary = []
  if stopped_by is None:
    summary = sweep_summary.write_summary(
        workdir, trials, list(settings[0]), c.metrics_format, target_spec,
        plot=c.plot, metric=metric)
  return SweepResult(trials, traced, structural, len(groups), stopped_by is not None,
                     summary, workdir, stopped_by)


def load_trial_state(workdir: str, trial: str) -> tuple[Any, int]:
  """The latest saved state of one trial of the sweep in ``workdir``.

  Rebuilds the trial's group from ``workdir/sweep.json`` for the state's
  structure, restores the group's latest checkpoint and returns
  ``(state, step)`` for the trial named ``trial`` (its directory name under
  ``trials/``), like :func:`fedjx.experiments.runner.load_state` for a run.
  """
  with open(os.path.join(workdir, 'sweep.json'), encoding='utf-8') as f:
    spec = json.load(f)
  config = ml_collections.ConfigDict(spec['config'])
  groups, _, _ = plan(config, spec['settings'], spec['seeds'],
                      spec.get('settings_per_program'))
  for group in groups:
    for i, row in enumerate(group.trials):
      for j, t in enumerate(row):
        if t.name != trial:
          continue
        _, _, states, _ = _group_states(config, group)
        alive = jnp.ones((len(group.seeds), len(group.settings)), bool)
        ckpt = checkpointing.Checkpointer(
            os.path.join(workdir, 'groups', group.name, 'checkpoints'))
        try:
          restored = ckpt.restore_latest_intact((states, alive))
        finally:
          ckpt.close()
        if restored is None:
          raise FileNotFoundError(f'{workdir}: {group.name} holds no checkpoint.')
        (states, _), meta = restored
        step = int(meta['step'])
        return jax.tree.map(lambda x: x[i, j], states), step
  names = [t.name for g in groups for row in g.trials for t in row]
  raise SweepError(f'{workdir} has no trial {trial!r}; its trials: {names}.')
