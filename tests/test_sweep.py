"""Sweeps: vectorized trials equal their single runs; summaries, divergence, resume."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fedjx.algorithms.privacy import accounting
from fedjx.experiments import config_base
from fedjx.experiments import experiment
from fedjx.experiments import metrics_writers
from fedjx.experiments import run_trainer
from fedjx.experiments import runner
from fedjx.experiments import workdir_lock
from fedjx.experiments.sweeps import group_round
from fedjx.experiments.sweeps import plan as plan_lib
from fedjx.experiments.sweeps import run
from fedjx.experiments.sweeps import spec
from fedjx.experiments.sweeps import summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Trials and single runs add the same float32 numbers, but a batched matrix
# product may sum in another order than an unbatched one: each of the 3
# rounds adds up ~10^2-10^3 terms per output (16 examples x 65 features, then
# 5 clients), so relative differences stay within a few hundred float32 ulps
# (2^-24 ~ 6e-8 each): 1e-4 relative, with absolute 1e-6 for values near 0.
RTOL, ATOL = 1e-4, 1e-6


def small_config(**changes):
  config = config_base.base_config()
  config.rounds = 3
  config.cohort_size = 5
  config.batch_size = 16
  config.eval_every = 2
  config.checkpoint_every = 2
  config.progress = False
  config.tensorboard = False
  config.plot = False
  config.prefetch = 0
  config.dataset = dict(name='digits', num_clients=12, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(
      name='fedadam', client_optimizer=config_base.optimizer('sgd', learning_rate=0.1),
      server_learning_rate=0.05)
  for k, v in changes.items():
    setattr(config, k, v)
  return config


def trial_params(workdir, trial):
  state, _ = run.load_trial_state(str(workdir), trial.name)
  return jax.device_get(state.params)


def assert_trees_close(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL), a, b)


def test_axis_and_seed_parsing():
  axis = spec.parse_axis('config.algorithm.server_learning_rate=0.01,1e-1,(1,2)')
  assert axis.path == 'algorithm.server_learning_rate'
  assert axis.values == (0.01, 0.1, (1, 2))
  rand = spec.parse_axis('algorithm.b1=loguniform(1e-3, 1)')
  assert (rand.distribution, rand.arguments) == ('loguniform', (1e-3, 1.0))
  assert spec.parse_seeds('0-2,7') == (0, 1, 2, 7)
  for bad in ('algorithm.x', 'algorithm.x=', '1x=2', 'seed=1,2', 'a=1,1',
              'a=loguniform(0,1)', 'a=uniform(2,1)', 'a=uniform(1)'):
    with pytest.raises(spec.SweepError):
      spec.parse_axis(bad)
  for bad in ('', 'a', '1,1', '-1'):
    with pytest.raises(spec.SweepError):
      spec.parse_seeds(bad)


def test_short_names():
  assert spec.short_names(['algorithm.client_optimizer.learning_rate',
                           'algorithm.server_learning_rate', 'batch_size',
                           'model.hidden', 'dataset.hidden']) == {
      'algorithm.client_optimizer.learning_rate': 'client_optimizer.learning_rate',
      'algorithm.server_learning_rate': 'server_learning_rate',
      'batch_size': 'batch_size', 'model.hidden': 'model.hidden',
      'dataset.hidden': 'dataset.hidden'}


def test_grid_and_random_settings():
  grid = spec.settings([spec.parse_axis('a=1,2'),
                        spec.parse_axis('b.c=x,y,z')])
  assert grid == [{'a': a, 'b.c': c} for a in (1, 2) for c in 'xyz']
  axes = [spec.parse_axis('a=loguniform(1e-3,1)'), spec.parse_axis('b=3,4')]
  draws = spec.settings(axes, num_samples=20, sample_seed=5)
  assert draws == spec.settings(axes, num_samples=20, sample_seed=5)
  assert all(1e-3 <= d['a'] <= 1 and d['b'] in (3, 4) for d in draws)
  logs = np.log10([d['a'] for d in draws])
  assert logs.min() < -2 and logs.max() > -1  # Spread over the decades.
  with pytest.raises(spec.SweepError, match='num_samples'):
    spec.settings(axes)


def test_classification_traced_and_structural():
  values = {'algorithm.server_learning_rate': [0.01, 0.1],
            'algorithm.client_optimizer.learning_rate': [0.05, 0.2],
            'algorithm.local_epochs': [1, 2],
            'batch_size': [8, 16]}
  traced, structural = run.classify(small_config(), values)
  assert traced == ['algorithm.server_learning_rate',
                    'algorithm.client_optimizer.learning_rate']
  assert structural == ['algorithm.local_epochs', 'batch_size']


@pytest.mark.slow
def test_trials_equal_single_runs(tmp_path):
  config = small_config()
  settings = spec.settings(
      [spec.parse_axis('algorithm.server_learning_rate=0.02,0.1'),
       spec.parse_axis('batch_size=8,16')])
  result = run.run_sweep(config, str(tmp_path / 'sweep'), settings, (0, 4),
                         target='eval_accuracy=0.3', log=lambda m: None)
  assert result.traced == ['algorithm.server_learning_rate']
  assert result.structural == ['batch_size']
  assert result.groups == 2 and len(result.trials) == 8
  # Every trial against its own single run.
  for trial in result.trials:
    single = runner.run(run.trial_config(config, trial.setting, trial.seed),
                        str(tmp_path / 'single' / trial.name), log=lambda m: None)
    rows = metrics_writers.read_metrics(str(tmp_path / 'sweep' / 'trials' / trial.name))
    assert [r['round'] for r in rows] == [r['round'] for r in single.history]
    for got, want in zip(rows, single.history):
      for key in want:
        if key != 'elapsed_s':
          np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL,
                                     err_msg=f'{trial.name} round {want["round"]} {key}')
    assert_trees_close(trial_params(tmp_path / 'sweep', trial),
                       jax.device_get(single.state.params))
  # The summary: one row per trial, mean and sd over the two seeds per setting.
  with open(tmp_path / 'sweep' / 'summary.csv', encoding='utf-8') as f:
    per_setting = list(csv.DictReader(f))
  assert len(per_setting) == 4
  trial_rows = {r['trial']: r for r in result.summary}
  for row in per_setting:
    finals = [trial_rows[t.name]['final_eval_accuracy'] for t in result.trials
              if t.setting == {'algorithm.server_learning_rate': float(
                  row['algorithm.server_learning_rate']),
                               'batch_size': int(row['batch_size'])}]
    assert len(finals) == 2
    np.testing.assert_allclose(float(row['final_eval_accuracy_mean']), np.mean(finals))
    np.testing.assert_allclose(float(row['final_eval_accuracy_sd']), np.std(finals, ddof=1))
  text = (tmp_path / 'sweep' / 'summary.md').read_text()
  assert '| server_learning_rate | batch_size | seeds |' in text


def test_rounds_to_target_and_best():
  rows = [{'round': 0, 'eval_accuracy': 0.1, 'eval_loss': 2.0},
          {'round': 2, 'eval_accuracy': 0.6, 'eval_loss': 1.0},
          {'round': 4, 'eval_accuracy': 0.5, 'eval_loss': 1.5}]
  trial = run.Trial('t', {'a': 1}, 0)
  row = summary.trial_row(trial, rows, ('eval_loss', 1.2))
  assert row['best_eval_accuracy'] == 0.6 and row['best_round_eval_accuracy'] == 2
  assert row['best_eval_loss'] == 1.0 and row['final_eval_loss'] == 1.5
  assert row['rounds_to_target'] == 2 and row['diverged_round'] is None
  assert summary.trial_row(trial, rows, ('eval_accuracy', 0.9))[
      'rounds_to_target'] is None


@pytest.mark.slow
def test_a_diverging_trial_stops_alone(tmp_path):
  config = small_config()
  config.algorithm = dict(name='fedavg', server_optimizer=config_base.optimizer(
      'sgd', learning_rate=1.0))
  settings = [{'algorithm.server_optimizer.learning_rate': v} for v in (1.0, 1e38)]
  messages = []
  result = run.run_sweep(config, str(tmp_path / 'sweep'), settings, (0,),
                         log=messages.append)
  assert result.groups == 1
  good, bad = result.trials
  bad_rows = metrics_writers.read_metrics(str(tmp_path / 'sweep' / 'trials' / bad.name))
  last = bad_rows[-1]['round']
  assert any(bad.name in m and f'diverged in round {last}' in m for m in messages)
  assert last < config.rounds and bad_rows[-1]['diverged'] == 1.0
  assert [r['round'] for r in bad_rows] == list(range(last + 1))
  by_trial = {r['trial']: r for r in result.summary}
  assert by_trial[bad.name]['diverged_round'] == last
  assert by_trial[good.name]['diverged_round'] is None
  single = runner.run(run.trial_config(config, good.setting, 0),
                      str(tmp_path / 'single'), log=lambda m: None)
  good_rows = metrics_writers.read_metrics(str(tmp_path / 'sweep' / 'trials' / good.name))
  np.testing.assert_allclose([r['eval_accuracy'] for r in good_rows if 'eval_accuracy' in r],
                             [r['eval_accuracy'] for r in single.history if 'eval_accuracy' in r],
                             rtol=RTOL)
  frozen = jax.tree.leaves(trial_params(tmp_path / 'sweep', bad))
  assert frozen and all(np.isfinite(x).all() for x in frozen)  # Its last finite model.


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
  settings = [{'algorithm.server_learning_rate': v} for v in (0.02, 0.1)]
  whole = run.run_sweep(small_config(rounds=4), str(tmp_path / 'whole'), settings,
                        (1,), log=lambda m: None)
  run.run_sweep(small_config(rounds=2), str(tmp_path / 'parts'), settings, (1,),
                log=lambda m: None)
  parts = run.run_sweep(small_config(rounds=4), str(tmp_path / 'parts'), settings,
                        (1,), log=lambda m: None)
  for t in whole.trials:
    a, _ = run.load_trial_state(str(tmp_path / 'whole'), t.name)
    b, step = run.load_trial_state(str(tmp_path / 'parts'), t.name)
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))
    rows_a = metrics_writers.read_metrics(str(tmp_path / 'whole' / 'trials' / t.name))
    rows_b = metrics_writers.read_metrics(str(tmp_path / 'parts' / 'trials' / t.name))
    strip = lambda rows: [{k: v for k, v in r.items() if k != 'elapsed_s'} for r in rows]
    assert strip(rows_a) == strip(rows_b)
  assert [r['trial'] for r in parts.summary] == [t.name for t in whole.trials]
  with pytest.raises(spec.SweepError, match='different sweep'):
    run.run_sweep(small_config(rounds=4), str(tmp_path / 'parts'), settings[:1], (1,),
                  log=lambda m: None)


def test_settings_per_program_splits_groups():
  settings = [{'algorithm.server_learning_rate': v} for v in (0.01, 0.02, 0.03)]
  groups, traced, _ = run.plan(small_config(), settings, (0, 1), settings_per_program=2)
  assert traced == ['algorithm.server_learning_rate']
  assert [len(g.settings) for g in groups] == [2, 1]
  assert [[t.seed for t in row] for row in groups[1].trials] == [[0], [1]]
  with pytest.raises(spec.SweepError, match='settings_per_program'):
    run.plan(small_config(), settings, (0,), settings_per_program=0)


def test_the_round_is_compiled_ahead_on_a_thread():
  """A group's round compiled by group_round.Compiling (on a background
  thread) is what the round's first call runs: the call compiles nothing."""
  config = small_config()
  settings = [{'algorithm.server_learning_rate': v} for v in (0.01, 0.1)]
  groups, _, _ = run.plan(config, settings, (0, 1))
  exps, algorithm, states, configs = group_round.group_states(config, groups[0])
  step_fn = group_round.make_sweep_round(algorithm)
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
      jax.numpy.stack([e.round_key for e in exps]), 0)
  args = (states, jax.device_put(group_round.stacked_cohort(exps, configs[0][0], 0)),
          keys, jax.device_put(np.ones((2, 2), bool)))
  assert group_round.Compiling(step_fn, args).wait() is not None
  compiles = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    states = jax.block_until_ready(step_fn(*args))[0]  # (args' states are donated)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
  # Compiled ahead with the seeds' round keys (as the group's trainer does,
  # before round 0's keys are folded), the round's call compiles nothing either.
  unfolded = jax.numpy.stack([e.round_key for e in exps])
  args = (states, args[1], keys, args[3])
  step_fn = group_round.make_sweep_round(algorithm)
  assert group_round.Compiling(step_fn, (states, args[1], unfolded, args[3])).wait()
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    jax.block_until_ready(step_fn(*args))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []

  class Failing:
    def lower(self, *args):
      raise ValueError('no program')

  with pytest.raises(ValueError, match='no program'):
    group_round.Compiling(Failing(), ()).wait()  # Raised where it is waited for.


