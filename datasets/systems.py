"""A system model of unreliable clients on a simulated clock.

Every round of a plain run is synchronous with perfect clients. This module
simulates the clients of cross-device federated learning as they are: they
come and go, drop out after selection, run at different speeds, and finish
only part of their work before the server closes the round (Bonawitz et al.,
"Towards Federated Learning at Scale: System Design", MLSys 2019). It works
on the host, in NumPy, on the cohort a round is about to train on; the
compiled round is unchanged.

A :class:`SystemModel` has four parts, each built from a config dict
(:func:`from_config`):

* **availability** (:class:`Availability`), which clients can be sampled at
  simulated time ``t``: ``'always'``; ``'bernoulli'``, each client
  independently with probability ``p`` in each round; ``'diurnal'``, client
  ``i`` is available while ``sin(2 pi (t / day + phi_i)) > threshold`` with a
  phase ``phi_i ~ U[0, 1)`` of its own (devices train when idle, charging and
  on Wi-Fi, mostly at night in their own time zone: Bonawitz et al. 2019,
  Fig. 6; Yang et al., "Applied Federated Learning: Improving Google Keyboard
  Query Suggestions", 2018). A fraction ``1/2 - asin(threshold) / pi`` of
  the population is available at any time.
* **dropout** (:class:`Dropout`): a sampled client fails to report with
  probability ``p``, or ``p_i ~ Beta(p k, (1 - p) k)`` of its own
  (``concentration=k``; mean ``p``).
* **speed** (:class:`Speed`): a local step of client ``i`` takes
  ``s_i = step_seconds * exp(sigma z_i)`` seconds (log-normal across
  clients, median ``step_seconds``), times ``exp(jitter z_{i,r})`` in round
  ``r`` (``z ~ N(0, 1)``); receiving the model and sending the update take
  ``c = 2 * model_bytes / bandwidth`` seconds. A client with ``tau_i``
  local steps reports ``c + tau_i s_i`` seconds after the round starts.
* **deadline** (:class:`Deadline`): the server closes the round at
  ``seconds`` after its start, or when the first ``reports`` clients have
  reported (over-selection: sample ``cohort_size`` clients for ``reports``
  updates, Bonawitz et al. 2019, Sec. 2.1), or when every client that did
  not drop out has reported, whichever comes first. Clients that have not
  reported by then are *late*: ``late='drop'`` leaves them out;
  ``late='partial'`` takes the ``floor((T - c) / s_i)`` steps they finished
  (their later steps are masked in the cohort; a client that finished none
  is left out).

A round (:func:`SystemModel.close_round`) turns the built cohort into the
cohort the server really aggregates: clients that dropped out or are left out
become padding clients (id ``PADDING_CLIENT``, ``num_examples`` 0, mask all
False: weight 0 in every algorithm), partial clients keep their first steps,
and ``num_examples`` of the others is unchanged (``p_i`` stays the client's
share of the data, as FedNova's objective needs). It returns a
:class:`RoundReport`: the round's duration ``T`` (the clock advances by it)
and how many clients were sampled, reported, dropped out, late and partial.
A round in which no client reports lasts the deadline, or ``idle_seconds``
without one (the server waits for clients to come back). Without a deadline
or ``reports``, the server waits for every client that did not drop out (a
dropout is noticed at once, as a lost connection).

Everything random is drawn from generators keyed by ``(purpose, seed,
round)`` (per-client constants by ``(purpose, seed)``, drawn once): a
round's clients, dropouts and speeds depend on the seed, the round and its
start time only. A round's host work is O(cohort) (O(log N) to find the
diurnally available clients among phases kept sorted), except for
``'bernoulli'`` availability, which draws one number per client per round. The start time of round ``r`` is the sum of
the durations before it; :func:`system_cohort_iterator` carries it from
round to round, and the runner stores it with each checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets.cohort import (PADDING_CLIENT, Cohort, CohortSampler,
                                   place_cohort)
from fedjx.datasets.federated import FederatedDataset
from fedjx.datasets.prefetch import Batching, Prefetcher, calling_thread_mesh

# Purpose tags of this module's random streams (apart from _seeding's and
# async_schedule's).
PHASE = 30
AVAILABLE = 31
SAMPLE = 32
DROPOUT_RATE = 33
DROPOUT = 34
SPEED = 35
JITTER = 36
ASYNC_JITTER = 37

AVAILABILITIES = ('always', 'bernoulli', 'diurnal')
LATE = ('drop', 'partial')


def _error(where: str, name: str, value: Any, allowed: str) -> ValueError:
  field = f'{where}.{name}' if where else name
  return ValueError(f'systems.{field}={value!r}; it must be {allowed}.')


def _number(where: str, name: str, value: Any, *, low: float = 0.0,
            strict: bool = False, high: float | None = None,
            allow_none: bool = False) -> float | None:
  """``value`` as a float in ``[low, high]`` (``(low, high]`` if strict)."""
  if value is None and allow_none:
    return None
  bound = f'{">" if strict else ">="} {low}' + (
      f' and <= {high}' if high is not None else '')
  allowed = f'a finite number {bound}' + (' or None' if allow_none else '')
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
    raise _error(where, name, value, allowed)
  v = float(value)
  if not math.isfinite(v) or v < low or (strict and v == low) or (
      high is not None and v > high):
    raise _error(where, name, value, allowed)
  return v


@dataclasses.dataclass(frozen=True)
class Availability:
  """Which clients can be sampled: ``'always'``, ``'bernoulli'`` or ``'diurnal'``.

  Attributes:
    kind: one of :data:`AVAILABILITIES`.
    p: ``'bernoulli'``: the probability a client is available in a round.
    day_hours: ``'diurnal'``: the period, in hours.
    threshold: ``'diurnal'``: available while ``sin(2 pi (t / day + phi_i))
      > threshold``, in ``[-1, 1)``; 0 makes half the population available.
  """

  kind: str = 'always'
  p: float = 1.0
  day_hours: float = 24.0
  threshold: float = 0.0

  def __post_init__(self):
    if self.kind not in AVAILABILITIES:
      raise _error('availability', 'kind', self.kind, f'one of {AVAILABILITIES}')
    _number('availability', 'p', self.p, low=0.0, strict=True, high=1.0)
    _number('availability', 'day_hours', self.day_hours, strict=True)
    _number('availability', 'threshold', self.threshold, low=-1.0, high=1.0)
    if self.threshold >= 1.0:
      raise _error('availability', 'threshold', self.threshold,
                   'below 1 (no client is ever available at 1)')

  @property
  def fraction(self) -> float:
    """The expected fraction of the population available at any time."""
    if self.kind == 'bernoulli':
      return self.p
    if self.kind == 'diurnal':
      return 0.5 - math.asin(self.threshold) / math.pi
    return 1.0


@dataclasses.dataclass(frozen=True)
class Dropout:
  """A sampled client fails to report with probability ``p`` (or ``p_i``).

  Attributes:
    p: the (mean) probability, in ``[0, 1)``.
    concentration: None for the same ``p`` for every client; else ``k > 0``
      and ``p_i ~ Beta(p k, (1 - p) k)`` (mean ``p``; smaller ``k``, more
      spread between clients).
  """

  p: float = 0.0
  concentration: float | None = None

  def __post_init__(self):
    _number('dropout', 'p', self.p, high=1.0)
    if self.p >= 1.0:
      raise _error('dropout', 'p', self.p, 'in [0, 1)')
    _number('dropout', 'concentration', self.concentration, strict=True,
            allow_none=True)


@dataclasses.dataclass(frozen=True)
class Speed:
  """How long clients take: per-step compute and per-round communication.

  Attributes:
    step_seconds: the median time of one local step, seconds.
    sigma: the log-normal spread of step times across clients.
    jitter: the log-normal spread of a client's step time from round to round.
    bandwidth: bytes per second each way, or None for no communication time.
    model_bytes: the bytes of the model (and of the update); the runner
      fills in the model's size when this is None.
  """

  step_seconds: float = 1.0
  sigma: float = 0.0
  jitter: float = 0.0
  bandwidth: float | None = None
  model_bytes: float | None = None

  def __post_init__(self):
    _number('speed', 'step_seconds', self.step_seconds, strict=True)
    _number('speed', 'sigma', self.sigma)
    _number('speed', 'jitter', self.jitter)
    _number('speed', 'bandwidth', self.bandwidth, strict=True, allow_none=True)
    _number('speed', 'model_bytes', self.model_bytes, allow_none=True)

  @property
  def comm_seconds(self) -> float:
    """``2 model_bytes / bandwidth``: download the model, upload the update."""
    if self.bandwidth is None or not self.model_bytes:
      return 0.0
    return 2.0 * self.model_bytes / self.bandwidth


@dataclasses.dataclass(frozen=True)
class Deadline:
  """When the server closes a round, and what happens to late clients.

  Attributes:
    seconds: close this long after the round starts (None: no deadline).
    reports: close once this many clients have reported (None: all).
    late: ``'drop'`` (late clients are left out) or ``'partial'`` (they
      contribute the local steps they finished).
  """

  seconds: float | None = None
  reports: int | None = None
  late: str = 'drop'

  def __post_init__(self):
    _number('deadline', 'seconds', self.seconds, strict=True, allow_none=True)
    r = self.reports
    if r is not None and (isinstance(r, bool) or
                          not isinstance(r, (int, np.integer)) or r < 1):
      raise _error('deadline', 'reports', r, 'an int >= 1 or None')
    if self.late not in LATE:
      raise _error('deadline', 'late', self.late, f'one of {LATE}')


class RoundReport(NamedTuple):
  """What the system model did to one round.

  Attributes:
    round: the round.
    start_time: the simulated time the round started, seconds.
    duration: how long it lasted, seconds (``T``).
    available: clients available when it started.
    sampled: clients sampled (real clients of the cohort).
    reported: clients whose full work was aggregated.
    partial: late clients whose finished steps were aggregated.
    late: late clients left out (``late='drop'``, or no step finished).
    dropped: clients that dropped out.
  """

  round: int
  start_time: float
  duration: float
  available: int
  sampled: int
  reported: int
  partial: int
  late: int
  dropped: int

  @property
  def end_time(self) -> float:
    return self.start_time + self.duration

  def metrics(self) -> dict[str, float]:
    """The round's metrics: ``simulated_time`` (seconds, at its end) and counts."""
    return {'simulated_time': self.end_time,
            'round_seconds': self.duration,
            'available_clients': float(self.available),
            'sampled_clients': float(self.sampled),
            'reported_clients': float(self.reported),
            'partial_clients': float(self.partial),
            'late_clients': float(self.late),
            'dropped_clients': float(self.dropped)}


