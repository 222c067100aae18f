"""Empirical privacy of a DP run from canary clients, in the same run.

Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical
Privacy Estimation for Federated Learning", ICLR 2024 (arXiv 2302.03098),
with the one-run bound of Steinke, Nasr, Jagielski, "Privacy Auditing with
One (1) Training Run", NeurIPS 2023 (arXiv 2305.08846).

**Canaries.** ``m`` canary clients ``i`` each hold a random direction
``u_i`` (a standard normal over all the model's parameters, scaled to unit
norm) and a secret sign ``S_i``, +1 or -1 with probability 1/2 each. Each
round every canary slot takes part as a real client of the run's sampler
would (:func:`participation`), and a participating canary sends the
clipped update ``S_i C u_i`` (design ``'swap'``) or, with ``S_i = +1``
only, ``C u_i`` (design ``'insert'``: canaries with ``S_i = -1`` are held
out). Their sum joins the clipped sum before the noise
(:func:`with_canaries`). The design follows the sampler's neighbouring
relation, so that changing one ``S_i`` is a pair of neighbouring runs the
accountant's epsilon covers:

| sampler | relation | design | changing ``S_i`` |
|---|---|---|---|
| Poisson | add or remove one | insert | canary ``i`` added or removed |
| shuffled epochs | zero out | insert | canary ``i``'s update against zero |
| fixed size (``uniform``) | replace one | swap | ``C u_i`` replaced by ``-C u_i`` |

With fixed-size cohorts the canaries are themselves drawn as a fixed-size
cohort each round, the same fraction ``m_c / N`` of the ``m`` slots as of
the real clients (``m m_c / N`` must be a whole number), so that
``dp_accounting``'s bound for sampling without replacement, which depends
on that fraction only, covers them as it covers the real clients.

**Estimates** (:func:`audit`), from the cosines ``t_i`` between the run's
total model change ``x_0 - x_R`` and the ``u_i``:

* Andrew et al.: the estimate is the epsilon at the run's ``delta``
  between two Gaussians (:func:`epsilon_between_gaussians`), the epsilon
  of a mechanism whose outputs on the two neighbouring inputs were those
  Gaussians: for ``'insert'``, the held-out canaries' distribution, known
  exactly (a direction the model never saw has cosine of mean 0 and
  variance ``1 / d``; their Section 4), and the Gaussian fitted to the
  inserted canaries' cosines; for ``'swap'``, the Gaussians fitted to the
  ``-u`` and ``+u`` canaries with their pooled standard deviation (the two
  groups are mirror images). An estimate, not a bound; its interval is a
  bootstrap over the canaries. Where the number of rounds a canary is in
  varies (Poisson sampling) the inserted cosines are a mixture whose
  fitted Gaussian is wider than the null, which at small ``delta`` can
  make the estimate overstate the privacy loss.
* Steinke et al.: an auditor guesses ``S_i = +1`` for the ``k`` highest
  cosines; if the run is ``(epsilon, delta)``-DP for each canary, the number
  of correct guesses is at most a ``Binomial(k, e^epsilon / (1 +
  e^epsilon))`` plus a ``delta`` term (their Theorem 3.3, here
  :func:`one_run_p_value`), so a count too large for it refutes
  ``epsilon``: with probability at least ``confidence`` the run is not
  ``(epsilon, delta)``-DP for any ``epsilon`` below
  :func:`one_run_lower_bound`. A bound, and loose: with ``m`` canaries it
  cannot exceed about ``log(m)``.

The real clients' guarantee is unchanged: the canaries' updates do not
depend on any real client's data. The cost is ``q m / 2`` (insert) or ``q
m`` (swap) extra clipped updates a round, random directions the model also
learns (bounded like any client's), and, with a fixed denominator, a bias
of those over ``D`` in the aggregate. Canaries are not clients of the
cohort: they do not train, and no client metric (``clients``,
``train_loss``, ``clipped_fraction``, ...) counts them; ``canary_clients``
is the number a round inserted. Adaptive clipping's unclipped count does
not see them: the audit probes the update query, whose noise ``z_Delta``
is above the total ``z``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjx.algorithms.privacy import accounting
from fedjx.algorithms import base
from fedjx.algorithms import nonfinite

if TYPE_CHECKING:  # The DP aggregators build on this module.
  from fedjx.algorithms.aggregators import core as aggregators

DESIGNS = ('insert', 'swap')
# The design of each neighbouring relation (module docstring).
DESIGN_OF_RELATION = {'add_or_remove_one': 'insert', 'zero_out': 'insert',
                      'replace_one': 'swap'}
# Streams of the canaries' randomness, folded into their key.
_DIRECTIONS, _PARTICIPATION, _SIGNS = 0, 1, 0x5349474E
# How many guesses the one-run auditor tries, as fractions of the canaries
# (a Bonferroni correction over them).
GUESS_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)


@dataclasses.dataclass(frozen=True)
class Canaries:
  """The canary clients of a run (module docstring).

  Attributes:
    count: ``m >= 2`` canary slots.
    sampling: the run's :class:`fedjx.algorithms.privacy.accounting.Sampling`, by
      which each slot takes part.
    seed: the seed of their directions, signs and participation.
    design: ``'insert'`` or ``'swap'``; None chooses the sampler's
      (:data:`DESIGN_OF_RELATION`).
  """

  count: int
  sampling: accounting.Sampling
  seed: int = 0
  design: str | None = None

  def __post_init__(self):
    fn = 'Canaries'
    if isinstance(self.count, bool) or not isinstance(
        self.count, (int, np.integer)) or self.count < 2:
      raise ValueError(f'{fn}: count={self.count!r}; it must be an int >= 2.')
    if not isinstance(self.sampling, accounting.Sampling):
      raise ValueError(f'{fn}: sampling={self.sampling!r} is not an '
                       'accounting.Sampling.')
    if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
      raise ValueError(f'{fn}: seed={self.seed!r}; it must be an int.')
    relation = accounting.RELATION_OF_SAMPLING[self.sampling.name]
    if self.design is None:
      object.__setattr__(self, 'design', DESIGN_OF_RELATION[relation])
    if self.design not in DESIGNS:
      raise ValueError(f'{fn}: design={self.design!r} is not one of {DESIGNS}.')
    if self.sampling.name == 'uniform':
      n, c = self.sampling.population, int(self.sampling.cohort_size)
      step = n // math.gcd(n, c)
      if self.count % step:
        raise ValueError(
            f'{fn}: count={self.count} with {c} of {n} clients per round: each '
            f'round draws the same fraction {c}/{n} of the canaries, so count '
            f'must be a multiple of {step}.')

  @property
  def relation(self) -> str:
    """The sampler's neighbouring relation."""
    return accounting.RELATION_OF_SAMPLING[self.sampling.name]

  def signs(self) -> np.ndarray:
    """``int8 [m]``: the secret ``S_i``, each +1 or -1 with probability 1/2."""
    rng = np.random.default_rng([self.seed, _SIGNS])
    return rng.choice(np.array([-1, 1], np.int8), size=self.count)

  def coefficients(self) -> np.ndarray:
    """``float32 [m]``: what a participating slot sends, in units of ``C u_i``."""
    s = self.signs().astype(np.float32)
    return s if self.design == 'swap' else (s > 0).astype(np.float32)

  @property
  def per_round(self) -> float:
    """The expected number of canaries a round inserts (the audit's cost)."""
    # Every sampler takes a client (and a slot) in a round with probability
    # q = cohort_size / N (shuffled epochs: E m_c / N an epoch, over E rounds).
    return self.sampling.rate * float(np.sum(np.abs(self.coefficients())))

  def describe(self) -> str:
    what = ('each inserted (S = +1) or held out (S = -1)'
            if self.design == 'insert' else 'each sending +C u or -C u (S = +1 or -1)')
    return (f'{self.count} canary clients, {what}, taking part as the real '
            f'clients of {self.sampling.name!r} sampling do: about '
            f'{self.per_round:.3g} extra clipped updates a round')


