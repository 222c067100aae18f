"""Command-line entry point of sweeps: ``fedjx-sweep`` and ``python scripts/sweep.py``.

::

  fedjx-sweep --config configs/fedadam_digits.py --workdir runs/grid \\
      --sweep 'algorithm.server_learning_rate=0.003,0.01,0.03,0.1,0.3' \\
      --seeds 0,1,2 --target eval_accuracy=0.9

``--sweep FIELD=V1,V2,...`` (repeatable) makes a grid; ``--sweep
FIELD=loguniform(LOW,HIGH)`` / ``uniform(...)`` / ``choice(...)`` with
``--num_samples N`` makes a random search. A config file may instead define
``get_sweep()`` returning ``{'sweep': [...axis strings...], 'seeds': '0,1,2',
'num_samples': None, 'target': 'eval_accuracy=0.9'}``; flags given on the
command line take precedence. ``--config.<field>=<value>`` overrides the base
config as for ``fedjx-run``. Running again with the same ``--workdir``
resumes; with more values of the swept fields or more seeds it extends the
sweep, training only the new trials (:mod:`fedjx.experiments.sweeps.record`). Errors are one line with exit status 2 (``--debug`` or
``FEDJX_DEBUG=1`` shows the traceback); SIGINT/SIGTERM save checkpoints and
exit with status 130/143. The shared command-line machinery is
:mod:`fedjx.experiments.cli`'s: ``--config``, ``--workdir``, ``--debug`` and
``--config.PATH=VALUE`` (also for builder and optimizer options the file does
not set) mean what they mean for ``fedjx-run``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags
from absl import logging

from fedjx.experiments import cli
from fedjx.experiments import workdir as workdir_lib
from fedjx.experiments.sweeps import spec

_SWEEP = flags.DEFINE_multi_string(
    'sweep', None, "A swept field: 'FIELD=V1,V2,...' (grid) or "
    "'FIELD=loguniform(LOW,HIGH)' (random search). Repeatable.")
_SEEDS = flags.DEFINE_string('seeds', None, "Seeds of every setting: '0,1,2' or '0-4'.")
_NUM_SAMPLES = flags.DEFINE_integer(
    'num_samples', None, 'Random search: how many settings to draw.')
_SAMPLE_SEED = flags.DEFINE_integer(
    'sample_seed', None, 'Random search: the seed of the draws.')
_PER_PROGRAM = flags.DEFINE_integer(
    'settings_per_program', None,
    'At most this many settings (x every seed) per compiled program.')
_METRIC = flags.DEFINE_string(
    'metric', None, 'Main metric of summary.md and the plots (default: '
    'eval_accuracy, else eval_loss, else a training loss).')
_TARGET = flags.DEFINE_string(
    'target', None, "Rounds to reach e.g. 'eval_accuracy=0.9' (in the summary).")

USAGE = """\
fedjx-sweep: trains a grid (or random search) of settings x seeds of a config,
vectorized into one compiled program wherever only traced hyperparameters
and seeds differ.

usage: fedjx-sweep --config FILE[:ARG] [--workdir DIR] [--sweep FIELD=VALUES ...]
                   [--seeds 0,1,2] [--num_samples N] [--target METRIC=NUMBER]
                   [--metric METRIC] [--settings_per_program K]
                   [--config.PATH=VALUE ...] [--fresh [--yes]] [--debug]

  --sweep FIELD=V1,V2,...           a grid axis (repeatable)
  --sweep 'FIELD=loguniform(LO,HI)' a random-search axis (also uniform(),
                                    choice()); needs --num_samples
  --seeds 0,1,2 | 0-4               every setting runs with every seed
  --target eval_accuracy=0.9        rounds-to-target in the summary
  --workdir DIR                     default runs/<config name>_sweep; the
                                    same DIR again resumes, or with more
                                    values or seeds extends, the sweep
  --fresh [--yes]                   start over: removes what a sweep wrote
                                    in DIR (named, asked on a terminal)

