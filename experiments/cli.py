"""Command-line entry point: ``fedjx-run`` and ``python scripts/run.py``.

::

  fedjx-run --config configs/fedavg_digits.py --workdir runs/quickstart \
      --config.rounds=100 --config.algorithm.client_optimizer.learning_rate=0.05

``--config`` is an ``ml_collections`` config file (``get_config()``); every
field can be overridden with ``--config.<path>=<value>``. An unknown field
stops with the list of valid fields; an unknown algorithm, dataset or model
name with the list of valid names. Running again with the same ``--workdir``
resumes from its latest checkpoint. SIGINT (Ctrl-C) saves a checkpoint after
the current round and exits with status 130.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Sequence

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file (a Python file with get_config()).',
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Directory for checkpoints, metrics, event files and plots '
    '(default: runs/<config file name>).')

_OVERRIDE = re.compile(r'^--?config\.([A-Za-z0-9_.]+)(=|$)')
INTERRUPTED_STATUS = 130


def _load_config_file(spec: str):
  path, _, arg = spec.partition(':')
  if not os.path.exists(path):
    raise app.UsageError(f'--config={spec!r}: no such file {path!r}.')
  module_spec = importlib.util.spec_from_file_location('_fedjx_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, 'get_config'):
    raise app.UsageError(f'--config={spec!r}: {path} defines no get_config().')
  return module.get_config(arg) if arg else module.get_config()


def check_overrides(argv: Sequence[str]) -> None:
  """Fails with the valid fields when ``--config.<path>`` names no field."""
  spec = None
  for i, arg in enumerate(argv):
    if arg.startswith(('--config=', '-config=')):
      spec = arg.split('=', 1)[1]
    elif arg in ('--config', '-config') and i + 1 < len(argv):
      spec = argv[i + 1]
  if spec is None:
    return
  config = _load_config_file(spec)
  for arg in argv:
    match = _OVERRIDE.match(arg)
    if not match:
      continue
    node, walked = config, 'config'
    for part in match.group(1).split('.'):
      keys = list(node.keys()) if hasattr(node, 'keys') else []
      if part not in keys:
        from fedjx.experiments import registry  # pylint: disable=g-import-not-at-top
        raise app.UsageError(
            f'unknown config field {walked}.{part} (in {arg}).'
            f'{registry._suggest(part, keys)} Valid fields of {walked}: '  # pylint: disable=protected-access
            f'{sorted(keys)}.')
      node, walked = node[part], f'{walked}.{part}'


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl flag parsing, after checking ``--config.*`` overrides name fields."""
  try:
    check_overrides(argv[1:])
    return flags.FLAGS(argv)
  except (app.UsageError, flags.Error) as e:
    print(f'fedjx-run: {e}', file=sys.stderr)
    sys.exit(2)


def _main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}; settings go in '
                         '--config.<field>=<value>.')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  config = _CONFIG.value
  if config is None:
    raise app.UsageError('--config is required, e.g. --config '
                         'configs/fedavg_digits.py.')
  workdir = _WORKDIR.value
  if workdir is None:
    name = os.path.splitext(os.path.basename(
        flags.FLAGS['config'].config_filename))[0]
    workdir = os.path.join('runs', name)
  from fedjx.experiments import registry  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import runner  # pylint: disable=g-import-not-at-top
  try:
    result = runner.run(config, workdir)
  except registry.ConfigError as e:
    print(f'fedjx-run: {e}', file=sys.stderr)
    return 2
  if result.interrupted:
    return INTERRUPTED_STATUS
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() != 0:
    return 0
  summary = result.history[-1] if result.history else {}
  shown = {k: v for k, v in summary.items()
           if k.startswith('eval_') or k in ('round', 'elapsed_s')}
  print(' '.join(f'{k}={v:.4f}' if isinstance(v, float) else f'{k}={v}'
                 for k, v in shown.items()))
  print(f'fedjx-run: done; metrics, checkpoints and learning_curve.png in '
        f'{result.workdir}')
  return 0


def main() -> None:
  """Console-script entry point."""
  app.run(_main, flags_parser=parse_flags)


if __name__ == '__main__':
  main()
