"""FedAvgM (Hsu et al. 2019) on the quickstart's non-IID digits.

FedAvg's clients (one epoch of SGD, learning rate 0.3) with heavy-ball
momentum on the server's pseudo-gradient: ``v <- 0.9 v + g``, ``x <- x - v``
(server learning rate 1). Reddi et al. 2021 compare it with the adaptive
server optimizers.

Tuned (docs/reproductions.md, ``bash scripts/reproductions.sh runs/repro
fedopt``): a grid of client learning rates {0.03, 0.1, 0.3} x server
learning rates {0.03, 0.1, 0.3, 1, 3}, seeds 0-2, 150 rounds; the setting
with the fewest mean rounds to 90% test accuracy among those where every
seed reached it.
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.rounds = 300
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='fedavgm', client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_learning_rate=1.0, server_momentum=0.9)
  return config
