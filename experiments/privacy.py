"""The privacy side of a run: its sampler, its accounting and its statement.

A config's ``sampling`` field chooses how each round's cohort is drawn and
its ``privacy`` field how the run is accounted (``docs/privacy.md``)::

  config.sampling = dict(name='poisson')    # or 'uniform' (default), 'epochs'
  config.privacy = dict(delta=None, accountant='rdp', target_epsilon=8.0,
                        audit=dict(canaries=1000))   # audit: None by default

:func:`plan` reads the DP mechanism of ``config.algorithm`` from what its
parts declare (:class:`fedjx.algorithms.traits.Privacy`: the algorithm's
own DP aggregator, as DP-FedAvg declares one, or its ``aggregator``),
checks that ``fedjx.algorithms.privacy.accounting`` can account for it
under the configured sampling (one-line :class:`ConfigError` otherwise) and
gives a :class:`Plan`: the epsilon after each round, the last
round within ``target_epsilon`` and the privacy statement the runner writes
to ``workdir/privacy.json``. :func:`make_sampler` builds the sampler the
accounting assumes. With ``privacy.audit`` the DP aggregator gets canary
clients (:func:`algorithm_spec`; :mod:`fedjx.algorithms.privacy.audit`) and
:func:`run_audit` estimates epsilon from them at the end of the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.privacy import accounting
from fedjx.algorithms.privacy import audit as privacy_audit
from fedjx.datasets import sampling as samplers
from fedjx.experiments import metrics_writers
from fedjx.experiments import parts
from fedjx.experiments import registry
from fedjx.experiments import signatures
from fedjx.experiments.config import ConfigError

# Relative slack allowed between a fixed denominator and q N.
DENOMINATOR_RTOL = 1e-6


def _as_dict(value: Any) -> Any:
  return value.to_dict() if hasattr(value, 'to_dict') else (
      dict(value) if isinstance(value, Mapping) else value)


def dp_part(algorithm: Mapping[str, Any]) -> tuple[Any, dict[str, Any]] | None:
  """``(builder, options)`` of the DP aggregator of ``config.algorithm``, or None.

  The algorithm's own, built from its options (its declared
  ``Traits.aggregator``, DP-FedAvg's ``gaussian``), else its
  ``aggregator``'s, when that builder declares a
  :class:`fedjx.algorithms.traits.Privacy`.
  """
  algorithm = {k: _as_dict(v) for k, v in _as_dict(algorithm).items()}
  name = algorithm.get('name')
  own = (registry.algorithm_traits(name).aggregator
         if name in registry.ALGORITHMS else None)
  if own is not None:
    taken = signatures.accepted_kwargs(own)[0]
    return own, {k: v for k, v in algorithm.items() if k in taken}
  spec = algorithm.get('aggregator')
  if not isinstance(spec, Mapping) or spec.get('name') not in parts.AGGREGATORS:
    return None
  builder = parts.AGGREGATORS[spec['name']]
  if traits_lib.of(builder).privacy is None:
    return None
  return builder, {k: v for k, v in spec.items() if k != 'name'}


def privacy_of(algorithm: Mapping[str, Any]) -> Any:
  """The :class:`fedjx.algorithms.traits.Privacy` of ``config.algorithm``'s DP
  aggregator, as its builder declares it, or None when it adds no DP noise."""
  part = dp_part(algorithm)
  return None if part is None else traits_lib.of(part[0]).privacy


def mechanism_of(algorithm: Mapping[str, Any]) -> Any:
  """The :class:`fedjx.algorithms.traits.Privacy` of ``config.algorithm``'s DP
  aggregator, with its noise multiplier and denominator, when the runner's
  accountant accounts for it (its ``mechanism`` is set); else None.

  The aggregator is built from the config's options (without canaries or a
  sampling, which do not change what it declares) and its own record read.
  """
  part = dp_part(algorithm)
  if part is None or part[0].traits.privacy.mechanism is None:
    return None
  builder, options = part
  options = {k: v for k, v in options.items() if k != 'canaries'}
  try:
    aggregator = builder(**options)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.algorithm: {e}') from None
  return aggregator.traits.privacy


def sampling_of(config: Any, population: int) -> accounting.Sampling:
  """The :class:`accounting.Sampling` of ``config.sampling`` over ``population``."""
  spec = _as_dict(config.sampling)
  name = spec.get('name', 'uniform')
  if name == 'poisson':
    rate = spec.get('rate')
    rate = config.cohort_size / population if rate is None else float(rate)
    return accounting.Sampling.poisson(population, rate)
  return accounting.Sampling(name, population, int(config.cohort_size))


def make_sampler(config: Any, dataset: Any):
  """The sampler of ``config.sampling`` over ``dataset`` (or a client count),
  or None for the default uniform one."""
  spec = _as_dict(config.sampling)
  name = spec.get('name', 'uniform')
  if name == 'uniform':
    return None  # cohort_iterator's CohortSampler: today's behaviour.
  if name == 'epochs':
    return samplers.EpochSampler(dataset, config.cohort_size, config.seed)
  s = sampling_of(config, getattr(dataset, 'num_clients', dataset))
  try:
    return samplers.PoissonSampler(dataset, s.rate, config.seed,
                                   spec.get('max_cohort_size'))
  except ValueError as e:
    raise ConfigError(f'config.sampling: {e}') from None


@dataclasses.dataclass
class Plan:
  """How a DP run is accounted: its mechanism, sampling, delta and epsilons.

  Attributes:
    mechanism: the :class:`fedjx.algorithms.traits.Privacy` of the
      algorithm's DP aggregator (its noise multiplier and denominator set).
    sampling: the cohorts' :class:`accounting.Sampling`.
    delta: the delta at which epsilon is reported.
    accountant: ``'rdp'`` or ``'pld'``.
    target_epsilon: the budget, or None.
    rounds: the rounds the config asks for.
  """

  mechanism: Any
  sampling: accounting.Sampling
  delta: float
  accountant: str
  target_epsilon: float | None
  rounds: int
  _curve: np.ndarray | None = None
  # config.privacy.audit: the canary clients and the audit's options.
  canaries: Any = None
  audit_options: dict[str, Any] | None = None

  def _kwargs(self) -> dict[str, Any]:
    return dict(sampling=self.sampling, mechanism=self.mechanism.mechanism,
                restart_every=self.mechanism.restart_every)

  @property
  def noise_multiplier(self) -> float:
    """The mechanism's ``z``."""
    return float(self.mechanism.noise_multiplier)

  def epsilon(self, rounds: int) -> float:
    """Epsilon at :attr:`delta` after ``rounds`` rounds (cumulative)."""
    if rounds == 0:
      return 0.0
    if self.accountant == 'rdp':
      if self._curve is None:  # Every round's epsilon, computed once.
        self._curve = accounting.epsilons(
            self.noise_multiplier, self.rounds, self.delta,
            **self._kwargs())
      if rounds <= len(self._curve):
        return float(self._curve[rounds - 1])
    return accounting.epsilon(self.noise_multiplier, rounds,
                              self.delta, accountant=self.accountant,
                              **self._kwargs())

  def stop_round(self) -> int:
    """The last round to run: :attr:`rounds`, or the last within the budget."""
    if self.target_epsilon is None or self.epsilon(self.rounds) <= self.target_epsilon:
      return self.rounds
    lo, hi = 0, self.rounds  # epsilon(lo) <= target < epsilon(hi)
    while hi - lo > 1:
      mid = (lo + hi) // 2
      if self.epsilon(mid) <= self.target_epsilon:
        lo = mid
      else:
        hi = mid
    return lo

  def statement(self, rounds: int) -> dict[str, Any]:
    """The privacy statement after ``rounds`` rounds (``workdir/privacy.json``)."""
    m = self.mechanism
    out = accounting.statement(
        mechanism=m.mechanism, aggregator=m.name,
        noise_multiplier=self.noise_multiplier, sampling=self.sampling,
        rounds=rounds, delta=self.delta, accountant=self.accountant,
        restart_every=m.restart_every, epsilon_value=self.epsilon(rounds))
    out['target_epsilon'] = self.target_epsilon
    d = m.expected_clients_per_round
    out['expected_clients_per_round'] = None if d is None else float(d)
    return out

  def summary(self, rounds: int) -> str:
    """One line: the guarantee after ``rounds`` rounds."""
    eps = self.epsilon(rounds)
    relation = accounting.sensitivity(self.mechanism.name,
                                         self.sampling).relation
    return (f'({eps:.4g}, {self.delta:.3g})-DP for each user after {rounds} '
            f'rounds: {self.mechanism.name} with noise multiplier '
            f'{self.noise_multiplier:g}, '
            f'{self.sampling.describe()}, {relation.replace("_", " ")} '
            f'neighbours, {self.accountant} accountant')


