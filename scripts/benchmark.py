"""FedAvg round time against cohort size for each map strategy (JSON lines).

Example (CPU):
  python scripts/benchmark.py --models=logreg,cnn,transformer \
      --clients=4,8,16,32,64 --strategies=vmap,chunked:4,sequential,auto \
      --steps=2 --batch=8 --out=runs/benchmark_cpu.jsonl --plot=runs/benchmark_cpu.png
On a GPU use --clients=16,64,256,1024,4096 and chunk sizes such as chunked:64.
The cost of the non-finite guard (skip_nonfinite on / off, paired timing):
  python scripts/benchmark.py --models=logreg,cnn --clients=8,32 --strategies=auto \
      --guard_cost=200
and in the runner's own round loop on shipped configs (nonfinite='skip' / 'off'):
  python scripts/benchmark.py --guard_cost=400 \
      --guard_configs=configs/fedavg_digits.py,configs/fedprox_synthetic.py

Streamed rounds (fedjx.streaming), one cohort size per process:
  for n in 1000 10000 100000 1000000; do
    python scripts/benchmark.py --streaming=1000 --models=logreg --clients=$n \
        --steps=2 --batch=8; done
  python scripts/benchmark.py --streaming=64 --models=logreg,cnn --clients=1024 \
      --compare_jit --steps=2 --batch=8 --repeats=5

The runner's streamed path (lazy cohorts from a FederatedDataset), peak memory:
  for n in 1000 10000 100000; do
    python scripts/benchmark.py --streaming=0 --from_dataset --clients=$n; done

Fused against stacked (fedjx.fusion), memory plan and interleaved time:
  python scripts/benchmark.py --compile_only --models=cnn --clients=1024,10000 \
      --strategies=auto,nofuse:auto --steps=8 --batch=20
  python scripts/benchmark.py --models=cnn --clients=16,64 \
      --strategies=auto,nofuse:auto --no_references --repeats=10
"""

import os
import sys

from absl import app
from absl import flags

# The benchmark is the repository's tooling, not part of the installed package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                os.pardir, 'benchmarks'))
import round_bench as benchmark  # pylint: disable=g-import-not-at-top,wrong-import-position

_MODELS = flags.DEFINE_list('models', ['logreg', 'cnn', 'transformer'], 'Models.')
_CLIENTS = flags.DEFINE_list('clients', ['4', '8', '16', '32', '64'], 'Cohort sizes.')
_STRATEGIES = flags.DEFINE_list(
    'strategies', ['vmap', 'chunked:4', 'sequential', 'auto'],
    'Map strategies; chunked:K sets the chunk size; a nofuse: prefix runs the '
    'round with its client outputs stacked before the reductions (no fusion).')
_STEPS = flags.DEFINE_integer('steps', 2, 'Local SGD steps per client.')
_BATCH = flags.DEFINE_integer('batch', 8, 'Examples per local step.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed rounds after the first.')
_OUT = flags.DEFINE_string('out', None, 'Also append the JSON lines to this file.')
_PLOT = flags.DEFINE_string('plot', None, 'Write a plot of ms/round to this PNG.')
_PRECISION = flags.DEFINE_enum('precision', 'float32', ['float32', 'bfloat16'],
                               'Compute dtype (bfloat16 keeps float32 master weights).')
_NO_REFS = flags.DEFINE_bool('no_references', False, 'Skip the reference rounds.')
_COMPILE_ONLY = flags.DEFINE_bool(
    'compile_only', False,
    "Only compile each round from shapes and print XLA's memory plan.")
_GUARD_COST = flags.DEFINE_integer(
    'guard_cost', 0,
    'If > 0, instead time this many interleaved repetitions of FedAvg with '
    'skip_nonfinite on and off (first strategy of --strategies) and print '
    'their paired ratio.')
_GUARD_CONFIGS = flags.DEFINE_list(
    'guard_configs', [],
    "With --guard_cost: time the runner's round loop of these config files "
    "(path[:arg]) with nonfinite='skip' and 'off' instead of the models.")
_STREAMING = flags.DEFINE_integer(
    'streaming', None,
    'Stream one FedAvg round per cohort size in chunks of this many clients '
    '(fedjx.streaming) and print its time and peak resident memory; run one '
    'cohort size per process for the peak.')
_FROM_DATASET = flags.DEFINE_bool(
    'from_dataset', False,
    'With --streaming (0: the default chunk size): stream a Synthetic(1, 1) '
    'population of --clients clients (logistic regression, all in the '
    "cohort) through the runner's lazy cohort path and print its time and "
    'peak resident memory.')
_COMPARE_JIT = flags.DEFINE_bool(
    'compare_jit', False, 'With --streaming: also time the compiled round, '
    'interleaved, and print the ratio.')
_EVALUATION = flags.DEFINE_bool(
    'client_evaluation', False,
    "Also evaluate each client before and after training (fedjx's default in "
    'experiments; the references do not do it).')


def main(argv):
  del argv
  out = open(_OUT.value, 'a') if _OUT.value else None

  def emit(record):
    line = benchmark.dumps(record)
    print(line, flush=True)
    if out:
      out.write(line + '\n')
      out.flush()

  if _GUARD_COST.value and _GUARD_CONFIGS.value:
    from fedjx.experiments import cli  # pylint: disable=g-import-not-at-top
    benchmark.guard_cost_in_runs(
        {spec: cli.load_config_file(spec) for spec in _GUARD_CONFIGS.value},
        pairs=_GUARD_COST.value, emit=emit)
    if out:
      out.close()
    return
  if _GUARD_COST.value:
    benchmark.guard_cost(_MODELS.value, [int(c) for c in _CLIENTS.value],
                         _STRATEGIES.value[0], _STEPS.value, _BATCH.value,
                         pairs=_GUARD_COST.value, emit=emit,
                         client_evaluation=_EVALUATION.value)
    if out:
      out.close()
    return
  if _STREAMING.value is not None and _FROM_DATASET.value:
    for clients in _CLIENTS.value:
      benchmark.streaming_from_dataset(int(clients), _STREAMING.value or None,
                                       _STEPS.value, _BATCH.value, emit=emit)
    if out:
      out.close()
    return
  if _STREAMING.value:
    for name in _MODELS.value:
      for clients in _CLIENTS.value:
        benchmark.streaming_round(name, int(clients), _STREAMING.value, _STEPS.value,
                                  _BATCH.value, emit=emit, compare_jit=_COMPARE_JIT.value,
                                  repeats=_REPEATS.value)
    if out:
      out.close()
    return
  if _COMPILE_ONLY.value:
    benchmark.compile_only(_MODELS.value, [int(c) for c in _CLIENTS.value],
                           _STRATEGIES.value, _STEPS.value, _BATCH.value,
                           emit=emit, precision=_PRECISION.value,
                           client_evaluation=_EVALUATION.value)
    if out:
      out.close()
    return
  records = benchmark.run(_MODELS.value, [int(c) for c in _CLIENTS.value],
                          _STRATEGIES.value, _STEPS.value, _BATCH.value,
                          _REPEATS.value, emit=emit, references=not _NO_REFS.value,
                          precision=_PRECISION.value,
                          client_evaluation=_EVALUATION.value)
  if _PLOT.value:
    benchmark.plot(records, _PLOT.value)
  if out:
    out.close()


if __name__ == '__main__':
  app.run(main)
