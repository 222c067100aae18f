"""q-FFL (q-FedAvg) on scikit-learn's digits: fairer accuracy across clients.

Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated
Learning", ICLR 2020, Algorithm 2. The quickstart's task (50 non-IID
clients, Dirichlet alpha = 0.5; 10 clients a round, one epoch of batch-10
SGD with learning rate 0.3 on an MLP with 128 hidden units), with the
q-FedAvg server step: each client's update is scaled by F_k^q (its loss at
the server model before training) and the step divides by sum_k h_k, with
the Lipschitz estimate L = 1 / 0.3 read from the client learning rate.
q = 0 is FedAvg with server learning rate 1; larger q weighs the clients
with larger loss more. Each client holds out 20% of its examples
(``client_test_fraction``), so the held-out data are per client and the
accuracy of every client can be measured (docs/reproductions.md).

  fedjx-run --config configs/qffl_digits.py --workdir runs/qffl_digits
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
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5,
                        client_test_fraction=0.2)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='qffl', q=1.0,
      client_optimizer=optimizer('sgd', learning_rate=0.3))
  return config
