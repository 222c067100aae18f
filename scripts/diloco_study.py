"""Summarizes the DiLoCo sweeps at equal compute and at equal rounds.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models". Reads the sweeps that ``bash scripts/reproductions.sh OUT
diloco`` writes under ``OUT``:

* ``diloco_h<H>``: DiLoCo, ``K`` replicas of batch ``B``, ``H`` inner steps
  per round, outer learning rate x momentum swept;
* ``diloco_dp``: data-parallel training with batch ``K * B`` for the same
  ``T`` steps, its learning rate swept;
* ``diloco_k4``, ``diloco_k1`` (optional): 4 replicas against 1 at equal
  rounds.

Every arm at equal compute must take the same ``T`` steps over the same
``T * K * B`` examples (checked from each trial's ``config.json``). A
setting's held-out loss is the final ``eval_loss`` of each seed (mean and
sample sd over seeds); the best-tuned setting of an arm is the one with the
lowest mean. Communications: DiLoCo synchronizes once per round (``T / H``),
data-parallel training every step (``T``). "Steps to equal loss" pairs each
seed of DiLoCo's best setting with the same seed of the best data-parallel
setting: the first evaluated step at which data-parallel training reaches
DiLoCo's final loss.

  python scripts/diloco_study.py runs/repro --out benchmarks/results/diloco_equal_compute

writes ``<out>.jsonl`` (one line per setting), ``<out>.png`` (held-out loss
against H, and against communications) and prints the Markdown tables.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedjx.experiments import metrics_writers


def load_trials(sweep_dir: str) -> list[dict[str, Any]]:
  """Each trial of a sweep: its config, eval curve and final eval loss."""
  paths = sorted(glob.glob(os.path.join(sweep_dir, 'trials', '*', 'config.json')))
  if not paths:
    raise FileNotFoundError(f'sweep_dir={sweep_dir!r} holds no trials/*/config.json; '
                            'is it a fedjx-sweep workdir?')
  trials = []
  for path in paths:
    with open(path) as f:
      config = json.load(f)
    rows = metrics_writers.read_metrics(os.path.dirname(path))
    curve = [(r['round'], r['eval_loss']) for r in rows
             if isinstance(r.get('eval_loss'), (int, float))]
    if not curve or curve[-1][0] != config['rounds']:
      raise ValueError(f'trial {os.path.dirname(path)!r} has no eval_loss at its '
                       f'last round {config["rounds"]}; is the sweep finished?')
    steps = config['local_steps']
    trials.append(dict(
        seed=config['seed'], rounds=config['rounds'], steps_per_round=steps,
        replicas=config['cohort_size'], batch_size=config['batch_size'],
        inner_lr=config['algorithm']['inner_optimizer']['learning_rate'],
        outer_lr=config['algorithm']['outer_optimizer']['learning_rate'],
        outer_momentum=config['algorithm']['outer_optimizer']['momentum'],
        steps=[r * steps for r, _ in curve], losses=[l for _, l in curve],
        final=curve[-1][1]))
  return trials


def settings(trials: Sequence[dict[str, Any]], arm: str,
             sync_every_step: bool = False) -> list[dict[str, Any]]:
  """Trials grouped by setting (all but the seed): mean and sd over seeds.

  ``sync_every_step``: data-parallel training communicates every step;
  DiLoCo once per round.
  """
  keys = ('rounds', 'steps_per_round', 'replicas', 'batch_size', 'inner_lr',
          'outer_lr', 'outer_momentum')
  groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
  for t in trials:
    groups.setdefault(tuple(t[k] for k in keys), []).append(t)
  out = []
  for key, group in sorted(groups.items()):
    group = sorted(group, key=lambda t: t['seed'])
    finals = np.array([t['final'] for t in group])
    row = dict(zip(keys, key))
    row.update(
        arm=arm, total_steps=row['rounds'] * row['steps_per_round'],
        examples=row['rounds'] * row['steps_per_round'] * row['replicas']
        * row['batch_size'],
        communications=row['rounds'] * (row['steps_per_round']
                                        if sync_every_step else 1),
        seeds=[t['seed'] for t in group], final_eval_loss=finals.tolist(),
        mean=float(finals.mean()),
        sd=float(finals.std(ddof=1)) if len(finals) > 1 else float('nan'),
        curves={t['seed']: (t['steps'], t['losses']) for t in group})
    out.append(row)
  return out


def best(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The setting with the lowest mean final held-out loss."""
  return min(rows, key=lambda r: r['mean'])


