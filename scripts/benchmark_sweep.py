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

Compiled programs: each side starts from an empty compilation cache of its
own (``--cache fresh``, the default), as a researcher's first grid would:
the sweep compiles its programs once, the first sequential run compiles
its own and the later runs load them. ``--cache off`` compiles everything
every time; ``--cache user`` uses the user's cache as it is. ``--repeats N``
measures both sides N times, alternating which goes first, and prints a
speed-up line per repeat (then their median).

A sweep of 6 trials (the size of issue 64's measurement):

  python scripts/benchmark_sweep.py --rounds 300 --values 2 --seeds 0,1,2 \
      --repeats 3
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
_CACHE = flags.DEFINE_enum('cache', 'fresh', ['fresh', 'off', 'user'],
                           'Compilation cache of each side: an empty folder of '
                           "its own ('fresh'), none, or the user's.")
_REPEATS = flags.DEFINE_integer('repeats', 1, 'Measure both sides this many times.')
_SWEEP_ARGS = flags.DEFINE_multi_string(
    'sweep_args', [], "More arguments of the sweep alone, e.g. '--config.mesh=' "
    '(no CPU split: the trials stay on one device).')


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


def _cache_flag(work: str, side: str, repeat: int) -> list[str]:
  if _CACHE.value == 'user':
    return []
  if _CACHE.value == 'off':
    return ['--config.compilation_cache=off']
  return [f'--config.compilation_cache={os.path.join(work, f"xla_{side}_{repeat}")}']


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
          'rounds': _ROUNDS.value, 'cpus': os.cpu_count(), 'cache': _CACHE.value,
          'sweep_args': list(_SWEEP_ARGS.value)}
  trials = [(v, s) for v in values for s in seeds]
  limit = len(trials) if _LIMIT.value is None else min(_LIMIT.value, len(trials))

  def sweep(repeat: int) -> float:
    wall = _timed([os.path.join(bindir, 'fedjx-sweep'), '--config', _CONFIG.value,
                   '--workdir', os.path.join(work, f'sweep_{repeat}'),
                   '--sweep', f'{_FIELD.value}={",".join(map(str, values))}',
                   '--seeds', _SEEDS.value] + common + _cache_flag(work, 'sweep', repeat)
                  + list(_SWEEP_ARGS.value))
    _emit(dict(base, what='vectorized_sweep', repeat=repeat, wall_s=round(wall, 2)),
          _OUT.value)
    return wall

  def sequential(repeat: int) -> float:
    walls = []
    for i, (v, s) in enumerate(trials[:limit]):
      walls.append(_timed([os.path.join(bindir, 'fedjx-run'), '--config', _CONFIG.value,
                           '--workdir', os.path.join(work, f'run_{repeat}_{i}'),
                           f'--config.{_FIELD.value}={v}', f'--config.seed={s}']
                          + common + _cache_flag(work, 'runs', repeat)))
    wall = float(np.sum(walls)) * len(trials) / limit
    _emit(dict(base, what='sequential_runs', repeat=repeat, runs_measured=limit,
               first_run_s=round(walls[0], 2),
               mean_run_s=round(float(np.mean(walls)), 2), wall_s=round(wall, 2)),
          _OUT.value)
    return wall

  ratios = []
  try:
    for repeat in range(_REPEATS.value):
      if repeat % 2 == 0:
        sweep_s = sweep(repeat)
        sequential_s = sequential(repeat)
      else:
        sequential_s = sequential(repeat)
        sweep_s = sweep(repeat)
      ratios.append(sequential_s / sweep_s)
      _emit(dict(base, what='speedup', repeat=repeat,
                 sequential_over_sweep=round(ratios[-1], 2),
                 extrapolated=limit < len(trials)), _OUT.value)
    if len(ratios) > 1:
      _emit(dict(base, what='speedup_median', repeats=len(ratios),
                 sequential_over_sweep=round(float(np.median(ratios)), 2),
                 low=round(min(ratios), 2), high=round(max(ratios), 2),
                 extrapolated=limit < len(trials)), _OUT.value)
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  app.run(main)
