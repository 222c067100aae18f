"""fedjx's FedAvg round (``fedjx.algorithms.fedavg``, ``map_strategy='auto'``,
``client_evaluation=False``) on the peer setup; cohorts from
``make_cohort(..., bucket=False)``, so each client is padded only to the
largest client's step count and padded steps are skipped. The population
is placed as ``fedjx-run``'s ``config.data_placement`` places it
(``--data_placement``, default ``'auto'``: held once on the device where it
fits, ``fedjx.datasets.device_data.fits_on_device``, each round's cohort an
index into it; ``'host'`` builds each round's padded arrays on the host).
Rounds run as ``fedjx-run`` runs them under ``config.nonfinite='skip'``:
unguarded, with the in-program finiteness flag of
``guarded_rounds.checking_finiteness``.

  python fedjx_round.py --setup=equal --rounds=4
"""

import common  # first: starts the clock

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjx
from fedjx import algorithms
from fedjx import datasets
from fedjx.experiments import guarded_rounds
from fedjx.experiments import processes

import jax_cnn


def main():
  args = common.parse_args(__doc__.split('\n')[0], lambda p: p.add_argument(
      '--data_placement', default='auto', choices=('auto', 'device', 'host'),
      help="where the population lives (fedjx-run's config.data_placement)"))
  # As fedjx-run does (config.cpu_devices='auto', config.mesh='auto'): before
  # JAX starts, one CPU device per core; the cohort split over them only for
  # small models or ones that stream their weights (processes.splits_model:
  # this CNN's 6.5 MB reuse their kernels, and stay on one device).
  devices = fedjx.distributed.split_cpu(divides=common.COHORT)
  jax_cnn.use_conv(args.conv)
  data = common.client_data(args.setup)
  if (jax.default_backend() != 'cpu' or not processes.splits_model(
      jax_cnn.init(jax.random.key(0)), jax_cnn.loss, {'x': data[0][0], 'y': data[0][1]})
      or common.COHORT < fedjx.distributed.AUTO_MIN_CLIENTS_PER_DEVICE * devices):
    devices = 1
  mesh = fedjx.distributed.make_mesh({'clients': -1}) if devices > 1 else None
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    run(args, devices, data)


def run(args, devices, data):
  x = np.concatenate([x for x, _ in data])
  y = np.concatenate([y for _, y in data]).astype(np.int32)
  groups = np.repeat(np.arange(len(data)), [len(y) for _, y in data])
  population = datasets.from_arrays({'x': x, 'y': y}, groups=groups)
  placement = args.data_placement
  if placement == 'auto':
    placement = 'device' if datasets.device_data.fits_on_device(population) else 'host'
  if placement == 'device':
    population = datasets.on_device(population)
  params = jax_cnn.init(jax.random.key(0))
  assert sum(p.size for p in jax.tree.leaves(params)) == common.NUM_PARAMS
  algo = algorithms.fedavg(jax_cnn.loss, client_optimizer=optax.sgd(common.LOCAL_LR),
                           server_optimizer=optax.sgd(common.SERVER_LR),
                           client_evaluation=False, skip_nonfinite=False).compile(
      map_strategy='auto', donate=False)
  algo = guarded_rounds.checking_finiteness(algo, whole=True)
  state = algo.init(params)
  clock = common.Clock()
  for r in range(args.rounds):
    cohort = datasets.make_cohort(population, np.arange(len(data)), common.BATCH,
                                  shuffle_seed=0, round_num=r, bucket=False)
    cohort = datasets.place_cohort(cohort)
    state, metrics = algo.round(state, cohort, jax.random.key(r))
    jax.block_until_ready(state.params)
    clock.tick()
    if not metrics[guarded_rounds.RESULT_FINITE]:
      raise SystemExit(f'round {r}: the result is not finite')
  # What map_fn sizes 'auto' by: one client's inputs (its padded example
  # slots, gathered or placed, and its mask), the broadcast model included.
  row = x.nbytes // len(x) + y.nbytes // len(y)
  slots = int(np.prod(cohort.mask.shape[1:]))
  client_bytes = slots * (row + 1) + sum(a.nbytes for a in jax.tree.leaves(params))
  # Staged per round: the cohort's host arrays (an on-device table moved once).
  batches = (cohort.batches.index if placement == 'device' else cohort.batches)
  staged = sum(np.asarray(a).nbytes for a in jax.tree.leaves(
      (batches, cohort.mask, cohort.num_examples, cohort.client_ids)))
  spread = fedjx.mapping.device_blocks('clients', None, len(data))
  blocks = spread is not None
  n = len(data) // devices if blocks else len(data)
  k = fedjx.mapping.choose_chunk_size('auto', n, client_bytes, 1)
  picked = ('sequential' if k == 1 else 'vmap' if k >= n else f'chunked:{k}') + (
      '' if spread is None else f' on each of {devices} CPU devices' if blocks
      else f' on one of {devices} CPU devices')
  common.report('fedjx', f'fedjx (jax {jax.__version__})', args.setup, clock,
                jax_cnn.threads(), conv=args.conv, map_strategy=f'auto -> {picked}',
                bucket=False, data_placement=placement,
                host_bytes_staged_per_round=int(staged),
                staged_over_real=round(staged / (len(y) * row), 4),
                padded_steps=int(cohort.mask.shape[1]),
                real_steps=int(np.asarray(jnp.sum(jnp.any(cohort.mask, -1)))))


if __name__ == '__main__':
  main()
