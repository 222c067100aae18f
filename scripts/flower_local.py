"""Runs a fedjx config on a local Flower federation: ``fedjx-deploy``.

  python scripts/flower_local.py --config configs/fedavg_digits.py --nodes 3 \
      --overrides "rounds=3 cohort_size=3 dataset.num_clients=3" \
      --workdir runs/flower_local

is the same command as ``fedjx-deploy ...`` (see experiments/deploy/cli.py and
docs/deploy.md).
"""

import sys

from fedjx.experiments.deploy import cli

if __name__ == '__main__':
  sys.exit(cli.main())
