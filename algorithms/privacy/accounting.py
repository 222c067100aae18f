"""Privacy accounting for the DP aggregators, matched to the cohort sampling.

Pure functions on top of ``dp_accounting``. A run is described by its
mechanism, its noise multiplier ``z`` (the noise standard deviation over
the bound ``C`` on one client's clipped contribution), the sampling of its
cohorts and its number of rounds ``R``; :func:`dp_event` gives the
``dp_accounting`` event of the whole run and :func:`epsilon` its epsilon at
``delta``. The unit of privacy is the user (client): neighbouring
populations differ in all the data of one client.

| mechanism | sampling | neighbours | sensitivity | event per run | accountants |
|---|---|---|---|---|---|
| ``gaussian`` | ``poisson`` (rate ``q``) | add or remove one | ``C`` | ``R`` x ``PoissonSampled(q, Gaussian(z))`` | rdp, pld |
| ``gaussian`` | ``uniform`` (``m`` of ``N``) | replace one | ``2C`` | ``R`` x ``SampledWithoutReplacement(N, m, Gaussian(z / 2))`` | rdp |
| ``gaussian`` | ``epochs`` | zero out | ``C`` | ``ceil(R / E)`` x ``Gaussian(z)`` | rdp, pld |
| ``tree`` | ``epochs`` | zero out | ``C`` per node | per epoch ``SingleEpochTreeAggregation(z, trees)`` | rdp |

**Sensitivity follows from the neighbouring relation** (:func:`sensitivity`,
the one place it is derived). One client's contribution to each noised
query lies in a ball of radius ``b`` (``C`` for the clipped sum, ``1/2``
for adaptive clipping's centred count ``b_i - 1/2``). Under add-or-remove
one client moves the query by at most ``b`` (its contribution against
none), under zero-out by at most ``b`` (against the null client's zero),
under replace-one by at most ``2b`` (two contributions of the ball, ``x -
x'``). A round that adds Gaussian noise of standard deviation ``sigma_j`` to
queries of sensitivities ``Delta_j`` is one Gaussian mechanism with noise
multiplier ``(sum_j (Delta_j / sigma_j)^2)^(-1/2)``; every ``Delta_j``
scales by the same factor ``k`` (1 or 2), so the accountant's noise
multiplier is ``z / k``:

* ``gaussian``: noise ``zC`` on a sum of sensitivity ``kC``: ``z / k``.
* ``adaptive_gaussian``: noise ``z_Delta C`` on the sum (``kC``) and
  ``sigma_b`` on the centred count (``k / 2``):
  ``((k / z_Delta)^2 + (k / (2 sigma_b))^2)^(-1/2) = z / k`` with
  ``z = (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021,
  Theorem 1, stated there for add-or-remove).
* ``tree_gaussian``: noise ``zC`` on every node, each client in one leaf per
  tree: ``z`` (zero out, ``k = 1``).

So fixed-size cohorts (``uniform``, replace-one: ``N`` is public) are
accounted with ``z / 2``: ``dp_accounting``'s
``SampledWithoutReplacementDpEvent`` takes the ratio of the noise to the
replace-one sensitivity (Wang, Balle, Kasiviswanathan 2019, Theorem 27,
whose base mechanism is replace-one), while its ``GaussianDpEvent``
elsewhere means the add-or-remove one.

* ``gaussian`` is the clipped sum plus ``N(0, (zC)^2 I)`` of DP-FedAvg
  (McMahan et al. 2018; aggregator ``gaussian``) and of adaptive clipping
  (Andrew et al. 2021; aggregator ``adaptive_gaussian``), whose
  ``noise_multiplier`` is already the total ``z`` of the update and count
  mechanisms composed.
* ``tree`` is DP-FTRL's tree aggregation (Kairouz et al. 2021, aggregator
  ``tree_gaussian``, node noise ``N(0, (zC)^2 I)``): no amplification; with
  shuffled epochs of ``E`` rounds each client is in at most one leaf of the
  trees of an epoch, provided every tree lies inside one epoch
  (``restart_every`` divides ``E``, or a single tree and ``R <= E``). The RDP
  of such an epoch is ``alpha ceil(log2(T + 1)) / (2 z^2)`` for its longest
  tree of ``T`` rounds (their Appendix D).
* ``distributed_skellam`` (Agarwal, Kairouz, Liu 2021; the aggregator of
  :mod:`fedjx.algorithms.privacy.distributed_dp`) is not a ``dp_accounting`` event:
  its RDP is the Skellam mechanism's, which that module computes and
  composes in the aggregator's state. The relation and the factor ``k`` on
  its sensitivity ``Delta_2`` still come from :func:`sensitivity` under the
  run's :class:`Sampling`, which the runner hands the aggregator
  (``experiments/privacy.py``), as it hands it to the central accountant.
* ``epochs`` with ``gaussian``: a client takes part in at most ``ceil(R / E)``
  rounds, each a Gaussian mechanism; the other rounds do not depend on it.
  The argument fixes the population and the shuffled order (which client
  sits where is independent of the data) and changes one client's data:
  zero-out, the relation of Kairouz et al. 2021 (Definition 1.1) and
  Ponomareva et al. 2023 ("How to DP-fy ML", Section 2), under which the
  client's contributions are replaced by zeros. Adding or removing a client
  would change ``N`` and with it every cohort of the epoch, which the
  argument does not cover. No amplification by shuffling is claimed.

Combinations not in the table (tree aggregation without a participation
bound; PLD with fixed-size sampling or trees, which ``dp_accounting``'s PLD
accountant does not model) raise ``ValueError`` in one line.

The RDP accountant evaluates ``dp_accounting``'s default orders; at a few
fractional orders its series for the Poisson-subsampled Gaussian does not
converge, and ``dp_accounting`` then drops the order with a logged warning.
Here those warnings are taken, not logged: the order is still dropped (its
RDP is infinite, so the epsilon is the minimum over the remaining orders,
a valid bound), and :func:`rdp_details` names the dropped orders and the
order that gave the epsilon (``privacy.json``: ``accountant_detail``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np

from fedjx.algorithms import base

MECHANISMS = ('gaussian', 'tree')
SAMPLINGS = ('poisson', 'uniform', 'epochs')
ACCOUNTANTS = ('rdp', 'pld')

# What two neighbouring populations differ in, by relation.
RELATIONS = {
    'add_or_remove_one': 'one client, with all its data, added or removed',
    'replace_one': "one client's data replaced by another client's (the "
                   'population size N is public)',
    'zero_out': "one client's data replaced by a null client whose "
                'contribution to every query is zero (the population and '
                'the shuffled order are fixed)',
}
# The relation each sampling's argument uses (module docstring).
RELATION_OF_SAMPLING = {'poisson': 'add_or_remove_one',
                        'uniform': 'replace_one', 'epochs': 'zero_out'}
# How far one client moves a query whose per-client contributions lie in a
# ball of radius b, in units of b: against no contribution (add or remove),
# against zero (zero out), or against another contribution (replace one).
SENSITIVITY_FACTOR = {'add_or_remove_one': 1, 'replace_one': 2, 'zero_out': 1}
# dp_accounting's name of each relation.
DP_ACCOUNTING_RELATION = {'add_or_remove_one': 'ADD_OR_REMOVE_ONE',
                          'replace_one': 'REPLACE_ONE',
                          'zero_out': 'REPLACE_SPECIAL'}
# The queries each DP aggregator noises, with the bound on one client's
# contribution to each (the radius of the ball it lies in).
QUERIES = {
    'gaussian': (('clipped sum', 'C'),),
    'adaptive_gaussian': (('clipped sum', 'C'),
                          ('centred unclipped count', '1/2')),
    'tree_gaussian': (('clipped sum in each tree node', 'C'),),
    # Agarwal et al. 2021: the scaled, randomly rounded clipped vector of one
    # client, ``||v||_2 <= Delta_2 = C s + sqrt(D)`` (and ``||v||_1 <=
    # Delta_1``), under the Skellam noise of the secure sum.
    'distributed_skellam': (('scaled, rounded clipped sum', 'Delta_2'),),
}
# The accounting mechanism of each DP aggregator.
AGGREGATOR_MECHANISM = {'gaussian': 'gaussian', 'adaptive_gaussian': 'gaussian',
                        'tree_gaussian': 'tree', 'distributed_skellam': 'skellam'}
_DOUBLED = {'C': '2C', '1/2': '1', 'Delta_2': '2 Delta_2'}


@dataclasses.dataclass(frozen=True)
class Sensitivity:
  """How far one client moves what a DP aggregator noises (:func:`sensitivity`).

  Attributes:
    aggregator: ``'gaussian'``, ``'adaptive_gaussian'`` or ``'tree_gaussian'``.
    sampling: the sampling's name.
    relation: the neighbouring relation (a key of :data:`RELATIONS`).
    factor: ``k``, each query's sensitivity over the bound on one client's
      contribution to it (1 or 2).
    queries: ``(query, bound on a contribution, sensitivity)`` of each
      noised query, e.g. ``('clipped sum', 'C', '2C')``.
  """

  aggregator: str
  sampling: str
  relation: str
  factor: int
  queries: tuple[tuple[str, str, str], ...]

  def noise_multiplier(self, noise_multiplier: float) -> float:
    """The accountant's noise multiplier ``z / k`` for the configured ``z``.

    ``z`` is the noise over the bound on one contribution (for adaptive
    clipping, the total of its two queries); the accountant takes the noise
    over the sensitivity.
    """
    return float(noise_multiplier) / self.factor

  @property
  def dp_accounting_relation(self):
    """The ``dp_accounting.NeighboringRelation`` of :attr:`relation`."""
    return getattr(_dp().NeighboringRelation,
                   DP_ACCOUNTING_RELATION[self.relation])

  def describe(self) -> str:
    """One line, e.g. ``replace one: sensitivity 2C of the clipped sum; ...``."""
    queries = ', '.join(f'{s} of the {q}' for q, _, s in self.queries)
    z = 'z' if self.factor == 1 else f'z / {self.factor}'
    return (f"{self.relation.replace('_', ' ')}: sensitivity {queries}; "
            f'the accountant takes noise multiplier {z}')


def sensitivity(aggregator: str, sampling: 'Sampling') -> Sensitivity:
  """The sensitivity of ``aggregator``'s queries under ``sampling``'s relation.

  The one place where the sensitivity is derived (module docstring): the
  relation is the sampling's (:data:`RELATION_OF_SAMPLING`), each query's
  sensitivity is its contribution bound times
  :data:`SENSITIVITY_FACTOR` of the relation, and the accountant's noise
  multiplier is ``z / k``.

  Args:
    aggregator: a key of :data:`QUERIES`, or a mechanism of
      :data:`MECHANISMS` (``'tree'`` is ``'tree_gaussian'``; ``'gaussian'``
      the aggregator of that name, whose factor ``adaptive_gaussian``
      shares under every sampling).
    sampling: the cohorts' :class:`Sampling`.
  """
  name = 'tree_gaussian' if aggregator == 'tree' else aggregator
  if name not in QUERIES:
    raise ValueError(f'sensitivity: aggregator={aggregator!r} is not one of '
                     f'{tuple(QUERIES)} or the mechanisms {MECHANISMS}.')
  if not isinstance(sampling, Sampling):
    raise ValueError(f'sensitivity: sampling={sampling!r} is not an '
                     'accounting.Sampling.')
  if AGGREGATOR_MECHANISM[name] == 'tree' and sampling.name != 'epochs':
    raise ValueError(
        f"sensitivity: tree aggregation (DP-FTRL) with {sampling.name!r} "
        'sampling has no bound on how often a client takes part; use '
        "sampling name='epochs' (each client at most once per epoch).")
  relation = RELATION_OF_SAMPLING[sampling.name]
  k = SENSITIVITY_FACTOR[relation]
  queries = tuple((q, b, b if k == 1 else _DOUBLED[b]) for q, b in QUERIES[name])
  return Sensitivity(name, sampling.name, relation, k, queries)


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
  """``dp_accounting``, imported where an epsilon is first accounted."""
  import dp_accounting  # deferred: heavy (0.7 s with SciPy), used by the accountant only
  return dp_accounting


# dp_accounting's warning when it drops an RDP order (module docstring).
NOT_CONVERGED = '_compute_log_a_frac failed to converge'


class _TakeNotConverged(logging.Filter):
  """Drops dp_accounting's non-convergence warnings; passes everything else."""

  def filter(self, record: logging.LogRecord) -> bool:
    return NOT_CONVERGED not in str(record.msg)


