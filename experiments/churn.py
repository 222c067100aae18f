"""Replicas that join, leave or fail mid-run, and the goodput of such a run.

A churn schedule says, for ``M`` replicas and ``R`` rounds, which replicas
take part in each round of DiLoCo (Douillard et al. 2023, arXiv 2311.08105):

* ``present``: the replicas that start the round; each starts from the
  current global model ``theta``, as every DiLoCo replica does every round
  (``diloco_lib``'s client map broadcasts ``state.params`` to every
  replica), so a replica that joins or rejoins needs nothing more;
* ``failed``: present replicas that fail mid-round. Their inner steps are
  spent but their outer gradients never reach the all-reduce: the round's
  step is taken as if they were absent, and their tokens are wasted;
* ``contributing = present - failed``: the replicas whose outer gradients
  enter the round's outer step.

**The outer step over those present.** :func:`round_cohort` gives the
round's cohort with the mask and ``num_examples`` of every non-contributing
replica set to zero, the framework's padding clients: such a replica takes
no inner step, carries weight 0, and keeps its inner optimizer state from
before the round (``diloco`` writes inner states back only for replicas with
data). The outer gradient is then
``Delta = sum_{k in C} w_k Delta_k / sum_{k in C} w_k`` over the
contributing replicas ``C`` only. When every replica contributes, the cohort
is unchanged and the round is DiLoCo's bit for bit.

**Seeded schedules** (:func:`seeded_schedule`): the run starts with all
``M`` replicas. Round ``r`` draws ``u = default_rng([seed, r]).random((2,
M))``. For ``r >= 1``, replica ``k`` that contributed to round ``r - 1``
leaves if ``u[0, k] < leave``, and one that did not (absent, or failed in
round ``r - 1``) joins if ``u[0, k] < join``; in every round a present
replica fails mid-round if ``u[1, k] < fail``. If no replica would
contribute, replica ``r mod M`` is present and does not fail (every round
has at least one contributing replica). Round ``r``'s draws depend on
``(seed, r)`` only and its membership on the draws of rounds ``0..r``, so
the schedule is a pure function of the seed and the round: a resumed run
rebuilds it from its arguments and needs no saved state.

**Goodput** (:func:`goodput`): useful tokens, those of the contributing
replicas, per simulated second, the round's time from
:func:`fedjx.experiments.network.simulate`.

**In a run** (:func:`with_schedule`, what ``config.churn`` builds through
:func:`fedjx.experiments.experiment.with_churn`): the algorithm's round
applies the rule of :func:`round_cohort` to its own cohort, round ``r``
read from ``state.round_index``, and its metrics gain the round's replica
counts, useful and wasted tokens and, given the round's simulated seconds,
its goodput.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjx import constant_hoisting
from fedjx.algorithms.base import scan_rounds
from fedjx.experiments import network as network_lib


def _int(where: str, arg: str, value, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise ValueError(f'{where}: {arg}={value!r} must be an integer >= {low}.')
  return int(value)


def _probability(where: str, arg: str, value) -> float:
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not 0.0 <= float(value) <= 1.0):
    raise ValueError(f'{where}: {arg}={value!r} must be a probability in [0, 1].')
  return float(value)


@dataclasses.dataclass(frozen=True)
class ChurnRound:
  """Who takes part in one round.

  Attributes:
    index: the round ``r``.
    present: replicas that start the round (from the global model).
    failed: present replicas that fail mid-round (their work is lost).
    joined: present replicas that did not contribute to round ``r - 1``.
    left: replicas that contributed to round ``r - 1`` and are absent now
      (before round 0, every replica counts as contributing).
  """

  index: int
  present: frozenset[int]
  failed: frozenset[int]
  joined: frozenset[int]
  left: frozenset[int]

  @property
  def contributing(self) -> frozenset[int]:
    """``present - failed``: the replicas whose outer gradients enter the step."""
    return self.present - self.failed


@dataclasses.dataclass(frozen=True)
class ChurnSchedule:
  """Who takes part in each of ``len(rounds)`` rounds of ``num_replicas`` replicas."""

  num_replicas: int
  rounds: tuple[ChurnRound, ...]

  @property
  def num_rounds(self) -> int:
    return len(self.rounds)

  def round(self, r: int) -> ChurnRound:
    """Round ``r``."""
    if (isinstance(r, bool) or not isinstance(r, numbers.Integral)
        or not 0 <= r < self.num_rounds):
      raise ValueError(f'ChurnSchedule.round: r={r!r} must be an integer in '
                       f'[0, {self.num_rounds}).')
    return self.rounds[int(r)]

  def contributing_mask(self, r: int) -> np.ndarray:
    """``[M]`` bools, True for round ``r``'s contributing replicas."""
    keep = np.zeros(self.num_replicas, bool)
    keep[sorted(self.round(r).contributing)] = True
    return keep