@dataclasses.dataclass(frozen=True)
class SystemModel:
  """Availability, dropout, speed and deadline of a population of clients.

  Per-client constants (phases, dropout rates, base step times) are drawn
  from ``seed`` on first use and kept with the model; everything else from
  ``(seed, round)``.

  Attributes:
    num_clients: the population size ``N``.
    seed: the random seed.
    availability, dropout, speed, deadline: the parts.
    idle_seconds: how long a round in which no client reports lasts when
      there is no deadline.
  """

  num_clients: int
  seed: int = 0
  availability: Availability = Availability()
  dropout: Dropout = Dropout()
  speed: Speed = Speed()
  deadline: Deadline = Deadline()
  idle_seconds: float = 60.0

  def __post_init__(self):
    n = self.num_clients
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f'SystemModel: num_clients={n!r}; it must be an int >= 1.')
    _number('', 'idle_seconds', self.idle_seconds, strict=True)

  # ----------------------------------------------------------- per client

  @functools.cached_property
  def phases(self) -> np.ndarray:
    """``[N]`` diurnal phases ``phi_i ~ U[0, 1)``."""
    return _seeding.rng(PHASE, self.seed).random(self.num_clients)

  @functools.cached_property
  def dropout_rates(self) -> np.ndarray:
    """``[N]`` dropout probabilities ``p_i``."""
    d = self.dropout
    if d.concentration is None or d.p == 0.0:
      return np.full(self.num_clients, d.p)
    gen = _seeding.rng(DROPOUT_RATE, self.seed)
    return gen.beta(d.p * d.concentration, (1 - d.p) * d.concentration,
                    self.num_clients)

  @functools.cached_property
  def base_step_seconds(self) -> np.ndarray:
    """``[N]`` median step times ``step_seconds * exp(sigma z_i)``."""
    s = self.speed
    z = _seeding.rng(SPEED, self.seed).standard_normal(self.num_clients)
    return s.step_seconds * np.exp(s.sigma * z)

  # ----------------------------------------------------------- per round

  def available(self, round_num: int, time: float) -> np.ndarray:
    """``bool [N]``: the clients that can be sampled in round ``round_num``
    starting at simulated time ``time`` (seconds)."""
    a = self.availability
    if a.kind == 'bernoulli':
      return _seeding.rng(AVAILABLE, self.seed, round_num).random(
          self.num_clients) < a.p
    if a.kind == 'diurnal':
      mask = np.zeros(self.num_clients, bool)
      order = self._by_phase[0]
      for lo, hi in self._diurnal_ranges(time):
        mask[order[lo:hi]] = True
      return mask
    return np.ones(self.num_clients, bool)

  @functools.cached_property
  def _by_phase(self) -> tuple[np.ndarray, np.ndarray]:
    """The client ids sorted by diurnal phase, and the sorted phases."""
    order = np.argsort(self.phases, kind='stable')
    return order, self.phases[order]

  def _diurnal_ranges(self, time: float) -> list[tuple[int, int]]:
    """The available clients at ``time``: ranges of :attr:`_by_phase`'s order.

    ``sin(2 pi x) > h`` exactly when ``x mod 1`` lies in ``(x0, 1/2 - x0)``,
    ``x0 = asin(h) / (2 pi)``; with ``x = t / day + phi_i``, the available
    phases are an arc of the circle: one or two ranges of the sorted phases
    (O(log N), not O(N), per round).
    """
    a = self.availability
    x0 = math.asin(a.threshold) / (2 * math.pi)
    start = (x0 - time / (a.day_hours * 3600.0)) % 1.0
    end = start + 0.5 - 2 * x0
    phases = self._by_phase[1]
    lo = int(np.searchsorted(phases, start, side='right'))
    if end <= 1.0:
      return [(lo, int(np.searchsorted(phases, end, side='left')))]
    return [(lo, phases.size),
            (0, int(np.searchsorted(phases, end - 1.0, side='left')))]

  def sample_available(self, round_num: int, time: float,
                       size: int) -> tuple[np.ndarray, int]:
    """Up to ``size`` clients drawn uniformly without replacement among those
    available in round ``round_num`` at ``time``: ``(sorted int32 ids,
    number available)``, from ``(seed, round_num, time)``. With
    ``'always'``, the draw of :class:`fedjx.datasets.CohortSampler`: a model
    of perfect clients trains on the cohorts of a run without one."""
    if self.availability.kind == 'always':  # CohortSampler's own draw.
      sampler = CohortSampler(self.num_clients, min(size, self.num_clients),
                              self.seed)
      return sampler.sample(round_num), self.num_clients
    gen = _seeding.rng(SAMPLE, self.seed, round_num)
    if self.availability.kind == 'bernoulli':
      pool = np.flatnonzero(self.available(round_num, time))
      ids = gen.choice(pool, size=min(size, pool.size), replace=False)
      return np.sort(ids).astype(np.int32), int(pool.size)
    ranges = self._diurnal_ranges(time)
    count = sum(hi - lo for lo, hi in ranges)
    ranks = gen.choice(count, size=min(size, count), replace=False)
    first = ranges[0][1] - ranges[0][0]
    positions = np.where(ranks < first, ranges[0][0] + ranks,
                         ranges[-1][0] + ranks - first)
    return np.sort(self._by_phase[0][positions]).astype(np.int32), int(count)

  def step_seconds(self, round_num: int, client_ids: np.ndarray) -> np.ndarray:
    """Seconds per local step of the cohort ``client_ids`` in round
    ``round_num`` (the jitter is drawn per cohort position)."""
    ids = np.asarray(client_ids, np.int64)
    base = self.base_step_seconds[ids]
    if self.speed.jitter == 0.0:
      return base
    z = _seeding.rng(JITTER, self.seed, round_num).standard_normal(ids.shape)
    return base * np.exp(self.speed.jitter * z)

  def dropped_out(self, round_num: int, client_ids: np.ndarray) -> np.ndarray:
    """``bool``: which of the cohort ``client_ids`` drop out in round
    ``round_num`` (drawn per cohort position)."""
    ids = np.asarray(client_ids, np.int64)
    u = _seeding.rng(DROPOUT, self.seed, round_num).random(ids.shape)
    return u < self.dropout_rates[ids]

  def duration(self, client_id: int, start_time: float, steps: int) -> float:
    """Seconds from ``start_time`` until ``client_id`` reports ``steps`` steps.

    ``c + steps * s_i``, with the jitter drawn from ``(seed, client_id,
    start_time in ms)``: a pure function of its arguments, for asynchronous
    schedules (:mod:`fedjx.datasets.async_schedule`), where clients start at
    any time rather than at rounds.
    """
    cid = int(client_id)
    step = float(self.base_step_seconds[cid])
    if self.speed.jitter:
      ms = int(round(max(float(start_time), 0.0) * 1000.0))
      z = _seeding.rng(ASYNC_JITTER, self.seed, cid, ms).standard_normal()
      step *= math.exp(self.speed.jitter * z)
    return self.speed.comm_seconds + int(steps) * step

  def close_round(self, cohort: Cohort, round_num: int, start_time: float,
                  available: int | None = None) -> tuple[Cohort, RoundReport]:
    """The cohort the server aggregates, and what happened, for one round.

    Args:
      cohort: the round's NumPy cohort as built (padding clients allowed);
        a client's local steps ``tau_i`` are its steps with a real example.
      round_num: the round.
      start_time: its simulated start time, seconds.
      available: the number of clients available at the start (reported).

    Returns:
      ``(cohort, report)``: the cohort with dropped and left-out clients made
      padding clients and partial clients' later steps masked (new arrays for
      ``mask``, ``num_examples`` and ``client_ids``; ``batches`` shared), and
      the :class:`RoundReport`.
    """
    ids = np.asarray(cohort.client_ids)
    mask = np.asarray(cohort.mask)
    real = (ids != PADDING_CLIENT) & (np.asarray(cohort.num_examples) > 0)
    safe_ids = np.where(real, ids, 0)
    steps = np.any(mask, axis=-1).sum(axis=-1)
    step_s = self.step_seconds(round_num, safe_ids)
    comm = self.speed.comm_seconds
    finish = comm + steps * step_s
    dropped = real & self.dropped_out(round_num, safe_ids)
    candidates = real & ~dropped
    d = self.deadline
    order = np.argsort(np.where(candidates, finish, np.inf), kind='stable')
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    count = int(candidates.sum())
    close = float(finish[candidates].max()) if count else math.inf
    if d.reports is not None and count > d.reports:
      close = float(finish[order[d.reports - 1]])
    if d.seconds is not None:
      close = min(close, d.seconds)
    on_time = candidates & (finish <= close)
    if d.reports is not None:
      on_time &= rank < d.reports
    late = candidates & ~on_time
    done = np.zeros_like(steps)
    if d.late == 'partial' and late.any():
      done = np.floor((close - comm) / step_s).astype(np.int64)
      done = np.where(late, np.clip(done, 0, steps), 0)
    partial = late & (done > 0)
    kept = on_time | partial
    if not kept.any():
      close = d.seconds if d.seconds is not None else self.idle_seconds
    new_mask = mask & kept[:, None, None]
    if partial.any():
      step_index = np.arange(mask.shape[1])
      new_mask &= ~(partial[:, None] & (step_index[None, :] >= done[:, None]))[
          :, :, None]
    out = cohort._replace(
        mask=new_mask,
        num_examples=np.where(kept, cohort.num_examples, 0).astype(np.float32),
        client_ids=np.where(kept, ids, PADDING_CLIENT).astype(np.int32))
    report = RoundReport(
        round=int(round_num), start_time=float(start_time),
        duration=float(close),
        available=int(real.sum() if available is None else available),
        sampled=int(real.sum()), reported=int(on_time.sum()),
        partial=int(partial.sum()), late=int((late & ~partial).sum()),
        dropped=int(dropped.sum()))
    return out, report

  def sampler(self, cohort_size: int) -> AvailableSampler:
    """A sampler of up to ``cohort_size`` clients among the available ones."""
    return AvailableSampler(self, cohort_size)


