"""The summary of a sweep: tables per trial and per setting, and plots.

Per trial (``summary_trials.csv``): the swept values, the seed, the final
value of every metric, the best value of each evaluation metric (maximum,
or minimum for a loss), the round it was reached, the rounds to the target
(first round at or past it; empty if never) and the round the trial
diverged (empty if it did not). Runs whose aggregator counts bits (the
compressors, secure sums: ``upload_bits`` and ``download_bits`` per client)
also get ``total_upload_bits`` and ``total_download_bits``, the sum over
rounds of bits per client times the round's ``clients``, and ``summary.md``
shows them beside the main metric (accuracy against bits).

Per setting (``summary.csv``, ``summary.md``): the mean and the sample
standard deviation (``ddof=1``; 0 for one seed) over seeds of those numbers,
the number of seeds, how many diverged and how many reached the target.
Diverged trials enter the means with their last finite values; the
``diverged`` column says how many there were.

Plots: ``sweep_<metric>.png`` (the main metric's final and best value
against each swept field, mean over seeds with ±1 sd error bars, one line
per combination of the other swept fields) and ``sweep_best_curves.png``
(learning curves of the best settings, every seed).
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedjx.experiments import metrics_writers
from fedjx.experiments.sweeps import plots
from fedjx.experiments.sweeps import spec

MAIN_METRICS = ('eval_accuracy', 'eval_loss', 'train_loss_after',
                'train_loss_during', 'train_loss_before', 'train_loss', 'loss')


def parse_target(text: str | None) -> tuple[str, float] | None:
  """``'eval_accuracy=0.9'`` -> ``('eval_accuracy', 0.9)``."""
  if not text:
    return None
  metric, sep, value = text.partition('=')
  try:
    number = float(value)
  except ValueError:
    number = float('nan')
  if not sep or not metric.strip() or not math.isfinite(number):
    raise spec.SweepError(f'--target={text!r}: write METRIC=NUMBER, e.g. '
                          'eval_accuracy=0.9.')
  return metric.strip(), number


def trial_row(trial: Any, rows: Sequence[Mapping[str, Any]],
              target: tuple[str, float] | None) -> dict[str, Any]:
  """One line of ``summary_trials.csv`` from a trial's metric rows."""
  out: dict[str, Any] = {'trial': trial.name, **trial.setting, 'seed': trial.seed}
  metrics = sorted({k for r in rows for k in r} - {'round', 'elapsed_s', 'diverged'})
  for m in metrics:
    series = spec.finite_series(rows, m)
    if not series:
      continue
    out[f'final_{m}'] = series[-1][1]
    if m.startswith('eval_'):
      pick = min if spec.lower_is_better(m) else max
      best_round, best = pick(series, key=lambda rv: rv[1])
      out[f'best_{m}'] = best
      out[f'best_round_{m}'] = best_round
  for way in ('upload', 'download'):  # compressors' bits: the run's traffic
    per_round = [(r.get(f'{way}_bits'), r.get('clients')) for r in rows]
    counted = [b * c for b, c in per_round if isinstance(b, (int, float))
               and isinstance(c, (int, float)) and math.isfinite(b * c)]
    if counted:
      out[f'total_{way}_bits'] = float(sum(counted))
  diverged = [int(r['round']) for r in rows if r.get('diverged')]
  out['diverged_round'] = diverged[0] if diverged else None
  out['rounds'] = max((int(r['round']) for r in rows), default=0)
  if target is not None:
    metric, value = target
    reached = [rnd for rnd, v in spec.finite_series(rows, metric)
               if (v <= value if spec.lower_is_better(metric) else v >= value)]
    out['rounds_to_target'] = reached[0] if reached else None
  return out


