"""Privacy accounting for the DP aggregators, matched to the cohort sampling.

Pure functions on top of ``dp_accounting``. A run is described by its
mechanism, its noise multiplier ``z`` (the noise standard deviation over the
L2 sensitivity ``C`` of one client's contribution), the sampling of its
cohorts and its number of rounds ``R``; :func:`dp_event` gives the
``dp_accounting`` event of the whole run and :func:`epsilon` its epsilon at
``delta``. The unit of privacy is the user (client): neighbouring datasets
differ in all the data of one client.

| mechanism | sampling | event per run | neighbours | accountants |
|---|---|---|---|---|
| ``gaussian`` | ``poisson`` (rate ``q``) | ``R`` x ``PoissonSampled(q, Gaussian(z))`` | add/remove one | rdp, pld |
| ``gaussian`` | ``uniform`` (``C`` of ``N``) | ``R`` x ``SampledWithoutReplacement(N, C, Gaussian(z))`` | replace one | rdp |
| ``gaussian`` | ``epochs`` | ``ceil(R / E)`` x ``Gaussian(z)`` | add/remove one | rdp, pld |
| ``tree`` | ``epochs`` | per epoch ``SingleEpochTreeAggregation(z, trees)`` | replace with zero | rdp |

* ``gaussian`` is the clipped sum plus ``N(0, (zC)^2 I)`` of DP-FedAvg
  (McMahan et al. 2018; aggregator ``gaussian``) and of adaptive clipping
  (Andrew et al. 2021; aggregator ``adaptive_gaussian``), whose
  ``noise_multiplier`` is already the total ``z`` of the update and count
  mechanisms composed (their Theorem 1), so it is accounted the same way.
* ``tree`` is DP-FTRL's tree aggregation (Kairouz et al. 2021, aggregator
  ``tree_gaussian``, node noise ``N(0, (zC)^2 I)``): no amplification; with
  shuffled epochs of ``E`` rounds each client is in at most one leaf of the
  trees of an epoch, provided every tree lies inside one epoch
  (``restart_every`` divides ``E``, or a single tree and ``R <= E``). The RDP
  of such an epoch is ``alpha ceil(log2(T + 1)) / (2 z^2)`` for its longest
  tree of ``T`` rounds (their Appendix D).
* ``epochs`` with ``gaussian``: a client takes part in at most ``ceil(R / E)``
  rounds, each a Gaussian mechanism; the other rounds do not depend on it.
  No amplification by shuffling is claimed.

Combinations not in the table (tree aggregation without a participation
bound; PLD with fixed-size sampling or trees, which ``dp_accounting``'s PLD
accountant does not model) raise ``ValueError`` in one line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

MECHANISMS = ('gaussian', 'tree')
SAMPLINGS = ('poisson', 'uniform', 'epochs')
ACCOUNTANTS = ('rdp', 'pld')


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each round's cohort is drawn from the ``population`` of ``N`` clients.

  Attributes:
    name: ``'poisson'`` (each client with probability ``cohort_size / N``),
      ``'uniform'`` (``cohort_size`` clients without replacement) or
      ``'epochs'`` (shuffled epochs of ``N // cohort_size`` rounds).
    population: ``N``.
    cohort_size: the fixed cohort size, or the expected one ``qN`` for
      Poisson sampling (a float there).
  """

  name: str
  population: int
  cohort_size: float

  def __post_init__(self):
    if self.name not in SAMPLINGS:
      raise ValueError(f'Sampling: name={self.name!r} is not one of {SAMPLINGS}.')
    if isinstance(self.population, bool) or not isinstance(
        self.population, (int, np.integer)) or self.population < 1:
      raise ValueError(f'Sampling: population={self.population!r}; it must '
                       'be an int >= 1 (the number of clients).')
    size = self.cohort_size
    if isinstance(size, bool) or not isinstance(size, (int, float, np.number)) \
        or not 0 < size <= self.population:
      raise ValueError(f'Sampling: cohort_size={size!r}; it must be in (0, '
                       f'{self.population}] (population={self.population}).')
    if self.name != 'poisson' and int(size) != size:
      raise ValueError(f'Sampling: cohort_size={size!r}; {self.name!r} '
                       'sampling draws a whole number of clients.')

  @classmethod
  def poisson(cls, population: int, rate: float) -> 'Sampling':
    """Poisson sampling with rate ``q``: expected cohort ``qN``."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) \
        or not 0 < rate <= 1:
      raise ValueError(f'Sampling.poisson: rate={rate!r}; it must be in (0, 1].')
    return cls('poisson', population, rate * population)

  @property
  def rate(self) -> float:
    """``q = cohort_size / N``."""
    return float(self.cohort_size) / self.population

  @property
  def rounds_per_epoch(self) -> int:
    """``E = N // C`` (shuffled epochs)."""
    return self.population // int(self.cohort_size)

  def describe(self) -> str:
    if self.name == 'poisson':
      return (f'Poisson sampling, each of {self.population} clients with '
              f'probability q={self.rate:.6g} per round (expected cohort '
              f'{self.cohort_size:.6g})')
    if self.name == 'uniform':
      return (f'{int(self.cohort_size)} of {self.population} clients per round, '
              'uniformly without replacement')
    return (f'shuffled epochs of {self.rounds_per_epoch} rounds of '
            f'{int(self.cohort_size)} of {self.population} clients (each client '
            'at most once per epoch)')