def test_the_group_round_reuses_the_trace_that_classified_it(monkeypatch):
  """plan.classify lowers the round of the experiment the group then takes;
  the group's program batches that trace instead of tracing the round (its
  Python) again."""
  from fedjx import fusion  # pylint: disable=import-outside-toplevel
  config = small_config()
  settings = [{'algorithm.server_learning_rate': v} for v in (0.01, 0.1)]
  built = plan_lib.Built()
  groups, traced, _ = run.plan(config, settings, (0,), built=built)
  assert traced == ['algorithm.server_learning_rate']
  exps, algorithm, states, configs = group_round.group_states(config, groups[0], built)
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
      jax.numpy.stack([e.round_key for e in exps]), 0)
  args = (states, jax.device_put(group_round.stacked_cohort(exps, configs[0][0], 0)),
          keys, jax.device_put(np.ones((1, 2), bool)))
  traced_rounds = []
  call_program = fusion.call_program  # What a round's program runs when traced.
  monkeypatch.setattr(fusion, 'call_program', lambda *a: traced_rounds.append(1) or
                      call_program(*a))
  group_round.make_sweep_round(algorithm).lower(*args)
  assert traced_rounds == []


def test_seeds_in_turn_give_each_trial_the_batched_round():
  """On a CPU the seeds of a group run one after another (lax.map): each
  trial's new state and metrics are those of the seeds batched (vmap), up
  to float32 summation order; where the seeds axis is split over devices,
  or off a CPU, they stay batched."""
  config = small_config()
  settings = [{'algorithm.server_learning_rate': v} for v in (0.01, 0.1)]
  groups, _, _ = run.plan(config, settings, (0, 1, 2))
  exps, algorithm, states, configs = group_round.group_states(config, groups[0])
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
      jax.numpy.stack([e.round_key for e in exps]), 0)
  cohorts = jax.device_put(group_round.stacked_cohort(exps, configs[0][0], 0))
  alive = jax.device_put(np.ones((3, 2), bool))
  copy = lambda tree: jax.tree.map(jax.numpy.array, tree)  # (states are donated)
  batched = group_round.make_sweep_round(algorithm)(copy(states), cohorts, keys, alive)
  in_turn = group_round.make_sweep_round(algorithm, in_turn=True)(
      states, cohorts, keys, alive)
  assert_trees_close(jax.device_get(in_turn[0].params),
                     jax.device_get(batched[0].params))
  for key in batched[1]:
    np.testing.assert_allclose(in_turn[1][key], batched[1][key], rtol=RTOL, atol=ATOL)
  np.testing.assert_array_equal(in_turn[2], batched[2])
  assert group_round.seeds_in_turn(None) == (jax.default_backend() == 'cpu')
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('trials',))
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  assert not group_round.seeds_in_turn(jax.sharding.NamedSharding(mesh, P('trials')))
  assert group_round.seeds_in_turn(jax.sharding.NamedSharding(mesh, P(None, 'trials'))) == (
      jax.default_backend() == 'cpu')


