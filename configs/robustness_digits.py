"""Robustness study: FedAvg on digits with malicious clients and a defense.

The quickstart's task (configs/fedavg_digits.py: scikit-learn's digits over
50 clients, 10 a round, one local epoch of SGD 0.3 on an MLP with 128 hidden
units, server SGD 2.0), with the clients' data split IID, the setting of the
robust-aggregation papers (under the quickstart's Dirichlet(0.5) label skew,
without any attack, the median, trimmed mean and Krum reach 0.68, 0.69 and
0.34 where the mean reaches 0.90: docs/robustness.md), shortened to 60
rounds, with an attack
(``config.attack``: docs/robustness.md) and a defense
(``config.algorithm.aggregator``). By default: no attack, the mean.

  fedjx-run --config configs/robustness_digits.py --workdir runs/robust \\
      --config.attack.name=sign_flip --config.attack.fraction=0.1

``config.attack`` is a spec like every other part, ``{name, fraction, seed,
**options}``: ``--config.attack.name=alie --config.attack.z=1.5`` (or
``config.attack = dict(name='alie', fraction=0.2, z=1.5)``) sets an option
of the named attack (fedjx.experiments.parts.ATTACKS).

``scripts/robustness_study.py`` runs the grid of attacks x defenses x
malicious fractions of docs/robustness.md as sweeps of this config.
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 60
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 60
  config.dataset = dict(name='digits', num_clients=50, alpha=None)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='fedavg',
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=2.0),
      aggregator=dict(name='mean'))
  return config
