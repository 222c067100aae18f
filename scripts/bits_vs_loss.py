"""Held-out loss against bits sent and against a simulated clock, at equal tokens.

Runs (or reads, when a finished ``metrics.jsonl`` is already there) one
workdir per arm under ``ROOT``, every arm on the byte-level stdlib text of
``configs/diloco_text.py`` at a CPU scale (overrides in
:data:`COMMON`), with the same rounds x inner steps x batch x replicas:

* data-parallel: one replica of batch ``K B`` whose outer step is SGD with
  learning rate 1 and no momentum, i.e. plain AdamW with batch ``K B`` (as
  in ``configs/diloco_text_equal_compute.py``'s ``dp`` arm);
* DiLoCo, float32 outer gradients (Nesterov 0.7 / 0.9);
* Streaming DiLoCo (``configs/streaming_diloco_text.py``, P = 2 fragments,
  e3m0 outer gradients), tau in {0, 4} and alpha in {0, 0.5};
* DiLoCo with the compressed outer steps: ``sparseloco`` (k = 16 of each
  chunk of 256, outer SGD learning rate 1), ``muloco_quantized`` (2 bits,
  DiLoCo's outer Nesterov) and ``demo`` (chunks of 64, k = 32, sign step,
  outer SGD learning rates 0.01 and 0.03), both with flat 1-D chunks
  (``chunk_shape='1d'``, as the recorded runs were measured; the default is
  the papers' 2-D tiles).

**Bits.** For the DiLoCo family, the sum over rounds of
``communicated_bytes * 8`` (what every replica uploads, summed over
replicas). For data-parallel, the gradient all-reduce the ``K``-replica run
would send: every replica uploads its float32 gradient (``32 d`` bits, ``d``
parameters, read from the run's own ``communicated_bytes``) every inner
step: ``rounds * H * K * 32 d``.

**Clock** (:mod:`fedjx.experiments.network`). Every inner step of one
replica takes ``step_seconds`` (a stated assumption, ``--step-seconds``),
the ``K`` replicas reduce over a ring of ``Link.gbps(b)`` links (no latency)
at each bandwidth ``b``, with no overlap of communication and compute except
Streaming DiLoCo's tau. The payload of a reduction is one replica's bytes as
the run reports them (``communicated_bytes / clients``): data-parallel
reduces ``4 d`` bytes every step (``Schedule.data_parallel``); DiLoCo and
its compressed variants their message every ``H`` steps
(``Schedule.diloco``); Streaming DiLoCo, which sends one fragment per round
of ``S`` steps, the sum of its ``P`` fragments every ``H = P S`` steps
(``Schedule.streaming_diloco``, tau overlapped). A compressed message is
charged as a ring all-reduce of its bytes; a sparse or quantized message
that cannot be summed on the way (an all-gather) would take ``K / 2`` times
as long.

  python scripts/bits_vs_loss.py runs/bits_vs_loss --out benchmarks/results/bits_vs_loss

writes ``<out>.jsonl`` (one line per arm), ``<out>.png`` and prints the
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fedjx.experiments import metrics_writers
from fedjx.experiments import network

REPLICAS = 4
ROUNDS = 16
INNER_STEPS = 16
BATCH_SIZE = 8
FRAGMENTS = 2
OVERLAP_STEPS = 4

COMMON = (f'--config.rounds={ROUNDS}', f'--config.local_steps={INNER_STEPS}',
          '--config.seed=0', '--config.model.width=32',
          '--config.dataset.seq_len=32', '--config.eval_every=4',
          '--config.eval_max_examples=512', '--config.checkpoint_every=1000')

_SGD1 = "--config.algorithm.outer_optimizer={'name': 'sgd', 'learning_rate': 1.0}"


def _demo(lr: float) -> tuple[str, ...]:
  return (f"--config.algorithm.outer_optimizer={{'name': 'sgd', 'learning_rate': {lr}}}",
          "--config.algorithm.aggregator={'name': 'demo', 'num_replicas': 4, "
          "'chunk_size': 64, 'k': 32, 'beta': 0.999, 'chunk_shape': '1d'}")


def _streaming(tau: int, alpha: float) -> dict[str, Any]:
  return dict(
      name=f'streaming_p{FRAGMENTS}_tau{tau}_alpha{alpha:g}',
      label=f'Streaming DiLoCo P={FRAGMENTS}, tau={tau}, alpha={alpha:g} (e3m0)',
      config='configs/streaming_diloco_text.py', schedule='streaming_diloco',
      fragments=FRAGMENTS, overlap_steps=tau,
      overrides=(f'--config.algorithm.num_fragments={FRAGMENTS}',
                 f'--config.algorithm.overlap_steps={tau}',
                 f'--config.algorithm.mixing_factor={alpha}'))


ARMS: tuple[dict[str, Any], ...] = (
    dict(name='data_parallel', label=f'data-parallel (batch {REPLICAS * BATCH_SIZE})',
         config='configs/diloco_text.py:1', schedule='data_parallel',
         overrides=(f'--config.batch_size={REPLICAS * BATCH_SIZE}',
                    "--config.algorithm.outer_optimizer={'name': 'sgd', "
                    "'learning_rate': 1.0, 'momentum': 0.0, 'nesterov': True}")),
    dict(name='diloco', label='DiLoCo (float32)', config='configs/diloco_text.py',
         schedule='diloco', overrides=()),
    _streaming(0, 0.0), _streaming(0, 0.5),
    _streaming(OVERLAP_STEPS, 0.0), _streaming(OVERLAP_STEPS, 0.5),
    dict(name='sparseloco', label='DiLoCo + SparseLoCo (k=16/256, 2-bit)',
         config='configs/diloco_text.py', schedule='diloco',
         overrides=(_SGD1, "--config.algorithm.aggregator={'name': 'sparseloco', "
                    "'num_replicas': 4, 'k': 16, 'chunk_size': 256, "
                    "'chunk_shape': '1d'}")),
    dict(name='muloco_quantized', label='DiLoCo + MuLoCo-style 2-bit',
         config='configs/diloco_text.py', schedule='diloco',
         overrides=("--config.algorithm.aggregator={'name': 'muloco_quantized', "
                    "'num_replicas': 4, 'bits': 2}",)),
    dict(name='demo_lr0.01', label='DiLoCo + DeMo (k=32/64, lr 0.01)',
         config='configs/diloco_text.py', schedule='diloco', overrides=_demo(0.01)),
    dict(name='demo_lr0.03', label='DiLoCo + DeMo (k=32/64, lr 0.03)',
         config='configs/diloco_text.py', schedule='diloco', overrides=_demo(0.03)),
)


def _finished(workdir: str, rounds: int) -> bool:
  try:
    rows = metrics_writers.read_metrics(workdir)
  except (FileNotFoundError, OSError, ValueError):
    return False
  return any(r.get('round') == rounds and 'eval_loss' in r for r in rows)


def run_arm(arm: Mapping[str, Any], root: str) -> float | None:
  """Runs ``arm`` into ``root/<name>`` unless finished there; its seconds, or None."""
  workdir = os.path.join(root, arm['name'])
  if _finished(workdir, ROUNDS):
    return None
  shutil.rmtree(workdir, ignore_errors=True)
  exe = shutil.which('fedjx-run') or 'fedjx-run'
  cmd = [exe, '--config', arm['config'], '--workdir', workdir, *COMMON,
         *arm['overrides']]
  start = time.monotonic()
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
  return time.monotonic() - start


def train_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """The rows of training rounds (those with ``communicated_bytes``)."""
  return [r for r in rows if isinstance(r.get('communicated_bytes'), (int, float))]


def eval_curve(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
  """``(round, eval_loss)`` of every evaluated round, in order."""
  return [(int(r['round']), float(r['eval_loss'])) for r in rows
          if isinstance(r.get('eval_loss'), (int, float))]


def total_bits(rows: Sequence[Mapping[str, Any]], schedule: str,
               inner_steps: int = INNER_STEPS, replicas: int = REPLICAS) -> float:
  """Bits every replica sends over the run, summed (the module docstring).

  ``'data_parallel'``: the run is one replica of batch ``K B``; its
  ``communicated_bytes`` are the float32 model (``4 d``), which each of
  ``replicas`` replicas would all-reduce every inner step.
  """
  train = train_rows(rows)
  if schedule == 'data_parallel':
    return sum(8.0 * r['communicated_bytes'] / r['clients'] * inner_steps * replicas
               for r in train)
  return sum(8.0 * r['communicated_bytes'] for r in train)


def payload_bytes(rows: Sequence[Mapping[str, Any]], fragments: int = 1) -> float:
  """One replica's bytes per reduction of the whole model (mean over rounds).

  Streaming DiLoCo sends one of ``fragments`` fragments each round, so one
  reduction of the whole model is ``fragments`` rounds' bytes.
  """
  train = train_rows(rows)
  if not train:
    raise ValueError('rows hold no round with communicated_bytes.')
  per_round = [r['communicated_bytes'] / r['clients'] for r in train]
  return fragments * sum(per_round) / len(per_round)


def round_seconds(arm: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                  step_seconds: float, gbps: float, inner_steps: int = INNER_STEPS,
                  replicas: int = REPLICAS) -> float:
  """Simulated wall clock of one round of the run (``inner_steps`` steps)."""
  compute = network.Compute.from_step_seconds(step_seconds)
  net = network.Network(network.Link.gbps(gbps))
  schedule = arm['schedule']
  if schedule == 'data_parallel':
    timing = network.simulate(network.Schedule.data_parallel(), compute, net,
                              payload_bytes(rows), replicas)
    return inner_steps * timing.step_seconds
  if schedule == 'diloco':
    timing = network.simulate(network.Schedule.diloco(inner_steps), compute, net,
                              payload_bytes(rows), replicas)
    return timing.round_seconds
  p = arm['fragments']
  timing = network.simulate(
      network.Schedule.streaming_diloco(p * inner_steps, p, arm['overlap_steps']),
      compute, net, payload_bytes(rows, p), replicas)
  return timing.round_seconds / p


def summarize(arm: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
              step_seconds: float, bandwidths: Sequence[float]) -> dict[str, Any]:
  """One line of the study: final loss, bits, clock at each bandwidth, curves."""
  curve = eval_curve(rows)
  bits = total_bits(rows, arm['schedule'])
  rounds = len(train_rows(rows))
  per_round = bits / rounds
  out = dict(arm=arm['name'], label=arm['label'], schedule=arm['schedule'],
             rounds=rounds, inner_steps=INNER_STEPS, batch_size=BATCH_SIZE,
             replicas=REPLICAS, final_eval_loss=curve[-1][1],
             total_bits=bits, payload_bytes_per_replica=payload_bytes(
                 rows, arm.get('fragments', 1)),
             step_seconds=step_seconds,
             curve_rounds=[r for r, _ in curve], curve_eval_loss=[l for _, l in curve],
             curve_bits=[per_round * r for r, _ in curve])
  for gbps in bandwidths:
    seconds = round_seconds(arm, rows, step_seconds, gbps)
    out[f'wall_clock_s_{gbps:g}gbps'] = seconds * rounds
    out[f'curve_wall_clock_s_{gbps:g}gbps'] = [seconds * r for r, _ in curve]
  return out


def table(lines: Sequence[Mapping[str, Any]], bandwidths: Sequence[float]) -> str:
  """The Markdown table, one row per arm."""
  clocks = ' | '.join(f'simulated clock at {b:g} Gbit/s (s)' for b in bandwidths)
  dp = next((l for l in lines if l['schedule'] == 'data_parallel'), None)
  out = [f'| arm | held-out loss | total bits | bits / data-parallel\'s | {clocks} |',
         '|---|---|---|---|' + '---|' * len(bandwidths)]
  for l in lines:
    ratio = f'{l["total_bits"] / dp["total_bits"]:.2e}' if dp else '–'
    clock = ' | '.join(f'{l[f"wall_clock_s_{b:g}gbps"]:.2f}' for b in bandwidths)
    out.append(f'| {l["label"]} | {l["final_eval_loss"]:.3f} | '
               f'{l["total_bits"]:.3e} | {ratio} | {clock} |')
  return '\n'.join(out)


def plot(lines: Sequence[Mapping[str, Any]], bandwidths: Sequence[float],
         path: str) -> str:
  """Loss against total bits (log x), and against the clock at each bandwidth."""
  from fedjx.experiments import plotting  # pylint: disable=g-import-not-at-top,unused-import
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 1 + len(bandwidths), figsize=(5 * (1 + len(bandwidths)), 4.2))
  markers = 'osD^v<>pP*X'
  for i, l in enumerate(lines):
    style = dict(marker=markers[i % len(markers)], markersize=4, label=l['label'])
    axes[0].plot(l['curve_bits'][1:], l['curve_eval_loss'][1:], **style)
    for ax, b in zip(axes[1:], bandwidths):
      ax.plot(l[f'curve_wall_clock_s_{b:g}gbps'], l['curve_eval_loss'], **style)
  axes[0].set_xscale('log')
  axes[0].set_xlabel('total bits sent (all replicas)')
  for ax, b in zip(axes[1:], bandwidths):
    ax.set_xlabel(f'simulated wall clock (s), {b:g} Gbit/s ring')
  for ax in axes:
    ax.set_ylabel('held-out loss')
    ax.set_ylim(top=min(4.0, max(max(l['curve_eval_loss'][1:]) for l in lines) + 0.1))
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=6)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('root', help='one workdir per arm under it (run if unfinished)')
  parser.add_argument('--out', default='benchmarks/results/bits_vs_loss')
  parser.add_argument('--step-seconds', type=float, default=0.01,
                      help='one replica\'s inner step, for the simulated clock')
  parser.add_argument('--gbps', type=float, nargs='+', default=[0.1, 10.0],
                      help='ring bandwidths, Gbit/s (a 43k-parameter model: at 100 '
                      'Gbit/s every arm is compute-bound)')
  parser.add_argument('--arms', nargs='*', help='names of arms to keep (default all)')
  args = parser.parse_args(argv)
  arms = [a for a in ARMS if not args.arms or a['name'] in args.arms]
  lines = []
  for arm in arms:
    seconds = run_arm(arm, args.root)
    if seconds is not None:
      print(f'{arm["name"]}: ran in {seconds:.0f} s', file=sys.stderr)
    rows = metrics_writers.read_metrics(os.path.join(args.root, arm['name']))
    lines.append(summarize(arm, rows, args.step_seconds, args.gbps))
  with open(args.out + '.jsonl', 'w') as f:
    for l in lines:
      f.write(json.dumps(l) + '\n')
  plot(lines, args.gbps, args.out + '.png')
  print(table(lines, args.gbps))


if __name__ == '__main__':
  main()
