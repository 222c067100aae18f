"""The experiment runner: exact resumption, metrics files, plots, CLI errors."""

import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import config_files
import float_tolerance as ft

from fedjx.experiments import checkpointing
from fedjx.experiments import config as config_lib
from fedjx.experiments import experiment
from fedjx.experiments import guarded_rounds
from fedjx.experiments import metrics_writers
from fedjx.experiments import plotting
from fedjx.experiments import processes
from fedjx.experiments import registry
from fedjx.experiments import run_trainer
from fedjx.experiments import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small, fast experiment: 12 rounds of FedAvg on digits with softmax
# regression; checkpoints after rounds 4, 8 and 12.
CONFIG_FILE = textwrap.dedent('''
    from fedjx.experiments.config_base import base_config, optimizer

    def get_config():
      config = base_config()
      config.seed = 3
      config.rounds = 12
      config.cohort_size = 5
      config.batch_size = 16
      config.local_epochs = 1
      config.eval_every = 4
      config.checkpoint_every = 4
      config.progress = False
      config.prefetch = 1
      config.dataset = dict(name='digits', num_clients=20, alpha=0.5)
      config.model = dict(name='logistic_regression')
      config.algorithm = dict(
          name='fedadam',
          client_optimizer=optimizer('sgd', learning_rate=0.1),
          server_learning_rate=0.05)
      return config
''')

# Runs the config and stops itself after round STOP_AT (once the checkpoint
# of round WAIT_FOR is on disk) with signal SIG: SIGKILL (no chance to save)
# or SIGINT (the runner saves and exits).
STOPPER = textwrap.dedent('''
    import os, sys, time
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import signal
    import config_file
    from fedjx.experiments import runner

    workdir, stop_at, wait_for, sig = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    def hook(step, state, row):
      if step == stop_at:
        done = os.path.join(workdir, 'checkpoints', str(wait_for))
        deadline = time.time() + 60
        while not os.path.isdir(done) and time.time() < deadline:
          time.sleep(0.01)
        os.kill(os.getpid(), getattr(signal, sig))

    result = runner.run(config_file.get_config(), workdir, hooks=[hook])
    sys.exit(130 if result.interrupted else 0)
''')


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp('cfg')
  (d / 'config_file.py').write_text(CONFIG_FILE)
  (d / 'stopper.py').write_text(STOPPER)
  return d


def _load_config(files):
  return config_files.load(files / 'config_file.py')


@pytest.fixture(scope='module')
def reference(files, tmp_path_factory):
  """An uninterrupted run of the config."""
  workdir = tmp_path_factory.mktemp('reference')
  return runner.run(_load_config(files), str(workdir))


def _env():
  env = dict(os.environ)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def _assert_same_params(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_reference_run_learns_and_writes_everything(reference):
  rows = reference.history
  assert [r['round'] for r in rows if 'eval_accuracy' in r] == [0, 4, 8, 12]
  assert rows[-1]['eval_accuracy'] > rows[0]['eval_accuracy'] + 0.3
  workdir = reference.workdir
  assert os.path.exists(os.path.join(workdir, 'learning_curve.png'))
  assert os.listdir(os.path.join(workdir, 'tensorboard'))
  on_disk = metrics_writers.read_metrics(workdir)
  assert [r['round'] for r in on_disk] == list(range(13))
  state, step = runner.load_state(workdir)
  assert step == 12
  _assert_same_params(state.params, reference.state.params)


@pytest.mark.slow
def test_kill_9_then_rerun_gives_bit_identical_params(files, reference, tmp_path):
  workdir = str(tmp_path / 'run')
  killed = subprocess.run(
      [sys.executable, str(files / 'stopper.py'), workdir, '6', '4', 'SIGKILL'],
      env=_env(), capture_output=True, text=True, timeout=300)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints')).latest_step() == 4
  # Rows for rounds 5 and 6 were written after the checkpoint.
  assert max(r['round'] for r in metrics_writers.read_metrics(workdir)) == 6

  resumed = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'run.py'),
       '--config', str(files / 'config_file.py'), '--workdir', workdir,
       '--config.progress=False'],
      env=_env(), capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'resuming' in resumed.stderr and 'after round 4' in resumed.stderr
  state, step = runner.load_state(workdir)
  assert step == 12
  _assert_same_params(state.params, reference.state.params)
  rows = metrics_writers.read_metrics(workdir)
  assert [r['round'] for r in rows] == list(range(13))  # No duplicates.
  for got, want in zip(rows, reference.history):
    assert got.get('eval_accuracy') == want.get('eval_accuracy')


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_exits_cleanly(files, reference, tmp_path):
  workdir = str(tmp_path / 'run')
  stopped = subprocess.run(
      [sys.executable, str(files / 'stopper.py'), workdir, '5', '4', 'SIGINT'],
      env=_env(), capture_output=True, text=True, timeout=300)
  assert stopped.returncode == 130, stopped.stderr[-2000:]
  assert 'Traceback' not in stopped.stderr
  assert 'interrupted after round 5' in stopped.stderr
  assert checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints')).latest_step() == 5
  result = runner.run(_load_config(files), workdir)
  assert not result.interrupted and result.step == 12
  _assert_same_params(result.state.params, reference.state.params)


