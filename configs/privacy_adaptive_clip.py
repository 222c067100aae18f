"""Privacy-utility study: DP-FedAvg with adaptive clipping (Andrew et al. 2021).

``--config=configs/privacy_adaptive_clip.py:digits`` or ``:synthetic``.
Poisson sampling with q = 0.1 (expected 50 of 500 clients); the clip norm
starts at 0.1 and follows the median update norm (target quantile 0.5,
geometric step 0.2; the count noise is the paper's default q N / 20). The
noise multiplier is the total ``z`` of the update and count mechanisms, which
the accountant composes like DP-FedAvg's (``docs/privacy.md``).
"""

from fedjx.experiments.config_base import optimizer
from fedjx.experiments.privacy import utility_client_optimizer, utility_task


def get_config(dataset='digits'):
  config = utility_task(dataset)
  config.sampling = dict(name='poisson')
  config.algorithm = dict(
      name='fedavg', client_optimizer=utility_client_optimizer(dataset),
      server_optimizer=optimizer('sgd', learning_rate=1.0),
      aggregator=dict(name='adaptive_gaussian', noise_multiplier=1.2,
                      initial_clip_norm=0.1, target_quantile=0.5,
                      clip_learning_rate=0.2, expected_clients_per_round=50.0))
  return config