def steps_to_reach(curve: tuple[Sequence[int], Sequence[float]],
                   loss: float) -> int | None:
  """The first evaluated step whose loss is at most ``loss`` (None if never)."""
  for step, value in zip(*curve):
    if value <= loss:
      return step
  return None


def equal_loss(diloco: dict[str, Any], dp: dict[str, Any]) -> list[int | None]:
  """Per seed: data-parallel steps (= syncs) to reach DiLoCo's final loss."""
  out = []
  for seed, final in zip(diloco['seeds'], diloco['final_eval_loss']):
    if seed not in dp['curves']:
      raise ValueError(f'seed {seed} of DiLoCo H={diloco["steps_per_round"]} has no '
                       f'data-parallel trial; data-parallel seeds: {dp["seeds"]}.')
    out.append(steps_to_reach(dp['curves'][seed], final))
  return out


def collect(out_dir: str) -> dict[str, Any]:
  """Every arm's settings from the sweeps under ``out_dir``."""
  dp = settings(load_trials(os.path.join(out_dir, 'diloco_dp')), 'data-parallel',
                sync_every_step=True)
  by_h = {}
  for path in glob.glob(os.path.join(out_dir, 'diloco_h*')):
    match = re.fullmatch(r'diloco_h(\d+)', os.path.basename(path))
    if match:
      by_h[int(match.group(1))] = settings(load_trials(path), 'DiLoCo')
  if not by_h:
    raise FileNotFoundError(f'out_dir={out_dir!r} holds no diloco_h<H> sweep.')
  for h, rows in by_h.items():
    for row in rows + dp:
      if (row['total_steps'], row['examples']) != (dp[0]['total_steps'],
                                                   dp[0]['examples']):
        raise ValueError(
            f'H={h}: {row["arm"]} takes {row["total_steps"]} steps over '
            f'{row["examples"]} examples, data-parallel {dp[0]["total_steps"]} over '
            f'{dp[0]["examples"]}; equal compute needs both equal.')
  rounds = {}
  for k in (4, 1):
    path = os.path.join(out_dir, f'diloco_k{k}')
    if os.path.isdir(path):
      rounds[k] = settings(load_trials(path), f'DiLoCo K={k}')
  return dict(dp=dp, by_h=dict(sorted(by_h.items())), rounds=rounds)


def _pm(row: dict[str, Any]) -> str:
  return f'{row["mean"]:.3f} ± {row["sd"]:.3f}'


def tables(study: dict[str, Any]) -> str:
  """The Markdown tables: best-tuned at equal compute, every setting, equal rounds."""
  dp, by_h = study['dp'], study['by_h']
  dp_best = best(dp)
  lines = ['| setting | held-out loss | communication rounds | DiLoCo − data-parallel (paired by seed) | data-parallel steps to DiLoCo\'s loss |',
           '|---|---|---|---|---|',
           f'| data-parallel, batch {dp_best["replicas"] * dp_best["batch_size"]}, '
           f'learning rate {dp_best["inner_lr"]:g} (best) | {_pm(dp_best)} | '
           f'{dp_best["communications"]} | – | – |']
  for h, rows in by_h.items():
    b = best(rows)
    diff = np.array(b['final_eval_loss']) - np.array(
        [dp_best['final_eval_loss'][dp_best['seeds'].index(s)] for s in b['seeds']])
    reach = equal_loss(b, dp_best)
    reach_text = ', '.join('not in T' if r is None else str(r) for r in reach)
    lines.append(
        f'| DiLoCo K={b["replicas"]}, H={h}, outer lr {b["outer_lr"]:g}, '
        f'momentum {b["outer_momentum"]:g} (best) | {_pm(b)} | {b["communications"]} | '
        f'{diff.min():+.3f} to {diff.max():+.3f} | {reach_text} |')
  lines += ['', '| arm | H | outer lr / momentum (DiLoCo), learning rate (data-parallel) | held-out loss | communication rounds |',
            '|---|---|---|---|---|']
  for row in dp:
    lines.append(f'| data-parallel | 1 | {row["inner_lr"]:g} | {_pm(row)} | '
                 f'{row["communications"]} |')
  for h, rows in by_h.items():
    for row in rows:
      lines.append(f'| DiLoCo | {h} | {row["outer_lr"]:g} / {row["outer_momentum"]:g} | '
                   f'{_pm(row)} | {row["communications"]} |')
  if study['rounds']:
    lines += ['', '| setting (equal rounds) | held-out loss | communication rounds | inner steps x batch x replicas |',
              '|---|---|---|---|']
    for k, rows in study['rounds'].items():
      for row in rows:
        lines.append(f'| K={k}, H={row["steps_per_round"]}, outer lr {row["outer_lr"]:g}, '
                     f'momentum {row["outer_momentum"]:g} | {_pm(row)} | {row["communications"]} | '
                     f'{row["total_steps"]} x {row["batch_size"]} x {row["replicas"]} |')
  return '\n'.join(lines)


