"""SCAFFOLD (Karimireddy et al. 2020, option II) on Synthetic(1, 1).

The FedProx config's population and clients (20 local epochs of SGD), with
control variates correcting client drift instead of a proximal term. Each of
the 30 clients keeps its control variate across rounds (the runner passes
the population size as ``num_clients``).
"""

from fedjx.experiments.config_base import base_config


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
  config.algorithm = dict(name='scaffold', client_learning_rate=0.01)
  return config
