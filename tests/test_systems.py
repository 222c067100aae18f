"""The system model: availability, dropout, speed, deadlines, the clock."""

import math

import jax
import numpy as np
import pytest

from fedjx import datasets
from fedjx.datasets import _seeding
from fedjx.datasets import systems
from fedjx.datasets.cohort import PADDING_CLIENT, Cohort


def _cohort(steps, ids=None, batch_size=2):
  """A cohort whose client ``c`` has ``steps[c]`` full steps (0: padding)."""
  clients = [{'x': np.full((s * batch_size, 1), c, np.float32)}
             for c, s in enumerate(steps)]
  ids = list(range(len(steps))) if ids is None else ids
  cohort = Cohort.from_clients(clients, batch_size, client_ids=ids)
  pad = np.asarray(steps) == 0
  return cohort._replace(client_ids=np.where(pad, PADDING_CLIENT,
                                             cohort.client_ids).astype(np.int32))


def _model(num_clients=8, **parts):
  return systems.SystemModel(num_clients=num_clients, seed=3, **parts)


def _reference(model, cohort, round_num):
  """The round simulated client by client, in the order reports arrive."""
  d, comm = model.deadline, model.speed.comm_seconds
  ids = np.where(cohort.client_ids == PADDING_CLIENT, 0, cohort.client_ids)
  step_s = model.step_seconds(round_num, ids)  # drawn per cohort position
  drops = model.dropped_out(round_num, ids)
  events = []
  for c, cid in enumerate(cohort.client_ids):
    if cid == PADDING_CLIENT:
      continue
    tau = int(np.any(cohort.mask[c], -1).sum())
    s, drop = float(step_s[c]), bool(drops[c])
    events.append((comm + tau * s, c, s, tau, drop))
  reports = sorted((e for e in events if not e[4]), key=lambda e: (e[0], e[1]))
  close = reports[-1][0] if reports else math.inf
  if d.reports is not None and len(reports) > d.reports:
    close = reports[d.reports - 1][0]
  if d.seconds is not None:
    close = min(close, d.seconds)
  kept = {}  # cohort position -> steps aggregated
  for n, (finish, c, s, tau, _) in enumerate(reports):
    if finish <= close and (d.reports is None or n < d.reports):
      kept[c] = tau
    elif d.late == 'partial':
      done = min(tau, max(0, math.floor((close - comm) / s)))
      if done:
        kept[c] = done
  if not kept:
    close = d.seconds if d.seconds is not None else model.idle_seconds
  return kept, close, sum(e[4] for e in events)


@pytest.mark.parametrize('deadline', [
    systems.Deadline(),
    systems.Deadline(seconds=7.0),
    systems.Deadline(seconds=7.0, late='partial'),
    systems.Deadline(reports=3),
    systems.Deadline(reports=3, late='partial'),
    systems.Deadline(seconds=0.5),
])
def test_close_round_matches_a_client_by_client_simulation(deadline):
  model = _model(deadline=deadline, dropout=systems.Dropout(p=0.2),
                 speed=systems.Speed(step_seconds=1.0, sigma=0.8, jitter=0.3,
                                     bandwidth=100.0, model_bytes=50.0))
  cohort = _cohort([4, 2, 0, 3, 4, 1, 2], ids=[5, 1, 0, 7, 2, 6, 3])
  for r in range(6):
    out, report = model.close_round(cohort, r, start_time=10.0 * r)
    kept, close, dropped = _reference(model, cohort, r)
    assert report.duration == pytest.approx(close, rel=1e-12)
    assert report.start_time == 10.0 * r
    assert report.dropped == dropped
    assert report.sampled == 6
    full = {c for c, t in kept.items()
            if t == np.any(cohort.mask[c], -1).sum()}
    assert report.reported + report.partial == len(kept)
    assert report.reported + report.partial + report.late + report.dropped == 6
    for c in range(7):
      steps_out = int(np.any(out.mask[c], -1).sum())
      if c in kept:
        assert out.client_ids[c] == cohort.client_ids[c]
        assert out.num_examples[c] == cohort.num_examples[c]
        assert steps_out == kept[c]
        # The kept steps are the first ones, untouched.
        np.testing.assert_array_equal(out.mask[c, :kept[c]],
                                      cohort.mask[c, :kept[c]])
      else:
        assert out.client_ids[c] == PADDING_CLIENT
        assert out.num_examples[c] == 0 and steps_out == 0
    if deadline.late == 'drop':
      assert report.partial == 0 and report.reported == len(full)


