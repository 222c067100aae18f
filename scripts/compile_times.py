"""Compile time of each offline config's round: one JSON line per config.

For every config in ``configs/`` whose dataset is built offline (digits,
synthetic, text), builds the experiment as ``fedjx-run`` does, takes the round
the runner runs first (``experiment.round_algorithms``: unguarded where that is
cheaper) and times ``round.lower(state, cohort, key)`` (tracing) and
``.compile()`` (XLA) separately on the first cohort. Nothing runs. Each line
holds the config, algorithm, model, cohort size and the two times in seconds.

  python scripts/compile_times.py                      # every offline config
  python scripts/compile_times.py diloco_text streaming_diloco_text
  python scripts/compile_times.py --small              # shrunk as tests/test_configs.py
  python scripts/compile_times.py --against_base --repeats=4 dp_fedavg_digits

``--against_base`` also compiles each private config's non-private twin (the
same config with the plain algorithm and aggregator: ``dp_fedavg`` becomes
``fedavg``, a DP ``aggregator`` is dropped, no budget or audit), alternating
the two ``--repeats`` times, and adds the median ratio to each line.

The jit cache is per process and per program, so each config compiles from
scratch; a persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) would
make the times meaningless and is switched off here.
"""

import argparse
import copy
import glob
import importlib.util
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = ('digits', 'synthetic', 'text')


def load(path):
  name = '_config_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# The options that make an algorithm private, dropped in its base twin.
PRIVATE_OPTIONS = ('clip_norm', 'noise_multiplier', 'expected_clients_per_round',
                   'aggregator', 'canaries')


def base_twin(config):
  """The non-private version of a private config, or None for the others."""
  spec = dict(config.algorithm)
  if spec['name'] != 'dp_fedavg' and 'aggregator' not in spec:
    return None
  twin = copy.deepcopy(config)
  for key in PRIVATE_OPTIONS:
    spec.pop(key, None)
  spec['name'] = 'fedavg' if spec['name'] == 'dp_fedavg' else spec['name']
  twin.algorithm = spec
  twin.privacy = dict(delta=None, accountant='rdp', target_epsilon=None, audit=None)
  return twin


def measure(name, config):
  import jax  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import config as config_lib  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import experiment  # pylint: disable=import-outside-toplevel
  config = config_lib.validate(config)
  t = time.perf_counter()
  exp = experiment.build(config)
  guarded, unguarded = experiment.round_algorithms(config, exp)
  algorithm = unguarded or guarded
  state = exp.algorithm.init(exp.init_params)
  cohort = next(iter(exp.cohorts(0, 1)))
  build_s = time.perf_counter() - t
  t = time.perf_counter()
  lowered = algorithm.round.lower(state, cohort, exp.round_key_for(0))
  lower_s = time.perf_counter() - t
  t = time.perf_counter()
  lowered.compile()
  compile_s = time.perf_counter() - t
  jax.clear_caches()
  return {'config': name, 'algorithm': config.algorithm.name,
          'model': config.model.name, 'clients': int(config.cohort_size),
          'lower_s': round(lower_s, 2), 'compile_s': round(compile_s, 2),
          'total_s': round(lower_s + compile_s, 2), 'build_s': round(build_s, 2)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('configs', nargs='*',
                      help='config names (default: every offline config)')
  parser.add_argument('--small', action='store_true',
                      help='shrink each config as tests/test_configs.py does')
  parser.add_argument('--against_base', action='store_true',
                      help="compile each private config's non-private twin too")
  parser.add_argument('--repeats', type=int, default=1,
                      help='alternate config and twin this many times')
  args = parser.parse_args(argv)
  os.environ.pop('JAX_COMPILATION_CACHE_DIR', None)
  sys.path.insert(0, ROOT)
  paths = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))
  if args.configs:
    wanted = set(args.configs)
    paths = [p for p in paths if os.path.basename(p)[:-3] in wanted]
  for path in paths:
    config = load(path)
    if config.dataset.name not in OFFLINE:
      continue
    if args.small:
      from fedjx.experiments import config_base  # pylint: disable=import-outside-toplevel
      config = config_base.smoke_sized(config)
    name = os.path.basename(path)[:-3]
    twin = base_twin(config) if args.against_base else None
    if twin is None:
      print(json.dumps(measure(name, config)), flush=True)
      continue
    own, base = [], []
    for _ in range(args.repeats):
      own.append(measure(name, copy.deepcopy(config)))
      base.append(measure(name, copy.deepcopy(twin)))
    median = lambda rows: statistics.median(r['total_s'] for r in rows)
    line = dict(own[len(own) // 2], total_s=median(own),
                base_algorithm=base[0]['algorithm'], base_total_s=median(base),
                repeats=args.repeats)
    line['ratio_to_base'] = round(line['total_s'] / line['base_total_s'], 2)
    print(json.dumps(line), flush=True)


if __name__ == '__main__':
  main()