def _build(num_replicas: int, present: Sequence[frozenset[int]],
           failed: Sequence[frozenset[int]]) -> ChurnSchedule:
  rounds, before = [], frozenset(range(num_replicas))
  for r, (p, f) in enumerate(zip(present, failed)):
    rounds.append(ChurnRound(r, p, f, p - before, before - p))
    before = p - f
  return ChurnSchedule(num_replicas, tuple(rounds))


def seeded_schedule(num_replicas: int, num_rounds: int, *, join: float = 0.0,
                    leave: float = 0.0, fail: float = 0.0,
                    seed: int = 0) -> ChurnSchedule:
  """A schedule drawn from per-round probabilities (the module docstring has the rule).

  Args:
    num_replicas: ``M``.
    num_rounds: ``R``.
    join: probability that a replica that did not contribute to the previous
      round is present in this one.
    leave: probability that a replica that contributed to the previous round
      is absent from this one.
    fail: probability that a present replica fails mid-round.
    seed: a non-negative integer; the draws of round ``r`` are
      ``numpy.random.default_rng([seed, r])``'s.
  """
  where = 'seeded_schedule'
  m = _int(where, 'num_replicas', num_replicas, 1)
  n = _int(where, 'num_rounds', num_rounds, 1)
  join = _probability(where, 'join', join)
  leave = _probability(where, 'leave', leave)
  fail = _probability(where, 'fail', fail)
  seed = _int(where, 'seed', seed, 0)
  member = np.ones(m, bool)  # Contributed to the previous round.
  present, failed = [], []
  for r in range(n):
    u = np.random.default_rng([seed, r]).random((2, m))
    here = member.copy() if r == 0 else np.where(member, u[0] >= leave, u[0] < join)
    down = here & (u[1] < fail)
    if not np.any(here & ~down):
      here[r % m], down[r % m] = True, False
    present.append(frozenset(np.flatnonzero(here).tolist()))
    failed.append(frozenset(np.flatnonzero(down).tolist()))
    member = here & ~down
  return _build(m, present, failed)


def _replica_set(where: str, arg: str, value, m: int) -> frozenset[int]:
  try:
    items = frozenset(value)
  except TypeError:
    items = None
  if items is None or not all(
      isinstance(k, numbers.Integral) and not isinstance(k, bool) and 0 <= k < m
      for k in items):
    raise ValueError(f'{where}: {arg}={value!r} must be a set of replica ids in '
                     f'[0, {m}).')
  return frozenset(int(k) for k in items)


def explicit_schedule(num_replicas: int, present: Sequence[Iterable[int]],
                      failed: Sequence[Iterable[int]] | None = None) -> ChurnSchedule:
  """A schedule given round by round.

  Args:
    num_replicas: ``M``.
    present: one set of replica ids per round, the replicas that start it.
    failed: one set per round, a subset of that round's ``present`` (None:
      no failures). Every round needs a contributing replica.
  """
  where = 'explicit_schedule'
  m = _int(where, 'num_replicas', num_replicas, 1)
  if isinstance(present, (str, bytes)) or not isinstance(present, Sequence) or not present:
    raise ValueError(f'{where}: present={present!r} must be a non-empty list of '
                     'sets of replica ids, one per round.')
  if failed is None:
    failed = [()] * len(present)
  if (isinstance(failed, (str, bytes)) or not isinstance(failed, Sequence)
      or len(failed) != len(present)):
    raise ValueError(f'{where}: failed={failed!r} must be a list of {len(present)} '
                     'sets (one per round of present), or None.')
  ps, fs = [], []
  for r, (p, f) in enumerate(zip(present, failed)):
    p = _replica_set(where, f'present[{r}]', p, m)
    f = _replica_set(where, f'failed[{r}]', f, m)
    if not f <= p:
      raise ValueError(f'{where}: failed[{r}]={sorted(f)} must be a subset of '
                       f'present[{r}]={sorted(p)}.')
    if not p - f:
      raise ValueError(f'{where}: round {r} has no contributing replica '
                       f'(present={sorted(p)}, failed={sorted(f)}); allowed: at '
                       'least one present replica that does not fail.')
    ps.append(p)
    fs.append(f)
  return _build(m, ps, fs)


