"""Runs a sweep from a config file (the same as the ``fedjx-sweep`` command).

  python scripts/sweep.py --config configs/fedadam_digits.py --workdir runs/grid \
      --sweep 'algorithm.server_learning_rate=0.01,0.1' --seeds 0,1,2
"""

from fedjx.experiments import sweep_cli

if __name__ == '__main__':
  sweep_cli.main()
