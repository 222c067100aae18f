"""A hand-written JAX FedAvg round on the cross-device setups, the floor a
framework's round is held to: the population's examples on the device once
as flat arrays, each round's example order per client as an int32 index
(shuffled on the host for the whole cohort in one sort), one ``lax.scan`` over clients, each a ``fori_loop``
over exactly its own steps (a dynamic trip count: no padded step is ever
entered) whose batch is gathered inside the loop, and the example-weighted
mean of the local models. One ``jit``; JAX only. Like fedjx's run, the CPU
is split into one device per core for small models (``--devices``, default
all cores: the largest count that divides the clients) and each device runs its
contiguous block of clients in its own loop (``jax.shard_map``), the sums
joined by one ``psum``; ``--devices=1`` is one device.

  python handwritten_cross_device.py --setup=2nn-1000 --rounds=4
"""

import common  # first: starts the clock

import os

import jax
import jax.numpy as jnp
import numpy as np

import fedjx
from fedjx.experiments import processes

import cross_device as cd
import fedjx_cross_device

P = jax.sharding.PartitionSpec


def main():
  args = cd.parse_args(__doc__.split('\n')[0], lambda p: p.add_argument(
      '--devices', type=int, default=0, help='CPU devices (0: one per core)'))
  cores = args.devices or len(os.sched_getaffinity(0))
  clients = len(cd.sizes(args.setup))
  devices = max(k for k in range(1, cores + 1) if clients % k == 0)
  jax.config.update('jax_num_cpu_devices', devices)
  # The split where fedjx's runs split (fedjx_cross_device.py): small models
  # or ones that stream their weights, at least 16 clients per device, a CPU
  # backend.
  data = cd.client_data(args.setup)
  if (jax.default_backend() != 'cpu' or not processes.splits_model(
      cd.init(args.setup), fedjx_cross_device.loss_fn(args.setup), data[0])
      or clients < fedjx.distributed.AUTO_MIN_CLIENTS_PER_DEVICE * devices):
    devices = 1
  table = {k: jnp.asarray(np.concatenate([d[k] for d in data]).astype(
      np.int32 if data[0][k].dtype == np.int64 else data[0][k].dtype)) for k in data[0]}
  sizes = np.array([len(d['y']) for d in data])
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  steps = -(-sizes // cd.BATCH)
  width = int(steps.max()) * cd.BATCH
  loss = fedjx_cross_device.loss_fn(args.setup)

  def mean_loss(w, batch, m):
    return jnp.sum(jnp.where(m, loss(w, batch), 0.0)) / jnp.maximum(jnp.sum(m), 1)

  mesh = jax.make_mesh((devices,), ('clients',), devices=jax.devices()[:devices])

  def block(params, index, mask, steps, weights):
    def client(acc, xs):
      ix, m, s, share = xs

      def step(t, w):
        rows = jax.lax.dynamic_slice_in_dim(ix, t * cd.BATCH, cd.BATCH)
        mt = jax.lax.dynamic_slice_in_dim(m, t * cd.BATCH, cd.BATCH)
        batch = {k: v[rows] for k, v in table.items()}
        g = jax.grad(mean_loss)(w, batch, mt)
        return jax.tree.map(lambda a, b: a - cd.LOCAL_LR * b, w, g)

      w = jax.lax.fori_loop(0, s, step, params)
      return jax.tree.map(lambda a, v: a + share * v, acc, w), None

    mean, _ = jax.lax.scan(client, jax.tree.map(jnp.zeros_like, params),
                           (index, mask, steps, weights))
    return jax.lax.psum(mean, 'clients')

  @jax.jit
  def fedavg_round(params, index, mask, steps, weights):
    mean = jax.shard_map(block, mesh=mesh, in_specs=(P(),) + (P('clients'),) * 4,
                         out_specs=P(), check_vma=False)(params, index, mask, steps, weights)
    return jax.tree.map(lambda p, m: p - cd.SERVER_LR * (p - m), params, mean)

  split = jax.sharding.NamedSharding(mesh, P('clients'))

  params = jax.device_put([tuple(map(jnp.asarray, layer)) for layer in cd.init(args.setup)],
                          jax.sharding.NamedSharding(mesh, P()))
  weights = jax.device_put((sizes / sizes.sum()).astype(np.float32), split)
  rounds = 1 if args.check else args.rounds
  clock = common.Clock()
  owner = np.repeat(np.arange(len(data)), sizes)
  slot = np.arange(owner.size) - offsets[owner]
  mask = np.zeros((len(data), width), bool)
  mask[owner, slot] = True
  mask = jax.device_put(mask, split)
  for r in range(rounds):
    index = np.zeros((len(data), width), np.int32)
    index[owner, slot] = offsets[owner] + cd.cohort_order(r, sizes, shuffle=not args.check)
    params = fedavg_round(params, jax.device_put(index, split),
                          mask,
                          jax.device_put(steps.astype(np.int32), split), weights)
    jax.block_until_ready(params)
    clock.tick()
  if args.check:
    cd.save(args.check, [tuple(map(np.asarray, layer)) for layer in params])
  cd.report('handwritten_jax', f'hand-written (jax {jax.__version__})', args.setup,
            clock, {'xla_flags': os.environ.get('XLA_FLAGS', ''),
                    'cpu_count': os.cpu_count(), 'cpu_devices': devices})


if __name__ == '__main__':
  main()
