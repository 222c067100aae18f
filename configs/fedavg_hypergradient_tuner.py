"""FedAvg with hypergradient descent on its server learning rate, on digits.

Softmax regression on scikit-learn's digits split over 50 non-IID clients
(Dirichlet alpha = 0.5). Each round 10 clients take 5 local SGD steps
(batch 10, learning rate 0.3) and the server applies SGD to the averaged
pseudo-gradient. The server learning rate starts at 0.03, 100x below the
best of a grid (3), and ``fedavg_hypergradient_tuner`` adapts it each round by
Adam on ``d L / d log(eta)``, the derivative of the round's clients' loss at
the new server model, with tangents carried across rounds (decay 0.99)
against short-horizon bias (Rush et al. 2023, arXiv 2301.07806; FedHyper, Wang et
al. 2024; Baydin et al. 2018). The metrics include
``hparams/server_optimizer/learning_rate``. See docs/hypergradients.md.

  fedjx-run --config configs/fedavg_hypergradient_tuner.py --workdir runs/hypertune

The algorithm name must be registered in fedjx.experiments.registry
(``fedavg_hypergradient_tuner`` from ``fedjx.algorithms``).
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 300
  config.cohort_size = 10
  config.batch_size = 10
  config.local_steps = 5
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(
      name='fedavg_hypergradient_tuner',
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=0.03),
      hyper_optimizer=optimizer('adam', learning_rate=0.1),
      tune=('server_optimizer/learning_rate',),
      local_steps=5,
      horizon_decay=0.99,
      min_value=1e-4,
      max_value=100.0)
  return config
