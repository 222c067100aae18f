"""Federated LoRA aggregation rules, each written as one MapReduce round.

Clients fine-tune a frozen model through LoRA adapters (Hu et al. 2021,
"LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685). For
one adapted weight ``W [n_in, n_out]`` (Flax layout, ``y = x W``) an adapter
is a pair ``a [..., n_in, r]``, ``b [..., r, n_out]`` (``...``: an optional
stacked layer axis, batched everywhere) and the effective weight is

    W + s a b,    s = alpha / r_max,

one ``s`` for everyone. A client of rank ``r_k < r_max`` holds zeros in the
columns ``r_k..r_max-1`` of ``a`` and the same rows of ``b`` (zero padding:
its product is unchanged, :func:`truncate`). An adapter tree ("pairs") is
``{name: {'a': a, 'b': b}}``.

A rule is a :class:`LoraAggregation`: a per-client ``client_weight`` (``w_k``)
and ``client_message`` (a tree to sum, ``sum_k m_k``, and a tree to average,
``sum_k w_k m_k / sum_k w_k``), run on one client inside ``fedjx.map_fn``,
and a ``server_update`` that turns the two reduced trees into the new global
adapters (and, for FLoRA, a dense delta merged into the frozen base). With
``n_k`` the client's example count, ``W = sum_k w_k``, ``P_k = s a_k b_k``:

* FedIT (Zhang et al. 2024, "Towards Building the Federated GPT: Federated
  Instruction Tuning", arXiv 2305.05644), :func:`fedit`:
  ``w_k = n_k``, ``a = sum_k w_k a_k / W``, ``b = sum_k w_k b_k / W``. Its
  product ``s a b`` is not the mean of the products ``sum_k w_k P_k / W``:
  the cross terms ``s a_j b_k`` (``j != k``) remain.
* FFA-LoRA (Sun et al. 2024, "Improving LoRA in Privacy-preserving Federated
  Learning", arXiv 2403.12313), :func:`ffa`: ``a`` stays frozen at its
  initialization (the global ``a``, shared by every client; the clients'
  ``a`` are not read), ``b = sum_k w_k b_k / W`` with ``w_k = n_k``; exact:
  ``s a b = sum_k w_k s a b_k / W``.
* FlexLoRA (Bai et al. 2024, "Federated Fine-tuning of Large Language Models
  under Heterogeneous Tasks and Client Resources", arXiv 2402.11505),
  :func:`flexlora`: ``P = sum_k w_k P_k / W`` (dense, ``w_k = n_k``), SVD
  ``P = U S V^T``, ``a = U_r sqrt(S_r) / sqrt(s)``,
  ``b = sqrt(S_r) V_r^T / sqrt(s)`` with ``r = r_max``: ``s a b`` is the best
  rank-``r_max`` approximation of ``P`` (Eckart-Young), and since the
  singular values are sorted, ``truncate(global, r_k)`` is the best
  rank-``r_k`` approximation (nested truncation).
* FLoRA (Wang et al. 2024, "FLoRA: Federated Fine-Tuning Large Language
  Models with Heterogeneous Low-Rank Adaptations", arXiv 2409.05976),
  :func:`flora`: stacking. Client ``k`` of ``C`` places ``a_k`` in block
  ``k`` of a zero ``[..., n_in, C r_max]`` (summed) and ``b_k`` in block
  ``k`` of a zero ``[..., C r_max, n_out]`` (averaged, ``w_k = n_k``):
  ``A = [a_1 ... a_C]``, ``B = [w_1 b_1; ...; w_C b_C] / W``, so
  ``s A B = sum_k w_k P_k / W`` exactly, for heterogeneous ranks too. The
  server merges ``s A B`` into the base (``Result.merged``) and
  re-initializes the adapters: ``a ~ he_uniform`` (fan-in ``n_in``), ``b = 0``.
* HetLoRA (Cho et al. 2024, "Heterogeneous LoRA for Federated Fine-tuning of
  On-Device Foundation Models", arXiv 2401.06432, EMNLP 2024),
  :func:`hetlora`: zero padding to ``r_max`` and sparsity-weighted
  aggregation, ``S_k = ||P_k||_F``, ``p_k = S_k / sum_j S_j``,
  ``a = sum_k p_k a_k``, ``b = sum_k p_k b_k``; a client of rank ``r_k``
  then receives ``truncate(global, r_k)``. The paper's rank self-pruning is
  :func:`self_prune` (its docstring states the reading implemented).

:func:`aggregate` is the reference driver (plain ``jnp`` reductions over a
leading client axis); :func:`federated_round` runs the same rule with
``fedjx.map_fn``, ``fedjx.reduce_sum`` and ``fedjx.reduce_weighted_mean``
inside a ``fedjx.program``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fedjx

Pair = Mapping[str, jax.Array]
Pairs = Mapping[str, Pair]


class Result(NamedTuple):
  """What a server update returns.

  Attributes:
    adapters: the new global adapters ``{name: {'a', 'b'}}`` (rank ``r_max``).
    merged: ``{name: delta [..., n_in, n_out]}`` to add to the frozen base
      weight (``{}`` when the rule merges nothing).
  """

  adapters: dict
  merged: dict


class LoraAggregation(NamedTuple):
  """A federated LoRA aggregation rule in MapReduce form.

  Attributes:
    name: the rule's name.
    client_weight: ``(client_pairs, num_examples, scale) -> w_k`` (a scalar,
      ``>= 0``), the weight of the client in the averaged reduction.
    client_message: ``(client_pairs, global_pairs, index, num_clients, scale)
      -> (summed, averaged)``, two trees (either may be ``{}``): the first is
      reduced by ``sum_k m_k``, the second by ``sum_k w_k m_k / sum_k w_k``.
    server_update: ``(global_pairs, summed, averaged, ranks_max, scale, key)
      -> Result``.
  """

  name: str
  client_weight: Callable[..., jax.Array]
  client_message: Callable[..., tuple[Any, Any]]
  server_update: Callable[..., Result]


# ------------------------------------------------------------ validation

def _concrete(x: Any) -> np.ndarray | None:
  """``x`` as a NumPy array, or None when it is a tracer (checks are skipped)."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _check_int(caller: str, arg: str, value: Any, low: int, high: int | None) -> None:
  v = _concrete(value)
  if v is None:
    return
  if v.ndim != 0 or not (np.issubdtype(v.dtype, np.integer) or float(v) == int(v)):
    raise ValueError(f'{caller}: {arg} must be an integer scalar; got {value!r}.')
  allowed = f'>= {low}' if high is None else f'in [{low}, {high}]'
  if int(v) < low or (high is not None and int(v) > high):
    raise ValueError(f'{caller}: {arg}={int(v)} is out of range; allowed: {allowed}.')