@dataclasses.dataclass(frozen=True)
class AvailableSampler:
  """Samples up to ``cohort_size`` clients among those available at ``start_time``.

  Uniformly without replacement among the clients ``model.available(r,
  start_time)``, as a function of ``(seed, r, start_time)``; when fewer are
  available, all of them (the cohort is filled with padding clients). A
  :class:`fedjx.datasets.Sampler` for one start time: ``at(t)`` gives the
  sampler of a round starting at ``t``. Over-selection is sampling more
  clients than the server needs reports (``cohort_size`` above
  ``deadline.reports``).
  """

  model: SystemModel
  cohort_size: int
  start_time: float = 0.0

  def __post_init__(self):
    c = self.cohort_size
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not (
        1 <= c <= self.model.num_clients):
      raise ValueError(f'AvailableSampler: cohort_size={c!r}; it must be an int '
                       f'in [1, {self.model.num_clients}] (the population).')

  @property
  def seed(self) -> int:
    return self.model.seed

  def at(self, start_time: float) -> AvailableSampler:
    return dataclasses.replace(self, start_time=float(start_time))

  def available_ids(self, round_num: int) -> np.ndarray:
    return np.flatnonzero(self.model.available(round_num, self.start_time))

  def draw(self, round_num: int) -> tuple[np.ndarray, int]:
    """``(sorted int32 ids, number of clients available)`` of round ``round_num``."""
    if round_num < 0:
      raise ValueError(f'round_num={round_num}; rounds are numbered from 0.')
    return self.model.sample_available(round_num, self.start_time,
                                       self.cohort_size)

  def sample(self, round_num: int) -> np.ndarray:
    """``int32``: the sorted ids of round ``round_num``'s clients."""
    return self.draw(round_num)[0]


