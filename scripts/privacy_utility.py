"""The privacy-utility figure: final accuracy against epsilon (docs/privacy.md).

Trains the study's recipes (``configs/privacy_utility.py``: 500 clients,
q = 0.1, 100 rounds, softmax regression) on digits and Synthetic-IID: non-private
FedAvg, DP-FedAvg's clipping without noise (z = 0) and FedAvgM with
DP-FTRLM's server and cohorts once, and DP-FedAvg,
adaptive clipping, DP-FTRL and DP-FedAdam at
each target epsilon, with the noise multiplier that
``fedjx.algorithms.privacy.accounting.noise_multiplier_for_epsilon`` calibrates for
that config's mechanism and sampling (rounded up to 4 decimals, so the
achieved epsilon is at most the target). Each run is what its ``command``
does (``fedjx-run``); an existing workdir is resumed, so a rerun only trains
what is missing. Writes ``<out>/privacy_utility.jsonl`` (one line a run) and
``<out>/privacy_utility.png``, and prints the table of docs/privacy.md::

  nice -n 19 python scripts/privacy_utility.py --out benchmarks/results \\
      --workdir runs/privacy_utility
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = 'privacy_utility.py'
# method -> (the config's method, label)
METHODS = {
    'fedavg': ('fedavg', 'FedAvg (non-private)'),
    'clip_only': ('dp_fedavg', 'DP-FedAvg clipping, no noise (z = 0)'),
    'fedavgm': ('fedavgm', 'FedAvgM (non-private, DP-FTRLM server)'),
    'dp_fedavg': ('dp_fedavg', 'DP-FedAvg, fixed clip'),
    'adaptive_clip': ('adaptive_clip', 'DP-FedAvg, adaptive clip'),
    'dp_ftrl': ('dp_ftrl', 'DP-FTRLM, efficient tree'),
    'dp_fedadam': ('dp_fedadam', 'DP-FedAdam'),
}
NOT_PRIVATE = ('fedavg', 'clip_only', 'fedavgm')  # run once, at epsilon = infinity


def load_config(arg: str):
  path = os.path.join(REPO, 'configs', CONFIG)
  spec = importlib.util.spec_from_file_location(CONFIG[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def noise_field(config) -> str:
  """Where the config keeps its noise multiplier."""
  from fedjx.experiments import registry  # pylint: disable=g-import-not-at-top
  if registry.algorithm_traits(config.algorithm.name).aggregator is not None:
    return 'algorithm.noise_multiplier'  # Its own DP aggregator's option.
  return 'algorithm.aggregator.noise_multiplier'


def calibrate(config, target: float) -> float:
  """The noise multiplier for ``target`` epsilon, rounded up to 4 decimals."""
  from fedjx.algorithms.privacy import accounting  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import privacy  # pylint: disable=g-import-not-at-top
  from fedjx.experiments.config import with_defaults  # pylint: disable=g-import-not-at-top
  plan = privacy.plan(with_defaults(config), config.dataset.num_clients)
  z = accounting.noise_multiplier_for_epsilon(
      target, plan.delta, config.rounds, sampling=plan.sampling,
      mechanism=plan.mechanism.mechanism, accountant=plan.accountant,
      restart_every=plan.mechanism.restart_every)
  return math.ceil(z * 1e4) / 1e4


def run_one(dataset: str, method: str, target: float | None, root: str):
  from fedjx.experiments import runner  # pylint: disable=g-import-not-at-top
  arg = f'{dataset},{METHODS[method][0]}'
  config = load_config(arg)
  tag = 'inf' if target is None else f'{target:g}'
  workdir = os.path.join(root, dataset, method, f'eps{tag}')
  command = f'fedjx-run --config=configs/{CONFIG}:{arg}'
  z = None
  if method == 'clip_only':  # the clipping's own effect: not private
    z = 0.0
  elif target is not None:
    z = calibrate(config, target)
  if z is not None:
    field = noise_field(config)
    node = config
    for part in field.split('.')[:-1]:
      node = node[part]
    node[field.split('.')[-1]] = z
    command += f' --config.{field}={z}'
  command += f' --workdir={workdir}'
  config.progress, config.plot, config.tensorboard = False, False, False
  start = time.perf_counter()
  result = runner.run(config, workdir, log=lambda msg: None)
  evals = [h for h in result.history if 'eval_accuracy' in h]
  last = evals[-1]
  eps = next((h['epsilon'] for h in reversed(result.history) if 'epsilon' in h),
             math.inf)
  return {'dataset': dataset, 'method': method, 'label': METHODS[method][1],
          'target_epsilon': target, 'noise_multiplier': z, 'epsilon': eps,
          'delta': config.privacy.delta, 'rounds': result.step,
          'eval_accuracy': last['eval_accuracy'], 'eval_loss': last['eval_loss'],
          'seconds': round(time.perf_counter() - start, 1),
          'command': command}


def plot(rows, path: str, epsilons) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  datasets = sorted({r['dataset'] for r in rows})
  fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4),
                           squeeze=False)
  for ax, dataset in zip(axes[0], datasets):
    for method, (_, label) in METHODS.items():
      pts = sorted((r['epsilon'], r['eval_accuracy']) for r in rows
                   if r['dataset'] == dataset and r['method'] == method)
      if method in NOT_PRIVATE:
        style = {'fedavg': ('k', '--'), 'clip_only': ('k', ':'),
                 'fedavgm': ('tab:green', '--')}[method]
        for _, acc in pts:
          ax.axhline(acc, color=style[0], ls=style[1], lw=1,
                     label=f'{label}, eps = inf')
      elif pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], 'o-', label=label)
    ax.set_xscale('log', base=2)
    ax.set_xticks(list(epsilons), [f'{e:g}' for e in epsilons])
    ax.set_xlabel('epsilon (user level, delta = 500^-1.1, RDP)')
    ax.set_ylabel('final test accuracy')
    ax.set_title(f'{dataset}: 500 clients, q = 0.1, 100 rounds')
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8, loc='lower right')
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def table(rows) -> str:
  lines = ['| dataset | method | target eps | z | eps reached | accuracy | command |',
           '|---|---|---|---|---|---|---|']
  for r in rows:
    t = 'inf' if r['target_epsilon'] is None else f"{r['target_epsilon']:g}"
    z = '-' if r['noise_multiplier'] is None else f"{r['noise_multiplier']:g}"
    e = 'inf' if not math.isfinite(r['epsilon']) else f"{r['epsilon']:.3f}"
    lines.append(f"| {r['dataset']} | {r['label']} | {t} | {z} | {e} | "
                 f"{r['eval_accuracy']:.3f} | `{r['command']}` |")
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(REPO, 'benchmarks', 'results'))
  parser.add_argument('--workdir', default=os.path.join('runs', 'privacy_utility'))
  parser.add_argument('--epsilons', default='1,2,4,8')
  parser.add_argument('--datasets', default='digits,synthetic')
  parser.add_argument('--methods', default=','.join(METHODS))
  args = parser.parse_args()
  logging.getLogger('absl').setLevel(logging.ERROR)  # dp_accounting's order notes
  epsilons = [float(e) for e in args.epsilons.split(',')]
  rows = []
  for dataset in args.datasets.split(','):
    for method in args.methods.split(','):
      for target in ([None] if method in NOT_PRIVATE else epsilons):
        row = run_one(dataset, method, target, args.workdir)
        rows.append(row)
        print(json.dumps(row), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'privacy_utility.jsonl'), 'w',
            encoding='utf-8') as f:
    for row in rows:
      f.write(json.dumps({k: (v if not (isinstance(v, float) and math.isinf(v))
                              else 'inf') for k, v in row.items()}) + '\n')
  plot(rows, os.path.join(args.out, 'privacy_utility.png'), epsilons)
  print(table(rows))


if __name__ == '__main__':
  main()