def check_denominator(aggregator: str, d: float | None,
                      sampling: accounting.Sampling) -> None:
  """One-line :class:`ConfigError` unless the DP mean's denominator ``D`` fits.

  With Poisson sampling the number of participants is private, so ``D``
  must be fixed (``expected_clients_per_round``); a fixed ``D`` must be the
  sampler's expected cohort ``q N``.
  """
  expected = sampling.cohort_size
  if sampling.name == 'poisson' and d is None:
    raise ConfigError(
        f'config: {aggregator} with Poisson sampling divides by the '
        'number of participating clients, which is private and not '
        f'accounted; set expected_clients_per_round={expected:g} (q N).')
  if d is not None and abs(d - expected) > DENOMINATOR_RTOL * expected:
    raise ConfigError(
        f'config: expected_clients_per_round={d:g} is not the expected cohort '
        f'{expected:g} of {sampling.name!r} sampling (cohort_size / rate); '
        'set it to that or None.')


def run_sampled(config: Any, population: int,
                aggregator: Mapping[str, Any]) -> dict[str, Any]:
  """The spec of a :data:`RUN_SAMPLED` aggregator, accounted for the run.

  Its ``sampling`` becomes the run's :class:`accounting.Sampling`
  (:func:`sampling_of`: the sampler, the cohort size and the population of
  ``config``), the one central DP's accountant is given; ``clients_per_round``
  (the cohort its scale is chosen for) defaults to the run's cohort. A
  ``sampling`` or ``sampling_rate`` in the spec that is not the run's, and a
  denominator that does not fit the sampling (:func:`check_denominator`),
  are one-line :class:`ConfigError` s.
  """
  spec = dict(aggregator)
  name = spec['name']
  sampling = sampling_of(config, population)
  given, rate = spec.pop('sampling', None), spec.pop('sampling_rate', None)
  if (given is not None and given != sampling.name) or (rate is not None and (
      given != sampling.name
      or abs(float(rate) - sampling.rate) > DENOMINATOR_RTOL * sampling.rate)):
    raise ConfigError(
        f'config.algorithm.aggregator: sampling={given!r}, sampling_rate='
        f'{rate!r} is not the run\'s sampling ({sampling.describe()}: '
        f'{sampling.name!r}, rate {sampling.rate:g}); leave both unset: the '
        f'runner accounts {name} for the run\'s own sampling.')
  check_denominator(name, spec.get('expected_clients_per_round'), sampling)
  spec['sampling'] = sampling
  spec.setdefault('clients_per_round', max(1, round(sampling.cohort_size)))
  return spec


