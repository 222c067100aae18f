"""Ditto on scikit-learn's digits: FedAvg plus a personal model per client.

Li et al. 2021 ("Ditto: Fair and Robust Federated Learning Through
Personalization"), Algorithm 1: the global model is FedAvg's (one local
epoch of SGD, server averaging); each sampled client also takes one epoch
of SGD on its personal model ``v_k`` with the pull ``lambda (v_k - w)``
toward the global model it received, ``lambda = 0.1`` (the paper tunes it in
{0.01, 0.1, 1, 2}). Data, model, cohort and client learning rate as
``configs/fedavg_digits.py`` (50 non-IID clients, 10 a round, batch 10). Not
tuned. The personal models live in the runner's client store
(``config.client_state``).

  fedjx-run --config configs/ditto_digits.py --workdir runs/ditto
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
      name='ditto', lam=0.1,
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      personal_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