@pytest.mark.slow
def test_extending_rounds_continues_a_finished_run(files, reference, tmp_path):
  config = _load_config(files)
  config.rounds = 8
  workdir = str(tmp_path / 'run')
  first = runner.run(config, workdir)
  assert first.step == 8
  config.rounds = 12
  second = runner.run(config, workdir)
  _assert_same_params(second.state.params, reference.state.params)


def test_resuming_with_a_different_experiment_fails(files, tmp_path):
  config = _load_config(files)
  config.rounds = 4
  workdir = str(tmp_path / 'run')
  runner.run(config, workdir)
  config.algorithm.server_learning_rate = 0.5
  with pytest.raises(registry.ConfigError, match='different experiment'):
    runner.run(config, workdir)


def test_unknown_names_list_the_valid_choices(files, tmp_path):
  config = _load_config(files)
  for field, bad, valid in (('algorithm', 'fedavgg', 'fedavg'),
                            ('dataset', 'digit', 'digits'),
                            ('model', 'cnn', 'emnist_cnn')):
    broken = _load_config(files)
    broken[field].name = bad
    with pytest.raises(registry.ConfigError) as e:
      experiment.build(broken)
    assert repr(bad) in str(e.value) and repr(valid) in str(e.value)
  broken = _load_config(files)
  broken.model.hidden_size = 3
  with pytest.raises(registry.ConfigError, match='no option .hidden_size'):
    experiment.build(broken)
  broken = _load_config(files)
  broken.algorithm.client_optimizer.name = 'sgdd'
  with pytest.raises(registry.ConfigError, match="'sgd'"):
    experiment.build(broken)
  with pytest.raises(registry.ConfigError, match="Valid top-level fields"):
    config_lib.with_defaults(dict(config.to_dict(), round=3))


def test_cli_unknown_override_lists_fields(files, tmp_path):
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'run.py'),
       '--config', str(files / 'config_file.py'), '--workdir', str(tmp_path),
       '--config.round=3', '--config.model.widht=2'],
      env=_env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  assert 'unknown config field config.round' in out.stderr
  assert "'rounds'" in out.stderr and 'Traceback' not in out.stderr


def test_metrics_writers_round_trip_and_truncate(tmp_path):
  for fmt in metrics_writers.FORMATS:
    d = tmp_path / fmt
    d.mkdir()
    w = metrics_writers.make_writer(str(d), fmt, tensorboard=False)
    w.write(0, {'eval_accuracy': 0.5})
    w.write(1, {'loss': np.float32(2.0), 'clients': 3})
    w.write(2, {'loss': 1.5, 'eval_accuracy': 0.75})
    w.close()
    rows = metrics_writers.read_metrics(str(d))
    assert rows == [{'round': 0, 'eval_accuracy': 0.5},
                    {'round': 1, 'loss': 2.0, 'clients': 3},
                    {'round': 2, 'loss': 1.5, 'eval_accuracy': 0.75}]
    w = metrics_writers.make_writer(str(d), fmt, tensorboard=False, resume_round=1)
    w.write(2, {'loss': 1.25})
    w.close()
    assert metrics_writers.read_metrics(str(d))[-1] == {'round': 2, 'loss': 1.25}
    assert len(metrics_writers.read_metrics(str(d))) == 3