def setting_rows(trial_rows: Sequence[Mapping[str, Any]], fields: Sequence[str]
                 ) -> list[dict[str, Any]]:
  """Mean and sd over seeds of every numeric column, per setting."""
  groups: dict[str, list[Mapping[str, Any]]] = {}
  for row in trial_rows:
    key = repr([row.get(f) for f in fields])
    groups.setdefault(key, []).append(row)
  out = []
  skip = set(fields) | {'trial', 'seed', 'diverged_round'}
  for rows in groups.values():
    summary: dict[str, Any] = {f: rows[0].get(f) for f in fields}
    summary['seeds'] = len(rows)
    summary['diverged'] = sum(r.get('diverged_round') is not None for r in rows)
    columns = [k for k in rows[0] if k not in skip]
    for k in columns:
      values = [r.get(k) for r in rows]
      numbers = [float(v) for v in values
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
      if k == 'rounds_to_target':
        summary['reached_target'] = len(numbers)
      if not numbers:
        continue
      summary[f'{k}_mean'] = float(np.mean(numbers))
      summary[f'{k}_sd'] = float(np.std(numbers, ddof=1)) if len(numbers) > 1 else 0.0
    out.append(summary)
  return out


def _write_csv(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
  columns: list[str] = []
  for row in rows:
    columns.extend(k for k in row if k not in columns)
  text = io.StringIO()
  writer = csv.DictWriter(text, columns)
  writer.writeheader()
  for row in rows:
    writer.writerow({k: ('' if v is None else v) for k, v in row.items()})
  metrics_writers.write_atomically(path, text.getvalue())


def _fmt(v: Any) -> str:
  if v is None:
    return ''
  if isinstance(v, float):
    return f'{v:.4g}'
  return str(v)


def markdown(settings: Sequence[Mapping[str, Any]], fields: Sequence[str],
             main: str, target: tuple[str, float] | None) -> str:
  """The per-setting table as Markdown: mean ± sd of the main metric."""
  names = spec.short_names(fields)
  head = [names[f] for f in fields] + ['seeds', f'final {main}', f'best {main}']
  if target is not None:
    head += [f'rounds to {target[0]}={target[1]:g}', 'reached']
  bits = any('final_upload_bits_mean' in row for row in settings)
  if bits:  # accuracy against bits: per client and round, and in all
    head += ['upload bits / client / round', 'total upload bits']
  head += ['diverged']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]

  def pm(row, key):
    if f'{key}_mean' not in row:
      return '–'
    return f'{row[f"{key}_mean"]:.4g} ± {row[f"{key}_sd"]:.2g}'

  for row in settings:
    cells = [_fmt(row.get(f)) for f in fields] + [str(row['seeds']),
                                                  pm(row, f'final_{main}'),
                                                  pm(row, f'best_{main}')]
    if target is not None:
      cells += [pm(row, 'rounds_to_target'),
                f'{row.get("reached_target", 0)}/{row["seeds"]}']
    if bits:
      cells += [pm(row, 'final_upload_bits'), pm(row, 'total_upload_bits')]
    cells += [str(row['diverged'])]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def main_metric(trial_rows: Sequence[Mapping[str, Any]]) -> str | None:
  present = {k[len('final_'):] for r in trial_rows for k in r if k.startswith('final_')}
  return next((m for m in MAIN_METRICS if m in present), None)


def write_summary(workdir: str, trials: Sequence[Any], fields: Sequence[str],
                  fmt: str, target: tuple[str, float] | None,
                  plot: bool = True, metric: str | None = None) -> list[dict[str, Any]]:
  """Writes the tables (and plots) of a finished sweep; returns the trial rows.

  ``metric`` is the main metric of ``summary.md`` and the plots (default: the
  first of :data:`MAIN_METRICS` that the trials report).
  """
  histories = {t.name: metrics_writers.read_metrics(
      metrics_writers.metrics_path(os.path.join(workdir, 'trials', t.name), fmt))
               for t in trials}
  trial_rows = [trial_row(t, histories[t.name], target) for t in trials]
  per_setting = setting_rows(trial_rows, fields)
  _write_csv(os.path.join(workdir, 'summary_trials.csv'), trial_rows)
  _write_csv(os.path.join(workdir, 'summary.csv'), per_setting)
  main = main_metric(trial_rows)
  if metric is not None:
    if not any(f'final_{metric}' in r for r in trial_rows):
      present = sorted({k[len('final_'):] for r in trial_rows for k in r
                        if k.startswith('final_')})
      raise spec.SweepError(f'--metric={metric!r}: the trials report no such '
                            f'metric; they report {present}.')
    main = metric
  if main is not None:
    text = (f'# Sweep summary\n\nMean ± sample sd over seeds; main metric '
            f'`{main}` ({"lower" if spec.lower_is_better(main) else "higher"} is '
            f'better).\n\n' + markdown(per_setting, fields, main, target))
    metrics_writers.write_atomically(os.path.join(workdir, 'summary.md'), text)
    if plot:
      plots.plot_sweep(workdir, per_setting, fields, main)
      plots.plot_best_curves(workdir, trials, trial_rows, histories, main)
  return trial_rows
