"""``fedjx-plot``: overlays the learning curves of runs (or sweep trials) in one PNG.

::

  fedjx-plot runs/diloco_k4 runs/diloco_k1 --out runs/compare.png \\
      --metrics eval_loss,eval_accuracy
  fedjx-plot runs/fedavg runs/fednova --x simulated_time \\
      --metrics eval_accuracy       # against the system model's clock, hours
  fedjx-plot runs/grid/trials/*     # a sweep's trials are runs too

Each argument is a run directory (its ``metrics.jsonl`` or ``metrics.csv``)
or a metrics file. Every error is one line on stderr with exit status 2: a
path that holds no metrics, a metric or x axis no run reports (with the
closest name and the ones there are), labels that do not match the runs, an
output that cannot be written. ``--debug`` (or ``FEDJX_DEBUG=1``) shows the
traceback instead. The work is :func:`fedjx.experiments.plotting.plot_runs`.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence

from fedjx.experiments import errors
from fedjx.experiments import metrics_writers
from fedjx.experiments import plotting

PROG = 'fedjx-plot'
USAGE_STATUS = 2


class PlotError(ValueError):
  """A command-line mistake of ``fedjx-plot`` (one line)."""


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=PROG, description='Overlays the learning curves of runs in one PNG.',
      epilog='example: fedjx-plot runs/a runs/b --metrics eval_accuracy '
      '--out runs/compare.png')
  parser.add_argument('workdirs', nargs='+', metavar='RUN',
                      help='run directories (or metrics files); a sweep\'s '
                      'trials/<name> folders are runs too')
  parser.add_argument('--out', default='runs/compare.png', help='the PNG to write '
                      '(default runs/compare.png)')
  parser.add_argument('--metrics', default=None,
                      help='comma-separated metrics (default: loss and the eval '
                      'metrics the runs report)')
  parser.add_argument('--labels', default=None,
                      help='comma-separated labels, one per run (default: the '
                      'folder names)')
  parser.add_argument('--title', default=None, help='a title above the panels')
  parser.add_argument('--x', default='round',
                      help="x axis: 'round' (default), 'simulated_time' (the "
                      "system model's clock, in hours) or another metric")
  parser.add_argument('--debug', action='store_true',
                      help='full tracebacks instead of one-line errors')
  return parser


def _split(text: str | None) -> list[str] | None:
  return [t.strip() for t in text.split(',') if t.strip()] if text else None


def plot(workdirs: Sequence[str], out: str, metrics: Sequence[str] | None = None,
         labels: Sequence[str] | None = None, title: str | None = None,
         x: str = 'round') -> str:
  """Checks the arguments, then writes the plot; returns its path.

  Raises:
    PlotError: a path without metrics, a metric or x axis that no run
      reports, labels that do not match the runs (one line each).
  """
  if labels is not None and len(labels) != len(workdirs):
    raise PlotError(f'--labels gives {len(labels)} labels for {len(workdirs)} '
                    'runs; give one per run.')
  reported: set[str] = set()
  for path in workdirs:
    if not os.path.exists(path):
      raise PlotError(f'no such run directory or metrics file {path!r}.')
    try:
      rows = metrics_writers.read_metrics(path)
    except FileNotFoundError as e:
      raise PlotError(' '.join(str(e).split())) from None
    except (OSError, ValueError) as e:
      raise PlotError(f'{path!r} cannot be read as metrics: '
                      f'{" ".join(str(e).split())}') from None
    reported |= {k for row in rows for k in row}
  there = sorted(reported - {'round'})
  for flag, names in (('--metrics', metrics or ()), ('--x', (x,))):
    for name in names:
      if name not in reported and not (flag == '--x' and name == 'round'):
        raise PlotError(f'{flag}: no run reports {name!r}.'
                        f'{errors.suggest(name, there)} The runs report: {there}.')
  try:
    return plotting.plot_runs(workdirs, out, metrics=metrics, labels=labels,
                              title=title, x=x)
  except OSError as e:
    if e.errno == errno.ENOSPC:
      raise  # metrics_writers.writing named the file and the full disk.
    raise PlotError(f'--out={out!r} cannot be written '
                    f'({e.strerror or type(e).__name__}); choose another '
                    '--out.') from None


def main(argv: Sequence[str] | None = None) -> None:
  """Console-script entry point."""
  args = _parser().parse_args(argv)
  env = os.environ.get('FEDJX_DEBUG', '').strip().lower()
  debug = args.debug or env not in ('', '0', 'false', 'no')
  try:
    path = plot(args.workdirs, args.out, _split(args.metrics), _split(args.labels),
                args.title, args.x)
  except (PlotError, ValueError, OSError) as e:
    if debug:
      raise
    text = ' '.join(str(e).split())
    if not isinstance(e, PlotError):
      text = f'{type(e).__name__}: {text}'
    print(f'{PROG}: {text}', file=sys.stderr)
    sys.exit(USAGE_STATUS)
  print(path)


if __name__ == '__main__':
  main()
