"""A hand-written JAX FedAvg round: ``lax.map`` over clients, each a
``fori_loop`` over exactly its own steps of SGD (0.1, batch 10) on its
shuffled, zero-padded batches, then the example-weighted mean of the local
models (server SGD 1.0). One ``jit``.

  python lax_map_round.py --setup=equal --rounds=4
"""

import common  # first: starts the clock

import jax
import jax.numpy as jnp
import numpy as np

import jax_cnn


def batches(data, round_num):
  """``x [C, S, B, 32, 32, 3]``, ``y``/``mask [C, S, B]``, ``steps [C]``."""
  s = max(-(-len(y) // common.BATCH) for _, y in data)
  c, b = len(data), common.BATCH
  xs = np.zeros((c, s * b) + common.IMAGE, np.float32)
  ys = np.zeros((c, s * b), np.int32)
  mask = np.zeros((c, s * b), bool)
  for i, (x, y) in enumerate(data):
    order = np.random.default_rng((round_num, i)).permutation(len(y))
    xs[i, :len(y)], ys[i, :len(y)], mask[i, :len(y)] = x[order], y[order], True
  steps = np.array([-(-len(y) // b) for _, y in data])
  return (xs.reshape(c, s, b, *common.IMAGE), ys.reshape(c, s, b),
          mask.reshape(c, s, b), steps)


@jax.jit
def fedavg_round(params, x, y, mask, steps):
  def client(args):
    cx, cy, cm, n = args

    def step(t, w):
      m = cm[t]
      g = jax.grad(lambda w: jnp.sum(jnp.where(
          m, jax_cnn.loss(w, {'x': cx[t], 'y': cy[t]}), 0.0)) /
          jnp.maximum(jnp.sum(m), 1))(w)
      return jax.tree.map(lambda a, b: a - common.LOCAL_LR * b, w, g)

    return jax.lax.fori_loop(0, n, step, params)

  models = jax.lax.map(client, (x, y, mask, steps))
  n = jnp.sum(mask, (1, 2)).astype(jnp.float32)
  w = n / jnp.sum(n)
  mean = jax.tree.map(lambda m: jnp.tensordot(w, m, 1), models)
  return jax.tree.map(lambda p, m: p - common.SERVER_LR * (p - m), params, mean)


def main():
  args = common.parse_args(__doc__.split('\n')[0])
  jax_cnn.use_conv(args.conv)
  data = common.client_data(args.setup)
  params = jax_cnn.init(jax.random.key(0))
  clock = common.Clock()
  for r in range(args.rounds):
    params = fedavg_round(params, *map(jnp.asarray, batches(data, r)))
    jax.block_until_ready(params)
    clock.tick()
  common.report('lax_map', f'hand-written (jax {jax.__version__})', args.setup,
                clock, jax_cnn.threads(), conv=args.conv)


if __name__ == '__main__':
  main()
