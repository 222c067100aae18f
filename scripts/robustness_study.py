"""The robustness study: attacks x defenses x malicious fraction on digits.

For each attack of :data:`ATTACKS`, one sweep of configs/robustness_digits.py
over the defenses of :data:`DEFENSES` (``algorithm.aggregator``) and the
malicious fractions of :data:`FRACTIONS` (``attack.fraction``), every cell
with the seeds given. A fraction of 0 has no malicious client whatever the
attack, so it runs once, in the first attack's sweep, and stands for every
row (and in the backdoor's, for the success rate of the trigger on a clean
model). Then it writes

* ``<out>.jsonl``: one line per trial (attack, defense, fraction, seed, the
  final and best test accuracy, the final attack success rate of the data
  poisoning attacks, and the ``fedjx-sweep`` command of its sweep);
* ``<out>.png``: final test accuracy against the malicious fraction, one
  panel per attack, one line per defense (mean and sample sd over seeds),
  and the backdoor's attack success rate;

and prints the Markdown table of docs/robustness.md (final accuracy, mean ±
sample sd over seeds).

Compiled rounds are cached on disk (JAX's persistent compilation cache in
``<workdir>/jax_cache``): the cells of one attack and defense differ only in
their malicious set and data, which are inputs of the same program, so each
compiles once.

  python scripts/robustness_study.py --workdir runs/robustness \\
      --seeds 0,1,2 --out benchmarks/results/robustness_digits
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, 'configs', 'robustness_digits.py')

# Row name -> config.attack, a spec {name, **options} (besides the fraction;
# fedjx.experiments.parts.ATTACKS).
ATTACKS = {
    'sign_flip': dict(name='sign_flip'),
    'sign_flip_x10': dict(name='sign_flip', scale=10.0),
    'gaussian_noise': dict(name='gaussian_noise', sigma=0.1),
    'alie': dict(name='alie'),
    'alie_z1.5': dict(name='alie', z=1.5),
    'ipm': dict(name='ipm', epsilon=0.1),
    'label_flip': dict(name='label_flip'),
    'backdoor': dict(name='backdoor', target=0, poison_fraction=0.5, boost=5.0),
}
# Column name -> config.algorithm.aggregator. Krum and the trimmed mean are
# told the largest malicious share of the grid: 3 of the 10 clients a round.
DEFENSES = {
    'mean': {'name': 'mean'},
    'median': {'name': 'median'},
    'trimmed_mean': {'name': 'trimmed_mean', 'beta': 0.3},
    'krum': {'name': 'krum', 'num_byzantine': 3},
    'norm_bounding': {'name': 'norm_bounding', 'max_norm': 1.0},
}
FRACTIONS = (0.0, 0.1, 0.2, 0.3)
QUIET = {'progress': False, 'plot': False, 'tensorboard': False}


def base_config(attack: dict, rounds: int | None):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('robustness_digits', CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for key, value in attack.items():
    setattr(config.attack, key, value)
  for key, value in QUIET.items():
    setattr(config, key, value)
  if rounds is not None:
    config.rounds = rounds
    config.eval_every = min(config.eval_every, rounds)
  return config


def with_zero(row: str) -> bool:
  return row in (next(iter(ATTACKS)), 'backdoor')


def cells(first: bool) -> list[dict]:
  fractions = FRACTIONS if first else tuple(f for f in FRACTIONS if f > 0)
  return [{'algorithm.aggregator': d, 'attack.fraction': f}
          for d in DEFENSES.values() for f in fractions]


def command(row: str, workdir: str, seeds: str, first: bool,
            rounds: int | None) -> str:
  """The ``fedjx-sweep`` command of one attack's sweep."""
  fractions = FRACTIONS if first else tuple(f for f in FRACTIONS if f > 0)
  parts = ['fedjx-sweep', '--config', 'configs/robustness_digits.py',
           '--workdir', shlex.quote(os.path.join(workdir, row)), '--seeds', seeds,
           '--sweep', '"algorithm.aggregator=' + ','.join(
               repr(d) for d in DEFENSES.values()) + '"',
           '--sweep', 'attack.fraction=' + ','.join(str(f) for f in fractions)]
  parts += [f'--config.attack.{k}={v}' for k, v in ATTACKS[row].items()]
  if rounds is not None:
    parts.append(f'--config.rounds={rounds}')
  return ' '.join(parts)


def defense_name(spec: dict) -> str:
  for name, d in DEFENSES.items():
    if d == spec:
      return name
  raise KeyError(spec)


def read_trials(workdir: str, row: str, cmd: str) -> list[dict]:
  out = []
  with open(os.path.join(workdir, 'summary_trials.csv'), encoding='utf-8') as f:
    for r in csv.DictReader(f):
      import ast  # pylint: disable=g-import-not-at-top
      number = lambda k: float(r[k]) if r.get(k) not in (None, '') else None
      out.append({
          'attack': row, 'defense': defense_name(ast.literal_eval(r['algorithm.aggregator'])),
          'fraction': float(r['attack.fraction']), 'seed': int(r['seed']),
          'final_eval_accuracy': number('final_eval_accuracy'),
          'best_eval_accuracy': number('best_eval_accuracy'),
          'final_attack_success_rate': number('final_eval_attack_success_rate'),
          'final_attack_z': number('final_attack_z'),
          'diverged_round': number('diverged_round'),
          'command': cmd})
  return out