def test_trials_are_sharded_over_devices(tmp_path):
  n = len(jax.devices())
  settings = [{'algorithm.server_learning_rate': 0.01 * (i + 1)} for i in range(n)]
  assert group_round.trial_sharding((1, n)) is not None or n == 1  # pylint: disable=protected-access
  result = run.run_sweep(small_config(rounds=1, eval_every=1), str(tmp_path / 's'),
                         settings, (0,), log=lambda m: None)
  single = runner.run(run.trial_config(small_config(rounds=1, eval_every=1),
                                       settings[-1], 0), str(tmp_path / 'one'),
                      log=lambda m: None)
  got = {r['trial']: r for r in result.summary}[result.trials[-1].name]
  np.testing.assert_allclose(got['final_eval_loss'], single.history[-1]['eval_loss'],
                             rtol=RTOL)


@pytest.mark.slow
def test_cli_one_line_errors(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  cmd = [sys.executable, '-m', 'fedjx.experiments.sweeps.cli',
         '--config', os.path.join(REPO, 'configs', 'fedavg_digits.py'),
         '--workdir', str(tmp_path / 'w')]
  for extra, message in (
      (['--sweep', 'algorithm.client_optimizer.lr=0.1'], "has no option 'lr'"),
      (['--sweep', 'algorithm.x=uniform(2,1)'], 'low < high'),
      (['--seeds', '1,x'], 'not an int'),
      (['--sweep', 'rounds=1', '--target', 'eval_accuracy'], 'METRIC=NUMBER')):
    proc = subprocess.run(cmd + extra, capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr


def _config_file(tmp_path, changes, sweep_text):
  """A config file whose get_config() is small_config(changes), with get_sweep()."""
  path = tmp_path / 'grid.py'
  path.write_text(
      'import sys\n'
      f'sys.path.insert(0, {os.path.join(REPO, "tests")!r})\n'
      'from test_sweep import small_config\n\n'
      f'def get_config():\n  return small_config({changes})\n\n'
      f'def get_sweep():\n  return {sweep_text}\n')
  return path


@pytest.mark.slow
def test_cli_sweep_from_the_config_file(tmp_path):
  config_file = _config_file(
      tmp_path, 'rounds=1, eval_every=1, plot=True',
      "{'sweep': ['algorithm.server_learning_rate=0.01,0.1'], 'seeds': '0-1', "
      "'target': 'eval_accuracy=0.01'}")
  proc = subprocess.run(
      [sys.executable, '-m', 'fedjx.experiments.sweeps.cli', '--config', str(config_file),
       '--workdir', str(tmp_path / 'w'), '--seeds', '3'],  # The flag wins.
      capture_output=True, text=True, cwd=str(tmp_path), check=False,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-2000:]
  with open(tmp_path / 'w' / 'summary_trials.csv', encoding='utf-8') as f:
    rows = list(csv.DictReader(f))
  assert sorted(r['trial'] for r in rows) == [
      'server_learning_rate=0.01,seed=3', 'server_learning_rate=0.1,seed=3']
  assert all(r['rounds_to_target'] == '0' for r in rows)  # Reached at round 0.
  assert (tmp_path / 'w' / 'sweep_eval_accuracy.png').exists()


def _sweep_process(config_file, workdir):
  return subprocess.Popen(
      [sys.executable, '-m', 'fedjx.experiments.sweeps.cli', '--config', str(config_file),
       '--workdir', str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'))


@pytest.mark.slow
def test_sigterm_then_resume_equals_an_uninterrupted_sweep(tmp_path):
  config_file = _config_file(
      tmp_path, 'rounds=40, checkpoint_every=1',
      "{'sweep': ['algorithm.server_learning_rate=0.02,0.1'], 'seeds': '1'}")
  # A busy workdir is refused in one line (the lock held here, as a live
  # sweep holds it).
  os.makedirs(tmp_path / 'parts')
  with workdir_lock.hold(str(tmp_path / 'parts')):
    second = _sweep_process(config_file, tmp_path / 'parts')
    _, err = second.communicate(timeout=120)
  assert second.returncode == 2 and 'in use by' in err and len(err.strip().splitlines()) == 1
  first = _sweep_process(config_file, tmp_path / 'parts')
  ckpts = tmp_path / 'parts' / 'groups' / 'group_000' / 'checkpoints'
  for _ in range(1200):  # Until two rounds are checkpointed (at most 120 s),
    if first.poll() is not None or (ckpts.exists() and len(  # then at once:
        [p for p in ckpts.iterdir() if p.name.isdigit()]) >= 2):  # 38 remain.
      break
    time.sleep(0.1)
  assert first.poll() is None, 'the sweep ended before it could be interrupted'
  first.send_signal(signal.SIGTERM)
  _, err = first.communicate(timeout=120)
  assert first.returncode == 128 + signal.SIGTERM, err[-2000:]
  resumed = _sweep_process(config_file, tmp_path / 'parts')
  _, err = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, err[-2000:]
  settings = [{'algorithm.server_learning_rate': v} for v in (0.02, 0.1)]
  whole = run.run_sweep(small_config(rounds=40, checkpoint_every=1), str(tmp_path / 'whole'),
                        settings, (1,), log=lambda m: None)
  for t in whole.trials:
    a, _ = run.load_trial_state(str(tmp_path / 'whole'), t.name)
    b, step = run.load_trial_state(str(tmp_path / 'parts'), t.name)
    assert step == 40
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))
    rows = [metrics_writers.read_metrics(str(tmp_path / d / 'trials' / t.name))
            for d in ('whole', 'parts')]
    strip = lambda rs: [{k: v for k, v in r.items() if k != 'elapsed_s'} for r in rs]
    assert strip(rows[0]) == strip(rows[1])  # Every row once, none lost.


def test_trials_draw_cohorts_with_the_config_s_sampler():
  config = small_config(sampling=dict(name='poisson', rate=0.25))
  exps = [experiment.build(run.trial_config(config, {}, seed)) for seed in (0, 1)]
  stacked = group_round.stacked_cohort(exps, config, 3)
  for row, exp in enumerate(exps):
    ids = exp.sampler.sample(3)
    got = np.asarray(stacked.client_ids[row])
    # The Poisson draw, then padding clients up to the sampler's bucket.
    assert got.shape == (exp.sampler.cohort_size,)
    np.testing.assert_array_equal(got[:len(ids)], ids)
    assert (got[len(ids):] == -1).all()
    assert not np.asarray(stacked.mask[row])[len(ids):].any()


@pytest.mark.parametrize('changes, message', [
    (dict(algorithm=dict(name='fedbuff')), 'is asynchronous'),
    (dict(systems=dict(dropout=dict(rate=0.1))), 'config.systems is set'),
])
def test_asynchronous_or_unreliable_clients_are_refused(tmp_path, changes, message):
  with pytest.raises(run.SweepError, match=message):
    run.run_sweep(small_config(**changes), str(tmp_path / 'w'), [{}])


def test_a_refused_grid_writes_nothing_and_the_corrected_grid_runs(tmp_path):
  config = small_config(rounds=1, eval_every=1)
  workdir = tmp_path / 'grid'
  lr = 'algorithm.client_optimizer.learning_rate'
  for bad, words in (
      ([{lr: 'abc'}, {lr: 0.1}], ["client_optimizer.learning_rate=abc",
                                  "learning_rate='abc' must be a number"]),
      ([{'algorithm.client_optimizer.momentum': 1.5}],
       ['client_optimizer.momentum=1.5', '<= 1.0']),
      ([{'map_strategy': 'foo'}], ["config.map_strategy='foo'"])):
    with pytest.raises(spec.SweepError) as e:
      run.run_sweep(config, str(workdir), bad, (0,), log=lambda m: None)
    assert '\n' not in str(e.value)
    for word in words:
      assert word in str(e.value), str(e.value)
    assert not workdir.exists()  # No sweep.json, no lock, no trial.
  # A sweep.json left by a sweep that never trained (as a refused grid left
  # it before grids were checked first) does not block the corrected grid.
  workdir.mkdir()
  (workdir / 'sweep.json').write_text('{"settings": [{"x": "abc"}]}\n')
  result = run.run_sweep(config, str(workdir), [{lr: 0.1}, {lr: 0.03}], (0,),
                         log=lambda m: None)
  assert len(result.trials) == 2 and not result.interrupted
  with open(workdir / 'sweep.json', encoding='utf-8') as f:
    assert json.load(f)['settings'] == [{lr: 0.1}, {lr: 0.03}]
  # Once trials exist, a different sweep is still refused.
  with pytest.raises(spec.SweepError, match='different sweep'):
    run.run_sweep(config, str(workdir), [{lr: 0.3}], (0,), log=lambda m: None)


def test_cli_a_grid_value_of_the_wrong_type_is_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'fedjx.experiments.sweeps.cli',
       '--config', os.path.join(REPO, 'configs', 'fedavg_digits.py'),
       '--workdir', str(tmp_path / 'w'),
       '--sweep', 'algorithm.client_optimizer.learning_rate=abc,0.1'],
      capture_output=True, text=True, cwd=str(tmp_path), check=False,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert "learning_rate='abc' must be a number" in lines[0]
  assert not (tmp_path / 'w').exists()


@pytest.mark.slow
def test_a_trial_stops_where_its_single_run_stops(tmp_path):
  """Client learning rate 1e30: every client is non-finite from some round
  on, so nothing can be aggregated. fedjx-run stops there with one line;
  the sweep's trial must be marked diverged in the same round (one rule,
  guarded_rounds.must_stop), and its neighbour goes on."""
  config = small_config()
  config.rounds = 4
  config.model = dict(name='mlp', hidden=(32,))
  config.algorithm = dict(name='fedavg', client_optimizer=config_base.optimizer(
      'sgd', learning_rate=0.1))
  settings = [{'algorithm.client_optimizer.learning_rate': v} for v in (0.1, 1e30)]
  messages = []
  result = run.run_sweep(config, str(tmp_path / 'sweep'), settings, (0,),
                         log=messages.append)
  good, bad = result.trials
  with pytest.raises(run_trainer.NonFiniteError, match=r'^round (\d+): every client') as info:
    runner.run(run.trial_config(config, bad.setting, 0), str(tmp_path / 'single'),
               log=lambda m: None)
  stopped = int(info.value.args[0].split(':')[0].split()[1])
  by_trial = {r['trial']: r for r in result.summary}
  assert by_trial[bad.name]['diverged_round'] == stopped
  assert by_trial[good.name]['diverged_round'] is None
  bad_rows = metrics_writers.read_metrics(str(tmp_path / 'sweep' / 'trials' / bad.name))
  assert bad_rows[-1]['round'] == stopped and bad_rows[-1]['diverged'] == 1.0


@pytest.mark.parametrize('finite,bad,kept,policy,stop', [
    (True, 0, 5, 'skip', False),
    (True, 3, 2, 'skip', False),   # More non-finite clients than kept ones: go on.
    (True, 5, 0, 'skip', True),    # Every client non-finite: nothing to aggregate.
    (True, 1, 4, 'stop', True),
    (False, 0, 5, 'skip', True),
    (False, 0, 5, 'off', True),
])
def test_the_stop_rule_of_runs_and_trials(finite, bad, kept, policy, stop):
  from fedjx.experiments import guarded_rounds  # pylint: disable=g-import-not-at-top
  assert bool(guarded_rounds.must_stop(finite, bad, kept, policy)) == stop
  per_trial = guarded_rounds.must_stop(np.array([finite, True]), np.array([bad, 0.0]),
                                       np.array([kept, 5.0]), policy)
  np.testing.assert_array_equal(per_trial, [stop, False])


def test_a_private_trial_reports_its_run_s_epsilon_and_stops_at_its_budget(tmp_path):
  """Two noise multipliers in one program: each trial's epsilon rows are its
  run's (an independent dp_accounting computation per round), and the trial
  with less noise stops after the last round within the shared target, as
  its fedjx-run would, while the other trains on."""
  config = small_config(rounds=6, eval_every=2, cohort_size=4)
  config.dataset = dict(name='digits', num_clients=40, alpha=0.5)
  config.algorithm = dict(name='dp_fedavg', clip_norm=1.0, noise_multiplier=1.0,
                          expected_clients_per_round=4.0,
                          client_optimizer=config_base.optimizer('sgd', learning_rate=0.1))
  config.sampling = dict(name='poisson')
  sampling = accounting.Sampling.poisson(40, 0.1)
  eps = {z: [accounting.epsilon(z, r, 1e-3, sampling=sampling) for r in range(7)]
         for z in (1.0, 2.0)}
  target = (eps[1.0][2] + eps[1.0][3]) / 2  # z = 1: rounds 1-2 fit, not 3
  assert eps[2.0][6] < target  # z = 2: every round fits
  config.privacy = dict(delta=1e-3, target_epsilon=target)
  settings = [{'algorithm.noise_multiplier': z} for z in (1.0, 2.0)]
  result = run.run_sweep(config, str(tmp_path / 'sweep'), settings, (0,),
                         log=lambda m: None)
  assert result.groups == 1  # The noise multiplier is traced.
  loud, quiet = result.trials
  rows = {t.name: [r for r in metrics_writers.read_metrics(
      str(tmp_path / 'sweep' / 'trials' / t.name)) if r['round'] > 0]
          for t in (loud, quiet)}
  # The accountant's curve, recomputed per round: float64 sums of a few terms.
  assert [r['epsilon'] for r in rows[loud.name]] == pytest.approx(eps[1.0][1:3], rel=1e-12)
  assert [r['epsilon'] for r in rows[quiet.name]] == pytest.approx(eps[2.0][1:7], rel=1e-12)
  assert 'eval_accuracy' in rows[loud.name][-1]  # Evaluated at its last round.
  assert not any(r.get('diverged') for rs in rows.values() for r in rs)
  statement = json.loads((tmp_path / 'sweep' / 'trials' / loud.name /
                          'privacy.json').read_text())
  assert statement['rounds'] == 2
  single = runner.run(run.trial_config(config, loud.setting, 0),
                      str(tmp_path / 'single'), log=lambda m: None)
  assert single.step == 2
  np.testing.assert_allclose(
      [r['eval_accuracy'] for r in rows[loud.name] if 'eval_accuracy' in r],
      [r['eval_accuracy'] for r in single.history if 'eval_accuracy' in r and r['round']],
      rtol=RTOL)


def _record(config, values, seeds, per_program=None):
  from fedjx.experiments.sweeps import record  # pylint: disable=import-outside-toplevel
  settings = [{'algorithm.server_learning_rate': v} for v in values]
  return record.fingerprint(config, settings, seeds, per_program)


def test_a_sweep_extends_by_values_or_seeds_and_says_what_else_differs():
  from fedjx.experiments.sweeps import record  # pylint: disable=import-outside-toplevel
  config = small_config()
  old = _record(config, (0.02, 0.1), (0,))
  saved = record.with_parts(old, record.extend(old, old, 'w'))
  assert record.parts(saved) == [record.Part(old['settings'], [0])]
  lr = lambda *vs: [{'algorithm.server_learning_rate': v} for v in vs]
  # One more value: the new setting with every seed.
  parts = record.extend(saved, _record(config, (0.02, 0.1, 0.5), (0,)), 'w')
  assert parts == [record.Part(lr(0.02, 0.1), [0]), record.Part(lr(0.5), [0])]
  # One more value and one more seed: also the old settings with the new seed.
  grown = _record(config, (0.5, 0.1, 0.02), (0, 3))
  parts = record.extend(saved, grown, 'w')
  assert parts == [record.Part(lr(0.02, 0.1), [0]), record.Part(lr(0.5), [0, 3]),
                   record.Part(lr(0.02, 0.1), [3])]
  # Recorded and extended again: the same parts, then the next one.
  again = record.with_parts(grown, parts)
  assert again['settings'] == lr(0.02, 0.1, 0.5) and again['seeds'] == [0, 3]
  assert record.extend(again, grown, 'w') == parts
  # The first part's groups keep the fingerprint they were started with.
  assert record.part_fingerprint(again, parts[0]) == old
  # Anything else is one line naming what differs.
  cases = [
      (_record(config, (0.02,), (0,)), 'the setting server_learning_rate=0.1 is left out'),
      (_record(config, (0.02, 0.1), (1,)), 'seed 0 is left out'),
      (_record(small_config(batch_size=8), (0.02, 0.1), (0,)),
       'config.batch_size: 16 -> 8'),
      (_record(config, (0.02, 0.1), (0,), 1), '--settings_per_program None -> 1'),
      (record.fingerprint(config, [{'seed_x': 1}], (0,), None),
       "swept fields ['algorithm.server_learning_rate'] -> ['seed_x']"),
  ]
  # A random search extends with more samples: its draws are a prefix.
  axes = [spec.parse_axis('algorithm.server_learning_rate=loguniform(1e-3,1)')]
  assert spec.settings(axes, 5, 7)[:3] == spec.settings(axes, 3, 7)
  for new, words in cases:
    with pytest.raises(spec.SweepError) as e:
      record.extend(saved, new, '/w')
    text = str(e.value)
    assert text.startswith('/w holds a different sweep (') and words in text, text
    assert 'may only add values or seeds' in text and '\n' not in text


@pytest.mark.slow
def test_one_more_value_trains_only_the_new_trials(tmp_path):
  lr = lambda *vs: [{'algorithm.server_learning_rate': v} for v in vs]
  workdir = tmp_path / 'grid'
  first = run.run_sweep(small_config(), str(workdir), lr(0.02, 0.1), (1,),
                        log=lambda m: None)
  before = {t.name: (workdir / 'trials' / t.name / 'metrics.jsonl').read_text()
            for t in first.trials}
  lines = []
  grown = run.run_sweep(small_config(), str(workdir), lr(0.02, 0.1, 0.5), (1, 2),
                        log=lines.append)
  assert lines[0].startswith('fedjx-sweep: 6 trials in 3 program(s)')
  assert len(grown.trials) == 6 and len(grown.summary) == 6
  for name, text in before.items():  # Kept as they were: not trained again.
    assert (workdir / 'trials' / name / 'metrics.jsonl').read_text() == text
  # A new trial is the trial a sweep of it alone trains.
  alone = run.run_sweep(small_config(), str(tmp_path / 'alone'), lr(0.5), (2,),
                        log=lambda m: None)
  name = alone.trials[0].name
  assert_trees_close(trial_params(workdir, alone.trials[0]),
                     trial_params(tmp_path / 'alone', alone.trials[0]))
  rows = metrics_writers.read_metrics(str(workdir / 'trials' / name))
  assert [r['round'] for r in rows] == [0, 1, 2, 3]
  # Run again as it is now: resumed, nothing trained.
  again = run.run_sweep(small_config(), str(workdir), lr(0.02, 0.1, 0.5), (1, 2),
                        log=lambda m: None)
  assert [t.name for t in again.trials] == [t.name for t in grown.trials]


# (cores, [settings, seeds], cohort size, devices made): as many devices as
# divide the settings or the seeds, while each device trains at least
# processes.SWEEP_MIN_CLIENTS_PER_DEVICE (48) clients a round.
@pytest.mark.parametrize('cores,sizes,cohort,made', [
    (2, [2, 3], 48, 2), (2, [3, 3], 48, 1), (4, [6, 1], 48, 3), (4, [1, 4], 48, 4),
    (8, [5, 7], 48, 7), (2, [2, 3], 10, 1), (2, [4, 3], 10, 2), (4, [8, 3], 10, 4),
    (4, [4, 3], 10, 2), (8, [16, 3], 10, 8)])
def test_a_sweep_splits_the_cpu_by_its_settings_or_seeds(monkeypatch, cores, sizes,
                                                         cohort, made):
  from fedjx import distributed  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import config as config_lib  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import processes  # pylint: disable=import-outside-toplevel
  asked = []
  monkeypatch.setattr(distributed, 'split_cpu', lambda n, divides=None: asked.append(
      (n, divides)) or n)
  # As a run on one process whose JAX has not started (this test's has).
  monkeypatch.setattr(distributed, 'may_split_cpu', lambda: True)
  config = config_lib.with_defaults(small_config(cpu_devices=str(cores),
                                                 cohort_size=cohort))
  assert processes.split_cpu(config, sizes) == made
  assert asked == [(made, None)]
  config = config_lib.with_defaults(small_config(cpu_devices=str(cores), mesh=''))
  assert processes.split_cpu(config, sizes) == 1  # mesh='' keeps one device.
