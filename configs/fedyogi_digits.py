"""FedYogi (Reddi et al. 2021) on the quickstart's non-IID digits.

FedAvg's clients (one epoch of SGD) with Yogi on the server's
pseudo-gradient: ``beta1 = 0.9, beta2 = 0.99, tau = 1e-3``.
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
      name='fedyogi', client_optimizer=optimizer('sgd', learning_rate=0.1),
      server_learning_rate=0.01, b1=0.9, b2=0.99, eps=1e-3)
  return config
