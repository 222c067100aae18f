"""A vectorized sweep against the same trials as sequential runs (JSON lines).

Times one ``fedjx-sweep`` process training a grid of server learning rates
x seeds, and ``fedjx-run`` processes training the same trials one after
another (each a fresh process: start-up, data, compilation and training, as
a researcher running a grid by hand would). Both sides write metrics and
checkpoints as usual; TensorBoard, plots and the non-finite checks are off
on both sides.

  python scripts/benchmark_sweep.py --rounds 300 --values 16 --seeds 0,1,2 \\
      --out benchmarks/results/benchmark_sweep_cpu.jsonl

``--sequential_limit K`` runs only the first K sequential trials; the line
then reports their measured mean and the ratio is marked ``"extrapolated":
true`` (the mean times the trial count).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app
from absl import flags

_CONFIG = flags.DEFINE_string('config', 'configs/fedavg_digits.py', 'Base config.')
_FIELD = flags.DEFINE_string('field', 'algorithm.server_optimizer.learning_rate',
                             'The swept field.')
_LOW = flags.DEFINE_float('low', 0.1, 'Smallest value (geometric grid).')
_HIGH = flags.DEFINE_float('high', 10.0, 'Largest value.')
_VALUES = flags.DEFINE_integer('values', 16, 'Grid values.')
_SEEDS = flags.DEFINE_string('seeds', '0,1,2', 'Seeds.')
_ROUNDS = flags.DEFINE_integer('rounds', 300, 'Rounds per trial.')
_LIMIT = flags.DEFINE_integer('sequential_limit', None,
                              'Run only this many sequential trials.')
_OUT = flags.DEFINE_string('out', None, 'Also append the JSON lines to this file.')


def _emit(row: dict, out: str | None) -> None:
  line = json.dumps(row)
  print(line, flush=True)
  if out:
    with open(out, 'a', encoding='utf-8') as f:
      f.write(line + '\n')


def _timed(cmd: list[str]) -> float:
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise SystemExit(f'{" ".join(cmd)} failed:\n{proc.stderr[-3000:]}')
  return wall


def main(argv) -> None:
  del argv
  values = [float(f'{v:.4g}') for v in np.geomspace(_LOW.value, _HIGH.value, _VALUES.value)]
  seeds = [int(s) for s in _SEEDS.value.split(',')]
  # nonfinite=off: a diverging trial runs all its rounds on both sides, so
  # both do the same work (a run would otherwise stop at its first NaN).
  common = [f'--config.rounds={_ROUNDS.value}', '--config.tensorboard=False',
            '--config.plot=False', '--config.progress=False',
            '--config.nonfinite=off']
  bindir = os.path.dirname(sys.executable)
  work = tempfile.mkdtemp(prefix='fedjx_sweep_bench_')
  base = {'config': _CONFIG.value, 'field': _FIELD.value, 'values': len(values),
          'seeds': len(seeds), 'trials': len(values) * len(seeds),
          'rounds': _ROUNDS.value, 'cpus': os.cpu_count()}
  try:
    sweep_s = _timed([os.path.join(bindir, 'fedjx-sweep'), '--config', _CONFIG.value,
                      '--workdir', os.path.join(work, 'sweep'),
                      '--sweep', f'{_FIELD.value}={",".join(map(str, values))}',
                      '--seeds', _SEEDS.value] + common)
    _emit(dict(base, what='vectorized_sweep', wall_s=round(sweep_s, 2)), _OUT.value)
    trials = [(v, s) for v in values for s in seeds]
    limit = len(trials) if _LIMIT.value is None else min(_LIMIT.value, len(trials))
    walls = []
    for i, (v, s) in enumerate(trials[:limit]):
      walls.append(_timed([os.path.join(bindir, 'fedjx-run'), '--config', _CONFIG.value,
                           '--workdir', os.path.join(work, f'run_{i}'),
                           f'--config.{_FIELD.value}={v}', f'--config.seed={s}'] + common))
    sequential_s = float(np.sum(walls)) * len(trials) / limit
    _emit(dict(base, what='sequential_runs', runs_measured=limit,
               mean_run_s=round(float(np.mean(walls)), 2),
               wall_s=round(sequential_s, 2)), _OUT.value)
    _emit(dict(base, what='speedup', sequential_over_sweep=round(sequential_s / sweep_s, 2),
               extrapolated=limit < len(trials)), _OUT.value)
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  app.run(main)
