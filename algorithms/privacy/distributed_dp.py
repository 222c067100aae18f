"""Distributed DP on a secure sum (Skellam), and local DP (client-side Gaussian).

**Distributed Skellam** (Agarwal, Kairouz, Liu, "The Skellam Mechanism for
Differentially Private Federated Learning", NeurIPS 2021). Each client of
:func:`distributed_skellam` runs the secure sum's encoding
(:mod:`fedjx.algorithms.aggregators.secure`: clip to ``C``, shared
Hadamard rotation, scale ``s``, randomized rounding) and adds integer noise
``Sk(mu / n_min)`` per coordinate, ``Sk(lambda) = Poisson(lambda / 2) -
Poisson(lambda / 2)`` (variance ``lambda``), before the modular reduction.
Skellam variables add up to a Skellam variable, so when at least ``n_min``
clients survive the server's modular sum holds the clients' sum plus
``Sk(mu')`` with ``mu' >= mu``; ``n_min = threshold + 1``, the fewest
survivors with which the secure sum can succeed. ``mu = (z C s)^2``: the
noise standard deviation is ``z`` times the clip norm, in the scaled
integer units (``z`` is the noise multiplier of central DP's Gaussian).

Scaled and rounded, one client's vector has ``||v||_2 <= Delta_2 = C s +
sqrt(D)`` (the rounding moves each of the ``D`` padded coordinates by less
than 1) and, being an integer vector, ``||v||_1 <= Delta_1 = min(Delta_2^2,
sqrt(D) Delta_2)``. The sum is then (their Theorem 3.5 with Corollary 3.6,
for the L2 and L1 sensitivities of an integer vector query)

    (alpha, eps(alpha))-RDP,  eps(alpha) = alpha Delta_2^2 / (2 mu)
        + min(((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (4 mu^2), 3 Delta_1 / (2 mu))

under add-or-remove of one client, and with ``2 Delta`` for replace-one.
As ``s`` grows the first term is the Gaussian's ``alpha / (2 z^2)`` and the
rest vanishes: with enough bits the distributed mechanism matches central
DP (their Figure 2). :func:`skellam_rdp` evaluates it; rounds compose by
adding RDP; cohorts sampled with probability ``q`` (Poisson) amplify it by
Zhu and Wang's bound for Poisson-subsampled RDP ("Poisson Subsampled Renyi
Differential Privacy", ICML 2019, Theorem 6, integer orders), fixed-size
cohorts (``m`` of ``N``, replace-one) by Wang, Balle, Kasiviswanathan
("Subsampled Renyi Differential Privacy and Analytical Moments
Accountant", AISTATS 2019, Theorem 9); shuffled epochs of ``E`` rounds
(zero-out, sensitivity ``Delta``) claim no amplification, a client
composing at most ``ceil(R / E)`` rounds; ``sampling=None`` claims no
amplification (replace-one). The relation, and with it the factor 1 or 2
on ``Delta``, is :func:`fedjx.algorithms.privacy.accounting.sensitivity`'s for the
sampling, as for central DP. ``sampling`` is the run's
:class:`fedjx.algorithms.privacy.accounting.Sampling` (population, cohort size and
sampler: what the runner passes, ``experiments/privacy.py``), or, for a
caller without one, a sampler name with its ``sampling_rate``. Epsilon at ``delta`` is ``min_alpha eps(alpha)
+ log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)``
(Balle et al. 2020, Theorem 21) over the orders ``2..256``. The aggregator
computes the per-round RDP at ``init`` (the dimension is the model's), adds
it up in its state each round that releases a sum (a failed secure sum
releases nothing), and reports ``ddp_epsilon``, the epsilon of the rounds
so far.

The scale is chosen so that the modular sum rarely wraps: with ``n =
clients_per_round`` clients the sum's coordinates have standard deviation
about ``s C sqrt(n / D + (n / n_min) z^2)`` (rotated coordinates of size
``C / sqrt(D)``, noise shares ``mu / n_min``), and ``s`` puts
``k_stddevs`` of them inside ``[-m/2, m/2)``: ``s = m / (2 k_stddevs C
sqrt(n / D + (n / n_min) z^2))`` (the choice of Kairouz, Liu, Steinke,
"The Distributed Discrete Gaussian Mechanism for Federated Learning with
Secure Aggregation", ICML 2021, Section 5). Fewer bits, smaller ``s``:
``Delta_2`` grows against ``C s`` and the guarantee weakens.

**Local DP** (:func:`local_gaussian`): each client clips to ``C`` and adds
``N(0, (z C)^2 I)`` itself before sending; the server averages. Every
report is a Gaussian mechanism on that client's data (any two of its
inputs differ by at most ``2 C``: noise multiplier ``z / 2``), whatever the
server does; a client's guarantee composes over the rounds it takes part
in (:func:`local_gaussian_epsilon`, ``dp_accounting``'s RDP accountant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fedjx
from fedjx.algorithms import base
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.aggregators import secure as secure_aggregation
from fedjx.algorithms.compression import compressors as compression
from fedjx.algorithms.privacy import accounting
from fedjx.algorithms.traits import Privacy
from fedjx.algorithms.traits import Traits

ORDERS = tuple(range(2, 257))
SAMPLINGS = (None, 'poisson', 'uniform')


# ------------------------------------------------------------- accounting

def skellam_sensitivity(clip_norm: float, scale: float,
                        dimension: int) -> tuple[float, float]:
  """``(Delta_2, Delta_1)`` of one scaled, randomly rounded client vector."""
  l2 = clip_norm * scale + math.sqrt(dimension)
  return l2, min(l2 * l2, math.sqrt(dimension) * l2)


def skellam_rdp(orders: Sequence[float], l2: float, l1: float,
                mu: float) -> np.ndarray:
  """Agarwal et al.'s RDP of ``Sk(mu)`` noise on a query of sensitivities ``(l2, l1)``."""
  a = np.asarray(orders, np.float64)
  if mu <= 0:
    return np.full(a.shape, np.inf)
  return a * l2 ** 2 / (2 * mu) + np.minimum(
      ((2 * a - 1) * l2 ** 2 + 6 * l1) / (4 * mu ** 2), 3 * l1 / (2 * mu))


