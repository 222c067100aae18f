"""Runs an experiment from a config file (the same as the ``fedjx-run`` command).

  python scripts/run.py --config configs/fedavg_digits.py --config.rounds=100 \
      --workdir runs/x

``--help`` lists the flags; ``--debug`` shows full tracebacks.
"""

from fedjx.experiments import cli

if __name__ == '__main__':
  cli.main()