def plot(study: dict[str, Any], path: str) -> str:
  """Held-out loss against H (left) and against communications (right)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  dp_best, by_h = best(study['dp']), study['by_h']
  hs = list(by_h)
  bests = [best(by_h[h]) for h in hs]
  fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
  left.errorbar(hs, [b['mean'] for b in bests], yerr=[b['sd'] for b in bests],
                marker='o', capsize=3,
                label=f'DiLoCo K={bests[0]["replicas"]}, best outer lr/momentum')
  for setting in range(len(by_h[hs[0]])):
    left.plot(hs, [by_h[h][setting]['mean'] for h in hs], color='C0', alpha=0.2,
              lw=0.8, label=None if setting else 'DiLoCo, each outer setting')
  left.axhline(dp_best['mean'], color='C1', label='data-parallel, batch K·B (best lr)')
  left.axhspan(dp_best['mean'] - dp_best['sd'], dp_best['mean'] + dp_best['sd'],
               color='C1', alpha=0.2)
  left.set_xscale('log')
  left.set_xticks(hs, [str(h) for h in hs])
  left.minorticks_off()
  left.set_xlabel('H (inner steps per outer round)')
  left.set_ylabel('held-out loss (nats/byte)')
  left.set_title(f'equal compute: T={dp_best["total_steps"]} steps')
  left.legend(fontsize=7)
  steps = dp_best['curves'][dp_best['seeds'][0]][0]
  curves = np.array([dp_best['curves'][s][1] for s in dp_best['seeds']])
  shown = [i for i, s in enumerate(steps) if s > 0]
  right.plot([steps[i] for i in shown], curves.mean(0)[shown], color='C1',
             marker='.', label='data-parallel (syncs every step)')
  right.errorbar([b['communications'] for b in bests], [b['mean'] for b in bests],
                 yerr=[b['sd'] for b in bests], fmt='o', color='C0', capsize=3,
                 label='DiLoCo after T steps')
  for h, b in zip(hs, bests):
    right.annotate(f'H={h}', (b['communications'], b['mean']), fontsize=7,
                   textcoords='offset points', xytext=(4, 4))
  right.set_xscale('log')
  right.set_xlabel('communication rounds')
  right.set_title('held-out loss against communications')
  right.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def write_jsonl(study: dict[str, Any], path: str) -> str:
  """One JSON line per setting (without curves), best-tuned ones marked."""
  rows = list(study['dp']) + [r for rows in study['by_h'].values() for r in rows]
  rows += [r for rows in study['rounds'].values() for r in rows]
  best_ids = {id(best(study['dp']))} | {id(best(r)) for r in study['by_h'].values()}
  with open(path, 'w') as f:
    for row in rows:
      record = {k: v for k, v in row.items() if k != 'curves'}
      record['best_tuned'] = id(row) in best_ids
      if row['arm'] == 'data-parallel':
        record['eval_curve_mean'] = np.mean(
            [row['curves'][s][1] for s in row['seeds']], axis=0).round(4).tolist()
        record['eval_steps'] = row['curves'][row['seeds'][0]][0]
      f.write(json.dumps(record) + '\n')
  return path


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('out_dir', help='the OUT of scripts/reproductions.sh')
  parser.add_argument('--out', default=None,
                      help='prefix of the .jsonl and .png to write (default: '
                           'OUT_DIR/diloco_study)')
  args = parser.parse_args(argv)
  study = collect(args.out_dir)
  prefix = args.out or os.path.join(args.out_dir, 'diloco_study')
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  write_jsonl(study, prefix + '.jsonl')
  plot(study, prefix + '.png')
  print(tables(study))


if __name__ == '__main__':
  main()
