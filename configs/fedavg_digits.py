"""Quickstart: FedAvg on scikit-learn's digits, 50 non-IID clients.

Of scikit-learn's 1,797 images, 359 (20%) are held out centrally and 1,438
are split over 50 clients of 28 or 29 images, each with a label mix drawn
from a Dirichlet (alpha = 0.5, Hsu et al. 2019: label skew at equal sizes).
Each round 10 clients run one epoch of SGD (learning rate 0.3, batch 10) on
an MLP with one hidden layer of 128 units, and the server steps along their
average update (McMahan et al. 2017) with learning rate 2: server learning
rate 1 is plain model averaging; a larger server step is the SGD case of
FedOpt (Reddi et al. 2021) and reaches 90% sooner. No download.

Tuned (docs/reproductions.md, ``bash scripts/reproductions.sh runs/repro
fedopt``): a grid of client learning rates {0.03, 0.1, 0.3} x server
learning rates {0.3, 1, 2, 3, 5, 10}, seeds 0-2, 150 rounds; the setting
with the fewest mean rounds to 90% test accuracy among those where every
seed reached it.

  fedjx-run --config configs/fedavg_digits.py --workdir runs/quickstart
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 300
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='fedavg',
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=2.0))
  return config
