"""FedJAX 0.0.17's FedAvg round (``fedjax.algorithms.fed_avg``) on the peer
setup: a Haiku model of pfl-research's CNN, ``InMemoryFederatedData``, one
shuffled epoch of batch 10 per client, SGD 0.1 local, SGD 1.0 server.
Needs jax 0.4.13 and dm-haiku 0.0.10 (requirements-fedjax.txt).

  python fedjax_round.py --setup=equal --rounds=4
"""

import common  # first: starts the clock

import os

import fedjax
import haiku as hk
import jax
import numpy as np
from importlib import metadata


def forward(x):
  glorot = hk.initializers.VarianceScaling(1.0, 'fan_avg', 'uniform')
  h = jax.nn.relu(hk.Conv2D(32, 3, padding='VALID', w_init=glorot)(x))
  h = jax.nn.relu(hk.Conv2D(64, 3, padding='VALID', w_init=glorot)(h))
  h = hk.max_pool(h, 2, 2, 'VALID')
  h = hk.Flatten()(h)
  h = jax.nn.relu(hk.Linear(128, w_init=glorot)(h))
  return hk.Linear(10, w_init=glorot)(h)


def main():
  args = common.parse_args(__doc__.split('\n')[0])
  data = common.client_data(args.setup)
  transformed = hk.transform(lambda batch: forward(batch['x']))
  model = fedjax.create_model_from_haiku(
      transformed_forward_pass=transformed,
      sample_batch={'x': np.zeros((1,) + common.IMAGE, np.float32),
                    'y': np.zeros(1, np.int32)},
      train_loss=lambda batch, out: fedjax.metrics.unreduced_cross_entropy_loss(
          batch['y'], out))
  params = model.init(jax.random.PRNGKey(0))
  assert sum(p.size for p in jax.tree_util.tree_leaves(params)) == common.NUM_PARAMS
  algorithm = fedjax.algorithms.fed_avg.federated_averaging(
      grad_fn=fedjax.model_grad(model),
      client_optimizer=fedjax.optimizers.sgd(common.LOCAL_LR),
      server_optimizer=fedjax.optimizers.sgd(common.SERVER_LR),
      client_batch_hparams=fedjax.ShuffleRepeatBatchHParams(
          batch_size=common.BATCH, num_epochs=common.EPOCHS))
  federated = fedjax.InMemoryFederatedData(
      {str(i).encode(): {'x': x, 'y': y.astype(np.int32)}
       for i, (x, y) in enumerate(data)})
  state = algorithm.init(params)
  ids = list(federated.client_ids())
  clock = common.Clock()
  for r in range(args.rounds):
    clients = [(cid, federated.get_client(cid), jax.random.PRNGKey(r))
               for cid in ids]
    state, _ = algorithm.apply(state, clients)
    jax.block_until_ready(state.params)
    clock.tick()
  common.report('fedjax', f"fedjax {metadata.version('fedjax')} (jax "
                f"{jax.__version__}, haiku {hk.__version__})", args.setup, clock,
                {'xla_flags': os.environ.get('XLA_FLAGS', ''),
                 'cpu_count': os.cpu_count(),
                 'xla_cpu_threads': 'XLA default (cpu_count)'})


if __name__ == '__main__':
  main()
