"""Privacy-utility study: non-private FedAvgM, DP-FTRLM's reference.

``--config=configs/privacy_fedavgm.py:digits`` or ``:synthetic``. The
cohorts (shuffled epochs of 10 rounds of 50 of the 500 clients) and the
server (SGD, learning rate 0.5, heavy-ball momentum 0.9) of
``configs/privacy_dp_ftrl.py``, without clipping or noise: what DP-FTRLM
would reach at epsilon = infinity.
"""

from fedjx.experiments.config_base import optimizer
from fedjx.experiments.privacy import utility_client_optimizer, utility_task


def get_config(dataset='digits'):
  config = utility_task(dataset)
  config.sampling = dict(name='epochs')
  config.algorithm = dict(
      name='fedavg', client_optimizer=utility_client_optimizer(dataset),
      server_optimizer=optimizer('sgd', learning_rate=0.5, momentum=0.9))
  return config
