"""Server cost of each robust aggregator: one JSON line per (defense, cohort).

Times the aggregation alone (``aggregators.map_clients`` on clients whose
update is given, then ``aggregators.aggregate``, one compiled program with
the non-finite guard on), as a round runs it after the clients' training, for
cohorts of ``C`` random updates of ``d`` float32 parameters: the compile time
and the median of ``--repeats`` runs. Each line holds the defense, ``C``,
``d``, both times in seconds and the size of the stacked updates in MiB.

  python scripts/robust_aggregator_cost.py                       # C = 16, 64; d = 100000
  python scripts/robust_aggregator_cost.py --clients 16 64 256 --dim 1000000
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import nonfinite
from fedjx.experiments import parts

DEFENSES = {
    'mean': {'name': 'mean'},
    'median': {'name': 'median'},
    'trimmed_mean': {'name': 'trimmed_mean', 'beta': 0.1},
    'krum': {'name': 'krum', 'num_byzantine': 2},
    'multi_krum': {'name': 'multi_krum', 'num_byzantine': 2, 'num_selected': 4},
    'bulyan': {'name': 'bulyan', 'num_byzantine': 2},
    'geometric_median': {'name': 'geometric_median'},
    'norm_bounding': {'name': 'norm_bounding'},
    'centered_clipping': {'name': 'centered_clipping'},
}


def program(agg, c):
  def run(updates, n, state, hp, key):
    @fedjx.program(clients=c)
    def body(updates, n, state, hp, key):
      client_fn = lambda u: nonfinite.ClientOutput(u, {'count': jnp.float32(1)})
      clients = aggregators.map_clients(agg, hp, client_fn, (updates,), n,
                                        'num_examples', True, aggregator_state=state)
      return aggregators.aggregate(agg, state, hp, clients, key)
    return body(updates, n, state, hp, key)
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--clients', type=int, nargs='+', default=[16, 64])
  parser.add_argument('--dim', type=int, default=100_000)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('defenses', nargs='*', default=sorted(DEFENSES))
  args = parser.parse_args()
  for c in args.clients:
    rng = np.random.default_rng(0)
    updates = {'w': jnp.asarray(rng.normal(size=(c, args.dim)).astype(np.float32))}
    n = jnp.asarray(rng.integers(1, 50, size=c), jnp.float32)
    for name in args.defenses:
      agg = parts.build_aggregator(DEFENSES[name])
      state = agg.init({'w': updates['w'][0]})
      hp = aggregators.init_hparams(agg)
      key = jax.random.key(0)
      fn = program(agg, c)
      start = time.perf_counter()
      compiled = fn.lower(updates, n, state, hp, key).compile()
      compile_s = time.perf_counter() - start
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(updates, n, state, hp, key))
        times.append(time.perf_counter() - start)
      print(json.dumps({
          'defense': name, 'clients': c, 'dim': args.dim,
          'compile_s': round(compile_s, 3), 'aggregate_s': round(statistics.median(times), 4),
          'stacked_mib': round(c * args.dim * 4 / 2**20, 1),
          'backend': jax.default_backend()}), flush=True)


if __name__ == '__main__':
  main()
