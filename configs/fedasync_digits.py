"""FedAsync on scikit-learn's digits: every arriving update mixed in at once.

Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", 2019. The
schedule of ``fedbuff_digits.py`` (100 non-IID clients, Dirichlet alpha =
0.5; 30 clients train at once, each job a log-normal time with median 60 s
and sigma 1) with a buffer of one: each round is one arriving client
(``cohort_size = 1``), mixed into the server model with weight alpha s(tau),
alpha = 0.6 and the polynomial staleness function s(tau) = (tau + 1)^-0.5;
updates more than 16 steps stale are dropped. Clients run one epoch of SGD
(learning rate 0.3, batch 10) on the MLP of ``fedavg_digits.py``, without
the proximal term (``rho = 0``). A round is one client's work, so 3000
rounds are the client updates of FedBuff's 300 steps of 10; the metrics
hold ``simulated_time`` (seconds), ``mean_staleness``, ``stale_dropped`` and
``mixing_weight`` (alpha s(tau)).

  fedjx-run --config configs/fedasync_digits.py --workdir runs/fedasync_digits
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 3000
  config.cohort_size = 1             # one arrival per server update
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 100
  config.checkpoint_every = 500
  config.dataset = dict(name='digits', num_clients=100, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='fedasync', alpha=0.6, rho=0.0,
      concurrency=30,                # clients training at once
      max_staleness=16,
      staleness_weighting='polynomial', staleness_exponent=0.5,
      client_durations=dict(name='lognormal', median=60.0, sigma=1.0),
      client_optimizer=optimizer('sgd', learning_rate=0.3))
  return config
