"""The cost of the system model: round times with and without config.systems.

For a config of configs/heterogeneity_digits.py (any cohort size), in one
process and interleaved (A, B, A, B, ...), prints one JSON line per
measurement:

Each pair is run in alternating order (A B, then B A); medians and minima
are printed (the minimum is the least disturbed by other processes).

* ``compiled_round``: the jitted round on the cohort as built (systems off)
  and on the same cohort after ``SystemModel.close_round`` (dropouts and
  late clients made padding, partial clients' later steps masked): the same
  compiled program, so the ratio isolates what the system model changes on
  the device;
* ``host``: per round, sampling among the available clients and building
  the NumPy cohort (``make_cohort``), and closing it (``close_round``);
  both run on the prefetch thread, overlapped with the previous round;
* ``loop``: the runner's loop, rounds from ``Experiment.cohorts`` (systems
  off) against ``Experiment.system_rounds`` (systems on), prefetched, each
  block of rounds timed from the first cohort to the last round's result;
  ``control_ratio`` compares two identical systems-off blocks (the noise
  floor of the machine).

  python scripts/benchmark_systems.py --method fedavg_partial --cohort 20,100
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import jax
import numpy as np

from fedjx import datasets
from fedjx.experiments import config as config_lib
from fedjx.experiments import experiment

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      'configs', 'heterogeneity_digits.py')


def _config(method: str, cohort_size: int):
  spec = importlib.util.spec_from_file_location('heterogeneity_digits', CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(method)
  config.cohort_size = cohort_size
  if config.systems.deadline.get('reports') is not None:
    config.systems.deadline.reports = max(1, int(0.77 * cohort_size))
  config.progress = False
  return config_lib.validate(config)


def _median_ms(times):
  return round(1e3 * float(np.median(times)), 4)


def _timed(fn, *args):
  t = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return time.perf_counter() - t


def bench(method: str, cohort_size: int, reps: int, rounds: int,
          blocks: int, passes: int) -> None:
  config = _config(method, cohort_size)
  exp = experiment.build(config)
  model, c = exp.systems, config
  sampler = model.sampler(c.cohort_size)
  algo = exp.algorithm.compile(donate=False)
  state = algo.init(exp.init_params)
  key = exp.round_key_for(0)
  common = dict(method=method, cohort_size=cohort_size,
                backend=jax.default_backend())

  # Host side, per round: building and closing the cohort.
  build_s, close_s, cohorts = [], [], []
  clock = 0.0
  for r in range(reps):
    t = time.perf_counter()
    ids, available = sampler.at(clock).draw(r)
    built = datasets.make_cohort(
        exp.data.train, ids, c.batch_size, num_steps=c.local_steps,
        shuffle_seed=c.seed, round_num=r, pad_to=c.cohort_size)
    t1 = time.perf_counter()
    closed, report = model.close_round(built, r, clock, available)
    t2 = time.perf_counter()
    clock = report.end_time
    build_s.append(t1 - t)
    close_s.append(t2 - t1)
    cohorts.append((datasets.place_cohort(built), datasets.place_cohort(closed)))
  print(json.dumps(dict(common, measure='host', sample_and_build_ms=_median_ms(build_s),
                        close_round_ms=_median_ms(close_s))), flush=True)

  # The compiled round, on the same cohort before and after the system model.
  _timed(algo.round, state, cohorts[0][0], key)  # compile once: same program
  plain, closed = [], []
  for i, (built, shut) in enumerate(cohorts * passes):  # A B, then B A, ...
    for which in ((0, 1) if i % 2 == 0 else (1, 0)):
      (plain, closed)[which].append(
          _timed(algo.round, state, (built, shut)[which], key))
  print(json.dumps(dict(common, measure='compiled_round',
                        off_ms=_median_ms(plain), on_ms=_median_ms(closed),
                        ratio=round(float(np.median(closed) / np.median(plain)), 4),
                        off_min_ms=round(1e3 * min(plain), 4),
                        on_min_ms=round(1e3 * min(closed), 4),
                        min_ratio=round(min(closed) / min(plain), 4),
                        samples=len(plain))), flush=True)

  # The runner's loop: prefetched cohorts and the round, blocks interleaved.
  run_round = exp.algorithm.compile(donate=False).round
  def block(iterator, systems_on=False):
    t = time.perf_counter()
    s = state
    for item in iterator:
      cohort = item[0] if systems_on else item
      s, _ = run_round(state, cohort, key)
    jax.block_until_ready(s)
    iterator.close()
    return time.perf_counter() - t
  off, off2, on = [], [], []  # off2: the same as off (the noise floor)
  block(exp.cohorts(0, 2))  # compile
  for i in range(blocks):  # A A' B, then B A' A, ...
    for which in ((0, 1, 2) if i % 2 == 0 else (2, 1, 0)):
      if which < 2:
        (off, off2)[which].append(
            block(exp.cohorts(i * rounds, (i + 1) * rounds)))
      else:
        on.append(block(exp.system_rounds(0, rounds, 0.0), systems_on=True))
  print(json.dumps(dict(common, measure='loop', rounds=rounds,
                        off_ms_per_round=round(1e3 * np.median(off) / rounds, 4),
                        on_ms_per_round=round(1e3 * np.median(on) / rounds, 4),
                        ratio=round(float(np.median(on) / np.median(off)), 4),
                        min_ratio=round(min(on) / min(off), 4),
                        control_ratio=round(float(np.median(off2) / np.median(off)), 4),
                        control_min_ratio=round(min(off2) / min(off), 4),
                        blocks=blocks)),
        flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--method', default='fedavg_partial')
  parser.add_argument('--cohort', default='20,100')
  parser.add_argument('--reps', type=int, default=10)
  parser.add_argument('--rounds', type=int, default=50)
  parser.add_argument('--blocks', type=int, default=10)
  parser.add_argument('--passes', type=int, default=10)
  args = parser.parse_args()
  for size in args.cohort.split(','):
    bench(args.method, int(size), args.reps, args.rounds, args.blocks,
          args.passes)


if __name__ == '__main__':
  main()
