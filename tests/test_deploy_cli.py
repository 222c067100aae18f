"""``fedjx-deploy`` refuses a bad command before any process starts: one
line on stderr naming the argument, its value and what is allowed, exit
status 2 (as ``fedjx-run``). No Flower process is started here."""

import os
import subprocess
import sys

import pytest

from fedjx.deploy import local
from fedjx.experiments.deploy import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, 'configs', 'fedavg_digits.py')
THREE = 'rounds=2 cohort_size=3 dataset.num_clients=3'


@pytest.fixture
def no_federation(monkeypatch):
  def refuse(self, *args, **kwargs):
    raise AssertionError('a process was started for a bad command')
  monkeypatch.setattr(local.LocalFederation, 'start', refuse)
  # Flower is looked for before the config is read: these commands are
  # checked as where Flower is installed (no Flower code runs for them).
  real = cli.importlib.util.find_spec
  monkeypatch.setattr(cli.importlib.util, 'find_spec',
                      lambda name, *a: (real('json') if name == 'flwr'
                                        else real(name, *a)))


@pytest.mark.parametrize('args, names', [
    (['--nodes', '0'], ['--nodes=0', '>= 1']),
    (['--nodes', 'two'], ['--nodes', "'two'"]),
    (['--timeout', '-1'], ['--timeout=-1', '> 0']),
    (['--overrides', 'rouns=3'], ["'rouns'", "'rounds'"]),
    (['--overrides', 'rounds'], ["'rounds'", 'path=value']),
    (['--config.rounds=abc'], ["'rounds'", 'abc']),
    (['--config.dataset.num_clent=3'], ["'num_clent'", "'num_clients'"]),
    (['--config.dataset.num_clients=4', '--config.cohort_size=4'],
     ['--nodes=3', '4 training clients']),
    (['--overrides', "algorithm={'name':'fedbuff'}"], ['config.algorithm']),
])
def test_a_bad_command_is_one_line_and_status_2(args, names, no_federation, tmp_path,
                                                 capsys):
  argv = ['--config', CONFIG, '--workdir', str(tmp_path / 'w'), '--overrides', THREE]
  status = cli.main(argv + args)
  err = capsys.readouterr().err
  assert status == 2, err
  assert err.startswith('fedjx-deploy: ') and err.count('\n') == 1, err
  for name in names:
    assert name in err, err
  assert 'Traceback' not in err


def test_a_missing_config_file_is_one_line(no_federation, tmp_path, capsys):
  assert cli.main(['--config', str(tmp_path / 'nope.py')]) == 2
  err = capsys.readouterr().err
  assert 'nope.py: no such file' in err and err.count('\n') == 1


def test_a_workdir_that_is_a_file_is_one_line(no_federation, tmp_path, capsys):
  (tmp_path / 'file').write_text('x')
  assert cli.main(['--config', CONFIG, '--workdir', str(tmp_path / 'file')]) == 2
  err = capsys.readouterr().err
  assert 'file' in err and err.count('\n') == 1


def test_config_overrides_in_fedjx_run_s_spelling_join_the_others():
  args = cli.parse_args(['--config', CONFIG, '--overrides', 'rounds=2',
                         '--config.model.hidden=(16,)'])
  assert args.overrides == 'rounds=2 model.hidden=(16,)'


def test_without_flower_the_command_names_the_install_before_importing_jax(tmp_path):
  """A missing Flower is said before the config is read (which imports JAX,
  seconds), with the command that installs it from this checkout (fedjx is
  on no package index) and the packages that Flower's caps downgrade."""
  code = ('import sys\n'
          "sys.modules['flwr'] = None  # not installed: find_spec says None\n"
          'from fedjx.experiments.deploy import cli\n'
          f'status = cli.main(["--config", {CONFIG!r}, "--workdir", '
          f'{str(tmp_path / "w")!r}, "--overrides", {THREE!r}])\n'
          "print(status, 'jax' in sys.modules)\n")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       timeout=120, cwd=REPO, check=False)
  assert out.stdout == '2 False\n', out.stderr
  assert out.stderr == (
      "fedjx-deploy: Flower is not installed: pip install -e '.[flower]' (Flower "
      'caps packaging<26, rich<15 and cryptography<51, so pip downgrades newer '
      'ones; fedjx and its tests run with either).\n')
  assert not (tmp_path / 'w').exists()  # A refused command leaves nothing.
