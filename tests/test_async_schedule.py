"""The asynchronous schedule against a brute-force event simulation."""

import numpy as np
import pytest

from fedjx import datasets
from fedjx.algorithms.fedbuff_lib import AsyncCohort
from fedjx.datasets import _seeding
from fedjx.datasets import async_schedule as sched


def _brute_force(num_clients, concurrency, buffer_size, duration, seed, steps):
  """The schedule by scanning every job at every step (no heap, no cache).

  Draws follow the documented stream: ``rng(ASYNC_SCHEDULE, seed, d)`` for
  the ``d``-th start (0: the initial ``M``), ``choice`` over the sorted idle
  ids without replacement.
  """
  jobs = []  # [finish, start order, client, version, reported]
  busy = set()

  def start(version, count, now, draw):
    gen = _seeding.rng(sched.ASYNC_SCHEDULE, seed, draw)
    idle = np.array(sorted(set(range(num_clients)) - busy))
    for c in gen.choice(idle, size=count, replace=False):
      jobs.append([now + duration(int(c), now), len(jobs), int(c), version, False])
      busy.add(int(c))

  start(0, concurrency, 0.0, 0)
  out = []
  for r in range(steps):
    in_flight = [j for j in jobs if not j[4]]
    assert len(in_flight) == concurrency
    first = sorted(in_flight, key=lambda j: (j[0], j[1]))[:buffer_size]
    for j in first:
      j[4] = True
      busy.discard(j[2])
    out.append(([j[2] for j in first], [r - j[3] for j in first], first[-1][0]))
    start(r + 1, buffer_size, first[-1][0], r + 1)
  return out


def _random_durations(num_clients, seed=3):
  """Durations that also depend on the start time (each job its own)."""
  speed = np.random.default_rng(seed).lognormal(0.0, 1.0, num_clients)
  return lambda c, t: float(speed[c] * (1.0 + 0.5 * np.sin(t + c)))


@pytest.mark.parametrize('n, m, k', [(12, 5, 2), (7, 7, 3), (20, 4, 1), (6, 6, 6)])
def test_scheduler_matches_brute_force(n, m, k):
  duration = _random_durations(n)
  scheduler = sched.AsyncScheduler(n, m, k, duration, seed=5)
  reference = _brute_force(n, m, k, duration, 5, 40)
  for r, (ids, staleness, time) in enumerate(reference):
    step = scheduler.step(r)
    np.testing.assert_array_equal(step.client_ids, ids)
    np.testing.assert_array_equal(step.staleness, staleness)
    assert step.time == time  # The same float additions, in the same order.
    assert step.client_ids.dtype == np.int32 and step.staleness.dtype == np.int32


def test_ties_report_in_start_order():
  # Every job takes 1 s: the M first jobs finish together; steps take them
  # K at a time in the order they started, and the clock stays at 1 s.
  scheduler = sched.AsyncScheduler(10, 6, 2, lambda c, t: 1.0, seed=0)
  reference = _brute_force(10, 6, 2, lambda c, t: 1.0, 0, 3)
  for r in range(3):
    step = scheduler.step(r)
    np.testing.assert_array_equal(step.client_ids, reference[r][0])
    np.testing.assert_array_equal(step.staleness, [r, r])
    assert step.time == 1.0
  assert scheduler.step(3).time == 2.0  # The jobs started at 1 s.


def test_buffer_equal_to_concurrency_is_synchronous():
  scheduler = sched.AsyncScheduler(30, 8, 8, _random_durations(30), seed=1)
  times = []
  for r in range(20):
    step = scheduler.step(r)
    np.testing.assert_array_equal(step.staleness, np.zeros(8))
    assert len(set(step.client_ids.tolist())) == 8
    times.append(step.time)
  assert np.all(np.diff(times) >= 0)


def test_invariants_of_a_long_schedule():
  n, m, k = 50, 12, 3
  scheduler = sched.AsyncScheduler(n, m, k, _random_durations(n), seed=2)
  previous = 0.0
  for r in range(300):
    step = scheduler.step(r)
    assert len(set(step.client_ids.tolist())) == k  # A client reports once.
    assert np.all(step.staleness >= 0) and np.all(step.staleness <= r)
    assert step.time >= previous
    previous = step.time
  assert int(scheduler._busy.sum()) == m  # pylint: disable=protected-access


