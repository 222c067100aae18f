"""The non-finite guard: clients whose update is NaN or Inf are left out.

One client with a NaN in its data, a NaN aggregation weight or a diverging
local step turns ``sum_i w_i Delta_i`` into NaN, and with it the server model,
for good. With the guard on (``skip_nonfinite=True``, the default of every
aggregating builder), each client's work is followed, inside the same
``fedjx.map_fn``, by

    ok_i = all(isfinite(Delta_i)) and isfinite(w_i) and isfinite(n_i)
    Delta_i, stats_i, extra_i  <-  where(ok_i, ., 0)
    w_i, n_i                   <-  where(ok_i, ., 0)
    state_i                    <-  where(ok_i, new state_i, old state_i)

so a skipped client is exactly a client that was not sampled: weight 0 in
every reduction, its values replaced by zeros before any reduction (so
``0 * NaN`` never reaches the sum), its stored per-client state (SCAFFOLD's
``c_i``, DiLoCo's inner optimizer state) unchanged, and its statistics out of
the round's metrics. The round's metrics gain ``nonfinite_clients``, the
number of skipped clients (padding clients, ``n_i = 0``, are never counted).
A round on a cohort with skipped clients equals the round on the cohort
without them.

Everything happens per client inside the algorithm's one ``map_fn`` (the
flags leave it as client values and are only reduced), so a guarded round is
still a MapReduce plan (:mod:`fedjx.plan`, Beam, ``fedjx.export``). With
``skip_nonfinite=False`` nothing is added: the round is the unguarded program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import fedjx
from fedjx.algorithms import base

METRIC = 'nonfinite_clients'


class ClientOutput(NamedTuple):
  """What one client's work returns, as the guard sees it.

  Attributes:
    update: what is aggregated (the model update ``Delta_i``, or a tuple of
      aggregated trees); every leaf is checked.
    stats: per-client metric sums (:func:`base.round_metrics`).
    extra: other per-client values (zeroed when the client is skipped).
    state: per-client state the server stores after the round.
    previous_state: the state before the round, stored instead of ``state``
      when the client is skipped (same structure as ``state``).
  """

  update: base.PyTree
  stats: Mapping[str, jax.Array]
  extra: base.PyTree = ()
  state: base.PyTree = ()
  previous_state: base.PyTree = ()


class Clients(NamedTuple):
  """The cohort's placed results after the guard.

  Attributes:
    update, stats, extra, state: as in :class:`ClientOutput`, stacked over
      clients (placed).
    weights: the aggregation weights ``w_i`` (0 for skipped clients).
    server_weights: when guarded, the weights as given (computed outside the
      map), non-finite ones set to 0; see :func:`weighted_mean`.
    num_examples: ``n_i`` (0 for skipped clients).
    present: placed float flags, 1 for a client with data that was kept;
      None when unguarded.
    skipped: placed float flags, 1 for a skipped client; None when unguarded.
  """

  update: base.PyTree
  stats: Mapping[str, jax.Array]
  extra: base.PyTree
  state: base.PyTree
  weights: jax.Array
  server_weights: jax.Array | None
  num_examples: jax.Array
  present: jax.Array | None
  skipped: jax.Array | None


def all_finite(tree: base.PyTree) -> jax.Array:
  """A boolean scalar: every element of every leaf of ``tree`` is finite."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, flags, jnp.asarray(True))


def _guarded(client_fn: Callable[..., ClientOutput],
             weights_are_counts: bool) -> Callable[..., tuple]:
  """``client_fn`` followed by the per-client check and replacement."""
  def run(w, *args):
    n, args = (w, args) if weights_are_counts else (args[0], args[1:])
    out = client_fn(*args)
    ok = all_finite((out.update, w, n))
    zero = lambda t: jax.tree.map(
        lambda x: jnp.where(ok, x, jnp.zeros_like(x)), t)
    state = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                         out.state, out.previous_state)
    n_kept = zero(jnp.asarray(n, jnp.float32))
    present = (n_kept > 0).astype(jnp.float32)  # Counted in ``clients``.
    skipped = jnp.logical_and(jnp.logical_not(ok), n != 0).astype(jnp.float32)
    return (zero(out.update), zero(out.stats), zero(out.extra), state,
            zero(w), n_kept, present, skipped)
  return run