def summarize(rows: list[dict], key: str) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  cells_ = {}
  for r in rows:
    cells_.setdefault((r['attack'], r['defense'], r['fraction']), []).append(r[key])
  out = {}
  for k, values in cells_.items():
    v = np.array([np.nan if x is None else x for x in values], np.float64)
    out[k] = (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0)
  return out


def table(rows: list[dict], key: str = 'final_eval_accuracy',
          attacks: tuple[str, ...] | None = None) -> str:
  stats = summarize(rows, key)
  fractions = sorted({r['fraction'] for r in rows})
  lines = ['| attack | defense | ' + ' | '.join(f'{100 * f:.0f}%' for f in fractions) + ' |',
           '|---|---|' + '---|' * len(fractions)]
  for attack in attacks or ATTACKS:
    for defense in DEFENSES:
      vals = []
      for f in fractions:
        k = (attack, defense, f)
        if k not in stats:  # The fraction 0 of the first attack's sweep.
          k = (next(iter(ATTACKS)), defense, f)
        ok = k in stats and stats[k][0] == stats[k][0]  # present, not NaN
        vals.append(f'{stats[k][0]:.3f} ± {stats[k][1]:.3f}' if ok else '-')
      lines.append(f'| {attack} | {defense} | ' + ' | '.join(vals) + ' |')
  return '\n'.join(lines)


def plot(rows: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  acc = summarize(rows, 'final_eval_accuracy')
  asr = summarize([r for r in rows if r['final_attack_success_rate'] is not None
                   or r['fraction'] == 0], 'final_attack_success_rate')
  panels = list(ATTACKS) + ['backdoor ASR']
  cols = 3
  fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols,
                           figsize=(4 * cols, 3.2 * ((len(panels) + cols - 1) // cols)),
                           sharex=True, squeeze=False)
  first = next(iter(ATTACKS))
  for ax, panel in zip(axes.flat, panels):
    stats, attack = (asr, 'backdoor') if panel == 'backdoor ASR' else (acc, panel)
    for defense in DEFENSES:
      xs, ms, ss = [], [], []
      for f in FRACTIONS:
        k = (attack, defense, f)
        if k not in stats:  # The fraction 0 of the first attack's sweep.
          k = (first, defense, f)
        if k in stats and stats[k][0] == stats[k][0]:
          xs.append(100 * f)
          ms.append(stats[k][0])
          ss.append(stats[k][1])
      if xs:
        ax.errorbar(xs, ms, yerr=ss, marker='o', capsize=3, label=defense)
    ax.set_title(panel)
    ax.set_ylim(0, 1)
    ax.set_xlabel('malicious clients (%)')
    ax.set_ylabel('attack success rate' if panel == 'backdoor ASR'
                  else 'final test accuracy')
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis('off')
  axes.flat[0].legend(fontsize=7)
  fig.suptitle('FedAvg on digits (50 IID clients, 10 a round, 60 rounds): '
               'attacks x defenses, mean ± sd over seeds')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', default='runs/robustness')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--out', default='benchmarks/results/robustness_digits')
  parser.add_argument('--rounds', type=int, default=None,
                      help='override config.rounds (default: the config\'s)')
  parser.add_argument('--attacks', default=','.join(ATTACKS),
                      help='comma-separated rows of ATTACKS to run')
  parser.add_argument('--report_only', action='store_true',
                      help='read the finished sweeps in --workdir, train nothing')
  args = parser.parse_args()
  cache = os.path.join(os.path.abspath(args.workdir), 'jax_cache')
  os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', cache)
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')
  from fedjx.experiments.sweeps import run  # pylint: disable=g-import-not-at-top
  seeds = [int(s) for s in args.seeds.split(',')]
  rows: list[dict] = []
  for row in args.attacks.split(','):
    workdir = os.path.join(args.workdir, row)
    t0 = time.perf_counter()
    if not args.report_only:
      run.run_sweep(base_config(ATTACKS[row], args.rounds), workdir,
                    cells(with_zero(row)), seeds, log=lambda m: None)
    cmd = command(row, args.workdir, args.seeds, with_zero(row), args.rounds)
    rows += read_trials(workdir, row, cmd)
    print(json.dumps({'attack': row, 'seconds': round(time.perf_counter() - t0, 1),
                      'command': cmd}), flush=True)
  with open(args.out + '.jsonl', 'w', encoding='utf-8') as f:
    for r in rows:
      f.write(json.dumps(r, sort_keys=True) + '\n')
  plot(rows, args.out + '.png')
  ran = tuple(dict.fromkeys(r['attack'] for r in rows))
  print(table(rows, attacks=ran))
  if any(r['final_attack_success_rate'] is not None for r in rows):
    print()
    print(table(rows, 'final_attack_success_rate',
                tuple(a for a in ('backdoor', 'label_flip') if a in ran)))


if __name__ == '__main__':
  main()
