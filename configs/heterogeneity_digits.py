"""Unreliable clients on digits: one population, one system model, five servers.

The heterogeneity study of docs/heterogeneity.md. 1,438 training images of
scikit-learn's digits over 500 clients (Dirichlet label skew alpha = 0.5:
2-3 images each), an MLP with 128 hidden units, 10 local SGD steps of batch
2 per round (data repeated). The system model (fedjx.datasets.systems):

* diurnal availability: client i is available while
  sin(2 pi (t / 24 h + phi_i)) > 0.3, about 40% of the population at any
  time, each client in its own hours (Bonawitz et al. 2019);
* 10% of the sampled clients drop out;
* a local step takes 2 s times a log-normal factor exp(z_i), z_i ~ N(0, 1)
  (the slowest client of 20 is typically ~7x the median), with a per-round
  jitter exp(0.3 z); the model (39 kB) goes down and the update up at
  20 kB/s (about 4 s).

The argument picks the server:

* ``fedavg_wait`` (default): FedAvg, 20 clients, waits for every report;
* ``fedavg_deadline``: FedAvg over-selecting 26 clients (30%) and closing
  the round at the first 20 reports or after 45 s, late clients dropped
  (Bonawitz et al. 2019);
* ``fedavg_partial``: FedAvg, 20 clients, 30 s deadline, late clients send
  the steps they finished;
* ``fednova_partial``: the same system with FedNova (Wang et al. 2020), which
  normalizes the partial clients' updates by their steps;
* ``fedbuff``: FedBuff (Nguyen et al. 2022): 20 clients train at once, the
  server steps at every 10 buffered updates (staleness weight
  1 / sqrt(1 + tau), updates over 16 steps stale dropped). The system model
  gives its clients' durations only: its schedule samples among idle clients
  (availability is not applied) and no client drops out.

  fedjx-run --config configs/heterogeneity_digits.py:fedavg_wait \\
      --workdir runs/hetero/fedavg_wait
"""

from fedjx.experiments.config_base import base_config, optimizer

SYSTEMS = dict(
    availability=dict(kind='diurnal', day_hours=24.0, threshold=0.3),
    dropout=dict(p=0.1),
    speed=dict(step_seconds=2.0, sigma=1.0, jitter=0.3, bandwidth=20_000.0))

METHODS = {
    'fedavg_wait': ('fedavg', 20, dict()),
    'fedavg_deadline': ('fedavg', 26, dict(seconds=45.0, reports=20,
                                           late='drop')),
    'fedavg_partial': ('fedavg', 20, dict(seconds=30.0, late='partial')),
    'fednova_partial': ('fednova', 20, dict(seconds=30.0, late='partial')),
    'fedbuff': ('fedbuff', 10, dict()),
}
FEDBUFF = dict(concurrency=20, max_staleness=16,
               staleness_weighting='polynomial', staleness_exponent=0.5)


def get_config(method: str = 'fedavg_wait'):
  if method not in METHODS:
    raise ValueError(f'heterogeneity_digits: method={method!r} is not one of '
                     f'{sorted(METHODS)}.')
  algorithm, cohort_size, deadline = METHODS[method]
  config = base_config()
  config.seed = 0
  config.rounds = 300
  config.cohort_size = cohort_size
  config.batch_size = 2
  config.local_steps = 10
  config.eval_every = 5
  config.checkpoint_every = 100
  config.dataset = dict(name='digits', num_clients=500, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.algorithm = dict(
      name=algorithm, client_evaluation=False,
      client_optimizer=optimizer('sgd', learning_rate=0.05),
      server_optimizer=optimizer('sgd', learning_rate=1.0),
      **(FEDBUFF if algorithm == 'fedbuff' else {}))
  config.systems = dict(SYSTEMS, deadline=deadline)
  return config
