"""DeMo: DCT-domain top-k of a decoupled momentum, as DiLoCo's outer step.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", 2024
(arXiv 2411.19870), Algorithm 1. Each worker ``k`` keeps its own momentum,
never synchronised; per step it adds its gradient, extracts the momentum's
"fast components" (top-k of a chunked DCT), sends only those, and removes
what it sent from its momentum:

    m_k <- beta m_k + Delta_k
    q_k  = IDCT(top_k(DCT(m_k)))              (chunks of s, k per chunk)
    m_k <- m_k - q_k
    Q    = sum_k w_k q_k / sum_k w_k           (the server decodes and averages)
    Delta = sign(Q)   (sign=True)  or  Q   (sign=False)

``DCT`` is the orthonormal DCT-II of each chunk (``jax.scipy.fft.dct(type=2,
norm='ortho')``): for a chunk of ``s`` coordinates, ``C[f, j] = a_f cos(pi
(2 j + 1) f / (2 s))``, ``a_0 = sqrt(1 / s)``, ``a_f = sqrt(2 / s)``; ``C`` is
orthogonal, so ``IDCT = C^T``. A 2-D tile ``X`` (``t_r x t_c``) takes the
separable 2-D transform ``Y = C_r X C_c^T`` (the 1-D DCT along the tile's
columns and along its rows; ``X = C_r^T Y C_c``), as the paper's reference
implementation does. ``top_k`` keeps, in every chunk, the ``k`` components
of largest magnitude (of the ``t_r t_c`` of a tile, flattened row-major;
ties to the lower index) and zeroes the rest.

**Adaptation to DiLoCo.** The paper applies this to every step's gradient
in data-parallel training. Here it is an aggregator, so DiLoCo applies it
to the outer gradient ``Delta_k = theta - theta_k`` of replica ``k`` once
per round: the momentum ``m_k`` accumulates outer gradients across rounds,
and the server's ``Delta`` is what DiLoCo's outer optimizer applies. DeMo's
own update is ``theta <- theta - eta Delta`` (SGD without momentum, the
momentum being ``m_k``), so pair it with ``outer_optimizer=optax.sgd(eta)``
(DiLoCo's default Nesterov outer optimizer would add a second momentum).
Only the replicas with data update their ``m_k``; a skipped replica keeps
its momentum as it was, undecayed.

**Sign.** The paper's reference implementation steps with the sign of the
decoded average (signSGD), ``Delta = sign(Q)``; that is the default here.
``sign=False`` applies the average ``Q`` itself (``x <- x - eta Q``). A
coordinate where ``Q`` is exactly 0 (no replica with data, or components
that cancel) gets ``sign(0) = 0``.

**Chunks** (``chunk_shape``). ``'2d'`` (the default) is the paper's: each
leaf of the update on its own, a leaf of rank >= 2 a matrix of its last two
axes (leading axes, e.g. a stacked layer axis, a batch of matrices) cut
into ``t_r x t_c`` tiles with ``t_a`` the largest divisor of the axis length
``a`` that is ``<= s`` (``a`` itself when ``a <= s``; the reference
implementation's rule: the tiles cover the matrix exactly, nothing is
padded, and an axis 64 does not divide gets smaller tiles, e.g. 50 for 100
or 1 for a prime above ``s``), a leaf of rank 0 or 1 cut the same way into
1-D chunks; ``k`` components are sent per tile (``k`` of ``s^2`` in a full
tile, clamped to the tile's size as in the reference: 32 of 64 for a
bias). The reference implementation's ``s = 64``, ``k = 32``, ``beta =
0.999`` are the defaults (see
:func:`fedjx.algorithms.compression.outer.tiled_layout` for the tiles).
``'1d'`` flattens the update (``ravel_pytree``, leaves in key order) and
cuts it into consecutive chunks of ``s``, the last zero-padded, ``k`` of
``s`` components each (this module's earlier layout; for the density of
the paper's 2-D tiles, ``32 / 4096``, give ``chunk_size=4096`` there).

**Message and bits.** With ``'1d'``, ``d`` coordinates, ``c = ceil(d / s)``
chunks and ``w = ceil(log2 s)``, replica ``k`` sends ``c k`` float32 values
and ``c k`` indices of ``w`` bits packed 32 to a ``uint32`` word
(:func:`fedjx.algorithms.compression.compressors.pack_bits`):

    upload_bits = 32 c k + 32 ceil(c k w / 32)

With ``'2d'``, the same per leaf ``l`` of ``n_l`` tiles of ``z_l``
coordinates, ``k_l = min(k, z_l)`` and ``w_l = ceil(log2 z_l)``:

    upload_bits = sum_l 32 n_l k_l + 32 ceil(n_l k_l w_l / 32)

reported as ``upload_bits`` (and ``download_bits``, the model plus the 64-bit
seed) by :func:`fedjx.algorithms.compression.compressed_mean`, as every
compressor there.

**Reuse.** ``m_k`` is :func:`~fedjx.algorithms.compression.compressed_mean`'s
error-feedback residual: that stores ``e_k <- x_k - C(x_k)`` with ``x_k =
Delta_k + e_k``; DeMo's recursion is the same with ``x_k = Delta_k + beta
e_k`` (``e_k`` is the momentum after the subtraction), so this module
scales the residual by ``beta`` on the client before the compressor sees it,
and otherwise uses the compressor's aggregator as it is (per-client state
``[K, d]`` indexed by the replica ids, ``num_replicas = K``). With ``beta =
1`` it is error-feedback top-k in the DCT basis (Stich, Cordonnier, Jaggi
2018); with ``k`` at least every chunk's size every component is sent,
``m_k`` is emptied each round, and the round is the uncompressed weighted mean of the ``Delta_k``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.scipy import fft

from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.compression import compressors as compression
from fedjx.algorithms.compression import outer as oc


def index_width(chunk_size: int) -> int:
  """``ceil(log2 s)``: the bits of one index into a chunk of ``s >= 2``."""
  return (int(chunk_size) - 1).bit_length()


def chunked_dct(x: jax.Array, chunk_size: int) -> jax.Array:
  """``[c, s]``: the orthonormal DCT-II of each chunk of ``x`` (zero-padded)."""
  c = math.ceil(x.shape[0] / chunk_size)
  chunks = jnp.pad(x, (0, c * chunk_size - x.shape[0])).reshape(c, chunk_size)
  return fft.dct(chunks, type=2, norm='ortho', axis=-1)


def chunked_idct(y: jax.Array, n: int) -> jax.Array:
  """``[n]``: the inverse of :func:`chunked_dct`, the padding dropped."""
  return fft.idct(y, type=2, norm='ortho', axis=-1).reshape(-1)[:n]


def dct_top_k(chunk_size: int, k: int) -> compression.Compressor:
  """DeMo's ``ExtractFastComponents``: top-``k`` DCT components per chunk.

  Sends the ``k`` largest-magnitude DCT-II components of each chunk of
  ``chunk_size`` (float32 values and ``ceil(log2 chunk_size)``-bit packed
  indices, the module docstring's bits); decodes ``IDCT`` of the sparse
  components. Biased (a contraction: the DCT is orthogonal, so
  ``||x - C(x)||^2 <= (1 - k / s) ||x||^2``), hence error feedback.
  """
  width = index_width(chunk_size)

  def encode(key, x):
    del key
    y = chunked_dct(x, chunk_size)
    _, index = jax.lax.top_k(jnp.abs(y), k)
    values = jnp.take_along_axis(y, index, axis=-1)
    message = {'values': values.reshape(-1).astype(jnp.float32),
               'indices': compression.pack_bits(index, width)}
    return message, jnp.float32(compression.representation_bits(message))

  def decode(key, m, n):
    del key
    c = math.ceil(n / chunk_size)
    index = compression.unpack_bits(m['indices'], width, c * k)
    index = index.reshape(c, k).astype(jnp.int32)
    y = jnp.zeros((c, chunk_size), jnp.float32).at[
        jnp.arange(c)[:, None], index].set(m['values'].reshape(c, k))
    return chunked_idct(y, n)

  return compression.Compressor(encode, decode)


def tiled_dct(x: jax.Array, chunk: int) -> jax.Array:
  """``[n, *tile]``: the orthonormal DCT-II of each tile of the leaf ``x``.

  Tiles of :func:`fedjx.algorithms.compression.outer.tile_shape` ``(x.shape,
  chunk)``; a 2-D tile ``X`` gives ``C_r X C_c^T`` (the DCT along both of
  its axes), a 1-D chunk ``C x``.
  """
  tile = oc.tile_shape(x.shape, chunk)
  y = fft.dct(oc.to_tiles(x, tile), type=2, norm='ortho', axis=-1)
  if len(tile) == 2:
    y = fft.dct(y, type=2, norm='ortho', axis=-2)
  return y


def tiled_idct(y: jax.Array, shape: Sequence[int]) -> jax.Array:
  """The leaf shaped ``shape`` whose :func:`tiled_dct` is ``y``."""
  x = fft.idct(y, type=2, norm='ortho', axis=-1)
  if y.ndim == 3:
    x = fft.idct(x, type=2, norm='ortho', axis=-2)
  return oc.from_tiles(x, shape)


def tiled_dct_top_k(shapes: Sequence[Sequence[int]], chunk: int, k: int
                    ) -> compression.Compressor:
  """DeMo's ``'2d'`` ``ExtractFastComponents``: top-``k`` DCT components per tile.

  ``shapes`` are the update's leaves
  (:func:`fedjx.algorithms.compression.outer.leaf_shapes`), cut by
  :func:`fedjx.algorithms.compression.outer.tiled_layout`. Message, for leaf
  ``i`` (keys suffixed ``.i``): ``values`` (float32, ``min(k, z)`` per tile
  of ``z`` coordinates) and ``indices`` (within-tile row-major indices
  packed ``ceil(log2 z)`` bits each). Bits: :func:`tiled_dct_bits`.
  """
  leaves, d = oc.tiled_layout(shapes, chunk, k)

  def encode(key, x):
    del key
    _check_length(x.shape[0], d)
    message = {}
    for i, leaf in enumerate(leaves):
      y = tiled_dct(x[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape), chunk)
      y = y.reshape(leaf.tiles, -1)
      _, index = jax.lax.top_k(jnp.abs(y), leaf.k)
      message[f'values.{i}'] = jnp.take_along_axis(y, index, axis=-1).reshape(-1)
      message[f'indices.{i}'] = compression.pack_bits(index, index_width(leaf.tile_size))
    return message, jnp.float32(compression.representation_bits(message))

  def decode(key, m, n):
    del key
    _check_length(n, d)
    parts = []
    for i, leaf in enumerate(leaves):
      count = leaf.tiles * leaf.k
      index = compression.unpack_bits(m[f'indices.{i}'], index_width(leaf.tile_size),
                                      count).reshape(leaf.tiles, leaf.k)
      rows = jnp.arange(leaf.tiles)[:, None]
      y = jnp.zeros((leaf.tiles, leaf.tile_size), jnp.float32).at[
          rows, index.astype(jnp.int32)].set(m[f'values.{i}'].reshape(leaf.tiles, leaf.k))
      parts.append(tiled_idct(y.reshape((leaf.tiles,) + leaf.tile), leaf.shape).reshape(-1))
    return jnp.concatenate(parts) if parts else jnp.zeros((n,), jnp.float32)

  return compression.Compressor(encode, decode)


def _check_length(n: int, d: int) -> None:
  if n != d:
    raise ValueError(f'tiled_dct_top_k: the vector has {n} coordinates, but the '
                     f'layout it was built for has {d}; build it from the '
                     "update's leaf shapes.")


def tiled_dct_bits(shapes: Sequence[Sequence[int]], chunk: int, k: int) -> int:
  """:func:`tiled_dct_top_k`'s bits per replica (module docstring, ``'2d'``)."""
  total = 0
  for leaf in oc.tiled_layout(shapes, chunk, k)[0]:
    sent = leaf.tiles * leaf.k
    total += 32 * sent + 32 * -(-sent * index_width(leaf.tile_size) // 32)
  return total


def demo(num_replicas: int, chunk_size: int = 64, k: int = 32,
         beta: float = 0.999, sign: bool = True,
         seed: int = 0, chunk_shape: str = '2d') -> aggregators.Aggregator:
  """DeMo (Peng, Quesnelle, Kingma 2024) as an aggregator (module docstring).

  Args:
    num_replicas: ``K``, DiLoCo's replicas (ids in ``[0, K)``): each keeps
      its momentum in the aggregator's state, ``[K, d]`` float32.
    chunk_size: ``s``, the DCT's length along each axis of a chunk, an int
      >= 2 (the paper: 64; tiles of 64 x 64 with ``chunk_shape='2d'``).
    k: components sent per chunk, an int in ``[1, s^2]`` with ``'2d'``
      (clamped to each tile's size) or ``[1, s]`` with ``'1d'`` (the paper:
      32).
    beta: the momentum's decay, in ``[0, 1]`` (the paper: 0.999; 1 is
      plain error feedback, 0 keeps no momentum).
    sign: apply ``sign(Q)`` (the paper's signum update) or ``Q``.
    seed: the first round's shared seed (nothing here is random; kept for
      the compressors' state).
    chunk_shape: ``'2d'``, the paper's tiles of each leaf, or ``'1d'``,
      chunks of the flattened update (module docstring).
  """
  fn = 'demo'
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 2:
    raise ValueError(f'{fn}: chunk_size={chunk_size!r} must be an int >= 2 '
                     '(the length of each DCT chunk; the paper uses 64).')
  oc.check_chunk_shape(fn, chunk_shape)
  if chunk_shape == '2d':
    most, name = chunk_size * chunk_size, f'chunk_size**2={chunk_size * chunk_size}'
  else:
    most, name = chunk_size, f'chunk_size={chunk_size}'
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
    raise ValueError(f'{fn}: k={k!r} must be an int in [1, {name}] with '
                     f'chunk_shape={chunk_shape!r} (the components sent per chunk; '
                     'the paper uses 32 of 64 x 64).')
  if (isinstance(beta, bool) or not isinstance(beta, (int, float))
      or not 0.0 <= beta <= 1.0):
    raise ValueError(f'{fn}: beta={beta!r} must be a number in [0, 1] (the '
                     'momentum\'s decay; the paper uses 0.999).')
  if sign not in (False, True):
    raise ValueError(f'{fn}: sign={sign!r} must be True (the paper\'s '
                     'sign(Q)) or False (Q).')
  if (isinstance(num_replicas, bool) or not isinstance(num_replicas, int)
      or num_replicas < 1):
    raise ValueError(f'{fn}: num_replicas={num_replicas!r} must be a positive '
                     'int (DiLoCo\'s replicas, each keeping its momentum).')
  kwargs = dict(fn=fn, error_feedback=True, num_clients=num_replicas, seed=seed)
  if chunk_shape == '2d':
    inner = oc.tiled_mean(lambda shapes: tiled_dct_top_k(shapes, chunk_size, k),
                          **kwargs)
  else:
    inner = compression.compressed_mean(dct_top_k(chunk_size, k), **kwargs)
  beta = float(beta)

  def encode(hp, update, w):
    # m_k <- beta m_k + Delta_k: compressed_mean adds the residual it is given.
    return inner.encode({**hp, 'residual': beta * hp['residual']}, update, w)

  def combine(state, hp, clients, key):
    mean, new_state, metrics = inner.combine(state, hp, clients, key)
    if sign:
      mean = jax.tree.map(jnp.sign, mean)
    return mean, new_state, metrics

  return inner._replace(encode=encode, combine=combine)


__all__ = ['chunked_dct', 'chunked_idct', 'dct_top_k', 'demo', 'index_width',
           'tiled_dct', 'tiled_dct_bits', 'tiled_dct_top_k', 'tiled_idct']
