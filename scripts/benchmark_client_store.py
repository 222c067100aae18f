"""A client store's host copies on several threads against one (JSON lines).

A round whose clients' states live in a ``fedjx.ClientStore`` (DiLoCo's
replicas' AdamW moments with ``client_state.placement='store'``) copies each
state three times on the host: read into reused arrays before it goes to the
device, staged as it comes back, and committed into the store's rows once
the round is accepted. The commit runs between rounds, on the round's
critical path. This times those copies in one process, interleaved and
repeated, with the store's copies in blocks on up to ``_COPY_THREADS``
threads (the default) against the same copies on one thread::

  python scripts/benchmark_client_store.py --rows 8 --row_mb 1170 --leaves 60

(8 rows of 1.17 GB: the 180M model's AdamW state of M = 8 DiLoCo replicas.)
Each line: the operation, the bytes it copies, the median seconds of each
side, and ``threads_over_one``.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from fedjx import client_store


def parse(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--rows', type=int, default=8, help='clients (rows) per round [8]')
  p.add_argument('--row_mb', type=float, default=1170.0, help='MB (10^6 bytes) per row [1170]')
  p.add_argument('--leaves', type=int, default=60, help='arrays per row [60]')
  p.add_argument('--repeats', type=int, default=5, help='timed repeats of each side [5]')
  p.add_argument('--out', default=None, help='also append the JSON lines here')
  args = p.parse_args(argv)
  for name in ('rows', 'leaves', 'repeats'):
    if getattr(args, name) < 1:
      p.error(f'--{name}={getattr(args, name)}; it must be a positive integer.')
  if args.row_mb <= 0:
    p.error(f'--row_mb={args.row_mb}; it must be positive.')
  return args


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main(argv=None) -> list[dict]:
  args = parse(argv)
  floats = max(1, int(args.row_mb * 1e6 / 4 / args.leaves))
  initial = {f'leaf_{i:03d}': np.zeros((floats,), np.float32) for i in range(args.leaves)}
  store = client_store.ClientStore(initial, args.rows, memory_budget_bytes=None)
  ids = np.arange(args.rows)
  rows = {k: np.random.default_rng(0).random((args.rows, floats), np.float32)
          for k in initial}
  store.write(ids, rows)  # Every row held: reads and commits touch written memory.
  out = {k: np.empty_like(v) for k, v in rows.items()}
  ops = {
      'read': lambda: store.read(ids, out=out),
      'stage': lambda: store.stage(ids, rows),
      'commit': store.commit,
  }
  threads = client_store._COPY_THREADS  # pylint: disable=protected-access
  times = {(op, side): [] for op in ops for side in ('threads', 'one')}
  for r in range(args.repeats + 1):  # The first pass warms the memory.
    order = ('threads', 'one') if r % 2 == 0 else ('one', 'threads')
    for side in order:
      client_store._COPY_THREADS = threads if side == 'threads' else 1  # pylint: disable=protected-access
      for op, fn in ops.items():  # stage before commit: a commit copies what is staged.
        seconds = _timed(fn)
        if r:
          times[(op, side)].append(seconds)
  client_store._COPY_THREADS = threads  # pylint: disable=protected-access
  nbytes = store.row_bytes * args.rows
  lines = []
  for op in ops:
    many, one = (statistics.median(times[(op, s)]) for s in ('threads', 'one'))
    line = {'benchmark': 'client_store_copies', 'op': op, 'bytes': nbytes,
            'threads': min(threads, os.cpu_count() or 1), 'cpu_count': os.cpu_count(),
            'threads_s': round(many, 4), 'one_thread_s': round(one, 4),
            'threads_over_one': round(many / one, 3),
            'threads_gb_per_s': round(nbytes / many / 1e9, 2),
            'one_thread_gb_per_s': round(nbytes / one / 1e9, 2),
            'repeats': args.repeats, 'python': sys.version.split()[0],
            'numpy': np.__version__}
    lines.append(line)
    print(json.dumps(line), flush=True)
    if args.out:
      with open(args.out, 'a', encoding='utf-8') as f:
        f.write(json.dumps(line) + '\n')
  return lines


if __name__ == '__main__':
  main(sys.argv[1:])
