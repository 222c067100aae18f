"""Secure aggregation, simulated: the server learns only the modular sum.

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017 (SecAgg), and Bell, Bonawitz, Gascon, Lepoint, Raykova,
"Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020
(SecAgg+). Each round of :func:`secure_sum`:

    client i:  x_i = Delta_i min(1, C / ||Delta_i||)           (clip to C)
               y_i = s R x_i                                 (shared rotation, scale)
               v_i = round(y_i) mod m                        (randomized rounding)
               send  v_i + b_i + sum_{j in N(i)} +-s_ij  mod m    (masks, in Z_m)
    server:    sum over the survivors mod m, minus the self masks b_i of the
               survivors and the pair masks s_ij of the dropped clients j
               (both rebuilt from the secret shares held by the survivors)
               = sum_i v_i mod m;  Delta = R^-1 center(sum) / (s n)

with ``m = 2^bits``: every value and mask is an integer in ``[0, m)`` held
in ``uint32``, and the sums are ``fedjx.reduce_sum`` over ``uint32`` (exact,
wrapping modulo ``2^32``, of which ``m`` is a divisor) reduced modulo ``m``.
``center`` maps ``[m/2, m)`` to negative values. The masks are drawn from
keys of the round's shared seed (standing in for the Diffie-Hellman
agreed seeds ``s_ij`` and the self seeds ``b_i``), so they cancel exactly:
what the server reads is the modular sum and nothing else. ``R`` is the
randomised Hadamard rotation of :mod:`fedjx.algorithms.compression` (it
spreads the vector so that few coordinates are large; ``rotation=False``
leaves it out). Randomized rounding is unbiased: ``floor(y) + Bernoulli(y -
floor(y))``.

**Dropouts.** Clients that fail to report are those of the system model
(:mod:`fedjx.datasets.systems`: a dropped client reaches the round as a
cohort slot without data); every slot of the cohort counts as a sampled
client. In SecAgg+ client ``i`` shares its secrets ``t``-out-of-``k`` with
its ``k`` neighbours ``N(i)`` on a random Harary graph (a ring in a random
order of the cohort, ``k / 2`` neighbours on each side): the server
rebuilds a survivor's self mask, or a dropped client's pair masks, from
``t`` shares held by its surviving neighbours. ``neighbors=None`` is the
complete graph of SecAgg (``k = n - 1``). When a survivor, or a dropped
client with a surviving neighbour, has fewer than ``t`` surviving
neighbours the round fails: the server learns nothing, the update is zero (the model is unchanged) and the
round's metrics say ``secagg_failed = 1``; a threshold above ``k`` or a
cohort smaller than ``t + 1`` is refused when the round is traced, in one
line.

**Costs.** Per round: ``upload_bits`` per client (the masked vector as
packed ``bits``-bit words, counted from the message, plus the protocol's
other messages with 256-bit keys and shares: two public keys, ``k``
encrypted share pairs and up to ``k`` shares at unmasking, ``512 + 768 k``
bits), ``download_bits`` (the model and the seed), and the orders of
computation of Bell et al.'s Table 1 with ``k`` for ``log n`` (client
``k^2 + l k``, server ``n (k^2 + l k)``, ``l`` the vector length; for
SecAgg, ``k = n - 1``: ``n^2 + l n`` and ``l n^2``): ``secagg_client_ops``,
``secagg_server_ops``. Also ``secagg_survivors`` and
``secagg_min_live_neighbors``.

Clients have weight 1 (the sum is over clients; the mean divides by the
survivors, or by ``expected_clients_per_round``). Distributed DP
(:mod:`fedjx.algorithms.privacy.distributed_dp`) adds integer noise to ``v_i``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms.traits import Traits
from fedjx.algorithms.compression import compressors as compression

_ROTATION, _CLIENTS, _GRAPH, _SELF, _PAIR, _NEXT = 0, 1, 2, 3, 4, 7
KEY_BITS = 256  # public keys and secret shares


class SecureSumState(NamedTuple):
  """The state of a secure sum: the round's shared seed and the update's structure."""

  key: jax.Array
  template: base.PyTree


def check_protocol(fn: str, bits: int, threshold: int,
                   neighbors: int | None) -> None:
  """One-line errors for the protocol's options."""
  if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 32:
    raise ValueError(f'{fn}: bits={bits!r} must be an int in [2, 32] (the '
                     'modulus is 2^bits).')
  base.check_positive_int(fn, 'threshold', threshold)
  if neighbors is not None:
    if isinstance(neighbors, bool) or not isinstance(neighbors, int) or (
        neighbors < 2 or neighbors % 2):
      raise ValueError(f'{fn}: neighbors={neighbors!r} must be an even int '
                       '>= 2 (a Harary graph) or None (the complete graph).')
    if threshold > neighbors:
      raise ValueError(f'{fn}: threshold={threshold} exceeds neighbors='
                       f'{neighbors}: no client could be unmasked.')


