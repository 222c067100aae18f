"""Shared helpers for the algorithm tests: cohorts, models, reference loops.

The references here use only NumPy and plain JAX (no fedjx), so the tests
compare the algorithms against independent computations.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fedjx.algorithms as algos
import float_tolerance as ft


class Cohort(NamedTuple):
  """The fields of ``fedjx.datasets.Cohort`` (duck-typed by the algorithms)."""

  batches: dict[str, Any]
  mask: Any
  num_examples: Any
  client_ids: Any


def make_cohort(clients: list[dict[str, np.ndarray]], batch_size: int,
                steps: int | None = None, client_ids=None) -> Cohort:
  """Pads clients (dicts of ``[n_i, ...]`` arrays) into ``[C, S, B, ...]``.

  Client ``i``'s examples fill its first ``ceil(n_i / B)`` steps in order; the
  rest is padding (zeros, mask False).
  """
  sizes = [len(next(iter(c.values()))) for c in clients]
  s = steps or max(max(math.ceil(n / batch_size) for n in sizes), 1)
  batches = {}
  for key in clients[0]:
    shape = clients[0][key].shape[1:]
    out = np.zeros((len(clients), s * batch_size) + shape, clients[0][key].dtype)
    for i, c in enumerate(clients):
      out[i, :sizes[i]] = c[key]
    batches[key] = jnp.asarray(out.reshape((len(clients), s, batch_size) + shape))
  mask = np.zeros((len(clients), s * batch_size), bool)
  for i, n in enumerate(sizes):
    mask[i, :n] = True
  ids = np.arange(len(clients)) if client_ids is None else np.asarray(client_ids)
  return Cohort(batches, jnp.asarray(mask.reshape(len(clients), s, batch_size)),
                jnp.asarray(sizes, jnp.float32), jnp.asarray(ids, jnp.int32))


def stack_cohorts(cohorts: list[Cohort]) -> Cohort:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *cohorts)


def linreg_loss(params, batch):
  """Per-example squared error of a linear model."""
  pred = batch['x'] @ params['w'] + params['b']
  return 0.5 * jnp.square(pred - batch['y'])


def linreg_data(rng: np.random.Generator, sizes: list[int], dim: int = 3,
                shift: float = 1.0) -> list[dict[str, np.ndarray]]:
  """Heterogeneous linear-regression clients of the given sizes."""
  out = []
  for i, n in enumerate(sizes):
    x = rng.normal(size=(n, dim)).astype(np.float32) + shift * i / len(sizes)
    w = rng.normal(size=(dim,)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(n,))).astype(np.float32)
    out.append({'x': x, 'y': y})
  return out


def linreg_params(dim: int = 3):
  return {'w': jnp.linspace(-0.5, 0.5, dim, dtype=jnp.float32),
          'b': jnp.asarray(0.1, jnp.float32)}


def mean_loss(loss_fn, params, data: dict[str, np.ndarray]):
  return jnp.mean(loss_fn(params, jax.tree.map(jnp.asarray, data)))


def minibatches(data: dict[str, np.ndarray], batch_size: int) -> list[dict]:
  n = len(next(iter(data.values())))
  return [{k: jnp.asarray(v[i:i + batch_size]) for k, v in data.items()}
          for i in range(0, n, batch_size)]


@functools.lru_cache(maxsize=None)
def _mean_loss_grad(loss_fn):
  return jax.jit(jax.grad(lambda p, b: jnp.mean(loss_fn(p, b))))


def reference_sgd(loss_fn, params, data, batch_size: int, lr: float,
                  epochs: int = 1, momentum: float = 0.0, correction=None):
  """Hand-written local (momentum) SGD over unpadded minibatches.

  ``correction(grads, params)`` is added to each minibatch gradient. Returns
  the trained params and the number of steps taken.
  """
  grad = _mean_loss_grad(loss_fn)
  trace = jax.tree.map(jnp.zeros_like, params)
  steps = 0
  for _ in range(epochs):
    for batch in minibatches(data, batch_size):
      g = grad(params, batch)
      if correction is not None:
        g = jax.tree.map(jnp.add, g, correction(g, params))
      trace = jax.tree.map(lambda t, g: momentum * t + g, trace, g)
      params = jax.tree.map(lambda p, t: p - lr * t, params, trace)
      steps += 1
  return params, steps


def weighted_average(trees: list[Any], weights: list[float]):
  w = np.asarray(weights, np.float64)
  return jax.tree.map(lambda *xs: sum(wi * x for wi, x in zip(w / w.sum(), xs)),
                      *trees)


# The longest chain of float32 sums in the algorithm tests: at most 10 local
# steps, each a (d <= 3)-term prediction, a (B <= 9)-example mean and a
# momentum/proximal/control update (<= 4 terms), so <= 160 terms a round; then
# a weighted mean over C <= 8 clients and a server step (<= 10 terms); one or
# two rounds. Stable SGD (learning rate times the largest curvature below 2)
# does not amplify earlier errors, so the references agree to 2 gamma_n with
#   n = 2 * (160 + 8 + 10) < 400.
CHAIN = 400


def assert_trees_close(a, b, n=CHAIN):
  """Leaves equal to ``2 gamma_n`` (float_tolerance), relative to each leaf's scale.

  The bound is on the error relative to the sum of magnitudes of the terms,
  which the largest magnitude of the reference leaf stands for (``atol``), so
  entries that cancel to near zero are not held to a relative bound.
  """
  tol = ft.rtol(n)
  def check(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scale = float(np.max(np.abs(y))) if y.size else 0.0
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol * scale)
  jax.tree.map(check, a, b)


def copy(tree):
  """A copy of a state that survives ``round`` donating its input."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


KEY = jax.random.key(0)
__all__ = ['algos']
