"""Runs a fedjx script as several cooperating processes on this machine.

Each process gets its own CPU devices and finds the others through the
environment (see fedjx.distributed.launch_local); collectives use gloo.

  python scripts/launch_local.py --num_processes=2 --devices_per_process=4 -- \
      scripts/run.py --config configs/fedavg_digits.py --config.mesh=clients=-1 \
      --workdir runs/two_processes
"""

import sys

from absl import app
from absl import flags

from fedjx import distributed

_PROCESSES = flags.DEFINE_integer('num_processes', 2, 'Processes to start.')
_DEVICES = flags.DEFINE_integer('devices_per_process', 4, 'CPU devices per process.')
_TIMEOUT = flags.DEFINE_float('timeout', None, 'Seconds before every process is killed.')


def main(argv):
  if len(argv) < 2:
    raise app.UsageError('give the script and its arguments after --.')
  results = distributed.launch_local(argv[1:], _PROCESSES.value, _DEVICES.value,
                                     timeout=_TIMEOUT.value)
  for pid, result in enumerate(results):
    for line in (result.stdout + result.stderr).splitlines():
      if not line.startswith('[Gloo]'):
        print(f'[process {pid}] {line}')
  return max(r.returncode for r in results)


if __name__ == '__main__':
  sys.exit(app.run(main))
