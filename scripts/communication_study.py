"""Accuracy against bits on digits: the reproductions of docs/communication.md.

Runs ``fedjx-run`` on ``configs/compressed_fedavg_digits.py`` and
``configs/secagg_ddp_digits.py`` with each study's aggregators and prints
one JSON line per run: the final and best test accuracy, the bits each
client uploads per round (``upload_bits``, counted from the messages), the
run's total upload, and for the DP runs the epsilon the run reports.

  python scripts/communication_study.py --workdir runs/comm --study quantization
  python scripts/communication_study.py --workdir runs/comm --study topk
  python scripts/communication_study.py --workdir runs/comm --study ddp

Studies: ``quantization`` (rotated stochastic quantization at 1, 2, 4, 8
bits against float32; Suresh et al. 2017), ``topk`` (top-1% with and
without error feedback; Stich et al. 2018), ``ddp`` (distributed Skellam at
12, 14, 16, 18 bits against central Gaussian DP at the 16-bit run's
epsilon; Agarwal et al. 2021).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(os.path.dirname(HERE), 'configs')


def quantization_runs():
  runs = [('float32', {'name': 'uncompressed'})]
  for bits in (1, 2, 4, 8):
    runs.append((f'rotated_sq_{bits}bit', {'name': 'stochastic_quantization',
                                           'bits': bits, 'rotation': True}))
  return 'compressed_fedavg_digits.py', runs, {}


def topk_runs():
  return 'compressed_fedavg_digits.py', [  # float32: the quantization study's
      ('top1pct_error_feedback', {'name': 'top_k', 'fraction': 0.01,
                                  'error_feedback': True, 'num_clients': 50}),
      ('top1pct_no_feedback', {'name': 'top_k', 'fraction': 0.01,
                               'error_feedback': False}),
  ], {}


def ddp_runs(rounds: int, bits: tuple[int, ...]):
  from fedjx.algorithms.privacy import accounting  # pylint: disable=g-import-not-at-top
  from fedjx.algorithms.privacy import distributed_dp  # pylint: disable=g-import-not-at-top
  clip, z, n, n_min, d_pad, delta = 0.5, 1.0, 10, 6, 16384, 1e-5
  base = {'name': 'distributed_skellam', 'clip_norm': clip,
          'noise_multiplier': z, 'clients_per_round': n, 'threshold': n_min - 1,
          'expected_clients_per_round': float(n), 'delta': delta}
  runs = [(f'skellam_{b}bit', dict(base, bits=b)) for b in bits]
  scale = distributed_dp.default_scale(16, clip, z, n, n_min, d_pad, 3.0)
  eps = distributed_dp.skellam_epsilon(z, clip, scale, d_pad, rounds, delta,
                                       'uniform', 0.2)
  z_central = accounting.noise_multiplier_for_epsilon(
      eps, delta, rounds, sampling=accounting.Sampling('uniform', 50, n))
  runs.append(('central_gaussian', {
      'name': 'gaussian', 'clip_norm': clip, 'noise_multiplier': z_central,
      'expected_clients_per_round': float(n)}))
  return 'secagg_ddp_digits.py', runs, {'privacy': {'delta': delta}}


def read(path: str) -> list[dict]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def summarize(name: str, aggregator: dict, rows: list[dict]) -> dict:
  evals = [r['eval_accuracy'] for r in rows if 'eval_accuracy' in r]
  ups = [(r['upload_bits'], r['clients']) for r in rows if 'upload_bits' in r]
  out = {'run': name, 'aggregator': aggregator,
         'rounds': max(r['round'] for r in rows),
         'final_eval_accuracy': evals[-1] if evals else None,
         'best_eval_accuracy': max(evals) if evals else None}
  if ups:
    out['upload_bits_per_client_round'] = ups[-1][0]
    out['total_upload_bits'] = float(sum(b * c for b, c in ups))
  for key in ('ddp_epsilon', 'epsilon'):
    values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    if values:
      out[key] = values[-1]
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True)
  p.add_argument('--study', choices=('quantization', 'topk', 'ddp'),
                 required=True)
  p.add_argument('--rounds', type=int, default=100)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--bits', type=lambda t: tuple(int(b) for b in t.split(',')),
                 default=(12, 14, 16, 18),
                 help='the ddp study\'s bit widths (18 draws a Poisson rate of '
                      '1e8 per coordinate as 1000 draws: slow on a CPU)')
  a = p.parse_args(argv)
  config, runs, extra = {'quantization': quantization_runs, 'topk': topk_runs,
                         'ddp': lambda: ddp_runs(a.rounds, a.bits)}[a.study]()
  for name, aggregator in runs:
    workdir = os.path.join(a.workdir, a.study, f'{name}_seed{a.seed}')
    metrics = os.path.join(workdir, 'metrics.jsonl')
    if not os.path.exists(metrics):
      cmd = ['fedjx-run', f'--config={os.path.join(CONFIGS, config)}',
             f'--workdir={workdir}', f'--config.rounds={a.rounds}',
             f'--config.seed={a.seed}', '--config.progress=False',
             '--config.checkpoint_every=100000',
             f'--config.algorithm.aggregator={aggregator!r}']
      for field, value in extra.items():
        cmd.append(f'--config.{field}={value!r}')
      subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(json.dumps(summarize(name, aggregator, read(metrics))), flush=True)


if __name__ == '__main__':
  main(sys.argv[1:])