def _key(seed: int, stream: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), stream)


def flat_direction(seed: int, index: jax.Array, size: int) -> jax.Array:
  """``u_index`` flattened: ``float32 [size]`` standard normal, unit norm."""
  key = jax.random.fold_in(_key(seed, _DIRECTIONS), index)
  raw = jax.random.normal(key, (size,), jnp.float32)
  return raw / jnp.sqrt(jnp.sum(jnp.square(raw)))


def direction(seed: int, index: jax.Array, like: base.PyTree) -> base.PyTree:
  """``u_index`` shaped as ``like``: :func:`flat_direction` cut into its leaves.

  One normal draw over all the parameters (in the order of
  ``jax.tree.leaves(like)``), scaled to unit global norm.
  """
  leaves, treedef = jax.tree.flatten(like)
  sizes = [math.prod(x.shape) for x in leaves]
  flat = flat_direction(seed, index, sum(sizes))
  parts = jnp.split(flat, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [flat]
  return jax.tree.unflatten(treedef, [
      p.reshape(x.shape).astype(x.dtype) for p, x in zip(parts, leaves)])


def participation(canaries: Canaries, round_index: jax.Array) -> jax.Array:
  """``float32 [m]``: 1 for the slots that take part in round ``round_index``.

  * Poisson: each slot with probability ``q``, independently each round.
  * fixed size: ``q m`` of the ``m`` slots, without replacement, each round.
  * shuffled epochs of ``E`` rounds of ``m_c`` of ``N``: each epoch a slot
    draws a place uniformly among the ``N`` of the epoch's permutation, and
    takes part in round ``place // m_c`` of the epoch if ``place < E m_c``,
    as a real client does (so at most once an epoch).
  """
  s, m = canaries.sampling, canaries.count
  round_index = jnp.asarray(round_index, jnp.int32)
  key = _key(canaries.seed, _PARTICIPATION)
  if s.name == 'poisson':
    return jax.random.bernoulli(jax.random.fold_in(key, round_index), s.rate,
                                (m,)).astype(jnp.float32)
  if s.name == 'uniform':
    k = m * int(s.cohort_size) // s.population
    chosen = jax.random.permutation(jax.random.fold_in(key, round_index), m)[:k]
    return jnp.zeros((m,), jnp.float32).at[chosen].set(1.0)
  size, epoch = int(s.cohort_size), s.rounds_per_epoch
  place = jax.random.randint(jax.random.fold_in(key, round_index // epoch),
                             (m,), 0, s.population)
  taking = (place < epoch * size) & (place // size == round_index % epoch)
  return taking.astype(jnp.float32)


def canary_sum(canaries: Canaries, round_index: jax.Array, clip_norm: jax.Array,
               like: base.PyTree) -> tuple[base.PyTree, jax.Array]:
  """The canaries' clipped updates of a round, summed, and how many were sent.

  ``sum_i p_i c_i C u_i`` with ``p_i`` the slot's :func:`participation` and
  ``c_i`` its :meth:`Canaries.coefficients`; directions are drawn only for
  the slots that send one.
  """
  weights = participation(canaries, round_index) * jnp.asarray(
      canaries.coefficients())
  clip = jnp.asarray(clip_norm, jnp.float32)

  def add(j, total):
    def one(total):
      u = direction(canaries.seed, j, like)
      w = (weights[j] * clip)
      return jax.tree.map(lambda t, v: t + w.astype(t.dtype) * v, total, u)
    return jax.lax.cond(weights[j] != 0, one, lambda t: t, total)

  zeros = jax.tree.map(jnp.zeros_like, like)
  return (jax.lax.fori_loop(0, canaries.count, add, zeros),
          jnp.sum(jnp.abs(weights)))


class CanaryState(NamedTuple):
  """The state of an aggregator with canaries.

  Attributes:
    inner: the wrapped aggregator's state.
    round: rounds aggregated so far (the next round's index).
  """

  inner: Any
  round: jax.Array


def with_canaries(aggregator: aggregators.Aggregator, canaries: Canaries, *,
                  clip_norm: Callable[[Any, Mapping[str, jax.Array]], jax.Array],
                  expected_clients_per_round: float | None
                  ) -> aggregators.Aggregator:
  """``aggregator`` whose clipped sum also holds the canaries' updates.

  The DP aggregators release ``(sum_i m_i + N) / D``; with the round's
  canary sum ``K`` (:func:`canary_sum`) this is ``(sum_i m_i + K + N) / D``,
  computed as ``aggregate + K / D`` (the release is linear in the sum and
  the noise does not depend on it; for DP-FTRL ``K`` enters the round's leaf
  of the tree). With ``expected_clients_per_round=None`` the canaries count
  in ``D`` as clients would: ``(aggregate n + K) / (n + k)``.

  Args:
    aggregator: a DP aggregator (``gaussian``, ``adaptive_gaussian``,
      ``tree_gaussian``).
    canaries: the run's :class:`Canaries`.
    clip_norm: ``clip_norm(state, hparams)``, the round's clip norm ``C``
      from the aggregator's state and hyperparameters (read before its
      combine: the ``C`` its clients clipped to).
    expected_clients_per_round: the aggregator's fixed ``D``, or None.
  """
  if not isinstance(canaries, Canaries):
    raise ValueError(f'with_canaries: canaries={canaries!r} is not a '
                     'privacy_audit.Canaries.')

  def init(params):
    return CanaryState(aggregator.init(params), jnp.zeros((), jnp.int32))

  def combine(state, hparams, clients, key):
    clip = clip_norm(state.inner, hparams)
    aggregate, inner, metrics = aggregator.combine(state.inner, hparams,
                                                   clients, key)
    extra, sent = canary_sum(canaries, state.round, clip, aggregate)
    if expected_clients_per_round is None:
      count = nonfinite.participants(clients)
      old = jnp.maximum(count, 1.0)  # The mean's denominator without a fixed D.
      new = jnp.maximum(count + sent, 1.0)
      aggregate = jax.tree.map(
          lambda a, e: (a * old.astype(a.dtype) + e) / new.astype(a.dtype),
          aggregate, extra)
    else:
      d = jnp.float32(expected_clients_per_round)
      aggregate = jax.tree.map(lambda a, e: a + e / d.astype(a.dtype),
                               aggregate, extra)
    metrics = dict(metrics, canary_clients=sent)
    return aggregate, CanaryState(inner, state.round + 1), metrics

  broadcast = None if aggregator.broadcast is None else (
      lambda state: aggregator.broadcast(state.inner))
  return aggregator._replace(init=init, combine=combine, broadcast=broadcast)


@jax.jit
def _flat_difference(first: base.PyTree, last: base.PyTree) -> jax.Array:
  return jnp.concatenate([jnp.ravel(a - b).astype(jnp.float32) for a, b in zip(
      jax.tree.leaves(first), jax.tree.leaves(last))])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _inner_products(seed: int, count: int, change: jax.Array) -> jax.Array:
  return jax.lax.map(
      lambda j: jnp.vdot(flat_direction(seed, j, change.size), change),
      jnp.arange(count))


def cosines(canaries: Canaries, initial_params: base.PyTree,
            final_params: base.PyTree) -> np.ndarray:
  """``float64 [m]``: ``cos(x_0 - x_R, u_i)`` for every canary slot.

  ``x_0 - x_R`` is the sum of the server's steps against its pseudo-gradients
  (for server SGD, the learning rate times the sum of the aggregates, in
  which canary ``i`` sent ``+C u_i``); its leaves are flattened in the order
  :func:`direction` cuts ``u_i`` into.
  """
  change = _flat_difference(initial_params, final_params)
  norm = float(np.linalg.norm(np.asarray(change, np.float64)))
  if norm == 0:
    raise ValueError('cosines: the final model equals the initial one; there '
                     'is no change to compare the canaries with.')
  dots = _inner_products(canaries.seed, canaries.count, change)
  return np.asarray(dots, np.float64) / norm


# ------------------------------------------------------------ the estimators

def _log_mass(mean: float, std: float, low: float, high: float) -> float:
  """``log P[low < X < high]`` for ``X ~ N(mean, std^2)``, stable in the tails."""
  from scipy import special  # deferred: SciPy is heavy, used by the audit's analysis only
  a, b = (low - mean) / std, (high - mean) / std
  if a >= b:
    return -math.inf
  if a > 0:  # Both in the upper tail: P[X > a] - P[X > b], in logs.
    la, lb = special.log_ndtr(-a), special.log_ndtr(-b)
  else:
    la, lb = special.log_ndtr(b), special.log_ndtr(a)
  if lb == -math.inf:
    return float(la)
  return float(la + np.log1p(-np.exp(min(lb - la, 0.0))))


def _log_region_mass(mean: float, std: float, region: list[tuple[float, float]]) -> float:
  from scipy import special  # deferred: SciPy is heavy, used by the audit's analysis only
  return float(special.logsumexp([_log_mass(mean, std, lo, hi) for lo, hi in region])
               if region else -math.inf)


def log_hockey_stick(mu_p: float, std_p: float, mu_q: float, std_q: float,
                     epsilon: float) -> float:
  """``log sup_A (P(A) - e^epsilon Q(A))`` for ``P = N(mu_p, std_p^2)``, ``Q = N(mu_q, std_q^2)``.

  The supremum is reached on ``A = {x : log p(x) - log q(x) > epsilon}``;
  the log-ratio is the quadratic ``a x^2 + b x + c``, so ``A`` is a
  half-line (equal variances), the outside of its roots (``a > 0``) or the
  inside (``a < 0``). ``-inf`` when the value is 0.
  """
  a = 0.5 / std_q**2 - 0.5 / std_p**2
  b = mu_p / std_p**2 - mu_q / std_q**2
  c = 0.5 * (mu_q / std_q) ** 2 - 0.5 * (mu_p / std_p) ** 2 + math.log(std_q / std_p)
  c -= epsilon
  inf = math.inf
  if a == 0:
    if b == 0:
      return -inf if c <= 0 else 0.0
    root = -c / b
    region = [(root, inf)] if b > 0 else [(-inf, root)]
  else:
    disc = b * b - 4 * a * c
    if disc <= 0:
      region = [(-inf, inf)] if a > 0 else []
    else:
      r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a),
                       (-b + math.sqrt(disc)) / (2 * a)))
      region = [(-inf, r1), (r2, inf)] if a > 0 else [(r1, r2)]
  log_p = _log_region_mass(mu_p, std_p, region)
  log_q = _log_region_mass(mu_q, std_q, region)
  if log_p == -inf:
    return -inf
  gap = epsilon + log_q - log_p
  if gap >= 0:
    return -inf
  return log_p + float(np.log1p(-np.exp(gap)))


