"""The cross-device setups: many small clients, a small model, one epoch.

What every ``*_cross_device.py`` script shares, NumPy and the standard
library only (it imports in every peer's virtualenv). FedAvg over the whole
population each round: one local epoch of SGD (learning rate 0.1, batch 10)
over each client's examples, server SGD 1.0 (the example-weighted mean of
the local models). Setups:

* ``2nn-100`` and ``2nn-1000`` (and ``2nn-10000`` and ``2nn-100000``, the
  accelerator's scale): McMahan et al.'s 2NN (784-200-200-10, ReLU,
  softmax cross-entropy; 199,210 parameters) over 100 or 1,000 clients of
  log-normal sizes (median 20, sigma 0.8, at least 1; seed 0: 2,850 and
  26,038 examples, 334 and 3,054 steps of 10); MNIST-shaped inputs uniform
  in [0, 1), labels uniform in 0..9. ``2nn-100000`` (2.6M examples, 8.2 GB
  of inputs) draws its inputs for all clients at once, each client a view of
  them, so that its host memory is the data once.
* ``logreg`` and ``logreg-sparse``: StackOverflow-like tag prediction, a
  logistic regression from 10,000 bag-of-words features to 500 tags (sigmoid
  cross-entropy summed over tags; 5,000,500 parameters), 50 clients of
  log-normal sizes (median 30, sigma 0.8), each example 30 tokens drawn
  uniformly and 3 tags. ``logreg`` gives the model dense count vectors
  ``[n, 10000]`` (what every peer takes); ``logreg-sparse`` the same
  examples as token ids ``[n, 30]``, whose logits ``sum_j W[t_j] + b`` are
  the dense model's (an embedding sum).

Every framework starts from :func:`init` (the same seeded weights) and, for
the equality check (``--check=FILE``), runs one round over each client's
examples in data order and saves its weights in the layout of :func:`init`;
:func:`numpy_round` is the float64 reference they are compared with
(:func:`compare`).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import common  # the clock and CPU time of a process tree

SETUPS = ('2nn-100', '2nn-1000', '2nn-10000', '2nn-100000', 'logreg',
          'logreg-sparse')
BATCH, LOCAL_LR, SERVER_LR = 10, 0.1, 1.0
FEATURES, TAGS, TOKENS, TAGS_PER_EXAMPLE = 10_000, 500, 30, 3
LAYERS = (784, 200, 200, 10)


def kind(setup: str) -> str:
  if setup not in SETUPS:
    raise ValueError(f'setup={setup!r} is not one of {SETUPS}.')
  return '2nn' if setup.startswith('2nn') else 'logreg'


def sizes(setup: str) -> np.ndarray:
  """Each client's example count."""
  clients, median = {'2nn-100': (100, 20), '2nn-1000': (1000, 20),
                     '2nn-10000': (10000, 20), '2nn-100000': (100_000, 20),
                     'logreg': (50, 30), 'logreg-sparse': (50, 30)}[setup]
  rng = np.random.default_rng(0)
  return np.maximum(1, np.round(median * np.exp(0.8 * rng.normal(size=clients)))).astype(int)


def client_data(setup: str) -> list[dict[str, np.ndarray]]:
  """Each client's examples: ``{'x': float32 [n, 784], 'y': int64 [n]}``
  (2NN), ``{'x': float32 [n, 10000] counts, 'y': float32 [n, 500]}``
  (``logreg``) or ``{'tokens': int64 [n, 30], 'y': ...}`` (``logreg-sparse``)."""
  if setup == '2nn-100000':
    x, y = _drawn_at_once(setup)
    bounds = np.cumsum(sizes(setup))[:-1]
    return [{'x': a, 'y': b} for a, b in zip(np.split(x, bounds), np.split(y, bounds))]
  rng = np.random.default_rng(1)
  out = []
  for n in sizes(setup):
    n = int(n)
    if kind(setup) == '2nn':
      out.append({'x': rng.random((n, LAYERS[0]), dtype=np.float32),
                  'y': rng.integers(0, LAYERS[-1], size=n)})
      continue
    tokens = rng.integers(0, FEATURES, size=(n, TOKENS))
    tags = np.zeros((n, TAGS), np.float32)
    for i in range(n):
      tags[i, rng.choice(TAGS, TAGS_PER_EXAMPLE, replace=False)] = 1.0
    if setup == 'logreg-sparse':
      out.append({'tokens': tokens, 'y': tags})
    else:
      x = np.zeros((n, FEATURES), np.float32)
      np.add.at(x, (np.repeat(np.arange(n), TOKENS), tokens.reshape(-1)), 1.0)
      out.append({'x': x, 'y': tags})
  return out