@contextlib.contextmanager
def quiet_rdp() -> Iterator[None]:
  """Inside: ``dp_accounting``'s RDP accountant logs no non-convergence warning.

  The order it concerns is dropped all the same (:func:`rdp_details` names
  it); every other log record passes.
  """
  logger = logging.getLogger('absl')
  taken = _TakeNotConverged()
  logger.addFilter(taken)
  try:
    yield
  finally:
    logger.removeFilter(taken)


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
  """The ``dp_accounting.NeighboringRelation`` the event is accounted under.

  :func:`sensitivity`'s: ``ADD_OR_REMOVE_ONE`` (Poisson), ``REPLACE_ONE``
  (fixed-size cohorts) or ``REPLACE_SPECIAL`` (zero-out: shuffled epochs,
  trees).
  """
  return sensitivity(mechanism, sampling).dp_accounting_relation


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
  # The accountant's noise multiplier: the noise over the sensitivity.
  z = sensitivity(mechanism, sampling).noise_multiplier(noise_multiplier)
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
    noise_multiplier: ``z >= 0`` (0: no privacy, epsilon infinite), the
      noise over the bound ``C`` on one client's contribution; the event
      holds :func:`sensitivity`'s ``z / k`` (``z / 2`` for ``'uniform'``).
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
  with quiet_rdp():
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
  with quiet_rdp():
    acc.compose(event)
  # The accountant's composed RDP curve; composition is its sum over events.
  return tuple(np.asarray(acc._rdp, np.float64))  # pylint: disable=protected-access


