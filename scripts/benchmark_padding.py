"""Padded steps: what a FedAvg round computes against the real work.

A cohort pads every client to the largest client's step count ``S`` (rounded
up to a power of two by ``make_cohort``'s default ``bucket=True``). A step
that is padding for every client run together with it is skipped
(``fedjx.mapping.any_in_chunk``), so a round costs the real steps. This
script measures it, in one process, on two setups:

* ``lognormal``: 50 clients with log-normal sizes (median 50 examples,
  sigma 0.8), batch 10;
* ``pfl_cifar10``: pfl-research's CIFAR-10 cross-device setup, 50 clients x
  50 examples, batch 10 (5 real steps, padded to 8);

with CIFAR-shaped synthetic inputs ``[32 * 32 * 3]`` and an MLP 3072-256-10
(``--model=mlp``), or EMNIST-shaped inputs ``[28, 28, 1]`` and the EMNIST
two-convolution CNN of ``fedjx.models`` without dropout, 10 classes
(``--model=cnn``); one local epoch of SGD 0.1. A strategy ``chunked:4+ordered`` runs the cohort
made with ``make_cohort(order_by_steps=True)`` (as ``fedjx-run`` does under
``map_strategy='chunked'``), whose chunks hold clients of similar sizes. The baseline is a hand-written round: ``lax.map``
over clients, each running a ``fori_loop`` over exactly its own steps, then
the example-weighted mean. Each record is a JSON line with the round's
milliseconds (median of ``--repeats`` after a compiled warm-up), the ratio
to the baseline measured in the same process, and ``computed_steps /
real_steps`` (the steps each chunk computes: its members times its largest
member's steps; chunks are formed from the step counts,
``fedjx.mapping.chunk_widths``). The repeats are interleaved: each repeat
times every strategy once, in turn, so a change of load hits them all.

``--bucketing`` instead measures, for a few cohorts of log-normal sizes, the
compile time of a chunked round and its padded steps with
``make_cohort(bucket=True)`` (``S`` a power of two: cohorts share programs)
and ``bucket=False`` (``S`` the cohort's largest step count: a program per
distinct ``S``).

  python scripts/benchmark_padding.py --repeats=5 --model=mlp
  python scripts/benchmark_padding.py --repeats=3 --model=cnn --setups=lognormal
  python scripts/benchmark_padding.py --bucketing --model=cnn
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjx
from fedjx import algorithms
from fedjx import datasets

DIM, HIDDEN, CLASSES, BATCH = 3072, 256, 10, 10
IMAGE = (28, 28, 1)


def _sizes(setup: str, rng, clients: int = 50) -> np.ndarray:
  if setup == 'pfl_cifar10':
    return np.full(clients, 50)
  return np.maximum(1, np.round(50 * np.exp(0.8 * rng.normal(size=clients)))).astype(int)


def _mlp_loss(params, batch):
  h = jax.nn.relu(batch['x'] @ params['w1'] + params['b1'])
  logits = h @ params['w2'] + params['b2']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def _mlp_params(key):
  k1, k2 = jax.random.split(key)
  return {'w1': jax.random.normal(k1, (DIM, HIDDEN)) / np.sqrt(DIM),
          'b1': jnp.zeros(HIDDEN),
          'w2': jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
          'b2': jnp.zeros(CLASSES)}


def _model(name: str):
  """``(loss_fn, params, input shape)`` of ``--model``."""
  if name == 'mlp':
    return _mlp_loss, _mlp_params(jax.random.key(0)), (DIM,)
  from fedjx import models  # pylint: disable=g-import-not-at-top
  cnn = models.emnist_cnn(num_classes=CLASSES, dropout=False)
  sample = {'x': jnp.zeros((1,) + IMAGE), 'y': jnp.zeros(1, jnp.int32)}
  return cnn.loss_fn, cnn.init(jax.random.key(0), sample), IMAGE


def _dataset(sizes, rng, shape=(DIM,)):
  x = rng.normal(size=(int(sizes.sum()),) + shape).astype(np.float32)
  y = rng.integers(0, CLASSES, size=int(sizes.sum())).astype(np.int32)
  groups = np.repeat(np.arange(len(sizes)), sizes)
  return datasets.from_arrays({'x': x, 'y': y}, groups=groups)


def _cohort(data, n, order_by_steps=False, bucket=True):
  cohort = datasets.make_cohort(data, np.arange(n), BATCH, shuffle_seed=None,
                                order_by_steps=order_by_steps, bucket=bucket)
  return jax.tree.map(jnp.asarray, cohort)


def _hand_written(loss, params, cohort):
  """``lax.map`` over clients, each exactly its own steps, then the mean."""
  steps = jnp.sum(jnp.any(cohort.mask, -1), -1)

  def client(args):
    batches, mask, n = args

    def step(t, w):
      batch = jax.tree.map(lambda a: a[t], batches)
      m = mask[t]
      g = jax.grad(lambda w: jnp.sum(jnp.where(m, loss(w, batch), 0.0)) /
                   jnp.maximum(jnp.sum(m), 1))(w)
      return jax.tree.map(lambda a, b: a - 0.1 * b, w, g)

    return jax.lax.fori_loop(0, n, step, params)

  models = jax.lax.map(client, (cohort.batches, cohort.mask, steps))
  w = cohort.num_examples / jnp.sum(cohort.num_examples)
  return jax.tree.map(lambda m: jnp.tensordot(w, m, 1), models)


def _ratios(real_steps: np.ndarray, strategy: str, k: int, padded: int) -> tuple[float, float]:
  """Computed over real steps with skipping (the chunks of
  ``fedjx.mapping.chunk_widths``, each running its largest member's steps)
  and without (every member the padded ``S``)."""
  real = int(real_steps.sum())
  with_skipping = fedjx.mapping.computed_steps(real_steps, k, strategy)
  return with_skipping / real, len(real_steps) * padded / real


def _time_once(fn):
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


def _bucketing(args, loss, params, shape):
  """Compile time and padded steps of a chunked round, bucket=True/False."""
  rng = np.random.default_rng(1)
  drawn = []  # The same cohorts for both.
  for _ in range(args.cohorts):
    sizes = _sizes('lognormal', rng, args.clients)
    drawn.append((sizes, _dataset(sizes, rng, shape)))
  for bucket in (True, False):
    algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1),
                             client_evaluation=False).compile(
        map_strategy='chunked', chunk_size=4, donate=False)
    state = algo.init(params)
    seen = set()
    for cohort_id, (sizes, data) in enumerate(drawn):
      cohort = _cohort(data, len(sizes), order_by_steps=True, bucket=bucket)
      padded = int(cohort.mask.shape[1])
      real = int(jnp.sum(jnp.any(cohort.mask, -1)))
      first = padded not in seen
      seen.add(padded)
      t = time.perf_counter()
      jax.block_until_ready(algo.round(state, cohort, jax.random.key(1))[0].params)
      first_s = time.perf_counter() - t
      run_s = _time_once(lambda: algo.round(state, cohort, jax.random.key(1))[0].params)
      print(json.dumps({
          'experiment': 'bucketing', 'model': args.model, 'bucket': bucket,
          'cohort': cohort_id, 'padded_steps': padded, 'real_steps': real,
          'padded_over_real': round(len(sizes) * padded / real, 3),
          'new_program': first, 'compile_s': round(max(first_s - run_s, 0.0), 2),
          'round_s': round(run_s, 3), 'backend': jax.default_backend(),
          'jax': jax.__version__}), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--model', default='mlp', choices=('mlp', 'cnn'))
  parser.add_argument('--clients', type=int, default=50)
  parser.add_argument('--setups', default='lognormal,pfl_cifar10')
  parser.add_argument('--strategies',
                      default='sequential,chunked:4,chunked:4+ordered,auto')
  parser.add_argument('--bucketing', action='store_true')
  parser.add_argument('--cohorts', type=int, default=4)
  args = parser.parse_args()
  loss, params, shape = _model(args.model)
  if args.bucketing:
    _bucketing(args, loss, params, shape)
    return
  rng = np.random.default_rng(0)
  for setup in args.setups.split(','):
    sizes = _sizes(setup, rng, args.clients)
    data = _dataset(sizes, rng, shape)
    cohort = _cohort(data, len(sizes))
    real = np.asarray(jnp.sum(jnp.any(cohort.mask, -1), -1))
    padded = int(cohort.mask.shape[1])
    base = jax.jit(lambda p, c: _hand_written(loss, p, c))
    runs = {'hand_written_lax_map': lambda: base(params, cohort)}
    records = {}
    for spec in args.strategies.split(','):
      name, _, order = spec.partition('+')
      strategy, _, chunk = name.partition(':')
      spec_cohort = _cohort(data, len(sizes), order_by_steps=order == 'ordered')
      spec_real = np.asarray(jnp.sum(jnp.any(spec_cohort.mask, -1), -1))
      algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1),
                               client_evaluation=False).compile(
          map_strategy=strategy, chunk_size=int(chunk) if chunk else None,
          donate=False)
      state = algo.init(params)
      runs[spec] = (lambda a, s, c: lambda: a.round(s, c, jax.random.key(1))[0].params)(
          algo, state, spec_cohort)
      # What map_fn sizes 'auto' by: one client's placed inputs, the
      # broadcast model included.
      client_bytes = sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize
                         for x in jax.tree.leaves((spec_cohort.batches, spec_cohort.mask))) + sum(
                             x.nbytes for x in jax.tree.leaves(params))
      k = fedjx.mapping.choose_chunk_size(strategy, len(sizes), client_bytes, 1,
                                          int(chunk) if chunk else None)
      kind = 'sequential' if k == 1 else ('vmap' if k >= len(sizes) else 'chunked')
      ratio, without = _ratios(spec_real, kind, k, padded)
      widths = (fedjx.mapping.chunk_widths(spec_real, k) if kind == 'chunked'
                else [k] * math.ceil(len(sizes) / k))
      records[spec] = {'chunk': k, 'chunks_alone': widths.count(1),
                       'chunks_of_k': widths.count(k) if k > 1 else 0,
                       'computed_over_real_steps': round(ratio, 3),
                       'without_skipping': round(without, 3)}
    compile_s = {name: _time_once(fn) for name, fn in runs.items()}
    times = {name: [] for name in runs}
    for _ in range(args.repeats):  # Interleaved: each repeat runs them all.
      for name, fn in runs.items():
        times[name].append(_time_once(fn))
    base_ms = float(np.median(times['hand_written_lax_map'])) * 1e3
    for name in runs:
      ms = float(np.median(times[name])) * 1e3
      print(json.dumps({
          'setup': setup, 'model': args.model, 'strategy': name,
          'clients': len(sizes), 'padded_steps': padded,
          'real_steps': int(real.sum()), **records.get(name, {}),
          'ms_per_round': round(ms, 2),
          'ms_min': round(min(times[name]) * 1e3, 2),
          'ratio_vs_hand_written': round(ms / base_ms, 3),
          'first_call_s': round(compile_s[name], 2), 'repeats': args.repeats,
          'backend': jax.default_backend(), 'jax': jax.__version__}), flush=True)


if __name__ == '__main__':
  main()
