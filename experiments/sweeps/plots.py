"""Plots of a sweep (matplotlib, Agg backend).

* ``sweep_<metric>.png``: for each swept field, the final and best value of
  the main metric against the field's values, mean over seeds with ±1 sd
  error bars, one line per combination of the other swept fields. Numeric
  fields whose positive values span more than a factor of 10 are drawn on a
  log axis.
* ``sweep_best_curves.png``: learning curves of the best settings (by the
  mean over seeds of the main metric's best value), every seed drawn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from fedjx.experiments import metrics_writers
from fedjx.experiments.sweeps import spec


def _numeric(values: Sequence[Any]) -> bool:
  return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def plot_sweep(workdir: str, settings: Sequence[Mapping[str, Any]],
               fields: Sequence[str], main: str) -> list[str]:
  """One figure per sweep: a panel per swept field; returns the paths written."""
  if not fields:
    return []
  names = spec.short_names(fields)
  stats = [k for k in (f'best_{main}', f'final_{main}')
           if any(f'{k}_mean' in s for s in settings)]
  fig, axes = plt.subplots(len(stats), len(fields),
                           figsize=(4.8 * len(fields), 3.4 * len(stats)),
                           squeeze=False)
  for col, field in enumerate(fields):
    others = [f for f in fields if f != field]
    lines: dict[str, list[Mapping[str, Any]]] = {}
    for s in settings:
      label = ', '.join(f'{names[o]}={spec.format_value(s.get(o))}'
                        for o in others)
      lines.setdefault(label, []).append(s)
    for row, stat in enumerate(stats):
      ax = axes[row][col]
      for label, rows in lines.items():
        rows = [r for r in rows if f'{stat}_mean' in r]
        values = [r.get(field) for r in rows]
        xs = values if _numeric(values) else list(range(len(values)))
        order = sorted(range(len(rows)), key=lambda i: xs[i])
        ax.errorbar([xs[i] for i in order],
                    [rows[i][f'{stat}_mean'] for i in order],
                    yerr=[rows[i][f'{stat}_sd'] for i in order],
                    marker='o', capsize=3, label=label or None)
        if not _numeric(values):
          ax.set_xticks(range(len(values)), [str(v) for v in values])
      if _numeric([s.get(field) for s in settings]):
        positive = [s.get(field) for s in settings if s.get(field) > 0]
        if positive and len(positive) == len(settings) and (
            max(positive) > 10 * min(positive)):
          ax.set_xscale('log')
      ax.set_xlabel(names[field])
      ax.set_ylabel(stat.replace('_', ' '))
      ax.grid(alpha=0.3)
      if len(lines) > 1:
        ax.legend(fontsize='x-small')
  fig.suptitle(f'{main}: mean ± sd over seeds')
  fig.tight_layout()
  path = os.path.join(workdir, f'sweep_{main}.png')
  with metrics_writers.writing(path):  # A full disk names the plot.
    fig.savefig(path, dpi=100)
  plt.close(fig)
  return [path]


def plot_best_curves(workdir: str, trials: Sequence[Any],
                     trial_rows: Sequence[Mapping[str, Any]],
                     histories: Mapping[str, Sequence[Mapping[str, Any]]],
                     main: str, top: int = 3) -> str | None:
  """Learning curves of the ``top`` best settings (every seed)."""
  key = f'best_{main}' if any(f'best_{main}' in r for r in trial_rows) else f'final_{main}'
  lower = spec.lower_is_better(main)
  by_setting: dict[str, list[float]] = {}
  for t, r in zip(trials, trial_rows):
    if key in r:
      by_setting.setdefault(repr(sorted(t.setting.items())), []).append(r[key])
  if not by_setting:
    return None
  ranked = sorted(by_setting, key=lambda k: sum(by_setting[k]) / len(by_setting[k]),
                  reverse=not lower)[:top]
  names = spec.short_names(list(trials[0].setting))
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for rank, setting_key in enumerate(ranked):
    color = colors[rank % len(colors)]
    labelled = False
    for t in trials:
      if repr(sorted(t.setting.items())) != setting_key:
        continue
      series = spec.finite_series(histories[t.name], main)
      if not series:
        continue
      label = None
      if not labelled:
        label = ', '.join(f'{names[p]}={spec.format_value(v)}'
                          for p, v in t.setting.items()) or 'base config'
        labelled = True
      ax.plot(*zip(*series), color=color, alpha=0.8, label=label)
  ax.set_xlabel('round')
  ax.set_ylabel(main)
  ax.set_title(f'best {len(ranked)} settings (every seed)')
  ax.grid(alpha=0.3)
  ax.legend(fontsize='small')
  fig.tight_layout()
  path = os.path.join(workdir, 'sweep_best_curves.png')
  with metrics_writers.writing(path):  # A full disk names the plot.
    fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