def _log_comb(n: int, k: np.ndarray) -> np.ndarray:
  return (math.lgamma(n + 1) - np.vectorize(math.lgamma)(k + 1)
          - np.vectorize(math.lgamma)(n - k + 1))


def poisson_subsampled_rdp(rdp: Sequence[float], q: float,
                           orders: Sequence[int] = ORDERS) -> np.ndarray:
  """Zhu and Wang (2019), Theorem 6: RDP of a mechanism on a Poisson sample.

  For integer ``alpha``: ``1/(alpha-1) log((1-q)^(alpha-1) (alpha q - q + 1)
  + C(alpha,2) q^2 (1-q)^(alpha-2) e^eps(2) + 3 sum_{l=3}^alpha C(alpha,l)
  (1-q)^(alpha-l) q^l e^((l-1) eps(l)))``, never above ``eps(alpha)``.
  ``rdp[j]`` is ``eps(orders[j])``; ``orders`` must be ``2, 3, ...``.
  """
  eps = dict(zip(orders, np.asarray(rdp, np.float64)))
  if q >= 1:
    return np.asarray(rdp, np.float64)
  out = []
  for a in orders:
    terms = [(a - 1) * math.log1p(-q) + math.log(a * q - q + 1),
             math.log(math.comb(a, 2)) + 2 * math.log(q) + (a - 2) * math.log1p(-q)
             + eps[2]]
    l = np.arange(3, a + 1)
    if l.size:
      e = np.array([eps[int(i)] for i in l])
      terms.extend(list(math.log(3) + _log_comb(a, l) + (a - l) * math.log1p(-q)
                        + l * math.log(q) + (l - 1) * e))
    out.append(min(eps[a], float(np.logaddexp.reduce(terms)) / (a - 1)))
  return np.asarray(out)


