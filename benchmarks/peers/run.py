"""Runs the peer comparison: each framework's round script as a subprocess
in its own virtualenv, interleaved (fedjx, lax_map, fedjax, torch_loop,
pfl-research, flower, then again), appending each JSON line to ``--out``,
then prints the Markdown table (``--table`` re-prints it from ``--out``).

  python benchmarks/peers/run.py --repeats=2 --out=benchmarks/results/peers_cpu.jsonl

Virtualenvs come from ``setup.sh`` (``$FEDJX_PEERS_DIR``, default
``~/.cache/fedjx-peers``); fedjx's rounds run under ``--fedjx_python``
(default: this interpreter, which must have fedjx installed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ('fedjx', 'lax_map', 'fedjax', 'torch_loop', 'pfl-research', 'flower')
SCRIPTS = {'fedjx': ('fedjx', 'fedjx_round.py'), 'lax_map': ('fedjx', 'lax_map_round.py'),
           'fedjax': ('fedjax', 'fedjax_round.py'), 'torch_loop': ('pfl', 'torch_loop.py'),
           'pfl-research': ('pfl', 'pfl_round.py'), 'flower': ('flower', 'flower_round.py')}
CROSS_DEVICE_SETUPS = ('2nn-100', '2nn-1000', 'logreg', 'logreg-sparse')
_DENSE = ('2nn-100', '2nn-1000', '2nn-10000', 'logreg')
_ANY = _DENSE + ('logreg-sparse',)
# The cross-device suite (cross_device.py): its frameworks, each as
# (virtualenv, script, extra arguments, the setups it runs, the check's
# batching: 'data' order or FedJAX's 'wrap').
CROSS_DEVICE = {
    'fedjx': ('fedjx', 'fedjx_cross_device.py', (), _ANY, 'data'),
    # The loops of the documentation, with nothing of fedjx-run's.
    'fedjx_loop_on_device': ('fedjx', 'fedjx_loop_cross_device.py',
                             ('--loop=on_device',), _ANY, 'data'),
    'fedjx_loop_on_device_no_guard': ('fedjx', 'fedjx_loop_cross_device.py',
                                      ('--loop=on_device', '--no_guard'), _ANY, 'data'),
    'fedjx_loop_make_cohort': ('fedjx', 'fedjx_loop_cross_device.py',
                               ('--loop=make_cohort',), _ANY, 'data'),
    'handwritten_jax': ('fedjx', 'handwritten_cross_device.py', (), _ANY, 'data'),
    # The accelerator's floor (vmapped chunks of clients sorted by steps).
    'handwritten_jax_chunks': ('fedjx', 'handwritten_chunks_cross_device.py', (),
                               _ANY, 'data'),
    'fedjax': ('fedjax', 'fedjax_cross_device.py', (), _DENSE, 'wrap'),
    'torch_loop': ('pfl', 'torch_cross_device.py', ('--threads=1',), _ANY, 'data'),
    'torch_loop_default_threads': ('pfl', 'torch_cross_device.py', ('--threads=0',),
                                   _ANY, 'data'),
    # nn.EmbeddingBag(sparse=True): SGD on the gathered rows only.
    'torch_loop_sparse_grad': ('pfl', 'torch_cross_device.py',
                               ('--threads=1', '--sparse_grad'), ('logreg-sparse',),
                               'data'),
    'pfl-research': ('pfl', 'pfl_cross_device.py', (), _ANY, None),
    'flower': ('flower', 'flower_cross_device.py', (), _ANY, 'data'),
}


# Rows of fedjx and its hand-written floors: not peers.
FEDJX_ROWS = ('fedjx', 'fedjx_loop_on_device', 'fedjx_loop_on_device_no_guard',
              'fedjx_loop_make_cohort')
OURS = FEDJX_ROWS + ('handwritten_jax', 'handwritten_jax_chunks')


def _python(env: str, args) -> str:
  if env == 'fedjx':
    return args.fedjx_python
  return os.path.join(args.envs, env, 'bin', 'python')


def run_one(name: str, setup: str, rounds: int, args, cross_device: bool = False,
            check: str = '') -> dict:
  if cross_device:
    env, script, extra = CROSS_DEVICE[name][:3]
  else:
    (env, script), extra = SCRIPTS[name], ()
  python = _python(env, args)
  cmd = [python, os.path.join(HERE, script), f'--setup={setup}', f'--rounds={rounds}',
         *extra] + ([f'--check={check}'] if check else [])
  load = os.getloadavg()[0]
  t = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE,
                          timeout=args.timeout)
  except FileNotFoundError as e:
    return {'framework': name, 'setup': setup, 'error': f'{e}'}
  except subprocess.TimeoutExpired:
    return {'framework': name, 'setup': setup,
            'error': f'timed out after {args.timeout} s ({rounds} rounds)'}
  lines = [l for l in proc.stdout.splitlines() if l.startswith('{')]
  if proc.returncode or not lines:
    tail = [l for l in proc.stderr.strip().splitlines() if l.strip()][-1:]
    return {'framework': name, 'setup': setup, 'returncode': proc.returncode,
            'error': tail[0][:300] if tail else 'no output'}
  record = json.loads(lines[-1])
  record.update(process_wall_s=round(time.perf_counter() - t, 2),
                loadavg_1m_before=round(load, 2),
                date=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()))
  return record


def table(records: list[dict]) -> str:
  """One row per framework and setup: the median over repeats."""
  import statistics
  rows = ['| setup | framework | version | CPU s / round | vs fedjx | wall s / round | '
          'time to first round (s) | threads | runs x timed rounds |',
          '|---|---|---|---|---|---|---|---|---|']
  for setup in ('equal', 'skewed'):
    ok = [r for r in records if r.get('setup') == setup]
    def med(name, key):
      vals = [r[key] for r in ok if r['framework'] == name and r.get(key) is not None]
      return statistics.median(vals) if vals else None
    base = med('fedjx', 'cpu_s_per_round')
    for name in ORDER:
      mine = [r for r in ok if r['framework'] == name]
      if not mine:
        continue
      good = [r for r in mine if 'error' not in r]
      if not good:
        error = re.sub(r'\x1b\[[0-9;]*m|\\x1b\[[0-9;]*m', '', mine[-1]['error'])
        rows.append(f'| {setup} | {name} | | failed: `{error}` | | | | | |')
        continue
      cpu = med(name, 'cpu_s_per_round')
      ratio = f'{cpu / base:.2f}x' if base and cpu is not None else ''
      last = good[-1]
      threads = ', '.join(f'{k}={v}' for k, v in last['threads'].items()
                          if k not in ('xla_cpu_threads',) and v != '')
      note = ' (first round)' if last.get('measured_first_round') else ''
      strategy = f', {last["map_strategy"]}' if 'map_strategy' in last else ''
      rows.append(
          f'| {setup} | {name}{strategy} | {last["version"]} | {cpu:.2f}{note} | {ratio} | '
          f'{med(name, "wall_s_per_round"):.2f} | {med(name, "time_to_first_round_s"):.1f} | '
          f'{threads} | {len(good)} x {last["rounds"]} |')
  return '\n'.join(rows)


def check_round(name: str, setup: str, args) -> dict:
  """The framework's weights after one round in data order against
  cross_device.py's float64 NumPy round."""
  how = CROSS_DEVICE[name][4]
  if how is None:
    return {'framework': name, 'setup': setup, 'check': 'not run',
            'why': "shuffles as it batches; no data-order round to compare"}
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'weights.npz')
    record = run_one(name, setup, 1, args, cross_device=True, check=path)
    if 'error' in record:
      return dict(record, check='failed')
    cmd = [_python('fedjx', args), os.path.join(HERE, 'cross_device.py'), setup, path]
    proc = subprocess.run(cmd + (['--wrap'] if how == 'wrap' else []),
                          capture_output=True, text=True, cwd=HERE)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
  return dict(out, framework=name, check='equal' if out['equal'] else 'differs',
              batching=how)


