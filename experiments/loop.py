"""One training loop for runs and sweeps: restore, step, emit, evaluate, checkpoint, signals.

``fedjx-run`` trains one state and ``fedjx-sweep`` a group of trials stacked
on leading axes; both go through :func:`train`, so a sweep's trial follows
the rules of a run. The loop owns the order of things in a round and never
what they mean; a *trainer* (:class:`Trainer`: the runner's
``RunTrainer``, the sweep's ``GroupTrainer``) supplies the round and its
policies (the non-finite guard, the privacy budget, the simulated clock).
Round ``r`` (from 0) goes

1. ``metrics = trainer.dispatch(r, cohort)``: the round is started (JAX
   dispatches asynchronously);
2. the previous round's checkpoint, written in the background meanwhile, is
   waited for (:class:`Checkpoints`), so a crash never leaves a newer
   metrics row than the newest checkpoint can replay;
3. ``rows = trainer.collect(r, cohort, metrics)``: the round's rows on the
   host, after the trainer's policies (a redone round, the clock);
4. ``trainer.evaluate(step, rows)`` at step ``r + 1``: the trainer
   evaluates where its schedule says (:meth:`Schedule.evaluates`; a
   sweep's trials each on their own, as their runs would);
5. ``trainer.record(step, rows)``: written; the trainer raises here to
   stop the run (a non-finite model);
6. on the checkpoint schedule: the writers are flushed and a checkpoint of
   ``trainer.state`` saved in the background;
7. ``trainer.after(step, rows)``: progress and hooks; then SIGINT or
   SIGTERM (:class:`StopFlag`) ends the loop after the round, with a
   checkpoint (:func:`interrupt`).

Steps count rounds completed: the checkpoint and the metrics row of step
``s`` hold the state after round ``s - 1``, so a run resumed from it
continues with round ``s`` and repeats the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from tqdm import auto as tqdm

from fedjx import distributed
from fedjx.experiments import checkpointing

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
    if threading.current_thread() is not threading.main_thread():
      yield self  # Signals reach only the main thread.
      return
    previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
    try:
      yield self
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)


class Checkpoints:
  """A checkpointer as the loop uses it: the last good step, a save in flight.

  Attributes:
    saved: the step of the newest checkpoint this loop wrote or restored
      (None: none yet). The non-finite guard replays rounds from it.
  """

  def __init__(self, ckpt: checkpointing.Checkpointer, saved: int | None = None):
    self.ckpt = ckpt
    self.saved = saved
    self._pending = False

  def save(self, step: int, state: Any, meta: Mapping[str, Any],
           force: bool = False) -> None:
    """Starts writing ``state`` as step ``step`` (in the background)."""
    self.ckpt.save(step, state, dict(meta), force=force)
    self.saved, self._pending = step, True

  def wait(self) -> None:
    """Returns once the save in flight, if any, is on disk."""
    if self._pending:
      self.ckpt.wait()
      self._pending = False

  def restore_saved(self, like: Any) -> tuple[Any, dict[str, Any]] | None:
    """``(state, meta)`` of :attr:`saved`, or None when nothing was saved."""
    self.wait()
    if self.saved is None:
      return None
    return self.ckpt.restore(self.saved, like)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When the loop evaluates and checkpoints.

  Attributes:
    rounds: ``config.rounds``.
    stop: the last step the loop reaches (``rounds``, or fewer where a
      privacy budget ends training earlier).
    eval_every: evaluate at multiples of it, and at ``rounds`` and ``stop``.
    checkpoint_every: checkpoint at multiples of it, and at ``rounds`` and
      ``stop``.
  """

  rounds: int
  stop: int
  eval_every: int
  checkpoint_every: int

  @classmethod
  def of(cls, config: Any, stop: int | None = None) -> Schedule:
    return cls(config.rounds, config.rounds if stop is None else stop,
               config.eval_every, config.checkpoint_every)

  def evaluates(self, step: int) -> bool:
    return step % self.eval_every == 0 or step in (self.rounds, self.stop)

  def checkpoints(self, step: int) -> bool:
    return step % self.checkpoint_every == 0 or step in (self.rounds, self.stop)


class Trainer(Protocol):
  """What :func:`train` trains (the module docstring gives the order of calls)."""

  state: Any  # What a checkpoint holds.

  def cohorts(self, start: int, stop: int) -> Iterator[Any]: ...
  def dispatch(self, r: int, cohort: Any) -> Any: ...
  def collect(self, r: int, cohort: Any, metrics: Any) -> Any: ...
  def evaluate(self, step: int, rows: Any) -> None: ...
  def record(self, step: int, rows: Any) -> None: ...
  def meta(self, step: int) -> dict[str, Any]: ...
  def flush(self) -> None: ...
  def after(self, step: int, rows: Any) -> None: ...


def train(trainer: Trainer, saves: Checkpoints, schedule: Schedule, start: int,
          flag: StopFlag) -> tuple[int, bool]:
  """Runs rounds ``start .. schedule.stop - 1`` of ``trainer``.

  Returns:
    ``(step, interrupted)``: the step reached, and whether SIGINT or SIGTERM
    ended the loop before ``schedule.stop`` (then :func:`interrupt` saves).
  """
  step = start
  cohorts = trainer.cohorts(start, schedule.stop)
  try:
    for r, cohort in zip(range(start, schedule.stop), cohorts):
      metrics = trainer.dispatch(r, cohort)
      saves.wait()  # The round runs meanwhile.
      step = r + 1
      rows = trainer.collect(r, cohort, metrics)
      trainer.evaluate(step, rows)
      trainer.record(step, rows)
      if schedule.checkpoints(step):
        trainer.flush()
        saves.save(step, trainer.state, trainer.meta(step))
      trainer.after(step, rows)
      if flag.raised:
        return step, step < schedule.stop
  finally:
    cohorts.close()
  return step, False


def interrupt(trainer: Trainer, saves: Checkpoints, step: int) -> None:
  """After a signal: everything written so far flushed, and a checkpoint of
  ``step`` on disk before returning."""
  trainer.flush()
  saves.save(step, trainer.state, trainer.meta(step), force=True)
  saves.wait()


def host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  """The one-element values of a round's metrics, as Python floats."""
  out = {}
  for k, v in distributed.to_host(dict(metrics)).items():
    arr = np.asarray(v)
    if arr.size == 1:
      out[k] = float(arr.reshape(()))
  return out


def progress_bar(total: int, initial: int, enabled: bool) -> Any:
  """A tqdm bar of rounds on stderr (a no-op bar when not ``enabled``).

  ``initial`` is the rounds already done (a resumed run's or sweep's
  checkpoints): the bar starts there and its rate counts only the rounds
  this process trains.
  """
  return tqdm.tqdm(total=total, initial=initial, unit='round', disable=not enabled,
                   dynamic_ncols=True, file=sys.stderr)


def log_above(bar: Any, log: Callable[[str], None], msg: str) -> None:
  """``log(msg)`` written above the progress bar, not onto its line.

  tqdm's own way (``tqdm.external_write_mode``, what ``tqdm.write`` does):
  the bars on the stream are cleared, the line is written, and they are
  drawn again below it.
  """
  if getattr(bar, 'disable', True) or not hasattr(bar, 'fp'):
    log(msg)
    return
  with type(bar).external_write_mode(file=bar.fp):
    log(msg)


def above(bar: Any, log: Callable[[str], None]) -> Callable[[str], None]:
  """``log`` whose lines go above ``bar`` (:func:`log_above`)."""
  return lambda msg: log_above(bar, log, msg)