def epsilon_between_gaussians(mu0: float, std0: float, mu1: float, std1: float,
                              delta: float) -> float:
  """The smallest ``epsilon >= 0`` for which the two Gaussians are ``(epsilon, delta)``-close.

  That is, ``max(H(P || Q), H(Q || P)) <= delta`` for ``P = N(mu0, std0^2)``
  and ``Q = N(mu1, std1^2)``, ``H`` the hockey-stick divergence
  (:func:`log_hockey_stick`), decreasing in ``epsilon``; found with
  ``scipy.optimize.brentq``. For equal variances it is the Gaussian
  mechanism's epsilon at noise multiplier ``std / |mu1 - mu0|`` (Balle and
  Wang 2018). ``inf`` when a standard deviation is 0 and the means differ.
  """
  from scipy import optimize  # deferred: SciPy is heavy, used by the audit's analysis only
  for name, v in (('std0', std0), ('std1', std1)):
    if not v >= 0:
      raise ValueError(f'epsilon_between_gaussians: {name}={v!r}; it must be >= 0.')
  if not 0 < delta < 1:
    raise ValueError(f'epsilon_between_gaussians: delta={delta!r}; it must be in (0, 1).')
  if std0 == 0 or std1 == 0:
    return 0.0 if (mu0 == mu1 and std0 == std1) else math.inf
  log_delta = math.log(delta)

  def excess(eps):
    return max(log_hockey_stick(mu0, std0, mu1, std1, eps),
               log_hockey_stick(mu1, std1, mu0, std0, eps)) - log_delta

  if excess(0.0) <= 0:
    return 0.0
  high = 1.0
  while excess(high) > 0:
    high *= 2
    if high > 1e6:
      return math.inf
  return float(optimize.brentq(excess, high / 2 if high > 1 else 0.0, high,
                               xtol=1e-10, rtol=1e-10))