def default_delta(population: int) -> float:
  """``N^-1.1``, below ``1 / N`` (McMahan et al. 2018, Section 3)."""
  return float(population) ** -1.1


def delta_warning(delta: float, population: int) -> str:
  """The one line :func:`plan` warns with when ``delta >= 1 / N``."""
  return (f'config.privacy.delta={delta:g} is at least 1/N = 1/{population}: '
          'a mechanism that publishes one random client\'s data in full meets '
          f'it; use delta < 1/N, e.g. None (N^-1.1 = '
          f'{default_delta(population):.3g}).')


def plan(config: Any, population: int) -> Plan | None:
  """The accounting of a (defaults-filled) config, or None when it is not DP.

  Raises :class:`ConfigError` (one line) when the combination cannot be
  accounted correctly: tree aggregation without a participation bound,
  an accountant that does not model the sampling, a fixed denominator that
  is not the sampler's expected cohort, or a privacy budget on an algorithm
  that adds no noise.
  """
  mech = mechanism_of(config.algorithm)
  privacy = _as_dict(config.privacy)
  if mech is None:
    canaries_of(config, population)  # An audit needs DP noise: refused.
    declared = privacy_of(config.algorithm)
    own = None if declared is None else declared.reported
    if own is not None and privacy.get('target_epsilon') is not None:
      raise ConfigError(
          f'config.privacy.target_epsilon={privacy["target_epsilon"]!r}: the '
          f'aggregator accounts its own privacy ({own}), which the runner '
          'does not plan or stop on; unset target_epsilon and read that.')
    if privacy.get('target_epsilon') is not None:
      raise ConfigError(
          f'config.privacy.target_epsilon={privacy["target_epsilon"]!r} but '
          f'algorithm {config.algorithm.name!r} adds no DP noise; use '
          f'{_accounted_parts()}.')
    return None
  sampling = sampling_of(config, population)
  accountant = privacy.get('accountant', 'rdp')
  try:
    accounting.check_supported(mech.mechanism, sampling, accountant,
                               config.rounds, mech.restart_every,
                               fn='config')
  except ValueError as e:
    raise ConfigError(str(e)) from None
  d = mech.expected_clients_per_round
  check_denominator(mech.name, None if d is None else float(d), sampling)
  canaries = canaries_of(config, population)
  delta = privacy.get('delta')
  delta = default_delta(population) if delta is None else float(delta)
  if delta * population >= 1:
    warnings.warn(delta_warning(delta, population), UserWarning, stacklevel=2)
  target = privacy.get('target_epsilon')
  return Plan(mech, sampling, delta, accountant,
              None if target is None else float(target), int(config.rounds),
              canaries=canaries,
              audit_options=None if canaries is None else dict(
                  _as_dict(privacy['audit'])))


