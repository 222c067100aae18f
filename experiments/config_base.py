"""The base of every experiment config: the runner's fields with defaults.

Config files in ``configs/`` start from :func:`base_config` and set what
their experiment needs::

  def get_config():
    config = base_config()
    config.rounds = 100
    config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
    ...
    return config

Optional integers are ``ml_collections`` placeholders, so they can be set
from the command line (``--config.local_steps=5``) although they default to
None.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections import config_dict

from fedjx.experiments import runner

_OPTIONAL_TYPES = {'local_epochs': int, 'local_steps': int,
                   'max_local_steps': int, 'chunk_size': int}


def base_config(**overrides: Any) -> ml_collections.ConfigDict:
  """A ConfigDict with every runner field at its default (see ``runner.DEFAULTS``).

  ``dataset``, ``model`` and ``algorithm`` start empty (``name=''``); set them.
  """
  config = ml_collections.ConfigDict()
  for key, value in runner.DEFAULTS.items():
    if value is None:
      value = config_dict.placeholder(_OPTIONAL_TYPES.get(key, int))
    setattr(config, key, value)
  for key in runner.REQUIRED:
    setattr(config, key, ml_collections.ConfigDict({'name': ''}))
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


def optimizer(name: str, **kwargs: Any) -> ml_collections.ConfigDict:
  """An optimizer spec: ``optimizer('sgd', learning_rate=0.1)``."""
  return ml_collections.ConfigDict(dict(name=name, **kwargs))
