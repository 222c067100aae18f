"""The heterogeneity study: accuracy against simulated hours under unreliable clients.

Runs every method of configs/heterogeneity_digits.py for each seed (each a
normal run directory, resumed if it exists), then writes

* ``<out>.png``: test accuracy against simulated hours, the mean over seeds
  (a band from the lowest to the highest seed);
* ``<out>.jsonl``: one line per run (method, seed, hours to each target,
  rounds, final accuracy, the evaluation curve);

and prints a Markdown table of hours to each target accuracy.

  python scripts/heterogeneity_study.py --workdir runs/heterogeneity \\
      --seeds 0,1,2 --out benchmarks/results/heterogeneity_digits
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import numpy as np

from fedjx.experiments import runner

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      'configs', 'heterogeneity_digits.py')
# Rounds (server steps) per method: each covers about the same simulated
# horizon (~8 hours), given its typical round duration.
ROUNDS = {'fedavg_wait': 300, 'fedavg_deadline': 700, 'fedavg_partial': 1000,
          'fednova_partial': 1000, 'fedbuff': 1100}
LABELS = {'fedavg_wait': 'FedAvg, wait for all 20',
          'fedavg_deadline': 'FedAvg, 26 sampled, first 20 or 45 s',
          'fedavg_partial': 'FedAvg, 30 s deadline, partial work',
          'fednova_partial': 'FedNova, 30 s deadline, partial work',
          'fedbuff': 'FedBuff, 20 concurrent, K = 10'}


def _get_config(method: str):
  spec = importlib.util.spec_from_file_location('heterogeneity_digits', CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(method)


def run_one(method: str, seed: int, workdir: str) -> list[dict]:
  config = _get_config(method)
  config.seed = seed
  config.rounds = ROUNDS[method]
  config.progress = False
  config.plot = False
  config.tensorboard = False
  return runner.run(config, workdir, log=lambda m: None).history


def curve(history: list[dict]) -> tuple[np.ndarray, np.ndarray]:
  """(hours, accuracy) of the evaluated rows."""
  rows = [r for r in history if 'eval_accuracy' in r]
  return (np.array([r['simulated_time'] / 3600.0 for r in rows]),
          np.array([r['eval_accuracy'] for r in rows]))


def hours_to(hours: np.ndarray, acc: np.ndarray, target: float) -> float | None:
  """The simulated hours of the first evaluation at or above ``target``."""
  hit = np.flatnonzero(acc >= target)
  return float(hours[hit[0]]) if hit.size else None


def plot(results: dict[str, list[tuple[np.ndarray, np.ndarray]]], path: str,
         horizon: float) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  grid = np.linspace(0.0, horizon, 200)
  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for method, curves in results.items():
    # Each seed's accuracy at time t is its last evaluation at or before t.
    ys = np.stack([acc[np.maximum(np.searchsorted(h, grid, side='right') - 1, 0)]
                   for h, acc in curves])
    line, = ax.plot(grid, ys.mean(0), label=LABELS[method])
    ax.fill_between(grid, ys.min(0), ys.max(0), color=line.get_color(),
                    alpha=0.15)
  ax.set_xlabel('simulated time (hours)')
  ax.set_ylabel('test accuracy')
  ax.set_ylim(0.5, 1.0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize='small', loc='lower right')
  ax.set_title('digits, 500 clients, diurnal availability, log-normal speeds')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='runs/heterogeneity')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--methods', default=','.join(ROUNDS))
  parser.add_argument('--targets', default='0.85,0.9')
  parser.add_argument('--horizon', type=float, default=8.0,
                      help='simulated hours shown in the figure')
  parser.add_argument('--out', default='benchmarks/results/heterogeneity_digits')
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(',')]
  targets = [float(t) for t in args.targets.split(',')]
  methods = args.methods.split(',')
  results: dict[str, list] = {}
  records = []
  for method in methods:
    for seed in seeds:
      t0 = time.perf_counter()
      history = run_one(method, seed, os.path.join(args.workdir,
                                                   f'{method}_seed{seed}'))
      hours, acc = curve(history)
      results.setdefault(method, []).append((hours, acc))
      records.append({
          'method': method, 'seed': seed, 'rounds': ROUNDS[method],
          'hours': float(hours[-1]), 'final_accuracy': float(acc[-1]),
          **{f'hours_to_{t}': hours_to(hours, acc, t) for t in targets},
          'wall_s': round(time.perf_counter() - t0, 1),
          'curve': {'hours': hours.round(4).tolist(),
                    'eval_accuracy': acc.round(4).tolist()}})
      print(json.dumps({k: v for k, v in records[-1].items() if k != 'curve'}),
            flush=True)
  with open(args.out + '.jsonl', 'w', encoding='utf-8') as f:
    for r in records:
      f.write(json.dumps(r) + '\n')
  plot(results, args.out + '.png', args.horizon)
  print(f'\n| method | ' + ' | '.join(f'hours to {t:.0%} (per seed)'
                                      for t in targets)
        + ' | accuracy at the end | hours simulated |')
  print('|---|' + '---|' * (len(targets) + 2))
  for method in methods:
    rows = [r for r in records if r['method'] == method]
    cells = []
    for t in targets:
      hit = [r[f'hours_to_{t}'] for r in rows]
      shown = ', '.join('-' if h is None else f'{h:.2f}' for h in hit)
      done = [h for h in hit if h is not None]
      mean = f'{np.mean(done):.2f}' if len(done) == len(hit) else 'not all'
      cells.append(f'{mean} ({shown})')
    final = np.mean([r['final_accuracy'] for r in rows])
    span = np.mean([r['hours'] for r in rows])
    print(f'| {LABELS[method]} | ' + ' | '.join(cells)
          + f' | {final:.3f} | {span:.1f} |')


if __name__ == '__main__':
  main()
