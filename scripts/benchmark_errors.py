"""How long ``fedjx-run`` takes to say what is wrong (JSON lines).

Each case is a command that ends with one line on stderr (or, for a finished
run, the summary); it is timed as a fresh process (wall clock, and the CPU
time of the process) ``--repeats`` times, alternating with the same case of
``--baseline`` (another installation's ``fedjx-run``, e.g. the checkout
before a change) when one is given. One line per case and command: the
median wall and CPU seconds, the exit status, what a refused run left in its
new workdir, and the first line printed.

  python scripts/benchmark_errors.py --repeats 5 \\
      --baseline /path/to/other/checkout/.venv/bin/fedjx-run

Cases: an unknown algorithm, a cohort larger than the population, a value of
the wrong type, an unknown field, a workdir of another experiment, a
finished run run again, and a workdir another process holds (this script
holds its lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

_CONFIG = flags.DEFINE_string('config', 'configs/fedavg_digits.py', 'Base config.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timings per case and command.')
_BASELINE = flags.DEFINE_string('baseline', None, 'Another fedjx-run to compare with.')
_OUT = flags.DEFINE_string('out', None, 'Also append the JSON lines to this file.')


def _emit(row: dict, out: str | None) -> None:
  line = json.dumps(row)
  print(line, flush=True)
  if out:
    with open(out, 'a', encoding='utf-8') as f:
      f.write(line + '\n')


def _timed(cmd: list[str]) -> tuple[float, float, int, str]:
  """Wall and CPU seconds of ``cmd``, its exit status and first stderr line."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  wall = time.perf_counter() - t0
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  lines = (proc.stderr or proc.stdout).strip().splitlines()
  return wall, cpu, proc.returncode, (lines[0] if lines else '')[:160]


@contextlib.contextmanager
def _held(workdir: str):
  """Holds ``workdir``'s lock as a live run would."""
  os.makedirs(workdir, exist_ok=True)
  fd = os.open(os.path.join(workdir, '.lock'), os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, json.dumps({'pid': os.getpid(), 'host': 'here',
                              'started': 'now'}).encode(), 0)
    yield
  finally:
    os.close(fd)


def main(argv) -> None:
  del argv
  here = os.path.join(os.path.dirname(sys.executable), 'fedjx-run')
  commands = {'this': here}
  if _BASELINE.value:
    commands['baseline'] = _BASELINE.value
  work = tempfile.mkdtemp(prefix='fedjx_errors_bench_')
  config = os.path.abspath(_CONFIG.value)
  quick = ['--config.rounds=2', '--config.progress=False',
           '--config.tensorboard=False']
  try:
    done = os.path.join(work, 'done')
    _, _, status, line = _timed([here, '--config', config, '--workdir', done] + quick)
    if status != 0:
      raise SystemExit(f'the finished run could not be made: {line}')
    cases = {
        'unknown_algorithm': (['--config.algorithm.name=fedavgg'], None),
        'cohort_over_population': (['--config.cohort_size=100000'], None),
        'wrong_type': (['--config.rounds=abc'], None),
        'unknown_field': (['--config.roundz=3'], None),
        'other_experiment': (quick + ['--config.seed=1'], done),
        'finished_rerun': (quick, done),
        'workdir_in_use': (quick, 'held'),
    }
    for case, (args, workdir) in cases.items():
      walls = {name: [] for name in commands}
      cpus = {name: [] for name in commands}
      last = {}
      for i in range(_REPEATS.value):  # The commands alternate.
        for name, binary in commands.items():
          target = workdir if workdir not in (None, 'held') else os.path.join(
              work, f'{case}_{name}_{i}')
          with (_held(target) if workdir == 'held' else contextlib.nullcontext()):
            wall, cpu, status, line = _timed(
                [binary, '--config', config, '--workdir', target] + args)
          walls[name].append(wall)
          cpus[name].append(cpu)
          left = (sorted(os.listdir(target)) if workdir is None and
                  os.path.isdir(target) else None)
          last[name] = (status, line, left)
      for name in commands:
        status, line, left = last[name]
        _emit({'case': case, 'command': name, 'repeats': _REPEATS.value,
               'wall_s': round(statistics.median(walls[name]), 3),
               'cpu_s': round(statistics.median(cpus[name]), 3), 'status': status,
               'left_behind': left, 'line': line}, _OUT.value)
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  app.run(main)
