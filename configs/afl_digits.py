"""AFL (agnostic federated averaging) on scikit-learn's digits, classes as domains.

Mohri, Sivek, Suresh, "Agnostic Federated Learning", ICML 2019 (their
Fashion-MNIST experiment makes each of three classes a domain); the
federated-averaging form of Ro et al. 2021 (FedJAX's agnostic_fed_avg).
Here each of the ten digits is a domain: ``domain_key='y'`` reads every
example's domain id from its label, and the server keeps mixture weights
lambda over the ten classes, raised by exponentiated gradient on the
classes' losses (rate 0.03, the lowest worst-class loss of the grid in
docs/reproductions.md), so the model is trained for the worst mixture of
classes rather than the average. The quickstart's task otherwise (50
non-IID clients, Dirichlet alpha = 0.5; 10 clients a round, one epoch of
batch-10 SGD with learning rate 0.3; MLP with 128 hidden units; server SGD
with learning rate 2). The metrics hold each class's training loss
(``domain_loss_<d>``), its weight (``domain_weight_<d>``) and
``worst_domain_loss``.

  fedjx-run --config configs/afl_digits.py --workdir runs/afl_digits
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 100
  config.cohort_size = 10
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='afl', num_domains=10, domain_key='y',
      domain_learning_rate=0.03, domain_algorithm='eg', domain_window_size=5,
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=2.0))
  return config