def gaussian_fit_estimate(first: np.ndarray, second: np.ndarray, delta: float,
                          *, null_std: float | None = None,
                          confidence: float = 0.95, resamples: int = 1000,
                          seed: int = 0) -> dict[str, Any]:
  """Andrew et al.'s estimate: the epsilon between Gaussians fitted to two groups.

  ``second`` holds the statistics of the canaries whose sign is +1 (inserted,
  or sending ``+C u``), ``first`` those of sign -1. The estimate is
  :func:`epsilon_between_gaussians` at ``delta`` of

  * ``N(0, null_std^2)`` and the Gaussian fitted to ``second`` (mean and
    standard deviation), when the first group's distribution is known
    (``null_std``: held-out canaries, whose cosine with a model that never
    saw them has mean 0 and variance ``1 / d`` exactly; Andrew et al.,
    Section 4); ``first`` is then only reported, as a check;
  * else the two fitted means with their pooled standard deviation (the
    ``'swap'`` design, whose two groups are mirror images).

  ``interval`` is the ``confidence`` percentile interval of the estimate
  over ``resamples`` bootstrap resamples of the fitted group(s)
  (``scipy.stats.bootstrap``); ``(estimate, estimate)`` with 0 resamples.
  """
  from scipy import stats  # deferred: heavy (0.7 s), used by the audit's analysis only
  first, second = np.asarray(first, np.float64), np.asarray(second, np.float64)
  if second.size < 2 or (null_std is None and first.size < 2):
    raise ValueError(f'gaussian_fit_estimate: {first.size} and {second.size} '
                     'canaries in the two groups; each fitted group needs at '
                     'least 2.')
  if null_std is not None and not null_std > 0:
    raise ValueError(f'gaussian_fit_estimate: null_std={null_std!r}; it must '
                     'be > 0 or None.')

  if null_std is not None:
    def estimate(ins):
      return epsilon_between_gaussians(0.0, null_std, np.mean(ins),
                                       np.std(ins, ddof=1), delta)
    samples = (second,)
  else:
    def estimate(out, ins):
      pooled = math.sqrt(((out.size - 1) * np.var(out, ddof=1)
                          + (ins.size - 1) * np.var(ins, ddof=1))
                         / (out.size + ins.size - 2))
      return epsilon_between_gaussians(np.mean(out), pooled, np.mean(ins),
                                       pooled, delta)
    samples = (first, second)
  point = estimate(*samples)
  interval = (point, point)
  if resamples and math.isfinite(point):
    boot = stats.bootstrap(samples, estimate, vectorized=False, paired=False,
                           n_resamples=resamples, confidence_level=confidence,
                           method='percentile',
                           random_state=np.random.default_rng(seed))
    interval = (float(boot.confidence_interval.low),
                float(boot.confidence_interval.high))
  fit = lambda x: ((float(np.mean(x)), float(np.std(x, ddof=1)))
                   if x.size >= 2 else (float('nan'), float('nan')))
  return {'epsilon': point, 'interval': interval, 'first': fit(first),
          'second': fit(second), 'null_std': null_std}


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float,
                    delta: float) -> float:
  """Steinke et al.'s p-value of ``correct`` of ``guesses`` under ``(epsilon, delta)``-DP.

  Their Theorem 3.3 (Algorithm 2's test): with ``p = e^epsilon / (1 +
  e^epsilon)`` and ``B ~ Binomial(guesses, p)``,
  ``P[correct guesses >= v] <= P[B >= v] + 2 m delta max_{1 <= i <= v}
  P[v - i <= B < v] / i`` for ``m`` canaries.
  """
  from scipy import special  # deferred: SciPy is heavy, used by the audit's analysis only
  from scipy import stats  # deferred: heavy (0.7 s), used by the audit's analysis only
  if not 0 <= correct <= guesses <= canaries:
    raise ValueError(f'one_run_p_value: correct={correct}, guesses={guesses}, '
                     f'canaries={canaries}; need 0 <= correct <= guesses <= '
                     'canaries.')
  p = special.expit(epsilon)
  tail = stats.binom.sf(correct - 1, guesses, p)  # P[B >= v]
  if delta == 0 or correct == 0:
    return float(min(tail, 1.0))
  i = np.arange(1, correct + 1)
  between = stats.binom.sf(correct - i - 1, guesses, p) - tail  # P[v-i <= B < v]
  return float(min(tail + 2 * canaries * delta * np.max(between / i), 1.0))


