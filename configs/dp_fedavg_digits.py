"""DP-FedAvg (McMahan et al. 2018) on digits with user-level clipping and noise.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent
Language Models", ICLR 2018. The 1,797 digits are spread over 500 clients
(Dirichlet 0.5 label skew); each client takes part in a round independently
with probability q = 0.1 (Poisson sampling, the sampling the accountant
assumes; cohorts padded to a fixed bucket). Each update is clipped to L2
norm 0.5, the clipped updates are summed, Gaussian noise of standard
deviation ``z C`` (z = 1.2) is added and the sum is divided by the expected
cohort q N = 50. After the 100 rounds the run is (4.0, 500^-1.1)-DP for each
user (RDP accountant; the runner writes the epsilon of every round to the
metrics and the full statement to ``workdir/privacy.json``, see
``docs/privacy.md``).
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.rounds = 100
  config.cohort_size = 50                # expected: q N with q = 0.1
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.dataset = dict(name='digits', num_clients=500, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.sampling = dict(name='poisson')
  config.privacy = dict(delta=500 ** -1.1, accountant='rdp',
                        target_epsilon=None)
  config.algorithm = dict(
      name='dp_fedavg', clip_norm=0.5, noise_multiplier=1.2,
      expected_clients_per_round=50.0,
      client_optimizer=optimizer('sgd', learning_rate=0.1),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
