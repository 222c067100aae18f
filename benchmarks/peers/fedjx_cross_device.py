"""fedjx's FedAvg on the cross-device setups, as a user writes it: the
population from ``datasets.from_arrays``, put on the device with
``datasets.on_device`` (what ``fedjx-run`` does under
``config.data_placement='auto'``), each round's cohort from
``datasets.cohort_iterator`` as ``fedjx-run`` takes it (``make_cohort`` of
the whole population, shuffled per client and round, steps bucketed to a
power of two, the next round's built and placed on a background thread
while a round runs: ``config.prefetch=1``), ``fedavg(...).compile()`` under ``map_strategy='auto'``,
``client_evaluation=False`` (no extra passes over the data: what the peers
compute). Rounds run as ``fedjx-run`` runs them under its default
``config.nonfinite='skip'``: built without the per-client guard
(``skip_nonfinite=False``), with the flag of
``guarded_rounds.checking_finiteness`` computed in the round's program
(a lowered flag would send ``fedjx-run`` through the guarded round; here it
stops the benchmark).

  python fedjx_cross_device.py --setup=2nn-1000 --rounds=4
"""

import common  # first: starts the clock

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjx
from fedjx import algorithms
from fedjx import datasets
from fedjx.experiments import guarded_rounds
from fedjx.experiments import processes

import cross_device as cd


def loss_fn(setup):
  if cd.kind(setup) == '2nn':
    def loss(params, batch):
      h = batch['x']
      for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
          h = jax.nn.relu(h)
      return optax.softmax_cross_entropy_with_integer_labels(h, batch['y'])
    return loss

  def loss(params, batch):
    (w, b), = params
    if 'tokens' in batch:  # The embedding sum of the example's tokens.
      logits = jnp.sum(jnp.take(w, batch['tokens'], axis=0), axis=1) + b
    else:
      logits = batch['x'] @ w + b
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, batch['y']), -1)
  return loss


def main():
  def options(p):
    p.add_argument('--map_strategy', default='auto',
                   choices=('auto', 'sequential', 'chunked', 'vmap'),
                   help="the round's map strategy (fedjx-run's config.map_strategy)")
    p.add_argument('--prefetch', type=int, default=1,
                   help="cohorts built ahead on a background thread (fedjx-run's "
                        'config.prefetch; 0: each built before its round)')
  args = cd.parse_args(__doc__.split('\n')[0], options)
  # As fedjx-run does (config.cpu_devices='auto', config.mesh='auto'): before
  # JAX starts, one CPU device per core; the cohort split over them when the
  # model is small or streams its weights (processes.splits_model) and there
  # are at least 16 clients per device.
  clients = len(cd.sizes(args.setup))
  devices = fedjx.distributed.split_cpu(divides=clients)
  data = cd.client_data(args.setup)
  if (jax.default_backend() != 'cpu' or not processes.splits_model(
      cd.init(args.setup), loss_fn(args.setup), data[0])
      or clients < processes.AUTO_MIN_CLIENTS_PER_DEVICE * devices):
    devices = 1
  mesh = fedjx.distributed.make_mesh({'clients': -1}) if devices > 1 else None
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    run(args, devices, data)


def run(args, devices, data):
  arrays = {k: np.concatenate([d[k] for d in data]) for k in data[0]}
  arrays = {k: v.astype(np.int32) if v.dtype == np.int64 else v
            for k, v in arrays.items()}
  groups = np.repeat(np.arange(len(data)), [len(d['y']) for d in data])
  population = datasets.on_device(datasets.from_arrays(arrays, groups=groups))
  params = [tuple(map(jnp.asarray, layer)) for layer in cd.init(args.setup)]
  algo = algorithms.fedavg(loss_fn(args.setup),
                           client_optimizer=optax.sgd(cd.LOCAL_LR),
                           server_optimizer=optax.sgd(cd.SERVER_LR),
                           client_evaluation=False,
                           skip_nonfinite=False).compile(map_strategy=args.map_strategy)
  algo = guarded_rounds.checking_finiteness(algo, whole=True)
  state = algo.init(params)
  ids = np.arange(len(data))
  rounds = 1 if args.check else args.rounds
  # As fedjx-run feeds its rounds: the next round's cohort is built and
  # placed on a background thread while this one runs (config.prefetch=1).
  cohorts = datasets.cohort_iterator(population, len(ids), cd.BATCH,
                                     num_rounds=rounds, shuffle=not args.check,
                                     prefetch=args.prefetch)
  clock = common.Clock()
  for r, cohort in enumerate(cohorts):
    state, metrics = algo.round(state, cohort, jax.random.key(r))
    jax.block_until_ready(state.params)
    clock.tick()
    if not metrics[guarded_rounds.RESULT_FINITE]:
      raise SystemExit(f'round {r}: the result is not finite')
  if args.check:
    cd.save(args.check, [tuple(map(np.asarray, layer)) for layer in state.params])
  # Staged per round: the cohort's host arrays (the table moved once).
  staged = sum(np.asarray(a).nbytes for a in (
      cohort.batches.index, cohort.mask, cohort.num_examples, cohort.client_ids))
  row = sum(v.nbytes // len(v) for v in arrays.values())
  real = int(sum(len(d['y']) for d in data)) * row
  cost = np.asarray(jnp.sum(jnp.any(cohort.mask, -1), -1))
  member = (int(np.prod(cohort.mask.shape[1:])) * (row + 5) +
            sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(params)))
  spread = fedjx.mapping.device_blocks('clients', None, len(ids))
  blocks = spread is not None
  k = fedjx.mapping.choose_chunk_size(
      args.map_strategy, len(ids) // devices if blocks else len(ids), member, 1)
  picked = 'sequential' if k == 1 else 'vmap' if k >= len(ids) else f'chunked:{k}'
  strategy = 'sequential' if k == 1 else 'vmap' if k >= len(ids) else 'chunked'
  cd.report('fedjx', f'fedjx (jax {jax.__version__})', args.setup, clock,
            {'xla_flags': os.environ.get('XLA_FLAGS', ''),
             'cpu_count': os.cpu_count(), 'cpu_devices': devices},
            map_strategy=f'{args.map_strategy} -> {picked}' + (
                '' if spread is None else f' on each of {devices} CPU devices'
                if blocks else f' on one of {devices} CPU devices'),
            host_bytes_staged_per_round=int(staged), real_data_bytes=real,
            staged_over_real=round(staged / real, 4),
            padded_steps=int(cohort.mask.shape[1]),
            computed_over_real_steps=round(sum(
                fedjx.mapping.computed_steps(block, k, strategy)
                for block in np.split(cost, devices if blocks else 1)) /
                int(cost.sum()), 4))


if __name__ == '__main__':
  main()
