"""Benchmark of FedAvg round time against cohort size, per map strategy.

Tooling of the repository, not part of the installed package: used by
``scripts/benchmark.py`` (which puts this folder on ``sys.path``) and the
tests (tests/conftest.py does the same).

For each model and cohort size, one FedAvg round (``S`` local SGD steps of
batch ``B`` per client) is timed under each ``map_fn`` strategy, next to
references computed in the same process:

* ``ref_vmap``: a hand-written ``jax.vmap`` round (what DrJAX does);
* ``ref_lax_map``: a hand-written ``lax.map`` round (one client at a time);
* ``central``: the centralized trajectory with the same FLOPs, ``S`` steps on
  the pooled batch of ``C * B`` examples;
* ``drjax``: DrJAX's ``map_fn`` when the package is installed.

Each record is one JSON line: milliseconds per round (median of repeats),
clients per second, TFLOP/s from the XLA cost analysis of one client's update
(times ``C``), compile seconds, peak memory (XLA's plan for the program, and
on GPUs the allocator's peak so far in the process), and ratios to the
centralized reference and to the fastest strategy of the same cohort. Timing belongs
here, never in tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjx import algorithms
from fedjx import datasets
from fedjx import mapping
from fedjx import models
from fedjx import frames


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model and the shape of one client's data."""
  name: str
  model: Any
  example: Callable[[np.random.Generator, tuple[int, ...]], dict[str, np.ndarray]]


def workloads() -> dict[str, Workload]:
  """The benchmarked models: logistic regression, the EMNIST CNN, a transformer.

  ``cnn`` runs its convolutions as patch matrix products (the default of
  :func:`fedjx.models.emnist_cnn`), ``cnn_xla`` the same network with XLA's
  convolutions.
  """
  def images(rng, shape, classes):
    return {'x': rng.normal(size=shape + (28, 28, 1)).astype(np.float32),
            'y': rng.integers(0, classes, size=shape).astype(np.int32)}

  def features(rng, shape):
    return {'x': rng.normal(size=shape + (60,)).astype(np.float32),
            'y': rng.integers(0, 10, size=shape).astype(np.int32)}

  def tokens(rng, shape):
    return {'x': rng.integers(1, 256, size=shape + (65,)).astype(np.int32)}

  return {
      'logreg': Workload('logreg', models.logistic_regression(10), features),
      'cnn': Workload('cnn', models.emnist_cnn(62, dropout=False),
                      lambda rng, shape: images(rng, shape, 62)),
      'cnn_xla': Workload('cnn_xla', models.emnist_cnn(62, dropout=False, conv='xla'),
                          lambda rng, shape: images(rng, shape, 62)),
      'transformer': Workload('transformer',
                              models.transformer_lm(256, max_len=64, width=64,
                                                    num_layers=2, num_heads=4),
                              tokens),
  }


def make_cohort(workload: Workload, clients: int, steps: int, batch: int,
                seed: int = 0) -> datasets.Cohort:
  rng = np.random.default_rng(seed)
  batches = workload.example(rng, (clients, steps, batch))
  mask = np.ones((clients, steps, batch), bool)
  return datasets.Cohort(batches, mask, np.full((clients,), steps * batch, np.float32),
                         np.arange(clients, dtype=np.int32))


