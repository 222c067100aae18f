"""SCAFFOLD's per-client state at population scale: memory, disk, round time.

Tooling of the repository, not part of the installed package. Each
configuration runs in its own process (so its peak RSS is its own): a few
SCAFFOLD rounds of a fixed cohort of ``C`` clients drawn uniformly from a
population of ``N``, on synthetic data of a few examples per client, with the
clients' ``c_i`` placed

* ``store_disk``: in a :class:`fedjx.client_store.ClientStore` with a small
  memory budget (``--budget_rows`` rows), the rows beyond it in memory-mapped
  files;
  the store is saved (an incremental checkpoint) after every round;
* ``store_memory``: the same store with no memory budget (host memory);
* ``dense``: ``client_state='dense'``, ``[N, ...]`` arrays in the server
  state on the device (only for populations where they fit).

Models: the EMNIST CNN (1.2M parameters, a ``c_i`` of 4.8 MB; 28x28 images,
62 classes) and logistic regression (60 features, 10 classes, 610
parameters). One untimed round compiles; the next ``--rounds`` are timed. A
round is: read the cohort's rows, run the compiled round, write its rows back
(and save, for ``store_disk``). Each JSON line gives the median seconds of
each part, the process's peak RSS (``VmHWM``) and its anonymous and
file-backed resident memory at the end (mapped row files count as file-backed
RSS while their pages are cached; the kernel can drop them), the store's
rows in memory, on disk, and checkpointed.

    python benchmarks/population_state.py                 # the table
    python benchmarks/population_state.py --one cnn store_disk 100000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The table: (model, placement, population).
TABLE = (
    ('cnn', 'dense', 100),
    ('cnn', 'store_memory', 100),
    ('cnn', 'store_disk', 1_000),
    ('cnn', 'store_disk', 100_000),
    ('logreg', 'dense', 10_000),
    ('logreg', 'store_memory', 10_000),
    ('logreg', 'store_disk', 10_000),
    ('logreg', 'store_disk', 1_000_000),
    ('logreg', 'dense', 1_000_000),
)


def _status_mb(field: str) -> float:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) / 1024
  return float('nan')


def one(model_name: str, placement: str, population: int, cohort: int,
        rounds: int, examples: int, budget_rows: int, directory: str) -> dict:
  """Runs one configuration in this process; its JSON record."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from fedjx import algorithms, datasets, models  # pylint: disable=g-import-not-at-top
  from fedjx.client_store import ClientStore  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  shape = (cohort, 1, examples)  # One local step on each client's examples.
  if model_name == 'cnn':
    model = models.emnist_cnn(62, dropout=False)
    batches = {'x': rng.normal(size=shape + (28, 28, 1)).astype(np.float32),
               'y': rng.integers(0, 62, size=shape).astype(np.int32)}
  else:
    model = models.logistic_regression(10)
    batches = {'x': rng.normal(size=shape + (60,)).astype(np.float32),
               'y': rng.integers(0, 10, size=shape).astype(np.int32)}
  params = model.init(jax.random.key(0), jax.tree.map(lambda a: a[0, 0], batches))
  dense = placement == 'dense'
  algo = algorithms.scaffold(model.loss_fn, population, client_learning_rate=0.05,
                             server_optimizer=optax.sgd(1.0),
                             client_state='dense' if dense else 'store')
  state = algo.init(params)
  store = None
  if not dense:
    initial = algo.client_state_init(params)
    row_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(initial))
    budget = None if placement == 'store_memory' else budget_rows * row_bytes
    store = ClientStore(initial, population, directory=directory,
                        memory_budget_bytes=budget)
  base = datasets.Cohort(batches, np.ones(shape, bool),
                         np.full(cohort, examples, np.float32),
                         np.zeros(cohort, np.int32))
  key = jax.random.key(1)
  parts = {'read_s': [], 'round_s': [], 'write_s': [], 'save_s': [], 'total_s': [],
           'total_cpu_s': []}
  for r in range(rounds + 1):
    ids = rng.choice(population, cohort, replace=False).astype(np.int32)
    t0, cpu0 = time.perf_counter(), time.process_time()
    c = base._replace(client_ids=ids)
    if not dense:
      c = c._replace(client_states=store.read(ids))
    t1 = time.perf_counter()
    out = algo.round(state, c, key)
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    state = out[0]
    if not dense:
      store.write(ids, jax.device_get(out[2]))
    t3 = time.perf_counter()
    if placement == 'store_disk':
      store.save(r)
    t4, cpu4 = time.perf_counter(), time.process_time()
    if r:  # Round 0 compiles.
      for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0,
                              cpu4 - cpu0)):
        parts[k].append(v)
  record = {'model': model_name, 'placement': placement, 'population': population,
            'cohort': cohort, 'examples_per_client': examples, 'rounds': rounds,
            'row_mb': round(sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))
                            / 2 ** 20, 3)}
  record.update({k: round(statistics.median(v), 4) for k, v in parts.items()})
  record.update({
      'peak_rss_mb': round(_status_mb('VmHWM'), 1),
      'ru_maxrss_mb': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
      'rss_anon_mb': round(_status_mb('RssAnon'), 1),
      'rss_file_mb': round(_status_mb('RssFile'), 1),
      'dense_state_mb': round(sum(np.asarray(a).nbytes for a in jax.tree.leaves(
          getattr(state, 'client_states', ()))) / 2 ** 20, 1),
  })
  if store is not None:
    record.update({'clients_held': len(store),
                   'store_memory_mb': round(store.memory_bytes / 2 ** 20, 1),
                   'store_disk_mb': round(store.disk_bytes / 2 ** 20, 1),
                   'checkpoint_mb': round(store.checkpoint_bytes / 2 ** 20, 1),
                   'budget_rows': None if placement == 'store_memory' else budget_rows})
    store.close()
  record.update({'machine': f'{platform.machine()} {os.cpu_count()} cpus',
                 'date': time.strftime('%Y-%m-%d')})
  return record


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--one', nargs=3, metavar=('MODEL', 'PLACEMENT', 'N'),
                 help='run one configuration in this process')
  p.add_argument('--cohort', type=int, default=20)
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--examples', type=int, default=4, help='examples per client')
  p.add_argument('--budget_rows', type=int, default=10,
                 help="store_disk's memory budget, in rows")
  p.add_argument('--directory', default=None,
                 help='where store_disk keeps its files (default: a temporary one)')
  a = p.parse_args(argv)
  if a.one:
    directory = a.directory or tempfile.mkdtemp(prefix='client_store_')
    try:
      record = one(a.one[0], a.one[1], int(a.one[2]), a.cohort, a.rounds,
                   a.examples, a.budget_rows, directory)
    finally:
      if a.directory is None:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(record), flush=True)
    return
  for model_name, placement, population in TABLE:
    cmd = [sys.executable, os.path.abspath(__file__), '--one', model_name,
           placement, str(population), '--cohort', str(a.cohort), '--rounds',
           str(a.rounds), '--examples', str(a.examples), '--budget_rows',
           str(a.budget_rows)]
    if a.directory:
      cmd += ['--directory', os.path.join(a.directory, f'{model_name}_{population}')]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
    print(line[0] if line else json.dumps(
        {'model': model_name, 'placement': placement, 'population': population,
         'error': out.stderr.strip().splitlines()[-1:]}), flush=True)


if __name__ == '__main__':
  main()
