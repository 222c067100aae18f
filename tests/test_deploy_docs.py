"""docs/deploy.md as tests, with real Flower processes (slow tests).

Every ``sh`` block of the page runs as written, in a directory whose
``configs`` is the repository's, on free ports; and ``fedjx-deploy``
stopped by SIGTERM mid-round, then run again, ends with the uninterrupted
run's model. Every process a test starts is stopped when it ends (on
failure too): the shell's session and whatever it started in others.
"""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip('flwr', reason="Flower is not installed: pip install -e '.[flower]'")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedjx.deploy import local  # noqa: E402
from fedjx.experiments.deploy.config_rounds import load_config  # noqa: E402
from fedjx.experiments import metrics_writers  # noqa: E402
from fedjx.experiments import runner  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, 'docs', 'deploy.md')
BIN = os.path.dirname(sys.executable)
DONE = 'FEDJX-DOCS-BLOCK-DONE'


def sh_blocks():
  with open(PAGE, encoding='utf-8') as f:
    return re.findall(r'```sh\n(.*?)```', f.read(), re.S)


def _free_ports(block):
  """The block on free ports (the SuperLink's, and a base for the nodes')."""
  return (block.replace('PORT=8000', f'PORT={local.free_port()}')
          .replace('$((9094 + i))', f'$(({local.free_port()} + i))'))


def _shell(block, cwd, timeout):
  """Runs ``block`` with bash in a session of its own; stops everything it
  started once it is done; returns ``(status, output)``."""
  log = open(os.path.join(cwd, 'block.log'), 'w+b')  # pylint: disable=consider-using-with
  script = f'set -e\n{block}\necho {DONE} $?\nsleep 900\n'
  env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get('PATH', ''))
  process = subprocess.Popen(['bash', '-c', script], cwd=cwd, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, env=env)
  try:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
      with open(log.name, encoding='utf-8', errors='replace') as f:
        if DONE in f.read():
          break
      time.sleep(1.0)
  finally:
    local.LocalFederation(1, cwd, grace=5.0).stop_process(process)
    log.close()
  with open(log.name, encoding='utf-8', errors='replace') as f:
    out = f.read()
  status = int(out.split(DONE)[1].split()[0]) if DONE in out else process.returncode
  return status, out


@pytest.fixture
def docs_dir(tmp_path):
  os.symlink(os.path.join(REPO, 'configs'), tmp_path / 'configs')
  return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize('index', range(len(sh_blocks())))
def test_every_command_of_the_page_runs(index, docs_dir):
  block = sh_blocks()[index]
  if '--simulation' in block and importlib.util.find_spec('ray') is None:
    pytest.skip("Flower's simulation engine needs Ray: pip install 'flwr[simulation]'")
  status, out = _shell(_free_ports(block), str(docs_dir), timeout=1500)
  assert status == 0, out[-3000:]
  workdir = re.search(r'runs/(\w+)', block).group(0)
  _, step = runner.load_state(str(docs_dir / workdir))
  want = int(re.search(r'rounds=(\d+)', block).group(1))
  assert step == want
  rounds = [r['round'] for r in metrics_writers.read_metrics(str(docs_dir / workdir))]
  assert rounds == sorted(set(rounds)) and rounds[-1] == want


SMALL = ('rounds=3 cohort_size=3 dataset.num_clients=3 model.hidden=(16,) '
         'local_epochs=None local_steps=8 eval_every=1 checkpoint_every=2')


def _close(got, want):
  # As tests/test_deploy_flower.py: float32 client work on the same data
  # with the same keys; float64 sums of 3 clients against float32 ones,
  # amplified well under 10x by 3 rounds of 8 local steps.
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=3 * 10 * 3 * 2**-23, atol=2e-6)


def _pids(text):
  found = re.search(r'\(pid (\d+)\), 3 SuperNodes \(pids ([\d, ]+)\)', text)
  return [int(found.group(1))] + [int(p) for p in found.group(2).split(',')]


@pytest.mark.slow
def test_sigterm_mid_round_then_the_same_command_resumes(tmp_path):
  """SIGTERM while round 2 runs: exit 143, a checkpoint of round 1 (off
  the checkpoint_every=2 schedule), no process left; the same command
  again finishes, one row per round, and the model is fedjx-run's."""
  workdir = str(tmp_path / 'deployed')
  command = [os.path.join(BIN, 'fedjx-deploy'), '--config',
             os.path.join(REPO, 'configs', 'fedavg_digits.py'), '--nodes', '3',
             '--overrides', SMALL, '--workdir', workdir, '--timeout', '300']
  err = open(tmp_path / 'first.err', 'w+', encoding='utf-8')  # pylint: disable=consider-using-with
  first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                           start_new_session=True)
  try:
    deadline = time.monotonic() + 900
    while not any(r['round'] == 1 for r in _metrics(workdir)):
      assert first.poll() is None and time.monotonic() < deadline, open(err.name).read()
      time.sleep(0.5)
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(timeout=300) == 128 + signal.SIGTERM
  finally:
    if first.poll() is None:
      local.LocalFederation(1, str(tmp_path)).stop_process(first)
    err.close()
  text = open(err.name, encoding='utf-8').read()
  assert 'stopped by SIGTERM' in text and 'checkpoint after round 1' in text, text
  for pid in _pids(text):
    assert not os.path.exists(f'/proc/{pid}') or _zombie(pid), pid
  assert runner.load_state(workdir)[1] == 1
  assert max(r['round'] for r in _metrics(workdir)) == 1

  again = subprocess.run(command, capture_output=True, text=True, timeout=1500,
                         check=False)
  assert again.returncode == 0, again.stderr[-3000:]
  assert [r['round'] for r in _metrics(workdir)] == [0, 1, 2, 3]
  deployed, step = runner.load_state(workdir)
  assert step == 3
  simulated = runner.run(load_config(os.path.join(REPO, 'configs', 'fedavg_digits.py'),
                                     SMALL), str(tmp_path / 'simulated'))
  for g, w in zip(jax.tree.leaves(deployed), jax.tree.leaves(simulated.state)):
    _close(g, w)


def _metrics(workdir):
  try:
    return metrics_writers.read_metrics(workdir)
  except (OSError, ValueError):
    return []


def _zombie(pid):
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      return f.read().rsplit(')', 1)[1].split()[0] == 'Z'
  except OSError:
    return True
