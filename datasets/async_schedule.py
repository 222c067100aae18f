"""Asynchronous schedules: which clients report at each server step, and when.

Buffered asynchronous aggregation (FedBuff: Nguyen et al., "Federated
Learning with Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1)
runs on a simulated clock. This module is the host side of it: a
discrete-event simulation in NumPy, a pure function of the seed, the server
step and a ``duration(client_id, start_time) -> seconds`` callable (a
system model; :func:`lognormal_durations` is a simple one). The device side
is :mod:`fedjx.algorithms.fedbuff_lib`.

The simulation (:class:`AsyncScheduler`), for a population of ``N`` clients,
a concurrency ``M`` (clients training at once) and a buffer of ``K``
updates per server step:

    time 0:  M distinct clients, drawn uniformly, start on model version 0;
             each job finishes at start + duration(client, start)
    server step r = 0, 1, ...  (the server holds version r):
        the K jobs in flight that finish first report (ties: the job that
        started first; starts are numbered in order)
        staleness  tau_i = r - (version job i started from)
        clock      <- finish time of the K-th of them
        K clients, drawn uniformly without replacement among those not
        training (those that just reported included), start on version
        r + 1 at the clock

Step ``r`` yields the ``K`` client ids in the order they finished, their
staleness and the clock (:class:`AsyncStep`). The draws of the start of
step ``r`` (``r = -1`` the initial ``M``) use the generator
``_seeding.rng(ASYNC_SCHEDULE, seed, r + 1)``: ``gen.choice(idle, n,
replace=False)`` over the sorted ids ``idle`` of the clients not training.
With ``K = M`` every job of a step started on the current version: the
staleness is always 0 and each step is a synchronous round of ``M`` clients.

:func:`async_cohort_iterator` turns the steps into placed
:class:`~fedjx.algorithms.fedbuff_lib.AsyncCohort`\\ s, as
:func:`fedjx.datasets.cohort_iterator` does for synchronous rounds.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjx.algorithms.fedbuff_lib import AsyncCohort
from fedjx.datasets import _seeding
from fedjx.datasets.cohort import place_cohort
from fedjx.datasets.federated import FederatedDataset
from fedjx.datasets.prefetch import Batching, Prefetcher, calling_thread_mesh

# Purpose tags of this module's random streams (apart from _seeding's).
ASYNC_SCHEDULE = 20
ASYNC_DURATIONS = 21

Duration = Callable[[int, float], float]


class AsyncStep(NamedTuple):
  """What the server receives at one step.

  Attributes:
    client_ids: ``int32 [K]``, the reporting clients in the order they finished.
    staleness: ``int32 [K]``, server steps since each one's model version.
    time: the simulated clock (seconds) when the ``K``-th update arrived.
  """

  client_ids: np.ndarray
  staleness: np.ndarray
  time: float


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
  ok = (not isinstance(value, bool) and isinstance(value, (int, np.integer))
        and value >= low and (high is None or value <= high))
  if not ok:
    bound = f'in [{low}, {high}]' if high is not None else f'>= {low}'
    raise ValueError(f'{name}={value!r}; it must be an int {bound}.')
  return int(value)


class AsyncScheduler:
  """The event simulation of buffered asynchronous training (module docstring).

  ``step(r)`` is deterministic in ``(seed, r)``: a resumed run asks for step
  ``r`` and gets what an uninterrupted run got. Steps are computed in order
  and kept (``K`` ids, ``K`` staleness values and a float each), so asking
  for step ``r`` of a fresh scheduler simulates steps ``0 .. r`` once:
  ``O(r (K log M + N))`` host time: 0.09 s for 1,000 steps of
  ``N, M, K = 1000, 100, 10``, 0.56 s for ``100000, 1000, 100`` (measured
  on one CPU core).

  Args:
    num_clients: ``N``, the population (client ids ``0 .. N - 1``).
    concurrency: ``M``, clients training at once, ``K <= M <= N``.
    buffer_size: ``K``, updates per server step.
    duration: ``duration(client_id, start_time) -> seconds`` of one job
      (local training and communication), finite and ``>= 0``; called once
      per job, in the order jobs start.
    seed: seeds the draws of clients.
  """

  def __init__(self, num_clients: int, concurrency: int, buffer_size: int,
               duration: Duration, seed: int = 0):
    self.num_clients = _check_int('num_clients', num_clients, 1)
    self.concurrency = _check_int('concurrency', concurrency, 1, self.num_clients)
    self.buffer_size = _check_int('buffer_size', buffer_size, 1, self.concurrency)
    if not callable(duration):
      raise ValueError(f'duration={duration!r} must be callable as '
                       'duration(client_id, start_time) -> seconds.')
    self.duration = duration
    self.seed = _check_int('seed', seed, 0)
    self._steps: list[AsyncStep] = []
    self._busy = np.zeros(self.num_clients, bool)
    self._heap: list[tuple[float, int, int, int]] = []  # finish, seq, id, version
    self._started = 0
    self._lock = threading.Lock()  # step() may be called from two threads.
    self._start(0, self.concurrency, 0.0, draw=0)

  def _start(self, version: int, count: int, now: float, draw: int) -> None:
    gen = _seeding.rng(ASYNC_SCHEDULE, self.seed, draw)
    idle = np.flatnonzero(~self._busy)
    for cid in gen.choice(idle, size=count, replace=False).tolist():
      seconds = float(self.duration(cid, now))
      if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f'duration({cid}, {now}) = {seconds!r}; a job must '
                         'take a finite number of seconds >= 0.')
      heapq.heappush(self._heap, (now + seconds, self._started, cid, version))
      self._started += 1
      self._busy[cid] = True

  def _advance(self) -> None:
    r = len(self._steps)
    done = [heapq.heappop(self._heap) for _ in range(self.buffer_size)]
    ids = np.array([cid for _, _, cid, _ in done], np.int32)
    staleness = np.array([r - v for _, _, _, v in done], np.int32)
    now = done[-1][0]
    self._busy[ids] = False
    self._steps.append(AsyncStep(ids, staleness, now))
    self._start(r + 1, self.buffer_size, now, draw=r + 1)

  def step(self, r: int) -> AsyncStep:
    """Server step ``r`` (numbered from 0)."""
    r = _check_int('r', r, 0)
    with self._lock:
      while len(self._steps) <= r:
        self._advance()
      return self._steps[r]


def lognormal_durations(num_clients: int, *, median: float = 60.0,
                        sigma: float = 1.0, seed: int = 0) -> Duration:
  """A simple system model: client ``c`` always takes ``median exp(sigma z_c)`` s.

  ``z_c ~ N(0, 1)`` once per client from ``(seed, ASYNC_DURATIONS)``: job
  times are log-normal across clients (heavy-tailed: a few stragglers) and
  fixed in time; ``sigma = 0`` makes every client take ``median``.
  """
  _check_int('num_clients', num_clients, 1)
  for name, value, strict in (('median', median, True), ('sigma', sigma, False)):
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or not math.isfinite(value) or value < 0 or (strict and value == 0)):
      raise ValueError(f'{name}={value!r}; it must be a finite number '
                       f'{"> 0" if strict else ">= 0"}.')
  z = _seeding.rng(ASYNC_DURATIONS, _check_int('seed', seed, 0)).standard_normal(
      num_clients)
  seconds = median * np.exp(sigma * z)

  def duration(client_id: int, start_time: float) -> float:
    del start_time
    return float(seconds[client_id])

  return duration


def fixed_durations(num_clients: int, *, seconds: Any) -> Duration:
  """Client ``c`` always takes ``seconds[c]`` s (e.g. DiLoCo replicas of
  known speeds); ``seconds`` holds one finite number ``>= 0`` per client."""
  _check_int('num_clients', num_clients, 1)
  table = np.asarray(seconds, np.float64)
  if table.shape != (num_clients,) or not np.all(np.isfinite(table)) \
      or np.any(table < 0):
    raise ValueError(f'seconds={seconds!r}; it must hold {num_clients} finite '
                     'numbers >= 0, one per client.')

  def duration(client_id: int, start_time: float) -> float:
    del start_time
    return float(table[client_id])

  return duration


DURATIONS: dict[str, Callable[..., Duration]] = {'lognormal': lognormal_durations,
                                                 'fixed': fixed_durations}


def make_durations(spec: Mapping[str, Any] | None, num_clients: int,
                   seed: int) -> Duration:
  """A duration model from a config's ``{'name': 'lognormal', **options}``.

  None is ``lognormal_durations`` with its defaults; ``seed`` is passed to
  the models that take one unless the spec sets it.
  """
  spec = dict(spec or {'name': 'lognormal'})
  name = spec.pop('name', None)
  if name not in DURATIONS:
    raise ValueError(f'client_durations name={name!r} is not one of '
                     f'{tuple(DURATIONS)}.')
  if name == 'lognormal':
    spec.setdefault('seed', seed)
  try:
    return DURATIONS[name](num_clients, **spec)
  except TypeError as e:
    raise ValueError(f'client_durations {name!r} got options {sorted(spec)}: '
                     f'{e}.') from None


def async_cohort_iterator(dataset: FederatedDataset, scheduler: AsyncScheduler,
                          batch_size: int, *, start_round: int = 0,
                          num_rounds: int | None = None,
                          num_epochs: int | None = None,
                          num_steps: int | None = None,
                          max_steps: int | None = None, shuffle: bool = True,
                          bucket: bool = True,
                          mesh: jax.sharding.Mesh | None = None,
                          prefetch: int = 1) -> Prefetcher:
  """Placed :class:`~fedjx.algorithms.fedbuff_lib.AsyncCohort`\\ s for steps ``start_round, ...``.

  Step ``r``'s is the cohort of ``scheduler.step(r).client_ids`` (batched by
  :func:`fedjx.datasets.make_cohort`, shuffled with ``(scheduler.seed, r,
  client)``) and the clients' staleness, placed alongside it (the clock is
  ``scheduler.step(r).time``). Arguments as
  :func:`fedjx.datasets.cohort_iterator`; one process only.
  """
  mesh = calling_thread_mesh(mesh)
  if scheduler.num_clients != dataset.num_clients:
    raise ValueError(f'scheduler.num_clients={scheduler.num_clients} differs '
                     f'from the dataset\'s {dataset.num_clients} clients.')
  if jax.process_count() > 1:
    raise ValueError('async_cohort_iterator runs on one process; this run has '
                     f'{jax.process_count()}.')
  batching = Batching(batch_size, num_epochs, num_steps, max_steps, shuffle, bucket)
  batching.check(dataset, scheduler.step(start_round).client_ids)

  def produce(r: int) -> Any:
    step = scheduler.step(r)
    cohort = batching.cohort(dataset, step.client_ids, scheduler.seed, r)
    return place_cohort(AsyncCohort(cohort, step.staleness), mesh)

  stop = None if num_rounds is None else start_round + num_rounds
  return Prefetcher(produce, start=start_round, stop=stop, prefetch=prefetch)


__all__ = ['AsyncScheduler', 'AsyncStep', 'DURATIONS', 'Duration',
           'async_cohort_iterator', 'fixed_durations', 'lognormal_durations',
           'make_durations']