def graph_offsets(cohort_size: int, neighbors: int | None) -> tuple[int, ...]:
  """Ring offsets of a client's neighbours: ``+-1 .. +-k/2``, or all others."""
  if neighbors is None or neighbors >= cohort_size - 1:
    return tuple(range(1, cohort_size))
  half = neighbors // 2
  return tuple(range(1, half + 1)) + tuple(
      range(cohort_size - half, cohort_size))


def neighbor_table(key: jax.Array, cohort_size: int,
                   offsets: tuple[int, ...]) -> jax.Array:
  """``[n, len(offsets)]`` int32: the cohort positions of each client's
  neighbours on the ring of a random order of the cohort (from ``key``)."""
  order = jax.random.permutation(jax.random.fold_in(key, _GRAPH),
                                 cohort_size).astype(jnp.int32)
  place = jnp.zeros(cohort_size, jnp.int32).at[order].set(
      jnp.arange(cohort_size, dtype=jnp.int32))
  return jnp.stack([order[(place + o) % cohort_size] for o in offsets], axis=1)


def live_neighbors_of(table: jax.Array, alive: jax.Array) -> jax.Array:
  """``[n]`` int32: each client's surviving neighbours."""
  return jnp.sum(alive[table].astype(jnp.int32), axis=1)


def unmaskable(live: jax.Array, alive: jax.Array, threshold: int) -> jax.Array:
  """Whether the server can unmask: each survivor (its ``b_i``) and each
  dropped client with a surviving neighbour (its ``s_ij``) has ``>= t``
  surviving neighbours holding its shares."""
  needed = jnp.logical_or(alive, live > 0)
  return jnp.all(jnp.logical_or(jnp.logical_not(needed), live >= threshold))


def _mod(v: jax.Array, modulus_bits: int) -> jax.Array:
  return v if modulus_bits == 32 else v & jnp.uint32(2 ** modulus_bits - 1)


def _prg(key: jax.Array, n: int, modulus_bits: int) -> jax.Array:
  return _mod(jax.random.bits(key, (n,), jnp.uint32), modulus_bits)


def self_key(key: jax.Array, i: jax.Array) -> jax.Array:
  """The key of ``b_i``, client ``i``'s self mask."""
  return jax.random.fold_in(jax.random.fold_in(key, _SELF), i)


def pair_key(key: jax.Array, i: jax.Array, j: jax.Array) -> jax.Array:
  """The key of ``s_ij`` (symmetric in ``i, j``)."""
  lo, hi = jnp.minimum(i, j), jnp.maximum(i, j)
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, _PAIR), lo), hi)


def _signed_masks(key: jax.Array, i: jax.Array, neighbors: jax.Array,
                  use_self: jax.Array, use_pair: jax.Array, n: int,
                  modulus_bits: int) -> jax.Array:
  """``use_self b_i + sum_slots use_pair (+-s_ij) mod m`` (``+`` if ``i < j``),
  every mask drawn in one vectorised PRG call."""
  keys = jnp.concatenate([
      self_key(key, i)[None],
      jax.vmap(lambda j: pair_key(key, i, j))(neighbors)])
  prg = jax.vmap(lambda k: _prg(k, n, modulus_bits))(keys)
  zero = jnp.zeros((), jnp.uint32)
  plus = jnp.concatenate([use_self[None], jnp.logical_and(use_pair, i < neighbors)])
  minus = jnp.concatenate([jnp.zeros((1,), bool),
                           jnp.logical_and(use_pair, i > neighbors)])
  add = jnp.sum(jnp.where(plus[:, None], prg, zero), axis=0, dtype=jnp.uint32)
  sub = jnp.sum(jnp.where(minus[:, None], prg, zero), axis=0, dtype=jnp.uint32)
  return _mod(add - sub, modulus_bits)


def masks(key: jax.Array, i: jax.Array, neighbors: jax.Array, n: int,
          modulus_bits: int) -> jax.Array:
  """Client ``i``'s mask ``b_i + sum_{j in N(i)} +-s_ij mod m``."""
  return _signed_masks(key, i, neighbors, jnp.ones((), bool),
                       jnp.ones(neighbors.shape, bool), n, modulus_bits)


