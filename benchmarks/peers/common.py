"""What every peer script shares: the setup, its data, the clock, the record.

Only NumPy and the standard library, so that it imports in each peer's
virtualenv. The task is pfl-research's CIFAR-10 cross-device benchmark: a
cohort of 50 users, 1 local epoch of SGD (learning rate 0.1, batch 10),
server SGD with learning rate 1.0 (the example-weighted mean of the local
models), pfl-research's 2-conv CNN (``simple_cnn``: conv 3x3x32, conv
3x3x64, max-pool 2, dense 128, dense 10; 1,626,442 parameters). The images
are synthetic and CIFAR-shaped: seeded uint8 ``[n, 32, 32, 3]``, divided by
255 to float32, labels uniform in 0..9. Dropout is left out everywhere.

Two setups:

* ``equal``: 50 users x 50 images (pfl-research's setup);
* ``skewed``: 50 users of log-normal sizes (median 50, sigma 0.8, at least
  1 image), the same sizes for every framework.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

START = time.perf_counter()

COHORT, BATCH, LOCAL_LR, SERVER_LR, EPOCHS = 50, 10, 0.1, 1.0, 1
IMAGE, CLASSES = (32, 32, 3), 10
SETUPS = ('equal', 'skewed')
NUM_PARAMS = 1_626_442


def sizes(setup: str) -> np.ndarray:
  if setup == 'equal':
    return np.full(COHORT, 50)
  if setup == 'skewed':
    rng = np.random.default_rng(0)
    return np.maximum(1, np.round(50 * np.exp(0.8 * rng.normal(size=COHORT)))).astype(int)
  raise ValueError(f'setup={setup!r} is not one of {SETUPS}.')


def client_data(setup: str) -> list[tuple[np.ndarray, np.ndarray]]:
  """Each user's ``(x float32 [n, 32, 32, 3] in [0, 1], y int64 [n])``."""
  rng = np.random.default_rng(1)
  out = []
  for n in sizes(setup):
    x = rng.integers(0, 256, size=(int(n),) + IMAGE, dtype=np.uint8)
    y = rng.integers(0, CLASSES, size=int(n))
    out.append(((x / 255.0).astype(np.float32), y.astype(np.int64)))
  return out


def tree_cpu_seconds(pid: int | None = None) -> float:
  """User + system CPU seconds of a process and all its live descendants
  (threads included; Ray's workers under Flower are descendants)."""
  tick = os.sysconf('SC_CLK_TCK')
  children: dict[int, list[int]] = {}
  stats: dict[int, float] = {}
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    except OSError:
      continue
    children.setdefault(int(fields[1]), []).append(int(name))
    stats[int(name)] = (int(fields[11]) + int(fields[12])) / tick
  total, todo = 0.0, [pid or os.getpid()]
  while todo:
    p = todo.pop()
    total += stats.get(p, 0.0)
    todo.extend(children.get(p, []))
  return total


class Clock:
  """Marks the end of each round: CPU of the process tree, wall time."""

  def __init__(self):
    self.marks = [(tree_cpu_seconds(), time.perf_counter())]
    self.first_round_s = None

  def start(self):
    self.marks = [(tree_cpu_seconds(), time.perf_counter())]

  def tick(self):
    self.marks.append((tree_cpu_seconds(), time.perf_counter()))
    if self.first_round_s is None:
      self.first_round_s = self.marks[-1][1] - START

  def rounds(self):
    """(cpu, wall) seconds of each round after the first (the warm-up)."""
    m = self.marks
    return [(m[i + 1][0] - m[i][0], m[i + 1][1] - m[i][1])
            for i in range(1, len(m) - 1)]


def report(framework: str, version: str, setup: str, clock: Clock,
           threads: dict, **extra):
  timed = clock.rounds()
  if not timed and len(clock.marks) == 2:
    # One round in all: it is the measure (flagged), for the slow peers
    # whose first round compiles nothing.
    (c0, w0), (c1, w1) = clock.marks
    timed = [(c1 - c0, w1 - w0)]
    extra['measured_first_round'] = True
  cpu = [c for c, _ in timed]
  wall = [w for _, w in timed]
  record = {
      'framework': framework, 'version': version, 'setup': setup,
      'cpu_s_per_round': round(float(np.median(cpu)), 3) if cpu else None,
      'wall_s_per_round': round(float(np.median(wall)), 3) if wall else None,
      'time_to_first_round_s': round(clock.first_round_s, 3),
      'threads': threads, 'rounds': len(timed),
      'cpu_s_rounds': [round(c, 3) for c in cpu],
      'wall_s_rounds': [round(w, 3) for w in wall],
      'clients': COHORT, 'examples': int(sizes(setup).sum()),
      'python': sys.version.split()[0], 'cpu_count': os.cpu_count(),
      'loadavg_1m': round(os.getloadavg()[0], 2)}
  record.update(extra)
  print(json.dumps(record), flush=True)


def parse_args(description: str, extra=None):
  import argparse
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--setup', default='equal', choices=SETUPS)
  parser.add_argument('--rounds', type=int, default=3,
                      help='rounds in all; the first is the warm-up')
  parser.add_argument('--conv', default='patches', choices=('patches', 'xla'),
                      help="the JAX rounds' convolution: fedjx.models' patches "
                           "(its default) or lax.conv_general_dilated, which "
                           'XLA:CPU runs several times slower inside a loop')
  if extra is not None:
    extra(parser)
  return parser.parse_args()
