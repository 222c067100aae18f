"""config.systems in the runner: the simulated clock, counts, and resumption."""

import os

import jax
import ml_collections
import numpy as np
import pytest

from fedjx import datasets
from fedjx.experiments import config as config_lib
from fedjx.experiments import experiment
from fedjx.experiments import metrics_writers
from fedjx.experiments import registry
from fedjx.experiments import runner

SYSTEMS = dict(
    availability=dict(kind='diurnal', day_hours=2.0, threshold=-0.2),
    dropout=dict(p=0.15),
    speed=dict(step_seconds=3.0, sigma=1.0, jitter=0.3, bandwidth=2e5),
    deadline=dict(seconds=40.0, reports=5, late='partial'))


def _config(rounds, **more):
  config = dict(
      seed=2, rounds=rounds, cohort_size=7, batch_size=16, local_steps=4,
      eval_every=2, checkpoint_every=2, progress=False, plot=False,
      tensorboard=False, prefetch=1, systems=SYSTEMS,
      dataset=dict(name='digits', num_clients=30, alpha=0.5),
      model=dict(name='logistic_regression'),
      algorithm=dict(name='fednova',
                     client_optimizer=dict(name='sgd', learning_rate=0.1)))
  config.update(more)
  return ml_collections.ConfigDict(config)


def _rows(workdir):
  path = metrics_writers.metrics_path(workdir, 'jsonl')
  return [{k: v for k, v in r.items() if k != 'elapsed_s'}
          for r in metrics_writers.read_metrics(path)]


def test_the_runner_records_the_system_models_clock_and_counts(tmp_path):
  config = config_lib.validate(_config(4))
  runner.run(config, str(tmp_path / 'whole'), log=lambda m: None)
  rows = _rows(str(tmp_path / 'whole'))
  # The clock and counts are the system model's, round by round.
  exp = experiment.build(config)
  assert exp.systems.speed.model_bytes == 4 * (64 * 10 + 10)
  with datasets.system_cohort_iterator(
      exp.data.train, exp.systems, 7, 16, num_rounds=4, num_steps=4,
      prefetch=0) as it:
    reports = [r for _, r in it]
  assert rows[0]['simulated_time'] == 0.0
  for r, report in zip(rows[1:], reports):
    assert {k: r[k] for k in report.metrics()} == pytest.approx(
        report.metrics(), rel=1e-15)
    assert r['sampled_clients'] == (r['reported_clients'] + r['partial_clients']
                                    + r['late_clients'] + r['dropped_clients'])
    assert r['reported_clients'] <= 5  # deadline.reports
    assert r['round_seconds'] <= 40.0
    # The algorithm trains exactly the clients the system model kept.
    assert r['clients'] == r['reported_clients'] + r['partial_clients']
  times = [r['simulated_time'] for r in rows]
  assert all(b > a for a, b in zip(times, times[1:]))
  assert sum(r['partial_clients'] for r in rows[1:]) > 0
  assert sum(r['dropped_clients'] for r in rows[1:]) > 0


@pytest.mark.slow  # ~25 s: three runs
def test_a_resumed_run_continues_the_simulated_clock(tmp_path):
  whole = runner.run(_config(4), str(tmp_path / 'whole'), log=lambda m: None)
  rows = _rows(str(tmp_path / 'whole'))
  # Stopped after round 2, then continued to 4: the same clock and model.
  part = str(tmp_path / 'part')
  runner.run(_config(2), part, log=lambda m: None)
  resumed = runner.run(_config(4), part, log=lambda m: None)
  assert _rows(part) == rows
  jax.tree.map(np.testing.assert_array_equal, resumed.state.params,
               whole.state.params)


def test_bad_systems_configs_are_one_line():
  bad = dict(SYSTEMS, deadline=dict(late='later'))
  with pytest.raises(config_lib.ConfigError,
                     match=r"config\.systems\.deadline\.late='later'"):
    config_lib.validate(_config(2, systems=bad))
  with pytest.raises(config_lib.ConfigError, match='config.systems.speed.warp'):
    config_lib.validate(_config(2, systems=dict(speed=dict(warp=2))))
  partial_with_steps = _config(2, algorithm=dict(name='fedavg', local_steps=3))
  with pytest.raises(registry.ConfigError, match="late='partial'") as e:
    experiment.build(config_lib.validate(partial_with_steps))
  assert '\n' not in str(e.value)