def map_clients(client_fn: Callable[..., ClientOutput], args: tuple,
                weights: jax.Array, num_examples: jax.Array,
                skip_nonfinite: bool) -> Clients:
  """``fedjx.map_fn(client_fn, args)``, guarded if ``skip_nonfinite``.

  Args:
    client_fn: one client's work, returning a :class:`ClientOutput`.
    args: placed (or broadcast) arguments of ``client_fn``, as for ``map_fn``.
    weights: the placed aggregation weights ``w_i``.
    num_examples: the placed ``n_i`` (``cohort.num_examples``).
    skip_nonfinite: whether to check and skip non-finite clients.
  """
  if not skip_nonfinite:
    out = fedjx.map_fn(client_fn, args)
    return Clients(out.update, out.stats, out.extra, out.state, weights,
                   None, num_examples, None, None)
  # Weights that are the counts themselves (w_i = n_i) go in once.
  same = weights is num_examples
  update, stats, extra, state, w, n, present, skipped = fedjx.map_fn(
      _guarded(client_fn, same),
      ((weights,) if same else (weights, num_examples)) + tuple(args))
  server_weights = jnp.where(jnp.isfinite(weights), weights,
                             jnp.zeros_like(weights))
  return Clients(update, stats, extra, state, w, server_weights, n, present,
                 skipped)


def weighted_mean(clients: Clients, values: base.PyTree) -> base.PyTree:
  """``sum_i w_i x_i / sum_i w_i`` over the kept clients (zero if none).

  Unguarded, this is ``fedjx.reduce_weighted_mean(values, weights)``. Guarded,
  the skipped clients' values are zero, and the mean is taken with the
  server's (finite) weights ``v_i`` and rescaled,

      sum_i w_i x_i / sum_i w_i  =  reduce_weighted_mean(x, v) * sum_i v_i / sum_i w_i,

  where ``w_i`` (0 for skipped clients) come out of the clients' map and
  ``v_i`` do not. The weights of the reduction are thus never outputs of the
  map, so the round's derivatives stay MapReduce plans (the transpose of a
  weighted mean computes with its weights outside ``map_fn``). With no client
  skipped the rescaling is not applied, and the
  result is bit for bit the unguarded one.
  """
  if clients.skipped is None:
    return fedjx.reduce_weighted_mean(values, clients.weights)
  mean = fedjx.reduce_weighted_mean(values, clients.server_weights)
  total = fedjx.reduce_sum(clients.server_weights)
  kept = fedjx.reduce_sum(clients.weights)
  scale = jnp.where(kept != 0, total / jnp.where(kept != 0, kept, 1.0), 0.0)
  any_skipped = fedjx.reduce_sum(clients.skipped) > 0
  return jax.tree.map(
      lambda m: jnp.where(any_skipped, m * scale.astype(m.dtype), m), mean)


def round_metrics(clients: Clients, **extra: jax.Array) -> base.Metrics:
  """:func:`base.round_metrics` of a guarded cohort, plus ``nonfinite_clients``.

  Skipped clients count neither in ``clients`` nor in ``examples`` nor in
  the pooled losses; ``nonfinite_clients`` is their number.
  """
  if clients.skipped is None:
    return base.round_metrics(clients.stats, clients.num_examples, **extra)
  return base.pooled_metrics(
      clients.stats, clients=fedjx.reduce_sum(clients.present),
      examples=fedjx.reduce_sum(clients.num_examples), **extra,
      **{METRIC: fedjx.reduce_sum(clients.skipped)})


def check_flag(fn: str, skip_nonfinite: Any) -> None:
  if not isinstance(skip_nonfinite, bool):
    raise ValueError(f'{fn}: skip_nonfinite={skip_nonfinite!r} must be True '
                     'or False.')
