"""The base of every experiment config: the runner's fields with defaults.

Config files in ``configs/`` start from :func:`base_config` and set what
their experiment needs::

  def get_config():
    config = base_config()
    config.rounds = 100
    config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
    ...
    return config

Fields that default to None are typed ``ml_collections`` placeholders, so
they can be set from the command line (``--config.local_steps=5``,
``--config.privacy.target_epsilon=8``) although they read as None.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections import config_dict

from fedjx.experiments import config as config_schema

def _typed(value: Any, path: str) -> Any:
  """``value``, with each None (at ``path``, nested) a typed placeholder."""
  if isinstance(value, dict):
    return ml_collections.ConfigDict(
        {k: _typed(v, f'{path}.{k}') for k, v in value.items()})
  if value is None and path in config_schema.OPTIONAL_TYPES:
    return config_dict.placeholder(config_schema.OPTIONAL_TYPES[path])
  return value


def base_config(**overrides: Any) -> ml_collections.ConfigDict:
  """A ConfigDict with every runner field at its default (see ``fedjx.experiments.config.DEFAULTS``).

  ``dataset``, ``model`` and ``algorithm`` start empty (``name=''``); set them.
  Fields whose default is None are placeholders of their type
  (``config.OPTIONAL_TYPES``): they read as None and can be set from the
  command line (``--config.privacy.target_epsilon=8``).
  """
  config = ml_collections.ConfigDict()
  for key, value in config_schema.DEFAULTS.items():
    setattr(config, key, _typed(value, key))
  for key in config_schema.REQUIRED:
    setattr(config, key, ml_collections.ConfigDict({'name': ''}))
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


def optimizer(name: str, **kwargs: Any) -> ml_collections.ConfigDict:
  """An optimizer spec: ``optimizer('sgd', learning_rate=0.1)``."""
  return ml_collections.ConfigDict(dict(name=name, **kwargs))


# Reddi et al. 2021, "Adaptive Federated Optimization" (ICLR), Table 8: the
# best client and server learning rates (log10) per task and algorithm, with
# server beta1 = 0.9, beta2 = 0.99, tau (eps) = 1e-3, and server momentum 0.9
# for FedAvgM. Entries are (log10 client lr, log10 server lr).
REDDI_2021_LEARNING_RATES = {
    'emnist': {'fedadagrad': (-1.5, -1.0), 'fedadam': (-1.5, -2.5),
               'fedyogi': (-1.5, -2.5), 'fedavgm': (-1.5, 0.0),
               'fedavg': (-1.0, 0.0)},
    'shakespeare': {'fedadagrad': (0.0, -0.5), 'fedadam': (0.0, -2.0),
                    'fedyogi': (0.0, -2.0), 'fedavgm': (0.0, 0.0),
                    'fedavg': (0.0, 0.0)},
    'stackoverflow': {'fedadagrad': (-0.5, -1.5), 'fedadam': (-0.5, -2.0),
                      'fedyogi': (-0.5, -2.0), 'fedavgm': (-0.5, 0.0),
                      'fedavg': (-0.5, 0.0)},
    'cifar100': {'fedadagrad': (-1.0, -1.0), 'fedadam': (-1.5, 0.0),
                 'fedyogi': (-1.5, 0.0), 'fedavgm': (-1.5, 0.0),
                 'fedavg': (-1.0, 0.0)},
}


def fedopt_algorithm(task: str, name: str) -> ml_collections.ConfigDict:
  """``config.algorithm`` for FedOpt ``name`` with Reddi et al.'s rates on ``task``.

  Args:
    task: a key of :data:`REDDI_2021_LEARNING_RATES`.
    name: ``'fedavg'``, ``'fedavgm'``, ``'fedadagrad'``, ``'fedadam'`` or
      ``'fedyogi'``.
  """
  table = REDDI_2021_LEARNING_RATES[task]
  if name not in table:
    raise ValueError(f'algorithm {name!r} has no tuned rates for {task!r}; '
                     f'valid: {sorted(table)}.')
  client_lr, server_lr = (10.0 ** e for e in table[name])
  algorithm = ml_collections.ConfigDict(dict(
      name=name, client_optimizer=optimizer('sgd', learning_rate=client_lr)))
  if name == 'fedavg':
    algorithm.server_optimizer = optimizer('sgd', learning_rate=server_lr)
  elif name == 'fedavgm':
    algorithm.server_learning_rate = server_lr
    algorithm.server_momentum = 0.9
  else:
    algorithm.server_learning_rate = server_lr
    algorithm.b1 = 0.9
    algorithm.eps = 1e-3
    if name != 'fedadagrad':
      algorithm.b2 = 0.99
  return algorithm


def smoke_sized(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` shrunk in place to a round that still exercises all its code.

  Two local steps of batch 4 (one epoch, capped), 64 evaluation examples,
  and for the text task a one-layer model of width 16 on 16-token sequences
  of one module: what the config smoke tests run and what
  ``scripts/compile_times.py --small`` compiles. Returns ``config``.
  """
  if config.dataset.name == 'text':
    config.dataset.modules = ('json',)
    config.dataset.seq_len = 16
    config.local_steps = 2
    config.model.width = 16
    config.model.num_layers = 1
  config.local_epochs = None if config.local_steps else 1
  config.max_local_steps = 2
  config.batch_size = 4
  config.eval_max_examples = 64
  return config
