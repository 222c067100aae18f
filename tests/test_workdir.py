"""The workdir at the command line: what cannot hold a run, --fresh, file modes, a full disk.

The command-line cases run ``fedjx-run`` / ``fedjx-sweep`` in a process of
their own. Faults the tests cannot make for real (they run as root, who may
write anywhere, on a disk with space) are injected by ``wrap.py``: it
patches the one OS call that fails (``os.open`` creating a file in the
workdir, ``os.listdir`` of it, the write of a metrics row) to raise as the
kernel does, then runs the entry point in the same process.
"""

import io
import json
import os
import pty
import stat
import subprocess
import sys
import textwrap

import pytest

from fedjx.experiments import metrics_writers
from fedjx.experiments import workdir as workdir_lib
from fedjx.experiments import workdir_lock

CONFIG = textwrap.dedent('''
    from fedjx.experiments.config_base import base_config, optimizer

    def get_config():
      config = base_config()
      config.rounds = 2
      config.cohort_size = 4
      config.batch_size = 16
      config.local_steps = 1
      config.progress = False
      config.tensorboard = False
      config.dataset = dict(name='digits', num_clients=8, alpha=0.5)
      config.model = dict(name='logistic_regression')
      config.algorithm = dict(
          name='fedavg',
          client_optimizer=optimizer('sgd', learning_rate=0.1),
          server_optimizer=optimizer('sgd', learning_rate=1.0))
      return config
''')

# FAULT=<kind>[:<n>] and TARGET=<workdir> choose the fault; argv[1] is the
# program (fedjx-run or fedjx-sweep), the rest its arguments.
WRAP = textwrap.dedent('''
    import errno, os, sys
    kind, _, n = os.environ.get('FAULT', '').partition(':')
    target = os.path.abspath(os.environ.get('TARGET', '/nonexistent'))

    def in_target(path):
      return os.path.dirname(os.path.abspath(os.fspath(path))) == target

    if kind == 'unwritable':  # What creating a file in a 0555 directory raises.
      real_open = os.open
      def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and in_target(path):
          raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, *args, **kwargs)
      os.open = fake_open

    if kind == 'unreadable':  # What listing a 0333 directory raises.
      real_listdir = os.listdir
      def fake_listdir(path='.'):
        if os.path.abspath(os.fspath(path)) == target:
          raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_listdir(path)
      os.listdir = fake_listdir

    if kind == 'enospc_row':  # The disk fills as metrics row n is written.
      from fedjx.experiments import metrics_writers

      class FullDisk:
        def __init__(self, f):
          self.f = f
        def write(self, text):
          if text.startswith('{"round": %d,' % int(n)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
          return self.f.write(text)
        def __getattr__(self, name):
          return getattr(self.f, name)

      init = metrics_writers.JsonlWriter.__init__
      def patched_init(self, path):
        init(self, path)
        self._file = FullDisk(self._file)
      metrics_writers.JsonlWriter.__init__ = patched_init
      truncate = metrics_writers.JsonlWriter.truncate
      def patched_truncate(self, last_round):
        truncate(self, last_round)
        self._file = FullDisk(self._file)
      metrics_writers.JsonlWriter.truncate = patched_truncate

    from fedjx.experiments import cli
    from fedjx.experiments.sweeps import cli as sweeps_cli
    prog = sys.argv[1]
    sys.argv = [prog] + sys.argv[2:]
    cli.main() if prog == 'fedjx-run' else sweeps_cli.main()
''')

RUN_FILES = ['checkpoint_manifests/', 'checkpoints/', 'config.json',
             'learning_curve.png', 'metrics.jsonl']


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp('workdir')
  (d / 'config_file.py').write_text(CONFIG)
  (d / 'wrap.py').write_text(WRAP)
  return d


def _cli(files, prog, workdir, *args, fault='', target=None, umask=None,
         stdin=subprocess.DEVNULL):
  env = dict(os.environ, JAX_PLATFORMS='cpu', FAULT=fault,
             TARGET=str(workdir if target is None else target))
  env.pop('FEDJX_DEBUG', None)
  cmd = [sys.executable, str(files / 'wrap.py'), prog, '--config',
         str(files / 'config_file.py'), '--workdir', str(workdir), *args]
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                        stdin=stdin, umask=-1 if umask is None else umask)