def _accounted_parts() -> str:
  """The algorithms and aggregators whose DP the runner accounts, in words."""
  own = [n for n in registry.ALGORITHMS
         if registry.algorithm_traits(n).aggregator is not None]
  central = sorted(n for n, b in parts.AGGREGATORS.items()
                   if getattr(traits_lib.of(b).privacy, 'mechanism', None))
  return f'{" or ".join(own)} or an aggregator in {central}'


def canaries_of(config: Any, population: int) -> Any:
  """The canary clients of ``config.privacy.audit`` (defaults filled), or None.

  A :class:`fedjx.algorithms.privacy.audit.Canaries` with the run's
  sampling; :class:`ConfigError` (one line) when the algorithm adds no DP
  noise or does not aggregate the whole model once a round, or when the
  count does not fit a fixed-size cohort.
  """
  audit = _as_dict(_as_dict(config.privacy).get('audit'))
  if audit is None:
    return None
  name = config.algorithm.name
  if mechanism_of(config.algorithm) is None:
    raise ConfigError(
        f'config.privacy.audit is set but algorithm {name!r} adds no DP noise: '
        f'the audit checks a DP run; use {_accounted_parts()}.')
  if not registry.algorithm_traits(name).aggregates_whole_model:
    auditable = tuple(n for n in registry.ALGORITHMS
                      if registry.algorithm_traits(n).aggregates_whole_model)
    raise ConfigError(
        f'config.privacy.audit is set but algorithm {name!r} does not '
        'aggregate the whole model once a round, which the canaries need; use '
        f'one of {auditable}.')
  seed = config.seed if audit.get('seed') is None else audit['seed']
  try:
    return privacy_audit.Canaries(int(audit['canaries']),
                                  sampling_of(config, population), int(seed))
  except ValueError as e:
    raise ConfigError(f'config.privacy.audit: {e}') from None


def algorithm_spec(config: Any, population: int) -> Any:
  """``config.algorithm``, with what the run gives its DP aggregator.

  As the aggregator's builder declares (:class:`fedjx.algorithms.traits.Privacy`):
  the canaries of ``config.privacy.audit`` if set (``canaries``), and the
  run's sampling to one that takes it (``run_sampling``,
  :func:`run_sampled`); to the algorithm's own options when it builds its
  DP aggregator itself (``Traits.aggregator``), else to its ``aggregator``.
  """
  canaries = canaries_of(config, population)
  declared = privacy_of(config.algorithm)
  sampled = declared is not None and declared.run_sampling
  if canaries is None and not sampled:
    return config.algorithm
  spec = _as_dict(config.algorithm)
  spec = {k: _as_dict(v) for k, v in spec.items()}
  own = registry.algorithm_traits(spec['name']).aggregator is not None
  part = dict(spec) if own else dict(spec['aggregator'])
  if sampled:
    part = run_sampled(config, population, part)
  if canaries is not None:
    part['canaries'] = canaries
  if own:
    return part
  spec['aggregator'] = part
  return spec


def run_audit(p: Plan, rounds: int, initial_params: Any,
              final_params: Any) -> dict[str, Any]:
  """The audit of a finished run (``privacy.json``'s ``audit``)."""
  options = p.audit_options or {}
  cos = privacy_audit.cosines(p.canaries, initial_params, final_params)
  dimension = sum(int(np.size(x)) for x in jax_leaves(initial_params))
  return privacy_audit.audit(
      p.canaries, cos, p.delta, dimension,
      confidence=options.get('confidence', 0.95),
      accountant_epsilon=p.epsilon(rounds),
      resamples=options.get('resamples', 1000))


