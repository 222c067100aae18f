"""Privacy-utility study: non-private FedAvg (the epsilon = infinity baseline).

``--config=configs/privacy_fedavg.py:digits`` or ``:synthetic``: the study's
task (``fedjx.experiments.privacy.utility_task``: 500 clients, 50 per round
uniformly without replacement, 100 rounds, softmax regression) trained with
FedAvg (McMahan et al. 2017), client SGD (0.1 on digits, 0.5 on
Synthetic), server SGD 1.0.
"""

from fedjx.experiments.config_base import optimizer
from fedjx.experiments.privacy import utility_client_optimizer, utility_task


def get_config(dataset='digits'):
  config = utility_task(dataset)
  config.algorithm = dict(
      name='fedavg', client_optimizer=utility_client_optimizer(dataset),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