def round_cohort(cohort: Any, churn_round: ChurnRound, num_replicas: int) -> Any:
  """The round's cohort with every non-contributing replica a padding client.

  Replica ``k`` is the cohort's client with ``client_ids == k``; its mask and
  ``num_examples`` become zero unless ``k`` contributes to ``churn_round``.
  A replica that contributes keeps its entries exactly.
  """
  m = _int('round_cohort', 'num_replicas', num_replicas, 1)
  ids = np.asarray(cohort.client_ids)
  if ids.size and (ids.min() < 0 or ids.max() >= m):
    raise ValueError(f'round_cohort: cohort.client_ids={ids.tolist()} must lie in '
                     f'[0, {m}) (num_replicas={m}).')
  keep = np.zeros(m, bool)
  keep[sorted(churn_round.contributing)] = True
  return _keep_clients(cohort, jnp.asarray(keep[ids]))


def _keep_clients(cohort: Any, kept: Any) -> Any:
  """``cohort`` with the clients where ``kept`` (``[C]`` bools) unchanged and
  every other one a padding client (mask and ``num_examples`` zero)."""
  mask = jnp.asarray(cohort.mask)
  n = jnp.asarray(cohort.num_examples)
  return cohort._replace(
      mask=jnp.logical_and(mask, kept.reshape(kept.shape + (1,) * (mask.ndim - 1))),
      num_examples=jnp.where(kept, n, jnp.zeros_like(n)))


METRICS = ('churn_present', 'churn_contributing', 'churn_failed', 'churn_joined',
           'churn_left', 'useful_tokens', 'wasted_tokens')
"""What :func:`with_schedule` adds to each round's metrics (and ``goodput``
when it is given the round's simulated seconds)."""


def schedule_masks(schedule: ChurnSchedule) -> dict[str, np.ndarray]:
  """``[R, M]`` bools per round and replica: ``present``, ``contributing``,
  ``failed``, ``joined`` and ``left``."""
  if not isinstance(schedule, ChurnSchedule):
    raise ValueError(f'schedule_masks: schedule={schedule!r} must be a ChurnSchedule.')
  out = {}
  for name in ('present', 'contributing', 'failed', 'joined', 'left'):
    table = np.zeros((schedule.num_rounds, schedule.num_replicas), bool)
    for rnd in schedule.rounds:
      table[rnd.index, sorted(getattr(rnd, name))] = True
    out[name] = table
  return out


def with_schedule(algorithm: Any, schedule: ChurnSchedule, tokens_per_round: float,
                  round_seconds: Callable[[Any, Any], Any] | None = None) -> Any:
  """``algorithm`` whose round ``r = state.round_index`` runs ``schedule.round(r)``.

  The round applies :func:`round_cohort`'s rule to the cohort it is given,
  inside its own program: replica ``k`` (``client_ids == k``) keeps its
  entries when it contributes to round ``r`` and is a padding client
  otherwise. The round index is read from the state, so a run resumed from
  a checkpoint continues the schedule where it stopped (rounds past the
  schedule's last repeat that last round's membership). The metrics gain,
  with ``U_r = tokens_per_round |C_r|`` and ``W_r = tokens_per_round |F_r|``
  (``tokens_per_round`` = ``H D``, the tokens one replica trains on in a
  round; :func:`goodput`'s notation):

  * ``churn_present``, ``churn_contributing``, ``churn_failed``,
    ``churn_joined``, ``churn_left``: the round's replica counts;
  * ``useful_tokens`` ``U_r`` and ``wasted_tokens`` ``W_r``;
  * ``goodput`` ``U_r / T_r`` when ``round_seconds`` is given:
    ``round_seconds(communicated_bytes, clients)``, the round's simulated
    seconds ``T_r`` from its own metrics, evaluated on the host.

  Args:
    algorithm: a :class:`fedjx.algorithms.Algorithm` whose state has
      ``round_index`` (DiLoCo's).
    schedule: the run's :class:`ChurnSchedule`.
    tokens_per_round: ``H D``, a positive number.
    round_seconds: None, or the round's simulated seconds as above.
  """
  where = 'with_schedule'
  masks = schedule_masks(schedule)
  if (isinstance(tokens_per_round, bool) or not isinstance(tokens_per_round, numbers.Real)
      or not 0 < float(tokens_per_round) < float('inf')):
    raise ValueError(f'{where}: tokens_per_round={tokens_per_round!r} must be a '
                     'positive finite number.')
  last = schedule.num_rounds - 1
  per_round = float(tokens_per_round)
  inner = algorithm.apply

  def apply(state, cohort, key):
    r = jnp.clip(jnp.asarray(state.round_index, jnp.int32), 0, last)
    row = {name: jnp.asarray(table)[r] for name, table in masks.items()}
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    state, metrics, *rows = inner(state, _keep_clients(cohort, row['contributing'][ids]),
                                  key)
    counts = {f'churn_{name}': jnp.sum(mask).astype(jnp.float32)
              for name, mask in row.items()}
    useful = per_round * counts['churn_contributing']
    extra = dict(counts, useful_tokens=useful,
                 wasted_tokens=per_round * counts['churn_failed'])
    if round_seconds is not None:
      seconds = jax.pure_callback(
          lambda b, c: np.asarray(round_seconds(float(b), float(c)), np.float32),
          jax.ShapeDtypeStruct((), jnp.float32), metrics['communicated_bytes'],
          metrics['clients'])
      extra['goodput'] = useful / seconds
    return (state, dict(metrics, **extra), *rows)

  apply.__name__ = getattr(inner, '__name__', 'round')
  return algorithm._replace(
      apply=apply, round=constant_hoisting.jit(apply, donate_argnums=(0,)),
      run_rounds=constant_hoisting.jit(
          lambda state, cohorts, keys: scan_rounds(apply, state, cohorts, keys),
          donate_argnums=(0,)),
      compiler=None)