def test_comm_and_step_times():
  speed = systems.Speed(step_seconds=2.0, sigma=0.5, bandwidth=10.0,
                        model_bytes=30.0)
  model = _model(num_clients=1000, speed=speed)
  assert speed.comm_seconds == 6.0  # Model down and update up.
  z = _seeding.rng(systems.SPEED, 3).standard_normal(1000)
  np.testing.assert_allclose(model.base_step_seconds, 2.0 * np.exp(0.5 * z),
                             rtol=1e-15)
  # Log-normal across clients: the log step times have mean log 2, sd 0.5.
  logs = np.log(model.base_step_seconds)
  assert abs(logs.mean() - math.log(2.0)) < 5 * 0.5 / math.sqrt(1000)
  # Without jitter, the asynchronous duration is c + tau s_i, any start.
  for cid in (0, 17, 999):
    for t in (0.0, 123.4):
      assert model.duration(cid, t, 5) == pytest.approx(
          6.0 + 5 * model.base_step_seconds[cid], rel=1e-15)
  jittered = _model(num_clients=1000, speed=systems.Speed(jitter=0.5))
  assert jittered.duration(4, 1.0, 3) == jittered.duration(4, 1.0, 3)
  assert jittered.duration(4, 1.0, 3) != jittered.duration(4, 2.0, 3)


def test_diurnal_availability_follows_each_clients_phase():
  a = systems.Availability(kind='diurnal', day_hours=24.0, threshold=0.5)
  model = _model(num_clients=20_000, availability=a)
  phases = _seeding.rng(systems.PHASE, 3).random(20_000)
  for hours in (0.0, 5.0, 13.5):
    t = hours * 3600
    expected = np.sin(2 * np.pi * (hours / 24 + phases)) > 0.5
    np.testing.assert_array_equal(model.available(0, t), expected)
    # A third of the population at any time (1/2 - asin(1/2)/pi = 1/3).
    frac = model.available(0, t).mean()
    assert abs(frac - 1 / 3) < 5 * math.sqrt(2 / 9 / 20_000)
  assert a.fraction == pytest.approx(1 / 3)
  # A client is available for a third of each day, at its own hours.
  hours = np.arange(0, 24, 0.25)
  mine = [model.available(0, h * 3600)[7] for h in hours]
  assert np.mean(mine) == pytest.approx(1 / 3, abs=0.25 / 24 * 2)


def test_bernoulli_availability_and_dropout_rates():
  model = _model(num_clients=10_000,
                 availability=systems.Availability(kind='bernoulli', p=0.3),
                 dropout=systems.Dropout(p=0.2, concentration=4.0))
  a0, a1 = model.available(0, 0.0), model.available(1, 0.0)
  np.testing.assert_array_equal(a0, model.available(0, 99.0))  # Per round.
  assert not np.array_equal(a0, a1)
  assert abs(a0.mean() - 0.3) < 5 * math.sqrt(0.21 / 10_000)
  rates = model.dropout_rates
  # Beta(0.8, 3.2): mean 0.2, variance 0.2 * 0.8 / 5.
  assert abs(rates.mean() - 0.2) < 5 * math.sqrt(0.032 / 10_000)
  assert abs(rates.var() - 0.032) < 0.004
  drops = np.mean([model.dropped_out(r, np.arange(10_000)).mean()
                   for r in range(5)])
  assert abs(drops - 0.2) < 5 * math.sqrt(0.16 / 50_000)


def test_sampler_draws_only_available_clients():
  model = _model(num_clients=200, availability=systems.Availability(
      kind='diurnal', threshold=0.8))
  sampler = model.sampler(40)
  for r, t in enumerate([0.0, 3600.0, 7 * 3600.0, 30.5 * 3600.0]):
    s = sampler.at(t)
    pool = np.flatnonzero(model.available(r, t))
    ids, count = s.draw(r)
    assert count == pool.size
    assert ids.dtype == np.int32 and np.all(np.diff(ids) > 0)
    assert len(ids) == min(40, pool.size)
    assert set(ids) <= set(pool)
    np.testing.assert_array_equal(ids, s.sample(r))  # Deterministic.
  # Over-selection: fewer available clients than cohort_size fill padding.
  few = systems.AvailableSampler(model, 150)
  assert len(few.sample(0)) == np.flatnonzero(model.available(0, 0.0)).size


def test_a_round_with_no_reports_waits():
  model = _model(deadline=systems.Deadline(seconds=1.0),
                 speed=systems.Speed(step_seconds=5.0))
  out, report = model.close_round(_cohort([2, 3]), 0, 0.0)
  assert report.duration == 1.0 and report.late == 2
  assert np.all(out.client_ids == PADDING_CLIENT) and not out.mask.any()
  idle = _model(idle_seconds=42.0)
  _, report = idle.close_round(_cohort([0, 0]), 0, 0.0)
  assert report.duration == 42.0 and report.sampled == 0


