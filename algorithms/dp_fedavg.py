"""DP-FedAvg: FedAvg with user-level differential privacy.

McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018, Algorithm 1 (the Gaussian mechanism on clipped client updates).
With the cohort sampled from the ``N`` clients with probability ``q``:

    client k:  Delta_k = x - y_k                       (y_k: local training)
               Delta_k <- Delta_k min(1, C / ||Delta_k||)       (clip to C)
    server:    g = (sum_k Delta_k + N(0, (z C)^2 I)) / D
               x <- x + ServerOpt(g)

Every client has weight 1, so one client changes the sum by at most ``C``
(its L2 sensitivity) and the noise of standard deviation ``z C`` makes the
round a Gaussian mechanism with noise multiplier ``z``. ``D`` is the expected
cohort size ``qN`` (``expected_clients_per_round``, McMahan et al.'s
fixed-denominator estimator) or, if None, the number of participating
clients (which the privacy analysis treats as public).

:func:`dp_epsilon` composes ``R`` such rounds with Poisson sampling rate
``q`` through the ``dp_accounting`` package (RDP or PLD accountant) and
returns epsilon at the given delta.

DP-FedAvg is FedAvg with the DP aggregator
:func:`fedjx.algorithms.aggregators.gaussian`; any other algorithm takes the
same aggregator (e.g. DP-FedAdam, DP DiLoCo).
"""

from __future__ import annotations

from typing import Any

from fedjx.algorithms import aggregators
from fedjx.algorithms import base
from fedjx.algorithms.fedavg import build as fedavg_build
from fedjx.algorithms.fedavg import without
from fedjx.algorithms.aggregators import clip_update  # pylint: disable=unused-import
from fedjx.algorithms.aggregators import safe_global_norm  # pylint: disable=unused-import

ACCOUNTANTS = ('rdp', 'pld')

# fedavg's options but those DP-FedAvg sets: its aggregator (which weights
# every client 1) and no client transform.
OPTIONS = without('aggregator', 'client_transform', 'weighting')


@base.with_options(OPTIONS)
def dp_fedavg(loss_fn: base.LossFn, *, clip_norm: float = 1.0,
              noise_multiplier: float = 1.0,
              expected_clients_per_round: float | None = None,
              **options: Any) -> base.Algorithm:
  """DP-FedAvg with clipping norm ``C`` and noise multiplier ``z``.

  ``fedavg(aggregator=aggregators.gaussian(clip_norm, noise_multiplier,
  expected_clients_per_round))``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    clip_norm: ``C`` > 0 (traced: ``state.hparams['clip_norm']``).
    noise_multiplier: ``z`` >= 0 (``state.hparams['noise_multiplier']``).
    expected_clients_per_round: ``qN``, the fixed denominator; None divides
      by the number of participating clients.
    **options: those of :func:`fedavg` but ``aggregator``,
      ``client_transform`` and ``weighting``. A skipped client counts as
      absent: it is not in the sum, nor (with
      ``expected_clients_per_round=None``) in ``D``.
  """
  name = 'dp_fedavg'
  aggregator = aggregators.gaussian(clip_norm, noise_multiplier,
                                    expected_clients_per_round)
  return fedavg_build(name, loss_fn, dict(
      base.take_options(name, options, OPTIONS), aggregator=aggregator,
      client_transform=None, weighting='uniform'))


def dp_epsilon(noise_multiplier: float, sampling_rate: float, num_rounds: int,
               delta: float, accountant: str = 'rdp') -> float:
  """Epsilon of ``num_rounds`` DP-FedAvg rounds at ``delta`` (user level).

  Each round is a Gaussian mechanism with noise multiplier ``z`` on a cohort
  Poisson-sampled with probability ``q``; ``R`` rounds compose. Computed with
  ``dp_accounting``'s RDP accountant (``'rdp'``) or privacy-loss-distribution
  accountant (``'pld'``).

  Args:
    noise_multiplier: ``z`` > 0.
    sampling_rate: ``q`` in ``(0, 1]``.
    num_rounds: ``R`` >= 0.
    delta: target delta in ``(0, 1)``.
    accountant: ``'rdp'`` or ``'pld'``.
  """
  fn = 'dp_epsilon'
  base.check_number(fn, 'noise_multiplier', noise_multiplier, strict=True)
  base.check_number(fn, 'sampling_rate', sampling_rate, strict=True, high=1.0)
  if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 0:
    raise ValueError(f'{fn}: num_rounds={num_rounds!r} must be an int >= 0.')
  base.check_number(fn, 'delta', delta, strict=True, high=1.0)
  base.check_choice(fn, 'accountant', accountant, ACCOUNTANTS)
  import dp_accounting  # pylint: disable=g-import-not-at-top
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)),
      num_rounds)
  acc = (dp_accounting.rdp.RdpAccountant() if accountant == 'rdp'
         else dp_accounting.pld.PLDAccountant())
  acc.compose(event)
  return float(acc.get_epsilon(delta))
