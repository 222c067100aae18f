"""Loading experiment config files in tests.

A config file is loaded from its path under a module name of its own, never
imported by name: a module imported as, say, ``config_file`` would stay in
``sys.modules`` and stand in for another test module's file of that name.
"""

import importlib.util
import os


def load(path, arg=None):
  """``get_config(arg)`` (or ``get_config()``) of the config file at ``path``."""
  path = os.fspath(path)
  name = '_config_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()
