"""A softmax-regression FedAvg problem over clients of log-normal sizes.

Shared by the tests of the client map's blocks and chunks: the population,
the model, and a float64 NumPy FedAvg round (each client's SGD steps over
its batches in data order, then the example-weighted mean of the client
models, McMahan et al. 2017, Algorithm 1) with its float32 tolerance.
"""

import jax.numpy as jnp
import numpy as np
import optax

import float_tolerance as ft


def population(n, features, classes, median=5, spread=0.8):
  """Client sizes ``max(1, round(median exp(spread z)))``, inputs and labels."""
  rng = np.random.default_rng(0)
  sizes = np.maximum(1, np.round(median * np.exp(spread * rng.normal(size=n)))).astype(int)
  x = rng.normal(size=(sizes.sum(), features)).astype(np.float32)
  y = rng.integers(0, classes, size=sizes.sum()).astype(np.int32)
  return sizes, x, y


def loss(params, batch):
  """Per-example softmax cross-entropy of ``x w + b``."""
  w, b = params
  return optax.softmax_cross_entropy_with_integer_labels(batch['x'] @ w + b,
                                                         batch['y'])


def initial_params(features, classes):
  rng = np.random.default_rng(1)
  return (jnp.asarray(rng.normal(size=(features, classes)).astype(np.float32)),
          jnp.zeros(classes, jnp.float32))


def numpy_fedavg(sizes, x, y, params, batch, lr):
  """Float64 FedAvg (server SGD 1.0) of the clients' batches in data order."""
  w0, b0 = (np.asarray(a, np.float64) for a in params)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  total_w, total_b = np.zeros_like(w0), np.zeros_like(b0)
  for start, m in zip(starts, sizes):
    w, b = w0.copy(), b0.copy()
    for s in range(0, m, batch):
      xb = x[start + s:start + min(m, s + batch)]
      yb = y[start + s:start + min(m, s + batch)]
      logits = xb @ w + b
      p = np.exp(logits - logits.max(1, keepdims=True))
      p /= p.sum(1, keepdims=True)
      p[np.arange(len(yb)), yb] -= 1
      w -= lr * xb.T @ p / len(yb)
      b -= lr * p.sum(0) / len(yb)
    total_w += m * w
    total_b += m * b
  return [total_w / sizes.sum(), total_b / sizes.sum()]


def tolerance(want, sizes, features, batch):
  """Each weight: a chain of ``2 S (features + batch)`` float32 roundings in
  a client's local steps (``S`` its steps), then the weighted sum over the
  ``n`` clients."""
  steps = int(np.max(-(-sizes // batch)))
  return ft.atol(2 * steps * (features + batch) + len(sizes), np.abs(want).max() + 1)