def _compile(jitted: Any, *args: Any) -> tuple[Any, float]:
  """Lowers and compiles ``jitted`` for ``args``: (executable, seconds)."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def _time_interleaved(calls: Sequence[Callable[[], Any]], repeats: int,
                      min_seconds: float = 1.0, max_repeats: int = 200,
                      cpu: list[list[float]] | None = None
                      ) -> list[tuple[float, float, float]]:
  """Times ``calls`` round-robin: (first call s, median s, min s) for each.

  After one untimed-for-statistics first call each (compilation), at least
  ``repeats`` rounds of all calls are timed, and more (up to ``max_repeats``)
  until ``min_seconds`` have passed, so millisecond rounds get stable numbers.
  With ``cpu`` (a list of one list per call), each timed call's process CPU
  seconds (all threads) are appended too: on a machine shared with other
  jobs, CPU time moves much less than wall time.
  """
  firsts = []
  for call in calls:
    start = time.perf_counter()
    jax.block_until_ready(call())
    firsts.append(time.perf_counter() - start)
  times: list[list[float]] = [[] for _ in calls]
  began = time.perf_counter()
  rounds = 0
  while rounds < repeats or (time.perf_counter() - began < min_seconds and
                             rounds < max_repeats):
    for k, call in enumerate(calls):
      start, start_cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(call())
      times[k].append(time.perf_counter() - start)
      if cpu is not None:
        cpu[k].append(time.process_time() - start_cpu)
    rounds += 1
  return [(f, statistics.median(t), min(t)) for f, t in zip(firsts, times)]


def _client_sgd(loss_fn, lr):
  def train(params, batches):
    def step(p, batch):
      g = jax.grad(lambda q: jnp.mean(loss_fn(q, batch)))(p)
      return jax.tree.map(lambda a, b: a - lr * b, p, g), None
    return jax.lax.scan(step, params, batches)[0]
  return train


def reference_rounds(loss_fn, lr: float) -> dict[str, Callable]:
  """Hand-written FedAvg rounds (no fedjx) and the centralized reference."""
  train = _client_sgd(loss_fn, lr)

  def average(stacked, weights):
    w = weights / weights.sum()
    return jax.tree.map(lambda x: jnp.tensordot(w, x, axes=1), stacked)

  @jax.jit
  def ref_vmap(params, batches, weights):
    return average(jax.vmap(train, in_axes=(None, 0))(params, batches), weights)

  @jax.jit
  def ref_lax_map(params, batches, weights):
    return average(jax.lax.map(lambda b: train(params, b), batches), weights)

  @jax.jit
  def central(params, batches, weights):
    del weights
    pooled = jax.tree.map(
        lambda x: jnp.swapaxes(x, 0, 1).reshape((x.shape[1], -1) + x.shape[3:]), batches)
    return train(params, pooled)

  return {'ref_vmap': ref_vmap, 'ref_lax_map': ref_lax_map, 'central': central}


def _drjax_round(loss_fn, lr, clients):
  try:
    import drjax  # noqa: F401 - optional
  except ImportError:
    return None
  train = _client_sgd(loss_fn, lr)

  @jax.jit
  @drjax.program(placements={'clients': clients})
  def round_(params, batches, weights):
    del weights
    trained = drjax.map_fn(train, (drjax.broadcast(params), batches))
    return drjax.reduce_mean(trained)
  return round_


def client_flops(loss_fn, lr, params, batches_one) -> float:
  """FLOPs of one client's local training, from XLA's cost analysis."""
  compiled = jax.jit(_client_sgd(loss_fn, lr)).lower(params, batches_one).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0]
  return float((cost or {}).get('flops', float('nan')))


def peak_bytes(compiled) -> int | None:
  """XLA's planned peak memory of a compiled program (arguments, outputs, temps)."""
  try:
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes + analysis.argument_size_in_bytes +
               analysis.output_size_in_bytes)
  except Exception:  # pragma: no cover - backend without analysis
    return None


def device_peak_bytes() -> int | None:
  """The device allocator's peak so far in this process, where it reports one."""
  stats = jax.devices()[0].memory_stats()
  return int(stats['peak_bytes_in_use']) if stats and 'peak_bytes_in_use' in stats else None


def _workload_and_loss(name: str, precision: str) -> tuple[Workload, Callable]:
  """The named workload and its loss function at ``precision``."""
  if precision not in ('float32', 'bfloat16'):
    raise ValueError(f"benchmark: precision={precision!r} is not one of "
                     "('float32', 'bfloat16').")
  all_workloads = workloads()
  if name not in all_workloads:
    raise ValueError(f'benchmark: model={name!r} is not one of {sorted(all_workloads)}.')
  workload = all_workloads[name]
  loss_fn = workload.model.loss_fn
  if precision == 'bfloat16':
    loss_fn = models.mixed_precision(loss_fn)
  return workload, loss_fn


