"""What an algorithm or a part says about itself: one record, :class:`Traits`.

Every algorithm builder and every part (aggregator, client transform,
compressor, attack) carries one :class:`Traits`, declared where it is
defined: a builder with :func:`declare` (``builder.traits``), a built
:class:`~fedjx.algorithms.Algorithm` or
:class:`~fedjx.algorithms.aggregators.Aggregator` in its ``traits`` field.
Whoever needs to know something about an algorithm or a part reads it
here: the runner (what to pass a builder, how to feed and guard its
rounds), the privacy accountant and its refusals, the privacy audit,
churn, deployment and the wrappers (which keep their algorithm's or
part's record as it is). Nothing is read from a name, a signature or a
sentence.

A field left at its default says "nothing special": a plain synchronous
algorithm whose clients keep no state, a part that adds no noise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar


class Privacy(NamedTuple):
  """A differentially private part: what it noises and who accounts for it.

  Attributes:
    name: the mechanism's name in the accountant's table of queries
      (:data:`fedjx.algorithms.privacy.accounting.QUERIES`), e.g.
      ``'gaussian'``, ``'adaptive_gaussian'``.
    model: where the noise is added: ``'central DP'`` (by the server),
      ``'distributed DP'`` (in a secure sum) or ``'local DP'`` (by each
      client).
    mechanism: the accounting mechanism the runner's accountant composes
      (:data:`fedjx.algorithms.privacy.accounting.MECHANISMS`:
      ``'gaussian'``, ``'tree'``), or None when the runner does not account
      for it (see ``reported``).
    noise_multiplier: ``z``, the noise over the bound on one client's
      contribution (None in a builder's declaration: the built part's).
    expected_clients_per_round: the fixed denominator ``qN`` of the noisy
      mean, or None (the participating count).
    restart_every: tree aggregation's restart period (None: one tree).
    reported: for a part that accounts for itself, where its epsilon is
      reported (a metric, a function); None for one the runner accounts.
    run_sampling: the part takes the run's
      :class:`~fedjx.algorithms.privacy.accounting.Sampling` as its option
      ``sampling`` (the runner gives it, as it gives it the accountant).
    canaries: the part takes the canary clients of a privacy audit as its
      option ``canaries`` (:mod:`fedjx.algorithms.privacy.audit`).
  """

  name: str
  model: str
  mechanism: str | None = None
  noise_multiplier: float | None = None
  expected_clients_per_round: float | None = None
  restart_every: int | None = None
  reported: str | None = None
  run_sampling: bool = False
  canaries: bool = False

  def __str__(self) -> str:
    return f'{self.name} ({self.model})'


class Traits(NamedTuple):
  """What an algorithm or a part declares about itself (module docstring).

  An algorithm's fields:

  Attributes:
    options: the keyword options its builder's ``**options`` takes (fields
      of :class:`fedjx.algorithms.template.Options`), beside the builder's
      own parameters: what a config may give it.
    population: the builder's parameter that takes the population size
      (SCAFFOLD's ``num_clients``, DiLoCo's ``num_replicas``); the runner
      sets it unless the config does. None: no per-client state by id.
    client_state: the builder's option choosing where per-client state
      lives (``'store'``: rows outside the server state; ``'dense'``: an
      ``[N, ...]`` array in it); the runner sets it from
      ``config.client_state.placement``. None: no choice offered.
    aggregator: the DP aggregator's builder the algorithm builds from its
      own options (DP-FedAvg: ``gaussian``), or None; the accountant reads
      the mechanism from that aggregator.
    asynchronous: its rounds take ``AsyncCohort``s from a simulated
      schedule (``fedjx.datasets.async_schedule``); ``fedjx-sweep`` refuses
      it.
    updates_reach_params: every client's output reaches the server model in
      the round that computes it (nothing waits in the state), so the
      runner may run rounds unguarded first and redo a non-finite one
      guarded (:mod:`fedjx.experiments.guarded_rounds`).
    indexed_batches: its round reads a cohort of
      :class:`fedjx.IndexedBatches` as it is (each step gathers its own
      rows); False: such a cohort is gathered whole first.
    unprivatized: None when all a round releases of the clients' data is
      the aggregate its aggregator encodes; otherwise what else it
      releases, in a phrase: every DP aggregator is then refused
      (:func:`fedjx.algorithms.base.check_private_uploads`).
    aggregates_whole_model: its aggregator combines the whole model's
      update once a round, so a privacy audit's canaries measure the
      release (:mod:`fedjx.algorithms.privacy.audit`).
    replicas_restart: every replica starts each round from the global
      model, so a replica that joins or rejoins needs nothing more
      (``config.churn``, :mod:`fedjx.experiments.churn`).

  A part's fields:

  Attributes:
    checks_update: the aggregator's per-client values are NaN or Inf
      whenever the update is (they hold its norm): the non-finite guard
      checks them instead of reading the client's model again.
    needs_all_updates: None for a rule written with the fedjx reductions;
      for one that reads every client's message at once (order statistics,
      pairwise distances), why, in a phrase: Beam runs it, a streamed round
      refuses it with that phrase.
    wire_bits: each client's ``encode`` counts the bits of its message in
      the wire format (``encoded['upload_bits']``), the one definition of
      what a client sends (:func:`fedjx.algorithms.aggregators.upload_bytes`).
    privacy: a DP part's :class:`Privacy`; None for a part that adds no
      noise.
    unbiased: a compressor's ``E[x_hat] = x`` over its key (it then needs
      no error feedback and refuses it).
    omniscient: an attack's ``poison`` reads the honest clients' mean and
      standard deviation (they are computed only then).
  """

  options: tuple[str, ...] = ()
  population: str | None = None
  client_state: str | None = None
  aggregator: Callable[..., Any] | None = None
  asynchronous: bool = False
  updates_reach_params: bool = False
  indexed_batches: bool = False
  unprivatized: str | None = None
  aggregates_whole_model: bool = False
  replicas_restart: bool = False
  checks_update: bool = False
  needs_all_updates: str | None = None
  wire_bits: bool = False
  privacy: Privacy | None = None
  unbiased: bool = False
  omniscient: bool = False


NONE = Traits()
"""The record of an algorithm or part that declares nothing special."""

_F = TypeVar('_F')


def declare(traits: Traits) -> Callable[[_F], _F]:
  """Declares a builder's :class:`Traits`: ``@declare(Traits(...))``.

  Sets ``builder.traits`` and returns the builder itself (its signature is
  not touched).
  """
  if not isinstance(traits, Traits):
    raise ValueError(f'declare: traits={traits!r} is not a Traits.')

  def attach(builder: _F) -> _F:
    builder.traits = traits
    return builder
  return attach


def of(thing: Any) -> Traits:
  """The :class:`Traits` of a builder, an algorithm or a part (:data:`NONE`
  for one that declares none)."""
  traits = getattr(thing, 'traits', NONE)
  return traits if isinstance(traits, Traits) else NONE


__all__ = ['NONE', 'Privacy', 'Traits', 'declare', 'of']