def test_iterator_resumes_with_the_stored_clock():
  data = datasets.load_digits(num_clients=60, alpha=0.5, seed=0)[0]
  model = systems.from_config(dict(
      availability=dict(kind='diurnal', day_hours=1.0, threshold=0.2),
      dropout=dict(p=0.1),
      speed=dict(step_seconds=2.0, sigma=1.0, jitter=0.2),
      deadline=dict(seconds=60.0, late='partial')), num_clients=60, seed=1)
  kw = dict(num_epochs=1, prefetch=0)
  with systems.system_cohort_iterator(data, model, 12, 10, num_rounds=6,
                                      **kw) as it:
    whole = list(it)
  times = [r.end_time for _, r in whole]
  assert all(b > a for a, b in zip(times, times[1:]))
  assert whole[0][1].start_time == 0.0
  with systems.system_cohort_iterator(
      data, model, 12, 10, start_round=3, start_time=whole[2][1].end_time,
      num_rounds=3, prefetch=1, num_epochs=1) as it:
    resumed = list(it)
  for (a, ra), (b, rb) in zip(whole[3:], resumed):
    assert ra == rb
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_from_config_and_errors_name_the_field():
  assert systems.from_config(None, 5) is None
  assert systems.from_config({}, 5) is None
  model = systems.from_config(dict(speed=dict(bandwidth=1e6)), 5, seed=2,
                              model_bytes=4e6)
  assert model.speed.model_bytes == 4e6 and model.seed == 2
  assert model.speed.comm_seconds == 8.0
  bad = [
      (dict(availability=dict(kind='sometimes')), 'systems.availability.kind'),
      (dict(availability=dict(kind='diurnal', threshold=1.0)),
       'systems.availability.threshold'),
      (dict(dropout=dict(p=1.0)), 'systems.dropout.p'),
      (dict(speed=dict(step_seconds=0)), 'systems.speed.step_seconds'),
      (dict(speed=dict(sigma=float('nan'))), 'systems.speed.sigma'),
      (dict(deadline=dict(reports=0)), 'systems.deadline.reports'),
      (dict(deadline=dict(late='wait')), 'systems.deadline.late'),
      (dict(deadline=dict(second=3)), 'systems.deadline.second'),
      (dict(clock=dict()), 'systems.clock'),
  ]
  for spec, where in bad:
    with pytest.raises(ValueError) as e:
      systems.from_config(spec, 5)
    assert where in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize('hours', [3.0, 20.0])  # one arc of phases, or two
def test_sampler_is_uniform_over_the_available_clients(hours):
  model = _model(num_clients=300, availability=systems.Availability(
      kind='diurnal', threshold=0.5))
  s = model.sampler(10).at(hours * 3600.0)
  pool = s.available_ids(0)
  counts = np.zeros(300)
  rounds = 3000
  for r in range(rounds):
    np.add.at(counts, s.sample(r), 1)
  assert set(np.flatnonzero(counts)) == set(pool)
  # Each available client is drawn with probability 10 / |pool| a round.
  q = 10 / pool.size
  sd = math.sqrt(rounds * q * (1 - q))
  assert np.all(np.abs(counts[pool] - rounds * q) < 5 * sd)


def test_perfect_clients_train_on_todays_cohorts():
  """Always available, no dropout, no deadline: the cohorts of a plain run."""
  data = datasets.load_digits(num_clients=40, alpha=0.5, seed=0)[0]
  model = systems.from_config(dict(speed=dict(step_seconds=1.5, sigma=0.5)),
                              num_clients=40, seed=4)
  kw = dict(num_rounds=4, num_epochs=1, prefetch=0)
  with systems.system_cohort_iterator(data, model, 8, 10, **kw) as it:
    rounds = list(it)
  with datasets.cohort_iterator(data, 8, 10, seed=4, **kw) as it:
    plain = list(it)
  for (cohort, report), expected in zip(rounds, plain):
    for x, y in zip(jax.tree.leaves(cohort), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert report.reported == report.sampled == 8
    assert report.late == report.dropped == report.partial == 0


def test_prefetched_system_cohorts_are_sharded_over_the_clients_axis():
  data = datasets.load_digits(num_clients=40, alpha=0.5, seed=0)[0]
  model = systems.from_config(dict(dropout=dict(p=0.2)), num_clients=40, seed=1)
  mesh = jax.make_mesh((4,), ('clients',))
  with jax.set_mesh(mesh):  # Found when the iterator is made, used on the
    with systems.system_cohort_iterator(  # prefetching thread.
        data, model, 8, 10, num_rounds=2, prefetch=1, num_epochs=1) as it:
      cohorts = [c for c, _ in it]
  for cohort in cohorts:
    sharding = cohort.mask.sharding
    assert isinstance(sharding, jax.sharding.NamedSharding)
    assert sharding.spec[0] == 'clients' and len(sharding.device_set) == 4
