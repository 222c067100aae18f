"""Distributed DP on digits: Skellam noise from every client inside a secure sum.

Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private
Federated Learning", NeurIPS 2021, on the simulated SecAgg of
:mod:`fedjx.algorithms.aggregators.secure` (Bonawitz et al. 2017; with
``neighbors`` set, SecAgg+ of Bell et al. 2020). 50 non-IID digits clients,
10 a round (fixed-size cohorts: replace-one neighbours, amplified by
sampling 10 of 50), an MLP with 128 hidden units. Each client clips its
update to 0.5, rotates it (shared Hadamard), scales it onto 16-bit integers,
rounds randomly, adds Skellam noise (its share of the sum's ``z = 1``) and
masks it; the server learns only the modular sum of the survivors. The
round's metrics carry ``ddp_epsilon`` (the RDP of the Skellam sum composed
over the rounds so far, at delta = 1e-5, for the run's own sampling: the
runner gives the aggregator ``config.sampling`` over the population, so
``--config.cohort_size=20`` is accounted as 20 of 50), the bits each client sends and
the protocol's costs. Dropouts come from ``config.systems`` (e.g.
``--config.systems="{'dropout': {'p': 0.1}}"``); a round in which a
survivor has fewer than ``threshold`` surviving neighbours fails and leaves
the model unchanged (``secagg_failed``).

  fedjx-run --config configs/secagg_ddp_digits.py --workdir runs/ddp16
  fedjx-run --config configs/secagg_ddp_digits.py \\
      --config.algorithm.aggregator.bits=12 --workdir runs/ddp12
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
      name='fedavg',
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=1.0),
      # clients_per_round (the scale's n) and sampling: the run's, from the
      # runner; the mean divides by the survivors.
      aggregator=dict(name='distributed_skellam', clip_norm=0.5,
                      noise_multiplier=1.0, bits=16, threshold=5,
                      neighbors=None, delta=1e-5))
  return config