def unmasking(key: jax.Array, alive: jax.Array, table: jax.Array, n: int,
              modulus_bits: int) -> jax.Array:
  """What the server subtracts: the survivors' ``b_i`` and, for each
  survivor ``i`` and dropped neighbour ``j``, ``+-s_ij`` (mod m)."""
  def one(i):
    live = alive[i]
    use_pair = jnp.logical_and(live, jnp.logical_not(alive[table[i]]))
    return _signed_masks(key, i, table[i], live, use_pair, n, modulus_bits)

  per = jax.lax.map(one, jnp.arange(table.shape[0], dtype=jnp.int32))
  return _mod(jnp.sum(per, axis=0, dtype=jnp.uint32), modulus_bits)


def randomized_round(key: jax.Array, y: jax.Array) -> jax.Array:
  """``floor(y) + Bernoulli(y - floor(y))`` as int32 (unbiased)."""
  low = jnp.floor(y)
  return (low + (jax.random.uniform(key, y.shape) < y - low)).astype(jnp.int32)


def to_modular(v: jax.Array, modulus_bits: int) -> jax.Array:
  """Signed int32 values as residues in ``[0, m)`` (two's complement is mod 2^32)."""
  return _mod(jax.lax.bitcast_convert_type(v.astype(jnp.int32), jnp.uint32),
              modulus_bits)


def centered(v: jax.Array, modulus_bits: int) -> jax.Array:
  """Residues in ``[0, m)`` as the signed values in ``[-m/2, m/2)`` (int32)."""
  signed = jax.lax.bitcast_convert_type(v, jnp.int32)
  if modulus_bits < 32:
    m = 2 ** modulus_bits
    signed = jnp.where(v >= m // 2, -(jnp.uint32(m) - v).astype(jnp.int32), signed)
  return signed


NoiseFn = Callable[[jax.Array, int], jax.Array]


def modular_sum(fn: str, *, bits: int, clip_norm: float, threshold: int,
                neighbors: int | None, rotation: bool, seed: int,
                scale: float | Callable[[int, int], float] | None,
                expected_clients_per_round: float | None = None,
                noise: NoiseFn | None = None,
                extra_metrics: Callable[[int, int], dict[str, float]] | None = None
                ) -> aggregators.Aggregator:
  """The secure sum of the module docstring, with optional per-client integer noise.

  ``scale`` is ``s``, or ``scale(cohort_size, length)``, or None: ``(m/2 -
  1) / (n C)``, which no sum of ``n`` clipped clients can wrap (every
  coordinate of ``R x_i`` is at most ``C``). ``noise(key, length)`` gives a
  client's integer noise (int32), added before the modular reduction.
  ``extra_metrics(cohort_size, length)`` adds constant metrics.
  """
  check_protocol(fn, bits, threshold, neighbors)
  base.check_number(fn, 'clip_norm', clip_norm, strict=True)
  if expected_clients_per_round is not None:
    base.check_number(fn, 'expected_clients_per_round',
                      expected_clients_per_round, strict=True)
  base.check_choice(fn, 'rotation', rotation, (False, True))
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f'{fn}: seed={seed!r} must be an int.')
  modulus = 2 ** bits

  def scale_of(cohort_size, length):
    if scale is None:
      return (modulus / 2 - 1) / (cohort_size * clip_norm)
    return float(scale(cohort_size, length) if callable(scale) else scale)

  def length_of(d):
    return compression.next_power_of_two(d) if rotation else d

  def init(params):
    return SecureSumState(jax.random.PRNGKey(seed),
                          compression.structure_template(params))

  def weights(num_examples):
    return base.aggregation_weights(num_examples, 'uniform')

  def broadcast(state):
    return {'shared_key': state.key}

  def client_inputs(state, client_ids, cohort_size):
    del client_ids
    if cohort_size < threshold + 1:
      raise ValueError(f'{fn}: threshold={threshold} needs a cohort of at '
                       f'least {threshold + 1} clients; this cohort has '
                       f'{cohort_size}.')
    d = compression._structure(state.template)[0]  # pylint: disable=protected-access
    return {'client_key': compression.client_keys(state.key, cohort_size),
            'position': jnp.arange(cohort_size, dtype=jnp.int32),
            'neighbors': neighbor_table(state.key, cohort_size,
                                        graph_offsets(cohort_size, neighbors)),
            'scale': jnp.full((cohort_size,),
                              scale_of(cohort_size, length_of(d)), jnp.float32)}

  def encode(hp, update, w):
    del w
    key, client_key = hp['shared_key'], hp['client_key']
    clipped, norm = aggregators.clip_update(update, clip_norm)
    x = compression._flat(clipped)  # pylint: disable=protected-access
    y = compression.rotate(jax.random.fold_in(key, _ROTATION), x) if rotation else x
    n = y.shape[0]
    v = randomized_round(jax.random.fold_in(client_key, 0), hp['scale'] * y)
    if noise is not None:
      v = v + noise(jax.random.fold_in(client_key, 1), n)
    masked = _mod(to_modular(v, bits) + masks(key, hp['position'],
                                              hp['neighbors'], n, bits), bits)
    message = {'masked': compression.pack_bits(masked, bits)}
    k = hp['neighbors'].shape[0]
    sent = (compression.representation_bits(message) + 2 * KEY_BITS
            + 3 * KEY_BITS * k)
    return message, {'upload_bits': jnp.float32(sent), 'norm': norm}

  def combine(state, hp, clients, key):
    del hp
    d, unravel = compression._structure(state.template)  # pylint: disable=protected-access
    n = length_of(d)
    cohort_size = clients.weights.shape[0]
    offsets = graph_offsets(cohort_size, neighbors)
    k = len(offsets)
    alive_f = fedjx.map_fn(lambda m: (m > 0).astype(jnp.float32),
                           (clients.num_examples,))
    # The survivors' masked vectors, summed modulo 2^32 (exact), then mod m.
    total = fedjx.reduce_sum(fedjx.map_fn(
        lambda msg, a: compression.unpack_bits(msg['masked'], bits, n)
        * a.astype(jnp.uint32), (clients.update, alive_f)))
    alive = clients.num_examples > 0
    table = neighbor_table(state.key, cohort_size, offsets)
    live = live_neighbors_of(table, alive)
    ok = unmaskable(live, alive, threshold)
    unmasked = _mod(total - unmasking(state.key, alive, table, n, bits), bits)
    survivors = fedjx.reduce_sum(alive_f)
    summed = centered(unmasked, bits).astype(jnp.float32) / scale_of(cohort_size, n)
    if rotation:
      summed = compression.unrotate(jax.random.fold_in(state.key, _ROTATION),
                                    summed, d)
    denom = aggregators.denominator(expected_clients_per_round, survivors)
    mean = jnp.where(ok, summed / denom, 0.0)
    count = jnp.maximum(survivors, 1.0)
    metrics = {
        'upload_bits': fedjx.reduce_sum(clients.encoded['upload_bits'] * alive_f) / count,
        'download_bits': jnp.float32(compression.model_bits(state.template) + 64),
        'secagg_failed': 1.0 - ok.astype(jnp.float32),
        'secagg_survivors': survivors,
        'secagg_min_live_neighbors': jnp.min(live).astype(jnp.float32),
        'secagg_client_ops': jnp.float32(k * k + n * k),
        'secagg_server_ops': jnp.float32(cohort_size * (k * k + n * k)),
        'mean_update_norm': fedjx.reduce_sum(clients.encoded['norm'] * alive_f) / count,
    }
    if extra_metrics is not None:
      metrics.update({name: jnp.float32(v) for name, v in
                      extra_metrics(cohort_size, n).items()})
    new_state = SecureSumState(
        jax.random.fold_in(compression._raw_key(key), _NEXT),  # pylint: disable=protected-access
        state.template)
    return unravel(mean), new_state, metrics

  return aggregators.Aggregator(
      init=init, combine=combine, encode=encode, weights=weights,
      broadcast=broadcast, client_inputs=client_inputs,
      traits=Traits(checks_update=True, wire_bits=True))


