"""Privacy-utility study: DP-FedAvg with a fixed clip (McMahan et al. 2018).

``--config=configs/privacy_dp_fedavg.py:digits`` or ``:synthetic``. Each of
the 500 clients takes part with probability q = 0.1 per round (Poisson
sampling, cohorts padded to a bucket); updates clipped to L2 norm 0.5,
summed, ``N(0, (z C)^2 I)`` added and divided by ``q N = 50``. ``z = 1.2``
gives epsilon 4.0 at delta = 500^-1.1 after 100 rounds (RDP accountant;
``scripts/privacy_utility.py`` sets ``z`` for each target epsilon with
``fedjx.algorithms.accounting.noise_multiplier_for_epsilon``).
"""

from fedjx.experiments.config_base import optimizer
from fedjx.experiments.privacy import utility_client_optimizer, utility_task


def get_config(dataset='digits'):
  config = utility_task(dataset)
  config.sampling = dict(name='poisson')
  config.algorithm = dict(
      name='dp_fedavg', clip_norm=0.5, noise_multiplier=1.2,
      expected_clients_per_round=50.0,
      client_optimizer=utility_client_optimizer(dataset),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