def one_run_epsilon(canaries: int, guesses: int, correct: int, delta: float,
                    significance: float) -> float:
  """The largest ``epsilon`` that ``correct`` of ``guesses`` refutes at ``significance``.

  ``sup {epsilon >= 0 : one_run_p_value(...) <= significance}`` (the
  p-value grows with ``epsilon``), or 0 when even ``epsilon = 0`` is not
  refuted.
  """
  from scipy import optimize  # deferred: SciPy is heavy, used by the audit's analysis only
  value = lambda eps: one_run_p_value(canaries, guesses, correct, eps, delta)
  if guesses == 0 or value(0.0) > significance:
    return 0.0
  high = 1.0
  while value(high) <= significance:
    high *= 2
    if high > 1e4:
      return math.inf
  return float(optimize.brentq(lambda e: value(e) - significance,
                               high / 2 if high > 1 else 0.0, high, xtol=1e-9))


def one_run_lower_bound(scores: np.ndarray, signs: np.ndarray, delta: float,
                        confidence: float = 0.95,
                        fractions: tuple[float, ...] = GUESS_FRACTIONS
                        ) -> dict[str, Any]:
  """Steinke et al.'s lower bound on epsilon from one run's canaries.

  For each ``k`` in ``fractions`` of the ``m`` canaries (at least 1), the
  auditor guesses ``S_i = +1`` for the ``k`` highest scores and abstains on
  the others; the bound is the largest :func:`one_run_epsilon` over those
  ``k`` at significance ``(1 - confidence) / len(fractions)`` (Bonferroni),
  so it holds with probability at least ``confidence``.
  """
  scores, signs = np.asarray(scores, np.float64), np.asarray(signs)
  m = scores.size
  if signs.shape != scores.shape:
    raise ValueError(f'one_run_lower_bound: {signs.size} signs for {m} scores.')
  order = np.argsort(-scores, kind='stable')
  significance = (1 - confidence) / len(fractions)
  best = {'epsilon': 0.0, 'guesses': 0, 'correct': 0}
  for f in fractions:
    k = max(1, int(round(f * m)))
    correct = int(np.sum(signs[order[:k]] > 0))
    eps = one_run_epsilon(m, k, correct, delta, significance)
    if eps > best['epsilon']:
      best = {'epsilon': eps, 'guesses': k, 'correct': correct}
  return best