A config file may define get_sweep() returning {'sweep': [...], 'seeds':
..., 'num_samples': ..., 'target': ...}; flags take precedence.

example:
  fedjx-sweep --config configs/fedadam_digits.py --workdir runs/grid \\
      --sweep 'algorithm.server_learning_rate=0.01,0.03,0.1' --seeds 0,1,2

The configs and algorithms there are to sweep: fedjx-run --list.

exit status: 0 done; 2 a usage, config or sweep error, a workdir in use or
that cannot be written, or --fresh not confirmed; 130/143 stopped by
Ctrl-C/SIGTERM (run the same command again to continue).
"""

SWEEP_KEYS = ('sweep', 'seeds', 'num_samples', 'sample_seed', 'target')


def sweep_arguments(config_path: str) -> dict[str, Any]:
  """The sweep of the command line, completed by the config's ``get_sweep()``."""
  module = cli.load_module(config_path, '_fedjx_sweep_config')
  defaults = {}
  if hasattr(module, 'get_sweep'):
    defaults = cli.call_in_config_file(config_path, module, 'get_sweep')
    if not isinstance(defaults, Mapping):
      got = 'None' if defaults is None else f'a {type(defaults).__name__}'
      raise spec.SweepError(
          f'get_sweep() in {config_path.partition(":")[0]} returned {got}; it '
          f'must return a dict with keys among {sorted(SWEEP_KEYS)}.')
    defaults = dict(defaults)
  unknown = set(defaults) - set(SWEEP_KEYS)
  if unknown:
    raise spec.SweepError(
        f'get_sweep() in {config_path} returns unknown keys {sorted(unknown)}; '
        f'valid: {sorted(SWEEP_KEYS)}.')
  pick = lambda flag, key, default: (flag.value if flag.present
                                     else defaults.get(key, default))
  return {'sweep': list(pick(_SWEEP, 'sweep', []) or []),
          'seeds': pick(_SEEDS, 'seeds', '0'),
          'num_samples': pick(_NUM_SAMPLES, 'num_samples', None),
          'sample_seed': pick(_SAMPLE_SEED, 'sample_seed', 0),
          'target': pick(_TARGET, 'target', None)}


def _sweep(argv: Sequence[str], extras: Sequence[Any]) -> int:
  if len(argv) > 1:
    raise cli.UsageError(f'unexpected arguments {argv[1:]} (see --help).')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  config = flags.FLAGS['config'].value
  if config is None:
    raise cli.UsageError('--config is required, e.g. --config '
                         'configs/fedadam_digits.py (see --help).')
  cli.apply_overrides(config, extras)
  config_path = flags.FLAGS['config'].config_filename
  workdir = flags.FLAGS['workdir'].value or os.path.join(
      'runs', os.path.splitext(os.path.basename(config_path.partition(':')[0]))[0]
      + '_sweep')
  cli.prepare_workdir(workdir, config, workdir_lib.SWEEP_OUTPUTS, 'fedjx-sweep')
  cli.quiet_orbax()
  from fedjx.experiments.sweeps import run  # deferred: before JAX (usage errors, config checks)
  args = sweep_arguments(config_path)
  axes = [spec.parse_axis(a) for a in args['sweep']]
  settings = spec.settings(axes, args['num_samples'], args['sample_seed'])
  seeds = spec.parse_seeds(str(args['seeds']))
  result = run.run_sweep(config, workdir, settings, seeds, target=args['target'],
                         settings_per_program=_PER_PROGRAM.value,
                         metric=_METRIC.value)
  if result.interrupted:
    return 128 + (result.signal or signal.SIGINT)
  print(f'fedjx-sweep: done; {len(result.trials)} trials in {result.groups} '
        f'program(s); summary.md, summary.csv and plots in {result.workdir}')
  return 0


def main() -> None:
  """Console-script entry point."""
  cli.main('fedjx-sweep', _sweep, USAGE)


if __name__ == '__main__':
  main()