def _drawn_at_once(setup: str) -> tuple[np.ndarray, np.ndarray]:
  """The 2NN inputs and labels of every client, drawn as one array each."""
  rng = np.random.default_rng(1)
  n = int(sizes(setup).sum())
  return (rng.random((n, LAYERS[0]), dtype=np.float32),
          rng.integers(0, LAYERS[-1], size=n))


def flat_arrays(setup: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Every client's examples of :func:`client_data`, client after client
  (int64 features as int32, what a JAX round takes), and each client's
  example count."""
  if setup == '2nn-100000':  # No per-client copies: the arrays as drawn.
    x, y = _drawn_at_once(setup)
    return {'x': x, 'y': y.astype(np.int32)}, sizes(setup)
  data = client_data(setup)
  counts = np.array([len(d['y']) for d in data])
  arrays = {}
  for k in list(data[0]):
    v = np.concatenate([d.pop(k) for d in data])
    arrays[k] = v.astype(np.int32) if v.dtype == np.int64 else v
  return arrays, counts


def first_client(arrays: dict[str, np.ndarray], sizes: np.ndarray) -> dict[str, np.ndarray]:
  return {k: v[:sizes[0]] for k, v in arrays.items()}


def init(setup: str) -> list[tuple[np.ndarray, np.ndarray]]:
  """The starting weights, ``[(w [in, out], b [out]), ...]`` per layer."""
  rng = np.random.default_rng(2)
  dims = LAYERS if kind(setup) == '2nn' else (FEATURES, TAGS)
  return [(rng.uniform(-1, 1, (a, b)).astype(np.float32) * np.float32(np.sqrt(6 / (a + b))),
           np.zeros(b, np.float32)) for a, b in zip(dims[:-1], dims[1:])]


def num_params(setup: str) -> int:
  return sum(w.size + b.size for w, b in init(setup))


def order(round_num: int, client: int, n: int, shuffle: bool = True) -> np.ndarray:
  """The order in which a PyTorch peer visits client ``client``'s ``n``
  examples in round ``round_num`` (fedjx and FedJAX shuffle with their own
  seeded generators; data order for the check)."""
  if not shuffle:
    return np.arange(n)
  return np.random.default_rng((round_num, client)).permutation(n)


def cohort_order(round_num: int, sizes: np.ndarray, shuffle: bool = True) -> np.ndarray:
  """Every client's example order for round ``round_num`` in one sort:
  ``[sum(sizes)]``, client ``i``'s block a permutation of ``range(sizes[i])``
  (each client's examples sorted by seeded uniform keys; data order for the
  check). The hand-written floor shuffles the whole cohort at once, as
  fedjx's ``example_orders`` does, rather than one generator per client."""
  sizes = np.asarray(sizes)
  owner = np.repeat(np.arange(len(sizes)), sizes)
  starts = np.cumsum(sizes) - sizes
  if not shuffle:
    return np.arange(owner.size) - starts[owner]
  keys = np.random.default_rng(round_num).random(owner.size)
  return np.argsort(owner + keys, kind='stable') - starts[owner]


def dense_x(setup: str, data: dict[str, np.ndarray]) -> np.ndarray:
  """The model's input as dense features (count vectors for ``logreg-sparse``)."""
  if 'tokens' not in data:
    return data['x']
  n = len(data['tokens'])
  x = np.zeros((n, FEATURES))
  np.add.at(x, (np.repeat(np.arange(n), TOKENS), data['tokens'].reshape(-1)), 1.0)
  return x


def _loss_grads(setup, layers, x, y):
  """Gradients of the batch-mean loss, float64, by hand."""
  if kind(setup) == 'logreg':
    (w, b), = layers
    z = x @ w + b
    dz = (1 / (1 + np.exp(-z)) - y) / len(x)
    return [(x.T @ dz, dz.sum(0))]
  hs = [x]
  for i, (w, b) in enumerate(layers):
    z = hs[-1] @ w + b
    hs.append(np.maximum(z, 0) if i < len(layers) - 1 else z)
  logits = hs[-1]
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  d = p
  d[np.arange(len(y)), y] -= 1
  d /= len(x)
  grads = []
  for i in range(len(layers) - 1, -1, -1):
    w, _ = layers[i]
    grads.append((hs[i].T @ d, d.sum(0)))
    if i:
      d = (d @ w.T) * (hs[i] > 0)
  return grads[::-1]


def numpy_round(setup: str, wrap: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
  """One FedAvg round in float64, every client in data order (the check).

  ``wrap``: the last batch of a client is filled up to ``B`` examples from
  the start of its data again, as FedJAX's ``shuffle_repeat_batch`` cuts one
  epoch into ``ceil(n / B)`` full batches of a repeated stream (the
  semantics of FedJAX's FedAvg); else it holds the ``n mod B`` left over.
  """
  data = client_data(setup)
  start = [(w.astype(np.float64), b.astype(np.float64)) for w, b in init(setup)]
  total = sum(len(d['y']) for d in data)
  mean = [(np.zeros_like(w), np.zeros_like(b)) for w, b in start]
  for d in data:
    x, y = dense_x(setup, d).astype(np.float64), d['y']
    if wrap:
      stream = np.resize(np.arange(len(y)), -(-len(y) // BATCH) * BATCH)
      x, y = x[stream], y[stream]
    layers = [(w.copy(), b.copy()) for w, b in start]
    for s in range(0, len(y), BATCH):
      grads = _loss_grads(setup, layers, x[s:s + BATCH], y[s:s + BATCH])
      layers = [(w - LOCAL_LR * gw, b - LOCAL_LR * gb)
                for (w, b), (gw, gb) in zip(layers, grads)]
    share = len(d['y']) / total
    mean = [(mw + share * w, mb + share * b) for (mw, mb), (w, b) in zip(mean, layers)]
  return mean


def save(path: str, layers) -> None:
  np.savez(path, **{f'{k}{i}': np.asarray(v, np.float32)
                    for i, (w, b) in enumerate(layers) for k, v in (('w', w), ('b', b))})


def load(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
  with np.load(path) as f:
    return [(f[f'w{i}'], f[f'b{i}']) for i in range(len(f.files) // 2)]


def tolerance(setup: str) -> float:
  """How far a float32 round may be from the float64 one, relative to the
  largest weight. Each local step's products sum ``fan_in + B`` terms in
  float32 forward and backward, errors add over a client's ``S`` steps and
  the ``C``-term mean: ``n = 2 S (fan_in + B) + C`` roundings in a chain.
  Rounding errors of independent sign grow as ``sqrt(n) u`` (Higham,
  "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1,
  the statistical rule of thumb; the worst case ``n u`` is far from what
  any order of summation reaches); 8x for the operations this leaves out
  (activations, the softmax, the learning-rate products). A wrong step,
  learning rate or weighting is off by orders of magnitude more."""
  u = 2.0 ** -24
  fan = max(LAYERS) if kind(setup) == '2nn' else FEATURES
  steps = int(np.max(-(-sizes(setup) // BATCH)))
  n = 2 * steps * (fan + BATCH) + len(sizes(setup))
  return 8 * np.sqrt(n) * u


def compare(setup: str, path: str, wrap: bool = False) -> dict:
  """Max ``|got - want| / max|want|`` over the weights of ``path``
  (``wrap``: against :func:`numpy_round`'s FedJAX batching)."""
  want = numpy_round(setup, wrap)
  got = load(path)
  scale = max(float(np.max(np.abs(v))) for layer in want for v in layer)
  err = max(float(np.max(np.abs(g - w))) for gl, wl in zip(got, want)
            for g, w in zip(gl, wl))
  tol = float(tolerance(setup))
  return {'max_rel_error': err / scale, 'tolerance': tol,
          'equal': bool(err / scale <= tol)}


def parse_args(description: str, extra=None):
  import argparse
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--setup', default='2nn-1000', choices=SETUPS)
  parser.add_argument('--rounds', type=int, default=4,
                      help='rounds in all; the first is the warm-up')
  parser.add_argument('--check', default='',
                      help='run one round in data order and save the weights here')
  if extra is not None:
    extra(parser)
  return parser.parse_args()


def report(framework: str, version: str, setup: str, clock: common.Clock,
           threads: dict, **extra) -> None:
  """Prints the run's JSON line (medians over the rounds after the first)."""
  timed = clock.rounds()
  if not timed and len(clock.marks) == 2:
    (c0, w0), (c1, w1) = clock.marks
    timed = [(c1 - c0, w1 - w0)]
    extra['measured_first_round'] = True
  cpu = [c for c, _ in timed]
  wall = [w for _, w in timed]
  n = sizes(setup)
  record = {
      'framework': framework, 'version': version, 'setup': setup,
      'cpu_s_per_round': round(float(np.median(cpu)), 4) if cpu else None,
      'wall_s_per_round': round(float(np.median(wall)), 4) if wall else None,
      'time_to_first_round_s': round(clock.first_round_s, 3),
      'threads': threads, 'rounds': len(timed),
      'cpu_s_rounds': [round(c, 4) for c in cpu],
      'wall_s_rounds': [round(w, 4) for w in wall],
      'clients': int(len(n)), 'examples': int(n.sum()),
      'steps': int(np.sum(-(-n // BATCH))),
      'python': sys.version.split()[0], 'cpu_count': os.cpu_count(),
      'loadavg_1m': round(os.getloadavg()[0], 2)}
  record.update(extra)
  print(json.dumps(record), flush=True)


if __name__ == '__main__':  # python cross_device.py SETUP WEIGHTS.npz [--wrap]
  print(json.dumps(dict(compare(sys.argv[1], sys.argv[2], '--wrap' in sys.argv),
                        setup=sys.argv[1])))