@dataclasses.dataclass(frozen=True)
class RoundGoodput:
  """One round's accounting (tokens and simulated seconds).

  Attributes:
    index: the round ``r``.
    useful_tokens: ``U_r``, tokens of the contributing replicas.
    wasted_tokens: ``W_r``, tokens of the replicas that failed mid-round.
    seconds: ``T_r``, the simulated wall-clock of the round.
    goodput: ``U_r / T_r``.
  """

  index: int
  useful_tokens: float
  wasted_tokens: float
  seconds: float
  goodput: float


def goodput(schedule: ChurnSchedule, network_schedule: network_lib.Schedule,
            compute: network_lib.Compute, network: network_lib.Network,
            payload_bytes: float, tokens_per_step: float) -> tuple[RoundGoodput, ...]:
  """Useful tokens per simulated second, round by round.

  With ``H`` the inner steps of ``network_schedule`` (``kind='diloco'``),
  ``D`` = ``tokens_per_step`` (tokens one replica trains on per inner step),
  ``C_r`` and ``F_r`` round ``r``'s contributing and failed replicas:

      U_r = H D |C_r|                    (useful tokens)
      W_r = H D |F_r|                    (wasted tokens)
      T_r = simulate(network_schedule, compute, network, payload_bytes,
                     replicas=|C_r|).round_seconds
          = H T + exposed(|C_r|)
      goodput_r = U_r / T_r

  A failed replica's round still takes the time: the round lasts its ``H``
  inner steps and the exposed part of the all-reduce of the outer gradient
  among the ``|C_r|`` contributing replicas (the time to detect a failure is
  not modeled). Absent replicas add no tokens and no time. The goodput of
  the whole run is ``sum_r U_r / sum_r T_r`` (:func:`run_goodput`).
  """
  where = 'goodput'
  if not isinstance(schedule, ChurnSchedule):
    raise ValueError(f'{where}: schedule={schedule!r} must be a ChurnSchedule.')
  if (not isinstance(network_schedule, network_lib.Schedule)
      or network_schedule.kind != 'diloco'):
    raise ValueError(f"{where}: network_schedule={network_schedule!r} must be a "
                     "Schedule of kind 'diloco'; allowed: Schedule.diloco(H, ...).")
  if (isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, numbers.Real)
      or not 0 < float(tokens_per_step) < float('inf')):
    raise ValueError(f'{where}: tokens_per_step={tokens_per_step!r} must be a '
                     'positive finite number.')
  h, d = network_schedule.inner_steps, float(tokens_per_step)
  out = []
  for rnd in schedule.rounds:
    c = len(rnd.contributing)
    seconds = network_lib.simulate(network_schedule, compute, network, payload_bytes,
                                   c).round_seconds
    useful = h * d * c
    out.append(RoundGoodput(rnd.index, useful, h * d * len(rnd.failed), seconds,
                            useful / seconds))
  return tuple(out)


def run_goodput(rounds: Sequence[RoundGoodput]) -> float:
  """``sum_r U_r / sum_r T_r``: the goodput of the rounds together."""
  if not rounds:
    raise ValueError(f'run_goodput: rounds={rounds!r} must be a non-empty sequence '
                     'of RoundGoodput.')
  return sum(r.useful_tokens for r in rounds) / sum(r.seconds for r in rounds)


__all__ = ['METRICS', 'ChurnRound', 'ChurnSchedule', 'RoundGoodput', 'explicit_schedule',
           'goodput', 'round_cohort', 'run_goodput', 'schedule_masks', 'seeded_schedule',
           'with_schedule']