def test_plot_runs_overlays(tmp_path):
  for name, acc in (('a', 0.5), ('b', 0.7)):
    d = tmp_path / name
    d.mkdir()
    with open(d / 'metrics.jsonl', 'w') as f:
      for r in range(3):
        f.write(json.dumps({'round': r, 'loss': 1.0 / (r + 1),
                            'eval_accuracy': acc + 0.1 * r}) + '\n')
  out = plotting.plot_runs([str(tmp_path / 'a'), str(tmp_path / 'b')],
                           str(tmp_path / 'cmp.png'))
  with open(out, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


@pytest.mark.slow
def test_mesh_shards_cohorts_over_devices_with_the_same_numbers(files, tmp_path):
  config = _load_config(files)
  config.rounds = 3
  config.cohort_size = 8
  config.tensorboard = False
  config.plot = False
  plain = runner.run(config, str(tmp_path / 'plain'))
  config.mesh = 'clients=-1'  # The 8 host devices of tests/conftest.py.
  sharded = runner.run(config, str(tmp_path / 'mesh'))
  for x, y in zip(jax.tree.leaves(plain.state.params),
                  jax.tree.leaves(sharded.state.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
  with pytest.raises(registry.ConfigError, match='clients=-1'):
    config.mesh = 'clients'
    processes.make_mesh(config_lib.with_defaults(config))


def test_docs_algorithm_example_runs_through_the_registry(files, tmp_path):
  import re  # pylint: disable=import-outside-toplevel
  with open(os.path.join(REPO, 'docs', 'algorithms.md'), encoding='utf-8') as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
  code = [b for b in blocks if 'def fedavg_decay' in b][0]
  namespace = {}
  exec(code, namespace)  # pylint: disable=exec-used
  registry.register_algorithm('fedavg_decay', namespace['fedavg_decay'])
  try:
    config = _load_config(files)
    config.rounds = 3
    config.tensorboard = config.plot = False
    config.algorithm = dict(name='fedavg_decay', server_learning_rate=1.0)
    result = runner.run(config, str(tmp_path))
    assert result.step == 3 and np.isfinite(result.history[-1]['eval_loss'])
  finally:
    registry.ALGORITHMS.pop('fedavg_decay')


def _small(files, **fields):
  config = _load_config(files)
  config.tensorboard = config.plot = False
  for key, value in fields.items():
    setattr(config, key, value)
  return config


def test_a_nonfinite_server_state_stops_and_is_never_checkpointed(files, tmp_path):
  # A server learning rate of 1e38 sends the parameters to ~1e38 in round 1
  # and to NaN in round 2 (float32 overflows at 3.4e38).
  config = _small(files, rounds=6, checkpoint_every=1)
  config.algorithm.server_learning_rate = 1e38
  workdir = str(tmp_path / 'run')
  with pytest.raises(run_trainer.NonFiniteError) as e:
    runner.run(config, workdir)
  message = str(e.value)
  assert '\n' not in message and 'NaN or Inf' in message
  bad = int(message.split()[1].rstrip(':'))
  assert f'after round {bad - 1}' in message
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  try:
    assert ckpt.latest_step() == bad - 1
    state, _ = ckpt.restore(bad - 1, experiment.build(config).algorithm.init(
        experiment.build(config).init_params))
  finally:
    ckpt.close()
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
  # The lock is released: the workdir can be used again at once.
  config.nonfinite = 'off'
  config.algorithm.server_learning_rate = 1e38
  with pytest.raises(registry.ConfigError, match='nonfinite'):
    runner.run(config, workdir)  # A different experiment, not a busy workdir.


def test_an_infinite_training_loss_stops_the_run_as_it_stops_a_sweep_trial(tmp_path):
  """Digits with a server learning rate of 1e38: the weights stay finite
  (about 1e38) while every training loss is Inf. The run stops there with
  one line naming the metrics, as fedjx-sweep marks the trial diverged (one
  rule, guarded_rounds.must_stop)."""
  from fedjx.experiments import config_base  # pylint: disable=import-outside-toplevel
  config = config_base.base_config()
  config.rounds, config.cohort_size, config.batch_size = 4, 5, 16
  config.progress, config.plot, config.tensorboard = False, False, False
  config.dataset = dict(name='digits', num_clients=12, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(name='fedavg', server_optimizer=config_base.optimizer(
      'sgd', learning_rate=1e38))
  with pytest.raises(run_trainer.NonFiniteError) as e:
    runner.run(config, str(tmp_path / 'run'), log=lambda m: None)
  message = str(e.value)
  assert '\n' not in message
  assert re.match(r"^round \d+: the round's metrics became NaN or Inf \(.*"
                  r"train_loss_before=inf", message), message
  rows = metrics_writers.read_metrics(str(tmp_path / 'run'))
  assert all(np.isfinite(v) for r in rows[:-1] for v in r.values())


def _guarded_fedavg(calls):
  """fedavg that takes ``skip_nonfinite`` and reports one non-finite client
  in round index 2 (as the guarded builders do)."""
  from fedjx import algorithms  # pylint: disable=import-outside-toplevel

  def builder(loss_fn, *, skip_nonfinite: bool = True, **kwargs):
    calls.append(skip_nonfinite)
    algo = algorithms.fedavg(loss_fn, skip_nonfinite=skip_nonfinite, **kwargs)

    def round_(state, cohort, key):
      index = int(state.round_index)
      state, metrics = algo.round(state, cohort, key)
      if skip_nonfinite:
        metrics = dict(metrics, nonfinite_clients=np.int32(index == 2))
      return state, metrics
    return algo._replace(round=round_)
  return builder


@pytest.mark.parametrize('policy', config_lib.NONFINITE)
def test_nonfinite_policy_reaches_the_builder_and_stop_stops(files, tmp_path, policy):
  calls = []
  registry.register_algorithm('guarded_fedavg', _guarded_fedavg(calls))
  try:
    config = _small(files, rounds=4, nonfinite=policy)
    config.algorithm = dict(name='guarded_fedavg', local_epochs=1)
    if policy == 'stop':
      with pytest.raises(run_trainer.NonFiniteError,
                         match=r'^round 3: 1 client\(s\) had a non-finite'):
        runner.run(config, str(tmp_path))
      rows = metrics_writers.read_metrics(str(tmp_path))
      assert rows[-1]['round'] == 3 and rows[-1]['nonfinite_clients'] == 1
    else:
      result = runner.run(config, str(tmp_path))
      assert result.step == 4
      counts = [r.get('nonfinite_clients') for r in result.history[1:]]
      assert counts == ([0, 0, 1, 0] if policy == 'skip' else [None] * 4)
    assert calls == [policy != 'off']
    config.algorithm.skip_nonfinite = False
    with pytest.raises(registry.ConfigError, match="no option 'skip_nonfinite'"):
      config_lib.validate(config)
  finally:
    registry.ALGORITHMS.pop('guarded_fedavg')


def test_the_all_finite_check_reads_every_float_leaf():
  tree = {'a': np.ones(3, np.float32), 'b': {'c': np.arange(4)},
          'd': np.zeros((2, 2), np.float16)}
  assert bool(guarded_rounds.all_finite(tree))
  for bad in (np.nan, np.inf, -np.inf):
    broken = dict(tree, d=np.array([[0, 0], [0, bad]], np.float16))
    assert not bool(guarded_rounds.all_finite(broken))


def test_resuming_with_a_changed_state_structure_is_one_line(files, tmp_path):
  from fedjx import models  # pylint: disable=import-outside-toplevel
  config = _small(files, rounds=2, checkpoint_every=1, checkpoints_to_keep=1)
  config.model = dict(name='tiny_mlp')
  workdir = str(tmp_path / 'run')
  registry.register_model('tiny_mlp', lambda num_classes: models.mlp(
      num_classes, hidden=(8,)))
  try:
    runner.run(config, workdir)
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
    assert ckpt.all_steps() == [1, 2]  # At least two are kept.
    ckpt.close()
    # Same config, different code behind the name: the structures differ.
    registry.register_model('tiny_mlp', lambda num_classes: models.mlp(
        num_classes, hidden=(16,)))
    config.rounds = 3
    with pytest.raises(registry.ConfigError) as e:
      runner.run(config, workdir)
  finally:
    registry.MODELS.pop('tiny_mlp')
  message = str(e.value)
  assert '\n' not in message and 'different model or optimizer' in message
  assert re.search(r"state leaf \S+: shape \((64, )?8,?\) float32 -> "
                   r"\((64, )?16,?\) float32", message), message


def test_one_writer_per_workdir_and_a_dead_holder_never_blocks(tmp_path):
  from fedjx.experiments import workdir_lock  # pylint: disable=import-outside-toplevel
  with workdir_lock.hold(str(tmp_path)):
    with pytest.raises(workdir_lock.WorkdirLocked,
                       match=rf'pid {os.getpid()} on host .* running since '):
      with workdir_lock.hold(str(tmp_path)):
        pass
  with workdir_lock.hold(str(tmp_path)):  # Released on exit.
    pass
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time\n'
       'from fedjx.experiments import workdir_lock\n'
       'with workdir_lock.hold(sys.argv[1]):\n'
       '  print("held", flush=True); time.sleep(600)\n', str(tmp_path)],
      stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'held'
    with pytest.raises(workdir_lock.WorkdirLocked, match=f'pid {holder.pid} '):
      with workdir_lock.hold(str(tmp_path)):
        pass
  finally:
    holder.kill()
    holder.wait()
  with workdir_lock.hold(str(tmp_path)):  # The dead holder's file is left.
    pass


def test_a_metrics_rewrite_interrupted_before_the_replace_keeps_the_old_file(
    tmp_path, monkeypatch):
  for fmt in metrics_writers.FORMATS:
    d = tmp_path / fmt
    d.mkdir()
    w = metrics_writers.make_writer(str(d), fmt, tensorboard=False)
    for r in range(4):
      w.write(r, {'loss': float(r)})
    w.close()
    before = (d / f'metrics.{fmt}').read_text()

    def fail(src, dst):
      raise KeyboardInterrupt  # As if the process stopped here.
    monkeypatch.setattr(metrics_writers.os, 'replace', fail)
    with pytest.raises(KeyboardInterrupt):
      metrics_writers.make_writer(str(d), fmt, tensorboard=False, resume_round=1)
    monkeypatch.undo()
    assert (d / f'metrics.{fmt}').read_text() == before
    (d / f'.metrics.{fmt}.stale.tmp').write_text('x')  # A killed rewrite's file.
    w = metrics_writers.make_writer(str(d), fmt, tensorboard=False, resume_round=1)
    w.close()
    assert [r['round'] for r in metrics_writers.read_metrics(str(d))] == [0, 1]
    assert sorted(os.listdir(d)) == [f'metrics.{fmt}']


def test_a_restored_state_that_differs_from_its_checksum_falls_back(tmp_path, monkeypatch):
  state = {'w': np.arange(6, dtype=np.float32).reshape(2, 3),
           'count': np.int32(3)}
  ckpt = checkpointing.Checkpointer(str(tmp_path), max_to_keep=2, async_save=False)
  try:
    ckpt.save(1, state, {'step': 1})
    ckpt.save(2, jax.tree.map(lambda x: x + 1, state), {'step': 2})
    real_restore = checkpointing.Checkpointer.restore

    def altered(self, step, like):  # One bit of step 2 changes on the way.
      restored, meta = real_restore(self, step, like)
      if step == 2:
        w = np.array(restored['w'])
        w.view(np.uint32)[0, 0] ^= 1
        restored = dict(restored, w=w)
      return restored, meta
    monkeypatch.setattr(checkpointing.Checkpointer, 'restore', altered)
    warnings = []
    restored, meta = ckpt.restore_latest_intact(state, warn=warnings.append)
  finally:
    ckpt.close()
  assert meta['step'] == 1
  np.testing.assert_array_equal(restored['w'], state['w'])
  assert len(warnings) == 1 and 'step 2' in warnings[0] and 'checksum' in warnings[0]
  ckpt = checkpointing.Checkpointer(str(tmp_path))
  try:
    assert ckpt.all_steps() == [1]  # The damaged step was deleted.
  finally:
    ckpt.close()


def test_checksum_and_structure_see_every_leaf():
  a = {'w': np.zeros((2, 3), np.float32), 'b': np.zeros(3, np.float32)}
  assert checkpointing.checksum(a) == checkpointing.checksum(jax.tree.map(np.copy, a))
  flipped = dict(a, b=np.array([0.0, -0.0, 0.0], np.float32))  # Sign bit only.
  assert checkpointing.checksum(flipped) != checkpointing.checksum(a)
  same = checkpointing.structure(a)
  assert checkpointing.structure_difference(same, same) is None
  wider = checkpointing.structure(dict(a, w=np.zeros((2, 4), np.float32)))
  assert checkpointing.structure_difference(same, wider) == (
      "state leaf ['w']: shape (2, 3) float32 -> (2, 4) float32")
  more = checkpointing.structure(dict(a, c=np.zeros(1, np.int32)))
  assert 'is new' in checkpointing.structure_difference(same, more)


def test_the_server_model_check_runs_inside_the_round_and_changes_nothing_else():
  """``checking_finiteness``: the round's own program reports whether the new
  server model is finite; state and metrics are bit-identical otherwise."""
  import optax  # pylint: disable=import-outside-toplevel
  from fedjx import algorithms  # pylint: disable=import-outside-toplevel
  from test_algorithms_util import linreg_data, linreg_params, make_cohort  # pylint: disable=import-outside-toplevel

  def loss(params, batch):
    return 0.5 * jnp.square(batch['x'] @ params['w'] + params['b'] - batch['y'])

  cohort = make_cohort(linreg_data(np.random.default_rng(0), [6, 8, 5], dim=3),
                       batch_size=4)
  params = linreg_params(3)
  for lr, finite in ((0.1, True), (np.inf, False)):
    algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1),
                             server_optimizer=optax.sgd(lr)).compile(donate=False)
    checked = guarded_rounds.checking_finiteness(algo)
    assert hasattr(checked.round, 'lower')  # One compiled program.
    key = jax.random.key(0)
    state, metrics = algo.round(algo.init(params), cohort, key)
    state2, metrics2 = checked.round(algo.init(params), cohort, key)
    assert bool(metrics2.pop(guarded_rounds.PARAMS_FINITE)) is finite
    assert metrics2.keys() == metrics.keys()
    for a, b in zip(jax.tree.leaves((state, metrics)), jax.tree.leaves((state2, metrics2))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A round that is not a compiled program is left as it is (the loop checks).
  plain = algo._replace(round=lambda s, c, k: algo.apply(s, c, k))
  assert guarded_rounds.checking_finiteness(plain) is plain


def _digits_with_a_nan_client(bad):
  """The digits builder with NaN in one feature of the first example of client
  ``bad`` (an int, or a collection of ints)."""
  bad = {bad} if isinstance(bad, int) else set(bad)
  from fedjx.datasets import federated  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import data as data_lib  # pylint: disable=import-outside-toplevel

  class Poisoned(federated.MappedDataset):

    def _client_data(self, cid):
      out = dict(self._base.client_data(cid))
      if cid in bad:
        x = np.array(out['x'], np.float32)
        x[0, 0] = np.nan
        out['x'] = x
      return out

  def build(num_clients=50, alpha=0.5, seed=0):
    data = data_lib.digits(num_clients=num_clients, alpha=alpha, seed=seed)
    return data_lib.ExperimentData(Poisoned(data.train, lambda e: e), data.test,
                                   data.info)
  return build


def _first_seen_late(files):
  """A client first sampled after the first checkpoint (round index >= 5), and
  the round indices that sample it."""
  exp = experiment.build(_small(files))
  rounds = [set(np.asarray(c.client_ids).tolist()) for c in exp.cohorts(0, 12)]
  for cid in range(20):
    seen = [r for r, ids in enumerate(rounds) if cid in ids]
    if seen and seen[0] >= 5:
      return cid, seen
  raise AssertionError('no client is first sampled after round 5')


@pytest.mark.parametrize('policy,checkpoint_every', [('skip', 4), ('skip', 12),
                                                     ('stop', 4)])
def test_a_nan_client_redoes_its_round_guarded_and_the_run_is_exact(
    files, tmp_path, policy, checkpoint_every):
  """Rounds run unguarded; a round with a NaN client is redone guarded from
  the state before it, rebuilt from the last checkpoint (after rounds 4 and
  8, or none before the end) by replaying the rounds since as they ran
  (guarded_rounds). The run equals the same rounds computed by hand, bit for
  bit, and its rows count the client."""
  bad, seen = _first_seen_late(files)
  assert len(seen) >= 2  # A later replay runs the first such round again.
  registry.register_dataset('digits_nan', _digits_with_a_nan_client(bad))
  try:
    config = _small(files, nonfinite=policy, checkpoint_every=checkpoint_every)
    config.dataset.name = 'digits_nan'
    if policy == 'stop':
      with pytest.raises(run_trainer.NonFiniteError,
                         match=rf'^round {seen[0] + 1}: 1 client\(s\) had a non-finite'):
        runner.run(config, str(tmp_path))
      rows = metrics_writers.read_metrics(str(tmp_path))
      assert [r['nonfinite_clients'] for r in rows if 'clients' in r] == (
          [0.0] * seen[0] + [1.0])
      return
    result = runner.run(config, str(tmp_path))
    # The same rounds by hand: unguarded, except where the client is sampled.
    exp = experiment.build(config)
    fast = guarded_rounds.checking_finiteness(
        experiment.build_algorithm(config, exp.model, 20, guarded=False), whole=True)
    slow = guarded_rounds.checking_finiteness(exp.algorithm)
    state = exp.algorithm.init(exp.init_params)
    peek = jax.jit(fast.apply)  # Does not donate.
    for r, cohort in enumerate(exp.cohorts(0, 12)):
      key = exp.round_key_for(r)
      # The unguarded round is finite exactly where the client is not sampled.
      assert bool(peek(state, cohort, key)[1][guarded_rounds.RESULT_FINITE]) is (
          r not in seen)
      state, _ = (slow if r in seen else fast).round(state, cohort, key)
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = [r for r in metrics_writers.read_metrics(str(tmp_path)) if 'clients' in r]
    assert [r['round'] for r in rows] == list(range(1, 13))
    assert [r['nonfinite_clients'] for r in rows] == [
        1.0 if r in seen else 0.0 for r in range(12)]
    assert all(np.isfinite(r['train_loss_before']) for r in rows)
    assert not any(k.startswith('_') for r in rows for k in r)
  finally:
    registry.DATASETS.pop('digits_nan')


@pytest.mark.slow  # ~6 s: two runs.
def test_a_nan_client_in_fedbuff_is_counted_as_when_every_round_is_guarded(
    tmp_path, monkeypatch):
  """Asynchronous cohorts rebuilt for the replay (guarded_rounds): the same
  clients are skipped as when every round runs guarded, and the models agree
  to float rounding (the two differ only in the programs of clean rounds)."""
  from fedjx.experiments import cli  # pylint: disable=import-outside-toplevel
  registry.register_dataset('digits_nan', _digits_with_a_nan_client((3, 7)))
  try:
    runs = {}
    for mode in ('unguarded_first', 'always_guarded'):
      if mode == 'always_guarded':
        fedbuff = registry.ALGORITHMS['fedbuff']
        guarded = functools.wraps(fedbuff)(lambda *a, **k: fedbuff(*a, **k))
        guarded.traits = fedbuff.traits._replace(updates_reach_params=False)
        monkeypatch.setitem(registry.ALGORITHMS, 'fedbuff', guarded)
      config = cli.load_config_file(os.path.join(REPO, 'configs', 'fedbuff_digits.py'))
      config.rounds, config.checkpoint_every, config.eval_every = 8, 3, 8
      config.progress = config.plot = config.tensorboard = False
      config.dataset.name = 'digits_nan'
      result = runner.run(config, str(tmp_path / mode), log=lambda m: None)
      rows = [r for r in result.history if 'clients' in r]
      runs[mode] = ([r['nonfinite_clients'] for r in rows], result.state.params)
    counts, params = runs['unguarded_first']
    assert counts == runs['always_guarded'][0] and sum(counts) > 0
    # The two runs differ only in how clean rounds form their 10-client
    # weighted sums (2 gamma_10 apart, relative); to first order 8 rounds
    # add up: 2 gamma_80 (ft.rtol(80)), also as an absolute bound at scale 1.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(runs['always_guarded'][1])):
      np.testing.assert_allclose(a, b, rtol=ft.rtol(8 * 10), atol=ft.rtol(8 * 10))
  finally:
    registry.DATASETS.pop('digits_nan')