def _fedavg(loss_fn, lr: float, steps: int, strategy: str, chunk: int | None,
            client_evaluation: bool) -> algorithms.Algorithm:
  """The benchmarked round: FedAvg with ``steps`` local SGD steps."""
  return algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(lr),
                           local_steps=steps, client_evaluation=client_evaluation
                           ).compile(map_strategy=strategy, chunk_size=chunk)


def parse_strategy(spec: str) -> tuple[str, int | None]:
  """``'chunked:16'`` -> ('chunked', 16); ``'vmap'`` -> ('vmap', None).

  A ``nofuse:`` prefix (see :func:`fusion_of`) is ignored here.
  """
  name, _, size = fusion_of(spec)[1].partition(':')
  return name, int(size) if size else None


UNFUSED_PREFIX = 'nofuse:'


def fusion_of(spec: str) -> tuple[bool, str]:
  """``'nofuse:chunked:64'`` -> (False, 'chunked:64'): the round as written,
  its ``map_fn`` outputs stacked before the reductions (fedjx.fusion off)."""
  if spec.startswith(UNFUSED_PREFIX):
    return False, spec[len(UNFUSED_PREFIX):]
  return True, spec


def _fusion_context(spec: str):
  return contextlib.nullcontext() if fusion_of(spec)[0] else frames.without_fusion()


def run(model_names: Sequence[str], cohort_sizes: Sequence[int],
        strategies: Sequence[str], steps: int, batch: int, repeats: int,
        lr: float = 0.01, emit: Callable[[dict], None] = print,
        references: bool = True, seed: int = 0,
        precision: str = 'float32', client_evaluation: bool = False) -> list[dict]:
  """Runs the benchmark; ``emit`` receives each record as it is measured.

  ``precision='bfloat16'`` computes in bfloat16 with float32 master weights
  (:func:`fedjx.models.mixed_precision`), for fedjx and the references alike.
  ``client_evaluation=True`` adds fedjx's before/after evaluation of every
  client (two forward passes over its data) that the references do not do.
  """
  records = []
  for name in model_names:
    workload, loss_fn = _workload_and_loss(name, precision)
    for clients in cohort_sizes:
      cohort = make_cohort(workload, clients, steps, batch, seed)
      params = workload.model.init(jax.random.key(seed),
                                   jax.tree.map(lambda a: a[0, 0], cohort.batches))
      one = jax.tree.map(lambda a: a[0], cohort.batches)
      flops = client_flops(loss_fn, lr, params, one) * clients
      client_bytes = mapping._client_bytes(
          jax.tree.leaves(jax.tree.map(lambda a: jnp.broadcast_to(a, (clients,) + a.shape),
                                       params)) + jax.tree.leaves(cohort.batches))
      placed = datasets.place_cohort(cohort)
      # Every contender first (each call compiles and warms up), then timed
      # calls interleaved round-robin, so drifts in machine load hit all alike.
      contenders = []  # (kind, name, call, compiled, extra)
      for spec in strategies:
        strategy, chunk = parse_strategy(spec)
        algo = _fedavg(loss_fn, lr, steps, strategy, chunk, client_evaluation)
        holder = {'state': algo.init(params)}
        key = jax.random.key(seed)

        def one_round(algo=algo, holder=holder, key=key, spec=spec):
          with _fusion_context(spec):
            holder['state'], metrics = algo.round(holder['state'], placed, key)
          return metrics
        with _fusion_context(spec):
          compiled, compile_s = _compile(jax.jit(algo.apply), algo.init(params),
                                         placed, key)
        k = mapping.choose_chunk_size(strategy, clients, client_bytes, 1, chunk)
        contenders.append(('fedjx', spec, one_round, compiled,
                           {'chunk_clients': k, 'compile_s': compile_s,
                            'fused': fusion_of(spec)[0]}))
      if references:
        refs = reference_rounds(loss_fn, lr)
        drjax_round = _drjax_round(loss_fn, lr, clients)
        if drjax_round is not None:
          refs['drjax'] = drjax_round
        args = (params, placed.batches, placed.num_examples)
        for ref_name, fn in refs.items():
          compiled, compile_s = _compile(fn, *args)
          contenders.append(('reference', ref_name, lambda fn=fn: fn(*args),
                             compiled, {'compile_s': compile_s}))
      timings = _time_interleaved([c[2] for c in contenders], repeats)
      row = []
      for (kind, label, _, compiled, extra), (first, median, best) in zip(contenders, timings):
        rec = {'model': name, 'clients': clients, 'steps': steps, 'batch': batch,
               'precision': precision, 'client_evaluation': client_evaluation,
               'kind': kind, 'strategy': label,
               'backend': jax.default_backend(),
               'ms_per_round': 1e3 * median, 'min_ms_per_round': 1e3 * best,
               'clients_per_s': clients / median, 'tflops': flops / median / 1e12,
               'first_call_s': first, 'peak_bytes': peak_bytes(compiled),
               'device_peak_bytes_so_far': device_peak_bytes(), **extra}
        row.append(rec)
      central = next((r['ms_per_round'] for r in row if r['strategy'] == 'central'), None)
      best = min(r['ms_per_round'] for r in row if r['kind'] == 'fedjx')
      best_min = min(r['min_ms_per_round'] for r in row if r['kind'] == 'fedjx')
      unfused = {fusion_of(r['strategy'])[1]: r for r in row
                 if r['kind'] == 'fedjx' and not fusion_of(r['strategy'])[0]}
      for rec in row:
        if central:
          rec['ratio_vs_central'] = rec['ms_per_round'] / central
        base = unfused.get(rec['strategy'])
        if base is not None and rec.get('fused'):
          # Same round with its outputs stacked, timed interleaved with it.
          rec['ratio_vs_unfused'] = rec['ms_per_round'] / base['ms_per_round']
          rec['min_ratio_vs_unfused'] = rec['min_ms_per_round'] / base['min_ms_per_round']
        rec['ratio_vs_best_strategy'] = rec['ms_per_round'] / best
        rec['min_ratio_vs_best_strategy'] = rec['min_ms_per_round'] / best_min
        emit(rec)
      records.extend(row)
  return records