def _check_scale(caller: str, scale: Any) -> None:
  v = _concrete(scale)
  if v is not None and (v.ndim != 0 or not np.isfinite(v) or float(v) <= 0):
    raise ValueError(f'{caller}: scale={scale!r} must be a positive finite scalar '
                     '(alpha / r_max).')


def _check_pair(caller: str, arg: str, name: str, pair: Any, lead: int) -> None:
  """Checks one pair: keys ``a``, ``b``; ``a [*L, n_in, r]``, ``b [*L, r, n_out]``."""
  if not isinstance(pair, Mapping) or set(pair) != {'a', 'b'}:
    keys = sorted(pair) if isinstance(pair, Mapping) else type(pair).__name__
    raise ValueError(f"{caller}: {arg}[{name!r}] must be a dict with keys 'a' and 'b'; "
                     f'got {keys}.')
  a, b = jnp.shape(pair['a']), jnp.shape(pair['b'])
  if len(a) < 2 + lead or len(a) != len(b) or a[:-2] != b[:-2] or a[-1] != b[-2]:
    raise ValueError(
        f"{caller}: {arg}[{name!r}] has a of shape {a} and b of shape {b}; allowed: "
        f"a [{'C, ' * lead}..., n_in, r] and b [{'C, ' * lead}..., r, n_out] with the same "
        'leading axes and the same r.')


