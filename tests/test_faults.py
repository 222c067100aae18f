"""Fault injection on real ``fedjx-run`` processes.

Each test damages a run the way real faults do (SIGKILL at a point drawn from
a seeded RNG, SIGTERM, a second process on the workdir, a truncated, altered
or deleted checkpoint file, a changed model) and checks what
docs/experiments.md ("What a run guarantees") promises: the final parameters
are bit-identical to an uninterrupted run, and the metrics file holds every
round exactly once, with the uninterrupted run's values.

Faults are injected by ``fault.py``: it patches one function of fedjx to die
(or signal itself) at the chosen point, then runs the ``fedjx-run`` entry
point in the same process. The uninterrupted reference run is shared by the
module.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import config_files

from fedjx.experiments import checkpointing
from fedjx.experiments import metrics_writers
from fedjx.experiments import runner

ROUNDS = 8
# 8 rounds of FedAdam on digits with softmax regression; a checkpoint after
# every second round (at most 2 kept).
CONFIG_FILE = textwrap.dedent(f'''
    from fedjx.experiments.config_base import base_config, optimizer

    def get_config():
      config = base_config()
      config.seed = 5
      config.rounds = {ROUNDS}
      config.cohort_size = 4
      config.batch_size = 16
      config.local_steps = 2
      config.eval_every = 4
      config.checkpoint_every = 2
      config.progress = False
      config.plot = False
      config.dataset = dict(name='digits', num_clients=12, alpha=0.5)
      config.model = dict(name='logistic_regression')
      config.algorithm = dict(
          name='fedadam',
          client_optimizer=optimizer('sgd', learning_rate=0.1),
          server_learning_rate=0.05)
      return config
''')

# FAULT=<kind>:<n> chooses the fault; the rest of argv goes to fedjx-run.
FAULT = textwrap.dedent('''
    import os, signal, sys, time
    from fedjx.experiments import checkpointing, cli, metrics_writers, registry

    kind, n = os.environ['FAULT'].split(':')
    n = int(n)

    def kill(sig=signal.SIGKILL):
      os.kill(os.getpid(), sig)

    write = metrics_writers.JsonlWriter.write
    def patched_write(self, round_, metrics):
      if kind == 'kill_in_row' and round_ == n:
        # Half a row reaches the file, then the process dies.
        self._file.write('{"round": %d, "clie' % round_)
        self._file.flush()
        kill()
      write(self, round_, metrics)
      if kind == 'term_after_row' and round_ == n:
        kill(signal.SIGTERM)
      if kind == 'hold_after_row' and round_ == n:
        open(os.environ['HOLDING'], 'w').close()
        while not os.path.exists(os.environ['RELEASE']):
          time.sleep(0.02)
    metrics_writers.JsonlWriter.write = patched_write

    save = checkpointing.Checkpointer.save
    def patched_save(self, step, state, meta, force=False):
      save(self, step, state, meta, force)
      if kind == 'kill_in_save' and step == n:
        kill()  # The asynchronous write has started, not finished.
    checkpointing.Checkpointer.save = patched_save

    replace = os.replace
    def patched_replace(src, dst):
      if kind == 'kill_in_rewrite' and str(dst).endswith('metrics.jsonl'):
        if n == 0:
          kill()  # The new file is written, not yet in place.
        replace(src, dst)
        kill()  # In place, the run not yet going.
      replace(src, dst)
    os.replace = patched_replace

    import errno
    import orbax.checkpoint as ocp
    json_save = ocp.JsonCheckpointHandler._save_fn
    async def patched_json_save(self, x, directory):
      if kind == 'enospc_in_save' and isinstance(x, dict) and x.get('step') == n:
        # The disk fills while the background thread writes the metadata.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
      return await json_save(self, x, directory)
    ocp.JsonCheckpointHandler._save_fn = patched_json_save

    build_dataset = registry.build_dataset
    def patched_build_dataset(*args, **kwargs):
      if kind == 'signal_at_startup':
        kill(n)
        time.sleep(5)  # The handler interrupts this.
      return build_dataset(*args, **kwargs)
    registry.build_dataset = patched_build_dataset

    sys.argv = ['fedjx-run'] + sys.argv[1:]
    cli.main()
''')

FEDJX_RUN = os.path.join(os.path.dirname(sys.executable), 'fedjx-run')


@pytest.fixture
def rng(request):
  """Draws kill points: seeded by the test's name, the same on every run."""
  return random.Random(f'20261130:{request.node.name}')


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp('faults')
  (d / 'config_file.py').write_text(CONFIG_FILE)
  (d / 'fault.py').write_text(FAULT)
  return d


