"""The hand-written accelerator floor on the cross-device setups: the
population's examples on the device once as flat arrays, each round's
example order per client as an int32 index (shuffled on the host for the
whole cohort in one sort, as ``handwritten_cross_device.py`` does), the
clients ordered by step count (descending) and cut into chunks of
``--width`` clients, one ``lax.scan`` over the chunks, each chunk a
``jax.vmap`` of its clients, each client a ``fori_loop`` over exactly its
own steps (vmapped, the loop runs the chunk's largest client's steps and
masks the steps past each client's own), its batch gathered inside the
loop, and the example-weighted mean of the local models. The last chunk is
filled with clients of no steps and weight 0. One ``jit``, one device, JAX
only.

On a TPU, many tiny steps one after another leave the chip idle, and
vmapped chunks of clients with similar step counts keep it busy until a
chunk is so wide that it pads too much (the sequential floor,
``handwritten_cross_device.py``, stays the CPU's).

  python handwritten_chunks_cross_device.py --setup=2nn-1000 --width=40 --rounds=4
"""

import common  # first: starts the clock

import os

import jax
import jax.numpy as jnp
import numpy as np

import cross_device as cd
import fedjx_cross_device


def main():
  args = cd.parse_args(__doc__.split('\n')[0], lambda p: p.add_argument(
      '--width', type=int, default=40, help='clients per vmapped chunk'))
  if args.width < 1:
    raise SystemExit(f'--width={args.width}; it must be at least 1.')
  arrays, sizes = cd.flat_arrays(args.setup)
  table = {k: jnp.asarray(v) for k, v in arrays.items()}
  del arrays
  n = len(sizes)
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  steps = -(-sizes // cd.BATCH)
  slots = int(steps.max()) * cd.BATCH
  width = min(args.width, n)
  chunks = -(-n // width)
  # Clients by descending step count (ties in client order), then filled to
  # chunks x width with clients of no steps and weight 0.
  order = np.argsort(-steps, kind='stable')
  filled = chunks * width - n
  loss = fedjx_cross_device.loss_fn(args.setup)

  def mean_loss(w, batch, m):
    return jnp.sum(jnp.where(m, loss(w, batch), 0.0)) / jnp.maximum(jnp.sum(m), 1)

  def client(params, ix, m, s):
    def step(t, w):
      rows = jax.lax.dynamic_slice_in_dim(ix, t * cd.BATCH, cd.BATCH)
      mt = jax.lax.dynamic_slice_in_dim(m, t * cd.BATCH, cd.BATCH)
      batch = {k: v[rows] for k, v in table.items()}
      g = jax.grad(mean_loss)(w, batch, mt)
      return jax.tree.map(lambda a, b: a - cd.LOCAL_LR * b, w, g)
    return jax.lax.fori_loop(0, s, step, params)

  @jax.jit
  def fedavg_round(params, index, mask, steps, weights):
    def chunk(acc, xs):
      ix, m, s, share = xs
      w = jax.vmap(client, in_axes=(None, 0, 0, 0))(params, ix, m, s)
      return jax.tree.map(lambda a, v: a + jnp.tensordot(share, v, 1), acc, w), None

    mean, _ = jax.lax.scan(chunk, jax.tree.map(jnp.zeros_like, params),
                           (index, mask, steps, weights))
    return jax.tree.map(lambda p, m: p - cd.SERVER_LR * (p - m), params, mean)

  def chunked(x):  # [n, ...] in client order -> [chunks, width, ...] sorted.
    x = x[order]
    x = np.concatenate([x, np.zeros((filled,) + x.shape[1:], x.dtype)])
    return x.reshape((chunks, width) + x.shape[1:])

  params = [tuple(map(jnp.asarray, layer)) for layer in cd.init(args.setup)]
  weights = jnp.asarray(chunked((sizes / sizes.sum()).astype(np.float32)))
  owner = np.repeat(np.arange(n), sizes)
  slot = np.arange(owner.size) - offsets[owner]
  mask = np.zeros((n, slots), bool)
  mask[owner, slot] = True
  mask = jnp.asarray(chunked(mask))
  chunk_steps = jnp.asarray(chunked(steps.astype(np.int32)))
  rounds = 1 if args.check else args.rounds
  clock = common.Clock()
  for r in range(rounds):
    index = np.zeros((n, slots), np.int32)
    index[owner, slot] = offsets[owner] + cd.cohort_order(r, sizes, shuffle=not args.check)
    params = fedavg_round(params, jnp.asarray(chunked(index)), mask, chunk_steps, weights)
    jax.block_until_ready(params)
    clock.tick()
  if args.check:
    cd.save(args.check, [tuple(map(np.asarray, layer)) for layer in params])
  sorted_steps = np.concatenate([steps[order], np.zeros(filled, steps.dtype)])
  computed = int(width * sorted_steps.reshape(chunks, width).max(1).sum())
  stats = jax.devices()[0].memory_stats() or {}
  cd.report('handwritten_jax_chunks', f'hand-written (jax {jax.__version__})',
            args.setup, clock, {'xla_flags': os.environ.get('XLA_FLAGS', ''),
                                'cpu_count': os.cpu_count()},
            width=width, chunks=chunks, device=jax.devices()[0].device_kind,
            computed_over_real_steps=round(computed / int(steps.sum()), 4),
            peak_bytes_in_use=stats.get('peak_bytes_in_use'))


if __name__ == '__main__':
  main()
