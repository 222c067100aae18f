"""The Flower App directory that ``flwr run`` submits for fedjx rounds.

A Flower App is a directory with a ``pyproject.toml`` naming its ServerApp
and ClientApp; ``flwr run`` packs it (a FAB) and the SuperLink hands it to
the server and the nodes, which load :mod:`fedjx.experiments.deploy.apps`
from the fedjx installed there. This module imports neither JAX nor Flower, so launchers
can write the App before anything heavy starts.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from typing import Any

__all__ = ['RUN_CONFIG_DEFAULTS', 'write_app']

# The ServerApp's run config and its defaults (fedjx.experiments.deploy.apps.Settings).
RUN_CONFIG_DEFAULTS = {'config': '', 'overrides': '', 'workdir': '',
                       'timeout': 120.0, 'wait-s': 120.0,
                       'min-available-nodes': 0}

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedjx-flower"
version = "{version}"
description = "fedjx rounds on Flower: server_prepare and server_update on the server, client_work on the nodes"
license = "Apache-2.0"
# The server and every node need fedjx installed with its flower extra
# (pip install -e '.[flower]' from a checkout).
dependencies = []

[tool.flwr.app]
publisher = "fedjx"

[tool.flwr.app.components]
serverapp = "fedjx.experiments.deploy.apps:server_app"
clientapp = "fedjx.experiments.deploy.apps:client_app"

[tool.flwr.app.config]
{config}
"""


def _version() -> str:
  try:
    return metadata.version('fedjx')
  except metadata.PackageNotFoundError:
    return '0.0.0'


def _toml_value(value: Any) -> str:
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (int, float)):
    return repr(value)
  return json.dumps(str(value))


def write_app(directory: str, **run_config: Any) -> str:
  """Writes the App's ``pyproject.toml`` into ``directory`` (created if
  needed) with ``run_config`` as the run config's defaults (``wait_s`` is
  written ``wait-s``); returns ``directory``.

  Raises:
    ValueError: a key that is not one of :data:`RUN_CONFIG_DEFAULTS`.
  """
  values = dict(RUN_CONFIG_DEFAULTS)
  for key, value in run_config.items():
    name = key.replace('_', '-')
    if name not in values:
      raise ValueError(f'write_app: {key}={value!r} is not a run config key; the '
                       f'keys are {sorted(RUN_CONFIG_DEFAULTS)}.')
    values[name] = type(RUN_CONFIG_DEFAULTS[name])(value)
  lines = '\n'.join(f'{k} = {_toml_value(v)}' for k, v in values.items())
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'pyproject.toml'), 'w', encoding='utf-8') as f:
    f.write(PYPROJECT.format(version=_version(), config=lines))
  return directory
