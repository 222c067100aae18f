"""Rounds under ``config.nonfinite``: run unguarded, redo guarded when needed.

With ``config.nonfinite`` ``'skip'`` or ``'stop'`` a round leaves out every
client whose update or weight is NaN or Inf, and counts it in
``nonfinite_clients``. The algorithms' guard (:mod:`fedjx.algorithms.nonfinite`)
does that inside the round, at the price of a second read of every client's
trained model and a few small kernels (on a CPU up to a few percent of a
round: docs/benchmarks.md). Almost no round has such a client. So for the
algorithms whose registry entry declares ``updates_reach_params``
(synchronous ones, whose every client output reaches the server model in the round that computes
it) the runner runs each round with the algorithm built *without* its guard,
and computes in the same compiled program one flag: whether the new server
model and the round's metrics are all finite.

A non-finite client always lowers the flag: NaN and Inf propagate through
the weighted sums of every aggregator (a NaN weight too, and an infinite
one gives ``Inf / Inf``), through clipping (the norm is NaN or Inf, and
``Inf * 0`` is NaN) and quantization (``x + (Q(x) - x)``), and through every
server optimizer into the new server model (a NaN count into the
``examples`` metric). A raised flag therefore means that the guard would
have skipped no client, and the unguarded round is kept. (A server optimizer
that replaces NaN updates itself, such as ``optax.zero_nans``, hides the
client from the flag; then nothing is skipped or counted.)

A lowered flag sends the round again through the guarded algorithm, from
the state before it. That state was donated to the round (its buffers hold
the new state), so it is rebuilt the way a resumed run rebuilds it: restored
from the run's last checkpoint, and the rounds since replayed as they ran
(unguarded, or redone guarded), with the same compiled programs, cohorts
and keys, which gives the same state bit for bit (the property the
fault-injection tests check for resuming). A run thus pays the guard only in
rounds that need it, plus at most ``checkpoint_every - 1`` replayed rounds
each time, and its results are a function of the config alone, as before.

Every other round runs guarded, with the check of the new server model
inside its program (:func:`checking_finiteness`): with ``'off'`` nothing is
checked; the other algorithms (Streaming DiLoCo, whose replicas keep
parameters a round does not synchronize, asynchronous DiLoCo, whose replicas
keep training across rounds, the hypergradient tuner, and algorithms
registered by users), rounds that are not one compiled program, and
builders that take no ``skip_nonfinite`` always run guarded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from fedjx import constant_hoisting
from fedjx.algorithms import nonfinite

# The metrics that checking_finiteness adds and the runner takes out before
# a row is written: 1.0 when the new server model (PARAMS_FINITE), or the new
# server model and every metric (RESULT_FINITE), are free of NaN/Inf.
PARAMS_FINITE = '_params_finite'
RESULT_FINITE = '_result_finite'


@jax.jit
def all_finite(tree: Any) -> jax.Array:
  """True when every floating-point leaf of ``tree`` is free of NaN and Inf."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def checking_finiteness(algorithm: Any, whole: bool = False) -> Any:
  """``algorithm`` whose round also reports whether its result is finite.

  The check runs inside the round's own compiled program and comes back with
  its metrics, as :data:`PARAMS_FINITE` (the new server model) or, if
  ``whole``, :data:`RESULT_FINITE` (the new server model and every metric),
  so it costs no dispatch or device-to-host wait of its own: on a 0.7 ms
  round of ``configs/fedavg_digits.py`` a separate check was 5% of the
  round. A round that is not a compiled program (no ``lower``) is returned
  as it is; the runner then checks the state after it.
  """
  if not hasattr(algorithm.round, 'lower'):
    return algorithm

  def apply(state, cohort, key):
    # An algorithm with per-client state returns its clients' rows third
    # (docs/client_state.md): passed on as they are.
    state, metrics, *rows = algorithm.apply(state, cohort, key)
    if whole:
      flag = all_finite((state.params, metrics))
      return (state, dict(metrics, **{RESULT_FINITE: flag}), *rows)
    return (state, dict(metrics, **{PARAMS_FINITE: all_finite(state.params)}),
            *rows)

  apply.__name__ = getattr(algorithm.apply, '__name__', 'round')
  return algorithm._replace(apply=apply, round=constant_hoisting.jit(apply, donate_argnums=(0,)))