def compile_only(model_names: Sequence[str], cohort_sizes: Sequence[int],
                 strategies: Sequence[str], steps: int, batch: int,
                 lr: float = 0.01, emit: Callable[[dict], None] = print,
                 seed: int = 0, precision: str = 'float32',
                 client_evaluation: bool = False) -> list[dict]:
  """Compiles rounds without data and reports XLA's memory plan for each.

  Nothing is allocated: the cohort is given as shapes. A record's
  ``argument_bytes`` are the state and the cohort, ``temp_bytes`` the
  working memory of the round, and ``peak_bytes`` their sum with the outputs;
  this is how a cohort size is checked against a device's memory before
  running it (on the device's own backend: layouts differ between backends).
  """
  records = []
  for name in model_names:
    workload, loss_fn = _workload_and_loss(name, precision)
    example = workload.example(np.random.default_rng(seed), (1, 1, 1))
    params = workload.model.init(jax.random.key(seed),
                                 jax.tree.map(lambda a: a[0, 0], example))
    for clients in cohort_sizes:
      shaped = lambda a: jax.ShapeDtypeStruct((clients, steps, batch) + a.shape[3:], a.dtype)
      cohort = datasets.Cohort(
          jax.tree.map(shaped, example),
          jax.ShapeDtypeStruct((clients, steps, batch), jnp.bool_),
          jax.ShapeDtypeStruct((clients,), jnp.float32),
          jax.ShapeDtypeStruct((clients,), jnp.int32))
      for spec in strategies:
        strategy, chunk = parse_strategy(spec)
        algo = _fedavg(loss_fn, lr, steps, strategy, chunk, client_evaluation)
        state = jax.eval_shape(algo.init, params)
        with _fusion_context(spec):
          compiled, compile_s = _compile(jax.jit(algo.apply), state, cohort,
                                         jax.random.key(seed))
        analysis = compiled.memory_analysis()
        rec = {'model': name, 'clients': clients, 'steps': steps, 'batch': batch,
               'precision': precision, 'client_evaluation': client_evaluation,
               'kind': 'compile_only', 'strategy': spec,
               'fused': fusion_of(spec)[0],
               'backend': jax.default_backend(), 'compile_s': compile_s,
               'argument_bytes': int(analysis.argument_size_in_bytes),
               'output_bytes': int(analysis.output_size_in_bytes),
               'temp_bytes': int(analysis.temp_size_in_bytes),
               # XLA's planned temporaries and outputs: what the round needs
               # beyond its inputs.
               'peak_minus_arguments_bytes': int(analysis.output_size_in_bytes +
                                                 analysis.temp_size_in_bytes),
               'peak_bytes': int(analysis.argument_size_in_bytes +
                                 analysis.output_size_in_bytes +
                                 analysis.temp_size_in_bytes)}
        emit(rec)
        records.append(rec)
  return records