def without_replacement_rdp(rdp: Sequence[float], gamma: float,
                            orders: Sequence[int] = ORDERS) -> np.ndarray:
  """Wang, Balle, Kasiviswanathan (2019), Theorem 9 (replace-one, ``gamma = m / N``).

  For integer ``alpha``: ``1/(alpha-1) log(1 + gamma^2 C(alpha,2)
  min(4 (e^eps(2) - 1), 2 e^eps(2)) + sum_{j=3}^alpha gamma^j C(alpha,j) 2
  e^((j-1) eps(j)))`` (``eps(inf) = inf`` for Skellam noise), never above
  ``eps(alpha)``.
  """
  eps = dict(zip(orders, np.asarray(rdp, np.float64)))
  if gamma >= 1:
    return np.asarray(rdp, np.float64)
  out = []
  for a in orders:
    second = min(math.log(4) + math.log(math.expm1(eps[2])) if eps[2] > 0 else -math.inf,
                 math.log(2) + eps[2])
    terms = [0.0, 2 * math.log(gamma) + math.log(math.comb(a, 2)) + second]
    j = np.arange(3, a + 1)
    if j.size:
      e = np.array([eps[int(i)] for i in j])
      terms.extend(list(j * math.log(gamma) + _log_comb(a, j) + math.log(2)
                        + (j - 1) * e))
    out.append(min(eps[a], float(np.logaddexp.reduce(terms)) / (a - 1)))
  return np.asarray(out)


def rdp_to_epsilon(rdp: Sequence[float], delta: float,
                   orders: Sequence[float] = ORDERS) -> float:
  """``min_alpha rdp(alpha) + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1)``."""
  a = np.asarray(orders, np.float64)
  eps = (np.asarray(rdp, np.float64) + np.log((a - 1) / a)
         - (math.log(delta) + np.log(a)) / (a - 1))
  return float(max(0.0, np.min(eps)))


Sampling = str | accounting.Sampling | None


def _check_accounting(fn: str, sampling: Sampling, sampling_rate: float | None,
                      delta: float) -> None:
  if isinstance(sampling, accounting.Sampling):
    if sampling_rate is not None:
      raise ValueError(f'{fn}: sampling_rate={sampling_rate!r} is given with '
                       f'sampling={sampling!r}, which has its own rate; give '
                       'sampling_rate only with a sampler name.')
  else:
    base.check_choice(fn, 'sampling', sampling, SAMPLINGS)
    if sampling is not None:
      if sampling_rate is None:
        raise ValueError(f'{fn}: sampling={sampling!r} needs sampling_rate '
                         '(q, or m / N for fixed-size cohorts).')
      base.check_number(fn, 'sampling_rate', sampling_rate, strict=True, high=1.0)
  base.check_number(fn, 'delta', delta, strict=True, high=1.0)


def sensitivity_factor(sampling: Sampling) -> int:
  """``k``: ``Delta`` of one client's vector times 1 or 2, by the relation.

  :func:`fedjx.algorithms.privacy.accounting.sensitivity` of the run's
  :class:`~fedjx.algorithms.privacy.accounting.Sampling`; a sampler name takes the
  relation of that sampler (``None``: replace-one).
  """
  if isinstance(sampling, accounting.Sampling):
    return accounting.sensitivity('distributed_skellam', sampling).factor
  relation = ('replace_one' if sampling is None
              else accounting.RELATION_OF_SAMPLING[sampling])
  return accounting.SENSITIVITY_FACTOR[relation]


