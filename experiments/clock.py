"""The simulated clock of a run whose clients take time.

Two things give rounds a duration: ``config.systems`` (availability,
stragglers and deadlines, :mod:`fedjx.datasets.systems`), whose cohorts come
with a report of when the round ended, and an asynchronous algorithm's
schedule (:class:`fedjx.datasets.AsyncScheduler`), which knows when each
server step happens. The clock turns either into the ``simulated_time``
(seconds) of each metrics row, and, for ``config.systems``, carries the time
across a checkpoint so that a resumed run's rounds start when the
uninterrupted run's would.
"""

from __future__ import annotations

from typing import Any


class SimulatedClock:
  """``simulated_time`` of each round, from the system model or the schedule.

  Attributes:
    time: with ``systems``, the simulated time (s) at which the next round
      starts.
  """

  def __init__(self, systems: Any = None, scheduler: Any = None, time: float = 0.0):
    self.systems, self.scheduler, self.time = systems, scheduler, time

  def initial_row(self) -> dict[str, float]:
    """What the evaluation row before the first round adds."""
    timed = self.systems is not None or self.scheduler is not None
    return {'simulated_time': 0.0} if timed else {}

  def advance(self, r: int, report: Any) -> dict[str, float]:
    """What round ``r``'s row adds (``report``: the system model's, or None)."""
    if report is not None:  # The system model's clock and counts.
      self.time = report.end_time
      return dict(report.metrics())
    if self.scheduler is not None:
      return {'simulated_time': self.scheduler.step(r).time}
    return {}

  def meta(self) -> dict[str, float]:
    """What a checkpoint records so that a resumed run starts on time."""
    return {'simulated_time': self.time} if self.systems is not None else {}
