"""Compressed outer steps for DiLoCo: SparseLoCo and MuLoCo-style 2-bit EF.

Both builders return an :class:`~fedjx.algorithms.aggregators.Aggregator`
for :func:`fedjx.algorithms.diloco`'s ``aggregator=`` argument. They are
:func:`fedjx.algorithms.compression.compressed_mean` over a
:class:`~fedjx.algorithms.compression.Compressor` defined here, so the
shared-key protocol, the per-replica residual store (``[K, d]`` float32 in
the aggregator's state, indexed by replica id), the weighted mean of the
decoded messages and the bit accounting (``upload_bits``,
``download_bits``, ``communicated_bytes``) are those of every compressor.

**Statistical quantization** (:func:`statistical_levels`), the ``b``-bit
quantizer both use, applied to a vector ``v`` of ``m`` values: with ``mu``
the mean of ``v``, ``c = v - mu``, ``sigma = ||c|| / sqrt(m - 1)`` and
``L = 2^b``, the step is ``s = r sigma / L`` (``r = range_sigmas``);
value ``v_j`` gets the code ``q_j = clip(round(c_j / s + L / 2), 0, L - 1)``
and decodes to ``mu + lookup[q_j]``, ``lookup[i]`` the mean of the ``c_j``
coded ``i`` (0 for a code no value has). The codes' cells are ``s`` wide
around ``(i - L / 2) s``, the end cells open (for ``L = 4``: below
``-1.5 s``, ``[-1.5 s, -0.5 s)``, ``[-0.5 s, 0.5 s)``, from ``0.5 s`` up).
Sent: the codes packed ``b`` bits each, the ``L`` float32 entries of
``lookup`` and ``mu`` (float32). This is the statistical ("uniform
buckets") quantization of the open implementations of DiLoCo-style
training (hivemind's; the compressor released with SparseLoCo: a range in
standard deviations, a table of bucket means); ``r = 6`` is a choice (the
value a released 2-bit use of it takes), not a number in either paper's
text. It is deterministic and biased (its ``traits.unbiased`` is False),
so error feedback is allowed.

**SparseLoCo** (:func:`sparseloco`; Sarfi, Thérien, Lidin, Belilovsky,
"Communication Efficient LLM Pre-training with SparseLoCo", 2025, arXiv
2508.15706, Algorithm 1). Replica ``k`` with outer gradient ``Delta_k``:

    e_k <- beta e_k + Delta_k                   (replaces outer momentum)
    m_k = Q(TopK_chunk(e_k))                     (sent)
    e_k <- e_k - m_k
    Delta = sum_k w_k m_k / sum_k w_k ;  theta <- theta - alpha Delta

``TopK_chunk`` keeps the ``k`` largest magnitudes of each chunk and zeroes
the rest; ``Q`` quantizes the kept values to ``bits``. The outer optimizer
is plain SGD (no momentum): pass DiLoCo ``outer_momentum=0.0`` (or
``outer_optimizer=optax.sgd(alpha)``); the paper's ``1 / R`` mean is
DiLoCo's ``weighting='uniform'``.

**Chunks** (``chunk_shape``). ``'2d'`` (the default) is the paper's
tiling, that of the code released with it (and with DeMo, whose chunking it
takes): with ``chunk_size = s^2`` coordinates per chunk (the paper's 4096,
``s = 64``), each leaf of the update is compressed on its own. A leaf of
rank >= 2 is a matrix of its last two axes, ``[..., r, c]`` (leading axes,
e.g. a stacked layer axis, are a batch of matrices), cut into tiles of
``t_r x t_c`` with ``t_a = tile_length(a, s)``: the largest divisor of the
axis length ``a`` that is ``<= s`` (``a`` itself when ``a <= s``). The
tiles cover the matrix exactly, so nothing is padded: a 64 x 64 tile where
64 divides the axis, a smaller (possibly non-square) one where it does
not, e.g. ``t = 50`` for an axis of 100 and ``t = 1`` for a prime axis
above ``s``. A leaf of rank 0 or 1 (biases, norm scales) is cut into 1-D
chunks of ``tile_length(size, s)``. Each tile keeps ``min(k, tile size)``
values (the released code's clamp: a bias in chunks of 64 with ``k = 64``
is sent whole), and each leaf's kept values get their own quantization
table (the released code quantizes tensor by tensor). ``'1d'`` flattens
the whole update (``ravel_pytree``, leaves in key order) into consecutive
chunks of ``chunk_size`` coordinates, the last zero-padded, with one table
for the whole message (this module's earlier layout).

**Bits per replica.** With ``'1d'``: ``n_c = ceil(d / chunk_size)``
chunks, ``m = n_c k`` kept values, ``w_i = max(1, ceil(log2 chunk_size))``::

    upload_bits = 32 ceil(m w_i / 32) + 32 ceil(m bits / 32) + 32 (2^bits + 1)

(indices within their chunk packed ``w_i`` bits each, codes packed ``bits``
each, the lookup table and ``mu``; words of 32 bits, as every packed
message here). With ``'2d'`` the same sum per leaf ``l``, over its ``n_l``
tiles of ``z_l`` coordinates, ``m_l = n_l min(k, z_l)`` and ``w_l =
max(1, ceil(log2 z_l))``::

    upload_bits = sum_l 32 ceil(m_l w_l / 32) + 32 ceil(m_l bits / 32) + 32 (2^bits + 1)

**MuLoCo-style 2-bit error feedback** (:func:`muloco_quantized`; Thérien,
Huang, Rish, Belilovsky, "MuLoCo: Muon is a practical inner optimizer for
DiLoCo", 2025, arXiv 2505.23725): replica ``k`` sends ``m_k = Q(Delta_k +
e_k)`` over the whole flattened outer gradient and keeps ``e_k <- Delta_k
+ e_k - m_k``; the server's mean goes to DiLoCo's outer optimizer (Nesterov
by default, as in the paper). The inner optimizer is Muon
(:func:`muon_inner_optimizer`, ``optax.contrib.muon``). Bits per replica::

    upload_bits = 32 ceil(d bits / 32) + 32 (2^bits + 1)

A replica that is skipped or has no data keeps its residual unchanged
(``compressed_mean``), and, for SparseLoCo, undecayed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms.compression import compressors as compression

_BITS = (1, 2, 3, 4, 8)
CHUNK_SHAPES = ('2d', '1d')


def _check_real(fn: str, name: str, value: Any, low: float, high: float | None,
                allowed: str) -> None:
  ok = (not isinstance(value, bool) and isinstance(value, (int, float))
        and math.isfinite(value) and value >= low
        and (high is None or value <= high))
  if not ok:
    raise ValueError(f'{fn}: {name}={value!r} is not allowed; {allowed}.')


def _check_int(fn: str, name: str, value: Any, allowed: tuple[int, ...] | None,
               low: int = 1) -> None:
  ok = not isinstance(value, bool) and isinstance(value, int)
  ok = ok and (value in allowed if allowed is not None else value >= low)
  if not ok:
    what = (f'one of {allowed}' if allowed is not None
            else f'an int >= {low}')
    raise ValueError(f'{fn}: {name}={value!r} is not allowed; it must be {what}.')


def _check_quantizer(fn: str, bits: Any, range_sigmas: Any) -> None:
  _check_int(fn, 'bits', bits, _BITS)
  _check_real(fn, 'range_sigmas', range_sigmas, 0.0, None,
              'it must be a finite number > 0 (the step is range_sigmas '
              'sigma / 2^bits)')
  if range_sigmas == 0:
    raise ValueError(f'{fn}: range_sigmas=0 is not allowed; it must be a '
                     'finite number > 0.')


# -------------------------------------------------------------- quantizer

def statistical_quantize(v: jax.Array, bits: int, range_sigmas: float
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(codes [m] int32, lookup [2^bits] float32, shift float32)`` of ``v``.

  Module docstring: ``c = v - mu``, ``s = r sigma / L``, ``code =
  clip(round(c / s + L / 2), 0, L - 1)``, ``lookup[j]`` the mean of the
  ``c`` coded ``j`` (0 for none), ``shift = mu``.
  """
  levels = 2 ** bits
  v = v.astype(jnp.float32)
  m = v.shape[0]
  mu = jnp.mean(v)
  c = v - mu
  sigma = jnp.sqrt(jnp.sum(jnp.square(c)) / max(m - 1, 1)) if m > 1 else jnp.float32(0)
  scale = range_sigmas * sigma / levels
  scale = jnp.where((scale > 0) & jnp.isfinite(scale), scale, 1.0)
  codes = jnp.clip(jnp.round(c / scale + levels // 2), 0, levels - 1).astype(jnp.int32)
  sums = jnp.zeros((levels,), jnp.float32).at[codes].add(c)
  counts = jnp.zeros((levels,), jnp.float32).at[codes].add(1.0)
  lookup = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
  return codes, lookup, mu


def _counted(message: compression.Message
             ) -> tuple[compression.Message, jax.Array]:
  return message, jnp.float32(compression.representation_bits(message))


def _quantized(codes, lookup, mu, bits) -> compression.Message:
  return {'codes': compression.pack_bits(codes, bits), 'lookup': lookup,
          'shift': jnp.reshape(mu, (1,)).astype(jnp.float32)}


def _dequantized(m: compression.Message, bits: int, count: int) -> jax.Array:
  codes = compression.unpack_bits(m['codes'], bits, count).astype(jnp.int32)
  return m['lookup'][codes] + m['shift'][0]


def statistical_levels(bits: int = 2, range_sigmas: float = 6.0
                       ) -> compression.Compressor:
  """The ``bits``-bit statistical quantizer of a whole vector (module docstring).

  Message: ``{'codes': uint32 [ceil(d bits / 32)], 'lookup': float32
  [2^bits], 'shift': float32 [1]}``; ``upload_bits = 32 ceil(d bits / 32)
  + 32 (2^bits + 1)``.
  """
  _check_quantizer('statistical_levels', bits, range_sigmas)

  def encode(key, x):
    del key
    return _counted(
        _quantized(*statistical_quantize(x, bits, range_sigmas), bits))

  def decode(key, m, n):
    del key
    return _dequantized(m, bits, n)

  return compression.Compressor(encode, decode)


def index_bits(chunk_size: int) -> int:
  """Bits of an index within a chunk: ``max(1, ceil(log2 chunk_size))``."""
  return max(1, (int(chunk_size) - 1).bit_length())


def chunked_top_k(k: int, chunk_size: int, bits: int = 2,
                  range_sigmas: float = 6.0) -> compression.Compressor:
  """The ``k`` largest magnitudes of each chunk, their values quantized.

  ``x`` (length ``d``) is zero-padded to ``n_c chunk_size``, ``n_c =
  ceil(d / chunk_size)``, and split into ``n_c`` consecutive chunks; the
  ``k`` largest ``|x_j|`` of each are kept (``jax.lax.top_k``), their
  ``m = n_c k`` values quantized by :func:`statistical_quantize` (one table).
  Message: ``{'indices': uint32 [ceil(m w_i / 32)], 'codes': uint32
  [ceil(m bits / 32)], 'lookup': float32 [2^bits], 'shift': float32 [1]}``,
  ``w_i =``
  :func:`index_bits` ``(chunk_size)``.
  """
  width = index_bits(chunk_size)

  def encode(key, x):
    del key
    n = x.shape[0]
    chunks = -(-n // chunk_size)
    blocks = jnp.pad(x, (0, chunks * chunk_size - n)).reshape(chunks, chunk_size)
    _, index = jax.lax.top_k(jnp.abs(blocks), k)
    values = jnp.take_along_axis(blocks, index, axis=1).reshape(-1)
    message = _quantized(*statistical_quantize(values, bits, range_sigmas), bits)
    message['indices'] = compression.pack_bits(index.reshape(-1), width)
    return _counted(message)

  def decode(key, m, n):
    del key
    chunks = -(-n // chunk_size)
    count = chunks * k
    index = compression.unpack_bits(m['indices'], width, count).astype(jnp.int32)
    rows = jnp.repeat(jnp.arange(chunks, dtype=jnp.int32), k)
    dense = jnp.zeros((chunks, chunk_size), jnp.float32).at[
        rows, index].set(_dequantized(m, bits, count))
    return dense.reshape(-1)[:n]

  return compression.Compressor(encode, decode)


# ------------------------------------------------------------------ tiles

def tile_length(n: int, chunk: int) -> int:
  """The largest divisor of ``n`` that is ``<= chunk`` (``n`` when ``n <= chunk``)."""
  if n <= chunk:
    return n
  return next(t for t in range(chunk, 0, -1) if n % t == 0)


def tile_shape(shape: Sequence[int], chunk: int) -> tuple[int, ...]:
  """The tile of a leaf shaped ``shape`` (module docstring, ``'2d'``).

  ``(t_r, t_c)`` for rank >= 2 (the last two axes), ``(t,)`` for rank 0 or 1
  (the leaf flattened), each ``t = tile_length(axis, chunk)``.
  """
  shape = tuple(shape)
  if len(shape) >= 2:
    return tile_length(shape[-2], chunk), tile_length(shape[-1], chunk)
  return (tile_length(math.prod(shape), chunk),)


def to_tiles(x: jax.Array, tile: tuple[int, ...]) -> jax.Array:
  """``[n, *tile]``: the tiles of ``x``, in row-major order of the tile grid.

  For a 2-D ``tile`` the leading axes of ``x`` come first (layer by layer),
  then the grid's rows, then its columns.
  """
  if len(tile) == 1:
    return x.reshape(-1, tile[0])
  rows, cols = x.shape[-2:]
  (tr, tc) = tile
  grid = x.reshape(-1, rows // tr, tr, cols // tc, tc)
  return grid.transpose(0, 1, 3, 2, 4).reshape(-1, tr, tc)


def from_tiles(tiles: jax.Array, shape: Sequence[int]) -> jax.Array:
  """The inverse of :func:`to_tiles`: ``tiles [n, *tile]`` back to ``shape``."""
  shape = tuple(shape)
  if len(shape) < 2:
    return tiles.reshape(shape)
  tr, tc = tiles.shape[-2:]
  rows, cols = shape[-2:]
  grid = tiles.reshape(-1, rows // tr, cols // tc, tr, tc).transpose(0, 1, 3, 2, 4)
  return grid.reshape(shape)


class TiledLeaf(NamedTuple):
  """One leaf of a tiled layout (:func:`tiled_layout`).

  Attributes:
    offset: where the leaf starts in the flattened update.
    shape: the leaf's shape.
    tile: its tile shape (:func:`tile_shape`).
    tiles: the number of tiles, ``size / prod(tile)``.
    k: the values kept per tile, ``min(k, prod(tile))``.
  """

  offset: int
  shape: tuple[int, ...]
  tile: tuple[int, ...]
  tiles: int
  k: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def tile_size(self) -> int:
    return math.prod(self.tile)


def tiled_layout(shapes: Sequence[Sequence[int]], chunk: int, k: int
                 ) -> tuple[list[TiledLeaf], int]:
  """The tiles of leaves shaped ``shapes`` (in ``ravel_pytree`` order), and ``d``.

  Leaves with no coordinates are left out (they send nothing).
  """
  leaves, offset = [], 0
  for shape in shapes:
    shape = tuple(int(a) for a in shape)
    size = math.prod(shape)
    if size:
      tile = tile_shape(shape, chunk)
      leaves.append(TiledLeaf(offset, shape, tile, size // math.prod(tile),
                              min(k, math.prod(tile))))
    offset += size
  return leaves, offset


def leaf_shapes(tree: base.PyTree) -> tuple[tuple[int, ...], ...]:
  """The shapes of ``tree``'s leaves, in ``ravel_pytree``'s order."""
  return tuple(tuple(jnp.shape(x)) for x in jax.tree.leaves(tree))


def _leaf_of(x: jax.Array, leaf: TiledLeaf) -> jax.Array:
  return x[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)


def _check_length(fn: str, n: int, d: int) -> None:
  if n != d:
    raise ValueError(f'{fn}: the vector has {n} coordinates, but the layout '
                     f'it was built for has {d}; build it from the update\'s '
                     'leaf shapes.')


def _scatter_tiles(index: jax.Array, values: jax.Array, leaf: TiledLeaf
                   ) -> jax.Array:
  """``[tiles, *tile]`` zeros but ``values`` at ``index`` (``[tiles, k]`` each)."""
  rows = jnp.arange(leaf.tiles, dtype=jnp.int32)[:, None]
  dense = jnp.zeros((leaf.tiles, leaf.tile_size), jnp.float32).at[
      rows, index].set(values)
  return dense.reshape((leaf.tiles,) + leaf.tile)


def tiled_top_k(shapes: Sequence[Sequence[int]], k: int, chunk: int,
                bits: int = 2, range_sigmas: float = 6.0
                ) -> compression.Compressor:
  """SparseLoCo's ``'2d'`` top-k: ``k`` per tile of ``chunk x chunk``, per leaf.

  ``shapes`` are the update's leaves (:func:`leaf_shapes`); each leaf is cut
  by :func:`tiled_layout` (tiles of ``tile_length`` per axis, rank <= 1
  leaves in 1-D chunks), the ``min(k, tile size)`` largest ``|x_j|`` of each
  tile kept (``jax.lax.top_k``, ties to the lower row-major index) and the
  leaf's kept values quantized by :func:`statistical_quantize` (a table per
  leaf). Message, for leaf ``i`` (keys suffixed ``.i``): ``indices`` (uint32,
  within-tile row-major indices packed ``max(1, ceil(log2 z))`` bits each,
  ``z`` the tile size), ``codes``, ``lookup``, ``shift``. Bits:
  :func:`tiled_top_k_bits`.
  """
  leaves, d = tiled_layout(shapes, chunk, k)

  def encode(key, x):
    del key
    _check_length('tiled_top_k', x.shape[0], d)
    message = {}
    for i, leaf in enumerate(leaves):
      blocks = to_tiles(_leaf_of(x, leaf), leaf.tile).reshape(leaf.tiles, -1)
      _, index = jax.lax.top_k(jnp.abs(blocks), leaf.k)
      values = jnp.take_along_axis(blocks, index, axis=1).reshape(-1)
      part = _quantized(*statistical_quantize(values, bits, range_sigmas), bits)
      part['indices'] = compression.pack_bits(index.reshape(-1),
                                              index_bits(leaf.tile_size))
      message.update({f'{name}.{i}': v for name, v in part.items()})
    return _counted(message)

  def decode(key, m, n):
    del key
    _check_length('tiled_top_k', n, d)
    parts = []
    for i, leaf in enumerate(leaves):
      count = leaf.tiles * leaf.k
      index = compression.unpack_bits(m[f'indices.{i}'], index_bits(leaf.tile_size),
                                      count).astype(jnp.int32)
      part = {name: m[f'{name}.{i}'] for name in ('codes', 'lookup', 'shift')}
      values = _dequantized(part, bits, count)
      dense = _scatter_tiles(index.reshape(leaf.tiles, leaf.k),
                             values.reshape(leaf.tiles, leaf.k), leaf)
      parts.append(from_tiles(dense, leaf.shape).reshape(-1))
    return jnp.concatenate(parts) if parts else jnp.zeros((n,), jnp.float32)

  return compression.Compressor(encode, decode)


def tiled_top_k_bits(shapes: Sequence[Sequence[int]], k: int, chunk: int,
                     bits: int = 2) -> int:
  """:func:`tiled_top_k`'s bits per replica (module docstring, ``'2d'``)."""
  total = 0
  for leaf in tiled_layout(shapes, chunk, k)[0]:
    m = leaf.tiles * leaf.k
    total += (32 * -(-m * index_bits(leaf.tile_size) // 32) + 32 * -(-m * bits // 32)
              + 32 * (2 ** bits + 1))
  return total


def tiled_mean(make_compressor: Callable[[tuple[tuple[int, ...], ...]],
                                         compression.Compressor],
               **kwargs: Any) -> aggregators.Aggregator:
  """:func:`~fedjx.algorithms.compression.compressed_mean` of a layout-aware compressor.

  ``make_compressor(shapes)`` builds the compressor of an update whose
  leaves have ``shapes`` (:func:`leaf_shapes`); it is built from the update
  on the client, from the state's template on the server and from the
  model for ``message_bytes``, all static shapes, so client and server cut
  the same tiles. ``kwargs`` go to ``compressed_mean``.
  """
  def mean_for(tree):
    return compression.compressed_mean(make_compressor(leaf_shapes(tree)), **kwargs)

  agg = compression.compressed_mean(make_compressor(()), **kwargs)

  def encode(hp, update, w):
    return mean_for(update).encode(hp, update, w)

  def combine(state, hp, clients, key):
    return mean_for(state.template).combine(state, hp, clients, key)

  def message_bytes(params):
    return mean_for(params).message_bytes(params)

  return agg._replace(encode=encode, combine=combine, message_bytes=message_bytes)


def check_chunk_shape(fn: str, chunk_shape: Any) -> None:
  """``chunk_shape`` must be one of :data:`CHUNK_SHAPES`."""
  if not isinstance(chunk_shape, str) or chunk_shape not in CHUNK_SHAPES:
    raise ValueError(f'{fn}: chunk_shape={chunk_shape!r} is not allowed; it must '
                     "be '2d' (tiles of each matrix leaf, the papers') or '1d' "
                     '(chunks of the flattened update).')


# --------------------------------------------------------------- builders

def sparseloco_upload_bits(d: int, k: int, chunk_size: int, bits: int = 2) -> int:
  """SparseLoCo's ``'1d'`` bits per replica for ``d`` coordinates (module docstring).

  The ``'2d'`` layout's are :func:`tiled_top_k_bits` of the leaf shapes.
  """
  m = -(-d // chunk_size) * k
  return (32 * -(-m * index_bits(chunk_size) // 32) + 32 * -(-m * bits // 32)
          + 32 * (2 ** bits + 1))


def muloco_upload_bits(d: int, bits: int = 2) -> int:
  """MuLoCo-style quantization's bits per replica for ``d`` coordinates."""
  return 32 * -(-d * bits // 32) + 32 * (2 ** bits + 1)


def sparseloco(num_replicas: int, k: int = 64, chunk_size: int = 4096,
               beta: float = 0.95, bits: int = 2, range_sigmas: float = 6.0,
               seed: int = 0, chunk_shape: str = '2d') -> aggregators.Aggregator:
  """SparseLoCo's outer step (Sarfi et al. 2025, arXiv 2508.15706), module docstring.

  Args:
    num_replicas: ``K``, DiLoCo's ``num_replicas`` (one accumulator each).
    k: values kept per chunk; the paper's 64 of 4096 (density 1.56%; 32,
      0.78%, is its other setting).
    chunk_size: coordinates per chunk; the paper's 4096. With
      ``chunk_shape='2d'`` a square ``s^2``: tiles of ``s x s`` of each
      matrix (64 x 64), 1-D chunks of ``s`` of the other leaves.
    beta: the accumulator's decay, ``e_k <- beta e_k + Delta_k``; the
      paper's 0.95.
    bits: bits per kept value (the paper's 2).
    range_sigmas: ``r``, the step ``r sigma / 2^bits`` (default 6).
    seed: the shared seed (unused by this deterministic compressor, kept
      for the protocol).
    chunk_shape: ``'2d'``, the paper's tiles of each leaf, or ``'1d'``,
      consecutive chunks of the flattened update (module docstring).

  Use with ``diloco(..., aggregator=sparseloco(K), outer_momentum=0.0,
  outer_learning_rate=alpha)``: no outer momentum.
  """
  fn = 'sparseloco'
  base.check_positive_int(fn, 'num_replicas', num_replicas)
  _check_int(fn, 'chunk_size', chunk_size, None)
  _check_int(fn, 'k', k, None)
  if k > chunk_size:
    raise ValueError(f'{fn}: k={k} is not allowed; it must be <= '
                     f'chunk_size={chunk_size} (k values are kept per chunk).')
  _check_real(fn, 'beta', beta, 0.0, 1.0, 'it must be a number in [0, 1]')
  _check_quantizer(fn, bits, range_sigmas)
  check_chunk_shape(fn, chunk_shape)
  side = math.isqrt(chunk_size)
  if chunk_shape == '2d' and side * side != chunk_size:
    raise ValueError(f'{fn}: chunk_size={chunk_size} is not allowed with '
                     "chunk_shape='2d'; it must be a square s^2 (tiles of s x s, "
                     "4096 = 64 x 64), or use chunk_shape='1d'.")
  kwargs = dict(fn=fn, error_feedback=True, num_clients=num_replicas, seed=seed)
  if chunk_shape == '2d':
    agg = tiled_mean(lambda shapes: tiled_top_k(shapes, k, side, bits, range_sigmas),
                     **kwargs)
  else:
    agg = compression.compressed_mean(
        chunked_top_k(k, chunk_size, bits, range_sigmas), **kwargs)
  gather = agg.client_inputs

  def client_inputs(state, client_ids, cohort_size):
    inputs = gather(state, client_ids, cohort_size)
    # compressed_mean encodes Delta_k + (its residual input): decaying that
    # input by beta makes it Delta_k + beta e_k, and the residual it keeps
    # e_k <- Delta_k + beta e_k - m_k.
    inputs['residual'] = beta * inputs['residual']
    return inputs

  return agg._replace(client_inputs=client_inputs)


def muloco_quantized(num_replicas: int, bits: int = 2, range_sigmas: float = 6.0,
                     seed: int = 0) -> aggregators.Aggregator:
  """MuLoCo's quantized outer gradient with error feedback (module docstring).

  Thérien et al. 2025, arXiv 2505.23725: ``m_k = Q(Delta_k + e_k)``,
  ``e_k <- Delta_k + e_k - m_k``, ``bits`` per coordinate (the paper's 2)
  a ``2^bits``-entry float32 table and the mean.

  Args:
    num_replicas: ``K``, DiLoCo's ``num_replicas``.
    bits: bits per coordinate.
    range_sigmas: ``r``, the step ``r sigma / 2^bits`` (default 6).
    seed: the shared seed (unused by this deterministic compressor).
  """
  fn = 'muloco_quantized'
  base.check_positive_int(fn, 'num_replicas', num_replicas)
  _check_quantizer(fn, bits, range_sigmas)
  comp = statistical_levels(bits, range_sigmas)
  return compression.compressed_mean(comp, fn=fn, error_feedback=True,
                                     num_clients=num_replicas, seed=seed)


def muon_inner_optimizer(learning_rate: float = 0.02, **kwargs: Any
                         ) -> optax.GradientTransformation:
  """Muon (``optax.contrib.muon``) as DiLoCo's inner optimizer, injected.

  Muon orthogonalizes the momentum of each matrix parameter by Newton-Schulz
  iterations; other parameters (biases, vectors) take AdamW steps. ``kwargs``
  go to ``optax.contrib.muon``.
  """
  muon = getattr(getattr(optax, 'contrib', None), 'muon', None)
  if muon is None:
    raise ValueError('muon_inner_optimizer: optax.contrib.muon is not in the '
                     f'installed optax {optax.__version__}; install optax '
                     '>= 0.2.4, or pass another inner_optimizer.')
  return optax.inject_hyperparams(muon)(learning_rate=learning_rate, **kwargs)


# The builders a config can name: aggregator=dict(name='sparseloco', ...).
OUTER_COMPRESSORS = {
    'sparseloco': sparseloco,
    'muloco_quantized': muloco_quantized,
}

__all__ = ['CHUNK_SHAPES', 'OUTER_COMPRESSORS', 'TiledLeaf', 'check_chunk_shape',
           'chunked_top_k', 'from_tiles', 'index_bits', 'leaf_shapes',
           'muloco_quantized', 'muloco_upload_bits', 'muon_inner_optimizer',
           'sparseloco', 'sparseloco_upload_bits', 'statistical_levels',
           'statistical_quantize', 'tile_length', 'tile_shape', 'tiled_layout',
           'tiled_mean', 'tiled_top_k', 'tiled_top_k_bits', 'to_tiles']