def compositions(sampling: Sampling, rounds: int) -> int:
  """How many rounds one client's data enters: ``ceil(R / E)`` for shuffled
  epochs of ``E`` rounds (each client at most once per epoch), else ``R``."""
  if isinstance(sampling, accounting.Sampling) and sampling.name == 'epochs':
    return -(-int(rounds) // sampling.rounds_per_epoch)
  return int(rounds)


def skellam_round_rdp(noise_multiplier: float, clip_norm: float, scale: float,
                      dimension: int, sampling: Sampling = None,
                      sampling_rate: float | None = None,
                      orders: Sequence[int] = ORDERS) -> np.ndarray:
  """The RDP of one round of :func:`distributed_skellam` (module docstring).

  ``dimension`` is the padded length ``D``; the noise of the sum is
  ``Sk((z C s)^2)``, on a query of sensitivity ``k Delta``
  (:func:`sensitivity_factor`). ``sampling``: the run's
  :class:`~fedjx.algorithms.privacy.accounting.Sampling` (``'poisson'``: rate ``q``;
  ``'uniform'``: ``m / N``; ``'epochs'``: no amplification), or a sampler
  name with ``sampling_rate``: ``'poisson'`` (add-or-remove, ``q``),
  ``'uniform'`` (replace-one, ``m / N``) or None (replace-one, no
  amplification).
  """
  if isinstance(sampling, accounting.Sampling):
    name, rate = sampling.name, sampling.rate
  else:
    name, rate = sampling, sampling_rate
  l2, l1 = skellam_sensitivity(clip_norm, scale, dimension)
  factor = sensitivity_factor(sampling)
  mu = (noise_multiplier * clip_norm * scale) ** 2
  rdp = skellam_rdp(orders, factor * l2, factor * l1, mu)
  if name == 'poisson':
    return poisson_subsampled_rdp(rdp, rate, orders)
  if name == 'uniform':
    return without_replacement_rdp(rdp, rate, orders)
  return rdp


def skellam_epsilon(noise_multiplier: float, clip_norm: float, scale: float,
                    dimension: int, rounds: int, delta: float,
                    sampling: Sampling = None,
                    sampling_rate: float | None = None) -> float:
  """Epsilon at ``delta`` after ``rounds`` rounds of :func:`distributed_skellam`.

  ``compositions(sampling, rounds)`` times the round's RDP
  (:func:`skellam_round_rdp`), converted at ``delta``.
  """
  _check_accounting('skellam_epsilon', sampling, sampling_rate, delta)
  if rounds == 0:
    return 0.0
  return rdp_to_epsilon(compositions(sampling, rounds) * skellam_round_rdp(
      noise_multiplier, clip_norm, scale, dimension, sampling, sampling_rate),
      delta)


def local_gaussian_epsilon(noise_multiplier: float, participations: int,
                           delta: float) -> float:
  """A client's local-DP epsilon after sending ``participations`` reports.

  Each report is ``clip(Delta) + N(0, (zC)^2 I)``: a Gaussian mechanism of
  sensitivity ``2C`` (noise multiplier ``z / 2``), composed with
  ``dp_accounting``'s RDP accountant.
  """
  base.check_number('local_gaussian_epsilon', 'noise_multiplier',
                    noise_multiplier, strict=True)
  base.check_number('local_gaussian_epsilon', 'delta', delta, strict=True,
                    high=1.0)
  if participations == 0:
    return 0.0
  import dp_accounting  # deferred: heavy (0.7 s with SciPy), used here only
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier / 2),
              int(participations))
  return float(acc.get_epsilon(delta))


# ------------------------------------------------------------ aggregators

class DistributedDPState(NamedTuple):
  """The secure sum's state, with the RDP spent so far (float32 ``[orders]``),
  that of one round, and the rounds run (int32)."""

  secure: secure_aggregation.SecureSumState
  rdp: jax.Array
  round_rdp: jax.Array
  rounds: jax.Array


# The largest Poisson rate drawn at once: JAX's float32 sampler inflates the
# variance beyond it (by 2% at 1e6, 19% at 1e8; exact to sampling error at 1e5).
MAX_POISSON_RATE = 1e5


def poisson(key: jax.Array, rate: float, n: int) -> jax.Array:
  """``[n]`` int32 ``Poisson(rate)`` draws, as sums of ``r`` draws of rate
  ``rate / r <= MAX_POISSON_RATE`` (Poisson variables add up exactly)."""
  r = max(1, math.ceil(rate / MAX_POISSON_RATE))
  draws = jax.random.poisson(key, rate / r, (r, n), jnp.int32)
  return jnp.sum(draws, axis=0, dtype=jnp.int32)


def skellam_noise(key: jax.Array, n: int, variance: float) -> jax.Array:
  """``[n]`` int32 draws of ``Sk(variance)``: ``Poisson(v/2) - Poisson(v/2)``."""
  if variance == 0:
    return jnp.zeros((n,), jnp.int32)
  k1, k2 = jax.random.split(key)
  return poisson(k1, variance / 2, n) - poisson(k2, variance / 2, n)


def default_scale(bits: int, clip_norm: float, noise_multiplier: float,
                  clients_per_round: int, noise_clients: int, dimension: int,
                  k_stddevs: float) -> float:
  """``s = m / (2 k C sqrt(n / D + (n / n_min) z^2))`` (module docstring)."""
  n = clients_per_round
  spread = math.sqrt(n / dimension + (n / noise_clients) * noise_multiplier ** 2)
  return 2 ** bits / (2 * k_stddevs * clip_norm * spread)


DISTRIBUTED_SKELLAM = Privacy(
    'distributed_skellam', 'distributed DP',
    reported="the round's ddp_epsilon metric", run_sampling=True)
""":func:`distributed_skellam`'s mechanism: it accounts for itself, for
the run's sampling, which the runner gives it."""

