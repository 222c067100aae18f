"""The privacy-utility study (docs/privacy.md): one task, seven recipes.

``--config=configs/privacy_utility.py:DATASET,METHOD``, e.g.
``configs/privacy_utility.py:digits,dp_fedavg`` (the default). The task:
500 clients, 50 per round, 100 rounds, softmax regression, one local epoch
of batches of 10, delta = 500^-1.1, on

* ``digits``: scikit-learn's 1,797 digits over 500 clients (Dirichlet 0.5
  label skew), client SGD 0.1;
* ``synthetic``: Synthetic-IID of Li et al. 2020 over 500 clients of at most
  100 examples, client SGD 0.5 (with the non-IID Synthetic(alpha, beta) one
  softmax model stays near 30% accuracy at this population, too low to show
  what the noise costs).

The methods (``scripts/privacy_utility.py`` sets each noise multiplier for a
target epsilon with ``fedjx.algorithms.privacy.accounting``):

* ``fedavg``: FedAvg (McMahan et al. 2017), server SGD 1.0, uniform cohorts;
  non-private.
* ``fedavgm``: FedAvg with DP-FTRLM's server (SGD 0.5, momentum 0.9) and
  cohorts (shuffled epochs); non-private, DP-FTRLM's epsilon = infinity.
* ``dp_fedavg``: DP-FedAvg (McMahan et al. 2018): Poisson sampling q = 0.1,
  clip 0.5, ``N(0, (z C)^2 I)`` on the sum, divided by q N = 50; z = 1.2 is
  epsilon 4.0 after 100 rounds (RDP).
* ``adaptive_clip``: the same with adaptive clipping (Andrew et al. 2021):
  the clip starts at 0.1 and follows the median norm (step 0.2, count noise
  q N / 20); ``noise_multiplier`` is the total z, accounted like DP-FedAvg's.
* ``dp_ftrl``: DP-FTRLM (Kairouz et al. 2021): no sampling assumed; shuffled
  epochs of 10 rounds take each client at most once per epoch and the tree
  restarts every epoch; Honaker's efficient estimates (``efficient=True``);
  server SGD 0.5 with momentum 0.9. Without amplification, the same epsilon
  needs a noise multiplier 4 to 6 times DP-FedAvg's (z = 5.7 for epsilon 4).
* ``dp_fedadam``: FedAdam's server (Reddi et al. 2021: learning rate 0.01,
  beta1 0.9, beta2 0.99, tau 1e-3) on DP-FedAvg's Gaussian aggregator, a
  post-processing of it, so accounted the same.
"""

from fedjx.experiments.config_base import base_config, optimizer

POPULATION, COHORT, ROUNDS = 500, 50, 100
DATASETS = {
    'digits': dict(name='digits', num_clients=POPULATION, alpha=0.5),
    'synthetic': dict(name='synthetic', alpha=0.0, beta=0.0, iid=True,
                      num_clients=POPULATION, max_examples=100),
}
CLIENT_LR = {'digits': 0.1, 'synthetic': 0.5}  # FedAvg's best of {0.1, 0.5}
METHODS = ('fedavg', 'fedavgm', 'dp_fedavg', 'adaptive_clip', 'dp_ftrl',
           'dp_fedadam')


def algorithm(method, client):
  """``config.algorithm`` and ``config.sampling`` of ``method``."""
  sgd = lambda lr, **kw: optimizer('sgd', learning_rate=lr, **kw)
  gaussian = dict(clip_norm=0.5, noise_multiplier=1.2,
                  expected_clients_per_round=float(COHORT))
  return {
      'fedavg': (dict(name='fedavg', client_optimizer=client,
                      server_optimizer=sgd(1.0)), 'uniform'),
      'fedavgm': (dict(name='fedavg', client_optimizer=client,
                       server_optimizer=sgd(0.5, momentum=0.9)), 'epochs'),
      'dp_fedavg': (dict(name='dp_fedavg', client_optimizer=client,
                         server_optimizer=sgd(1.0), **gaussian), 'poisson'),
      'adaptive_clip': (dict(
          name='fedavg', client_optimizer=client, server_optimizer=sgd(1.0),
          aggregator=dict(name='adaptive_gaussian', noise_multiplier=1.2,
                          initial_clip_norm=0.1, target_quantile=0.5,
                          clip_learning_rate=0.2,
                          expected_clients_per_round=float(COHORT))),
                        'poisson'),
      'dp_ftrl': (dict(
          name='fedavg', client_optimizer=client,
          server_optimizer=sgd(0.5, momentum=0.9),
          aggregator=dict(name='tree_gaussian', clip_norm=0.5,
                          noise_multiplier=5.7, restart_every=10,
                          expected_clients_per_round=float(COHORT),
                          efficient=True)), 'epochs'),
      'dp_fedadam': (dict(
          name='fedadam', client_optimizer=client, server_learning_rate=0.01,
          b1=0.9, b2=0.99, eps=1e-3,
          aggregator=dict(name='gaussian', **gaussian)), 'poisson'),
  }[method]


def get_config(arg='digits,dp_fedavg'):
  dataset, _, method = arg.partition(',')
  if dataset not in DATASETS or method not in METHODS:
    raise ValueError(f'privacy_utility.py: arg={arg!r}; give DATASET,METHOD '
                     f'with DATASET in {tuple(DATASETS)} and METHOD in '
                     f'{METHODS}.')
  config = base_config()
  config.rounds = ROUNDS
  config.cohort_size = COHORT
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 20
  config.checkpoint_every = ROUNDS
  config.dataset = dict(DATASETS[dataset])
  config.model = dict(name='logistic_regression')
  config.privacy = dict(delta=POPULATION ** -1.1, accountant='rdp',
                        target_epsilon=None)
  alg, sampling = algorithm(
      method, optimizer('sgd', learning_rate=CLIENT_LR[dataset]))
  config.sampling = dict(name=sampling)
  config.algorithm = alg
  return config
