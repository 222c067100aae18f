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

with CIFAR-shaped synthetic inputs ``[32 * 32 * 3]`` and an MLP 3072-256-10,
one local epoch of SGD 0.1. A strategy ``chunked:4+ordered`` runs the cohort
made with ``make_cohort(order_by_steps=True)`` (as ``fedjx-run`` does under
``map_strategy='chunked'``), whose chunks hold clients of similar sizes. The baseline is a hand-written round: ``lax.map``
over clients, each running a ``fori_loop`` over exactly its own steps, then
the example-weighted mean. Each record is a JSON line with the round's
milliseconds (median of ``--repeats`` after a compiled warm-up), the ratio
to the baseline measured in the same process, and ``computed_steps /
real_steps`` (the steps each chunk computes: its members times its largest
member's steps).

  python scripts/benchmark_padding.py --repeats=5
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


def _sizes(setup: str, rng) -> np.ndarray:
  if setup == 'pfl_cifar10':
    return np.full(50, 50)
  return np.maximum(1, np.round(50 * np.exp(0.8 * rng.normal(size=50)))).astype(int)


def _loss(params, batch):
  h = jax.nn.relu(batch['x'] @ params['w1'] + params['b1'])
  logits = h @ params['w2'] + params['b2']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def _params(key):
  k1, k2 = jax.random.split(key)
  return {'w1': jax.random.normal(k1, (DIM, HIDDEN)) / np.sqrt(DIM),
          'b1': jnp.zeros(HIDDEN),
          'w2': jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
          'b2': jnp.zeros(CLASSES)}


def _dataset(sizes, rng):
  x = rng.normal(size=(int(sizes.sum()), DIM)).astype(np.float32)
  y = rng.integers(0, CLASSES, size=int(sizes.sum())).astype(np.int32)
  groups = np.repeat(np.arange(len(sizes)), sizes)
  return datasets.from_arrays({'x': x, 'y': y}, groups=groups)


def _cohort(data, n, order_by_steps=False):
  cohort = datasets.make_cohort(data, np.arange(n), BATCH, shuffle_seed=None,
                                order_by_steps=order_by_steps)
  return jax.tree.map(jnp.asarray, cohort)


def _hand_written(params, cohort):
  """``lax.map`` over clients, each exactly its own steps, then the mean."""
  steps = jnp.sum(jnp.any(cohort.mask, -1), -1)

  def client(args):
    batches, mask, n = args

    def step(t, w):
      batch = jax.tree.map(lambda a: a[t], batches)
      m = mask[t]
      g = jax.grad(lambda w: jnp.sum(jnp.where(m, _loss(w, batch), 0.0)) /
                   jnp.maximum(jnp.sum(m), 1))(w)
      return jax.tree.map(lambda a, b: a - 0.1 * b, w, g)

    return jax.lax.fori_loop(0, n, step, params)

  models = jax.lax.map(client, (cohort.batches, cohort.mask, steps))
  w = cohort.num_examples / jnp.sum(cohort.num_examples)
  return jax.tree.map(lambda m: jnp.tensordot(w, m, 1), models)


def _computed_over_real(real_steps: np.ndarray, k: int, padded: int,
                        skipping: bool) -> float:
  """Steps the chunks compute over the real steps: with skipping, each
  chunk of ``k`` runs its largest member's steps; without, the padded ``S``."""
  n = len(real_steps)
  computed = 0
  for start in range(0, n, k):
    chunk = real_steps[start:start + k]
    computed += k * (int(chunk.max()) if skipping else padded)
  return computed / int(real_steps.sum())


def _time(fn, repeats):
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return float(np.median(times)) * 1e3


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--setups', default='lognormal,pfl_cifar10')
  parser.add_argument('--strategies',
                      default='sequential,chunked:4,chunked:4+ordered,auto')
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  params = _params(jax.random.key(0))
  for setup in args.setups.split(','):
    sizes = _sizes(setup, rng)
    data = _dataset(sizes, rng)
    cohort = _cohort(data, len(sizes))
    real = np.asarray(jnp.sum(jnp.any(cohort.mask, -1), -1))
    padded = int(cohort.mask.shape[1])
    base_ms = _time(lambda: jax.jit(_hand_written)(params, cohort), args.repeats)
    print(json.dumps({'setup': setup, 'strategy': 'hand_written_lax_map',
                      'ms_per_round': round(base_ms, 2), 'clients': len(sizes),
                      'padded_steps': padded, 'real_steps': int(real.sum())}),
          flush=True)
    for spec in args.strategies.split(','):
      name, _, order = spec.partition('+')
      strategy, _, chunk = name.partition(':')
      cohort = _cohort(data, len(sizes), order_by_steps=order == 'ordered')
      real = np.asarray(jnp.sum(jnp.any(cohort.mask, -1), -1))
      algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1),
                               client_evaluation=False).compile(
          map_strategy=strategy, chunk_size=int(chunk) if chunk else None,
          donate=False)
      state = algo.init(params)
      key = jax.random.key(1)
      ms = _time(lambda: algo.round(state, cohort, key)[0].params, args.repeats)
      client_bytes = sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize
                         for x in jax.tree.leaves((cohort.batches, cohort.mask)))
      k = fedjx.mapping.choose_chunk_size(strategy, len(sizes), client_bytes, 1,
                                          int(chunk) if chunk else None)
      print(json.dumps({
          'setup': setup, 'strategy': spec, 'chunk': k,
          'ms_per_round': round(ms, 2), 'ratio_vs_hand_written': round(ms / base_ms, 3),
          'computed_over_real_steps': round(_computed_over_real(real, k, padded, True), 3),
          'without_skipping': round(_computed_over_real(real, k, padded, False), 3),
          'backend': jax.default_backend(), 'jax': jax.__version__}), flush=True)


if __name__ == '__main__':
  main()
