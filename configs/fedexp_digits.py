"""FedExP on scikit-learn's digits, the quickstart's task.

Jhunjhunwala, Wang, Joshi 2023 ("FedExP: Speeding Up Federated Averaging via
Extrapolation"): FedAvg whose server step size is extrapolated each round,
eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps))), eps =
1e-3 (the paper's); reported as the metric ``server_step_size``. Data,
model, cohort and local epoch as ``configs/fedavg_digits.py`` (50 non-IID
clients, 10 a round, batch 10); the client learning rate is the tuned one
(docs/reproductions.md).

  fedjx-run --config configs/fedexp_digits.py --workdir runs/fedexp
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
      name='fedexp', epsilon=1e-3,
      client_optimizer=optimizer('sgd', learning_rate=0.3))
  return config