def _one_line(out):
  lines = [l for l in out.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and 'Traceback' not in out.stderr, out.stderr[-3000:]
  return lines[0]


def _mode(path):
  return stat.S_IMODE(os.stat(path).st_mode)


# ----------------------------------------------------- workdirs that fail

@pytest.mark.parametrize('prog', ['fedjx-run', 'fedjx-sweep'])
def test_a_workdir_that_is_a_file_or_under_one_is_one_line(files, tmp_path, prog):
  a_file = tmp_path / 'results.txt'
  a_file.write_text('not a directory')
  out = _cli(files, prog, a_file)
  assert out.returncode == 2
  assert _one_line(out) == (
      f'{prog}: --workdir={str(a_file)!r} is a file, not a directory; give a '
      'directory (it is created if missing), or move the file away.')
  out = _cli(files, prog, a_file / 'run')
  assert out.returncode == 2
  assert _one_line(out) == (
      f"{prog}: --workdir={str(a_file / 'run')!r}: {str(a_file)!r} is a file, so "
      'no directory can be made under it; choose another --workdir.')
  assert a_file.read_text() == 'not a directory'


@pytest.mark.parametrize('prog', ['fedjx-run', 'fedjx-sweep'])
def test_an_unwritable_or_unreadable_workdir_is_one_line(files, tmp_path, prog):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  out = _cli(files, prog, workdir, fault='unwritable')
  assert out.returncode == 2
  assert _one_line(out) == (
      f'{prog}: --workdir={str(workdir)!r} is not writable (Permission denied); '
      f'give yourself access (chmod u+rwx {workdir}) or choose another --workdir.')
  out = _cli(files, prog, workdir, fault='unreadable')
  assert out.returncode == 2
  assert _one_line(out) == (
      f'{prog}: --workdir={str(workdir)!r} cannot be read (Permission denied); '
      f'give yourself access (chmod u+rwx {workdir}) or choose another --workdir.')
  assert os.listdir(workdir) == []  # The probe file was never left behind.
  # A workdir to be made in a directory where no file can be created.
  missing = workdir / 'new' / 'run'
  out = _cli(files, prog, missing, fault='unwritable', target=workdir)
  assert out.returncode == 2
  assert _one_line(out) == (
      f'{prog}: --workdir={str(missing)!r} cannot be created in {str(workdir)!r} '
      '(Permission denied); choose a --workdir where you can write, e.g. under '
      'your home directory.')
  assert os.listdir(workdir) == []


@pytest.mark.slow
def test_a_full_disk_while_a_metrics_row_is_written_is_one_line(files, tmp_path):
  workdir = tmp_path / 'run'
  out = _cli(files, 'fedjx-run', workdir, fault='enospc_row:2')
  assert out.returncode == 2
  assert _one_line(out) == (
      f'fedjx-run: no space left on the device to write {workdir}/metrics.jsonl; '
      'free space (or choose a --workdir on another disk) and run the same '
      'command again: it continues from the newest checkpoint.')
  rows = metrics_writers.read_metrics(str(workdir))
  assert [r['round'] for r in rows] == [0, 1]
  again = _cli(files, 'fedjx-run', workdir)  # Space freed: the same command.
  assert again.returncode == 0, again.stderr[-3000:]
  assert [r['round'] for r in metrics_writers.read_metrics(str(workdir))] == [0, 1, 2]


def test_the_workdir_check_leaves_a_missing_directory_to_the_run(tmp_path):
  path = tmp_path / 'a' / 'b'
  assert workdir_lib.check(str(path)) == str(path)
  assert os.listdir(tmp_path) == []  # Its probe file came and went.
  assert workdir_lib.start_over(str(path), workdir_lib.RUN_OUTPUTS, 'fedjx-run',
                                yes=False) == []


# ------------------------------------------------------------------ --fresh

@pytest.fixture(scope='module')
def finished(files, tmp_path_factory):
  """A finished run, written under umask 027; every test gets a copy."""
  workdir = tmp_path_factory.mktemp('finished') / 'run'
  out = _cli(files, 'fedjx-run', workdir, umask=0o027)
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir


def _copy(finished, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  workdir = tmp_path / 'run'
  shutil.copytree(finished, workdir)
  (workdir / 'notes.txt').write_text('mine')
  return workdir


def test_a_run_s_own_files_follow_the_umask(finished):
  for name in ('config.json', 'metrics.jsonl', 'learning_curve.png',
               'checkpoint_manifests/2.json'):
    assert _mode(finished / name) == 0o640, name
  assert sorted(workdir_lib.outputs(str(finished), workdir_lib.RUN_OUTPUTS)) == RUN_FILES


def test_fresh_without_a_terminal_needs_yes(files, finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  before = sorted(os.listdir(workdir))
  out = _cli(files, 'fedjx-run', workdir, '--fresh')
  assert out.returncode == 2
  assert _one_line(out) == (
      f'fedjx-run: --fresh would remove {", ".join(RUN_FILES)} from {workdir}, and '
      'stdin is not a terminal to confirm it: add --yes to remove them.')
  assert sorted(os.listdir(workdir)) == before


def test_fresh_asks_on_a_terminal_and_a_no_keeps_everything(files, finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  before = sorted(os.listdir(workdir))
  leader, follower = pty.openpty()
  try:
    os.write(leader, b'n\n')
    out = _cli(files, 'fedjx-run', workdir, '--fresh', stdin=follower)
  finally:
    os.close(leader)
    os.close(follower)
  assert out.returncode == 2
  assert out.stderr == (
      f'fedjx-run: --fresh removes {", ".join(RUN_FILES)} from {workdir}. Remove '
      'them? [y/N] fedjx-run: --fresh was not confirmed; nothing was removed from '
      f'{workdir}.\n')
  assert sorted(os.listdir(workdir)) == before


def test_fresh_yes_removes_the_run_and_trains_from_round_zero(files, finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  with open(workdir / 'metrics.jsonl', 'a', encoding='utf-8') as f:
    f.write(json.dumps({'round': 99, 'loss': 1.0}) + '\n')  # Marks the old run.
  out = _cli(files, 'fedjx-run', workdir, '--fresh', '--yes')
  assert out.returncode == 0, out.stderr[-3000:]
  assert (f'fedjx-run: --fresh removed {", ".join(RUN_FILES)} from {workdir}.'
          in out.stderr.splitlines())
  assert 'resuming' not in out.stderr
  assert [r['round'] for r in metrics_writers.read_metrics(str(workdir))] == [0, 1, 2]
  assert (workdir / 'notes.txt').read_text() == 'mine'  # Not a run's file: kept.


def test_fresh_on_a_sweep_names_the_sweep_s_files(files, tmp_path):
  workdir = tmp_path / 'sweep'
  for d in ('groups/group_000/checkpoints', 'trials/t0'):
    (workdir / d).mkdir(parents=True)
  for name in ('sweep.json', 'summary.md', 'sweep_eval_accuracy.png', 'notes.txt',
               '.summary.md.0123abcd.tmp'):
    (workdir / name).write_text('x')
  out = _cli(files, 'fedjx-sweep', workdir, '--fresh')
  assert out.returncode == 2
  assert _one_line(out) == (
      'fedjx-sweep: --fresh would remove .summary.md.0123abcd.tmp, groups/, '
      f'summary.md, sweep.json, sweep_eval_accuracy.png, trials/ from {workdir}, '
      'and stdin is not a terminal to confirm it: add --yes to remove them.')


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_start_over_removes_only_a_run_s_files_once_confirmed(tmp_path):
  workdir = tmp_path / 'run'
  (workdir / 'checkpoints' / '2').mkdir(parents=True)
  (workdir / 'metrics.jsonl').write_text('{}\n')
  (workdir / 'mine.py').write_text('x')
  shown = io.StringIO()
  removed = workdir_lib.start_over(str(workdir), workdir_lib.RUN_OUTPUTS, 'fedjx-run',
                                   yes=False, stdin=_Terminal('y\n'), stderr=shown)
  assert removed == ['checkpoints/', 'metrics.jsonl']
  assert shown.getvalue().startswith(
      f'fedjx-run: --fresh removes checkpoints/, metrics.jsonl from {workdir}. '
      'Remove them? [y/N] ')
  assert sorted(os.listdir(workdir)) == ['.lock', 'mine.py']
  # A workdir another run holds is left alone, whatever the answer.
  (workdir / 'metrics.jsonl').write_text('{}\n')
  with workdir_lock.hold(str(workdir)):
    with pytest.raises(workdir_lock.WorkdirLocked, match='is in use by pid'):
      workdir_lib.start_over(str(workdir), workdir_lib.RUN_OUTPUTS, 'fedjx-run',
                             yes=True, stderr=io.StringIO())
  assert (workdir / 'metrics.jsonl').exists()
