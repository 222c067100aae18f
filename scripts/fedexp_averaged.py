"""FedExP's last iterate against the mean of its last two, as the paper evaluates.

Jhunjhunwala et al. 2023 report FedExP's accuracy at ``(x_t + x_{t-1}) / 2``
because extrapolated iterates oscillate; the runner and the sweep evaluate
``x_t``. This script trains a config (``configs/fedexp_digits.py`` by
default; any config, so that FedAvg's iterates can be averaged the same way)
for each seed, evaluates both models after every round, and prints one JSON
line per seed and model (rounds to the target accuracy, final and best
accuracy), then the means. For FedExP the mean is
``fedjx.algorithms.fedexp_lib.averaged_params(state)``.

  python scripts/fedexp_averaged.py --seeds 0,1,2 --rounds 150
  python scripts/fedexp_averaged.py --config configs/fedavg_digits.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import numpy as np

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      'configs', 'fedexp_digits.py')


def load(path: str):
  spec = importlib.util.spec_from_file_location('_fedexp_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def run(path: str, seed: int, rounds: int, client_lr: float | None) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import experiment  # pylint: disable=g-import-not-at-top
  config = load(path)
  config.seed = seed
  config.rounds = rounds
  if client_lr is not None:
    config.algorithm.client_optimizer.learning_rate = client_lr
  config.progress = False
  exp = experiment.build(config)
  state = exp.algorithm.init(exp.init_params)
  acc = {'last': [], 'averaged': []}
  for r, cohort in enumerate(exp.cohorts(0, rounds)):
    previous = jax.tree.map(jnp.copy, state.params)  # The round donates state.
    state, _ = exp.algorithm.round(state, cohort, exp.round_key_for(r))
    averaged = jax.tree.map(lambda a, b: (a + b) / 2, state.params, previous)
    acc['last'].append(exp.evaluate(state.params)['eval_accuracy'])
    acc['averaged'].append(exp.evaluate(averaged)['eval_accuracy'])
  return acc


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default=CONFIG)
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--rounds', type=int, default=150)
  parser.add_argument('--target', type=float, default=0.9)
  parser.add_argument('--client_lr', type=float, default=None)
  args = parser.parse_args()
  summary: dict[str, list] = {'last': [], 'averaged': []}
  for seed in (int(s) for s in args.seeds.split(',')):
    acc = run(args.config, seed, args.rounds, args.client_lr)
    for model, curve in acc.items():
      curve = np.asarray(curve)
      hit = np.flatnonzero(curve >= args.target)
      row = {'seed': seed, 'model': model,
             'rounds_to_target': int(hit[0]) + 1 if hit.size else None,
             'final_accuracy': round(float(curve[-1]), 4),
             'best_accuracy': round(float(curve.max()), 4)}
      summary[model].append(row)
      print(json.dumps(row), flush=True)
  for model, rows in summary.items():
    reached = [r['rounds_to_target'] for r in rows if r['rounds_to_target']]
    print(json.dumps({
        'model': model, 'seeds': len(rows),
        'rounds_to_target_mean': float(np.mean(reached)) if reached else None,
        'rounds_to_target_sd': float(np.std(reached, ddof=1)) if len(reached) > 1 else None,
        'reached': len(reached),
        'final_accuracy_mean': float(np.mean([r['final_accuracy'] for r in rows])),
        'final_accuracy_sd': (float(np.std([r['final_accuracy'] for r in rows], ddof=1))
                              if len(rows) > 1 else None),
    }))


if __name__ == '__main__':
  main()