# ------------------------------------------------------------------ configs

_PARTS = {'availability': Availability, 'dropout': Dropout, 'speed': Speed,
          'deadline': Deadline}


def from_config(spec: Mapping[str, Any] | None, num_clients: int, seed: int = 0,
                model_bytes: float | None = None) -> SystemModel | None:
  """A :class:`SystemModel` from ``config.systems`` (None or ``{}``: none).

  ``spec`` is a dict with any of ``availability``, ``dropout``, ``speed``,
  ``deadline`` (dicts of the fields of :class:`Availability`,
  :class:`Dropout`, :class:`Speed`, :class:`Deadline`) and
  ``idle_seconds``. ``model_bytes`` fills ``speed.model_bytes`` when unset.
  """
  if spec is None:
    return None
  if hasattr(spec, 'to_dict'):
    spec = spec.to_dict()
  if not isinstance(spec, Mapping):
    raise ValueError(f'systems={spec!r}; it must be a dict with any of '
                     f'{sorted(_PARTS) + ["idle_seconds"]}, or None.')
  if not spec:
    return None
  valid = sorted(_PARTS) + ['idle_seconds']
  parts = {}
  for key, value in spec.items():
    if key == 'idle_seconds':
      parts[key] = value
      continue
    if key not in _PARTS:
      raise ValueError(f'systems.{key}: unknown part; valid parts: {valid}.')
    if hasattr(value, 'to_dict'):
      value = value.to_dict()
    if not isinstance(value, Mapping):
      raise ValueError(f'systems.{key}={value!r}; it must be a dict of the '
                       f'fields {[f.name for f in dataclasses.fields(_PARTS[key])]}.')
    fields = [f.name for f in dataclasses.fields(_PARTS[key])]
    for name in value:
      if name not in fields:
        raise ValueError(f'systems.{key}.{name}: unknown field; valid fields: '
                         f'{fields}.')
    parts[key] = _PARTS[key](**value)
  speed = parts.get('speed', Speed())
  if speed.model_bytes is None and model_bytes is not None:
    parts['speed'] = dataclasses.replace(speed, model_bytes=float(model_bytes))
  return SystemModel(num_clients=num_clients, seed=seed, **parts)


