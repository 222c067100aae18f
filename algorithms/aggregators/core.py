"""Aggregators: how the clients' updates become the server's one update.

An aggregator is a part of its own, like an optax transformation: any
algorithm takes one (``aggregator=``), so differential privacy, compression
and weighting are swapped without touching the algorithm. It has

* a per-client step, ``encode(hparams, Delta_i, w_i) -> (m_i, e_i)``, run on
  each client inside the algorithm's ``fedjx.map_fn`` (after the non-finite
  guard's check, so a skipped client's ``m_i`` and ``e_i`` are zero): weight,
  clip, quantize, add local noise; ``m_i`` is what the client sends and
  ``e_i`` per-client values for the aggregator's metrics;
* a server step, ``combine(state, hparams, clients, key) -> (Delta, state,
  metrics)``: weighted mean, noisy sum, decode, written with the fedjx
  reductions (so rounds stay MapReduce plans for Beam and ``fedjx.export``);
  ``clients`` is the :class:`fedjx.algorithms.nonfinite.Clients` of the round,
  whose ``update`` holds the messages ``m_i``;

with its own state (``init(params)``; stored in the algorithm's state as
``aggregator_state``), its own traced hyperparameters (``hparams``, stored at
the top level of ``state.hparams``), its own client weights (``weights``, or
None for the algorithm's ``weighting``) and the bytes one client sends
(``message_bytes``).

Aggregators here:

| aggregator | encode | combine |
|---|---|---|
| :func:`mean` (default) | ``m_i = Delta_i`` | ``sum_i w_i m_i / sum_i w_i`` |
| :func:`quantized_mean` | ``m_i = Q(Delta_i)`` | weighted mean |
| :func:`gaussian` (DP) | ``m_i = Delta_i min(1, C / ||Delta_i||)``, ``w_i = 1`` | ``(sum_i m_i + N(0, (zC)^2 I)) / D`` |
| ``adaptive_gaussian`` (DP) | clip to the state's ``C``, ``b_i = 1[||Delta_i|| <= C]`` | noisy mean, ``C`` to a quantile |
| ``tree_gaussian`` (DP-FTRL) | clip to ``C``, ``w_i = 1`` | ``(s_t - s_{t-1}) / D``, tree prefix sums |

``adaptive_gaussian`` is :func:`fedjx.algorithms.privacy.adaptive_gaussian`
(Andrew et al. 2021), ``tree_gaussian`` :func:`fedjx.algorithms.privacy.tree_gaussian`
(Kairouz et al. 2021). Those, the compressors, secure sums, distributed DP
and robust aggregators build on this module, which imports none of them; the
names a config gives them are :data:`fedjx.experiments.parts.AGGREGATORS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import fedjx
from fedjx.algorithms import base
from fedjx.algorithms import nonfinite
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.compression import quantization
from fedjx.algorithms.privacy import audit as privacy_audit
from fedjx.algorithms.traits import Privacy
from fedjx.algorithms.traits import Traits

Encode = Callable[[Mapping[str, jax.Array], base.PyTree, jax.Array],
                  tuple[base.PyTree, base.PyTree]]
Combine = Callable[[Any, Mapping[str, jax.Array], nonfinite.Clients, jax.Array],
                   tuple[base.PyTree, Any, base.Metrics]]


class Aggregator(NamedTuple):
  """A per-client ``encode`` and a server ``combine``, with state and metrics.

  Attributes:
    init: ``init(params) -> state`` (``()`` for a stateless aggregator).
    combine: ``combine(state, hparams, clients, key) -> (aggregate, state,
      metrics)``, on the server, with fedjx reductions over ``clients``.
    encode: ``encode(hparams, update, weight) -> (message, encoded)`` per
      client, or None to send the update as it is.
    hparams: initial traced hyperparameters, by name (``state.hparams[name]``).
    weights: ``weights(num_examples) -> w`` placed client weights, or None
      for the algorithm's ``weighting``.
    message_bytes: ``message_bytes(params) -> int``, bytes one client sends
      when the message has a fixed size known from the model (the float32
      update by default; a quantized mean's format). Not read when
      ``wire_bits`` is set.
    broadcast: ``broadcast(state) -> {name: value}``, the values of the
      aggregator's state the clients' ``encode`` reads (added to its
      ``hparams``; e.g. adaptive clipping's current clip norm), or None.
    client_inputs: ``client_inputs(state, client_ids, cohort_size) ->
      {name: placed value}``, per-client values ``encode`` reads in its
      ``hparams`` (e.g. a compressor's per-client key, an error-feedback
      residual gathered by ``client_ids``, which are None when the
      algorithm does not pass them), or None.
    traits: what the aggregator declares about itself
      (:class:`fedjx.algorithms.traits.Traits`): whether its per-client
      values check the update (``checks_update``: the non-finite guard then
      reads them instead of the client's model, :mod:`fedjx.algorithms.nonfinite`),
      whether it reads every client's message at once and why
      (``needs_all_updates``: its ``combine`` stacks the messages on the
      server, :func:`fedjx.plan.gather_to_server`, so Beam runs it and a
      streamed round refuses it with that phrase), whether its clients
      count their messages' bits on the wire (``wire_bits``: then
      ``encoded['upload_bits']`` per client, and ``combine`` reports their
      mean over the clients with data as ``upload_bits``, from which the
      round's bytes derive, :func:`upload_bytes`), and its DP mechanism
      (``privacy``, a :class:`~fedjx.algorithms.traits.Privacy`: its
      clipping and noise cover the message each client uploads, so an
      algorithm whose round releases more refuses it,
      :func:`fedjx.algorithms.base.check_private_uploads`). A wrapper of an
      aggregator (an attack, a privacy audit's canaries) keeps it, with
      ``weights`` and ``message_bytes``, built as ``wrapped._replace(init=...,
      combine=..., ...)``.
  """

  init: Callable[[base.Params], Any]
  combine: Combine
  encode: Encode | None = None
  hparams: Mapping[str, float] = {}
  weights: Callable[[jax.Array], jax.Array] | None = None
  message_bytes: Callable[[base.Params], int] = (
      lambda params: quantization.num_bytes(params, 'float32'))
  broadcast: Callable[[Any], Mapping[str, jax.Array]] | None = None
  client_inputs: Callable[[Any, Any, int], Mapping[str, Any]] | None = None
  traits: Traits = traits_lib.NONE


def _stateless(params: base.Params) -> tuple[()]:
  del params
  return ()


def _weighted_mean(state, hparams, clients, key):
  del hparams, key
  return nonfinite.weighted_mean(clients), state, {}


def mean() -> Aggregator:
  """The weighted mean ``sum_i w_i Delta_i / sum_i w_i`` (zero if no weight).

  The default of every algorithm (McMahan et al. 2017's FedAvg average).
  """
  return Aggregator(init=_stateless, combine=_weighted_mean)


def quantized_mean(fmt: str) -> Aggregator:
  """The weighted mean of quantized updates ``sum_i w_i Q(Delta_i) / sum_i w_i``.

  ``Q`` is :func:`fedjx.algorithms.compression.quantize` in ``fmt``
  (Streaming DiLoCo's 4-bit ``'e3m0'``, Douillard et al. 2025); the sum runs
  in the update's dtype (float32).
  """
  quantization.check_format('quantized_mean', 'fmt', fmt)
  if fmt == 'float32':
    return mean()
  encode = lambda hparams, update, w: (quantization.quantize(update, fmt), ())
  return Aggregator(init=_stateless, combine=_weighted_mean, encode=encode,
                    message_bytes=lambda p: quantization.num_bytes(p, fmt))


# ------------------------------------------------------------- DP (Gaussian)

def safe_global_norm(tree: base.PyTree) -> jax.Array:
  """``||tree||_2``, with a zero (not NaN) derivative at zero.

  NaN or Inf when ``tree`` holds one (the non-finite guard relies on it).
  """
  sq = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))
  positive = sq > 0
  # Where sq is not positive it is 0 (then the norm is 0) or NaN (kept).
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), sq)


def clip_update(update: base.PyTree, clip_norm: jax.Array) -> tuple[base.PyTree, jax.Array]:
  """``update min(1, C / ||update||)``: the update scaled into the C-ball.

  Returns the clipped update and the norm before clipping.
  """
  norm = safe_global_norm(update)
  factor = jnp.minimum(1.0, clip_norm / jnp.where(norm > 0, norm, 1.0))
  return jax.tree.map(lambda u: u * factor.astype(u.dtype), update), norm


def add_gaussian_noise(tree: base.PyTree, std: jax.Array,
                       key: jax.Array) -> base.PyTree:
  """``tree + N(0, std^2 I)``, one key per leaf from ``jax.random.split(key)``.

  Leaf ``i`` gets ``std * jax.random.normal(k_i, shape_i, dtype_i)``, drawn
  by :func:`normal_like` in a few compiled draws rather than one per leaf.
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  noise = normal_like(leaves, keys)
  return jax.tree.unflatten(treedef, [
      t + std.astype(t.dtype) * z for t, z in zip(leaves, noise)])


# A group of leaves drawn together may compute at most twice its leaves'
# elements plus this many.
_PADDING_ALLOWANCE = 2 ** 16


def normal_like(leaves: list[jax.Array], keys: jax.Array) -> list[jax.Array]:
  """``[jax.random.normal(keys[i], x.shape, x.dtype) for i, x in enumerate(leaves)]``.

  The same numbers, in fewer compiled draws. XLA compiles each threefry draw
  (JAX's default PRNG) on its own: with a draw per parameter leaf the DP
  rounds compiled 2-5x slower than their non-private base, and 4 leaves of
  an MLP's noise alone compiled in 6.7 s against 1.6 s drawn together (one
  measurement each, loaded 2-core CPU). With JAX's partitionable threefry
  (the default) an element's value depends only on the key and its flat
  index, so ``normal(k, (L,))[:n].reshape(shape) == normal(k, shape)`` for
  ``n = prod(shape) <= L``: leaves of one dtype are drawn as the rows of one
  ``vmap`` over their keys, at the size of the group's largest, and cut
  back. A group computes at most twice its leaves' elements plus 2^16.
  (Without partitionable threefry each leaf's noise is still an independent
  draw from its own key, with other values.)
  """
  out: list[jax.Array | None] = [None] * len(leaves)
  by_dtype: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    by_dtype.setdefault(jnp.dtype(x.dtype), []).append(i)
  for dtype, members in by_dtype.items():
    members = sorted(members, key=lambda i: -leaves[i].size)
    while members:
      width, group, total = leaves[members[0]].size, [], 0
      while members and (len(group) + 1) * width <= (
          2 * (total + leaves[members[0]].size) + _PADDING_ALLOWANCE):
        total += leaves[members[0]].size
        group.append(members.pop(0))
      draw = jax.vmap(lambda k, w=width, d=dtype: jax.random.normal(k, (w,), d))(
          keys[jnp.asarray(group)])
      for row, i in enumerate(group):
        out[i] = draw[row, :leaves[i].size].reshape(leaves[i].shape)
  return out


participants = nonfinite.participants


def denominator(expected_clients_per_round: float | None,
                count: jax.Array) -> jax.Array:
  """The DP mean's ``D``: ``qN`` if given, else the participating count (>= 1)."""
  if expected_clients_per_round is not None:
    return jnp.float32(expected_clients_per_round)
  return jnp.maximum(count, 1.0)


def check_dp_options(fn: str, noise_multiplier: float,
                     expected_clients_per_round: float | None,
                     **positive: float) -> None:
  """One-line errors for the options the DP aggregators share.

  ``noise_multiplier`` >= 0, ``expected_clients_per_round`` > 0 or None, and
  each of ``positive`` (e.g. ``clip_norm=...``) > 0.
  """
  for name, value in positive.items():
    base.check_number(fn, name, value, strict=True)
  base.check_number(fn, 'noise_multiplier', noise_multiplier)
  if expected_clients_per_round is not None:
    base.check_number(fn, 'expected_clients_per_round',
                      expected_clients_per_round, strict=True)


def audited(aggregator: Aggregator, canaries: Any,
            clip_norm: Callable[[Any, Mapping[str, jax.Array]], jax.Array],
            expected_clients_per_round: float | None) -> Aggregator:
  """``aggregator`` with the canary clients of a privacy audit, if any.

  ``canaries`` is a :class:`fedjx.algorithms.privacy.audit.Canaries` (or
  None: ``aggregator`` as it is); see
  :func:`fedjx.algorithms.privacy.audit.with_canaries`.
  """
  if canaries is None:
    return aggregator
  return privacy_audit.with_canaries(
      aggregator, canaries, clip_norm=clip_norm,
      expected_clients_per_round=expected_clients_per_round)


GAUSSIAN = Privacy('gaussian', 'central DP', mechanism='gaussian',
                    canaries=True)
""":func:`gaussian`'s mechanism, as its builder declares it."""


@traits_lib.declare(Traits(checks_update=True, privacy=GAUSSIAN))
def gaussian(clip_norm: float = 1.0, noise_multiplier: float = 1.0,
             expected_clients_per_round: float | None = None,
             canaries: Any = None) -> Aggregator:
  """User-level DP: clip each update, sum, add Gaussian noise, divide.

  McMahan et al., "Learning Differentially Private Recurrent Language
  Models", ICLR 2018, Algorithm 1:

      client k:  m_k = Delta_k min(1, C / ||Delta_k||)        (clip to C)
      server:    Delta = (sum_k m_k + N(0, (z C)^2 I)) / D

  Every client has weight 1 (the algorithm's ``weighting`` is not used), so
  adding or removing one client (Poisson cohorts), or zeroing it out
  (shuffled epochs), changes the sum by at most ``C``, and replacing one
  client's update by another's (fixed-size cohorts) by at most ``2C``: the
  round is a Gaussian mechanism with noise multiplier ``z``, or ``z / 2``
  under replace-one (:func:`fedjx.algorithms.privacy.accounting.sensitivity`
  derives it for each sampling; :mod:`fedjx.algorithms.privacy.accounting`
  accounts for it). ``D`` is
  ``expected_clients_per_round`` (``qN``, the fixed-denominator estimator) or,
  if None, the number of participating clients. ``C`` and ``z`` are traced:
  ``state.hparams['clip_norm']`` and ``state.hparams['noise_multiplier']``.
  The noise is drawn from the round's key. Metrics: ``clipped_fraction``,
  ``mean_update_norm`` (before clipping) and ``noise_std`` (``zC``).
  ``canaries``: the canary clients of a privacy audit
  (:mod:`fedjx.algorithms.privacy.audit`; the runner sets them from
  ``config.privacy.audit``), or None.
  """
  fn = 'gaussian'
  check_dp_options(fn, noise_multiplier, expected_clients_per_round,
                   clip_norm=clip_norm)

  def weights(num_examples):
    return base.aggregation_weights(num_examples, 'uniform')

  def encode(hparams, update, w):
    clipped, norm = clip_update(update, hparams['clip_norm'])
    return jax.tree.map(lambda u: u * w.astype(u.dtype), clipped), norm

  def combine(state, hparams, clients, key):
    clip, z = hparams['clip_norm'], hparams['noise_multiplier']
    real, norms = clients.weights, clients.encoded
    noisy = add_gaussian_noise(fedjx.reduce_sum(clients.update), z * clip, key)
    count = participants(clients)
    denom = denominator(expected_clients_per_round, count)
    aggregate = jax.tree.map(lambda t: t / denom.astype(t.dtype), noisy)
    clipped_count = fedjx.reduce_sum(real * (norms > clip).astype(jnp.float32))
    metrics = {
        'clipped_fraction': clipped_count / jnp.maximum(count, 1.0),
        'mean_update_norm': fedjx.reduce_sum(real * norms) / jnp.maximum(count, 1.0),
        'noise_std': z * clip}
    return aggregate, state, metrics

  privacy = GAUSSIAN._replace(
      noise_multiplier=noise_multiplier,
      expected_clients_per_round=expected_clients_per_round)
  return audited(Aggregator(init=_stateless, combine=combine, encode=encode,
                            hparams={'clip_norm': clip_norm,
                                     'noise_multiplier': noise_multiplier},
                            weights=weights,
                            traits=gaussian.traits._replace(privacy=privacy)),
                 canaries, lambda state, hparams: hparams['clip_norm'],
                 expected_clients_per_round)


# ------------------------------------------------------------ for algorithms

def check(fn: str, aggregator: Any) -> Aggregator:
  """The aggregator (default :func:`mean`), or a one-line error.

  ``aggregator`` is an :class:`Aggregator` or None. A config names one as
  ``{'name': ..., **options}``, which the experiments layer builds
  (:func:`fedjx.experiments.parts.build_aggregator`).
  """
  if aggregator is None:
    return mean()
  if isinstance(aggregator, Mapping):
    raise ValueError(f'{fn}: aggregator={aggregator!r} is a config spec; '
                     'build it with fedjx.experiments.parts.build_aggregator, '
                     'or pass an Aggregator (e.g. mean(), gaussian(...)).')
  if not isinstance(aggregator, Aggregator):
    raise ValueError(f'{fn}: aggregator={aggregator!r} is not a '
                     'fedjx.algorithms.aggregators.Aggregator (e.g. mean(), '
                     'gaussian(...), quantized_mean(...)).')
  return aggregator


def init_hparams(aggregator: Aggregator) -> dict[str, jax.Array]:
  """The aggregator's entries of ``state.hparams``."""
  return {k: jnp.asarray(v, jnp.float32) for k, v in aggregator.hparams.items()}


def hparams_of(aggregator: Aggregator,
               hparams: Mapping[str, Any]) -> dict[str, jax.Array]:
  """The aggregator's hyperparameters read from ``state.hparams``."""
  return {k: hparams[k] for k in aggregator.hparams}


def encode_hparams(aggregator: Aggregator, hparams: Mapping[str, Any],
                   aggregator_state: Any) -> dict[str, jax.Array]:
  """What ``encode`` reads: the hyperparameters and the broadcast state.

  ``aggregator_state`` is the algorithm's ``state.aggregator_state``; an
  aggregator with a ``broadcast`` needs it (None is refused).
  """
  hp = hparams_of(aggregator, hparams)
  if aggregator.broadcast is not None:
    if aggregator_state is None:
      raise ValueError('map_clients: aggregator_state=None, but this '
                       'aggregator\'s clients read its state (pass '
                       'aggregator_state=state.aggregator_state).')
    hp.update(aggregator.broadcast(aggregator_state))
  return hp


def client_weights(aggregator: Aggregator, num_examples: jax.Array,
                   weighting: str) -> jax.Array:
  """The placed ``w_i``: the aggregator's own, or the algorithm's weighting."""
  if aggregator.weights is not None:
    return aggregator.weights(num_examples)
  return base.aggregation_weights(num_examples, weighting)


def map_clients(aggregator: Aggregator, hparams: Mapping[str, Any],
                client_fn: Callable[..., nonfinite.ClientOutput], args: tuple,
                num_examples: jax.Array, weighting: str,
                skip_nonfinite: bool,
                aggregator_state: Any = None,
                client_ids: jax.Array | None = None,
                rows: Any = None) -> nonfinite.Clients:
  """:func:`fedjx.algorithms.nonfinite.map_clients` with the aggregator's encode.

  ``hparams`` is the algorithm's ``state.hparams`` and ``aggregator_state``
  its ``state.aggregator_state`` (needed when the aggregator has a
  ``broadcast``). ``client_ids`` (the cohort's ``client_ids``) reach the
  aggregator's combine as ``clients.client_ids``. ``rows``: the clients'
  stored state (:func:`fedjx.algorithms.nonfinite.map_clients`).
  """
  clients = nonfinite.map_clients(
      client_fn, args, client_weights(aggregator, num_examples, weighting),
      num_examples, skip_nonfinite, encode=aggregator.encode,
      encode_hparams=encode_hparams(aggregator, hparams, aggregator_state),
      check_encoded=aggregator.traits.checks_update,
      encode_inputs=client_inputs(aggregator, aggregator_state, client_ids,
                                  num_examples), rows=rows)
  return clients._replace(client_ids=client_ids)


def client_inputs(aggregator: Aggregator, aggregator_state: Any,
                  client_ids: Any, num_examples: jax.Array) -> dict[str, Any]:
  """The placed per-client values of ``aggregator.client_inputs`` (or ``{}``)."""
  if aggregator.client_inputs is None:
    return {}
  return dict(aggregator.client_inputs(aggregator_state, client_ids,
                                       jnp.shape(num_examples)[0]))


def encode_map(aggregator: Aggregator, hparams: Mapping[str, Any],
               clients: nonfinite.Clients, fn: Callable[..., base.PyTree],
               args: tuple, aggregator_state: Any = None) -> nonfinite.Clients:
  """``clients`` whose messages are the encoded ``fn(*args)``, in a further map.

  For updates computed after the algorithm's client map (e.g. Streaming
  DiLoCo's outer gradient of one fragment). ``fn`` must give finite values
  for kept clients; skipped clients have weight 0. ``aggregator_state`` as
  for :func:`map_clients`.
  """
  hp = encode_hparams(aggregator, hparams, aggregator_state)
  encode = aggregator.encode or (lambda h, u, w: (u, ()))
  guarded = clients.totals is not None

  def one(w, *a):
    h, a = (a[0], a[1:]) if hp else ({}, a)
    message, encoded = encode(h, fn(*a), w)
    weighted = (jax.tree.map(lambda v: w * v, message) if guarded else ())
    return message, weighted, encoded

  placed = client_inputs(aggregator, aggregator_state, clients.client_ids,
                         clients.num_examples)
  hp_args = (dict(fedjx.broadcast(hp), **placed),) if hp or placed else ()
  hp = hp or placed
  message, weighted, encoded = fedjx.map_fn(
      one, (clients.weights,) + hp_args + tuple(args))
  return clients._replace(update=message,
                          weighted_update=weighted if guarded else None,
                          encoded=encoded)


def upload_bytes(aggregator: Aggregator, params: base.Params,
                 clients: jax.Array, metrics: Mapping[str, jax.Array]) -> jax.Array:
  """Bytes the round's ``clients`` (the count of clients with data) uploaded.

  ``clients * upload_bits / 8`` for an aggregator that counts its messages'
  bits (``wire_bits``: ``metrics['upload_bits']`` is their mean over the
  clients with data), else ``clients * message_bytes(params)``.
  """
  clients = jnp.asarray(clients, jnp.float32)
  if aggregator.traits.wire_bits:
    return clients * metrics['upload_bits'] / 8.0
  return clients * jnp.float32(aggregator.message_bytes(params))


def aggregate(aggregator: Aggregator, state: Any, hparams: Mapping[str, Any],
              clients: nonfinite.Clients,
              key: jax.Array) -> tuple[base.PyTree, Any, base.Metrics]:
  """``aggregator.combine`` with its hyperparameters read from ``state.hparams``."""
  return aggregator.combine(state, hparams_of(aggregator, hparams), clients, key)


def step(aggregator: Aggregator, optimizer, state: Any,
         optimizer_hparams: Mapping[str, jax.Array], clients: nonfinite.Clients,
         key: jax.Array) -> tuple[base.PyTree, base.Params, Any, Any, base.Metrics]:
  """The server's half of a round: combine, then ``x <- x + ServerOpt(Delta)``.

  ``state`` has ``params``, ``opt_state``, ``hparams`` and
  ``aggregator_state``. Returns ``(Delta, params, opt_state,
  aggregator_state, aggregator_metrics)``.
  """
  delta, agg_state, metrics = aggregate(aggregator, state.aggregator_state,
                                        state.hparams, clients, key)
  params, opt_state = base.server_update(optimizer, state.opt_state,
                                         optimizer_hparams, state.params, delta)
  return delta, params, opt_state, agg_state, metrics


__all__ = ['Aggregator', 'add_gaussian_noise', 'audited',
           'clip_update', 'denominator', 'gaussian', 'mean', 'normal_like',
           'participants', 'quantized_mean', 'safe_global_norm', 'upload_bytes']
