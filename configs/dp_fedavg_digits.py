"""DP-FedAvg (McMahan et al. 2018) on digits with user-level clipping and noise.

Each client's update is clipped to L2 norm 1 and Gaussian noise of standard
deviation ``z C / (q N)`` is added to the average (z = 0.3, fixed denominator
q N = 10 clients per round). With 50 clients this is a demonstration of the
mechanism, not a meaningful privacy guarantee: the privacy accountant
``fedjx.algorithms.dp_epsilon`` gives the epsilon.
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
      name='dp_fedavg', clip_norm=1.0, noise_multiplier=0.3,
      expected_clients_per_round=10.0,
      client_optimizer=optimizer('sgd', learning_rate=0.1),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