# ------------------------------------------------------------------ rounds

def system_cohort_iterator(dataset: FederatedDataset, model: SystemModel,
                           cohort_size: int, batch_size: int, *,
                           start_round: int = 0, start_time: float = 0.0,
                           num_rounds: int | None = None,
                           num_epochs: int | None = None,
                           num_steps: int | None = None,
                           max_steps: int | None = None, shuffle: bool = True,
                           bucket: bool = True,
                           mesh: jax.sharding.Mesh | None = None,
                           prefetch: int = 1) -> Prefetcher[tuple[Cohort, RoundReport]]:
  """``(placed cohort, report)`` of rounds ``start_round, start_round + 1, ...``.

  Round ``r`` starts at the end of round ``r - 1`` (round ``start_round`` at
  ``start_time``): its clients are ``model.sampler(cohort_size).at(t_r)``'s,
  batched as :func:`fedjx.datasets.cohort_iterator` batches them (padded to
  ``cohort_size``, shuffled with ``model.seed``), then closed by
  :meth:`SystemModel.close_round`. Rounds are produced in order (one
  background thread with ``prefetch > 0``), each from the clock the one
  before left. Cohorts are placed on ``mesh``, else on the mesh set with
  ``jax.set_mesh`` when the iterator is made, as
  :func:`fedjx.datasets.cohort_iterator` places them.
  """
  sampler = model.sampler(cohort_size)
  mesh = calling_thread_mesh(mesh)
  batching = Batching(batch_size, num_epochs, num_steps, max_steps, shuffle, bucket)
  clock = {'round': start_round, 'time': float(start_time)}

  def produce(round_num: int) -> tuple[Cohort, RoundReport]:
    if round_num != clock['round']:
      raise RuntimeError(f'system rounds run in order: asked for round '
                         f'{round_num}, the clock is at round {clock["round"]}.')
    ids, available = sampler.at(clock['time']).draw(round_num)
    built = batching.cohort(dataset, ids, model.seed, round_num, pad_to=cohort_size)
    cohort, report = model.close_round(built, round_num, clock['time'], available)
    clock['round'], clock['time'] = round_num + 1, report.end_time
    return place_cohort(cohort, mesh), report

  stop = None if num_rounds is None else start_round + num_rounds
  return Prefetcher(produce, start=start_round, stop=stop, prefetch=prefetch)


__all__ = ['AVAILABILITIES', 'AvailableSampler', 'Availability', 'Deadline',
           'Dropout', 'LATE', 'RoundReport', 'Speed', 'SystemModel',
           'from_config', 'system_cohort_iterator']
