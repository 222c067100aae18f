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
import logging
import os
import re

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


class MapPlans(logging.Handler):
  """Collects how each traced map ran (``fedjx.mapping.PLAN_MESSAGE``)."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.plans = []

  def emit(self, record):
    if record.msg == fedjx.mapping.PLAN_MESSAGE:
      _, n, strategy, k, how = record.args
      self.plans.append({'members': n, 'strategy': strategy, 'k': k, 'how': how})

  def __enter__(self):
    log = logging.getLogger('fedjx.fusion')
    self._level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(self)
    return self

  def __exit__(self, *exc):
    log = logging.getLogger('fedjx.fusion')
    log.removeHandler(self)
    log.setLevel(self._level)

  def report(self, cost):
    """``map_strategy`` (what the round's map ran) and its computed / real
    steps for the members' ``cost`` (each device's block when split)."""
    if not self.plans:
      return {'map_strategy': 'not traced'}
    plan = self.plans[-1]
    block = re.search(r'one block of (\d+) per device', plan['how'])
    blocks = block is not None
    devices = len(cost) // int(block.group(1)) if blocks else 1
    k, n = plan['k'], len(cost) // devices
    kind = ('sorted' if 'sorted' in plan['how'] else
            'sequential' if k == 1 else 'vmap' if k >= n else 'chunked')
    picked = f'{kind}:{k}' if kind in ('sorted', 'chunked') else kind
    computed = sum(fedjx.mapping.computed_steps(part, k, kind)
                   for part in np.split(np.asarray(cost), devices))
    return {'map_strategy': f'{plan["strategy"]} -> {picked}' + (
                f' on each of {devices} CPU devices' if blocks else ''),
            'computed_over_real_steps': round(computed / int(np.sum(cost)), 4)}


def staging(cohort, arrays, sizes) -> dict:
  """Host bytes staged per round (the cohort's arrays; the table moved
  once) against the cohort's real data."""
  batches = cohort.batches
  leaves = ([batches.index] if fedjx.indexed.is_indexed(batches)
            else jax.tree.leaves(batches))
  staged = sum(np.asarray(a).nbytes for a in (
      *leaves, cohort.mask, cohort.num_examples, cohort.client_ids))
  row = sum(v.nbytes // len(v) for v in arrays.values())
  real = int(np.sum(sizes)) * row
  return {'host_bytes_staged_per_round': int(staged), 'real_data_bytes': real,
          'staged_over_real': round(staged / real, 4),
          'padded_steps': int(cohort.mask.shape[1])}


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
  arrays, sizes = cd.flat_arrays(args.setup)
  if (jax.default_backend() != 'cpu' or not processes.splits_model(
      cd.init(args.setup), loss_fn(args.setup), cd.first_client(arrays, sizes))
      or clients < fedjx.distributed.AUTO_MIN_CLIENTS_PER_DEVICE * devices):
    devices = 1
  mesh = fedjx.distributed.make_mesh({'clients': -1}) if devices > 1 else None
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    run(args, devices, arrays, sizes)


def run(args, devices, arrays, sizes):
  groups = np.repeat(np.arange(len(sizes)), sizes)
  population = datasets.on_device(datasets.from_arrays(arrays, groups=groups))
  params = [tuple(map(jnp.asarray, layer)) for layer in cd.init(args.setup)]
  algo = algorithms.fedavg(loss_fn(args.setup),
                           client_optimizer=optax.sgd(cd.LOCAL_LR),
                           server_optimizer=optax.sgd(cd.SERVER_LR),
                           client_evaluation=False,
                           skip_nonfinite=False).compile(map_strategy=args.map_strategy)
  algo = guarded_rounds.checking_finiteness(algo, whole=True)
  state = algo.init(params)
  ids = np.arange(len(sizes))
  rounds = 1 if args.check else args.rounds
  # As fedjx-run feeds its rounds: the next round's cohort is built and
  # placed on a background thread while this one runs (config.prefetch=1).
  cohorts = datasets.cohort_iterator(population, len(ids), cd.BATCH,
                                     num_rounds=rounds, shuffle=not args.check,
                                     prefetch=args.prefetch)
  clock = common.Clock()
  with MapPlans() as plans:
    for r, cohort in enumerate(cohorts):
      state, metrics = algo.round(state, cohort, jax.random.key(r))
      jax.block_until_ready(state.params)
      clock.tick()
      if not metrics[guarded_rounds.RESULT_FINITE]:
        raise SystemExit(f'round {r}: the result is not finite')
  if args.check:
    cd.save(args.check, [tuple(map(np.asarray, layer)) for layer in state.params])
  cost = np.asarray(jnp.sum(jnp.any(cohort.mask, -1), -1))
  stats = jax.devices()[0].memory_stats() or {}
  cd.report('fedjx', f'fedjx (jax {jax.__version__})', args.setup, clock,
            {'xla_flags': os.environ.get('XLA_FLAGS', ''),
             'cpu_count': os.cpu_count(), 'cpu_devices': devices},
            **plans.report(cost), **staging(cohort, arrays, sizes),
            device=jax.devices()[0].device_kind,
            peak_bytes_in_use=stats.get('peak_bytes_in_use'))


if __name__ == '__main__':
  main()
