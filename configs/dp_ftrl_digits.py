"""DP-FTRL with momentum (Kairouz et al. 2021) on digits, 500 clients.

Each round 50 clients train; their updates are clipped to L2 norm 1 and
summed, and the server releases the noisy prefix sum of all rounds' sums
through a binary tree whose nodes each carry N(0, (z C)^2) noise (z = 5.7):
a release at round t carries popcount(t) node noises. The aggregate is the
difference of consecutive releases over D = 50, and server SGD with
heavy-ball momentum 0.9 on it is the paper's DP-FTRLM:
x_t = x_0 - lr V_t / D with V_t = 0.9 V_(t-1) + s_t. The tree restarts every
10 rounds, one pass over the 500 clients (the paper restarts at epoch
boundaries). The releases are Honaker's efficient estimates of the prefix
sums (efficient=True: less noise, the same privacy). DP-FTRL needs no
sampling: the guarantee holds for any rule that bounds how often one client
takes part between restarts; here shuffled epochs
(``sampling=dict(name='epochs')``) take each client at most once per epoch,
so each tree holds a client at most once (``docs/privacy.md``).

Over 300 rounds (30 epochs, one tree each), z = 5.7 gives epsilon = 8.0 at
delta = 500^-1.1 (RDP; the run's metrics report it, and
``fedjx.algorithms.privacy.accounting.noise_multiplier_for_epsilon`` calibrates z for
another budget, see docs/privacy.md); 77% test accuracy after 300 rounds
(DP-FTRL pays for needing no sampling with 3 to 6 times the noise).
"""

from fedjx.experiments.config_base import base_config, optimizer


def get_config():
  config = base_config()
  config.rounds = 300
  config.cohort_size = 50
  config.batch_size = 10
  config.local_epochs = 1
  config.eval_every = 10
  config.dataset = dict(name='digits', num_clients=500, alpha=0.5)
  config.model = dict(name='mlp', hidden=(128,))
  config.sampling = dict(name='epochs')  # each client once per 10-round epoch
  config.algorithm = dict(
      name='fedavg',
      client_optimizer=optimizer('sgd', learning_rate=0.1),
      server_optimizer=optimizer('sgd', learning_rate=1.0, momentum=0.9),
      aggregator=dict(name='tree_gaussian', clip_norm=1.0, noise_multiplier=5.7,
                      restart_every=10, expected_clients_per_round=50.0,
                      efficient=True))
  return config
