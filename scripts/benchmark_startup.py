"""Time to the first round of ``fedjx-run``, with and without the cache.

Each repeat runs a config three times in fresh workdirs, one after the
other: with ``--config.compilation_cache=off`` (what a run cost before the
cache), then with an empty cache folder (the run that fills it), then again
with that folder (a second run of the same config). Each run's line is the
runner's "the first round took X s (compilation included)", the run's
``elapsed_s`` after its last round and the process's wall seconds, as JSON.

  python scripts/benchmark_startup.py --repeats=3 --out=benchmarks/results/startup_cpu.jsonl
  python scripts/benchmark_startup.py --config=configs/diloco_text.py
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = re.compile(r'the first round took ([0-9.]+) s')


def run(config: str, workdir: str, cache: str, rounds: int) -> dict:
  cmd = [sys.executable, '-m', 'fedjx.experiments.cli', f'--config={config}',
         f'--workdir={workdir}', f'--config.compilation_cache={cache}',
         f'--config.rounds={rounds}', '--config.plot=False',
         '--config.tensorboard=False']
  env = dict(os.environ)
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  start = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
  wall = time.perf_counter() - start
  if proc.returncode:
    raise SystemExit(f'{" ".join(cmd)} failed:\n{proc.stderr[-2000:]}')
  first = FIRST.search(proc.stderr.replace('\r', '\n'))
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    last = [json.loads(l) for l in f if l.strip()][-1]
  return {'first_round_s': float(first.group(1)) if first else None,
          'elapsed_s': last.get('elapsed_s'), 'process_wall_s': round(wall, 2)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/fedavg_digits.py')
  parser.add_argument('--rounds', type=int, default=20)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  for repeat in range(args.repeats):
    with tempfile.TemporaryDirectory() as tmp:
      cache = os.path.join(tmp, 'cache')
      for case, setting in (('off', 'off'), ('cache_fill', cache), ('cache_hit', cache)):
        record = dict(run(args.config, os.path.join(tmp, case), setting, args.rounds),
                      config=args.config, case=case, repeat=repeat,
                      rounds=args.rounds, cpu_count=os.cpu_count(),
                      loadavg_1m=round(os.getloadavg()[0], 2),
                      date=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()))
        print(json.dumps(record), flush=True)
        if args.out:
          with open(args.out, 'a') as f:
            f.write(json.dumps(record) + '\n')


if __name__ == '__main__':
  main()
