"""A small per-client row store for the tests of algorithms with client state.

Rows live in a dict keyed by client id; a client never written reads the
initial row (``client_state_init(params)``), a padding client (id < 0) too
and is never written. Independent of the library's own store.
"""

from __future__ import annotations

import jax
import numpy as np

from fedjx.datasets.cohort import Cohort


class Rows:
  """``read(ids)`` / ``write(ids, rows)`` over NumPy copies."""

  def __init__(self, initial):
    self.initial = jax.tree.map(lambda x: np.array(x, copy=True), initial)
    self.rows = {}

  def row(self, i: int):
    return self.rows.get(int(i), self.initial)

  def read(self, ids):
    return jax.tree.map(lambda *xs: np.stack(xs),
                        *[self.row(i) for i in np.asarray(ids)])

  def write(self, ids, rows):
    for j, i in enumerate(np.asarray(ids)):
      if i >= 0:
        self.rows[int(i)] = jax.tree.map(lambda x: np.array(x[j], copy=True), rows)


def with_rows(cohort, store: Rows) -> Cohort:
  """The test cohort (four fields) as a Cohort carrying its clients' rows."""
  return Cohort(*cohort[:4], client_states=store.read(cohort.client_ids))


def run_round(algo, state, cohort, store: Rows, key):
  """One round reading and writing ``store``; returns (state, metrics, rows)."""
  state, metrics, rows = algo.round(state, with_rows(cohort, store), key)
  store.write(cohort.client_ids, rows)
  return state, metrics, rows


# ------------------------------------------- float64 linear-regression pieces

def theta_of(params) -> np.ndarray:
  """``linreg_params``-shaped params as one float64 vector ``[w, b]``."""
  return np.concatenate([np.asarray(params['w'], np.float64).ravel(),
                         np.asarray(params['b'], np.float64).ravel()])


def linreg_grad(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """Gradient of the mean of ``0.5 (x.w + b - y)^2`` over the rows of ``x``."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  r = x @ theta[:-1] + theta[-1] - y
  return np.concatenate([x.T @ r / len(y), [np.mean(r)]])


def batches_of(data, batch_size: int):
  """A client's minibatches ``(x, y)`` in order, as make_cohort pads them."""
  n = len(data['y'])
  return [(data['x'][i:i + batch_size], data['y'][i:i + batch_size])
          for i in range(0, n, batch_size)]