def lazy_clients(workload: Workload, clients: int, steps: int, batch: int,
                 seed: int = 0, distinct: int = 256) -> Any:
  """A cohort of :func:`make_cohort`'s shapes as a ``fedjx.streaming.Clients``
  whose chunks are assembled when loaded, so no more than one chunk of it is
  in host memory. Client ``i`` holds the data of ``i mod distinct`` of
  ``distinct`` random clients made once (making 100,000 clients' random
  images would take longer than their round)."""
  from fedjx import streaming  # pylint: disable=g-import-not-at-top
  pool = make_cohort(workload, min(distinct, clients), steps, batch, seed)

  def load(ids):
    ids = np.asarray(ids)
    rows = ids % len(pool.client_ids)
    return datasets.Cohort(jax.tree.map(lambda a: a[rows], pool.batches), pool.mask[rows],
                           pool.num_examples[rows], ids.astype(np.int32))

  spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), load([0]))
  return streaming.Clients(range(clients), load, spec)


def _rss_bytes() -> tuple[int, int]:
  """(current, peak) resident memory of this process, in bytes (Linux)."""
  import resource  # pylint: disable=g-import-not-at-top
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  current = peak
  try:
    with open('/proc/self/statm', encoding='ascii') as f:
      current = int(f.read().split()[1]) * resource.getpagesize()
  except OSError:  # pragma: no cover - not Linux
    pass
  return current, peak


