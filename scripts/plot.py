"""Overlays the learning curves of several runs into one PNG.

  python scripts/plot.py runs/diloco_k4 runs/diloco_k1 --out runs/diloco.png \
      --metrics eval_loss,eval_accuracy
  python scripts/plot.py runs/fedavg runs/fednova --x simulated_time \
      --metrics eval_accuracy       # against the system model's clock, hours
"""

import argparse

from fedjx.experiments import plotting


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('workdirs', nargs='+', help='run directories (or metric files)')
  parser.add_argument('--out', default='runs/compare.png', help='PNG to write')
  parser.add_argument('--metrics', default=None,
                      help='comma-separated metrics (default: loss and eval metrics)')
  parser.add_argument('--labels', default=None, help='comma-separated run labels')
  parser.add_argument('--title', default=None)
  parser.add_argument('--x', default='round',
                      help="x axis: 'round' (default), 'simulated_time' (the "
                           'system model\'s clock, in hours) or another metric')
  args = parser.parse_args()
  path = plotting.plot_runs(
      args.workdirs, args.out,
      metrics=args.metrics.split(',') if args.metrics else None,
      labels=args.labels.split(',') if args.labels else None, title=args.title,
      x=args.x)
  print(path)


if __name__ == '__main__':
  main()
