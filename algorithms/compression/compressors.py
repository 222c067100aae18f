"""Compressed aggregation: the client encodes its update into bits, the server decodes.

Each compressor here is an :class:`~fedjx.algorithms.aggregators.Aggregator`:
its ``encode`` runs on every client inside the algorithm's client map and
turns the client's update ``Delta_i`` (flattened to ``x in R^d``, float32)
into a *message*, a dict of the integer and float arrays the client would
put on the wire (b-bit codes packed 32 to a ``uint32`` word, float32
scalars); its ``combine`` decodes every message on the server and averages,
``Delta = sum_i w_i D(m_i) / sum_i w_i`` (with the algorithm's weights), so
every algorithm that takes ``aggregator=`` composes with every compressor.

| builder | message (per client) | unbiased | paper |
|---|---|---|---|
| :func:`stochastic_quantization` | ``b`` bits per coordinate, min and max | yes | Suresh, Yu, Kumar, McMahan, ICML 2017 (``pi_sk``; with ``rotation=True`` ``pi_srk``) |
| :func:`eden` / :func:`drive` | ``b`` bits per rotated coordinate, one scale | (yes) | Vargaftik et al., NeurIPS 2021 (DRIVE), ICML 2022 (EDEN) |
| :func:`qsgd` | norm, sign and level of each coordinate | yes | Alistarh et al., NeurIPS 2017 |
| :func:`terngrad` | 2 bits per coordinate, the max magnitude | yes | Wen et al., NeurIPS 2017 |
| :func:`sign_majority` | 1 bit per coordinate | no | Bernstein et al., ICLR 2019 (signSGD with majority vote) |
| :func:`top_k` / :func:`random_k` | ``k`` values (and their indices) | no | Stich, Cordonnier, Jaggi, NeurIPS 2018 (with error feedback) |
| :func:`uncompressed` | ``d`` float32 | exact | the baseline, with its bits counted |

**Bits.** Every round reports ``upload_bits`` (the mean over the clients
with data of what each sent) and ``download_bits`` (per client: the model's
leaves at their dtypes plus the 64-bit shared seed broadcast with it).
``upload_bits`` is counted from the message itself: the size of each array
times its dtype's width (:func:`representation_bits`), a packed word being
32 bits however many of its bits are used. QSGD's Elias coding is a
variable-length bit stream; the message carries the same integers packed at
fixed width, and its ``upload_bits`` is the length of their Elias-omega
code, computed from the integers (see :func:`qsgd`).

**Randomness shared by client and server.** The aggregator's state holds a
key for the round. The clients' per-client keys are ``split(fold_in(key, 1),
C)`` by cohort position; a rotation shared by every client (Suresh et al.)
is drawn from ``fold_in(key, 0)``; both sides derive them from the same key,
as the papers' public shared randomness, so a random-k client sends no
indices and the server rebuilds each rotation. After the round the server
sets the next round's key to ``fold_in(round_key, 7)``: a run's quantization
noise follows its seed.

**Rotation.** ``R = H D / sqrt(D_pad)``: ``D`` a diagonal of random signs,
``H`` the Walsh-Hadamard matrix (``H H = D_pad I``), the update zero-padded
to the next power of two ``D_pad`` (the padded coordinates are sent and
counted). ``R`` is orthogonal; ``R^-1 = D H / sqrt(D_pad)``; it costs
``O(D_pad log D_pad)`` (a fast Walsh-Hadamard transform).

**Error feedback** (:func:`top_k`, :func:`random_k`): client ``i`` sends
``C(Delta_i + e_i)`` and keeps ``e_i <- Delta_i + e_i - C(Delta_i + e_i)``.
There is no client state store yet, so the residuals ``e_i`` live in the
aggregator's state, one dense ``[N, d]`` float32 array over the population of
``num_clients`` clients indexed by ``cohort.client_ids`` (as SCAFFOLD's
controls): the algorithm must pass the client ids (FedAvg, FedOpt, FedProx,
SCAFFOLD and DiLoCo do). A client that is skipped or has no data keeps its
residual.

Compressed messages are integers: a round through a compressor has no
derivative (use :func:`fedjx.algorithms.aggregators.quantized_mean`, whose
gradient is straight-through, to differentiate through quantization).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms.traits import Traits

Message = dict[str, jax.Array]

# fold_in tags of the state's key.
_ROTATION, _CLIENTS, _NEXT = 0, 1, 7


# ------------------------------------------------------------------- bits

def pack_bits(values: jax.Array, width: int) -> jax.Array:
  """``uint32 [ceil(n width / 32)]``: ``n`` codes of ``width`` bits, packed.

  Code ``j`` occupies bits ``j width .. (j + 1) width - 1`` of the stream,
  least significant bit first; the last word is zero-padded.
  """
  values = jnp.asarray(values).astype(jnp.uint32).reshape(-1)
  bits = (values[:, None] >> jnp.arange(width, dtype=jnp.uint32)) & 1
  bits = bits.reshape(-1)
  pad = -bits.shape[0] % 32
  bits = jnp.pad(bits, (0, pad)).reshape(-1, 32)
  return jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=1,
                 dtype=jnp.uint32)


def unpack_bits(words: jax.Array, width: int, n: int) -> jax.Array:
  """``uint32 [n]``: the codes :func:`pack_bits` packed."""
  bits = (words[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  bits = bits.reshape(-1)[:n * width].reshape(n, width)
  return jnp.sum(bits << jnp.arange(width, dtype=jnp.uint32), axis=1,
                 dtype=jnp.uint32)


def representation_bits(message: Any) -> int:
  """Bits of ``message`` on the wire: ``sum`` over arrays of size x dtype width."""
  return sum(math.prod(jnp.shape(x)) * jnp.dtype(x.dtype).itemsize * 8
             for x in jax.tree.leaves(message))


def index_dtype(n: int) -> jnp.dtype:
  """The narrowest unsigned integer dtype that holds ``0 .. n - 1``."""
  for dtype in (jnp.uint8, jnp.uint16):
    if n <= np.iinfo(dtype).max + 1:
      return jnp.dtype(dtype)
  return jnp.dtype(jnp.uint32)


def bit_length(n: jax.Array) -> jax.Array:
  """``floor(log2 n) + 1`` of positive ``uint32`` ``n`` (0 for 0)."""
  n = jnp.asarray(n, jnp.uint32)
  return (32 - jax.lax.clz(n)).astype(jnp.int32)


def elias_omega_length(n: jax.Array) -> jax.Array:
  """Length in bits of the Elias omega code of each positive integer ``n``.

  Elias, "Universal codeword sets and representations of the integers",
  IEEE Trans. Inf. Theory 1975: the code of ``n`` is the code of ``L - 1``
  (recursively, while it is above 1), then ``n`` in ``L = floor(log2 n) + 1``
  bits, then a 0; so ``len(1) = 1`` and ``len(n) = 1 + L + ...``.
  """
  m = jnp.asarray(n, jnp.uint32)
  total = jnp.ones(m.shape, jnp.int32)
  for _ in range(6):  # 32 -> 6 -> 3 -> 2 -> 1: five steps suffice.
    active = m > 1
    length = bit_length(m)
    total = total + jnp.where(active, length, 0)
    m = jnp.where(active, (length - 1).astype(jnp.uint32), jnp.uint32(1))
  return total


# --------------------------------------------------------------- rotation

def next_power_of_two(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


@functools.cache
def _sylvester(m: int) -> np.ndarray:
  h = np.ones((1, 1), np.float32)
  for _ in range(m):
    h = np.block([[h, h], [h, -h]])
  return h


def walsh_hadamard(x: jax.Array) -> jax.Array:
  """``H x`` for the unnormalised Walsh-Hadamard ``H`` (``x``'s length 2^m).

  ``H_{2^m} = H_{2^a} (x) H_{2^b} (x) ...`` (Sylvester's construction is a
  Kronecker power), so ``x`` reshaped to ``[2^a, 2^b, ...]`` is multiplied
  by one small Hadamard matrix along each axis (factors of at most 2^7):
  ``O(D (2^a + 2^b + ...))`` flops in a few matrix products, which compile
  far faster than ``m`` butterfly stages.
  """
  n = x.shape[-1]
  m = n.bit_length() - 1
  if m == 0:
    return x
  parts = [7] * (m // 7) + ([m % 7] if m % 7 else [])
  y = x.reshape([2 ** p for p in parts])
  for axis, p in enumerate(parts):
    y = jnp.moveaxis(jnp.tensordot(jnp.asarray(_sylvester(p)), y, axes=([1], [axis]),
                                   precision=jax.lax.Precision.HIGHEST), 0, axis)
  return y.reshape(n)


def _signs(key: jax.Array, n: int) -> jax.Array:
  return jax.random.rademacher(key, (n,), jnp.float32)


def rotate(key: jax.Array, x: jax.Array) -> jax.Array:
  """``R x = H D x / sqrt(D_pad)``, ``x`` zero-padded to ``D_pad = 2^ceil(log2 d)``."""
  n = next_power_of_two(x.shape[0])
  x = jnp.pad(x, (0, n - x.shape[0]))
  return walsh_hadamard(_signs(key, n) * x) / jnp.sqrt(jnp.float32(n))


def unrotate(key: jax.Array, y: jax.Array, d: int) -> jax.Array:
  """``R^-1 y = D H y / sqrt(D_pad)``, its first ``d`` coordinates."""
  n = y.shape[0]
  return (_signs(key, n) * walsh_hadamard(y) / jnp.sqrt(jnp.float32(n)))[:d]


# ------------------------------------------------------------- compressors

class Compressor(NamedTuple):
  """One vector compressor: ``encode(key, x) -> (message, bits)``,
  ``decode(key, message, n) -> x_hat`` (``n`` the length of ``x``).

  ``bits`` is a float32 scalar, the bits the message costs on the wire
  (:func:`representation_bits` of it, unless the wire code is variable-length).
  ``traits.unbiased`` declares ``E[x_hat] = x`` over the key. Error feedback
  (Stich, Cordonnier, Jaggi 2018; Karimireddy et al. 2019) is analysed for
  a contraction, ``E||x_hat - x||^2 <= (1 - delta) ||x||^2``; an unbiased
  compressor need not be one (rescaled random-k has ``E||x_hat - x||^2 =
  (d / k - 1) ||x||^2``, and the residual then grows by that factor every
  round) and needs no memory, its errors averaging out: it defaults to no
  error feedback and refuses it (:func:`compressed_mean`).
  """

  encode: Callable[[jax.Array, jax.Array], tuple[Message, jax.Array]]
  decode: Callable[[jax.Array, Message, int], jax.Array]
  traits: Traits = Traits()


def _counted(message: Message) -> tuple[Message, jax.Array]:
  return message, jnp.float32(representation_bits(message))


def uniform_levels(bits: int) -> Compressor:
  """Stochastic ``k``-level quantization, ``k = 2^bits`` (Suresh et al. ``pi_sk``).

  ``B_r = x_min + r (x_max - x_min) / (k - 1)``; coordinate ``x_j`` in
  ``[B_r, B_{r+1})`` becomes ``B_{r+1}`` with probability ``(x_j - B_r) /
  (B_{r+1} - B_r)``, else ``B_r``: ``E[Y] = x`` and ``E||Y - x||^2 =
  sum_j (B_{r+1} - x_j)(x_j - B_r) <= d (x_max - x_min)^2 / (4 (k - 1)^2)``.
  """
  k = 2 ** bits

  def encode(key, x):
    lo, hi = jnp.min(x), jnp.max(x)
    step = (hi - lo) / (k - 1)
    t = (x - lo) / jnp.where(step > 0, step, 1.0)
    low = jnp.floor(t)
    up = jax.random.uniform(key, x.shape) < t - low
    level = jnp.clip(low + up, 0, k - 1)
    return _counted({'levels': pack_bits(level, bits),
                     'range': jnp.stack([lo, hi]).astype(jnp.float32)})

  def decode(key, m, n):
    del key
    lo, hi = m['range'][0], m['range'][1]
    level = unpack_bits(m['levels'], bits, n).astype(jnp.float32)
    return lo + level * ((hi - lo) / (k - 1))

  return Compressor(encode, decode, Traits(unbiased=True))


@functools.cache
def lloyd_max_normal(bits: int) -> tuple[np.ndarray, np.ndarray]:
  """The ``2^bits`` Lloyd-Max centroids of ``N(0, 1)`` and their boundaries.

  Lloyd's iteration on the density (float64): boundaries are midpoints of
  neighbouring centroids, centroids the conditional means
  ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))`` of their cells. One bit gives
  ``+-sqrt(2 / pi)``; two bits ``+-0.4528, +-1.5104`` (Max 1960).
  """
  k = 2 ** bits
  pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi) if math.isfinite(t) else 0.0
  cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2))) if math.isfinite(t) else (1.0 if t > 0 else 0.0)
  c = np.linspace(-2.0, 2.0, k) if k > 1 else np.zeros(1)
  for _ in range(2000):
    b = np.concatenate([[-math.inf], (c[1:] + c[:-1]) / 2, [math.inf]])
    c = np.array([(pdf(b[j]) - pdf(b[j + 1])) / (cdf(b[j + 1]) - cdf(b[j]))
                  for j in range(k)])
  return c, (c[1:] + c[:-1]) / 2


def eden_codes(bits: int) -> Compressor:
  """EDEN (Vargaftik et al. 2022) with ``b = bits``, rotation per client.

  ``z = R_i x``, ``u = z sqrt(D_pad) / ||x||`` (about ``N(0, 1)`` per
  coordinate), ``q = Q(u)`` the nearest of the ``2^b`` Lloyd-Max centroids
  of ``N(0, 1)``; the client sends the indices and the scale
  ``S = ||x||^2 / <z, q>``; the server decodes ``x_hat = R_i^-1 (S q)``, so
  ``<x_hat, x> = ||x||^2`` exactly. With ``b = 1`` the centroids are
  ``+-sqrt(2 / pi)`` and ``S q = sign(z) ||x||^2 / ||z||_1``: DRIVE
  (Vargaftik et al. 2021). The rotation ``R_i`` comes from the client's key,
  which the server rebuilds.
  """
  centroids, boundaries = lloyd_max_normal(bits)

  def encode(key, x):
    z = rotate(jax.random.fold_in(key, _ROTATION), x)
    norm = jnp.sqrt(jnp.sum(jnp.square(x)))
    u = z * jnp.sqrt(jnp.float32(z.shape[0])) / jnp.where(norm > 0, norm, 1.0)
    index = jnp.searchsorted(jnp.asarray(boundaries, jnp.float32), u)
    q = jnp.asarray(centroids, jnp.float32)[index]
    dot = jnp.vdot(z, q)
    scale = jnp.where(dot > 0, jnp.square(norm) / jnp.where(dot > 0, dot, 1.0), 0.0)
    return _counted({'indices': pack_bits(index, bits),
                     'scale': jnp.reshape(scale, (1,)).astype(jnp.float32)})

  def decode(key, m, n):
    padded = next_power_of_two(n)
    index = unpack_bits(m['indices'], bits, padded)
    y = m['scale'][0] * jnp.asarray(centroids, jnp.float32)[index]
    return unrotate(jax.random.fold_in(key, _ROTATION), y, n)

  # Unbiased for uniformly random rotations (their Theorem 2.1).
  return Compressor(encode, decode, Traits(unbiased=True))


def qsgd_levels(levels: int, coding: str) -> Compressor:
  """QSGD's ``Q_s`` (Alistarh et al. 2017), ``s = levels``.

  ``Q_s(v)_j = ||v|| sign(v_j) xi_j``, ``xi_j = (l + 1) / s`` with
  probability ``|v_j| s / ||v|| - l`` else ``l / s`` (``l = floor(|v_j| s /
  ||v||)``): unbiased, ``E||Q_s(v) - v||^2 <= min(d / s^2, sqrt(d) / s)
  ||v||^2`` (their Lemma 3.1). Sent: the norm (32 bits), a sign bit and the
  level ``0..s`` of each coordinate. ``coding='fixed'``: ``1 +
  ceil(log2(s + 1))`` bits per coordinate, counted from the packed arrays.
  ``coding='elias'``: the paper's code (Section 3.2): 32 bits of norm, then
  for each nonzero coordinate the Elias-omega code of its distance to the
  previous nonzero one, its sign bit and the Elias-omega code of its level;
  counted from the integers produced.
  """
  width = int(levels).bit_length()

  def encode(key, x):
    norm = jnp.sqrt(jnp.sum(jnp.square(x)))
    r = jnp.abs(x) * levels / jnp.where(norm > 0, norm, 1.0)
    low = jnp.floor(r)
    level = jnp.clip(low + (jax.random.uniform(key, x.shape) < r - low), 0, levels)
    message = {'norm': jnp.reshape(norm, (1,)).astype(jnp.float32),
               'signs': pack_bits(x < 0, 1),
               'levels': pack_bits(level, width)}
    if coding == 'fixed':
      return _counted(message)
    nonzero = level > 0
    position = jnp.arange(x.shape[0], dtype=jnp.int32)
    last = jnp.where(nonzero, position, -1)
    previous = jnp.concatenate([jnp.array([-1], jnp.int32),
                                jax.lax.cummax(last)[:-1]])
    gap = jnp.maximum(position - previous, 1)
    per = (elias_omega_length(gap) + 1 +
           elias_omega_length(jnp.maximum(level, 1).astype(jnp.uint32)))
    bits = 32 + jnp.sum(jnp.where(nonzero, per, 0))
    return message, bits.astype(jnp.float32)

  def decode(key, m, n):
    del key
    level = unpack_bits(m['levels'], width, n).astype(jnp.float32)
    sign = 1.0 - 2.0 * unpack_bits(m['signs'], 1, n).astype(jnp.float32)
    return m['norm'][0] * sign * level / levels

  return Compressor(encode, decode, Traits(unbiased=True))


def ternary() -> Compressor:
  """TernGrad (Wen et al. 2017): ``s sign(g) b``, ``b_j ~ Bernoulli(|g_j| / s)``.

  ``s = max_j |g_j|``: unbiased, ``E||t - g||^2 = sum_j (s |g_j| - g_j^2)``.
  Sent: 2 bits per coordinate (0, +1, -1) and ``s``.
  """
  def encode(key, x):
    s = jnp.max(jnp.abs(x))
    keep = jax.random.uniform(key, x.shape) < jnp.abs(x) / jnp.where(s > 0, s, 1.0)
    code = jnp.where(keep, jnp.where(x < 0, 2, 1), 0)
    return _counted({'ternary': pack_bits(code, 2),
                     'scale': jnp.reshape(s, (1,)).astype(jnp.float32)})

  def decode(key, m, n):
    del key
    code = unpack_bits(m['ternary'], 2, n)
    value = jnp.where(code == 1, 1.0, jnp.where(code == 2, -1.0, 0.0))
    return m['scale'][0] * value

  return Compressor(encode, decode, Traits(unbiased=True))


def signs() -> Compressor:
  """``sign(x)`` in one bit per coordinate (``x_j >= 0`` is ``+1``)."""
  def encode(key, x):
    del key
    return _counted({'signs': pack_bits(x < 0, 1)})

  def decode(key, m, n):
    del key
    return 1.0 - 2.0 * unpack_bits(m['signs'], 1, n).astype(jnp.float32)

  return Compressor(encode, decode)


def sparse(k: int, choose: str, rescale: bool) -> Compressor:
  """Top-k (the ``k`` largest ``|x_j|``) or random-k (``k`` drawn from the key).

  Top-k sends the values and their indices (the narrowest unsigned dtype
  that holds ``d - 1``); random-k sends the values only, the server
  drawing the same indices from the client's key. ``rescale`` multiplies
  random-k's values by ``d / k`` (then unbiased).
  """
  def indices(key, n):
    return jax.random.permutation(key, n)[:k]

  def encode(key, x):
    n = x.shape[0]
    if choose == 'top':
      _, index = jax.lax.top_k(jnp.abs(x), k)
      return _counted({'values': x[index].astype(jnp.float32),
                       'indices': index.astype(index_dtype(n))})
    values = x[indices(key, n)]
    if rescale:
      values = values * (n / k)
    return _counted({'values': values.astype(jnp.float32)})

  def decode(key, m, n):
    index = (m['indices'].astype(jnp.int32) if choose == 'top'
             else indices(key, n))
    return jnp.zeros((n,), jnp.float32).at[index].set(m['values'])

  return Compressor(encode, decode,
                    Traits(unbiased=choose == 'random' and rescale))


def identity() -> Compressor:
  """``x`` as float32 (the uncompressed baseline)."""
  return Compressor(lambda key, x: _counted({'values': x.astype(jnp.float32)}),
                    lambda key, m, n: m['values'], Traits(unbiased=True))


# ------------------------------------------------------------- aggregator

class CompressionState(NamedTuple):
  """A compressed aggregator's state.

  Attributes:
    key: ``uint32 [2]``, the round's shared seed (client keys, rotation).
    template: the update's structure: zeros shaped like the model (the
      server decodes the flat messages into it; checkpoints hold it).
    residual: the error-feedback residuals ``e_i``, ``[N, d]`` float32
      (``()`` without error feedback).
  """

  key: jax.Array
  template: base.PyTree
  residual: jax.Array


def _raw_key(key: jax.Array) -> jax.Array:
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key)
  return key


def _structure(template: base.PyTree) -> tuple[int, Callable[[jax.Array], base.PyTree]]:
  flat, unravel = ravel_pytree(template)
  return flat.shape[0], unravel


def structure_template(params: base.PyTree) -> base.PyTree:
  """Zeros shaped like ``params``: the structure a decoded update takes."""
  return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)),
                      params)


def model_bits(template: base.PyTree) -> int:
  """Bits of the model the server broadcasts (its leaves at their dtypes)."""
  return sum(math.prod(t.shape) * jnp.dtype(t.dtype).itemsize * 8
             for t in jax.tree.leaves(template))


def _flat(update: base.PyTree) -> jax.Array:
  return ravel_pytree(jax.tree.map(lambda u: jnp.asarray(u, jnp.float32),
                                   update))[0]


def client_keys(key: jax.Array, cohort_size: int) -> jax.Array:
  """The placed per-client keys of a round: ``split(fold_in(key, 1), C)``."""
  return jax.random.split(jax.random.fold_in(key, _CLIENTS), cohort_size)


def _masked_mean(values: jax.Array, real: jax.Array) -> jax.Array:
  count = fedjx.reduce_sum(real)
  return fedjx.reduce_sum(values * real) / jnp.maximum(count, 1.0)


def compressed_mean(compressor: Compressor, *, fn: str,
                    shared_rotation: bool = False, seed: int = 0,
                    error_feedback: bool = False,
                    num_clients: int | None = None,
                    vote_step: bool = False,
                    hparams: Mapping[str, float] | None = None) -> aggregators.Aggregator:
  """The weighted mean of decoded messages, with bits counted (module docstring).

  Args:
    compressor: the vector :class:`Compressor`.
    fn: the builder's name, for errors.
    shared_rotation: rotate every client's vector by the round's shared
      ``R`` before compressing; the server sums the decoded (rotated)
      vectors and rotates the mean back once (Suresh et al. 2017).
    seed: the first round's shared seed.
    error_feedback: keep per-client residuals (needs ``num_clients``);
      refused for an unbiased compressor (``Compressor.traits.unbiased``).
    num_clients: the population size ``N``.
    vote_step: combine as signSGD's majority vote,
      ``Delta = step_size sign(sum_i 1[w_i > 0] sign_i)``.
    hparams: the aggregator's traced hyperparameters.
  """
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f'{fn}: seed={seed!r} must be an int.')
  if error_feedback and compressor.traits.unbiased:
    raise ValueError(
        f'{fn}: error_feedback=True is refused for an unbiased compressor: '
        'error feedback needs a contraction (E||C(x) - x||^2 < ||x||^2), '
        'which an unbiased one need not be (its residual can grow every '
        'round); use error_feedback=False.')
  if error_feedback:
    base.check_positive_int(fn, 'num_clients', num_clients)

  def init(params):
    template = structure_template(params)
    d = _structure(template)[0]
    residual = (jnp.zeros((num_clients, d), jnp.float32) if error_feedback
                else ())
    return CompressionState(jax.random.PRNGKey(seed), template, residual)

  def broadcast(state):
    return {'shared_key': state.key}

  def client_inputs(state, client_ids, cohort_size):
    inputs = {'client_key': client_keys(state.key, cohort_size)}
    if error_feedback:
      if client_ids is None:
        raise ValueError(
            f'{fn}: error_feedback=True keeps a residual per client, but the '
            'algorithm does not pass the cohort\'s client ids to its '
            'aggregator; use error_feedback=False or FedAvg / FedOpt / '
            'FedProx / SCAFFOLD / DiLoCo.')
      inputs['residual'] = base.gather_clients(state.residual, client_ids)
    return inputs

  def encode(hp, update, w):
    del w
    x = _flat(update)
    d = x.shape[0]
    if error_feedback:
      x = x + hp['residual']
    z = rotate(jax.random.fold_in(hp['shared_key'], _ROTATION), x) if shared_rotation else x
    message, bits = compressor.encode(hp['client_key'], z)
    encoded = {'upload_bits': bits}
    if error_feedback:
      encoded['residual'] = x - compressor.decode(hp['client_key'], message, d)
    return message, encoded

  def combine(state, hp, clients, key):
    d, unravel = _structure(state.template)
    n = next_power_of_two(d) if shared_rotation else d
    cohort = clients.weights.shape[0]
    keys = client_keys(state.key, cohort)
    real = fedjx.map_fn(lambda m: (m > 0).astype(jnp.float32),
                        (clients.num_examples,))
    if vote_step:
      votes = fedjx.reduce_sum(fedjx.map_fn(
          lambda k, m, r: r * compressor.decode(k, m, n),
          (keys, clients.update, real)))
      mean = hp['step_size'] * jnp.sign(votes)
    else:
      total = fedjx.reduce_sum(fedjx.map_fn(
          lambda k, m, w: w * compressor.decode(k, m, n),
          (keys, clients.update, clients.weights)))
      weight = fedjx.reduce_sum(clients.weights)
      mean = jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), 0.0)
    if shared_rotation:
      mean = unrotate(jax.random.fold_in(state.key, _ROTATION), mean, d)
    residual = state.residual
    if error_feedback:
      residual = base.scatter_clients(residual, clients.client_ids,
                                      clients.encoded['residual'],
                                      clients.num_examples > 0)
    metrics = {'upload_bits': _masked_mean(clients.encoded['upload_bits'], real),
               'download_bits': jnp.float32(model_bits(state.template) + 64)}
    new_state = CompressionState(
        jax.random.fold_in(_raw_key(key), _NEXT), state.template, residual)
    return unravel(mean), new_state, metrics

  def message_bytes(params):
    x = jax.ShapeDtypeStruct((_flat(jax.tree.map(jnp.zeros_like, params)).shape[0],),
                             jnp.float32)
    shape = (next_power_of_two(x.shape[0]),) if shared_rotation else x.shape
    out = jax.eval_shape(compressor.encode, jax.ShapeDtypeStruct((2,), jnp.uint32),
                         jax.ShapeDtypeStruct(shape, jnp.float32))[0]
    return math.ceil(representation_bits(out) / 8)

  return aggregators.Aggregator(
      init=init, combine=combine, encode=encode, hparams=dict(hparams or {}),
      broadcast=broadcast, client_inputs=client_inputs,
      message_bytes=message_bytes, traits=Traits(wire_bits=True))


# ---------------------------------------------------------------- builders

_BITS = (1, 2, 4, 8, 16)


def stochastic_quantization(bits: int = 2, rotation: bool = False,
                            seed: int = 0) -> aggregators.Aggregator:
  """Stochastic uniform quantization, optionally after a shared random rotation.

  Suresh, Yu, Kumar, McMahan, "Distributed Mean Estimation with Limited
  Communication", ICML 2017: ``pi_sk`` (``rotation=False``) and ``pi_srk``
  (``rotation=True``, ``R = H D / sqrt(D_pad)`` shared by all clients; the
  server rotates the mean back). :func:`uniform_levels` gives the levels.
  Mean squared error of the mean of ``n`` clients, over ``(1/n) sum_i
  ||x_i||^2``: at most ``d / (2 n (k - 1)^2)`` for ``pi_sk`` and ``(2 log D_pad
  + 2) / (n (k - 1)^2)`` for ``pi_srk`` (their Theorems 2 and 3; ``k =
  2^bits``). Sent: ``bits`` per (padded) coordinate and two float32.
  """
  fn = 'stochastic_quantization'
  base.check_choice(fn, 'bits', bits, _BITS)
  base.check_choice(fn, 'rotation', rotation, (False, True))
  return compressed_mean(uniform_levels(bits), fn=fn, shared_rotation=rotation,
                         seed=seed)


def eden(bits: int = 1, seed: int = 0) -> aggregators.Aggregator:
  """EDEN (Vargaftik et al., "EDEN: Communication-Efficient and Robust
  Distributed Mean Estimation for Federated Learning", ICML 2022) with
  ``bits`` per coordinate (:func:`eden_codes`). Unbiased for uniformly random
  rotations (their Theorem 2.1); here ``R_i`` is the randomised Hadamard
  rotation, as in their experiments. Sent: ``bits`` per padded coordinate and
  one float32 scale."""
  base.check_choice('eden', 'bits', bits, (1, 2, 4))
  return compressed_mean(eden_codes(bits), fn='eden', seed=seed)


def drive(seed: int = 0) -> aggregators.Aggregator:
  """DRIVE (Vargaftik et al., "DRIVE: One-bit Distributed Mean Estimation",
  NeurIPS 2021), unbiased scale ``S = ||x||^2 / ||R x||_1``: :func:`eden` with
  one bit. Its normalised error ``||x_hat - x||^2 / ||x||^2 = D_pad ||x||^2 /
  ||R x||_1^2 - 1``, about ``pi / 2 - 1`` for large ``d``."""
  return compressed_mean(eden_codes(1), fn='drive', seed=seed)


def qsgd(levels: int = 4, coding: str = 'elias', seed: int = 0) -> aggregators.Aggregator:
  """QSGD (Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
  Quantization and Encoding", NeurIPS 2017) with ``s = levels``; see
  :func:`qsgd_levels` for the bits of ``coding='elias'`` and ``'fixed'``."""
  fn = 'qsgd'
  base.check_positive_int(fn, 'levels', levels)
  base.check_choice(fn, 'coding', coding, ('elias', 'fixed'))
  return compressed_mean(qsgd_levels(levels, coding), fn=fn, seed=seed)


def terngrad(seed: int = 0) -> aggregators.Aggregator:
  """TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning", NeurIPS 2017), one scale for
  the whole update (:func:`ternary`)."""
  return compressed_mean(ternary(), fn='terngrad', seed=seed)


def sign_majority(step_size: float = 1e-2) -> aggregators.Aggregator:
  """signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli,
  Anandkumar, "signSGD with Majority Vote is Communication Efficient and
  Fault Tolerant", ICLR 2019, Algorithm 1).

  Client ``i`` sends ``sign(Delta_i)`` (1 bit per coordinate); the server
  takes the vote ``Delta = step_size sign(sum_i sign(Delta_i))`` over the
  clients with data (unweighted; a tie gives 0). Biased by design.
  ``step_size`` is traced (``state.hparams['step_size']``); the server
  optimizer then applies ``Delta`` (SGD 1.0 by default: ``x <- x - Delta``).
  """
  base.check_number('sign_majority', 'step_size', step_size, strict=True)
  return compressed_mean(signs(), fn='sign_majority', vote_step=True,
                         hparams={'step_size': step_size})


def _sparse(fn: str, choose: str, fraction: float | None, k: int | None,
            error_feedback: bool | None, num_clients: int | None, rescale: bool,
            seed: int) -> aggregators.Aggregator:
  if (fraction is None) == (k is None):
    raise ValueError(f'{fn}: give exactly one of fraction={fraction!r} and '
                     f'k={k!r}.')
  if k is not None:
    base.check_positive_int(fn, 'k', k)
  else:
    base.check_number(fn, 'fraction', fraction, strict=True, high=1.0)
  base.check_choice(fn, 'error_feedback', error_feedback, (None, False, True))
  unbiased = choose == 'random' and rescale
  if error_feedback is None:  # Memory for biased compressors only.
    error_feedback = not unbiased
  if error_feedback and unbiased:
    raise ValueError(
        f'{fn}: error_feedback=True with rescale=True is refused: the '
        'rescaled random-k is unbiased, E||C(x) - x||^2 = (d/k - 1) ||x||^2, '
        'not a contraction, so the residual grows by d/k - 1 every round; '
        'use rescale=False with error feedback, or error_feedback=None or '
        'False with rescale=True.')

  def count(d):  # k depends on d, known when the update is.
    if k is not None:
      if k > d:
        raise ValueError(f'{fn}: k={k} exceeds the update\'s {d} coordinates.')
      return k
    return max(1, math.ceil(fraction * d))

  comp = Compressor(
      lambda key, x: sparse(count(x.shape[0]), choose, rescale).encode(key, x),
      lambda key, m, n: sparse(count(n), choose, rescale).decode(key, m, n),
      Traits(unbiased=unbiased))
  return compressed_mean(comp, fn=fn, error_feedback=error_feedback,
                         num_clients=num_clients, seed=seed)


def top_k(fraction: float | None = None, k: int | None = None,
          error_feedback: bool | None = None, num_clients: int | None = None,
          seed: int = 0) -> aggregators.Aggregator:
  """Top-k sparsification, with error feedback by default (it is biased).


  Client ``i`` sends the ``k`` largest-magnitude coordinates of ``a_i =
  Delta_i + e_i`` (values float32, indices in the narrowest unsigned dtype)
  and keeps ``e_i <- a_i - top_k(a_i)`` (Stich, Cordonnier, Jaggi,
  "Sparsified SGD with Memory", NeurIPS 2018; Karimireddy et al. 2019).
  ``k`` is given, or ``ceil(fraction d)``. Error feedback (the default,
  ``error_feedback=None``: top-k is biased, a contraction with ``delta = k
  / d``) needs ``num_clients`` (residuals ``[N, d]`` in the aggregator's
  state, module docstring). ``k = d`` decodes exactly.
  """
  return _sparse('top_k', 'top', fraction, k, error_feedback, num_clients,
                 False, seed)


def random_k(fraction: float | None = None, k: int | None = None,
             error_feedback: bool | None = None, num_clients: int | None = None,
             rescale: bool = False, seed: int = 0) -> aggregators.Aggregator:
  """Random-k sparsification (``k`` coordinates drawn from the client's key,
  which the server shares: only the values are sent).

  Without ``rescale`` the values are sent as they are: biased, a
  contraction (``E||C(x) - x||^2 = (1 - k / d) ||x||^2``), with error
  feedback by default as :func:`top_k`. ``rescale=True`` multiplies them by
  ``d / k``: unbiased (``Compressor.traits.unbiased``), ``E||C(x) - x||^2 = (d / k
  - 1) ||x||^2`` (Stich, Cordonnier, Jaggi 2018, Section 2), so the default
  is no error feedback, and ``error_feedback=True`` is refused (the
  residual would grow by ``d / k - 1`` a round)."""
  base.check_choice('random_k', 'rescale', rescale, (False, True))
  return _sparse('random_k', 'random', fraction, k, error_feedback,
                 num_clients, rescale, seed)


def uncompressed(seed: int = 0) -> aggregators.Aggregator:
  """The weighted mean of float32 updates, with its bits counted."""
  return compressed_mean(identity(), fn='uncompressed', seed=seed)


# The compressors a config can name: aggregator=dict(name='qsgd', levels=4).
COMPRESSORS = {
    'stochastic_quantization': stochastic_quantization,
    'eden': eden,
    'drive': drive,
    'qsgd': qsgd,
    'terngrad': terngrad,
    'sign_majority': sign_majority,
    'top_k': top_k,
    'random_k': random_k,
    'uncompressed': uncompressed,
}

__all__ = ['COMPRESSORS', 'CompressionState', 'Compressor', 'compressed_mean',
           'drive', 'eden', 'elias_omega_length', 'pack_bits', 'qsgd',
           'random_k', 'representation_bits', 'rotate', 'sign_majority',
           'stochastic_quantization', 'terngrad', 'top_k', 'uncompressed',
           'unpack_bits', 'unrotate']
