"""The DiLoCo scaling study's comparison against data-parallel, at CPU scale.

Charles et al. 2025, "Communication-Efficient Language Model Training
Scales Reliably and Robustly: Scaling Laws for DiLoCo" (arXiv 2503.09799),
Table 4: the evaluation loss of data-parallel training and the percent
difference of DiLoCo with M = 1, 2, 4, 8 replicas from it, at equal tokens.
Here each arm is ``configs/diloco_study.py:M,preset,tokens_per_param``
(``M = 0`` is data-parallel) with its ``recipe_algorithm`` (the inner
warmup-cosine schedule and gradient clipping of
``fedjx.algorithms.diloco_recipe``, ``'diloco_recipe'``),
trained with ``fedjx.experiments.runner.run``
in its own work directory; the loss is the final ``eval_loss`` (held-out
sequences of the standard-library corpus), and

    diff_pct(M) = 100 (loss(M) - loss(data-parallel)) / loss(data-parallel).

  python scripts/reproduce_table4.py --presets 500k --tokens-per-param 2 --seed 0 \\
      --workdir runs/table4 --out runs/table4/table4.json
  python scripts/reproduce_table4.py --small --workdir /tmp/t4   # seconds

prints one JSON line per run, then one per (preset, M) row of the table, and
writes ``{'runs': [...], 'table': [...], 'paper': {...}}`` to ``--out``.
``--small`` shrinks every arm (one module of the corpus, 2 inner steps, one
round, 64 held-out sequences, M in {0, 2}) to check the pipeline only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from fedjx.experiments import cli
from fedjx.experiments import runner

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, 'configs',
                      'diloco_study.py')

PAPER = {
    '35m': {'data_parallel_loss': 3.485,
            'diff_pct': {1: -0.1, 2: 0.7, 4: 2.0, 8: 3.9}},
    '2.4b': {'diff_pct': {8: 1.1}},
}
"""Charles et al. 2025, Table 4, as quoted for this comparison."""


def arm_config(preset: str, replicas: int, tokens_per_param: float, seed: int,
               small: bool):
  """The config of one arm (``replicas = 0``: data-parallel)."""
  spec = f'{CONFIG}:{replicas},{preset},{tokens_per_param}'
  config = cli.load_config_file(spec)
  config.seed = seed
  config.progress = False
  config.plot = False
  if small:
    config.rounds = 1
    config.local_steps = 2
    config.eval_every = 1
    config.checkpoint_every = 1
    config.eval_max_examples = 64
    config.dataset.modules = ('json',)
  config.algorithm = cli.load_module(spec).recipe_algorithm(
      config.rounds, config.local_steps, replicas)  # Its schedule spans the rounds run.
  return config


def final_eval_loss(history) -> float:
  """The last ``eval_loss`` of a run's rows."""
  losses = [row['eval_loss'] for row in history if 'eval_loss' in row]
  if not losses:
    raise ValueError('reproduce_table4: the run wrote no eval_loss.')
  return float(losses[-1])


def mean_of(history, key: str) -> float | None:
  """The mean of ``key`` over the rows that have it (None if none do)."""
  values = [row[key] for row in history if key in row]
  return sum(values) / len(values) if values else None


def run_arm(preset: str, replicas: int, tokens_per_param: float, seed: int,
            workdir: str, small: bool) -> dict:
  """Trains one arm; its summary row."""
  config = arm_config(preset, replicas, tokens_per_param, seed, small)
  path = os.path.join(workdir, f'{preset}_m{replicas}_seed{seed}')
  start = time.perf_counter()
  result = runner.run(config, path, log=lambda msg: None)
  wall = time.perf_counter() - start
  if result.interrupted:  # SIGINT or SIGTERM: the arm is incomplete; stop the study.
    raise SystemExit(f'reproduce_table4: {path} was interrupted after round {result.step}; '
                     'run the same command again to continue it.')
  tokens = (config.rounds * config.local_steps * config.cohort_size * config.batch_size *
            config.dataset.seq_len)
  return {
      'preset': preset, 'replicas': replicas, 'seed': seed, 'rounds': config.rounds,
      'inner_steps': config.local_steps, 'tokens': tokens,
      'tokens_per_param': tokens_per_param, 'eval_loss': final_eval_loss(result.history),
      'wall_s': round(wall, 2), 'tokens_per_s': mean_of(result.history, 'tokens_per_s'),
      'mfu': mean_of(result.history, 'mfu'),
      'inner_grad_norm': mean_of(result.history, 'inner_grad_norm'),
      'communicated_bytes_per_round': mean_of(result.history, 'communicated_bytes'),
  }


def table(runs: list[dict]) -> list[dict]:
  """Per (preset, M): the loss and its percent difference to data-parallel."""
  rows = []
  for preset in dict.fromkeys(r['preset'] for r in runs):
    dp = [r for r in runs if r['preset'] == preset and r['replicas'] == 0]
    base = dp[0]['eval_loss'] if dp else None
    for r in (r for r in runs if r['preset'] == preset):
      diff = (None if base is None or r['replicas'] == 0 else
              round(100.0 * (r['eval_loss'] - base) / base, 3))
      paper = PAPER['35m']['diff_pct'].get(r['replicas'])
      rows.append({'preset': preset, 'replicas': r['replicas'],
                   'arm': 'data-parallel' if r['replicas'] == 0 else f'DiLoCo M={r["replicas"]}',
                   'eval_loss': round(r['eval_loss'], 4), 'diff_pct': diff,
                   'paper_35m_diff_pct': paper})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
  parser.add_argument('--presets', default='500k')
  parser.add_argument('--replicas', default='0,1,2,4,8',
                      help='comma-separated M; 0 is data-parallel')
  parser.add_argument('--tokens-per-param', type=float, default=20.0)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--out', default=None, help='JSON file (default: WORKDIR/table4.json)')
  parser.add_argument('--small', action='store_true')
  args = parser.parse_args(argv)
  presets = args.presets.split(',')
  replicas = [int(m) for m in args.replicas.split(',')]
  if args.small:
    replicas = [m for m in replicas if m in (0, 2)] or [0, 2]
  runs = []
  for preset in presets:
    for m in replicas:
      row = run_arm(preset, m, args.tokens_per_param, args.seed, args.workdir, args.small)
      runs.append(row)
      print(json.dumps(row), flush=True)
  rows = table(runs)
  for row in rows:
    print(json.dumps(row), flush=True)
  out = args.out or os.path.join(args.workdir, 'table4.json')
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, 'w', encoding='utf-8') as f:
    json.dump({'runs': runs, 'table': rows, 'paper': PAPER}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