def _dp():
  import dp_accounting  # pylint: disable=g-import-not-at-top
  return dp_accounting


def _check(fn: str, mechanism: str, noise_multiplier: float, sampling: Sampling,
           rounds: int, accountant: str | None = None,
           restart_every: int | None = None) -> None:
  if mechanism not in MECHANISMS:
    raise ValueError(f'{fn}: mechanism={mechanism!r} is not one of {MECHANISMS}.')
  if isinstance(noise_multiplier, bool) or not isinstance(
      noise_multiplier, (int, float, np.number)) or not noise_multiplier >= 0:
    raise ValueError(f'{fn}: noise_multiplier={noise_multiplier!r}; it must '
                     'be a number >= 0.')
  if not isinstance(sampling, Sampling):
    raise ValueError(f'{fn}: sampling={sampling!r} is not an '
                     'accounting.Sampling.')
  if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) \
      or rounds < 0:
    raise ValueError(f'{fn}: rounds={rounds!r}; it must be an int >= 0.')
  if accountant is not None and accountant not in ACCOUNTANTS:
    raise ValueError(f'{fn}: accountant={accountant!r} is not one of '
                     f'{ACCOUNTANTS}.')
  if restart_every is not None and (
      isinstance(restart_every, bool) or not isinstance(
          restart_every, (int, np.integer)) or restart_every < 1):
    raise ValueError(f'{fn}: restart_every={restart_every!r}; it must be an '
                     'int >= 1 or None (never restart).')
  check_supported(mechanism, sampling, accountant, rounds, restart_every, fn=fn)


def check_supported(mechanism: str, sampling: Sampling, accountant: str | None,
                    rounds: int, restart_every: int | None = None,
                    fn: str = 'accounting') -> None:
  """Raises ``ValueError`` (one line) when the combination cannot be accounted."""
  if mechanism == 'tree':
    if sampling.name != 'epochs':
      raise ValueError(
          f"{fn}: tree aggregation (DP-FTRL) with {sampling.name!r} sampling "
          'has no bound on how often a client takes part; use '
          "sampling name='epochs' (each client at most once per epoch).")
    epoch = sampling.rounds_per_epoch
    if restart_every is None and rounds > epoch:
      raise ValueError(
          f'{fn}: a tree that is never restarted over rounds={rounds} spans '
          f'more than one epoch of {epoch} rounds, so a client could be in it '
          f'twice; set restart_every to a divisor of {epoch}.')
    if restart_every is not None and epoch % restart_every:
      raise ValueError(
          f'{fn}: restart_every={restart_every} does not divide the epoch of '
          f'{epoch} rounds, so a tree could span two epochs and hold a client '
          f'twice; use a divisor of {epoch}.')
  if accountant == 'pld' and (mechanism == 'tree' or sampling.name == 'uniform'):
    what = ('tree aggregation' if mechanism == 'tree'
            else 'fixed-size sampling without replacement')
    raise ValueError(f"{fn}: accountant='pld' does not model {what} in "
                     "dp_accounting; use accountant='rdp'.")


