"""Float64 NumPy references of local training on linear-regression clients.

The model of ``test_algorithms_util.linreg_loss``: per-example loss
``l_j = 0.5 (x_j . w + b - y_j)^2`` with params ``{'w': [d], 'b': []}``.
Local SGD steps on consecutive minibatches of ``B`` examples (the last one
short), each on the batch mean of ``s_j l_j`` (per-example scales ``s``,
default 1), plus the proximal gradient ``mu (theta - anchor)`` when ``mu``
is given. Everything is float64, so against a float32 run the reference is
exact to the tests' tolerances.
"""

from __future__ import annotations

import numpy as np


def as64(params) -> dict[str, np.ndarray]:
  return {k: np.asarray(v, np.float64) for k, v in params.items()}


def losses(params, data) -> np.ndarray:
  """Per-example ``0.5 (x w + b - y)^2``, float64."""
  x = np.asarray(data['x'], np.float64)
  r = x @ params['w'] + params['b'] - np.asarray(data['y'], np.float64)
  return 0.5 * r * r


def mean_loss(params, data) -> float:
  return float(np.mean(losses(params, data)))


def sgd(params, data, batch_size: int, lr: float, epochs: int = 1,
        scales: np.ndarray | None = None, mu: float = 0.0):
  """Local SGD from ``params``; returns the trained params (float64)."""
  p = {k: np.array(v, np.float64) for k, v in params.items()}
  anchor = {k: v.copy() for k, v in p.items()}
  x = np.asarray(data['x'], np.float64)
  y = np.asarray(data['y'], np.float64)
  n = len(y)
  s = np.ones(n) if scales is None else np.asarray(scales, np.float64)
  for _ in range(epochs):
    for i in range(0, n, batch_size):
      xb, yb, sb = x[i:i + batch_size], y[i:i + batch_size], s[i:i + batch_size]
      r = sb * (xb @ p['w'] + p['b'] - yb) / len(yb)
      g = {'w': xb.T @ r, 'b': np.sum(r)}
      for k in p:
        p[k] = p[k] - lr * (g[k] + mu * (p[k] - anchor[k]))
  return p


def sub(a, b):
  return {k: a[k] - b[k] for k in a}


def sq_norm(tree) -> float:
  return float(sum(np.sum(np.square(v)) for v in tree.values()))