def runs_unguarded(guarded: Any, updates_reach_params: bool) -> bool:
  """Whether rounds run unguarded first (module docstring).

  Args:
    guarded: the algorithm built with its guard.
    updates_reach_params: whether the algorithm is one whose every client
      output reaches the server model in the round that computes it (and
      whose builder takes ``skip_nonfinite``).
  """
  return updates_reach_params and hasattr(guarded.round, 'lower')




def must_stop(finite: Any, nonfinite_clients: Any, clients: Any,
              policy: str) -> Any:
  """The rule by which a run (or a sweep's trial) stops after a round.

  It stops when the new server model or the round's metrics are not finite;
  or, when some client was non-finite, under ``policy='stop'``, or when
  every client of the round was (``clients``, the round's metric, counts
  the clients kept: none was, so nothing could be aggregated and training
  cannot go on). Array-valued arguments give one answer per trial: the
  runner and ``fedjx-sweep`` apply this one rule.
  """
  bad = jnp.asarray(nonfinite_clients)
  some = bad > 0
  every = jnp.logical_and(some, jnp.asarray(clients) == 0)
  return jnp.logical_or(jnp.logical_not(finite), jnp.logical_and(
      some, jnp.logical_or(policy == 'stop', every)))


class GuardedRounds:
  """How a run's rounds go under ``config.nonfinite`` (the module docstring).

  ``first`` runs each round: the unguarded algorithm where rounds run
  unguarded first, else the guarded one. :meth:`settle` keeps its result, or
  redoes the round guarded from the state before it, which ``state_before``
  rebuilds with :meth:`replay`.

  Args:
    guarded: the algorithm with its guard (and its model check).
    unguarded: the algorithm without it, checking its whole result, or None.
    make_runner: ``make_runner(algorithm) -> run_round(state, cohort, key)``.
  """

  def __init__(self, guarded: Any, unguarded: Any | None,
               make_runner: Callable[[Any], Callable[..., Any]]):
    self._guarded, self._make_runner = guarded, make_runner
    self.first = make_runner(unguarded if unguarded is not None else guarded)
    self._unguarded = unguarded is not None
    self._run_guarded: Callable[..., Any] | None = None
    self._redone: set[int] = set()  # Rounds of this process redone guarded.
    self.redone_rows: Any = None  # The last redone round's per-client rows.

  def settle(self, r: int, row: dict[str, float], cohort: Any, key: Any,
             state_before: Callable[[int], Any]
             ) -> tuple[Any | None, Any | None, dict[str, float]]:
    """``(state, metrics, row)`` of round ``r`` after its first run's ``row``.

    ``state`` and ``metrics`` are None when the first run stands; else they
    are the guarded round's, from ``state_before(r)``. The guarded round's
    per-client rows, if its algorithm returns any, are :attr:`redone_rows`.
    """
    self.redone_rows = None
    if row.pop(RESULT_FINITE, 1.0) != 1.0:  # Not finite unguarded: again, guarded.
      self._run_guarded = self._run_guarded or self._make_runner(self._guarded)
      state, metrics, *rows = self._run_guarded(state_before(r), cohort, key)
      self._redone.add(r)
      self.redone_rows = rows[0] if rows else None
      return state, metrics, row
    if self._unguarded:  # No client would have been skipped.
      row = dict(sorted({**row, nonfinite.METRIC: 0.0}.items()))
    return None, None, row

  def replay(self, state: Any, first: int, last: int, cohorts: Iterator[Any],
             key_for: Callable[[int], Any],
             rows: Callable[[Any], Any] = lambda cohort: cohort,
             write: Callable[[Any, Any], None] | None = None) -> Any:
    """``state`` after rounds ``first .. last - 1``, each run as it was.

    For an algorithm with per-client state, ``rows(cohort)`` attaches the
    cohort's rows as of the round and ``write(cohort, new_rows)`` keeps the
    round's new ones (both on the run's store, restored to ``first``).
    """
    self.redone_rows = None
    for r, cohort in zip(range(first, last), cohorts):
      run = self._run_guarded if r in self._redone else self.first
      cohort = rows(cohort)
      state, _, *new = run(state, cohort, key_for(r))
      if new and write is not None:
        write(cohort, new[0])
    return state


__all__ = ['GuardedRounds', 'PARAMS_FINITE', 'RESULT_FINITE', 'all_finite',
           'checking_finiteness', 'must_stop', 'runs_unguarded']
