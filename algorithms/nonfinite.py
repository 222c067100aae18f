"""The non-finite guard: clients whose update is NaN or Inf are left out.

One client with a NaN in its data, a NaN aggregation weight or a diverging
local step turns ``sum_i w_i Delta_i`` into NaN, and with it the server model,
for good. With the guard on (``skip_nonfinite=True``, the default of every
aggregating builder), each client's work is followed, inside the same
``fedjx.map_fn``, by

    ok_i = all(isfinite(y_i)) and isfinite(w_i) and isfinite(n_i)
           (y_i the trained model: finite exactly when Delta_i = x - y_i is)
    w_i, n_i, Delta_i, stats_i  <-  where(ok_i, ., 0)
    state_i                     <-  where(ok_i, new state_i, old state_i)
    send w_i Delta_i; the server divides sum_i w_i Delta_i by sum_i w_i

so a skipped client is exactly a client that was not sampled: weight 0 in
every reduction, its values replaced by zeros before any reduction (so
``0 * NaN`` never reaches the sum), its stored per-client state (SCAFFOLD's
``c_i``, DiLoCo's inner optimizer state) unchanged, and its statistics out of
the round's metrics. The round's metrics gain ``nonfinite_clients``, the
number of skipped clients (padding clients, ``n_i = 0``, are never counted).
A round on a cohort with skipped clients equals the round on the cohort
without them.

Everything happens per client inside the algorithm's one ``map_fn``, and the
reductions are sums (whose transpose is ``broadcast``), so a guarded round and
its derivatives are still MapReduce plans (:mod:`fedjx.plan`, Beam,
``fedjx.export``). The cost is one read of each client's trained model. The
DP aggregators compute each update's norm ``||Delta_i||`` anyway (to clip
it), and it is NaN or Inf whenever ``Delta_i`` is: they set
``Traits.checks_update``, and the guard checks the norm instead of
reading the model again (an update whose squared norm overflows float32,
entries beyond about 1e19, then counts as non-finite too). With
``skip_nonfinite=False`` nothing is added: the round is the unguarded program.
"""