LOCAL_GAUSSIAN = Privacy(
    'local_gaussian', 'local DP',
    reported='per client: distributed_dp.local_gaussian_epsilon')
""":func:`local_gaussian`'s mechanism: each client's epsilon depends on its
participations (:func:`local_gaussian_epsilon`)."""


@traits_lib.declare(Traits(checks_update=True, wire_bits=True,
                           privacy=DISTRIBUTED_SKELLAM))
def distributed_skellam(clip_norm: float = 1.0, noise_multiplier: float = 1.0,
                        bits: int = 16, clients_per_round: int = 10,
                        threshold: int = 2, neighbors: int | None = None,
                        k_stddevs: float = 3.0, scale: float | None = None,
                        expected_clients_per_round: float | None = None,
                        sampling: Sampling = None,
                        sampling_rate: float | None = None,
                        delta: float = 1e-5, seed: int = 0) -> aggregators.Aggregator:
  """Distributed DP: Skellam noise from every client inside a secure sum.

  Args:
    clip_norm: ``C``.
    noise_multiplier: ``z``, the sum's noise standard deviation over ``C``.
    bits: the secure sum's modulus ``m = 2^bits``.
    clients_per_round: ``n``, the cohort size the scale is chosen for.
    threshold, neighbors: the secure sum's SecAgg+ options; the noise is
      split over ``n_min = threshold + 1`` clients.
    k_stddevs: standard deviations of the sum kept inside the modulus.
    scale: ``s`` (None: :func:`default_scale`).
    expected_clients_per_round: divide the sum by it (else by the survivors).
    sampling: the cohorts' sampling ``ddp_epsilon`` is accounted for: the
      run's :class:`fedjx.algorithms.privacy.accounting.Sampling` (the runner
      passes it), or a sampler name (``'poisson'``, ``'uniform'``, None)
      with ``sampling_rate`` (module docstring).
    sampling_rate: ``q`` or ``m / N``, with a sampler name only.
    delta: the delta of ``ddp_epsilon``.
    seed: the first round's shared seed.

  Metrics: those of the secure sum, ``ddp_epsilon`` (rounds so far),
  ``ddp_scale``, ``ddp_noise_stddev`` (``sqrt(mu)`` in integer units) and
  ``ddp_l2_sensitivity`` (``Delta_2``).
  """
  fn = 'distributed_skellam'
  base.check_number(fn, 'noise_multiplier', noise_multiplier)
  base.check_number(fn, 'k_stddevs', k_stddevs, strict=True)
  base.check_positive_int(fn, 'clients_per_round', clients_per_round)
  if scale is not None:
    base.check_number(fn, 'scale', scale, strict=True)
  _check_accounting(fn, sampling, sampling_rate, delta)
  noise_clients = threshold + 1

  def scale_of(cohort_size, length):
    del cohort_size
    if scale is not None:
      return scale
    return default_scale(bits, clip_norm, noise_multiplier, clients_per_round,
                         noise_clients, length, k_stddevs)

  def noise(key, length):
    s = scale_of(None, length)
    return skellam_noise(key, length,
                         (noise_multiplier * clip_norm * s) ** 2 / noise_clients)

  def extra(cohort_size, length):
    s = scale_of(cohort_size, length)
    return {'ddp_scale': s,
            'ddp_noise_stddev': noise_multiplier * clip_norm * s,
            'ddp_l2_sensitivity': skellam_sensitivity(clip_norm, s, length)[0]}

  inner = secure_aggregation.modular_sum(
      fn, bits=bits, clip_norm=clip_norm, threshold=threshold,
      neighbors=neighbors, rotation=True, seed=seed, scale=scale_of,
      expected_clients_per_round=expected_clients_per_round, noise=noise,
      extra_metrics=extra)
  orders = np.asarray(ORDERS, np.float64)

  def init(params):
    secure = inner.init(params)
    d = compression._structure(secure.template)[0]  # pylint: disable=protected-access
    length = compression.next_power_of_two(d)
    per_round = skellam_round_rdp(noise_multiplier, clip_norm,
                                  scale_of(None, length), length, sampling,
                                  sampling_rate)
    return DistributedDPState(secure, jnp.zeros(len(ORDERS), jnp.float32),
                              jnp.asarray(per_round, jnp.float32),
                              jnp.zeros((), jnp.int32))

  def counted(state, metrics):
    # Whether this round's RDP adds to the client's: a released sum, or, in
    # shuffled epochs, the epoch's first round (each client enters one round
    # of an epoch, whichever; counting it first is counting it once).
    if isinstance(sampling, accounting.Sampling) and sampling.name == 'epochs':
      first = state.rounds % sampling.rounds_per_epoch == 0
      return first.astype(jnp.float32)
    return 1.0 - metrics['secagg_failed']

  def combine(state, hparams, clients, key):
    mean, secure, metrics = inner.combine(state.secure, hparams, clients, key)
    rdp = state.rdp + counted(state, metrics) * state.round_rdp
    a = jnp.asarray(orders, jnp.float32)
    eps = jnp.min(rdp + jnp.log((a - 1) / a) - (math.log(delta) + jnp.log(a)) / (a - 1))
    metrics = dict(metrics, ddp_epsilon=jnp.maximum(eps, 0.0))
    return mean, DistributedDPState(secure, rdp, state.round_rdp,
                                    state.rounds + 1), metrics

  return inner._replace(
      init=init, combine=combine,
      broadcast=lambda state: inner.broadcast(state.secure),
      client_inputs=lambda state, ids, c: inner.client_inputs(state.secure, ids, c),
      traits=inner.traits._replace(privacy=DISTRIBUTED_SKELLAM._replace(
          noise_multiplier=noise_multiplier,
          expected_clients_per_round=expected_clients_per_round)))


