"""Runs the peer comparison: each framework's round script as a subprocess
in its own virtualenv, interleaved (fedjx, lax_map, fedjax, torch_loop,
pfl-research, flower, then again), appending each JSON line to ``--out``,
then prints the Markdown table (``--table`` re-prints it from ``--out``).

  python benchmarks/peers/run.py --repeats=2 --out=docs/peers_cpu.jsonl

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


def _python(env: str, args) -> str:
  if env == 'fedjx':
    return args.fedjx_python
  return os.path.join(args.envs, env, 'bin', 'python')


def run_one(name: str, setup: str, rounds: int, args) -> dict:
  env, script = SCRIPTS[name]
  python = _python(env, args)
  cmd = [python, os.path.join(HERE, script), f'--setup={setup}', f'--rounds={rounds}']
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--envs', default=os.environ.get(
      'FEDJX_PEERS_DIR', os.path.expanduser('~/.cache/fedjx-peers')))
  parser.add_argument('--fedjx_python', default=sys.executable)
  parser.add_argument('--frameworks', default=','.join(ORDER))
  parser.add_argument('--setups', default='equal,skewed')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--rounds', type=int, default=3,
                      help='rounds per run, the first a warm-up')
  parser.add_argument('--slow_rounds', type=int, default=2,
                      help='rounds per run of the PyTorch peers')
  parser.add_argument('--timeout', type=int, default=1200, help='seconds per run')
  parser.add_argument('--out', default='peers.jsonl')
  parser.add_argument('--table', action='store_true', help='only print the table of --out')
  args = parser.parse_args()
  if not args.table:
    names = args.frameworks.split(',')
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


if __name__ == '__main__':
  main()
