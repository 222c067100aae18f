"""Runs a sweep from a config file (the same as the ``fedjx-sweep`` command).

  python scripts/sweep.py --config configs/fedadam_digits.py --workdir runs/grid \
      --sweep 'algorithm.server_learning_rate=0.01,0.1' --seeds 0,1,2

SIGINT and SIGTERM are handled from the first line on, before fedjx (and
JAX) is imported: a signal during start-up is one line and exit status
128 + N.
"""

import os
import signal
import sys


def _stopped(signum, frame):
  del frame
  os.write(2, f'fedjx-sweep: stopped by {signal.Signals(signum).name}; the '
           'workdir keeps its last complete checkpoints, if any.\n'.encode())
  os._exit(128 + signum)  # pylint: disable=protected-access


if __name__ == '__main__':
  for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, _stopped)  # The command line installs its own next.
  from fedjx.experiments.sweeps import cli  # pylint: disable=g-import-not-at-top
  cli.main()
  sys.exit(0)
