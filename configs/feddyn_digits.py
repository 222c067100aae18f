"""FedDyn on scikit-learn's digits: dynamic regularization of each client.

Acar et al. 2021 ("Federated Learning Based on Dynamic Regularization"),
Algorithm 1: each client minimises its loss minus the linear term of its
last local gradient plus ``(alpha / 2) ||theta - theta^{t-1}||^2``,
``alpha = 0.01`` (the paper tunes it in {0.1, 0.01, 0.001}), with one epoch
of SGD; the server averages the clients' models uniformly (the paper's)
and subtracts ``h / alpha``, ``h`` summing the updates over the population
of 50 (the runner passes it as ``num_clients``). Data, model, cohort and
client learning rate as ``configs/fedavg_digits.py`` (50 non-IID clients,
10 a round, batch 10). Not tuned. The clients' gradient states live in the
runner's client store (``config.client_state``).

  fedjx-run --config configs/feddyn_digits.py --workdir runs/feddyn
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 150
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='feddyn', alpha=0.01, weighting='uniform',
      client_optimizer=optimizer('sgd', learning_rate=0.3))
  return config
