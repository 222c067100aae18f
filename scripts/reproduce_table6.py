"""Reproduces Table 6 of Charles et al. 2025 with the communication model.

Charles et al. 2025, "Communication-Efficient Language Model Training
Scales Reliably and Robustly: Scaling Laws for DiLoCo" (arXiv 2503.09799),
Table 6: the bandwidth a 10B-parameter model needs to reach 50, 80, 90, 95
and 99 % compute utilization, for data-parallel training and for DiLoCo
with H = 100 and H = 300 inner steps, taken as the smallest point of a grid
of bandwidths, after the simulation of Douillard et al. 2025 (Streaming
DiLoCo, arXiv 2501.18512).

The assumptions (docs/reproductions.md says where each comes from):

* the grid: 50 bandwidths spaced evenly in log from 0.1 to 1000 Gbit/s;
* 10B parameters, gradients and outer gradients in bfloat16 (2 bytes each),
  a ring all-reduce between 2 replicas;
* every reduction overlaps the backward pass of its step, 2/3 of the step
  (``overlap_fraction=2/3``);
* a step of ``STEP_SECONDS`` and a link latency of ``LATENCY_S``: not stated
  in what we could read of either paper, fitted to the table.

  python scripts/reproduce_table6.py [--step-seconds 1.18] [--latency-ms 62.5] [--layers L]

prints one JSON line per cell: schedule, target, paper (Gbit/s), ours
(Gbit/s, the grid point), ratio (ours / paper).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from fedjx.experiments import network

PARAMS = 10e9
BYTES_PER_PARAM = 2.0
REPLICAS = 2
OVERLAP = 2.0 / 3.0
STEP_SECONDS = 1.18
LATENCY_S = 0.0625
GRID_GBPS = tuple(float(b) for b in np.logspace(-1, 3, 50))
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)

PAPER = {
    'data_parallel': (104.8, 184.2, 222.3, 222.3, 390.7),
    'diloco_h100': (1.4, 6.2, 13.3, 23.3, 86.8),
    'diloco_h300': (0.5, 2.0, 4.3, 9.1, 41.0),
}
"""Table 6 of Charles et al. 2025, Gbit/s, for the targets of ``TARGETS``."""


def schedules(layers: int | None = None) -> dict[str, network.Schedule]:
  """The three rows of the table (``layers``: reduced layer by layer)."""
  return {
      'data_parallel': network.Schedule.data_parallel(OVERLAP, layers),
      'diloco_h100': network.Schedule.diloco(100, OVERLAP, layers),
      'diloco_h300': network.Schedule.diloco(300, OVERLAP, layers),
  }


def rows(step_seconds: float = STEP_SECONDS, latency_s: float = LATENCY_S,
         layers: int | None = None) -> list[dict]:
  """One dict per cell: schedule, target, paper, ours, ratio."""
  compute = network.Compute.from_step_seconds(step_seconds)
  out = []
  for name, schedule in schedules(layers).items():
    ours = network.required_bandwidth(
        schedule, compute, PARAMS * BYTES_PER_PARAM, GRID_GBPS, TARGETS,
        replicas=REPLICAS, latency_s=latency_s)
    for target, paper in zip(TARGETS, PAPER[name]):
      b = ours[target]
      out.append({'schedule': name, 'target': target, 'paper_gbps': paper,
                  'ours_gbps': None if b is None else round(b, 3),
                  'ratio': None if b is None else round(b / paper, 3)})
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--step-seconds', type=float, default=STEP_SECONDS,
                      help='compute time of one inner step (s)')
  parser.add_argument('--latency-ms', type=float, default=LATENCY_S * 1e3,
                      help='latency of one message on the link (ms)')
  parser.add_argument('--layers', type=int, default=None,
                      help='reduce layer by layer, L layers [no: one overlap fraction]')
  args = parser.parse_args(argv)
  for row in rows(args.step_seconds, args.latency_ms / 1e3, args.layers):
    print(json.dumps(row))


if __name__ == '__main__':
  main()
