"""FedPer on scikit-learn's digits: joint local steps, only the body averaged.

Arivazhagan et al. 2019 ("Federated Learning with Personalization
Layers"): each client trains its whole model (the shared body and its own
``logits`` layer) for one epoch; the server averages the bodies and each
client keeps its head for its next round. Data, model, cohort and client
learning rate as ``configs/fedavg_digits.py`` (50 non-IID clients, 10 a
round, batch 10); server SGD with learning rate 1 (plain averaging). Not
tuned. The heads live in the runner's client store (``config.client_state``).

  fedjx-run --config configs/fedper_digits.py --workdir runs/fedper
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
      name='fedper', head='logits',
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
