"""Random row reads and writes of per-client state: which backend serves them.

Tooling of the repository, not part of the installed package. A round of a
stateful algorithm reads its cohort's rows (``C`` random clients of the
population) and writes them back; this times exactly that, for rows of
``D`` float32 (1.2M: the EMNIST CNN's SCAFFOLD ``c_i``; 100: a logistic
regression's), on ``slots`` rows already on disk, under:

* ``client_store``: :class:`fedjx.client_store.ClientStore` with a zero memory
  budget, every row in its memory-mapped files (``np.memmap``);
* ``client_store_memory``: the same with no budget (rows in host memory);
* ``tensorstore_zarr``: TensorStore's zarr driver on local files, one chunk
  per row, uncompressed (``oindex`` reads and writes of the cohort's rows);
* ``array_record``: ArrayRecord files (one record per row, ``group_size:1``);
  records cannot be rewritten in place, so a write appends the cohort's rows
  to a new file (what a store on it would do before compacting) and a read
  fetches records by index.

TensorStore and ArrayRecord come with fedjx's dependencies (Flax and Orbax
need TensorStore; the TFDS sources read ArrayRecord); a missing one is
reported and skipped. Each record is one
JSON line: median milliseconds per cohort read and write over ``repeats``
cohorts (after one untimed), and MB/s. The files are freshly written and
smaller than memory, so reads come from the page cache: this measures each
backend's own overhead, not the disk.

    python benchmarks/client_store_bench.py --dim 1200000 --slots 200
    python benchmarks/client_store_bench.py --dim 100 --slots 100000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np

from fedjx import client_store


def _time(fn, repeats: int) -> float:
  fn()
  out = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t)
  return statistics.median(out)


def _cohorts(rng, slots, cohort, repeats):
  return [rng.choice(slots, cohort, replace=False) for _ in range(repeats + 1)]


class _Backend:
  """``write(ids, rows)`` and ``read(ids)`` of ``[C, D]`` float32 rows."""

  def __init__(self, name):
    self.name = name


def _client_store(directory, dim, slots, budget):
  store = client_store.ClientStore({'c': np.zeros(dim, np.float32)}, slots,
                                   directory=directory, memory_budget_bytes=budget)
  block = max(1, (64 << 20) // (4 * dim))
  for s in range(0, slots, block):  # Every slot holds a row.
    ids = np.arange(s, min(s + block, slots))
    store.write(ids, {'c': np.ones((ids.size, dim), np.float32)})
  b = _Backend('client_store' if budget == 0 else 'client_store_memory')
  b.write = lambda ids, rows: store.write(ids, {'c': rows})
  b.read = lambda ids: store.read(ids)['c']
  return b


def _tensorstore(directory, dim, slots):
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  arr = ts.open({'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': directory},
                 'metadata': {'shape': [slots, dim], 'chunks': [1, dim],
                              'dtype': '<f4', 'compressor': None}},
                create=True, delete_existing=True).result()
  block = max(1, (64 << 20) // (4 * dim))
  for s in range(0, slots, block):
    e = min(s + block, slots)
    arr[s:e].write(np.ones((e - s, dim), np.float32)).result()
  b = _Backend('tensorstore_zarr')
  b.write = lambda ids, rows: arr.oindex[np.sort(ids)].write(rows).result()
  b.read = lambda ids: arr.oindex[np.sort(ids)].read().result()
  return b


def _array_record(directory, dim, slots):
  from array_record.python import array_record_module as ar  # pylint: disable=g-import-not-at-top
  path = os.path.join(directory, 'rows.array_record')
  writer = ar.ArrayRecordWriter(path, 'group_size:1')
  row = np.ones(dim, np.float32).tobytes()
  for _ in range(slots):
    writer.write(row)
  writer.close()
  reader = ar.ArrayRecordReader(path)
  count = [0]

  def write(ids, rows):
    count[0] += 1
    w = ar.ArrayRecordWriter(os.path.join(directory, f'delta_{count[0]}'),
                             'group_size:1')
    for r in rows:
      w.write(r.tobytes())
    w.close()

  def read(ids):
    return np.stack([np.frombuffer(r, np.float32)
                     for r in reader.read([int(i) for i in ids])])

  b = _Backend('array_record')
  b.write, b.read = write, read
  return b


def run(dim: int, slots: int, cohort: int, repeats: int, seed: int = 0,
        backends=None):
  rng = np.random.default_rng(seed)
  builders = {
      'client_store': lambda d: _client_store(d, dim, slots, 0),
      'client_store_memory': lambda d: _client_store(d, dim, slots, None),
      'tensorstore_zarr': lambda d: _tensorstore(d, dim, slots),
      'array_record': lambda d: _array_record(d, dim, slots),
  }
  mb = cohort * dim * 4 / 1e6
  for name, build in builders.items():
    if backends and name not in backends:
      continue
    with tempfile.TemporaryDirectory() as directory:
      try:
        backend = build(directory)
      except ImportError as e:
        print(json.dumps({'backend': name, 'skipped': str(e)}), flush=True)
        continue
      ids = iter(_cohorts(rng, slots, cohort, 2 * repeats + 2))
      rows = rng.normal(size=(cohort, dim)).astype(np.float32)
      write_s = _time(lambda: backend.write(next(ids), rows), repeats)
      read_s = _time(lambda: backend.read(next(ids)), repeats)
      got = backend.read(np.arange(min(cohort, slots)))
      assert got.shape == (min(cohort, slots), dim)
      print(json.dumps({
          'backend': name, 'dim': dim, 'slots': slots, 'cohort': cohort,
          'write_ms': round(1e3 * write_s, 3), 'read_ms': round(1e3 * read_s, 3),
          'write_mb_s': round(mb / write_s, 1), 'read_mb_s': round(mb / read_s, 1),
          'machine': f'{platform.machine()} {os.cpu_count()} cpus',
          'date': time.strftime('%Y-%m-%d')}), flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--dim', type=int, default=100, help='float32 per row')
  p.add_argument('--slots', type=int, default=10000, help='rows on disk')
  p.add_argument('--cohort', type=int, default=32, help='rows per read/write')
  p.add_argument('--repeats', type=int, default=5)
  p.add_argument('--backends', nargs='*', default=None, help='default: all')
  a = p.parse_args(argv)
  run(a.dim, a.slots, a.cohort, a.repeats, backends=a.backends)


if __name__ == '__main__':
  main()