def streaming_round(model_name: str, clients: int, chunk: int, steps: int, batch: int,
                    lr: float = 0.01, emit: Callable[[dict], None] = print,
                    seed: int = 0, compare_jit: bool = False,
                    repeats: int = 3) -> dict:
  """One FedAvg round streamed in chunks of ``chunk`` clients: time and memory.

  Reports the process's peak resident memory (``peak_rss_bytes``; run one
  cohort size per process, as the peak never goes down) and its resident
  memory before the round. With ``compare_jit``, the compiled round on the
  same cohort (materialized) is timed interleaved with the streamed one and
  ``ratio_vs_jit`` is their ratio of medians.
  """
  from fedjx import streaming  # pylint: disable=g-import-not-at-top
  workload, loss_fn = _workload_and_loss(model_name, 'float32')
  source = lazy_clients(workload, clients, steps, batch, seed)
  example = source.load([0])
  params = workload.model.init(jax.random.key(seed),
                               jax.tree.map(lambda a: a[0, 0], example.batches))
  algo = _fedavg(loss_fn, lr, steps, 'auto', None, False)
  state, key = algo.init(params), jax.random.key(seed)
  rss_before, _ = _rss_bytes()

  streamer = streaming.Streamer(algo.apply, chunk)  # Traced and compiled once.

  def streamed():
    return streamer(state, source, key)

  calls = [streamed]
  if compare_jit:
    placed = datasets.place_cohort(source.load(range(clients)))
    jitted = jax.jit(algo.apply)
    calls.append(lambda: jitted(state, placed, key))
    cpu: list[list[float]] = [[], []]
    timings = _time_interleaved(calls, repeats, min_seconds=0.0, cpu=cpu)
  else:
    start = time.perf_counter()
    jax.block_until_ready(streamed())
    first = time.perf_counter() - start
    timings = [(first, first, first)]
  _, peak = _rss_bytes()
  rec = {'model': model_name, 'clients': clients, 'steps': steps, 'batch': batch,
         'kind': 'streaming', 'chunk_clients': chunk,
         'backend': jax.default_backend(),
         'first_call_s': timings[0][0], 'ms_per_round': 1e3 * timings[0][1],
         'rss_before_round_bytes': rss_before, 'peak_rss_bytes': peak,
         'device_peak_bytes_so_far': device_peak_bytes(),
         'data_bytes_per_chunk': chunk * sum(
             int(np.prod(a.shape[1:])) * a.dtype.itemsize
             for a in jax.tree.leaves(example)),
         'data_bytes_of_cohort': clients * sum(
             int(np.prod(a.shape[1:])) * a.dtype.itemsize
             for a in jax.tree.leaves(example))}
  if compare_jit:
    rec['jit_ms_per_round'] = 1e3 * timings[1][1]
    rec['ratio_vs_jit'] = timings[0][1] / timings[1][1]
    rec['min_ratio_vs_jit'] = timings[0][2] / timings[1][2]
    # Per repetition (interleaved pairs): wall and CPU time ratios.
    rec['cpu_s_per_round'] = statistics.median(cpu[0])
    rec['jit_cpu_s_per_round'] = statistics.median(cpu[1])
    rec['cpu_ratio_vs_jit'] = statistics.median(a / b for a, b in zip(*cpu))
    rec['cpu_ratios_vs_jit'] = [a / b for a, b in zip(*cpu)]
  emit(rec)
  return rec


def streaming_from_dataset(clients: int, chunk: int | None, steps: int, batch: int,
                           lr: float = 0.01, emit: Callable[[dict], None] = print,
                           seed: int = 0) -> dict:
  """One FedAvg round of logistic regression on a Synthetic(1, 1) population
  of ``clients`` clients, all in the cohort, streamed as the runner streams it.

  The cohort comes from ``fedjx.datasets.prefetch.lazy_cohort_iterator`` (ids
  and a step count; each chunk's clients generated, batched and transferred
  when the round reaches them) and runs through
  ``fedjx.execution.round_runner(..., 'streaming', chunk)``, the runner's
  path for ``config.execution='streaming'``. Reports the process's peak
  resident memory (run one cohort size per process).
  """
  from fedjx import execution  # pylint: disable=g-import-not-at-top
  workload, loss_fn = _workload_and_loss('logreg', 'float32')
  population = datasets.synthetic(1.0, 1.0, num_clients=clients, seed=seed,
                                  max_examples=60)
  algo = _fedavg(loss_fn, lr, steps, 'auto', None, False)
  cohorts = datasets.prefetch.lazy_cohort_iterator(
      population, clients, batch, seed=seed, num_rounds=1, num_steps=steps)
  cohort = next(cohorts)
  cohorts.close()
  example = cohort.load(cohort.client_ids[:1])
  params = workload.model.init(jax.random.key(seed),
                               jax.tree.map(lambda a: a[0, 0], example.batches))
  state, key = algo.init(params), jax.random.key(seed)
  run = execution.round_runner(algo, 'streaming', chunk)
  rss_before, _ = _rss_bytes()
  start = time.perf_counter()
  jax.block_until_ready(run(state, cohort, key))
  seconds = time.perf_counter() - start
  _, peak = _rss_bytes()
  per_client = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize
                   for a in jax.tree.leaves(example))
  k = run.chunk_for(cohort)
  rec = {'model': 'logreg', 'clients': clients, 'steps': steps, 'batch': batch,
         'kind': 'streaming_from_dataset', 'chunk_clients': k,
         'backend': jax.default_backend(), 'first_call_s': seconds,
         'rss_before_round_bytes': rss_before, 'peak_rss_bytes': peak,
         'data_bytes_per_chunk': k * per_client,
         'data_bytes_of_cohort': clients * per_client}
  emit(rec)
  return rec