def test_deterministic_and_resumable():
  duration = _random_durations(40)
  full = sched.AsyncScheduler(40, 10, 4, duration, seed=9)
  steps = [full.step(r) for r in range(30)]
  resumed = sched.AsyncScheduler(40, 10, 4, duration, seed=9)
  for r in (17, 3, 29):  # Any order: later steps are simulated once, kept.
    got = resumed.step(r)
    np.testing.assert_array_equal(got.client_ids, steps[r].client_ids)
    np.testing.assert_array_equal(got.staleness, steps[r].staleness)
    assert got.time == steps[r].time
  other = sched.AsyncScheduler(40, 10, 4, duration, seed=10)
  assert any((other.step(r).client_ids != steps[r].client_ids).any()
             for r in range(30))


def test_lognormal_durations():
  n, median, sigma = 4000, 30.0, 0.7
  duration = sched.lognormal_durations(n, median=median, sigma=sigma, seed=4)
  logs = np.log([duration(c, 0.0) for c in range(n)])
  # The mean and std of n standard normals: standard errors 1/sqrt(n) and
  # 1/sqrt(2n); 5 standard errors.
  assert abs(logs.mean() - np.log(median)) < 5 * sigma / np.sqrt(n)
  assert abs(logs.std() - sigma) < 5 * sigma / np.sqrt(2 * n)
  assert duration(7, 0.0) == duration(7, 123.0)  # Fixed in time.
  again = sched.lognormal_durations(n, median=median, sigma=sigma, seed=4)
  assert duration(11, 0.0) == again(11, 5.0)


@pytest.mark.parametrize('kwargs, match', [
    (dict(num_clients=5, concurrency=6, buffer_size=2), r'concurrency=6'),
    (dict(num_clients=5, concurrency=3, buffer_size=4), r'buffer_size=4'),
    (dict(num_clients=5, concurrency=3, buffer_size=0), r'buffer_size=0'),
    (dict(num_clients=5, concurrency=3, buffer_size=1, seed=-1), r'seed=-1'),
])
def test_errors_name_the_argument(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sched.AsyncScheduler(duration=lambda c, t: 1.0, **kwargs)


def test_bad_duration_is_one_line():
  with pytest.raises(ValueError, match=r'duration\(\d+, 0.0\) = -1.0'):
    sched.AsyncScheduler(4, 2, 1, lambda c, t: -1.0)
  with pytest.raises(ValueError, match=r"name='gamma'"):
    sched.make_durations({'name': 'gamma'}, 4, 0)
  with pytest.raises(ValueError, match=r'sigma=-1'):
    sched.make_durations({'name': 'lognormal', 'sigma': -1}, 4, 0)


def test_async_cohort_iterator():
  rng = np.random.default_rng(0)
  n = 9
  groups = [np.arange(3 * c, 3 * c + 2 + c % 2) for c in range(n)]
  data = datasets.from_arrays({'x': rng.normal(size=(3 * n, 2)).astype(np.float32),
                               'y': np.arange(3 * n, dtype=np.int32)},
                              groups=groups)
  scheduler = sched.AsyncScheduler(n, 5, 2, _random_durations(n), seed=3)
  with sched.async_cohort_iterator(data, scheduler, 2, start_round=4,
                                   num_rounds=3, prefetch=1) as it:
    got = list(it)
  assert len(got) == 3
  for r, c in zip(range(4, 7), got):
    step = scheduler.step(r)
    assert isinstance(c, AsyncCohort)
    np.testing.assert_array_equal(c.client_ids, step.client_ids)
    np.testing.assert_array_equal(c.staleness, step.staleness)
    expected = datasets.make_cohort(data, step.client_ids, 2,
                                    shuffle_seed=scheduler.seed, round_num=r)
    np.testing.assert_array_equal(c.batches['y'], expected.batches['y'])
    np.testing.assert_array_equal(c.mask, expected.mask)
