"""Learning curves with matplotlib (Agg backend: no display needed).

A curve plot has one panel per metric (by default the training loss and the
evaluation accuracy and loss, where present); :func:`plot_runs` overlays
several runs, labelled by their directory names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from fedjx.experiments import metrics_writers

DEFAULT_METRICS = ('loss', 'eval_loss', 'eval_accuracy')
# x axes other than a metric's own name: (axis label, scale of the values).
# ``simulated_time`` (seconds, config.systems) is plotted in hours.
X_AXES = {'round': ('round', 1.0),
          'simulated_time': ('simulated time (hours)', 1.0 / 3600.0)}


def _series(rows: Sequence[Mapping[str, Any]], metric: str, x: str = 'round'):
  xs, ys = [], []
  scale = X_AXES.get(x, (x, 1.0))[1]
  for row in rows:
    value = row.get(metric)
    if isinstance(value, (int, float)) and value is not None and isinstance(
        row.get(x), (int, float)):
      xs.append(row[x] * scale)
      ys.append(float(value))
  return xs, ys


def plot_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str,
                metrics: Sequence[str] | None = None,
                title: str | None = None, x: str = 'round') -> str:
  """Plots ``metric`` against round (or ``x``) for each run, one panel per metric.

  Args:
    runs: label -> metric rows (dicts with a ``round`` key).
    path: the PNG to write (parent directories are created).
    metrics: which metrics; default: those of :data:`DEFAULT_METRICS` present
      in some run.
    title: a figure title.
    x: the metric on the x axis: ``'round'``, ``'simulated_time'`` (the
      system model's clock, shown in hours) or any other metric; rows
      without it are left out.

  Returns:
    ``path``.
  """
  if metrics is None:
    present = {k for rows in runs.values() for row in rows for k in row}
    metrics = [m for m in DEFAULT_METRICS if m in present]
  if not metrics:
    raise ValueError('plot_curves: none of the requested metrics are in the runs; '
                     f'available metrics: {sorted({k for rows in runs.values() for row in rows for k in row} - {"round"})}.')
  fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6),
                           squeeze=False)
  for ax, metric in zip(axes[0], metrics):
    for label, rows in runs.items():
      xs, ys = _series(rows, metric, x)
      if xs:
        ax.plot(xs, ys, marker='.' if len(xs) < 40 else None, label=label)
    ax.set_xlabel(X_AXES.get(x, (x, 1.0))[0])
    ax.set_title(metric)
    ax.grid(alpha=0.3)
  if len(runs) > 1 or title is None:
    axes[0][-1].legend(fontsize='small')
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with metrics_writers.writing(path):  # A full disk names the plot.
    fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot_runs(workdirs: Sequence[str], path: str,
              metrics: Sequence[str] | None = None,
              labels: Sequence[str] | None = None,
              title: str | None = None, x: str = 'round') -> str:
  """Overlays the learning curves of several run directories into ``path``
  (against ``x``, as :func:`plot_curves`)."""
  if labels is not None and len(labels) != len(workdirs):
    raise ValueError(f'plot_runs: {len(labels)} labels for {len(workdirs)} runs.')
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  runs = {label: metrics_writers.read_metrics(w) for label, w in zip(labels, workdirs)}
  return plot_curves(runs, path, metrics, title, x=x)