def plot(records: Sequence[dict], path: str) -> None:
  """ms per round against cohort size, one panel per model, one line per strategy."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  names = sorted({r['model'] for r in records})
  labels = list(dict.fromkeys(r['strategy'] for r in records))
  colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
  for ax, name in zip(axes[0], names):
    rows = [r for r in records if r['model'] == name]
    for strategy in dict.fromkeys(r['strategy'] for r in rows):
      pts = sorted((r['clients'], r['ms_per_round']) for r in rows if r['strategy'] == strategy)
      style = '--' if any(r['kind'] == 'reference' and r['strategy'] == strategy for r in rows) else '-'
      ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker='o',
              label=strategy, color=colors[strategy])
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('clients per round')
    ax.set_ylabel('ms per FedAvg round')
    ax.set_title(f'{name} ({rows[0]["backend"]})')
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0]
  cost = cost or {}
  return {k: float(cost.get(k, float('nan'))) for k in ('flops', 'bytes accessed')}


def guard_cost(model_names: Sequence[str], cohort_sizes: Sequence[int],
               strategy: str, steps: int, batch: int, pairs: int = 200,
               lr: float = 0.01, emit: Callable[[dict], None] = print,
               seed: int = 0, client_evaluation: bool = False) -> list[dict]:
  """The cost of the non-finite guard: FedAvg with ``skip_nonfinite`` on / off.

  Three programs are compiled: the guarded round (``on``), the unguarded one
  (``off``) and a second, separately built unguarded one (``off2``, the
  control). Then ``pairs`` times, in an order that alternates, each is run
  once; ``ratio_on_off`` is the median over repetitions of ``t_on / t_off``
  within the same repetition (paired, so the machine's drifts cancel), and
  ``ratio_off2_off`` the same for the two identical programs: the noise
  floor of the measurement. XLA's cost analysis of the compiled programs
  gives the added work without noise (``flops_ratio``,
  ``bytes_ratio``).
  """
  name_, chunk = parse_strategy(strategy)
  records = []
  for name in model_names:
    workload, loss_fn = _workload_and_loss(name, 'float32')
    for clients in cohort_sizes:
      cohort = make_cohort(workload, clients, steps, batch, seed)
      params = workload.model.init(jax.random.key(seed),
                                   jax.tree.map(lambda a: a[0, 0], cohort.batches))
      placed = datasets.place_cohort(cohort)
      key = jax.random.key(seed)
      calls, costs = [], []
      for skip in (True, False, False):
        algo = algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(lr),
                                 local_steps=steps, client_evaluation=client_evaluation,
                                 skip_nonfinite=skip).compile(map_strategy=name_,
                                                              chunk_size=chunk)
        holder = {'state': algo.init(params)}

        def one_round(algo=algo, holder=holder):
          holder['state'], metrics = algo.round(holder['state'], placed, key)
          return metrics
        compiled, _ = _compile(jax.jit(algo.apply), algo.init(params), placed, key)
        costs.append(_cost(compiled))
        jax.block_until_ready(one_round())  # Compile and warm up.
        calls.append(one_round)
      times: list[list[float]] = [[] for _ in calls]
      for r in range(pairs):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for k in order:
          start = time.perf_counter()
          jax.block_until_ready(calls[k]())
          times[k].append(time.perf_counter() - start)
      on, off, off2 = times
      rec = {'model': name, 'clients': clients, 'steps': steps, 'batch': batch,
             'strategy': strategy, 'client_evaluation': client_evaluation,
             'backend': jax.default_backend(), 'pairs': pairs,
             'ms_guard_on': 1e3 * statistics.median(on),
             'ms_guard_off': 1e3 * statistics.median(off),
             'ratio_on_off': statistics.median(a / b for a, b in zip(on, off)),
             'ratio_off2_off': statistics.median(a / b for a, b in zip(off2, off)),
             'min_ratio_on_off': min(on) / min(off),
             'flops_ratio': costs[0]['flops'] / costs[1]['flops'],
             'bytes_ratio': costs[0]['bytes accessed'] / costs[1]['bytes accessed']}
      emit(rec)
      records.append(rec)
  return records


def guard_cost_in_runs(configs: dict[str, Any], rounds: int = 20, pairs: int = 400,
                       emit: Callable[[dict], None] = print) -> list[dict]:
  """The cost of ``config.nonfinite`` in the runner's own round loop.

  For each named config (``ml_collections``, e.g. a shipped one), three
  experiments are built: ``nonfinite='skip'`` (the default: guarded
  builders, the server model checked in the round's program) and twice
  ``'off'`` (the second is the A/A control). Their first ``rounds`` cohorts
  are loaded once; then ``pairs`` times, in a random order (seeded; no
  experiment keeps a position, which shifts a round's time by about 1%), each
  experiment runs one round as the runner does (the round it would run,
  unguarded first where it does so,
  :func:`fedjx.experiments.experiment.round_algorithms`, and
  the fetch of its metrics with the check's flag), cycling through the
  cohorts from the initial state. ``ratio_on_off`` is the median over repetitions of
  ``t_skip / t_off`` within a repetition, ``ratio_off2_off`` the same for the
  two identical experiments.
  """
  # The experiment layer imports the registry and every algorithm; import
  # it here to keep `import round_bench` light.
  from fedjx import execution  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import config as config_lib  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import experiment  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import loop  # pylint: disable=g-import-not-at-top
  records = []
  for name, config in configs.items():
    loops, first_unguarded = [], False
    for policy in ('skip', 'off', 'off'):
      c = config_lib.with_defaults(config)
      c.nonfinite = policy
      exp = experiment.build(c)
      guarded, unguarded = experiment.round_algorithms(c, exp)
      first_unguarded = first_unguarded or unguarded is not None
      loops.append((exp, execution.round_runner(unguarded or guarded, c.execution,
                                                c.chunk_size, lambda _: None)))
    exp0 = loops[0][0]
    cohorts = list(exp0.cohorts(0, rounds))
    keys = [exp0.round_key_for(r) for r in range(rounds)]
    states = [exp.algorithm.init(exp.init_params) for exp, _ in loops]

    def one_round(k, r):
      states[k], metrics = loops[k][1](states[k], cohorts[r], keys[r])
      loop.host_scalars(metrics)

    for k in range(len(loops)):  # Compile and warm up.
      one_round(k, 0)
    shuffle = np.random.default_rng(0)
    times: list[list[float]] = [[] for _ in loops]
    for i in range(pairs):
      r = i % rounds
      if r == 0:
        states = [exp.algorithm.init(exp.init_params) for exp, _ in loops]
      order = shuffle.permutation(len(loops))
      for k in order:
        start = time.perf_counter()
        one_round(k, r)
        times[k].append(time.perf_counter() - start)
    on, off, off2 = times
    c = exp0.config
    rec = {'config': name, 'algorithm': c.algorithm.name, 'model': c.model.name,
           'unguarded_first': first_unguarded, 'cohort_size': c.cohort_size,
           'backend': jax.default_backend(), 'rounds': rounds, 'pairs': pairs,
           'ms_skip': 1e3 * statistics.median(on),
           'ms_off': 1e3 * statistics.median(off),
           'ratio_on_off': statistics.median(a / b for a, b in zip(on, off)),
           'ratio_off2_off': statistics.median(a / b for a, b in zip(off2, off))}
    emit(rec)
    records.append(rec)
  return records


def dumps(record: dict) -> str:
  return json.dumps(record, sort_keys=True)