def jax_leaves(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree)


def audit_metrics(audit: Mapping[str, Any]) -> dict[str, float]:
  """The audit's numbers for the final metrics row."""
  low, high = audit['epsilon_estimate_interval']
  return {'audit_epsilon': audit['epsilon_estimate'],
          'audit_epsilon_low': low, 'audit_epsilon_high': high,
          'audit_epsilon_lower_bound': audit['epsilon_lower_bound']}


def write_statement(workdir: str, p: Plan, rounds: int,
                    audit: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Writes ``workdir/privacy.json`` for ``rounds`` completed rounds (and the audit)."""
  out = p.statement(rounds)
  if audit is not None:
    out['audit'] = dict(audit)
  text = json.dumps(out, indent=2, sort_keys=True,
                    default=lambda v: None if v is None else str(v))
  metrics_writers.write_atomically(os.path.join(workdir, 'privacy.json'),
                                   text.replace('Infinity', '"inf"') + '\n')
  return out


def budget_message(p: Plan, stop: int) -> str:
  """The line the runner prints when ``target_epsilon`` ends the run early."""
  nxt = p.epsilon(stop + 1)
  return (f'fedjx: privacy budget target_epsilon={p.target_epsilon:g} (delta='
          f'{p.delta:.3g}) reached: round {stop + 1} would bring epsilon to '
          f'{nxt:.4g}; stopped after round {stop} (epsilon '
          f'{p.epsilon(stop):.4g}).')


class Budget:
  """A run's privacy budget, as the training loop consults it.

  Without a plan (a run that is not private) it never stops a run and adds
  nothing. With one, :attr:`stop` is the last round within
  ``privacy.target_epsilon`` (or ``config.rounds``); each round's row gets
  its ``epsilon`` (every round with the RDP accountant, at evaluations and
  the last round with PLD, whose computation is slower), and the last
  round's the audit's numbers when ``privacy.audit`` asks for one.
  ``workdir/privacy.json`` states the guarantee of the rounds completed.
  """

  def __init__(self, p: Plan | None, rounds: int, eval_every: int,
               initial_params: Any):
    self.plan = p
    self.rounds = rounds
    self.stop = rounds if p is None else p.stop_round()
    self._eval_every = eval_every
    self._initial_params = initial_params
    self._audit: dict[str, Any] | None = None

  def begin(self, workdir: str, lead: bool, log: Callable[[str], None]) -> None:
    """The statement of the whole run, written before its first round."""
    if self.plan is not None and lead:
      write_statement(workdir, self.plan, self.stop)
      log(f'fedjx: privacy: {self.plan.summary(self.stop)}.')

  def audits(self, step: int) -> bool:
    """Whether :meth:`row` of ``step`` runs the audit (and so reads its
    ``params``; other steps may pass None)."""
    return (self.plan is not None and self.plan.canaries is not None
            and step == self.stop)

  def row(self, step: int, finite: bool, params: Any) -> dict[str, float]:
    """What step ``step``'s metrics row adds (``params``: the new model,
    read only where :meth:`audits`)."""
    p, out = self.plan, {}
    if p is None:
      return out
    if p.accountant == 'rdp' or step == self.stop or step % self._eval_every == 0:
      out['epsilon'] = p.epsilon(step)
    if p.canaries is not None and step == self.stop and finite:
      self._audit = run_audit(p, step, self._initial_params, params)
      out.update(audit_metrics(self._audit))
    return out

  def finish(self, step: int, interrupted: bool, params: Any, workdir: str,
             lead: bool, log: Callable[[str], None]) -> None:
    """After the loop: why it stopped early, and the statement of what ran."""
    p = self.plan
    if p is None:
      return
    if self.stop < self.rounds and step == self.stop and not interrupted:
      log(budget_message(p, self.stop))
    if lead and step != self.stop:
      write_statement(workdir, p, step)  # Interrupted early.
    if p.canaries is not None and step == self.stop:
      if self._audit is None:  # Resumed after the last round: the saved model.
        self._audit = run_audit(p, step, self._initial_params, params)
      if lead:
        write_statement(workdir, p, step, self._audit)
        log(f"fedjx: privacy audit: {self._audit['statement']}")
