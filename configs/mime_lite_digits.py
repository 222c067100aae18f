"""MimeLite on scikit-learn's digits, the quickstart's task.

Karimireddy et al. 2021 ("Breaking the centralized barrier for cross-device
federated learning"): the clients step with the server's base optimizer
(SGD with momentum 0.9), its momentum frozen during local training and
updated once a round from the cohort's full-batch gradient at the server
model; the server averages the clients' models (server SGD, learning rate
1, the paper's). Data, model, cohort and local epoch as
``configs/fedavg_digits.py`` (50 non-IID clients, 10 a round, batch 10).
The base learning rate is the tuned one (docs/reproductions.md).

  fedjx-run --config configs/mime_lite_digits.py --workdir runs/mime_lite
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
      name='mime_lite',
      base_optimizer=optimizer('sgd', learning_rate=0.05, momentum=0.9),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
