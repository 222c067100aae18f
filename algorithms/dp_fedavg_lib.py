"""DP-FedAvg: FedAvg with user-level differential privacy.

McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018, Algorithm 1 (the Gaussian mechanism on clipped client updates).
With the cohort sampled from the ``N`` clients with probability ``q``:

    client k:  Delta_k = x - y_k                       (y_k: local training)
               Delta_k <- Delta_k min(1, C / ||Delta_k||)       (clip to C)
    server:    g = (sum_k Delta_k + N(0, (z C)^2 I)) / D
               x <- x + ServerOpt(g)

Every client has weight 1, so adding or removing one client changes the
sum by at most ``C`` (its L2 sensitivity under the Poisson sampling of the
paper) and the noise of standard deviation ``z C`` makes the round a
Gaussian mechanism with noise multiplier ``z``; with fixed-size cohorts
(replace-one: one client's update swapped for another's) the sensitivity
is ``2C`` and the noise multiplier ``z / 2``
(:func:`fedjx.algorithms.privacy.accounting.sensitivity`). ``D`` is the expected
cohort size ``qN`` (``expected_clients_per_round``, McMahan et al.'s
fixed-denominator estimator) or, if None, the number of participating
clients (which the privacy analysis treats as public).

:func:`fedjx.algorithms.privacy.dp_epsilon` composes ``R`` such rounds with Poisson sampling rate
``q`` through the ``dp_accounting`` package (RDP or PLD accountant) and
returns epsilon at the given delta; :mod:`fedjx.algorithms.privacy.accounting`
accounts for the other samplings and mechanisms (``docs/privacy.md``).

DP-FedAvg is FedAvg with the DP aggregator
:func:`fedjx.algorithms.aggregators.gaussian`; any other algorithm takes the
same aggregator (e.g. DP-FedAdam, DP DiLoCo).
"""

from __future__ import annotations

from typing import Any

from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import kit
from fedjx.algorithms import fedavg_lib

TRAITS = fedavg_lib.TRAITS._replace(
    options=kit.options_but('aggregator', 'client_transform', 'weighting'),
    aggregator=aggregators.gaussian)
"""FedAvg's traits; every option but those DP-FedAvg sets (its aggregator,
which weights every client 1, and no client transform); and the aggregator
it builds from its own options, :func:`~fedjx.algorithms.aggregators.gaussian`."""


@kit.declare(TRAITS)
def dp_fedavg(loss_fn: kit.LossFn, *, clip_norm: float = 1.0,
              noise_multiplier: float = 1.0,
              expected_clients_per_round: float | None = None,
              canaries: Any = None,
              **options: Any) -> kit.Algorithm:
  """DP-FedAvg with clipping norm ``C`` and noise multiplier ``z``.

  ``fedavg(aggregator=aggregators.gaussian(clip_norm, noise_multiplier,
  expected_clients_per_round))``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    clip_norm: ``C`` > 0 (traced: ``state.hparams['clip_norm']``).
    noise_multiplier: ``z`` >= 0 (``state.hparams['noise_multiplier']``).
    expected_clients_per_round: ``qN``, the fixed denominator; None divides
      by the number of participating clients.
    canaries: the canary clients of a privacy audit
      (:mod:`fedjx.algorithms.privacy.audit`; the runner sets them from
      ``config.privacy.audit``), or None.
    **options: those of :func:`fedavg` but ``aggregator``,
      ``client_transform`` and ``weighting``. A skipped client counts as
      absent: it is not in the sum, nor (with
      ``expected_clients_per_round=None``) in ``D``.
  """
  name = 'dp_fedavg'
  aggregator = aggregators.gaussian(clip_norm, noise_multiplier,
                                    expected_clients_per_round, canaries)
  return kit.algorithm(name, loss_fn, kit.Options.of(
      name, options, TRAITS.options, aggregator=aggregator,
      client_transform=None, weighting='uniform'), traits=TRAITS)