def cross_device_table(records: list[dict]) -> str:
  """Per setup: each framework's medians, and fedjx over the fastest peer."""
  import statistics
  rows = ['| setup | framework | version | CPU s / round | wall s / round | '
          'time to first round (s) | round equal to NumPy | runs x timed rounds |',
          '|---|---|---|---|---|---|---|---|']
  summary = ['| setup | fedjx row | CPU / fastest peer | wall / fastest peer | '
             '/ hand-written (CPU) | / hand-written (wall) | '
             'host bytes staged / real data | computed / real steps |',
             '|---|---|---|---|---|---|---|---|']
  checks = {(r['setup'], r['framework']): r for r in records if 'check' in r}
  for setup in CROSS_DEVICE_SETUPS:
    ok = [r for r in records if r.get('setup') == setup and 'check' not in r
          and 'error' not in r and 'cpu_s_per_round' in r]
    if not ok:
      continue
    med = lambda name, key: statistics.median(
        [r[key] for r in ok if r['framework'] == name]) if any(
            r['framework'] == name for r in ok) else None
    for name in CROSS_DEVICE:
      mine = [r for r in ok if r['framework'] == name]
      if not mine:
        continue
      c = checks.get((setup, name), {})
      eq = (f"{c['check']} ({c['max_rel_error']:.1e} <= {c['tolerance']:.1e})"
            if 'max_rel_error' in c else c.get('check', ''))
      last = mine[-1]
      strategy = f', {last["map_strategy"]}' if 'map_strategy' in last else ''
      rows.append(f'| {setup} | {name}{strategy} | {last["version"]} | '
                  f'{med(name, "cpu_s_per_round"):.3f} | {med(name, "wall_s_per_round"):.3f} | '
                  f'{med(name, "time_to_first_round_s"):.1f} | {eq} | '
                  f'{len(mine)} x {last["rounds"]} |')
    peers = [n for n in CROSS_DEVICE if n not in OURS
             and med(n, 'cpu_s_per_round') is not None]
    best_cpu = min((med(n, 'cpu_s_per_round') for n in peers), default=None)
    best_wall = min((med(n, 'wall_s_per_round') for n in peers), default=None)
    hand_cpu = med('handwritten_jax', 'cpu_s_per_round')
    hand_wall = med('handwritten_jax', 'wall_s_per_round')
    ratio = lambda a, b: '' if a is None or not b else f'{a / b:.2f}x'
    for name in FEDJX_ROWS:
      if med(name, 'cpu_s_per_round') is None:
        continue
      fx = [r for r in ok if r['framework'] == name][-1]
      cpu, wall = med(name, 'cpu_s_per_round'), med(name, 'wall_s_per_round')
      summary.append(
          f'| {setup} | {name} | {ratio(cpu, best_cpu)} | {ratio(wall, best_wall)} | '
          f'{ratio(cpu, hand_cpu)} | {ratio(wall, hand_wall)} | '
          f'{fx.get("staged_over_real", 0):.3f} | '
          f'{fx.get("computed_over_real_steps", 0):.2f} |')
  return '\n'.join(rows) + '\n\n' + '\n'.join(summary)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--envs', default=os.environ.get(
      'FEDJX_PEERS_DIR', os.path.expanduser('~/.cache/fedjx-peers')))
  parser.add_argument('--fedjx_python', default=sys.executable)
  parser.add_argument('--frameworks', default=None,
                      help='default: every framework of the suite')
  parser.add_argument('--suite', default='cifar', choices=('cifar', 'cross_device'),
                      help="pfl-research's CIFAR-10 setup, or cross_device.py's")
  parser.add_argument('--setups', default=None,
                      help='default: equal,skewed (cifar) or every cross-device setup')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--rounds', type=int, default=3,
                      help='rounds per run, the first a warm-up')
  parser.add_argument('--slow_rounds', type=int, default=2,
                      help='rounds per run of the PyTorch peers')
  parser.add_argument('--timeout', type=int, default=1200, help='seconds per run')
  parser.add_argument('--out', default='peers.jsonl')
  parser.add_argument('--table', action='store_true', help='only print the table of --out')
  args = parser.parse_args()
  if args.suite == 'cross_device':
    return main_cross_device(args)
  args.setups = args.setups or 'equal,skewed'
  if not args.table:
    names = (args.frameworks or ','.join(ORDER)).split(',')
    for repeat in range(args.repeats):
      for setup in args.setups.split(','):
        for name in names:
          slow = SCRIPTS[name][0] in ('pfl', 'flower')
          record = run_one(name, setup, args.slow_rounds if slow else args.rounds, args)
          record['repeat'] = repeat
          print(json.dumps(record), flush=True)
          with open(args.out, 'a') as f:
            f.write(json.dumps(record) + '\n')
  with open(args.out) as f:
    records = [json.loads(l) for l in f if l.strip()]
  print(table(records))


