"""fedjx's FedAvg on the cross-device setups, in the loops a user writes from
the documentation, with nothing of ``fedjx-run`` (no mesh, no device split,
no options beyond the peers' work):

* ``--loop=on_device`` (docs/datasets.md): the population from
  ``datasets.from_arrays`` put on the device with ``datasets.on_device``,
  each round's cohort from ``datasets.cohort_iterator``;
* ``--loop=make_cohort``: the population on the host, each round's cohort
  from ``datasets.make_cohort`` (shuffled per client and round), passed to
  the round as NumPy arrays.

The algorithm is ``fedavg(...).compile()`` under its defaults
(``map_strategy='auto'``, the per-client non-finite guard; ``--no_guard``:
``skip_nonfinite=False``, as ``fedjx-run`` runs its rounds), with
``client_evaluation=False`` (no extra passes over the data: what the peers
compute). Nothing touches JAX before the population is built, so
``on_device`` may split the CPU into one device per core as the library
does by itself.

  python fedjx_loop_cross_device.py --setup=2nn-1000 --loop=on_device --rounds=4
"""

import common  # first: starts the clock

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjx import algorithms
from fedjx import datasets

import cross_device as cd
import fedjx_cross_device


def main():
  def options(p):
    p.add_argument('--loop', default='on_device', choices=('on_device', 'make_cohort'),
                   help='the documented loop to run')
    p.add_argument('--no_guard', action='store_true',
                   help='build the round with skip_nonfinite=False')
  args = cd.parse_args(__doc__.split('\n')[0], options)
  arrays, sizes = cd.flat_arrays(args.setup)
  groups = np.repeat(np.arange(len(sizes)), sizes)
  population = datasets.from_arrays(arrays, groups=groups)
  with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter('always')
    if args.loop == 'on_device':
      population = datasets.on_device(population)
    params = [tuple(map(jnp.asarray, layer)) for layer in cd.init(args.setup)]
    algo = algorithms.fedavg(fedjx_cross_device.loss_fn(args.setup),
                             client_optimizer=optax.sgd(cd.LOCAL_LR),
                             server_optimizer=optax.sgd(cd.SERVER_LR),
                             client_evaluation=False,
                             skip_nonfinite=not args.no_guard).compile()
    state = algo.init(params)
    ids = np.arange(len(sizes))
    rounds = 1 if args.check else args.rounds
    if args.loop == 'on_device':
      cohorts = datasets.cohort_iterator(population, len(ids), cd.BATCH,
                                         num_rounds=rounds, shuffle=not args.check)
    else:
      cohorts = (datasets.make_cohort(population, ids, cd.BATCH, round_num=r,
                                      shuffle_seed=None if args.check else 0)
                 for r in range(rounds))
    clock = common.Clock()
    with fedjx_cross_device.MapPlans() as plans:
      for r, cohort in enumerate(cohorts):
        state, _ = algo.round(state, cohort, jax.random.key(r))
        jax.block_until_ready(state.params)
        clock.tick()
  if args.check:
    cd.save(args.check, [tuple(map(np.asarray, layer)) for layer in state.params])
  cost = np.asarray(cohort.mask).any(-1).sum(-1)
  name = f'fedjx_loop_{args.loop}' + ('_no_guard' if args.no_guard else '')
  cd.report(name, f'fedjx (jax {jax.__version__})', args.setup, clock,
            {'xla_flags': os.environ.get('XLA_FLAGS', ''),
             'cpu_count': os.cpu_count(), 'cpu_devices': len(jax.devices('cpu'))},
            **plans.report(cost),
            **fedjx_cross_device.staging(cohort, arrays, sizes),
            warnings=sorted({str(w.message) for w in warned}))


if __name__ == '__main__':
  main()
