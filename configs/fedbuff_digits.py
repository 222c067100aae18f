"""FedBuff on scikit-learn's digits: buffered asynchronous aggregation.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
AISTATS 2022. The digits are split over 100 non-IID clients (Dirichlet
label skew, alpha = 0.5). Thirty clients train at once (concurrency M); a
client's job takes a log-normal time (median 60 s, sigma 1: the slowest
tenth take over 3.6x the median); the server steps whenever K = 10 updates
are buffered (``cohort_size``), weighting each by 1 / sqrt(1 + staleness)
and dropping updates more than 16 steps stale. Clients run one epoch of SGD
(learning rate 0.3, batch 10) on the MLP of ``fedavg_digits.py``; the
server step is SGD with learning rate 1 on the weighted mean. The metrics
hold ``simulated_time`` (seconds), ``mean_staleness`` and ``stale_dropped``.

  fedjx-run --config configs/fedbuff_digits.py --workdir runs/fedbuff_digits
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.seed = 0
  config.rounds = 300
  config.cohort_size = 10            # K: updates per server step
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.checkpoint_every = 50
  config.dataset = dict(name='digits', num_clients=100, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name='fedbuff',
      concurrency=30,                # M: clients training at once
      max_staleness=16,
      staleness_weighting='polynomial', staleness_exponent=0.5,
      client_durations=dict(name='lognormal', median=60.0, sigma=1.0),
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=1.0))
  return config
