"""A sweep group's trials under the runs' rules: what :func:`fedjx.experiments.sweeps.run.run_sweep` trains.

:class:`GroupTrainer` gives the shared loop (:mod:`fedjx.experiments.loop`)
the rounds of one group of trials stacked ``[seeds, settings]``
(:mod:`fedjx.experiments.sweeps.group_round`). Each trial follows the rules
of its run: it stops where :func:`fedjx.experiments.guarded_rounds.must_stop`
would stop its run (``diverged``), at the end of its privacy budget
(:class:`fedjx.experiments.privacy.Budget`, with its ``epsilon`` rows and
``privacy.json``), and is evaluated on its run's schedule.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjx import datasets
from fedjx.experiments import checkpointing
from fedjx.experiments import loop
from fedjx.experiments import metrics_writers
from fedjx.experiments import privacy as privacy_lib
from fedjx.experiments.sweeps import group_round
from fedjx.experiments.sweeps import spec
from fedjx.experiments.sweeps.group_round import make_sweep_round
from fedjx.experiments.sweeps.plan import Built
from fedjx.experiments.sweeps.plan import Group
from fedjx.experiments.sweeps.plan import Trial
from fedjx.experiments.sweeps.plan import trial_config

SweepError = spec.SweepError


class GroupTrainer:
  """A sweep group's trials as :func:`fedjx.experiments.loop.train` drives them.

  The loop's state is ``(states, alive)``: the ``[S, H]`` stacked trial
  states and whether each trial still trains. Rows are ``[seed][setting]``
  lists of dicts; a trial writes only while it is alive.
  """

  def __init__(self, config: Any, group: Group, workdir: str,
               log: Callable[[str], None], bar: Any, fingerprint: dict[str, Any],
               ckpt: checkpointing.Checkpointer, group_dir: str, counted: int = 0,
               built: Built | None = None):
    self.group, self.workdir, self.log, self.bar = group, workdir, log, bar
    self.fingerprint = fingerprint
    self.shape = (len(group.seeds), len(group.settings))
    self._sharding = group_round.trial_sharding(self.shape)
    # Laid out on the trials' devices from the host (a checkpoint restores
    # into the same layout).
    self.exps, algorithm, states, configs = group_round.group_states(
        config, group, built, self._sharding)
    self.c = c = configs[0][0]
    alive = group_round.place(np.ones(self.shape, bool), self._sharding)
    self.start, restored = 0, self._restore(ckpt, (states, alive), group_dir)
    if restored is not None:
      (states, alive), meta = restored
      self.start = int(meta['step'])
      log(f'fedjx-sweep: resuming {group.name} after round {self.start}.')
    # The bar counted ``counted`` rounds of this group already (its newest
    # checkpoint's); an older one restored, or none, moves it back.
    self.bar.update(min(self.start, c.rounds) - counted)
    self._elapsed_before = float((restored or (None, {}))[1].get('elapsed_s', 0.0))
    self.saves = loop.Checkpoints(ckpt, self.start if restored else None)
    self.state = (states, alive)
    self.alive = np.asarray(alive)
    self.budgets = [[privacy_lib.Budget(
        privacy_lib.plan(cfg, exp.data.train.num_clients), c.rounds,
        c.eval_every, exp.init_params) for cfg in row]
                    for row, exp in zip(configs, self.exps)]
    self.schedule = loop.Schedule.of(c, max(b.stop for row in self.budgets for b in row))
    self._round_keys = jnp.stack([e.round_key for e in self.exps])
    self.step_fn = make_sweep_round(algorithm, c.nonfinite,
                                    group_round.seeds_in_turn(self._sharding))
    # The round is compiled on a background thread while the trials' files
    # are written and their first evaluation runs; train() waits for it
    # before the first round (whose call then finds it compiled).
    self._compiling = None
    if self.start < self.schedule.stop:
      # The program depends on its arguments' shapes and types only: the
      # seeds' round keys stand for round ``start``'s (fold_in(round_key,
      # start), of the same type), whose own small program then compiles on
      # the prefetching thread instead of before this one.
      cohorts = jax.device_put(group_round.stacked_cohort(self.exps, c, self.start))
      self._compiling = group_round.Compiling(self.step_fn, (
          self.state[0], cohorts, self._round_keys, self.state[1]))
      group_round.check_memory(self._compiling, group)
    self.writers = self._writers(config, resume=self.start if restored else None)
    self._t0 = time.perf_counter()
    self._evaluable = self.alive
    self._host_params: Any = None  # The trials' parameters on the host, if read.

  def _restore(self, ckpt: checkpointing.Checkpointer, like: Any,
               group_dir: str) -> Any:
    def same_sweep(meta: Mapping[str, Any]) -> None:
      if meta.get('sweep') != self.fingerprint:
        raise SweepError(f'{group_dir} holds a checkpoint of a different '
                         'sweep; use a new --workdir, or start over in it with --fresh.')
    return ckpt.restore_latest_intact(like, same_sweep, warn=self.log)

  def _trial_dir(self, trial: Trial) -> str:
    return os.path.join(self.workdir, 'trials', trial.name)

  def _writers(self, config: Any, resume: int | None) -> list[list[Any]]:
    c = self.c
    for row in self.group.trials:
      for t in row:
        os.makedirs(self._trial_dir(t), exist_ok=True)
        metrics_writers.write_atomically(
            os.path.join(self._trial_dir(t), 'config.json'),
            trial_config(config, t.setting, t.seed).to_json_best_effort(
                indent=2, sort_keys=True) + '\n')
    return [[metrics_writers.make_writer(self._trial_dir(t), c.metrics_format,
                                         c.tensorboard, resume_round=resume)
             for t in row] for row in self.group.trials]

  def _keys(self, r: int) -> jax.Array:
    """Each seed's round key of round ``r`` (``fold_in(round_key, r)``, as its
    run's), ``[S]``, in one call."""
    return _fold_in(self._round_keys, r)

  def _inputs(self, r: int) -> tuple[Any, jax.Array]:
    """Round ``r``'s seed cohorts, stacked and put on the device, and its
    seed keys: made ahead by the loop's prefetching thread, so that the
    round is started without them."""
    return (jax.device_put(group_round.stacked_cohort(self.exps, self.c, r)),
            self._keys(r))

  def _each(self, mask: np.ndarray) -> Iterator[tuple[int, int]]:
    return zip(*(a.tolist() for a in np.nonzero(mask)))

  def train(self, flag: loop.StopFlag) -> bool:
    """Trains the group to its last round; True when a signal stopped it."""
    quiet = lambda msg: None
    for i, j in self._each(np.ones(self.shape, bool)):
      self.budgets[i][j].begin(self._trial_dir(self.group.trials[i][j]), True, quiet)
    if self.start == 0:
      rows = [[{} for _ in self.group.settings] for _ in self.group.seeds]
      self._evaluable = np.ones(self.shape, bool)
      self.evaluate(0, rows)
      if self.exps[0].evaluate is not None:
        self._write(0, rows, np.ones(self.shape, bool))
    step, interrupted = self.start, False
    if self.start < self.schedule.stop:
      # The seed keys' small program compiles here while the round still
      # compiles (the prefetching thread's first call then finds it).
      self._keys(self.start)
      self._compiling.wait()
      step, interrupted = loop.train(self, self.saves, self.schedule, self.start, flag)
    for i, j in self._each(np.ones(self.shape, bool)):
      budget = self.budgets[i][j]
      if budget.plan is not None:
        budget.finish(min(step, budget.stop), interrupted, self._params(i, j),
                      self._trial_dir(self.group.trials[i][j]), True, quiet)
    if interrupted:
      loop.interrupt(self, self.saves, step)
    elif step < self.c.rounds:  # Privacy budgets ended every trial early.
      self.bar.update(self.c.rounds - step)
    return interrupted

  def close(self) -> None:
    for row in self.writers:
      for w in row:
        w.close()

  # The loop's calls (fedjx.experiments.loop.Trainer), in the order it makes them.

  def cohorts(self, start: int, stop: int) -> Iterator[Any]:
    return datasets.Prefetcher(self._inputs, start, stop, prefetch=self.c.prefetch)

  def dispatch(self, r: int, inputs: Any) -> Any:
    del r  # Round r's inputs: _inputs(r), made ahead.
    states, alive = self.state
    states, metrics, alive = self.step_fn(states, *inputs, alive)
    self.state = (states, alive)
    self._host_params = None
    return metrics

  def collect(self, r: int, cohort: Any, metrics: Any) -> list[list[dict[str, float]]]:
    del cohort
    step, was_alive = r + 1, self.alive
    kept = np.asarray(self.state[1])
    metrics = jax.device_get(metrics)
    rows = [[group_round.per_trial_scalars(metrics, i, j)
             for j in range(self.shape[1])] for i in range(self.shape[0])]
    for i, j in self._each(was_alive & ~kept):
      rows[i][j]['diverged'] = 1.0
      self.log(f'fedjx-sweep: trial {self.group.trials[i][j].name} diverged in '
               f'round {step} (its run would stop there); it stops, the others '
               'go on.')
    self._written, self._evaluable = was_alive, kept
    within = np.array([[b.stop >= b.rounds or step < b.stop for b in row]
                       for row in self.budgets])
    self.alive = kept & within
    if not within.all():  # A trial's privacy budget ends it, as its run.
      self.state = (self.state[0], group_round.place(self.alive, self._sharding))
    return rows

  def evaluate(self, step: int, rows: list[list[dict[str, float]]]) -> None:
    if self.exps[0].evaluate is None:
      return
    for i, j in self._each(self._evaluable):
      if self.schedule.evaluates(step) or step == self.budgets[i][j].stop:
        rows[i][j].update(self.exps[i].evaluate(self._params(i, j)))

  def record(self, step: int, rows: list[list[dict[str, float]]]) -> None:
    for i, j in self._each(self._written):
      budget = self.budgets[i][j]
      if budget.plan is not None:  # Without one, a budget adds nothing.
        rows[i][j].update(budget.row(
            step, bool(self._evaluable[i, j]),
            self._params(i, j) if budget.audits(step) else None))
    self._write(step, rows, self._written)

  def _params(self, i: int, j: int) -> Any:
    """Trial ``(i, j)``'s server parameters as NumPy arrays: the stacked
    parameters are copied to the host once per round that reads them (an
    evaluation gathers them to the host anyway), then sliced there."""
    if self._host_params is None:
      self._host_params = jax.device_get(self.state[0].params)
    return jax.tree.map(lambda x: x[i, j], self._host_params)

  def meta(self, step: int) -> dict[str, Any]:
    return {'step': step, 'elapsed_s': self.elapsed(), 'sweep': self.fingerprint}

  def flush(self) -> None:
    for row in self.writers:
      for w in row:
        w.flush()

  def after(self, step: int, rows: Any) -> None:
    del step, rows
    self.bar.update(1)

  def elapsed(self) -> float:
    return self._elapsed_before + time.perf_counter() - self._t0

  def _write(self, step: int, rows: list[list[dict[str, float]]],
             mask: np.ndarray) -> None:
    for i, j in self._each(mask):
      self.writers[i][j].write(step, dict(rows[i][j], elapsed_s=round(self.elapsed(), 4)))


_fold_in = jax.jit(jax.vmap(jax.random.fold_in, in_axes=(0, None)))


def run_group(config: Any, group: Group, workdir: str, flag: loop.StopFlag,
              log: Callable[[str], None], bar: Any, fingerprint: dict[str, Any],
              counted: int = 0, built: Built | None = None) -> bool:
  """Trains one group to ``config.rounds``; returns True when interrupted.

  ``bar`` counts rounds; it has counted ``counted`` of this group's already
  (the rounds its newest checkpoint holds). The group's experiments built
  ahead (:class:`~fedjx.experiments.sweeps.plan.Built`) are taken from
  ``built``.
  """
  group_dir = os.path.join(workdir, 'groups', group.name)
  c = trial_config(config, group.settings[0], group.seeds[0])
  ckpt = checkpointing.Checkpointer(os.path.join(group_dir, 'checkpoints'),
                                    max_to_keep=max(2, c.checkpoints_to_keep))
  trainer = None
  try:
    trainer = GroupTrainer(config, group, workdir, log, bar, fingerprint, ckpt,
                           group_dir, counted, built)
    return trainer.train(flag)
  finally:
    if trainer is not None:
      trainer.close()
      trainer.saves.wait()
    ckpt.close()