def audit(canaries: Canaries, cosine: np.ndarray, delta: float,
          dimension: int, confidence: float = 0.95,
          accountant_epsilon: float | None = None,
          resamples: int = 1000) -> dict[str, Any]:
  """The audit of a run from its canaries' cosines (``privacy.json``'s ``audit``).

  Args:
    canaries: the run's :class:`Canaries`.
    cosine: ``[m]`` :func:`cosines` of the run.
    delta: the run's delta.
    dimension: ``d``, the number of model parameters (the held-out cosines'
      variance is ``1 / d``).
    confidence: of the estimate's interval and of the one-run bound.
    accountant_epsilon: the accountant's epsilon, recorded beside them.
    resamples: bootstrap resamples of the interval.
  """
  signs = canaries.signs()
  cosine = np.asarray(cosine, np.float64)
  insert = canaries.design == 'insert'
  fit = gaussian_fit_estimate(
      cosine[signs < 0], cosine[signs > 0], delta,
      null_std=dimension ** -0.5 if insert else None, confidence=confidence,
      resamples=resamples, seed=canaries.seed)
  bound = one_run_lower_bound(cosine, signs, delta, confidence)
  low, high = fit['interval']
  lines = [
      f"Andrew et al. 2024 estimate {fit['epsilon']:.4g} (an estimate, not a "
      f'bound; {confidence:.0%} bootstrap interval over the canaries '
      f'[{low:.4g}, {high:.4g}])']
  if bound['epsilon'] > 0:
    lines.append(
        f'Steinke et al. 2023 lower bound {bound["epsilon"]:.4g}: with '
        f'probability >= {confidence:.0%} the run is not (epsilon, '
        f'{delta:.3g})-DP for any epsilon below it ({bound["correct"]} of '
        f'{bound["guesses"]} guesses correct)')
  else:
    lines.append(f'Steinke et al. 2023: no epsilon > 0 refuted at '
                 f'{confidence:.0%} confidence')
  delta_term = 2 * canaries.count * delta
  if delta_term >= 0.1:
    lines[-1] += (f' (its delta term 2 m delta = {delta_term:.3g} is too large '
                  'to refute much: the bound needs delta well below 1 / (2 m))')
  if accountant_epsilon is not None:
    lines.append(f'accountant epsilon {accountant_epsilon:.4g}')
  first, second = ('held_out', 'inserted') if insert else ('minus', 'plus')
  group = lambda name, stat, sign: {
      'mean': stat[0], 'std': stat[1], 'count': int(np.sum(signs == sign))}
  return {
      'method': 'Andrew et al. 2024, one-shot empirical privacy estimation '
                '(final model); Steinke, Nasr, Jagielski 2023, one-run audit',
      'canaries': canaries.count,
      'design': canaries.design,
      'relation': canaries.relation,
      'canaries_detail': canaries.describe(),
      'canaries_per_round': canaries.per_round,
      'seed': canaries.seed,
      'dimension': int(dimension),
      'delta': float(delta),
      'confidence': float(confidence),
      'epsilon_estimate': fit['epsilon'],
      'epsilon_estimate_interval': [low, high],
      'estimate_fit': ('N(0, 1/d) for the held-out canaries (exact), a fitted '
                       'Gaussian for the inserted ones' if insert else
                       'Gaussians fitted to the -u and +u canaries, with '
                       'their pooled standard deviation'),
      f'cosine_{first}': group(first, fit['first'], -1),
      f'cosine_{second}': group(second, fit['second'], 1),
      'epsilon_lower_bound': bound['epsilon'],
      'lower_bound_delta_term': delta_term,
      'lower_bound_guesses': bound['guesses'],
      'lower_bound_correct': bound['correct'],
      'accountant_epsilon': accountant_epsilon,
      'statement': '; '.join(lines) + '.',
  }


__all__ = ['CanaryState', 'Canaries', 'DESIGNS', 'DESIGN_OF_RELATION',
           'GUESS_FRACTIONS', 'audit', 'canary_sum', 'cosines', 'direction',
           'epsilon_between_gaussians', 'gaussian_fit_estimate',
           'log_hockey_stick', 'one_run_epsilon', 'one_run_lower_bound',
           'one_run_p_value', 'participation', 'with_canaries']