def test_plots_against_simulated_hours(tmp_path):
  from fedjx.experiments import plotting  # pylint: disable=g-import-not-at-top
  rows = [{'round': 0, 'eval_accuracy': 0.1, 'simulated_time': 0.0},
          {'round': 1, 'loss': 2.0, 'simulated_time': 1800.0},
          {'round': 2, 'eval_accuracy': 0.5, 'simulated_time': 7200.0}]
  assert plotting._series(rows, 'eval_accuracy', 'simulated_time') == (
      [0.0, 2.0], [0.1, 0.5])
  assert plotting._series(rows, 'eval_accuracy') == ([0, 2], [0.1, 0.5])
  path = plotting.plot_curves({'a': rows}, str(tmp_path / 'p.png'),
                              metrics=['eval_accuracy'], x='simulated_time')
  assert os.path.getsize(path) > 0


@pytest.mark.slow  # ~15 s: two runs
def test_perfect_clients_give_the_same_run(tmp_path):
  plain = runner.run(_config(3, systems={}), str(tmp_path / 'a'),
                     log=lambda m: None)
  perfect = runner.run(_config(3, systems=dict(speed=dict(step_seconds=1.0))),
                       str(tmp_path / 'b'), log=lambda m: None)
  jax.tree.map(np.testing.assert_array_equal, plain.state.params,
               perfect.state.params)
  for a, b in zip(plain.history, perfect.history):
    assert {k: v for k, v in b.items() if k in a and k != 'elapsed_s'} == {
        k: v for k, v in a.items() if k != 'elapsed_s'}
  # 4 local steps of 1 s a round, no communication time given.
  assert [r['simulated_time'] for r in perfect.history] == [0.0, 4.0, 8.0, 12.0]


def test_fedbuff_takes_its_durations_from_the_system_model():
  fedbuff = dict(name='fedbuff', concurrency=9, max_staleness=8,
                 client_optimizer=dict(name='sgd', learning_rate=0.1))
  config = config_lib.validate(_config(3, algorithm=fedbuff, cohort_size=3))
  exp = experiment.build(config)
  assert exp.systems is None  # No synchronous rounds: durations only.
  model = datasets.systems.from_config(
      SYSTEMS, 30, seed=2, model_bytes=4 * (64 * 10 + 10))
  # 4 local steps each (config.local_steps): c + 4 s_i from its start.
  expected = datasets.AsyncScheduler(
      30, 9, 3, lambda cid, t: model.duration(cid, t, 4), seed=2)
  for r in range(5):
    got, want = exp.scheduler.step(r), expected.step(r)
    np.testing.assert_array_equal(got.client_ids, want.client_ids)
    assert got.time == want.time
  both = dict(fedbuff, client_durations=dict(name='lognormal'))
  with pytest.raises(registry.ConfigError, match='give one of them'):
    experiment.build(config_lib.validate(_config(2, algorithm=both, cohort_size=3)))


def test_nan_clients_under_the_system_model_are_skipped_on_the_same_clock(tmp_path):
  """Rounds redone with the guard (fedjx.experiments.guarded_rounds) rebuild
  their cohorts from the system model at the checkpoint's clock."""
  import test_runner  # pylint: disable=import-outside-toplevel
  registry.register_dataset('digits_nan',
                            test_runner._digits_with_a_nan_client((9, 25)))  # pylint: disable=protected-access
  try:
    clean = _rows_of(runner.run(_config(5), str(tmp_path / 'clean'),
                                log=lambda m: None).workdir)
    config = _config(5)
    config.dataset.name = 'digits_nan'
    result = runner.run(config, str(tmp_path / 'nan'), log=lambda m: None)
    rows = _rows_of(result.workdir)
    assert [r['simulated_time'] for r in rows] == [r['simulated_time'] for r in clean]
    bad = [r['nonfinite_clients'] for r in rows[1:]]
    assert sum(bad) > 0 and all(b <= r['sampled_clients'] for b, r in zip(bad, rows[1:]))
    for r in rows[1:]:
      assert r['clients'] + r['nonfinite_clients'] == (r['reported_clients']
                                                       + r['partial_clients'])
    assert all(np.all(np.isfinite(np.asarray(p)))
               for p in jax.tree.leaves(result.state.params))
  finally:
    registry.DATASETS.pop('digits_nan')


def _rows_of(workdir):
  return _rows(workdir)