def neighboring_relation(mechanism: str, sampling: Sampling):
  """The ``dp_accounting.NeighboringRelation`` the event is accounted under."""
  rel = _dp().NeighboringRelation
  if mechanism == 'tree':
    return rel.REPLACE_SPECIAL
  if sampling.name == 'uniform':
    return rel.REPLACE_ONE
  return rel.ADD_OR_REMOVE_ONE


def _tree_epochs(noise_multiplier: float, sampling: Sampling, rounds: int,
                 restart_every: int | None) -> list[tuple[object, int]]:
  """``[(SingleEpochTreeAggregationDpEvent, count)]`` for ``rounds`` rounds."""
  dp = _dp()
  epoch = sampling.rounds_per_epoch
  full, rest = divmod(rounds, epoch)

  def trees(n: int) -> tuple[int, ...]:
    k = n if restart_every is None else restart_every
    return (k,) * (n // k) + ((n % k,) if n % k else ())

  out = []
  if full:
    out.append((dp.SingleEpochTreeAggregationDpEvent(
        noise_multiplier, trees(epoch)), full))
  if rest:
    out.append((dp.SingleEpochTreeAggregationDpEvent(
        noise_multiplier, trees(rest)), 1))
  return out


def _terms(mechanism: str, noise_multiplier: float, sampling: Sampling,
           rounds: int, restart_every: int | None) -> list[tuple[object, int]]:
  """The run as ``[(event, count)]``: ``count`` self-compositions of each."""
  dp = _dp()
  z = float(noise_multiplier)
  if rounds == 0:
    return []
  if mechanism == 'tree':
    return _tree_epochs(z, sampling, rounds, restart_every)
  gauss = dp.GaussianDpEvent(z)
  if sampling.name == 'poisson':
    return [(dp.PoissonSampledDpEvent(sampling.rate, gauss), rounds)]
  if sampling.name == 'uniform':
    return [(dp.SampledWithoutReplacementDpEvent(
        sampling.population, int(sampling.cohort_size), gauss), rounds)]
  return [(gauss, -(-rounds // sampling.rounds_per_epoch))]


def dp_event(mechanism: str, noise_multiplier: float, sampling: Sampling,
             rounds: int, restart_every: int | None = None):
  """The ``dp_accounting.DpEvent`` of ``rounds`` rounds (see the module table).

  Args:
    mechanism: ``'gaussian'`` (DP-FedAvg, adaptive clipping) or ``'tree'``
      (DP-FTRL).
    noise_multiplier: ``z >= 0`` (0: no privacy, epsilon infinite).
    sampling: the cohorts' :class:`Sampling`.
    rounds: ``R >= 0``.
    restart_every: rounds per tree (``'tree'`` only; None: one tree).
  """
  _check('dp_event', mechanism, noise_multiplier, sampling, rounds,
         restart_every=restart_every)
  dp = _dp()
  terms = _terms(mechanism, noise_multiplier, sampling, rounds, restart_every)
  events = [dp.SelfComposedDpEvent(e, n) if n > 1 else e for e, n in terms]
  if not events:
    return dp.NoOpDpEvent()
  return events[0] if len(events) == 1 else dp.ComposedDpEvent(events)


def make_accountant(accountant: str, relation):
  """A fresh ``dp_accounting`` RDP or PLD accountant under ``relation``."""
  dp = _dp()
  if accountant == 'rdp':
    return dp.rdp.RdpAccountant(neighboring_relation=relation)
  return dp.pld.PLDAccountant(neighboring_relation=relation)


def epsilon(noise_multiplier: float, rounds: int, delta: float, *,
            sampling: Sampling, mechanism: str = 'gaussian',
            accountant: str = 'rdp', restart_every: int | None = None) -> float:
  """Epsilon of the run at ``delta`` (``inf`` when ``z = 0``).

  Args:
    noise_multiplier: ``z >= 0``.
    rounds: ``R >= 0``.
    delta: in ``(0, 1)``.
    sampling: the cohorts' :class:`Sampling`.
    mechanism: ``'gaussian'`` or ``'tree'``.
    accountant: ``'rdp'`` or ``'pld'``.
    restart_every: rounds per tree (``'tree'`` only).
  """
  _check('epsilon', mechanism, noise_multiplier, sampling, rounds, accountant,
         restart_every)
  _check_delta('epsilon', delta)
  if rounds == 0:
    return 0.0
  if noise_multiplier == 0:
    return math.inf
  acc = make_accountant(accountant, neighboring_relation(mechanism, sampling))
  acc.compose(dp_event(mechanism, noise_multiplier, sampling, rounds,
                       restart_every))
  return float(acc.get_epsilon(delta))


def _check_delta(fn: str, delta: float) -> None:
  if isinstance(delta, bool) or not isinstance(delta, (int, float)) \
      or not 0 < delta < 1:
    raise ValueError(f'{fn}: delta={delta!r}; it must be a number in (0, 1).')


@functools.lru_cache(maxsize=64)
def _rdp_of(event, relation) -> tuple[float, ...]:
  """The RDP curve of one event at the accountant's default orders."""
  acc = _dp().rdp.RdpAccountant(neighboring_relation=relation)
  acc.compose(event)
  # The accountant's composed RDP curve; composition is its sum over events.
  return tuple(np.asarray(acc._rdp, np.float64))  # pylint: disable=protected-access


def epsilons(noise_multiplier: float, rounds: int, delta: float, *,
             sampling: Sampling, mechanism: str = 'gaussian',
             restart_every: int | None = None) -> np.ndarray:
  """``float64 [R]``: the RDP epsilon after each of rounds ``1 .. R``.

  The same numbers as :func:`epsilon` with ``accountant='rdp'`` for every
  prefix of the run, but cheap: RDP composes by addition, so the curve of
  each distinct per-round event is computed once (``dp_accounting``'s RDP of
  a subsampled Gaussian costs about 0.07 s; the ``R`` conversions to
  epsilon about 0.2 ms each).
  """
  _check('epsilons', mechanism, noise_multiplier, sampling, rounds, 'rdp',
         restart_every)
  _check_delta('epsilons', delta)
  if noise_multiplier == 0:
    return np.full(rounds, math.inf)
  dp = _dp()
  relation = neighboring_relation(mechanism, sampling)
  orders = dp.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
  out = np.empty(rounds)
  for r in range(1, rounds + 1):
    total = np.zeros(len(orders))
    for event, count in _terms(mechanism, noise_multiplier, sampling, r,
                               restart_every):
      total += count * np.asarray(_rdp_of(event, relation))
    out[r - 1] = dp.rdp.compute_epsilon(orders, total, delta)[0]
  return out


def noise_multiplier_for_epsilon(target_epsilon: float, delta: float,
                                 rounds: int, *, sampling: Sampling,
                                 mechanism: str = 'gaussian',
                                 accountant: str = 'rdp',
                                 restart_every: int | None = None,
                                 tol: float = 1e-4) -> float:
  """The smallest ``z`` whose run has epsilon at most ``target_epsilon`` at ``delta``.

  ``dp_accounting.calibrate_dp_mechanism`` (a bracketing search with Brent's
  method over the accountant) to within ``tol``, rounded up by ``tol`` so
  that the returned ``z`` meets the target. With ``accountant='pld'`` the
  search runs in ``[z_rdp / 2, z_rdp]`` (``z_pld <= z_rdp``; below
  ``z_rdp / 2`` it returns ``z_rdp / 2``, which then also meets the target).
  """
  _check('noise_multiplier_for_epsilon', mechanism, 1.0, sampling, rounds,
         accountant, restart_every)
  _check_delta('noise_multiplier_for_epsilon', delta)
  if isinstance(target_epsilon, bool) or not isinstance(
      target_epsilon, (int, float)) or not target_epsilon > 0:
    raise ValueError(f'noise_multiplier_for_epsilon: target_epsilon='
                     f'{target_epsilon!r}; it must be a number > 0.')
  if rounds == 0:
    return 0.0
  dp = _dp()
  relation = neighboring_relation(mechanism, sampling)

  def calibrate(name, bracket):
    return float(dp.calibrate_dp_mechanism(
        lambda: make_accountant(name, relation),
        lambda z: dp_event(mechanism, z, sampling, rounds, restart_every),
        target_epsilon, delta, bracket_interval=bracket, tol=tol))

  z = calibrate('rdp', dp.LowerEndpointAndGuess(1e-3, 1.0))
  if accountant == 'pld':
    # PLD's epsilon is at most RDP's, so its z is at most RDP's; PLD's grids
    # grow without bound as z -> 0, so the search starts from RDP's answer.
    lower = z / 2
    if epsilon(lower, rounds, delta, sampling=sampling, mechanism=mechanism,
               accountant='pld', restart_every=restart_every) > target_epsilon:
      z = calibrate('pld', dp.ExplicitBracketInterval(lower, z))
    else:
      z = lower
  return z + tol


def statement(*, mechanism: str, aggregator: str, noise_multiplier: float,
              sampling: Sampling, rounds: int, delta: float, accountant: str,
              restart_every: int | None = None,
              epsilon_value: float | None = None) -> dict[str, object]:
  """The privacy statement of a run: what is guaranteed and under which model."""
  if epsilon_value is None:
    epsilon_value = epsilon(noise_multiplier, rounds, delta, sampling=sampling,
                            mechanism=mechanism, accountant=accountant,
                            restart_every=restart_every)
  relation = neighboring_relation(mechanism, sampling)
  if mechanism == 'tree':
    bound = (f'at most once per epoch of {sampling.rounds_per_epoch} rounds; '
             f'trees restart every {restart_every or rounds} rounds')
  elif sampling.name == 'epochs':
    bound = (f'at most {-(-rounds // sampling.rounds_per_epoch)} rounds '
             '(once per epoch)')
  else:
    bound = 'none (amplification by sampling)'
  return {
      'unit': 'user (all the data of one client)',
      'neighbouring': relation.name.lower(),
      'mechanism': mechanism,
      'aggregator': aggregator,
      'noise_multiplier': float(noise_multiplier),
      'sampling': sampling.name,
      'sampling_detail': sampling.describe(),
      'population': sampling.population,
      'cohort_size': float(sampling.cohort_size),
      'participation_bound': bound,
      'rounds': int(rounds),
      'restart_every': restart_every,
      'accountant': accountant,
      'delta': float(delta),
      'epsilon': float(epsilon_value),
      'dp_event': repr(dp_event(mechanism, noise_multiplier, sampling, rounds,
                                restart_every)),
      'trust': 'trusted server: it sees individual clipped updates; only the '
               'released model sequence is private',
  }


def dp_epsilon(noise_multiplier: float, sampling_rate: float, num_rounds: int,
               delta: float, accountant: str = 'rdp') -> float:
  """Epsilon of ``num_rounds`` DP-FedAvg rounds at ``delta`` (user level).

  Each round is a Gaussian mechanism with noise multiplier ``z`` on a cohort
  Poisson-sampled with probability ``q``; ``R`` rounds compose (RDP or PLD
  accountant). Kept with its original signature; see :func:`epsilon` for
  other samplings and mechanisms.
  """
  from fedjx.algorithms import base  # pylint: disable=g-import-not-at-top
  fn = 'dp_epsilon'
  base.check_number(fn, 'noise_multiplier', noise_multiplier, strict=True)
  base.check_number(fn, 'sampling_rate', sampling_rate, strict=True, high=1.0)
  if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 0:
    raise ValueError(f'{fn}: num_rounds={num_rounds!r} must be an int >= 0.')
  base.check_number(fn, 'delta', delta, strict=True, high=1.0)
  base.check_choice(fn, 'accountant', accountant, ACCOUNTANTS)
  dp = _dp()
  event = dp.SelfComposedDpEvent(
      dp.PoissonSampledDpEvent(sampling_rate, dp.GaussianDpEvent(noise_multiplier)),
      num_rounds)
  acc = (dp.rdp.RdpAccountant() if accountant == 'rdp'
         else dp.pld.PLDAccountant())
  acc.compose(event)
  return float(acc.get_epsilon(delta))


__all__ = ['ACCOUNTANTS', 'MECHANISMS', 'SAMPLINGS', 'Sampling',
           'check_supported', 'dp_epsilon', 'dp_event', 'epsilon', 'epsilons',
           'make_accountant', 'neighboring_relation',
           'noise_multiplier_for_epsilon', 'statement']
