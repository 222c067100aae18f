"""FedProx on Synthetic(1, 1) (Li et al. 2020, Section 5).

30 clients of heterogeneous softmax-regression data (alpha = beta = 1; each
holds out 20% of its examples), 10 clients per round, 20 local epochs of SGD
(learning rate 0.01, batch 10) with the proximal term ``mu / 2 ||w - w_t||^2``,
mu = 1: the paper's setting.
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.rounds = 200
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 20
  config.max_local_steps = 256
  config.eval_every = 10
  config.dataset = dict(name='synthetic', alpha=1.0, beta=1.0, num_clients=30,
                        max_examples=200)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(
      name='fedprox', mu=1.0,
      client_optimizer=optimizer('sgd', learning_rate=0.01))
  return config
