"""Running a sweep: a grid of hyperparameters and seeds trained in one compiled program.

fedjx keeps every numeric hyperparameter of an algorithm as an array in
``state.hparams`` (that is what makes hypergradients work), so trials that
differ only in those values and in the seed run the *same* round program on
different inputs. :func:`run_sweep` therefore stacks the states of such
trials on two leading axes ``[seeds, settings]`` and trains them together,

    states[s, h] <- round(states[s, h], cohort_s(r), key_s(r))  for all s, h,

as ``vmap(vmap(round))`` (:mod:`fedjx.experiments.sweeps.group_round`; on a
CPU ``lax.map`` over ``s`` of ``vmap`` over ``h``): one compiled call per
round for the whole group, instead of one process per trial. Every trial sees exactly the cohorts, PRNG keys and initial model
that ``fedjx-run`` would give its config, so a trial's numbers equal the
single run's (up to float32 summation order: a batched matrix product may
add in another order than an unbatched one).

Which swept fields are vectorized is decided by the program, not by a list
of names (:mod:`fedjx.experiments.sweeps.plan`): a field is *traced* when
changing it leaves the lowered round (StableHLO) unchanged and only changes
the initial state. Seeds are always vectorized. Everything else (model,
cohort size, algorithm, local steps, ...) is *structural*: each structural
setting is its own group, trained after the previous one.

A group trains in the runner's loop (:mod:`fedjx.experiments.loop`), and
each trial follows the rules of its run:

* it writes ``trials/<name>/metrics.jsonl`` (or ``.csv``), its
  ``config.json`` and its own TensorBoard events, and is evaluated on its
  run's schedule;
* where its run would stop after a round
  (:func:`fedjx.experiments.guarded_rounds.must_stop` under its
  ``config.nonfinite``: a non-finite server model, a round in which every
  client was non-finite, or with ``'stop'`` any non-finite client), the
  trial is marked ``diverged`` in that round's row, frozen at its last state
  and stops writing; the others are untouched (trials share no computation);
* a private trial reports its ``epsilon`` as its run would, writes its
  ``privacy.json``, and stops after the last round within its
  ``privacy.target_epsilon`` (:class:`fedjx.experiments.privacy.Budget`).

Groups are checkpointed like runs (``checkpoint_every``, SIGINT/SIGTERM save
and stop); running the same sweep again resumes. At the end
:mod:`fedjx.experiments.sweeps.summary` writes the summary tables and plots.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from fedjx.experiments import checkpointing
from fedjx.experiments import compilation_cache
from fedjx.experiments import config as config_schema
from fedjx.experiments import loop
from fedjx.experiments import metrics_writers
from fedjx.experiments import processes
from fedjx.experiments import registry
from fedjx.experiments.sweeps import group_round
from fedjx.experiments.sweeps import record
from fedjx.experiments.sweeps import spec
from fedjx.experiments.sweeps import summary
from fedjx.experiments import workdir as workdir_lib
from fedjx.experiments import workdir_lock
# Names documented here first; they live in the modules of their parts.
# pylint: disable=unused-import
from fedjx.experiments.sweeps.group_round import make_sweep_round
from fedjx.experiments.sweeps.plan import Built
from fedjx.experiments.sweeps.plan import Group
from fedjx.experiments.sweeps.plan import Trial
from fedjx.experiments.sweeps.plan import check_trials
from fedjx.experiments.sweeps.plan import classify
from fedjx.experiments.sweeps.plan import plan
from fedjx.experiments.sweeps.plan import trial_config
from fedjx.experiments.sweeps.trainer import GroupTrainer
from fedjx.experiments.sweeps.trainer import run_group as _run_group
# pylint: enable=unused-import

SweepError = spec.SweepError

@dataclasses.dataclass
class SweepResult:
  """What :func:`run_sweep` returns.

  Attributes:
    trials: every trial, in the order of the summary.
    traced: the swept fields that were vectorized (besides the seed).
    structural: the swept fields that made separate programs.
    groups: how many programs the sweep compiled (structural settings).
    interrupted: True when SIGINT/SIGTERM stopped it (run again to continue).
    summary: the per-trial summary rows (see :mod:`fedjx.experiments.sweeps.summary`).
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

def _started(workdir: str) -> bool:
  """Whether a sweep in ``workdir`` has trained or written any trial."""
  return any(os.path.exists(os.path.join(workdir, d)) for d in ('groups', 'trials'))


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
    settings: the settings, e.g. from :func:`fedjx.experiments.sweeps.spec.settings`.
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
  seeds = spec.parse_seeds(list(seeds))
  target_spec = summary.parse_target(target)
  check_trials(config, settings, seeds)  # Before anything is written.
  # One CPU device per core, as for runs (config.mesh='auto'), here to
  # spread the trials over (trial_sharding): a count that divides the
  # settings or the seeds.
  processes.split_cpu(config_schema.with_defaults(config),
                      [settings_per_program or len(settings), len(seeds)])
  # A refused sweep (before it trains) removes the workdir it made.
  with workdir_lib.made(workdir, (workdir_lock.LOCK_NAME, 'sweep.json')) as workdir:
    with workdir_lock.hold(workdir):
      return _sweep(config, workdir, settings, seeds, target_spec,
                    settings_per_program, metric, log)