def check_pairs(caller: str, arg: str, pairs: Any, *, lead: int = 0) -> None:
  """Raises ValueError unless ``pairs`` is ``{name: {'a', 'b'}}`` of matching shapes.

  Args:
    caller: the function named in the error.
    arg: the argument named in the error.
    pairs: the adapter tree.
    lead: the number of leading axes (1 for a client axis) before the layer axes.
  """
  if not isinstance(pairs, Mapping) or not pairs:
    raise ValueError(f"{caller}: {arg} must be a non-empty dict {{name: {{'a', 'b'}}}}; "
                     f'got {type(pairs).__name__}.')
  for name, pair in pairs.items():
    _check_pair(caller, arg, name, pair, lead)


def _check_against(caller: str, arg: str, pairs: Pairs, ref_arg: str, ref: Pairs,
                   lead: int) -> None:
  """``pairs`` has the names of ``ref`` and the same shapes after ``lead`` axes."""
  if set(pairs) != set(ref):
    raise ValueError(f'{caller}: {arg} has names {sorted(pairs)} but {ref_arg} has '
                     f'{sorted(ref)}; they must be the same.')
  for name in ref:
    for part in ('a', 'b'):
      got, want = jnp.shape(pairs[name][part])[lead:], jnp.shape(ref[name][part])
      if got != want:
        raise ValueError(f"{caller}: {arg}[{name!r}]['{part}'] has shape {got} after the "
                         f'client axis but {ref_arg} has {want}; they must match.')


def _check_weights(caller: str, arg: str, weights: Any, num_clients: int) -> None:
  if jnp.shape(weights) != (num_clients,):
    raise ValueError(f'{caller}: {arg} has shape {jnp.shape(weights)}; allowed: '
                     f'({num_clients},), one entry per client.')
  v = _concrete(weights)
  if v is not None and (not np.all(np.isfinite(v)) or np.any(v < 0)):
    raise ValueError(f'{caller}: {arg}={v.tolist()} has a negative or non-finite entry; '
                     'allowed: finite values >= 0.')


# --------------------------------------------------------------- helpers

def rank_mask(r_max: int, rank: Any) -> jax.Array:
  """The float32 ``[r_max]`` mask ``1[j < rank]`` (``rank`` may be traced)."""
  _check_int('rank_mask', 'r_max', r_max, 1, None)
  _check_int('rank_mask', 'rank', rank, 0, int(r_max))
  return (jnp.arange(int(r_max)) < rank).astype(jnp.float32)


def truncate(pairs: Pairs, rank: Any) -> dict:
  """Zeroes the columns ``>= rank`` of every ``a`` and the rows of every ``b``.

  What a client of rank ``rank`` receives (zero padding to ``r_max``).
  """
  check_pairs('truncate', 'pairs', pairs)
  out = {}
  for name, pair in pairs.items():
    r_max = jnp.shape(pair['a'])[-1]
    _check_int('truncate', 'rank', rank, 0, r_max)
    mask = rank_mask(r_max, rank)
    out[name] = {'a': pair['a'] * mask.astype(pair['a'].dtype),
                 'b': pair['b'] * mask[:, None].astype(pair['b'].dtype)}
  return out


def product(pair: Pair, scale: Any) -> jax.Array:
  """The adapter's dense delta ``s a b`` of shape ``[..., n_in, n_out]``."""
  return scale * jnp.matmul(pair['a'], pair['b'])


def effective_delta(result: Result, scale: Any) -> dict:
  """``{name: merged + s a b}``: the total change of each base weight."""
  return {name: product(pair, scale) + result.merged.get(name, 0.0)
          for name, pair in result.adapters.items()}


