"""Privacy-utility study: DP-FedAdam, FedAdam's server on the Gaussian aggregator.

``--config=configs/privacy_dp_fedadam.py:digits`` or ``:synthetic``. The
clients and the privacy are DP-FedAvg's (``configs/privacy_dp_fedavg.py``:
Poisson sampling with q = 0.1, clip 0.5, ``N(0, (z C)^2 I)`` on the sum,
divided by q N = 50); the server steps with Adam (Reddi et al. 2021: beta1
0.9, beta2 0.99, tau 1e-3, learning rate 0.01), a post-processing of the
private aggregate, so it is accounted exactly as DP-FedAvg.
"""

from fedjx.experiments.config_base import optimizer  # pylint: disable=unused-import
from fedjx.experiments.privacy import utility_client_optimizer, utility_task


def get_config(dataset='digits'):
  config = utility_task(dataset)
  config.sampling = dict(name='poisson')
  config.algorithm = dict(
      name='fedadam', client_optimizer=utility_client_optimizer(dataset),
      server_learning_rate=0.01, b1=0.9, b2=0.99, eps=1e-3,
      aggregator=dict(name='gaussian', clip_norm=0.5, noise_multiplier=1.2,
                      expected_clients_per_round=50.0))
  return config
