"""APFL on scikit-learn's digits: a personal model per client mixed with the global one.

Deng, Kamani, Mahdavi 2020 ("Adaptive Personalized Federated Learning"),
Algorithm 1 with adaptive alpha: the global model is FedAvg's (one local
epoch of SGD, server averaging); each sampled client also steps its personal
model ``v_i`` on the gradient at the mixture ``alpha_i v_i + (1 - alpha_i)
w`` and its ``alpha_i`` (from 0.5, step 0.1, kept in [0, 1]). Data, model,
cohort and client learning rate as ``configs/fedavg_digits.py`` (50 non-IID
clients, 10 a round, batch 10). Not tuned. The personal models and alphas
live in the runner's client store (``config.client_state``).

  fedjx-run --config configs/apfl_digits.py --workdir runs/apfl
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 150
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='apfl', init_alpha=0.5, alpha_learning_rate=0.1,
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
