"""FedAvg with learning-rate schedules across rounds, on the quickstart's digits.

Papers' FedAvg baselines often decay the client learning rate from round to
round and anneal the server's. Both are hyperparameter schedules of the
round number (``algorithm.hparam_schedules``,
:mod:`fedjx.algorithms.schedules`): before round ``t`` the server sets

    client learning rate  0.3 * 0.99^t                    (exponential decay)
    server learning rate  2.0 * (0.1 + 0.9 (1 + cos(pi t / T)) / 2)
                                                      (cosine, T = rounds)

and the metrics report the values used (``hparam/<path>``). Everything else
is ``configs/fedavg_digits.py`` (its tuned constant rates 0.3 and 2.0 are
the schedules' starting values). The argument keeps one of the two,
``client_decay`` or ``server_cosine`` (default ``both``), optionally with
the client decay rate after a comma (``client_decay,0.98``; the schedule's
keys hold a ``/``, which ``--config`` overrides cannot name).

  fedjx-run --config configs/fedavg_schedules_digits.py --workdir runs/fedavg_schedules
  fedjx-run --config configs/fedavg_schedules_digits.py:client_decay,0.98 --workdir ...
"""

from fedjx.experiments.config_base import base_config, optimizer

VARIANTS = ('both', 'client_decay', 'server_cosine')


def get_config(arg: str = 'both'):
  variant, _, rate = arg.partition(',')
  if variant not in VARIANTS:
    raise ValueError(f'fedavg_schedules_digits: variant={variant!r} is not one '
                     f'of {VARIANTS}.')
  decay_rate = float(rate) if rate else 0.99
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
  schedules = {}
  if variant in ('both', 'client_decay'):
    schedules['client_optimizer/learning_rate'] = dict(
        name='exponential_decay', init_value=0.3, transition_steps=1,
        decay_rate=decay_rate)
  if variant in ('both', 'server_cosine'):
    schedules['server_optimizer/learning_rate'] = dict(
        name='cosine_decay_schedule', init_value=2.0,
        decay_steps=config.rounds, alpha=0.1)
  config.algorithm = dict(
      name='fedavg',
      client_optimizer=optimizer('sgd', learning_rate=0.3),
      server_optimizer=optimizer('sgd', learning_rate=2.0),
      hparam_schedules=schedules)
  return config
