"""A run's rounds under its policies: what :func:`fedjx.experiments.runner.run` trains.

:class:`RunTrainer` restores a run's newest intact checkpoint and gives the
shared loop (:mod:`fedjx.experiments.loop`) its rounds, with the run's
policies: the non-finite guard (:class:`fedjx.experiments.guarded_rounds.GuardedRounds`,
and :func:`fedjx.experiments.guarded_rounds.must_stop` to stop), the privacy
budget (:class:`fedjx.experiments.privacy.Budget`) and the simulated clock
(:class:`fedjx.experiments.clock.SimulatedClock`). It writes the metrics
rows, the progress bar and the learning curve; hooks see every round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from fedjx import distributed
from fedjx import execution as execution_lib
from fedjx import sharding
from fedjx.experiments import checkpointing
from fedjx.experiments import client_states
from fedjx.experiments import clock as clock_lib
from fedjx.experiments import compile_progress
from fedjx.experiments import config as config_schema
from fedjx.experiments import guarded_rounds
from fedjx.experiments import lm_cost
from fedjx.experiments import lm_metrics
from fedjx.experiments import loop
from fedjx.experiments import metrics_writers
from fedjx.experiments import network_clock
from fedjx.experiments import plotting
from fedjx.experiments import privacy as privacy_lib
from fedjx.experiments import registry
from fedjx.experiments.config import fingerprint as _fingerprint
from fedjx.experiments.experiment import Experiment
from fedjx.experiments.experiment import round_algorithms
from fedjx.experiments.guarded_rounds import PARAMS_FINITE
from fedjx.experiments.guarded_rounds import all_finite as _all_finite
from fedjx.experiments.loop import StopFlag
from fedjx.experiments.loop import host_scalars as _scalars

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


class RunTrainer:
  """One run's rounds as :func:`fedjx.experiments.loop.train` drives them.

  Its policies: the non-finite guard (:class:`guarded_rounds.GuardedRounds`
  and :func:`guarded_rounds.must_stop`), the privacy budget
  (:class:`privacy_lib.Budget`) and the simulated clock
  (:class:`clock_lib.SimulatedClock`).
  """

  def __init__(self, config: ml_collections.ConfigDict, exp: Experiment,
               workdir: str, log: Callable[[str], None], lead: bool,
               hooks: Sequence[Hook], ckpt: checkpointing.Checkpointer):
    self.config, self.exp, self.workdir = config, exp, workdir
    self.log, self.lead, self.hooks = log, lead, hooks
    self.fingerprint = _fingerprint(config)
    self.state = self.initial_state()
    # Per-client state outside the server state: the run's host store.
    self.store = client_states.make_store(
        config, exp.algorithm, exp.init_params, exp.data.train.num_clients,
        workdir)
    self.store_steps = client_states.StoreSteps(self.store)
    self._rows: Any = None  # The dispatched round's new per-client rows.
    self._row_scratch: dict[int, Any] = {}  # Host memory streamed rows are read into.
    restored = self._restore(ckpt)
    self.start = 0 if restored is None else int(restored['step'])
    self.saves = loop.Checkpoints(ckpt, None if restored is None else self.start)
    self.clock = clock_lib.SimulatedClock(exp.systems, exp.scheduler, float(
        (restored or {}).get('simulated_time', 0.0)))
    self.network_clock = network_clock.make(config, exp.init_params, restored)
    self._round_t0: float | None = None  # When the round being run was dispatched.
    # Tokens/s and MFU of a llama_lm model's rounds (None for other models).
    self.throughput = lm_metrics.throughput(exp.model,
                                            (exp.data.info or {}).get('max_len'))
    self.budget = privacy_lib.Budget(exp.privacy, config.rounds,
                                     config.eval_every, exp.init_params)
    self.schedule = loop.Schedule.of(config, self.budget.stop)
    self._elapsed_before = float((restored or {}).get('elapsed_s', 0.0))
    self._t0 = time.perf_counter()
    self.writer = self._writer(resumed=restored is not None)
    self.history = _previous_rows(workdir, config.metrics_format, self.start) if (
        lead and restored is not None) else []
    self.bar = loop.progress_bar(config.rounds, self.start, lead and config.progress)
    self.log = loop.above(self.bar, log)  # While the bar shows, lines go above it.
    self.rounds: guarded_rounds.GuardedRounds | None = None
    self._compiling = contextlib.ExitStack()  # Closed after the first round.
    self._last_row: dict[str, float] = {}
    self._report: Any = None  # The system model's report of the round.
    self._finite = self._params_finite = True

  def initial_state(self) -> Any:
    """The algorithm's initial state, placed on the mesh if there is one.

    Global arrays over every process's devices, each leaf on
    :func:`fedjx.sharding.replica_specs` over the mesh's ``fsdp`` and
    ``tensor`` axes (the model's ``layout``: Megatron-style for ``llama_lm``,
    FSDP along the largest divisible dimension otherwise) and replicated over
    ``clients``; with neither axis, replicated. Inside a round each replica's
    parameters keep this layout (:meth:`fedjx.models.Model.apply` constrains
    them), stacked on ``clients``; a checkpoint restores into it.
    """
    fresh = self.exp.algorithm.init(self.exp.init_params)
    mesh = jax.sharding.get_mesh()
    if mesh is not None and not mesh.empty:
      fresh = distributed.put_global(fresh, mesh, state_specs(
          self.config, self.exp.model, fresh, mesh))
    return fresh

  def _restore(self, ckpt: checkpointing.Checkpointer) -> dict[str, Any] | None:
    """Restores the newest intact checkpoint into ``state``; its meta, or None."""
    check = lambda m: config_schema.check_same_experiment(
        m.get('config', {}), self.fingerprint, self.workdir)
    try:
      restored = ckpt.restore_latest_intact(self.state, check, warn=self.log)
    except checkpointing.StructureMismatch as e:
      raise registry.ConfigError(f'{e} Use a new --workdir, or start over in '
                                 f'{self.workdir} with --fresh.') from None
    if restored is None:
      return None
    self.state, meta = restored
    # The step actually restored (an older one where the newest was damaged).
    self.store_steps.restore(int(meta['step']), self.workdir)
    self.log(f'fedjx: resuming {self.workdir} from the checkpoint after round '
             f'{int(meta["step"])}.')
    return meta

  def _writer(self, resumed: bool) -> Any:
    if not self.lead:
      return metrics_writers.MultiWriter([])
    metrics_writers.write_atomically(
        os.path.join(self.workdir, 'config.json'),
        self.config.to_json_best_effort(indent=2, sort_keys=True) + '\n')
    return metrics_writers.make_writer(
        self.workdir, self.config.metrics_format, self.config.tensorboard,
        resume_round=self.start if resumed else None)

  def elapsed(self) -> float:
    return self._elapsed_before + time.perf_counter() - self._t0

  def train(self) -> RunResult:
    """Trains from the restored step to the end (or a signal)."""
    step, interrupted = self.start, False
    try:
      with StopFlag().installed() as flag:
        self.budget.begin(self.workdir, self.lead, self.log)
        if self.start == 0 and self.exp.evaluate is not None:
          self.emit(0, dict(self.exp.evaluate(self.state.params),
                            **self.clock.initial_row()))
        if self.start < self.schedule.stop:
          step, interrupted = loop.train(self, self.saves, self.schedule,
                                         self.start, flag)
        self.budget.finish(step, interrupted, self.state.params, self.workdir,
                           self.lead, self.log)
        if interrupted:
          loop.interrupt(self, self.saves, step)
          self.bar.close()  # The message goes below the bar, which stays.
          self.log(f'fedjx: interrupted after round {step} '
                   f'({signal.Signals(flag.signum).name}); checkpoint saved in '
                   f'{self.workdir}. Run the same command again to continue.')
    finally:
      self._compiling.close()
      self.bar.close()
      self.writer.close()
      self.saves.wait()
      if self.store is not None:
        self.store.close()
    if self.lead and self.config.plot and not interrupted and self.history:
      plotting.plot_curves({os.path.basename(self.workdir): self.history},
                           os.path.join(self.workdir, 'learning_curve.png'),
                           title=_title(self.config))
    return RunResult(self.state, step, interrupted, self.history, self.workdir,
                     flag.signum if interrupted else None)

  # The loop's calls (fedjx.experiments.loop.Trainer), in the order it makes them.

  def cohorts(self, start: int, stop: int) -> Iterator[Any]:
    """The rounds' cohorts; the first's fetch and the first round compile."""
    guarded, unguarded = round_algorithms(self.config, self.exp)
    self.rounds = guarded_rounds.GuardedRounds(guarded, unguarded, self._runner)
    # Progress, like the bar: shown with config.progress (a quiet run logs
    # only what happened to it).
    self._announce(compile_progress.compiling_message(self.config))
    self._compile_t0 = time.perf_counter()
    self._compiling.enter_context(compile_progress.slow_compile_notice_as_progress())
    return self._cohorts_from(start, stop, self.clock.time, self.state)

  def dispatch(self, r: int, cohort: Any) -> Any:
    # The round's wall time, for a measured step time; none for the round
    # that compiles.
    self._round_t0 = None if r == self.start else time.perf_counter()
    if self.exp.systems is not None:
      cohort, self._report = cohort
    cohort = client_states.attach(self.store, cohort, self._row_scratch)
    self._cohort = cohort
    self.state, metrics, *rows = self.rounds.first(self.state, cohort,
                                                   self.exp.round_key_for(r))
    self._rows = rows[0] if rows else None
    if r == self.start:  # The first round compiles: timed.
      jax.block_until_ready(metrics)
      self._compiling.close()
      self._announce(compile_progress.compiled_message(
          time.perf_counter() - self._compile_t0))
    if self.config.nonfinite != 'off' and PARAMS_FINITE not in metrics and (
        guarded_rounds.RESULT_FINITE not in metrics):  # Not compiled.
      metrics = dict(metrics, **{PARAMS_FINITE: _all_finite(self.state.params)})
    return metrics

  def collect(self, r: int, cohort: Any, metrics: Any) -> dict[str, float]:
    del cohort  # The one dispatch unpacked.
    state, redone, row = self.rounds.settle(
        r, _scalars(metrics), self._cohort, self.exp.round_key_for(r),
        self._state_before)
    if state is not None:
      self.state, row = state, _scalars(redone)
      self._rows = self.rounds.redone_rows
    # The round is accepted: its clients' new rows replace their old ones.
    client_states.write_back(self.store, self._cohort, self._rows)
    self._rows = None
    # The run stops on a non-finite model or round metric (must_stop), e.g.
    # an infinite training loss of a model too large to be useful.
    self._params_finite = row.pop(PARAMS_FINITE, 1.0) == 1.0
    self._finite = self.config.nonfinite == 'off' or (
        self._params_finite and all(map(math.isfinite, row.values())))
    wall = None if self._round_t0 is None else time.perf_counter() - self._round_t0
    row.update(self.clock.advance(r, self._report))
    if self.throughput is not None and wall is not None and 'examples' in row:
      row.update(self.throughput.row(row['examples'], wall))
    if self.network_clock is not None:
      row.update(self.network_clock.advance(row, wall))
    return row

  def evaluate(self, step: int, row: dict[str, float]) -> None:
    if self.exp.evaluate is not None and self._finite and (
        self.schedule.evaluates(step)):
      row.update(self.exp.evaluate(self.state.params))

  def record(self, step: int, row: dict[str, float]) -> None:
    row.update(self.budget.row(step, self._finite, self.state.params))
    self.emit(step, row)
    bad = row.get('nonfinite_clients', 0)
    if bool(guarded_rounds.must_stop(self._finite, bad, row.get('clients', bad),
                                     self.config.nonfinite)):
      self.writer.flush()
      raise NonFiniteError(_nonfinite_message(
          step, row, self._finite, self._params_finite, self.saves.saved))

  def meta(self, step: int) -> dict[str, Any]:
    # Called once per checkpoint, before it is started: the store saves the
    # rows as of this step first, so a checkpoint on disk has its store step.
    self.store_steps.save(step)
    return {'step': step, 'next_round': step, 'seed': self.config.seed,
            'round_key': np.asarray(jax.random.key_data(self.exp.round_key)).tolist(),
            'elapsed_s': self.elapsed(), 'config': self.fingerprint,
            **self.clock.meta(),
            **({} if self.network_clock is None else self.network_clock.meta())}

  def flush(self) -> None:
    self.writer.flush()

  def after(self, step: int, row: dict[str, float]) -> None:
    self._last_row.update(row)
    postfix = {'loss': _train_loss(self._last_row)}
    if 'eval_accuracy' in self._last_row:
      postfix['eval_acc'] = self._last_row['eval_accuracy']
    self.bar.set_postfix({k: f'{v:.4f}' for k, v in postfix.items()
                          if v is not None}, refresh=False)
    self.bar.update(1)
    for hook in self.hooks:
      hook(step, self.state, row)

  # Helpers.

  def emit(self, step: int, row: dict[str, float]) -> None:
    row = dict(row, elapsed_s=round(self.elapsed(), 4))
    self.writer.write(step, row)
    self.history.append({'round': step, **row})

  def _announce(self, msg: str) -> None:
    if self.lead and self.config.progress:
      self.log(msg)

  def _runner(self, algorithm: Any) -> Callable[..., Any]:
    return execution_lib.round_runner(
        algorithm, self.config.execution,
        config_schema.streaming_chunk(self.config), self.log)

  def _cohorts_from(self, first: int, last: int, at: float,
                    like: Any) -> Iterator[Any]:
    """Cohorts of rounds ``first .. last - 1``, the first at simulated time ``at``."""
    exp = self.exp
    if exp.systems is not None:  # Cohorts closed by the system model.
      return exp.system_rounds(first, last, at)
    if getattr(self.rounds.first, 'may_stream', False) and exp.scheduler is None:
      # Clients are read a chunk at a time (and their rows, if the store
      # holds any: the decision to load a cohort whole counts them).
      whole = self.rounds.first.loads_whole(like, exp.round_key_for(first))
      store = self.store
      return exp.lazy_cohorts(first, last, whole if store is None else (
          lambda clients: whole(client_states.with_rows(store, clients))))
    return exp.cohorts(first, last)

  def _state_before(self, r: int) -> Any:
    """The state before round ``r``, rebuilt as a resumed run rebuilds it: the
    last checkpoint (or the initial state), then the rounds since, each run
    as it was (unguarded, or redone guarded)."""
    state, first, at = self.initial_state(), 0, 0.0
    restored = self.saves.restore_saved(state)
    if restored is not None:
      state, meta = restored
      first, at = self.saves.saved, float(meta.get('simulated_time', 0.0))
    if self.store is not None:  # The rows as of ``first``, replayed to ``r``.
      if first == 0:  # Nothing saved yet: every client reads its initial row.
        # The same store, reset: the round's streamed cohort reads and stages
        # its rows through it.
        self.store.reset()
        self.store_steps = client_states.StoreSteps(self.store)
      else:
        self.store_steps.restore(first, self.workdir)
    replay = self._cohorts_from(first, r, at, state)
    unpack = (lambda c: c[0]) if self.exp.systems is not None else (lambda c: c)
    try:
      return self.rounds.replay(
          state, first, r, map(unpack, replay), self.exp.round_key_for,
          rows=lambda c: client_states.attach(self.store, c, self._row_scratch),
          write=lambda c, new: client_states.write_back(self.store, c, new))
    finally:
      replay.close()


def state_specs(config: ml_collections.ConfigDict, model: Any, state: Any,
                mesh: jax.sharding.Mesh) -> Any:
  """The ``PartitionSpec`` of each leaf of a server state on ``mesh``.

  :func:`fedjx.sharding.replica_specs` with the sizes of the mesh's ``fsdp``
  and ``tensor`` axes and ``model.layout``. Refuses, naming ``config.mesh``,
  a ``tensor`` size that does not divide a Llama model's heads, MLP width and
  vocabulary, and a size that does not divide the dimension of a Llama
  matrix it would split.
  """
  fsdp, tensor = sharding.replica_axis_sizes(mesh)
  layout = getattr(model, 'layout', 'fsdp')
  try:
    shape = lm_metrics.llama_shape(model)
    if tensor > 1 and shape is not None:
      lm_cost.check_tensor('llama_lm', shape, tensor)
    return sharding.replica_specs(state, fsdp, tensor, layout)
  except ValueError as e:
    raise registry.ConfigError(f'config.mesh={config.mesh!r}: {e}') from None


def _train_loss(row: Mapping[str, Any]) -> float | None:
  for key in TRAIN_LOSS_KEYS:
    if key in row:
      return row[key]
  return None


def _nonfinite_message(step: int, row: Mapping[str, Any], finite: bool,
                       params_finite: bool, saved: int | None) -> str:
  """One line: the round (as in the metrics file), what was non-finite, and
  the last good checkpoint."""
  count = int(row.get('nonfinite_clients', 0))
  if finite and count and row.get('clients', 0) == 0:
    what = (f'every client ({count}) had a NaN or Inf update or weight, so '
            'nothing could be aggregated')
  elif finite:
    what = (f"{count} client(s) had a non-finite update or weight "
            "(config.nonfinite='stop')")
  elif params_finite:
    names = ', '.join(f'{k}={v}' for k, v in sorted(row.items())
                      if not math.isfinite(v) and not k.startswith('eval_'))
    what = f"the round's metrics became NaN or Inf ({names})"
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