def main_cross_device(args):
  """The cross-device suite: the checks once, then the timed runs of every
  framework interleaved (each setup, each framework, then again)."""
  names = (args.frameworks or ','.join(CROSS_DEVICE)).split(',')
  setups = (args.setups or ','.join(CROSS_DEVICE_SETUPS)).split(',')
  unknown = sorted(set(names) - set(CROSS_DEVICE))
  if unknown:
    raise SystemExit(f'--frameworks: {unknown} are not in {list(CROSS_DEVICE)}.')

  def emit(record):
    print(json.dumps(record), flush=True)
    with open(args.out, 'a') as f:
      f.write(json.dumps(record) + '\n')

  if not args.table:
    wanted = [(s, n) for s in setups for n in names
              if s in CROSS_DEVICE[n][3]]
    for setup, name in wanted:
      emit(check_round(name, setup, args))
    for repeat in range(args.repeats):
      for setup, name in wanted:
        slow = CROSS_DEVICE[name][0] in ('pfl', 'flower')
        record = run_one(name, setup, args.slow_rounds if slow else args.rounds,
                         args, cross_device=True)
        record['repeat'] = repeat
        emit(record)
  with open(args.out) as f:
    records = [json.loads(l) for l in f if l.strip()]
  print(cross_device_table([r for r in records if r.get('setup') in CROSS_DEVICE_SETUPS]))


if __name__ == '__main__':
  main()
