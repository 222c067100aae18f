"""config.churn: a seeded schedule of DiLoCo replicas in fedjx-run rounds."""

import signal

import jax
import numpy as np
import pytest

from fedjx.experiments import churn
from fedjx.experiments import config as config_lib
from fedjx.experiments import config_base
from fedjx.experiments import experiment
from fedjx.experiments import network
from fedjx.experiments import runner
from fedjx.experiments.errors import ConfigError

M = 4          # Replicas: the digits population of 4 clients, all in every cohort.
H = 3          # Inner steps a round.
B = 16
ROUNDS = 6
CHAOS = dict(join=0.5, leave=0.3, fail=0.2, seed=3)
STEP_S, GBPS = 0.1, 0.001


def _config(churn_section=None, **changes):
  config = config_base.base_config()
  config.seed = 2
  config.rounds = ROUNDS
  config.cohort_size = M
  config.batch_size = B
  config.local_steps = H
  config.eval_every = ROUNDS
  config.checkpoint_every = 2
  config.progress = False
  config.plot = False
  config.tensorboard = False
  config.dataset = dict(name='digits', num_clients=M, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(name='diloco',
                          inner_optimizer=dict(name='sgd', learning_rate=0.1))
  config.network = dict(bandwidth_gbps=GBPS, step_seconds=STEP_S)
  if churn_section is not None:
    config.churn = churn_section
  for key, value in changes.items():
    setattr(config, key, value)
  return config


def _equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               a, b)


@pytest.mark.slow
def test_a_churned_run_is_the_replay_of_its_schedule_and_resumes(tmp_path):
  full = runner.run(_config(CHAOS), str(tmp_path / 'full'))
  assert full.step == ROUNDS and not full.interrupted
  schedule = churn.seeded_schedule(M, ROUNDS, **CHAOS)
  # The chaos run has joins, leaves and failures.
  assert any(r.joined for r in schedule.rounds[1:]) and any(r.left for r in schedule.rounds)
  assert any(r.failed for r in schedule.rounds)

  # The replay: the same config without churn (plain DiLoCo), each round's
  # cohort given round_cohort of the schedule on the host, the algorithm
  # called directly with the run's keys.
  exp = experiment.build(_config(nonfinite='off'))
  algo, state = exp.algorithm, exp.algorithm.init(exp.init_params)
  cohorts = exp.cohorts(0, ROUNDS)
  for r, cohort in zip(range(ROUNDS), cohorts):
    state, _ = algo.round(state, churn.round_cohort(cohort, schedule.round(r), M),
                          exp.round_key_for(r))
  cohorts.close()
  # The run masks the cohort inside its compiled round, the replay before
  # it: the same float32 operations on the same inputs, which XLA may fuse
  # differently. DiLoCo's rounds here chain about ROUNDS (H (2 d + 6) + 12)
  # rounded operations per parameter (d = 64 inputs a dot product, the
  # softmax, the SGD update, then the outer mean and Nesterov), so the
  # 2 gamma_n bound of n = 2500 covers any reordering of them.
  tol = 2 * 2500 * 2.0 ** -24 / (1 - 2500 * 2.0 ** -24)
  for got, want in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(state.params)):
    scale = float(np.max(np.abs(np.asarray(want))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol,
                               atol=tol * scale)

  # The rows: the schedule's counts, tokens H B |C_r| and the goodput
  # U_r / T_r of the run's own clock, as churn.goodput computes it.
  rows = [row for row in full.history if row['round'] > 0]
  assert [row['churn_contributing'] for row in rows] == [
      len(r.contributing) for r in schedule.rounds]
  assert [row['clients'] for row in rows] == [len(r.contributing) for r in schedule.rounds]
  assert [row['churn_failed'] for row in rows] == [len(r.failed) for r in schedule.rounds]
  assert [row['churn_present'] for row in rows] == [len(r.present) for r in schedule.rounds]
  payload = rows[0]['communicated_bytes'] / rows[0]['clients']  # One replica's message.
  want = churn.goodput(schedule, network.Schedule.diloco(H),
                       network.Compute.from_step_seconds(STEP_S),
                       network.Network(network.Link.gbps(GBPS)), payload, float(B))
  for row, rnd in zip(rows, want):
    assert row['useful_tokens'] == rnd.useful_tokens
    assert row['wasted_tokens'] == rnd.wasted_tokens
    # The row's simulated seconds are float64; the goodput is a float32 quotient.
    np.testing.assert_allclose(row['simulated_round_s'], rnd.seconds, rtol=1e-12)
    np.testing.assert_allclose(row['goodput'], rnd.goodput, rtol=2 * 2.0 ** -24)

  # Interrupted after round 3 (SIGINT from a hook), then run again: the
  # uninterrupted run bit for bit, the schedule continued from the state's
  # round index.
  def interrupt(step, state, row):
    del state, row
    if step == 3:
      signal.raise_signal(signal.SIGINT)
  workdir = str(tmp_path / 'resumed')
  part = runner.run(_config(CHAOS), workdir, hooks=[interrupt])
  assert part.interrupted and part.step == 3
  resumed = runner.run(_config(CHAOS), workdir)
  assert resumed.step == ROUNDS
  _equal(resumed.state.params, full.state.params)
  assert [r['churn_contributing'] for r in resumed.history if r['round'] > 0] == [
      row['churn_contributing'] for row in rows]


def test_off_by_default_and_without_a_fixed_step_time_tokens_only():
  config = config_lib.with_defaults(_config())
  assert config.churn.to_dict() == config_lib.CHURN_DEFAULTS
  assert not config_lib.churn_on(config)
  assert experiment.churn_schedule(config, M) is None
  assert not config_lib.churn_on(config_lib.with_defaults(_config(None, churn=None)))
  measured = experiment.build(_config(CHAOS, network=dict(bandwidth_gbps=GBPS)))
  state = measured.algorithm.init(measured.init_params)
  cohorts = measured.cohorts(0, 1)
  _, metrics = measured.algorithm.round(state, next(cohorts), measured.round_key_for(0))
  cohorts.close()
  assert 'goodput' not in metrics
  assert float(metrics['useful_tokens']) == H * B * float(metrics['churn_contributing'])


@pytest.mark.parametrize('section, match', [
    (dict(leave=1.5), r'config.churn.leave=1.5; allowed: a probability in \[0, 1\]'),
    (dict(fail='x'), r"config.churn.fail='x'; allowed: a probability"),
    (dict(seed=-1), r'config.churn.seed=-1; allowed: an int >= 0, or None'),
    (dict(tokens_per_example=0), r'config.churn.tokens_per_example=0; allowed'),
    (dict(lose=0.1), r"config.churn\['lose'\] is unknown"),
])
def test_bad_sections_are_one_line_naming_the_field(section, match):
  with pytest.raises(ConfigError, match=match) as e:
    config_lib.with_defaults(_config(section))
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('changes, match', [
    (dict(algorithm=dict(name='fedavg')),
     r"config.churn is set but config.algorithm.name='fedavg'; allowed: one of \('diloco',\)"),
    (dict(cohort_size=2), r'config.cohort_size=2 but the training population has 4'),
    (dict(execution='streaming'), r"config.execution='streaming' is not allowed"),
    (dict(local_steps=None, network={}), r'config.local_steps, config.network.inner_steps'),
])
def test_what_churn_refuses(changes, match):
  config = config_lib.with_defaults(_config(dict(fail=0.5), **changes))
  with pytest.raises(ConfigError, match=match) as e:
    experiment.with_churn(config, None, M)
  assert '\n' not in str(e.value)