def _rdp_curve(noise_multiplier: float, rounds: int, sampling: Sampling,
               mechanism: str, restart_every: int | None) -> np.ndarray:
  """The RDP curve of ``rounds`` rounds at the default orders (cached terms)."""
  relation = neighboring_relation(mechanism, sampling)
  total = np.zeros(len(_dp().rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS))
  for event, count in _terms(mechanism, noise_multiplier, sampling, rounds,
                             restart_every):
    total += count * np.asarray(_rdp_of(event, relation))
  return total


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
  orders = dp.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
  out = np.empty(rounds)
  for r in range(1, rounds + 1):
    total = _rdp_curve(noise_multiplier, r, sampling, mechanism, restart_every)
    out[r - 1] = dp.rdp.compute_epsilon(orders, total, delta)[0]
  return out


def rdp_details(noise_multiplier: float, rounds: int, delta: float, *,
                sampling: Sampling, mechanism: str = 'gaussian',
                restart_every: int | None = None) -> dict[str, object]:
  """Which orders gave the RDP epsilon of the run, and which were dropped.

  Returns ``orders`` (how many), ``lowest`` and ``highest`` order,
  ``best_order`` (the one whose conversion gave the epsilon, None when
  ``z = 0`` or ``R = 0``) and ``excluded``: the orders whose RDP
  ``dp_accounting`` could not compute (its fractional-order series for the
  Poisson-subsampled Gaussian did not converge); their RDP is infinite, so
  the epsilon is the minimum over the others.
  """
  _check('rdp_details', mechanism, noise_multiplier, sampling, rounds, 'rdp',
         restart_every)
  _check_delta('rdp_details', delta)
  orders = list(_dp().rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
  out = {'orders': len(orders), 'lowest': float(min(orders)),
         'highest': float(max(orders)), 'best_order': None, 'excluded': []}
  if noise_multiplier == 0 or rounds == 0:
    return out
  total = _rdp_curve(noise_multiplier, rounds, sampling, mechanism,
                     restart_every)
  out['excluded'] = [float(a) for a, r in zip(orders, total) if np.isinf(r)]
  out['best_order'] = float(_dp().rdp.compute_epsilon(orders, total, delta)[1])
  return out


def accountant_detail(accountant: str, noise_multiplier: float, rounds: int,
                      delta: float, *, sampling: Sampling,
                      mechanism: str = 'gaussian',
                      restart_every: int | None = None) -> str:
  """One line: which ``dp_accounting`` accountant gave the epsilon, and how."""
  version = importlib.metadata.version('dp-accounting')
  if accountant == 'pld':
    return (f'dp_accounting {version} PLDAccountant: privacy loss '
            'distributions composed exactly on a grid of 1e-4 (pessimistic '
            'estimate)')
  d = rdp_details(noise_multiplier, rounds, delta, sampling=sampling,
                  mechanism=mechanism, restart_every=restart_every)
  line = (f"dp_accounting {version} RdpAccountant: RDP at {d['orders']} "
          f"orders from {d['lowest']:g} to {d['highest']:g}, converted with "
          'Canonne, Kamath and Steinke 2020 (Proposition 12)')
  if d['best_order'] is not None:
    line += f"; epsilon from order {d['best_order']:g}"
  if d['excluded']:
    line += (f"; orders {', '.join(f'{a:g}' for a in d['excluded'])} "
             'dropped (dp_accounting\'s series for them did not converge; '
             'the minimum over the other orders is still a bound)')
  return line


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
    with quiet_rdp():
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
  sens = sensitivity(aggregator if aggregator in QUERIES else mechanism,
                     sampling)
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
      'neighbouring': sens.relation,
      'neighbouring_detail': RELATIONS[sens.relation],
      'sensitivity': sens.describe(),
      'accounted_noise_multiplier': sens.noise_multiplier(noise_multiplier),
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
      'accountant_detail': accountant_detail(
          accountant, noise_multiplier, rounds, delta, sampling=sampling,
          mechanism=mechanism, restart_every=restart_every),
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
  with quiet_rdp():
    acc.compose(event)
    return float(acc.get_epsilon(delta))


__all__ = ['ACCOUNTANTS', 'AGGREGATOR_MECHANISM', 'DP_ACCOUNTING_RELATION',
           'MECHANISMS', 'QUERIES', 'RELATIONS', 'RELATION_OF_SAMPLING',
           'SAMPLINGS', 'SENSITIVITY_FACTOR', 'Sampling', 'Sensitivity',
           'accountant_detail', 'check_supported', 'dp_epsilon', 'dp_event',
           'epsilon', 'epsilons', 'make_accountant', 'neighboring_relation',
           'noise_multiplier_for_epsilon', 'quiet_rdp', 'rdp_details',
           'sensitivity', 'statement']