def exact_mean_product(client_pairs: Pairs, num_examples: Any, *, scale: Any) -> dict:
  """``{name: sum_k n_k s a_k b_k / sum_k n_k}`` over a leading client axis."""
  check_pairs('exact_mean_product', 'client_pairs', client_pairs, lead=1)
  w = jnp.asarray(num_examples, jnp.float32)
  total = jnp.sum(w)
  return {name: jnp.tensordot(w, product(pair, scale), axes=1) / jnp.where(total > 0, total, 1)
          for name, pair in client_pairs.items()}


def _frobenius(x: jax.Array) -> jax.Array:
  """``||x||_F`` over the last two axes (one norm per stacked matrix).

  Differentiable at zero (gradient 0 there, where ``sqrt`` has none): the
  tail score is a training regularizer and the tails start at ``b = 0``.
  """
  squares = jnp.sum(jnp.square(x), axis=(-2, -1))
  positive = squares > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, squares, 1.0)), 0.0)


def _divide(x: jax.Array, total: jax.Array, fallback: jax.Array) -> jax.Array:
  """``x / total`` where ``total > 0``, else ``fallback`` (``total`` per matrix)."""
  positive = (total > 0)[..., None, None]
  safe = jnp.where(total > 0, total, 1.0)[..., None, None]
  return jnp.where(positive, x / safe.astype(x.dtype), fallback)


# ------------------------------------------------------------------ FedIT

def _examples(client_pairs: Pairs, num_examples: Any, scale: Any) -> jax.Array:
  del client_pairs, scale
  return jnp.asarray(num_examples, jnp.float32)


def fedit() -> LoraAggregation:
  """FedIT: ``a = sum_k n_k a_k / sum_k n_k``, ``b`` likewise (not the mean of products)."""

  def message(client_pairs, global_pairs, index, num_clients, scale):
    del global_pairs, index, num_clients, scale
    return {}, dict(client_pairs)

  def server(global_pairs, summed, averaged, ranks_max, scale, key):
    del global_pairs, summed, ranks_max, scale, key
    return Result(adapters={n: {'a': p['a'], 'b': p['b']} for n, p in averaged.items()},
                  merged={})

  return LoraAggregation('fedit', _examples, message, server)


# --------------------------------------------------------------- FFA-LoRA

def ffa() -> LoraAggregation:
  """FFA-LoRA: the global ``a`` kept (frozen), ``b = sum_k n_k b_k / sum_k n_k``."""

  def message(client_pairs, global_pairs, index, num_clients, scale):
    del global_pairs, index, num_clients, scale
    return {}, {name: {'b': pair['b']} for name, pair in client_pairs.items()}

  def server(global_pairs, summed, averaged, ranks_max, scale, key):
    del summed, ranks_max, scale, key
    return Result(adapters={n: {'a': global_pairs[n]['a'], 'b': averaged[n]['b']}
                            for n in global_pairs},
                  merged={})

  return LoraAggregation('ffa', _examples, message, server)


# --------------------------------------------------------------- FlexLoRA