@traits_lib.declare(Traits(checks_update=True, privacy=LOCAL_GAUSSIAN))
def local_gaussian(clip_norm: float = 1.0, noise_multiplier: float = 1.0,
                   seed: int = 0) -> aggregators.Aggregator:
  """Local DP: each client sends ``clip_C(Delta_i) + N(0, (z C)^2 I)``.

  The server takes the mean over the clients with data (weight 1 each).
  Metrics: ``local_epsilon_per_report`` is not computed in the round (it
  depends on the client's participations): use
  :func:`local_gaussian_epsilon`; ``noise_std`` is ``z C``. ``clip_norm``
  and ``noise_multiplier`` are traced (``state.hparams``).
  """
  fn = 'local_gaussian'
  aggregators.check_dp_options(fn, noise_multiplier, None, clip_norm=clip_norm)
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f'{fn}: seed={seed!r} must be an int.')

  def init(params):
    del params
    return jax.random.PRNGKey(seed)

  def weights(num_examples):
    return base.aggregation_weights(num_examples, 'uniform')

  def client_inputs(state, client_ids, cohort_size):
    del client_ids
    return {'client_key': compression.client_keys(state, cohort_size)}

  def encode(hp, update, w):
    clipped, norm = aggregators.clip_update(update, hp['clip_norm'])
    noisy = aggregators.add_gaussian_noise(
        clipped, hp['noise_multiplier'] * hp['clip_norm'], hp['client_key'])
    return jax.tree.map(lambda u: u * w.astype(u.dtype), noisy), norm

  def combine(state, hp, clients, key):
    count = aggregators.participants(clients)
    total = fedjx.reduce_sum(clients.update)
    mean = jax.tree.map(lambda t: t / jnp.maximum(count, 1.0).astype(t.dtype), total)
    metrics = {'noise_std': hp['noise_multiplier'] * hp['clip_norm'],
               'mean_update_norm': fedjx.reduce_sum(clients.weights * clients.encoded)
                                   / jnp.maximum(count, 1.0)}
    return mean, jax.random.fold_in(compression._raw_key(key), 7), metrics  # pylint: disable=protected-access

  return aggregators.Aggregator(
      init=init, combine=combine, encode=encode, weights=weights,
      hparams={'clip_norm': clip_norm, 'noise_multiplier': noise_multiplier},
      client_inputs=client_inputs,
      traits=local_gaussian.traits._replace(
          privacy=LOCAL_GAUSSIAN._replace(noise_multiplier=noise_multiplier)))


__all__ = ['DistributedDPState', 'compositions', 'default_scale',
           'distributed_skellam', 'sensitivity_factor',
           'local_gaussian', 'local_gaussian_epsilon', 'poisson_subsampled_rdp',
           'rdp_to_epsilon', 'skellam_epsilon', 'skellam_noise', 'skellam_rdp',
           'skellam_round_rdp', 'skellam_sensitivity', 'without_replacement_rdp']
