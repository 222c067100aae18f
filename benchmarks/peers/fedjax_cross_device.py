"""FedJAX 0.0.17's FedAvg (``fedjax.algorithms.fed_avg``) on the cross-device
setups: the 2NN or the logistic regression as Haiku models started from the
setup's weights, ``InMemoryFederatedData``, one shuffled epoch of batch 10
per client, SGD 0.1 local, SGD 1.0 server. Needs jax 0.4.13 and dm-haiku
0.0.10 (requirements-fedjax.txt). Dense inputs only (FedJAX's model API has
no embedding-sum variant of the setup's sparse logistic regression).

  python fedjax_cross_device.py --setup=2nn-1000 --rounds=4
"""

import common  # first: starts the clock

import os
from importlib import metadata

import fedjax
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import cross_device as cd


def main():
  args = cd.parse_args(__doc__.split('\n')[0])
  if args.setup == 'logreg-sparse':
    raise SystemExit('fedjax_cross_device.py: logreg-sparse is not run by FedJAX.')
  data = cd.client_data(args.setup)
  layers = cd.init(args.setup)
  dims = [w.shape[1] for w, _ in layers]

  def forward(batch):
    h = batch['x']
    for i, d in enumerate(dims):
      h = hk.Linear(d, name=f'linear_{i}')(h)
      if i < len(dims) - 1:
        h = jax.nn.relu(h)
    return h

  if cd.kind(args.setup) == '2nn':
    sample = {'x': np.zeros((1, cd.LAYERS[0]), np.float32), 'y': np.zeros(1, np.int32)}
    train_loss = lambda batch, out: fedjax.metrics.unreduced_cross_entropy_loss(
        batch['y'], out)
  else:
    sample = {'x': np.zeros((1, cd.FEATURES), np.float32),
              'y': np.zeros((1, cd.TAGS), np.float32)}
    def train_loss(batch, out):
      y = batch['y']
      return jnp.sum(jnp.maximum(out, 0) - out * y + jnp.log1p(jnp.exp(-jnp.abs(out))), -1)
  model = fedjax.create_model_from_haiku(
      transformed_forward_pass=hk.transform(forward), sample_batch=sample,
      train_loss=train_loss)
  params = model.init(jax.random.PRNGKey(0))
  params = hk.data_structures.to_mutable_dict(params)
  for i, (w, b) in enumerate(layers):
    params[f'linear_{i}'] = {'w': jnp.asarray(w), 'b': jnp.asarray(b)}
  params = hk.data_structures.to_immutable_dict(params)
  assert sum(p.size for p in jax.tree_util.tree_leaves(params)) == cd.num_params(args.setup)
  algorithm = fedjax.algorithms.fed_avg.federated_averaging(
      grad_fn=fedjax.model_grad(model),
      client_optimizer=fedjax.optimizers.sgd(cd.LOCAL_LR),
      server_optimizer=fedjax.optimizers.sgd(cd.SERVER_LR),
      client_batch_hparams=fedjax.ShuffleRepeatBatchHParams(
          batch_size=cd.BATCH, num_epochs=1,
          # The check's round visits each client's examples in data order.
          skip_shuffle=bool(args.check)))
  federated = fedjax.InMemoryFederatedData(
      {str(i).encode(): {k: v.astype(np.int32) if v.dtype == np.int64 else v
                         for k, v in d.items()} for i, d in enumerate(data)})
  state = algorithm.init(params)
  ids = list(federated.client_ids())
  rounds = 1 if args.check else args.rounds
  clock = common.Clock()
  for r in range(rounds):
    clients = [(cid, federated.get_client(cid), jax.random.PRNGKey(r)) for cid in ids]
    state, _ = algorithm.apply(state, clients)
    jax.block_until_ready(state.params)
    clock.tick()
  if args.check:
    cd.save(args.check, [(np.asarray(state.params[f'linear_{i}']['w']),
                          np.asarray(state.params[f'linear_{i}']['b']))
                         for i in range(len(layers))])
  cd.report('fedjax', f"fedjax {metadata.version('fedjax')} (jax {jax.__version__}, "
            f'haiku {hk.__version__})', args.setup, clock,
            {'xla_flags': os.environ.get('XLA_FLAGS', ''), 'cpu_count': os.cpu_count()})


if __name__ == '__main__':
  main()