def secure_sum(bits: int = 32, clip_norm: float = 1.0, threshold: int = 2,
               neighbors: int | None = None, rotation: bool = True,
               scale: float | None = None,
               expected_clients_per_round: float | None = None,
               seed: int = 0) -> aggregators.Aggregator:
  """The mean of clipped updates through a simulated SecAgg / SecAgg+ sum.

  See the module docstring. ``bits``: the modulus ``m = 2^bits`` (2..32);
  ``clip_norm``: ``C``; ``threshold``: ``t``, the surviving neighbours every
  client needs; ``neighbors``: ``k`` (even; None: every other client, as
  SecAgg); ``rotation``: the shared Hadamard rotation; ``scale``: ``s``
  (None: no sum of the cohort can wrap); ``expected_clients_per_round``:
  divide by it rather than by the survivors; ``seed``: the first round's
  shared seed.
  """
  return modular_sum('secure_sum', bits=bits, clip_norm=clip_norm,
                     threshold=threshold, neighbors=neighbors,
                     rotation=rotation, seed=seed, scale=scale,
                     expected_clients_per_round=expected_clients_per_round)


__all__ = ['SecureSumState', 'centered', 'masks', 'modular_sum', 'pair_key', 'self_key',
           'neighbor_table', 'randomized_round', 'secure_sum', 'to_modular',
           'unmasking']
