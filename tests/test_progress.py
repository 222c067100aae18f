"""Progress bars of runs and sweeps: where a resumed bar starts, where log lines go."""

import io
import re

import pytest
from tqdm import auto as tqdm_auto

from fedjx.experiments import config_base
from fedjx.experiments import loop
from fedjx.experiments import runner
from fedjx.experiments.sweeps import run


def small_config(rounds):
  config = config_base.base_config()
  config.rounds = rounds
  config.cohort_size = 4
  config.batch_size = 16
  config.local_steps = 1
  config.eval_every = 2
  config.checkpoint_every = 2
  config.progress = True
  config.tensorboard = False
  config.plot = False
  config.prefetch = 0
  config.dataset = dict(name='digits', num_clients=8, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(
      name='fedadam', client_optimizer=config_base.optimizer('sgd', learning_rate=0.1),
      server_learning_rate=0.05)
  return config


@pytest.fixture
def bars(monkeypatch):
  """Every tqdm bar the runner and the sweep make, kept with its arguments."""
  made = []

  class Recorded(tqdm_auto.tqdm):  # pylint: disable=too-many-ancestors

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.initial_n = self.n
      made.append(self)

  monkeypatch.setattr(tqdm_auto, 'tqdm', Recorded)
  return made


def _starts_a_line(text, message):
  """Whether every occurrence of ``message`` in ``text`` begins a line."""
  parts = text.split(message)
  assert len(parts) > 1, (message, text[-2000:])
  return all(before == '' or before[-1] in '\r\n' for before in parts[:-1])


def test_a_log_line_goes_above_the_bar_which_is_drawn_again_below():
  stream = io.StringIO()
  bar = tqdm_auto.tqdm(total=4, initial=1, file=stream, unit='round')
  loop.log_above(bar, lambda msg: stream.write(msg + '\n'), 'fedjx: a line')
  text = stream.getvalue()
  before, after = text.split('fedjx: a line\n')
  assert before.endswith('\r')  # The bar's line was cleared first...
  assert '1/4' in after  # ...and the bar drawn again below the line.
  bar.close()
  # A bar that is off (config.progress=False) writes nothing of its own.
  quiet, lines = tqdm_auto.tqdm(total=4, disable=True), []
  loop.log_above(quiet, lines.append, 'x')
  assert lines == ['x']


@pytest.mark.slow
def test_a_resumed_sweep_s_bar_starts_at_the_rounds_done(tmp_path, bars, capsys):
  settings = [{'algorithm.server_learning_rate': v} for v in (0.02, 0.1)]
  workdir = str(tmp_path / 'sweep')
  # Two groups (one setting each) of 2 rounds, then the same sweep resumed
  # to 4 rounds: 4 of its 8 rounds are done when it starts.
  run.run_sweep(small_config(2), workdir, settings, (0,), settings_per_program=1)
  first = bars[-1]
  assert (first.initial_n, first.n, first.total) == (0, 4, 4)
  capsys.readouterr()
  run.run_sweep(small_config(4), workdir, settings, (0,), settings_per_program=1)
  resumed = bars[-1]
  assert (resumed.initial_n, resumed.n, resumed.total) == (4, 8, 8)
  err = capsys.readouterr().err
  for group in ('group_000', 'group_001'):  # Logged while the bar shows.
    assert _starts_a_line(err, f'fedjx-sweep: resuming {group} after round 2.')
  assert re.search(r'8/8 \[', err)


def test_a_resumed_run_s_bar_starts_at_its_checkpoint(tmp_path, bars, capsys):
  workdir = str(tmp_path / 'run')
  runner.run(small_config(2), workdir)
  capsys.readouterr()
  runner.run(small_config(4), workdir)
  bar = bars[-1]
  assert (bar.initial_n, bar.n, bar.total) == (2, 4, 4)
  err = capsys.readouterr().err
  assert _starts_a_line(err, 'fedjx: compiled the round')


def _interrupt_after(step):
  """A hook that sends this process SIGINT after round ``step``."""
  import os  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel

  def hook(s, *args):
    del args
    if s == step:
      os.kill(os.getpid(), signal.SIGINT)
  return hook


def test_after_ctrl_c_the_message_is_below_the_bar(tmp_path, bars, capsys):
  result = runner.run(small_config(4), str(tmp_path / 'run'),
                      hooks=[_interrupt_after(1)])
  assert result.interrupted and result.step == 1
  err = capsys.readouterr().err
  message = 'fedjx: interrupted after round 1 (SIGINT)'
  assert _starts_a_line(err, message)
  assert '1/4' in err.split(message)[0]  # The bar stays, above it...
  assert '%|' not in err.split(message)[1]  # ...and is not drawn again below.


def test_after_ctrl_c_a_sweep_s_message_is_below_its_bar(tmp_path, bars, capsys,
                                                         monkeypatch):
  from fedjx.experiments.sweeps import trainer  # pylint: disable=import-outside-toplevel
  after = trainer.GroupTrainer.after
  kill = _interrupt_after(1)

  def interrupting(self, step, rows):
    after(self, step, rows)
    kill(step)
  monkeypatch.setattr(trainer.GroupTrainer, 'after', interrupting)
  result = run.run_sweep(small_config(4), str(tmp_path / 'sweep'),
                         [{'algorithm.server_learning_rate': 0.1}], (0,))
  assert result.interrupted
  err = capsys.readouterr().err
  message = 'fedjx-sweep: interrupted (SIGINT)'
  assert _starts_a_line(err, message)
  assert '%|' not in err.split(message)[1]
  # A sweep's population stays on the host: no bar of its own per seed.
  assert 'population to device' not in err