def _canonical_signs(u: jax.Array, vt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Flips each singular pair so the largest-magnitude entry of ``u``'s column is positive.

  ``u v^T`` is unchanged; the factors no longer depend on the SVD kernel's
  arbitrary signs (e.g. jitted or not).
  """
  pick = jnp.argmax(jnp.abs(u), axis=-2, keepdims=True)
  sign = jnp.sign(jnp.take_along_axis(u, pick, axis=-2))
  sign = jnp.where(sign == 0, 1.0, sign).astype(u.dtype)
  return u * sign, vt * jnp.swapaxes(sign, -1, -2)


def svd_factors(delta: jax.Array, rank: int, scale: Any) -> dict:
  """Adapters of rank ``rank`` whose ``s a b`` is the best rank-``rank`` fit of ``delta``.

  ``delta = U S V^T`` (batched over leading axes); ``a = U_r sqrt(S_r) /
  sqrt(s)``, ``b = sqrt(S_r) V_r^T / sqrt(s)``, zero-padded when ``rank``
  exceeds ``min(n_in, n_out)``. Each singular pair's sign is fixed so the
  largest-magnitude entry of its ``U`` column is positive.
  """
  _check_int('svd_factors', 'rank', rank, 1, None)
  u, sv, vt = jnp.linalg.svd(delta, full_matrices=False)
  r = min(int(rank), sv.shape[-1])
  u, vt = _canonical_signs(u[..., :, :r], vt[..., :r, :])
  root = jnp.sqrt(sv[..., :r]) / jnp.sqrt(jnp.asarray(scale, delta.dtype))
  a = u * root[..., None, :]
  b = root[..., :, None] * vt
  pad = int(rank) - r
  if pad:
    a = jnp.concatenate([a, jnp.zeros(a.shape[:-1] + (pad,), a.dtype)], axis=-1)
    b = jnp.concatenate([b, jnp.zeros(b.shape[:-2] + (pad, b.shape[-1]), b.dtype)], axis=-2)
  return {'a': a, 'b': b}


def flexlora() -> LoraAggregation:
  """FlexLoRA: the weighted mean of products, refactored by a truncated SVD to ``r_max``."""

  def message(client_pairs, global_pairs, index, num_clients, scale):
    del global_pairs, index, num_clients
    return {}, {name: product(pair, scale) for name, pair in client_pairs.items()}

  def server(global_pairs, summed, averaged, ranks_max, scale, key):
    del global_pairs, summed, key
    return Result(adapters={n: svd_factors(p, ranks_max, scale) for n, p in averaged.items()},
                  merged={})

  return LoraAggregation('flexlora', _examples, message, server)


# ------------------------------------------------------------------ FLoRA

def _block(index: jax.Array, num_clients: int) -> jax.Array:
  return jax.nn.one_hot(index, num_clients, dtype=jnp.float32)


def stack_block(pair: Pair, index: Any, num_clients: int) -> dict:
  """FLoRA's blocks: ``a`` in column block ``index`` of ``[..., n_in, C r]``, ``b`` in row block.

  ``b`` goes to row block ``index`` of a zero ``[..., C r, n_out]``.
  """
  a, b = pair['a'], pair['b']
  hot = _block(index, num_clients)
  a_stack = jnp.einsum('c,...ir->...icr', hot.astype(a.dtype), a)
  b_stack = jnp.einsum('c,...rj->...crj', hot.astype(b.dtype), b)
  r = a.shape[-1]
  return {'a': a_stack.reshape(a.shape[:-1] + (num_clients * r,)),
          'b': b_stack.reshape(b.shape[:-2] + (num_clients * r, b.shape[-1]))}


def init_adapters(global_pairs: Pairs, key: jax.Array) -> dict:
  """Fresh adapters: ``a ~ he_uniform`` (fan-in ``n_in``), ``b = 0``.

  The key of the ``i``-th name in sorted order is ``jax.random.fold_in(key, i)``.
  """
  out = {}
  for i, name in enumerate(sorted(global_pairs)):
    a, b = global_pairs[name]['a'], global_pairs[name]['b']
    init = jax.nn.initializers.he_uniform(batch_axis=tuple(range(a.ndim - 2)))
    out[name] = {'a': init(jax.random.fold_in(key, i), a.shape, a.dtype),
                 'b': jnp.zeros_like(b)}
  return out


def flora() -> LoraAggregation:
  """FLoRA: stacked adapters, ``s A B`` merged into the base, adapters re-initialized."""

  def message(client_pairs, global_pairs, index, num_clients, scale):
    del global_pairs, scale
    stacks = {n: stack_block(p, index, num_clients) for n, p in client_pairs.items()}
    return ({n: {'a': s['a']} for n, s in stacks.items()},
            {n: {'b': s['b']} for n, s in stacks.items()})

  def server(global_pairs, summed, averaged, ranks_max, scale, key):
    del ranks_max
    merged = {n: scale * jnp.matmul(summed[n]['a'], averaged[n]['b']) for n in global_pairs}
    return Result(adapters=init_adapters(global_pairs, key), merged=merged)

  return LoraAggregation('flora', _examples, message, server)


# ---------------------------------------------------------------- HetLoRA

def _client_norm(client_pairs: Pairs, num_examples: Any, scale: Any) -> jax.Array:
  """``||Delta W_k||_F`` over all the client's adapted matrices: ``sqrt(sum ||s a b||_F^2)``."""
  del num_examples
  return jnp.sqrt(sum(jnp.sum(jnp.square(product(p, scale))) for p in client_pairs.values()))


def hetlora(*, weighting: str = 'matrix') -> LoraAggregation:
  """HetLoRA sparsity-weighted aggregation of zero-padded adapters.

  ``p_k = S_k / sum_j S_j``, ``a = sum_k p_k a_k``, ``b = sum_k p_k b_k``
  with ``S_k = ||s a_k b_k||_F``. Where every ``S_k`` is zero the global
  adapters are kept.

  Args:
    weighting: ``'matrix'``: one ``S_k`` per adapted matrix (and per stacked
      layer), the reduction an unweighted sum of ``(S_k a_k, S_k b_k, S_k)``;
      ``'client'``: one ``S_k`` per client, the norm of all its deltas
      together, used as the client weight of the averaged reduction.

  Returns:
    The rule.
  """
  if weighting not in ('matrix', 'client'):
    raise ValueError(f"hetlora: weighting={weighting!r}; allowed: 'matrix', 'client'.")

  def message(client_pairs, global_pairs, index, num_clients, scale):
    del global_pairs, index, num_clients
    if weighting == 'client':
      return {'norm': _client_norm(client_pairs, None, scale)}, dict(client_pairs)
    summed = {}
    for name, pair in client_pairs.items():
      norm = _frobenius(product(pair, scale))
      summed[name] = {'a': pair['a'] * norm[..., None, None],
                      'b': pair['b'] * norm[..., None, None], 'norm': norm}
    return summed, {}

  def server(global_pairs, summed, averaged, ranks_max, scale, key):
    del ranks_max, scale, key
    out = {}
    for name, g in global_pairs.items():
      if weighting == 'client':
        keep = summed['norm'] > 0
        out[name] = {k: jnp.where(keep, averaged[name][k], g[k]) for k in ('a', 'b')}
      else:
        s = summed[name]
        out[name] = {k: _divide(s[k], s['norm'], g[k]) for k in ('a', 'b')}
    return Result(adapters=out, merged={})

  weight = _client_norm if weighting == 'client' else _examples
  name = 'hetlora' if weighting == 'matrix' else 'hetlora_client'
  return LoraAggregation(name, weight, message, server)


def _as_pairs(pair_or_pairs: Any) -> Pairs:
  if isinstance(pair_or_pairs, Mapping) and set(pair_or_pairs) == {'a', 'b'} and not any(
      isinstance(v, Mapping) for v in pair_or_pairs.values()):
    return {'pair': pair_or_pairs}
  return pair_or_pairs


def _check_decay(caller: str, decay: Any) -> None:
  if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
    raise ValueError(f'{caller}: decay={decay!r}; allowed: a float in (0, 1) (the '
                     "paper's gamma, the fraction of the rank kept when pruning).")


def pruned_rank(rank: Any, *, decay: float) -> jax.Array:
  """``max(1, floor(decay * rank))``: the rank after one pruning step."""
  _check_decay('pruned_rank', decay)
  return jnp.maximum(1, jnp.floor(decay * jnp.asarray(rank, jnp.float32)).astype(jnp.int32))


def tail_norm(pair_or_pairs: Any, rank: Any, *, decay: float) -> jax.Array:
  """HetLoRA's tail score ``sum ||a[..., :, t:rank]||_F ||b[..., t:rank, :]||_F``.

  ``t = floor(decay rank)``; one product of norms per adapted matrix and
  stacked layer, summed. Also usable, times ``lambda``, as the local
  training regularizer of HetLoRA's self-pruning.
  """
  _check_decay('tail_norm', decay)
  pairs = _as_pairs(pair_or_pairs)
  check_pairs('tail_norm', 'pair_or_pairs', pairs)
  start = jnp.floor(decay * jnp.asarray(rank, jnp.float32)).astype(jnp.int32)
  total = jnp.zeros((), jnp.float32)
  for pair in pairs.values():
    r_max = jnp.shape(pair['a'])[-1]
    _check_int('tail_norm', 'rank', rank, 1, r_max)
    j = jnp.arange(r_max)
    tail = ((j >= start) & (j < rank)).astype(pair['a'].dtype)
    na = _frobenius(pair['a'] * tail)
    nb = _frobenius(pair['b'] * tail[:, None])
    total = total + jnp.sum(na * nb)
  return total


def self_prune(pair_or_pairs: Any, rank: Any, *, decay: float, threshold: Any) -> jax.Array:
  """HetLoRA's rank self-pruning: the client's rank for the next round.

  Our reading of Cho et al. 2024 (arXiv 2401.06432), Sec. "rank
  self-pruning": a client of rank ``r`` trains with the regularizer
  ``lambda * T(a, b)`` on the tail of its ranks, where (this module's choice
  of norm)

      T(a, b) = sum_matrices ||a[:, t:r]||_F ||b[t:r, :]||_F,   t = floor(gamma r),

  (:func:`tail_norm`), and after local training prunes to ``t`` when the
  tail of its trained adapters is smaller than that of the adapters it
  received:

      r_next = max(1, floor(gamma r))  if T(trained) < T(received)  else  r.

  The client passes ``threshold = tail_norm(received, r, decay=gamma)``;
  any other threshold (e.g. a constant) gives the same rule against it. It
  then sends ``truncate(trained, r_next)``. The exact norm of the paper's
  regularizer (product of the two tail norms here) is our reading.

  Args:
    pair_or_pairs: the trained ``{'a', 'b'}`` or ``{name: {'a', 'b'}}``.
    rank: the client's current rank ``r`` (``1 <= r <= r_max``; may be traced).
    decay: ``gamma`` in ``(0, 1)``.
    threshold: the tail score to beat (a scalar ``>= 0``).

  Returns:
    The int32 scalar ``r_next``.
  """
  _check_decay('self_prune', decay)
  v = _concrete(threshold)
  if v is not None and (v.ndim != 0 or not np.isfinite(v) or float(v) < 0):
    raise ValueError(f'self_prune: threshold={threshold!r}; allowed: a finite scalar >= 0.')
  score = tail_norm(pair_or_pairs, rank, decay=decay)
  rank = jnp.asarray(rank, jnp.int32)
  return jnp.where(score < threshold, pruned_rank(rank, decay=decay), rank)


# ---------------------------------------------------------------- drivers

def _check_round(caller: str, client_pairs: Pairs, global_pairs: Pairs, num_examples: Any,
                 scale: Any) -> tuple[int, int]:
  check_pairs(caller, 'client_pairs', client_pairs, lead=1)
  check_pairs(caller, 'global_pairs', global_pairs)
  _check_against(caller, 'client_pairs', client_pairs, 'global_pairs', global_pairs, 1)
  sizes = {jnp.shape(p[k])[0] for p in client_pairs.values() for k in ('a', 'b')}
  if len(sizes) != 1:
    raise ValueError(f'{caller}: client_pairs have client axes of sizes {sorted(sizes)}; '
                     'allowed: one size C for every leaf.')
  ranks = {jnp.shape(p['a'])[-1] for p in global_pairs.values()}
  if len(ranks) != 1:
    raise ValueError(f'{caller}: global_pairs have ranks {sorted(ranks)}; allowed: one '
                     'r_max for every adapted matrix.')
  num_clients = sizes.pop()
  _check_weights(caller, 'num_examples', num_examples, num_clients)
  _check_scale(caller, scale)
  return num_clients, ranks.pop()


def _weighted_mean(tree: Any, w: jax.Array) -> Any:
  total = jnp.sum(w)
  safe = jnp.where(total > 0, total, 1.0)
  return jax.tree.map(
      lambda m: jnp.where(total > 0, jnp.tensordot(w.astype(m.dtype), m, axes=1) /
                          safe.astype(m.dtype), jnp.zeros(m.shape[1:], m.dtype)), tree)


def aggregate(rule: LoraAggregation, client_pairs: Pairs, global_pairs: Pairs,
              num_examples: Any, *, scale: Any, key: jax.Array) -> Result:
  """Runs ``rule`` with plain ``jnp`` reductions over the leading client axis.

  Args:
    rule: a :class:`LoraAggregation`.
    client_pairs: the clients' trained adapters, stacked: ``a [C, ..., n_in,
      r_max]``, ``b [C, ..., r_max, n_out]`` (ranks ``< r_max`` zero-padded).
    global_pairs: the global adapters the clients received (rank ``r_max``).
    num_examples: ``[C]`` example counts (``>= 0``).
    scale: ``s = alpha / r_max``.
    key: the server's PRNG key (FLoRA's re-initialization).

  Returns:
    The rule's :class:`Result`.
  """
  num_clients, r_max = _check_round('aggregate', client_pairs, global_pairs, num_examples,
                                    scale)
  n = jnp.asarray(num_examples, jnp.float32)
  w = jax.vmap(lambda p, k: rule.client_weight(p, k, scale))(client_pairs, n)
  index = jnp.arange(num_clients, dtype=jnp.int32)
  summed, averaged = jax.vmap(
      lambda p, i: rule.client_message(p, global_pairs, i, num_clients, scale))(
          client_pairs, index)
  summed = jax.tree.map(lambda m: jnp.sum(m, axis=0), summed)
  return rule.server_update(global_pairs, summed, _weighted_mean(averaged, w), r_max, scale,
                            key)


def federated_round(rule: LoraAggregation, client_pairs: Pairs, global_pairs: Pairs,
                    num_examples: Any, *, scale: Any, key: jax.Array) -> Result:
  """The same round as :func:`aggregate` in fedjx primitives; call inside ``fedjx.program``.

  ``client_pairs`` and ``num_examples`` are placed at the clients (leading
  axis ``C``); ``global_pairs`` is a server value, broadcast to them. The
  per-client steps run in ``fedjx.map_fn``, the reductions are
  ``fedjx.reduce_sum`` and ``fedjx.reduce_weighted_mean``.
  """
  num_clients, r_max = _check_round('federated_round', client_pairs, global_pairs,
                                    num_examples, scale)
  n = jnp.asarray(num_examples, jnp.float32)
  placed = fedjx.broadcast(global_pairs)
  index = jnp.arange(num_clients, dtype=jnp.int32)
  w = fedjx.map_fn(lambda p, k: rule.client_weight(p, k, scale), (client_pairs, n))
  summed, averaged = fedjx.map_fn(
      lambda p, g, i: rule.client_message(p, g, i, num_clients, scale),
      (client_pairs, placed, index))
  summed = fedjx.reduce_sum(summed) if jax.tree.leaves(summed) else summed
  averaged = fedjx.reduce_weighted_mean(averaged, w) if jax.tree.leaves(averaged) else averaged
  return rule.server_update(global_pairs, summed, averaged, r_max, scale, key)


RULES: Mapping[str, Callable[[], LoraAggregation]] = {
    'fedit': fedit, 'ffa': ffa, 'flexlora': flexlora, 'flora': flora, 'hetlora': hetlora}

__all__ = ['LoraAggregation', 'RULES', 'Result', 'aggregate', 'check_pairs',
           'effective_delta', 'exact_mean_product', 'federated_round', 'fedit', 'ffa',
           'flexlora', 'flora', 'hetlora', 'init_adapters', 'product', 'pruned_rank',
           'rank_mask', 'self_prune', 'stack_block', 'svd_factors', 'tail_norm', 'truncate']
