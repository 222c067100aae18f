"""What the per-client non-finite guard costs in the loop of docs/datasets.md,
and what its check of each client's trained model costs, in one process.

Three ``fedavg(...).compile()`` rounds of the cross-device setup (the loop
of ``fedjx_loop_cross_device.py --loop=on_device``: ``datasets.on_device``,
``datasets.cohort_iterator``, ``client_evaluation=False``):

* ``guard``: ``skip_nonfinite=True`` (the default), the library's check
  (``fedjx.algorithms.nonfinite.all_finite``: on the CPU a large float32
  matrix ``X`` of the trained model is checked as ``sum_i (X 0)_i``, a
  matrix-vector product);
* ``guard_sum_check``: the same round traced with the check every leaf had
  before 2026-12-07, ``isfinite(sum_leaves sum_j (x_j - x_j))``;
* ``no_guard``: ``skip_nonfinite=False``.

All three take the same cohort each round, in an order rotated every
repeat, and time ``--rounds`` rounds each per repeat (after one warm-up
round each, which compiles): the ratios against ``no_guard`` come from
rounds interleaved in time. One JSON line per variant and repeat (median
CPU and wall seconds of its rounds), then one summary line (medians over
repeats, ratios to ``no_guard``).

  python guard_check_cross_device.py --setup=2nn-1000 --rounds=3 --repeats=10
"""

import common  # first: starts the clock

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjx import algorithms
from fedjx import datasets
from fedjx.algorithms import nonfinite

import cross_device as cd
import fedjx_cross_device

VARIANTS = ('guard', 'guard_sum_check', 'no_guard')


SUM_CHECKS = []  # One entry per trace of sum_check.


def sum_check(tree):
  """The check before 2026-12-07: ``isfinite(sum_leaves sum_j (x_j - x_j))``."""
  SUM_CHECKS.append(1)
  total = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      total = total + jnp.sum(x - x, dtype=jnp.float32)
  return jnp.isfinite(total)


def main():
  def options(p):
    p.add_argument('--repeats', type=int, default=10,
                   help='interleaved repeats of every variant')
  args = cd.parse_args(__doc__.split('\n')[0], options)
  arrays, sizes = cd.flat_arrays(args.setup)
  groups = np.repeat(np.arange(len(sizes)), sizes)
  population = datasets.on_device(datasets.from_arrays(arrays, groups=groups))
  init = [tuple(map(jnp.asarray, layer)) for layer in cd.init(args.setup)]
  algos, states = {}, {}
  for name in VARIANTS:
    algos[name] = algorithms.fedavg(
        fedjx_cross_device.loss_fn(args.setup),
        client_optimizer=optax.sgd(cd.LOCAL_LR),
        server_optimizer=optax.sgd(cd.SERVER_LR), client_evaluation=False,
        skip_nonfinite=name != 'no_guard').compile()
    states[name] = algos[name].init(init)
  total = 1 + args.repeats * args.rounds
  cohorts = list(datasets.cohort_iterator(population, len(sizes), cd.BATCH,
                                          num_rounds=total))
  library_check = nonfinite.all_finite
  warmup = {}
  for name in VARIANTS:  # The first round traces and compiles each variant.
    nonfinite.all_finite = sum_check if name == 'guard_sum_check' else library_check
    try:
      w0 = time.perf_counter()
      states[name], metrics = algos[name].round(states[name], cohorts[0],
                                                jax.random.key(0))
      jax.block_until_ready(states[name].params)
      warmup[name] = round(time.perf_counter() - w0, 3)
    finally:
      nonfinite.all_finite = library_check
  assert SUM_CHECKS, 'guard_sum_check was not traced with the sum check'
  # A later trace would call the check again (and lose the sum check): none may.
  retraced = []
  nonfinite.all_finite = lambda tree: retraced.append(1) or library_check(tree)
  per = {name: [] for name in VARIANTS}
  r = 1
  for rep in range(args.repeats):
    order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
    batch = cohorts[r:r + args.rounds]
    r += args.rounds
    for name in order:
      cpu, wall = [], []
      for i, cohort in enumerate(batch):
        c0, w0 = common.tree_cpu_seconds(), time.perf_counter()
        states[name], metrics = algos[name].round(states[name], cohort,
                                                  jax.random.key(r + i))
        jax.block_until_ready(states[name].params)
        cpu.append(common.tree_cpu_seconds() - c0)
        wall.append(time.perf_counter() - w0)
      per[name].append((float(np.median(cpu)), float(np.median(wall))))
      print(json.dumps({
          'benchmark': 'guard_check_cross_device', 'setup': args.setup,
          'variant': name, 'repeat': rep, 'rounds': args.rounds,
          'cpu_s_per_round': round(per[name][-1][0], 4),
          'wall_s_per_round': round(per[name][-1][1], 4),
          'nonfinite_clients': float(metrics.get('nonfinite_clients', 0.0)),
          'loadavg_1m': round(os.getloadavg()[0], 2)}), flush=True)
  nonfinite.all_finite = library_check
  assert not retraced, 'a round was traced again'
  base = per['no_guard']
  summary = {'benchmark': 'guard_check_cross_device', 'summary': True,
             'setup': args.setup, 'repeats': args.repeats,
             'rounds': args.rounds, 'jax': jax.__version__,
             'cpu_count': os.cpu_count(),
             'cpu_devices': len(jax.devices('cpu')),
             'warmup_s': warmup}
  for name in VARIANTS:
    cpu = [c for c, _ in per[name]]
    wall = [w for _, w in per[name]]
    summary[name] = {
        'cpu_s_per_round': round(float(np.median(cpu)), 4),
        'wall_s_per_round': round(float(np.median(wall)), 4),
        'cpu_ratio_to_no_guard': round(float(np.median(
            [c / b for c, (b, _) in zip(cpu, base)])), 4),
        'wall_ratio_to_no_guard': round(float(np.median(
            [w / b for w, (_, b) in zip(wall, base)])), 4)}
  print(json.dumps(summary), flush=True)


if __name__ == '__main__':
  main()