def _sweep(config: Any, workdir: str, settings: list[dict[str, Any]],
           seeds: tuple[int, ...], target_spec: tuple[str, float] | None,
           settings_per_program: int | None, metric: str | None,
           log: Callable[[str], None]) -> SweepResult:
  """The body of :func:`run_sweep`, holding the workdir's lock."""
  c = config_schema.validate(trial_config(config, settings[0], seeds[0]))
  try:  # Compiled programs kept on disk, as for runs (config.compilation_cache).
    compilation_cache.enable(c.compilation_cache, workdir)
  except ValueError as e:
    raise config_schema.ConfigError(str(e)) from None
  sweep = record.fingerprint(config, settings, seeds, settings_per_program)
  spec_path = os.path.join(workdir, 'sweep.json')
  parts = [record.Part(sweep['settings'], sweep['seeds'])]
  if os.path.exists(spec_path) and _started(workdir):
    with open(spec_path, encoding='utf-8') as f:
      saved = json.load(f)
    # The same sweep, or one with more values or seeds; else one line.
    parts = record.extend(saved, sweep, workdir)
  # (A sweep.json of a sweep that never started training is replaced.)
  metrics_writers.write_atomically(spec_path, json.dumps(
      record.with_parts(sweep, parts), indent=2, sort_keys=True) + '\n')
  built = Built()  # The experiment classify builds, for the group that trains it.
  groups, fingerprints, traced, structural = _plan_parts(
      config, sweep, parts, built)
  n_trials = sum(len(p.settings) * len(p.seeds) for p in parts)
  log(f'fedjx-sweep: {n_trials} trials in {len(groups)} program(s); vectorized: '
      f'seed{"".join(", " + p for p in traced)}; separate programs: '
      f'{", ".join(structural) or "none"}.')
  # The bar counts every group's rounds and starts at those its checkpoints
  # hold (a group corrects its share if it restores an older one).
  shares = [trial_config(config, g.settings[0], g.seeds[0]).rounds for g in groups]
  done = [_rounds_done(workdir, g, share) for g, share in zip(groups, shares)]
  bar = loop.progress_bar(sum(shares), sum(done), c.progress)
  log = loop.above(bar, log)  # While the bar shows, lines go above it.
  stopped_by = None
  try:
    with loop.StopFlag().installed() as flag:
      for group, fingerprint, counted in zip(groups, fingerprints, done):
        if _run_group(config, group, workdir, flag, log, bar, fingerprint, counted,
                      built):
          stopped_by = flag.signum
          bar.close()  # The message goes below the bar, which stays.
          log(f'fedjx-sweep: interrupted ({signal.Signals(flag.signum).name}); '
              f'checkpoints saved in {workdir}. Run the same command again to '
              'continue.')
          break
  finally:
    bar.close()
  trials = [t for g in groups for row in g.trials for t in row]
  rows = []
  if stopped_by is None:
    rows = summary.write_summary(
        workdir, trials, list(settings[0]), c.metrics_format, target_spec,
        plot=c.plot, metric=metric)
  return SweepResult(trials, traced, structural, len(groups), stopped_by is not None,
                     rows, workdir, stopped_by)


def _plan_parts(config: Any, sweep: Mapping[str, Any], parts: Sequence[record.Part],
                built: Built | None = None
                ) -> tuple[list[Group], list[dict[str, Any]], list[str], list[str]]:
  """Every part's groups (numbered on from the previous part's), the
  fingerprint each group's checkpoints carry, and the traced and structural
  fields of them all."""
  groups, fingerprints, traced, structural = [], [], [], []
  for part in parts:
    found, t, st = plan(config, part.settings, part.seeds,
                        sweep['settings_per_program'], built, first=len(groups))
    groups += found
    fingerprints += [record.part_fingerprint(sweep, part)] * len(found)
    traced += [f for f in t if f not in traced]
    structural += [f for f in st if f not in structural]
  traced = [f for f in traced if f not in structural]
  return groups, fingerprints, traced, structural


def _rounds_done(workdir: str, group: Group, rounds: int) -> int:
  """The rounds of ``group`` its newest checkpoint holds (at most ``rounds``)."""
  steps = checkpointing.written_steps(
      os.path.join(workdir, 'groups', group.name, 'checkpoints'))
  return min(steps[-1], rounds) if steps else 0


def load_trial_state(workdir: str, trial: str) -> tuple[Any, int]:
  """The latest saved state of one trial of the sweep in ``workdir``.

  Rebuilds the trial's group from ``workdir/sweep.json`` for the state's
  structure, restores the group's latest checkpoint and returns
  ``(state, step)`` for the trial named ``trial`` (its directory name under
  ``trials/``), like :func:`fedjx.experiments.runner.load_state` for a run.
  """
  with open(os.path.join(workdir, 'sweep.json'), encoding='utf-8') as f:
    saved = json.load(f)
  config = ml_collections.ConfigDict(saved['config'])
  groups, _, _, _ = _plan_parts(config, dict(saved, settings_per_program=saved.get(
      'settings_per_program')), record.parts(saved))
  for group in groups:
    for i, row in enumerate(group.trials):
      for j, t in enumerate(row):
        if t.name != trial:
          continue
        _, _, states, _ = group_round.group_states(config, group)
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