def _config(files):
  return config_files.load(files / 'config_file.py')


@pytest.fixture(scope='module')
def reference(files, tmp_path_factory):
  """The uninterrupted run."""
  return runner.run(_config(files), str(tmp_path_factory.mktemp('reference')))


@pytest.fixture(scope='module', autouse=True)
def compilation_cache(tmp_path_factory):
  """A persistent XLA cache shared by the module's processes (compile once)."""
  path = str(tmp_path_factory.mktemp('xla_cache'))
  os.environ['FEDJX_TEST_XLA_CACHE'] = path
  yield path
  os.environ.pop('FEDJX_TEST_XLA_CACHE', None)


def _env(**extra):
  env = dict(os.environ)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env.pop('FEDJX_DEBUG', None)
  if 'FEDJX_TEST_XLA_CACHE' in env:
    env.update(JAX_COMPILATION_CACHE_DIR=env['FEDJX_TEST_XLA_CACHE'],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _fedjx_run(files, workdir, *args, fault=None, env=None, wait=True):
  """``fedjx-run --config <config> --workdir <workdir> ...`` (with a fault)."""
  cmd = [sys.executable, str(files / 'fault.py')] if fault else [
      FEDJX_RUN] if os.path.exists(FEDJX_RUN) else [
          sys.executable, '-m', 'fedjx.experiments.cli']
  cmd += ['--config', str(files / 'config_file.py'), '--workdir', str(workdir),
          *args]
  env = _env(FAULT=fault or 'none:0', **(env or {}))
  if not wait:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _tensorboard_scalars(workdir):
  """``{tag: {step: value}}`` as TensorBoard shows a run's event files.

  Reads the TFRecord files in order (a record cut short by a kill ends a
  file); a ``SessionLog.START`` at step ``s`` (tensorboardX's ``purge_step``)
  discards the earlier events of steps ``>= s``, as TensorBoard does.
  """
  import glob  # pylint: disable=import-outside-toplevel
  import struct  # pylint: disable=import-outside-toplevel
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  scalars = {}
  paths = sorted(glob.glob(os.path.join(workdir, 'tensorboard', 'events.out.tfevents.*')),
                 key=lambda p: int(os.path.basename(p).split('.')[3]))
  for path in paths:
    with open(path, 'rb') as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack('<Q', data[pos:pos + 8])
      if pos + 12 + length + 4 > len(data):
        break
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      if (event.HasField('session_log') and
          event.session_log.status == event_pb2.SessionLog.START):
        for steps in scalars.values():
          for step in [s for s in steps if s >= event.step]:
            del steps[step]
      for value in event.summary.value:
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
  return scalars


def _assert_finished_like(reference, workdir):
  """Bit-identical final parameters; every round's row once, as in the reference."""
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  try:
    assert ckpt.latest_step() == ROUNDS
    state, meta = ckpt.restore(ROUNDS, reference.state)
  finally:
    ckpt.close()
  # The SHA-256 of every leaf's bytes: the whole state is bit-identical.
  assert meta['checksum'] == checkpointing.checksum(reference.state)
  assert checkpointing.checksum(state) == meta['checksum']
  for got, want in zip(jax.tree.leaves(state.params),
                       jax.tree.leaves(reference.state.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  rows = metrics_writers.read_metrics(workdir)
  assert [r['round'] for r in rows] == list(range(ROUNDS + 1))
  for got, want in zip(rows, reference.history):
    got = {k: v for k, v in got.items() if k != 'elapsed_s'}
    want = {k: v for k, v in want.items() if k != 'elapsed_s'}
    assert got == want
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    for line in f:
      json.loads(line)  # No torn line is left behind.
  assert not [n for n in os.listdir(workdir) if n.endswith('.tmp')]
  assert not [n for n in os.listdir(os.path.join(workdir, 'checkpoints'))
              if 'tmp' in n]
  # TensorBoard shows what the metrics file holds, every round once.
  shown = _tensorboard_scalars(workdir)
  expected = {}
  for row in rows:
    for key, value in row.items():
      if key != 'round':
        expected.setdefault(key, {})[row['round']] = float(np.float32(value))
  assert shown == expected


def _one_line(stderr):
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and 'Traceback' not in stderr, stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize('when', [0, 1], ids=['before_replace', 'after_replace'])
@pytest.mark.slow
def test_sigkill_mid_row_then_again_mid_metrics_rewrite(files, reference, tmp_path,
                                                        rng, when):
  workdir = tmp_path / 'run'
  kill_round = rng.randint(3, ROUNDS - 1)
  killed = _fedjx_run(files, workdir, fault=f'kill_in_row:{kill_round}')
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  # The dead process's lock file is left behind; it must not block the rest.
  with open(workdir / '.lock', encoding='utf-8') as f:
    assert json.load(f)['pid'] > 0
  # Killed while resuming, as the truncated metrics file replaces the old one
  # (just before or just after the replacement).
  again = _fedjx_run(files, workdir, fault=f'kill_in_rewrite:{when}')
  assert again.returncode == -signal.SIGKILL, again.stderr[-3000:]
  rows = metrics_writers.read_metrics(str(workdir))
  last_saved = (kill_round - 1) // 2 * 2
  want = list(range(kill_round)) if when == 0 else list(range(last_saved + 1))
  assert [r['round'] for r in rows] == want  # Never an empty or partial file.
  done = _fedjx_run(files, workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f'after round {last_saved}' in done.stderr
  _assert_finished_like(reference, str(workdir))


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write(files, reference, tmp_path, rng):
  workdir = tmp_path / 'run'
  step = rng.choice([4, 6])
  killed = _fedjx_run(files, workdir, fault=f'kill_in_save:{step}')
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  ckpt = checkpointing.Checkpointer(str(workdir / 'checkpoints'))
  try:
    # The interrupted write is either complete or invisible.
    assert ckpt.latest_step() in (step - 2, step)
  finally:
    ckpt.close()
  done = _fedjx_run(files, workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  _assert_finished_like(reference, str(workdir))


def test_sigterm_saves_and_exits_like_ctrl_c(files, reference, tmp_path, rng):
  workdir = tmp_path / 'run'
  at = rng.randint(1, ROUNDS - 1)
  stopped = _fedjx_run(files, workdir, fault=f'term_after_row:{at}')
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
  line = _one_line(stopped.stderr)
  assert f'interrupted after round {at} (SIGTERM)' in line
  ckpt = checkpointing.Checkpointer(str(workdir / 'checkpoints'))
  try:
    assert ckpt.latest_step() == at
  finally:
    ckpt.close()
  assert [r['round'] for r in metrics_writers.read_metrics(str(workdir))] == list(
      range(at + 1))
  result = runner.run(_config(files), str(workdir))  # Continue in-process.
  assert result.step == ROUNDS
  _assert_finished_like(reference, str(workdir))


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_data(
    files, reference, tmp_path, rng):
  workdir = tmp_path / 'run'
  step = rng.choice([4, 6])
  full = _fedjx_run(files, workdir, fault=f'enospc_in_save:{step}')
  assert full.returncode == 2, full.stderr[-3000:]
  line = _one_line(full.stderr)  # No Orbax traceback.
  assert line.startswith(f'fedjx-run: cannot write the checkpoint of step {step} '
                         f'in {workdir}: [Errno 28] No space left on device')
  assert f'of step {step - 2}, is intact' in line
  ckpt = checkpointing.Checkpointer(str(workdir / 'checkpoints'))
  try:
    assert ckpt.latest_step() == step - 2  # The failed write left nothing visible.
  finally:
    ckpt.close()
  rows = metrics_writers.read_metrics(str(workdir))
  assert [r['round'] for r in rows] == list(range(step + 1))
  done = _fedjx_run(files, workdir)  # Space freed: the same command continues.
  assert done.returncode == 0, done.stderr[-3000:]
  assert f'after round {step - 2}' in done.stderr
  _assert_finished_like(reference, str(workdir))


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_is_one_line(files, tmp_path, sig):
  stopped = _fedjx_run(files, tmp_path / 'run', fault=f'signal_at_startup:{int(sig)}')
  assert stopped.returncode == 128 + sig, stopped.stderr[-3000:]
  assert signal.Signals(sig).name in _one_line(stopped.stderr)


@pytest.mark.slow
def test_a_second_process_on_a_live_workdir_stops_at_once(files, reference, tmp_path):
  workdir = tmp_path / 'run'
  holding, release = tmp_path / 'holding', tmp_path / 'release'
  first = _fedjx_run(files, workdir, fault='hold_after_row:3', wait=False,
                     env={'HOLDING': holding, 'RELEASE': release})
  try:
    deadline = time.time() + 120
    while not holding.exists():
      assert first.poll() is None, first.communicate()[1][-3000:]
      assert time.time() < deadline
      time.sleep(0.05)
    second = _fedjx_run(files, workdir)
    assert second.returncode == 2
    line = _one_line(second.stderr)
    assert f'pid {first.pid}' in line and 'in use' in line and 'since' in line
  finally:
    release.touch()
    _, err = first.communicate(timeout=300)
  assert first.returncode == 0, err[-3000:]
  _assert_finished_like(reference, str(workdir))


@pytest.fixture(scope='module')
def stopped_at_six(files, tmp_path_factory):
  """A workdir whose run stopped after round 6 (checkpoints 4 and 6)."""
  config = _config(files)
  config.rounds = 6
  workdir = str(tmp_path_factory.mktemp('six'))
  runner.run(config, workdir)
  return workdir


def _largest_data_file(workdir, step):
  """The largest file of array data (the model's weights) in a checkpoint."""
  root = os.path.join(workdir, 'checkpoints', str(step), 'state')
  paths = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names
           if os.path.basename(d) == 'd']
  return max(paths, key=os.path.getsize)


def _truncate(path):
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)


def _flip(path):
  with open(path, 'r+b') as f:
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0x10
    f.seek(0)
    f.write(data)


@pytest.mark.parametrize('damage', [_truncate, _flip, os.remove],
                         ids=['truncated', 'flipped', 'deleted'])
@pytest.mark.slow
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(
    files, reference, stopped_at_six, tmp_path, damage):
  workdir = str(tmp_path / 'run')
  shutil.copytree(stopped_at_six, workdir)
  damaged = _largest_data_file(workdir, 6)
  damage(damaged)
  done = _fedjx_run(files, workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stderr.splitlines()
  assert len(lines) == 2, done.stderr[-3000:]
  name = os.path.relpath(damaged, os.path.join(workdir, 'checkpoints', '6'))
  assert lines[0].startswith(
      f'fedjx: warning: the checkpoint of step 6 is damaged: its file {name} ')
  assert 'after round 4' in lines[1]
  _assert_finished_like(reference, workdir)


@pytest.mark.parametrize('damage', [_truncate, _flip], ids=['truncated', 'flipped'])
@pytest.mark.slow
def test_damage_is_caught_without_the_file_manifest(
    files, reference, stopped_at_six, tmp_path, damage):
  # A run killed between a checkpoint's completion and its manifest: Orbax's
  # read error or the state's checksum catches the damage (a flipped byte in
  # zstd-compressed data usually decompresses to other values, which only
  # the checksum sees; tests/test_runner.py checks that path directly).
  workdir = str(tmp_path / 'run')
  shutil.copytree(stopped_at_six, workdir)
  shutil.rmtree(os.path.join(workdir, 'checkpoint_manifests'))
  damage(_largest_data_file(workdir, 6))
  done = _fedjx_run(files, workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  warnings = [l for l in done.stderr.splitlines() if l.startswith('fedjx: warning')]
  assert len(warnings) == 1 and 'step 6 is damaged' in warnings[0]
  _assert_finished_like(reference, workdir)


def test_resuming_with_a_changed_model_is_one_line(files, stopped_at_six, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(stopped_at_six, workdir)
  out = _fedjx_run(files, workdir, '--config.model.name=mlp')
  assert out.returncode == 2
  line = _one_line(out.stderr)
  assert "model.name: 'logistic_regression' -> 'mlp'" in line
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  try:
    assert ckpt.all_steps() == [4, 6]  # Nothing was touched.
  finally:
    ckpt.close()
