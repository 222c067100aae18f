"""Runs an experiment from a config file (the same as the ``fedjx-run`` command).

  python scripts/run.py --config configs/fedavg_digits.py --config.rounds=100 \
      --workdir runs/x

``--help`` lists the flags; ``--debug`` shows full tracebacks. SIGINT and
SIGTERM are handled from the first line on, before fedjx (and JAX) is
imported: a signal during start-up is one line and exit status 128 + N.
"""

import os
import signal
import sys


def _stopped(signum, frame):
  del frame
  os.write(2, f'fedjx-run: stopped by {signal.Signals(signum).name}; the workdir '
           'keeps its last complete checkpoint, if any.\n'.encode())
  os._exit(128 + signum)  # pylint: disable=protected-access


if __name__ == '__main__':
  for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, _stopped)  # cli.main installs its own next.
  from fedjx.experiments import cli  # pylint: disable=g-import-not-at-top
  cli.main()
  sys.exit(0)
