"""DP-FedAdam on digits: FedAdam's server with DP-FedAvg's clipped, noisy sum.

The Gaussian aggregator (McMahan et al. 2018) clips each client's update to
L2 norm 1, sums, adds N(0, (z C)^2) noise (z = 0.3) and divides by the
expected cohort size q N = 10; Adam (Reddi et al. 2021: beta1 = 0.9,
beta2 = 0.99, tau = 1e-3) then steps on that noisy pseudo-gradient. Adam's
step is a post-processing of the privatised aggregate, so the privacy
accounting is DP-FedAvg's: the runner accounts it for the uniform sampling
the run performs (10 of 50 clients without replacement: replace-one, so
sensitivity 2C and the accountant composes z / 2) and writes epsilon to the
metrics and ``privacy.json``. With 50 clients and z = 0.3 that epsilon is
12,578 at delta = 50^-1.1 after 300 rounds (RDP; reported as 2,579 before
the replace-one sensitivity was corrected), far too large to be a
guarantee: this config demonstrates the combination;
``configs/privacy_utility.py:digits,dp_fedadam`` runs it at epsilon 1 to 8.
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
      name='fedadam', client_optimizer=optimizer('sgd', learning_rate=0.1),
      server_learning_rate=0.01, b1=0.9, b2=0.99, eps=1e-3,
      aggregator=dict(name='gaussian', clip_norm=1.0, noise_multiplier=0.3,
                      expected_clients_per_round=10.0))
  return config
