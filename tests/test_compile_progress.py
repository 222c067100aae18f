"""The runner says what compiles before the first round, and XLA's
slow-compile alarm reads as progress, not as an error."""

import os

import pytest

from config_files import load

from fedjx.experiments import compile_progress
from fedjx.experiments import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALARM = (b'E0101 00:00:00.000000   4242 slow_operation_alarm.cc:73] \n'
         + b'*' * 32 + b'\nVery slow compile? If you want to file a bug, run with '
         b'envvar XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.\n'
         + b'*' * 32 + b'\n')


def test_the_first_round_is_announced_and_timed(tmp_path):
  config = load(os.path.join(REPO, 'configs', 'fedavg_digits.py'))
  config.rounds = 2
  config.tensorboard = config.plot = False
  config.progress = True  # The lines are progress, shown with the bar.
  messages = []
  result = runner.run(config, str(tmp_path / 'shown'), log=messages.append)
  assert result.step == 2
  compiling = [m for m in messages if m.startswith('fedjx: compiling')]
  assert compiling == ['fedjx: compiling the round of fedavg (model mlp, 10 '
                       'clients)...'], messages
  done = [m for m in messages if m.startswith('fedjx: compiled the round')]
  assert len(done) == 1 and messages.index(done[0]) > messages.index(compiling[0])
  seconds = float(done[0].split('took ')[1].split(' s')[0])
  assert 0 < seconds < 600
  config.progress = False  # A quiet run logs only what happened to it.
  quiet = []
  runner.run(config, str(tmp_path / 'quiet'), log=quiet.append)
  assert not [m for m in quiet if m.startswith('fedjx: compil')], quiet


def test_the_slow_compile_alarm_becomes_one_progress_line(capfd):
  with compile_progress.slow_compile_notice_as_progress():
    os.write(2, b'W0101 a warning before\n' + ALARM + b'E0101 a real error\n')
    os.write(2, b'a partial line')
  err = capfd.readouterr().err
  assert 'file a bug' not in err and '*' * 32 not in err
  assert 'slow_operation_alarm' not in err
  assert err.count('fedjx: still compiling the round (') == 1
  assert "notice, not an error)" in err
  lines = err.splitlines()
  assert lines[0] == 'W0101 a warning before'
  assert lines[2:] == ['E0101 a real error', 'a partial line']


def test_other_lines_of_the_alarm_s_file_pass_unchanged(capfd):
  other = (b'E0101 00:00:00.000000 1 slow_operation_alarm.cc:80] something '
           b'else\nnext line\n')
  with compile_progress.slow_compile_notice_as_progress():
    os.write(2, other)
  assert capfd.readouterr().err.encode() == other


@pytest.mark.slow
def test_compile_times_prints_one_json_line_per_config():
  import json  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'compile_times.py'),
       '--small', 'fedprox_synthetic', 'emnist'],
      capture_output=True, text=True, check=True, timeout=300).stdout
  rows = [json.loads(line) for line in out.splitlines()]
  assert len(rows) == 1  # emnist needs downloaded files: not an offline config
  row = rows[0]
  assert row['config'] == 'fedprox_synthetic' and row['algorithm'] == 'fedprox'
  assert row['model'] == 'logistic_regression' and row['clients'] == 10
  assert 0 < row['lower_s'] and 0 < row['compile_s']
  assert row['total_s'] == round(row['lower_s'] + row['compile_s'], 2) or abs(
      row['total_s'] - row['lower_s'] - row['compile_s']) <= 0.011