from __future__ import annotations

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
    update: what is averaged over the cohort with the weights ``w_i`` (the
      model update ``Delta_i``); every leaf is checked.
    stats: per-client metric sums (:func:`base.round_metrics`).
    extra: other per-client values (zeroed when the client is skipped), e.g.
      SCAFFOLD's ``Delta c_i``.
    state: per-client state the server stores after the round.
    previous_state: the state before the round, stored instead of ``state``
      when the client is skipped (same structure as ``state``).
    checked: what is checked, if not ``update``: algorithms pass the trained
      model ``y_i`` (with a finite server model ``x``, ``Delta_i = x - y_i``
      is finite when ``y_i`` is), so that the check reads an array that is in
      memory anyway and ``Delta_i`` is computed in one pass with its weight.
    encoded: the aggregator's per-client values from its ``encode`` step
      (e.g. the norm before clipping); set by :func:`map_clients`.
  """

  update: base.PyTree
  stats: Mapping[str, jax.Array]
  extra: base.PyTree = ()
  state: base.PyTree = ()
  previous_state: base.PyTree = ()
  checked: base.PyTree | None = None
  encoded: base.PyTree = ()


class Clients(NamedTuple):
  """The cohort's placed results after the guard.

  Attributes:
    update, stats, extra, state: as in :class:`ClientOutput`, stacked over
      clients (placed); a skipped client's are zero (``state``: the previous).
      With ``rows`` (:func:`map_clients`), ``state`` is the store with the
      cohort's new rows written in.
    weights: the placed aggregation weights ``w_i`` (0 for skipped clients).
    num_examples: the placed ``n_i`` (0 for skipped clients).
    weighted_update: when guarded, the placed ``w_i Delta_i`` (else None).
    totals: when guarded, the reduced ``weights`` (``sum_i w_i``),
      ``examples`` (``sum_i n_i``), ``clients`` (kept clients with data) and
      ``skipped`` (skipped clients with data); None when unguarded.
    skipped: when guarded, the placed flags (1.0 for a skipped client).
    encoded: the aggregator's per-client values (``ClientOutput.encoded``),
      zero for skipped clients.
    client_ids: the placed ids of the cohort's clients in the population
      (``Cohort.client_ids``, -1 for padding clients), for aggregators that
      treat clients by who they are (attacks,
      :mod:`fedjx.algorithms.attacks`); None when the algorithm does not pass
      them.
  """

  update: base.PyTree
  stats: Mapping[str, jax.Array]
  extra: base.PyTree
  state: base.PyTree
  weights: jax.Array
  num_examples: jax.Array
  weighted_update: base.PyTree | None = None
  totals: dict[str, jax.Array] | None = None
  skipped: jax.Array | None = None
  encoded: base.PyTree = ()
  client_ids: jax.Array | None = None


# Float32 leaves of at least this many elements, with two or more axes, are
# checked with a matrix-vector product on the CPU (``_zero_product``).
DOT_CHECK_MIN_SIZE = 4096


def _zero_product(x: jax.Array) -> jax.Array:
  """``sum_i (X 0)_i`` for ``X`` the float32 ``x`` as a matrix ``[m, k]``.

  Each entry of ``X 0`` is ``sum_j X_ij * 0``, and ``X_ij * 0`` is 0 for a
  finite ``X_ij`` and NaN for NaN or +-Inf (IEEE 754), so the result is 0
  exactly when every element of ``x`` is finite and NaN otherwise (it
  cannot overflow). The zero vector is ``X_00 * 0`` broadcast (NaN when
  ``X_00`` is not finite), a value the compiler cannot fold away.
  """
  m = jnp.reshape(jnp.asarray(x), (-1, jnp.shape(x)[-1]))
  zeros = jnp.broadcast_to(m[0, 0] * 0, (m.shape[1],))
  return jnp.sum(jnp.dot(m, zeros, precision=jax.lax.Precision.HIGHEST))


def _zero_sum(x: jax.Array) -> jax.Array:
  """``sum_j (x_j - x_j)`` in float32: 0 exactly when ``x`` is all finite."""
  return jnp.sum(x - x, dtype=jnp.float32)


def _leaf_check(x: jax.Array) -> jax.Array:
  """A float32 scalar, 0 exactly when every element of ``x`` is finite.

  On the CPU a large float32 matrix is checked by :func:`_zero_product`,
  whose matrix-vector kernel reads it about twice as fast as XLA's
  reduction of ``x - x`` (:func:`_zero_sum`, what every other leaf and
  platform uses); both are NaN exactly when some element is NaN or Inf.
  """
  if (jnp.result_type(x) == jnp.float32 and jnp.ndim(x) >= 2
      and jnp.size(x) >= DOT_CHECK_MIN_SIZE):
    return jax.lax.platform_dependent(x, cpu=_zero_product, default=_zero_sum)
  return _zero_sum(x)


def all_finite(tree: base.PyTree) -> jax.Array:
  """A boolean scalar: every element of every leaf of ``tree`` is finite.

  Computed as ``isfinite(sum_leaves c(x))`` with ``c(x)`` 0 for an all-finite
  leaf and NaN otherwise (:func:`_leaf_check`): ``sum_j (x_j - x_j)``, or on
  the CPU, for a large float32 matrix ``X``, ``sum_i (X 0)_i``, since ``x -
  x`` and ``x * 0`` are 0 for a finite ``x`` and NaN for NaN or +-Inf (so
  the sum cannot overflow). A float sum is one fused pass over each leaf,
  where ``all(isfinite(x))`` materialises a boolean array first.
  """
  total = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      total = total + _leaf_check(x)
  return jnp.isfinite(total)


def _guarded(client_fn: Callable[..., ClientOutput],
             weights_are_counts: bool) -> Callable[..., tuple]:
  """``client_fn`` followed by the per-client check and replacement."""
  def run(w, *args):
    n, args = (w, args) if weights_are_counts else (args[0], args[1:])
    out = client_fn(*args)
    checked = out.update if out.checked is None else out.checked
    ok = all_finite((checked, w, n))
    zero = lambda t: jax.tree.map(
        lambda x: jnp.where(ok, x, jnp.zeros_like(x)), t)
    state = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                         out.state, out.previous_state)
    w_kept, n_kept = zero(w), zero(jnp.asarray(n, jnp.float32))
    weighted = jax.tree.map(lambda u: jnp.where(ok, w_kept * u, 0.0), out.update)
    skipped = jnp.logical_and(jnp.logical_not(ok), n != 0).astype(jnp.float32)
    scalars = {'weights': jnp.asarray(w_kept, jnp.float32), 'examples': n_kept,
               'clients': (n_kept > 0).astype(jnp.float32), 'skipped': skipped}
    return (zero(out.update), weighted, zero(out.stats), zero(out.extra), state,
            w_kept, n_kept, skipped, scalars, zero(out.encoded))
  return run


def _encoding(client_fn: Callable[..., ClientOutput], encode: Callable[..., tuple],
              hparams: Any, check_encoded: bool) -> Callable[..., ClientOutput]:
  """``client_fn`` whose update is replaced by the aggregator's message.

  The wrapped function takes the client's weight (and, if ``hparams`` is
  None, the aggregator's broadcast hyperparameters) before ``client_fn``'s
  arguments. The guard checks the unencoded update (or ``checked``), or, if
  ``check_encoded``, the encoder's per-client values instead.
  """
  def run(w, *args):
    hp, args = (args[0], args[1:]) if hparams is None else (hparams, args)
    out = client_fn(*args)
    message, encoded = encode(hp, out.update, w)
    checked = out.update if out.checked is None else out.checked
    return out._replace(update=message, checked=encoded if check_encoded else checked,
                        encoded=encoded)
  return run


def map_clients(client_fn: Callable[..., ClientOutput], args: tuple,
                weights: jax.Array, num_examples: jax.Array,
                skip_nonfinite: bool, encode: Callable[..., tuple] | None = None,
                encode_hparams: Mapping[str, jax.Array] | None = None,
                check_encoded: bool = False,
                encode_inputs: Mapping[str, Any] | None = None,
                rows: Any = None) -> Clients:
  """``fedjx.map_fn(client_fn, args)``, guarded if ``skip_nonfinite``.

  Args:
    client_fn: one client's work, returning a :class:`ClientOutput`.
    args: placed (or broadcast) arguments of ``client_fn``, as for ``map_fn``.
    weights: the placed aggregation weights ``w_i``.
    num_examples: the placed ``n_i`` (``cohort.num_examples``).
    skip_nonfinite: whether to check and skip non-finite clients.
    encode: optional per-client step of an aggregator,
      ``encode(hparams, update, w_i) -> (message, encoded)``, run in the same
      map after ``client_fn``; the message replaces the update.
    encode_hparams: the aggregator's (server) hyperparameters for ``encode``.
    check_encoded: the guard checks ``encode``'s per-client values (e.g. the
      update's norm, NaN or Inf whenever the update is) instead of the
      client's trained model, saving a second pass over it.
    encode_inputs: placed per-client values ``encode`` reads in its
      ``hparams`` beside the broadcast ones (e.g. a compressor's per-client
      random key, its error-feedback residual).
    rows: the clients' stored state, a :class:`fedjx.mapping.Rows` (or
      None): ``client_fn`` takes its row first, and the map writes each
      client's new ``state`` into the store (in place when clients run one
      at a time); ``Clients.state`` is then the new store.
  """
  given = len(args)
  if encode is not None:
    if encode_hparams or encode_inputs:
      client_fn = _encoding(client_fn, encode, None, check_encoded)
      placed = dict(fedjx.broadcast(dict(encode_hparams or {})),
                    **dict(encode_inputs or {}))
      args = (weights, placed) + tuple(args)
    else:
      client_fn = _encoding(client_fn, encode, {}, check_encoded)
      args = (weights,) + tuple(args)
  if not skip_nonfinite:
    out = _map(client_fn, args, given, rows, lambda o: o.state,
               lambda o: o._replace(state=()))
    return Clients(out.update, out.stats, out.extra, out.state, weights,
                   num_examples, encoded=out.encoded)
  # Weights that are the counts themselves (w_i = n_i) go in once.
  same = weights is num_examples
  (update, weighted, stats, extra, state, w, n, skipped,
   scalars, encoded) = _map(
       _guarded(client_fn, same),
       ((weights,) if same else (weights, num_examples)) + tuple(args), given,
       rows, lambda o: o[4], lambda o: o[:4] + ((),) + o[5:])
  totals = fedjx.reduce_sum(scalars)
  return Clients(update, stats, extra, state, w, n, weighted, totals, skipped,
                 encoded)


def _map(fn: Callable[..., Any], args: tuple, given: int, rows: Any,
         new_row: Callable[[Any], Any], without_row: Callable[[Any], Any]) -> Any:
  """``fedjx.map_fn(fn, args)``; with ``rows``, each client's row goes to
  ``fn`` before the last ``given`` args (the client function's), and
  ``new_row(out)`` into the store, which takes its place in the result."""
  if rows is None:
    return fedjx.map_fn(fn, args)
  lead = len(args) - given  # The wrappers' own args (weights, ...).

  def with_row(row, *a):
    out = fn(*a[:lead], row, *a[lead:])
    return new_row(out), without_row(out)

  store, out = fedjx.map_fn(with_row, args, rows=rows)
  if isinstance(out, ClientOutput):
    return out._replace(state=store)
  return out[:4] + (store,) + out[5:]


def _divide(total: jax.Array, weight: jax.Array) -> jax.Array:
  nonzero = weight != 0
  safe = jnp.where(nonzero, weight, 1.0).astype(total.dtype)
  return jnp.where(nonzero, total / safe, jnp.zeros_like(total))


def weighted_mean(clients: Clients) -> base.PyTree:
  """``sum_i w_i Delta_i / sum_i w_i`` over the kept clients (zero if none).

  Unguarded, this is ``fedjx.reduce_weighted_mean(update, weights)``.
  Guarded, the clients send ``w_i Delta_i`` (zero when skipped) and the
  server divides the sum by ``sum_i w_i``: sums are what the derivative of a
  round can carry back to the clients as a MapReduce plan (the transpose of
  ``reduce_sum`` is ``broadcast``), whatever the weights are computed from.
  """
  if clients.totals is None:
    return fedjx.reduce_weighted_mean(clients.update, clients.weights)
  total = clients.totals['weights']
  return jax.tree.map(lambda s: _divide(s, total),
                      fedjx.reduce_sum(clients.weighted_update))


def participants(clients: Clients) -> jax.Array:
  """``sum_i w_i`` over the kept clients: with unit weights, their number."""
  if clients.totals is None:
    return fedjx.reduce_sum(clients.weights)
  return clients.totals['weights']


def round_metrics(clients: Clients, **extra: jax.Array) -> base.Metrics:
  """:func:`base.round_metrics` of a guarded cohort, plus ``nonfinite_clients``.

  Skipped clients count neither in ``clients`` nor in ``examples`` nor in
  the pooled losses; ``nonfinite_clients`` is their number.
  """
  if clients.totals is None:
    return base.round_metrics(clients.stats, clients.num_examples, **extra)
  t = clients.totals
  return base.pooled_metrics(clients.stats, clients=t['clients'],
                             examples=t['examples'], **extra,
                             **{METRIC: t['skipped']})


def check_flag(fn: str, skip_nonfinite: Any) -> None:
  """Raises unless the ``skip_nonfinite`` option is True or False."""
  if not isinstance(skip_nonfinite, bool):
    raise ValueError(f'{fn}: skip_nonfinite={skip_nonfinite!r} must be True '
                     'or False.')
