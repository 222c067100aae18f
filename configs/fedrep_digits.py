"""FedRep on scikit-learn's digits: a shared body, a personal output layer.

Collins et al. 2021 ("Exploiting Shared Representations for Personalized
Federated Learning"): each client keeps its own head (the MLP's ``logits``
layer) between rounds, trains it first with the body fixed (5 epochs of its
data), then the body with its new head (one epoch); the server averages the
bodies. Data, model, cohort and client learning rate as
``configs/fedavg_digits.py`` (50 non-IID clients, 10 a round, batch 10);
server SGD with learning rate 1 (plain averaging, the paper's). Not tuned.
The heads live in the runner's client store (``config.client_state``).

  fedjx-run --config configs/fedrep_digits.py --workdir runs/fedrep
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
      name='fedrep', head='logits', head_epochs=5,
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
