"""scripts/launch_local.py: arguments checked first, one line per failure,
and the other processes stopped at once when one fails."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, 'scripts', 'launch_local.py')


def _launch(*args, timeout=120):
  env = dict(os.environ)
  env.pop('FEDJX_DEBUG', None)
  return subprocess.run([sys.executable, LAUNCH, *args], capture_output=True,
                        text=True, timeout=timeout, env=env)


def _one_line(stderr):
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and 'Traceback' not in stderr, stderr[-3000:]
  return lines[0]


@pytest.fixture
def marker_script(tmp_path):
  """A child that leaves a file behind: it shows whether a process started."""
  path = tmp_path / 'child.py'
  path.write_text(f'open({str(tmp_path / "started")!r}, "w").close()\n')
  return path


@pytest.fixture
def busy_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    s.listen()
    yield s.getsockname()[1]


def test_bad_arguments_are_one_line_before_any_process_starts(tmp_path, marker_script,
                                                              busy_port):
  child = str(marker_script)
  for args, words in (
      (['--num_processes=0', '--', child], ['--num_processes=0', 'an int >= 1']),
      (['--num_processes=two', '--', child], ['--num_processes=two']),
      (['--devices_per_process=0', '--', child], ['--devices_per_process=0']),
      (['--num_processes=2'], ['give the script', 'after --']),
      ([f'--port={busy_port}', '--', child], [f'--port={busy_port}', 'in use']),
      (['--', child, f'--config.coordinator_address=localhost:{busy_port}'],
       [f'port {busy_port}', 'in use']),
      (['--num_processes=2', '--', child, '--config.num_processes=3'],
       ['--config.num_processes=3', '--num_processes=2'])):
    out = _launch(*args)
    assert out.returncode == 2, (args, out.stderr)
    line = _one_line(out.stderr)
    assert line.startswith('launch_local: '), line
    for word in words:
      assert word in line, (args, line)
  assert not (tmp_path / 'started').exists()


CHILD = textwrap.dedent('''
    import os, signal, sys, time
    pid = int(os.environ['FEDJX_PROCESS_ID'])
    assert os.environ['FEDJX_NUM_PROCESSES'] == '3'
    assert os.environ['FEDJX_COORDINATOR'].startswith('localhost:')
    print(f'process {pid} of 3 started', flush=True)
    if pid == 1:
      time.sleep(0.3)
      os.kill(os.getpid(), signal.SIGKILL)  # Dies as an out-of-memory kill would.
    # The others wait on it, as in a collective, deaf to SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
''')


def test_a_failed_process_stops_the_others_at_once(tmp_path):
  child = tmp_path / 'child.py'
  child.write_text(CHILD)
  start = time.monotonic()
  out = _launch('--num_processes=3', '--grace=1', '--', str(child), timeout=300)
  took = time.monotonic() - start
  assert out.returncode == 128 + 9, out.stderr[-3000:]
  assert took < 150, took  # Not the 600 s the survivors would wait.
  assert out.stderr.strip().splitlines()[-1] == (
      'launch_local: process 1 was killed by SIGKILL; stopped processes 0, 2.')
  for pid in range(3):
    assert f'[process {pid}] process {pid} of 3 started' in out.stdout


def test_every_process_succeeding_exits_0(tmp_path):
  child = tmp_path / 'child.py'
  child.write_text('import os\nprint("id", os.environ["FEDJX_PROCESS_ID"])\n')
  out = _launch('--num_processes=2', '--', str(child))
  assert out.returncode == 0 and out.stderr == '', out.stderr
  assert sorted(out.stdout.splitlines()) == ['[process 0] id 0', '[process 1] id 1']
