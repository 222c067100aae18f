"""Adaptive clipping: the clip norm follows a quantile of the update norms.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021 (arXiv 1905.03871), Algorithm 1 with the
geometric update. The clip norm ``C`` is the aggregator's state; each round

    client i:  m_i = Delta_i min(1, C / ||Delta_i||)          (clip to C)
               b_i = 1[||Delta_i|| <= C]                      (unclipped bit)
    server:    Delta = (sum_i m_i + N(0, (z_Delta C)^2 I)) / D
               b~    = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / D + 1/2
               C    <- C exp(-eta_C (b~ - gamma))

so ``C`` rises while fewer than a fraction ``gamma`` (``target_quantile``)
of the clients are unclipped and falls while more are: with no noise it
settles at the ``gamma``-quantile of the update norms, within the geometric
step ``exp(eta_C max(gamma, 1 - gamma))``.

The bits are centred (``b_i - 1/2``) as in the paper's privacy analysis
(the proof of its Theorem 1): one client then changes the noisy count by at most ``1/2``,
and ``b~`` equals ``(sum_i b_i + N(0, sigma_b^2)) / D`` whenever ``D``
clients take part. With ``D = None`` (divide by the participating count)
the count is not centred: ``b~ = (sum_i b_i + N(0, sigma_b^2)) / n``.

Privacy (the paper's Theorem 1): a round releases two Gaussian mechanisms
on the same clients, the updates (sensitivity ``C``, noise ``z_Delta C``)
and the centred count (sensitivity 1/2, noise ``sigma_b``); together they
are a single Gaussian mechanism with noise multiplier

    z = (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2).

Those sensitivities are add-or-remove's (Poisson cohorts) and zero-out's
(shuffled epochs). With fixed-size cohorts the relation is replace-one and
both double (``2C``, and 1 for the centred bit, which goes from ``-1/2`` to
``1/2``), so the round is a Gaussian mechanism with noise multiplier
``((2 / z_Delta)^2 + (1 / sigma_b)^2)^(-1/2) = z / 2``
(:func:`fedjx.algorithms.privacy.accounting.sensitivity`).

``noise_multiplier`` is the total ``z``, the one the accountant composes
(as ``z / 2`` under replace-one); the updates get the larger

    z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2),

which exists when ``2 sigma_b > z`` (:func:`update_noise_multiplier`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.traits import Privacy
from fedjx.algorithms.traits import Traits


class AdaptiveClipState(NamedTuple):
  """The adaptive Gaussian aggregator's state.

  Attributes:
    clip_norm: the clip norm ``C`` the next round's clients use.
  """

  clip_norm: jax.Array


def update_noise_multiplier(noise_multiplier: float,
                            clipped_count_stddev: float) -> float:
  """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``; 0 when ``z = 0``.

  The noise multiplier of the updates that leaves, with the count's noise
  ``sigma_b``, a round whose total noise multiplier is ``z`` (Andrew et al.
  2021, Theorem 1). Refuses ``sigma_b <= z / 2``, for which no update noise
  is enough.
  """
  fn = 'adaptive_gaussian'
  base.check_number(fn, 'noise_multiplier', noise_multiplier)
  base.check_number(fn, 'clipped_count_stddev', clipped_count_stddev)
  z, sigma_b = float(noise_multiplier), float(clipped_count_stddev)
  if z == 0:
    return 0.0
  if 2 * sigma_b <= z:
    raise ValueError(
        f'{fn}: clipped_count_stddev={clipped_count_stddev!r} must be > '
        f'noise_multiplier / 2 = {z / 2!r} (the count spends privacy: '
        'z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), Andrew et al. 2021, '
        'Theorem 1).')
  return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5


def _traced_update_noise_multiplier(z: jax.Array, sigma_b: jax.Array) -> jax.Array:
  """:func:`update_noise_multiplier` on traced values (NaN where it is undefined)."""
  positive = z > 0
  safe_z = jnp.where(positive, z, 1.0)
  inner = safe_z ** -2 - (2 * sigma_b) ** -2
  return jnp.where(positive, jax.lax.rsqrt(inner), 0.0)


ADAPTIVE_GAUSSIAN = Privacy('adaptive_gaussian', 'central DP',
                             mechanism='gaussian', canaries=True)
""":func:`adaptive_gaussian`'s mechanism, as its builder declares it."""


@traits_lib.declare(Traits(checks_update=True, privacy=ADAPTIVE_GAUSSIAN))
def adaptive_gaussian(noise_multiplier: float = 1.0,
                      initial_clip_norm: float = 0.1,
                      target_quantile: float = 0.5,
                      clip_learning_rate: float = 0.2,
                      clipped_count_stddev: float | None = None,
                      expected_clients_per_round: float | None = None,
                      canaries=None) -> aggregators.Aggregator:
  """User-level DP with the clip norm adapted to a quantile of the norms.

  Andrew et al., "Differentially Private Learning with Adaptive Clipping",
  NeurIPS 2021 (module docstring). The defaults are the paper's: ``C_0 =
  0.1``, ``gamma = 0.5``, ``eta_C = 0.2`` and ``sigma_b = D / 20``.

  Args:
    noise_multiplier: ``z`` >= 0, the round's total noise multiplier (what
      the accountant composes; ``state.hparams['noise_multiplier']``).
    initial_clip_norm: ``C_0`` > 0.
    target_quantile: ``gamma`` in ``[0, 1]``
      (``state.hparams['target_quantile']``).
    clip_learning_rate: ``eta_C`` >= 0 (``state.hparams['clip_learning_rate']``).
    clipped_count_stddev: ``sigma_b``, the count's noise, > ``z / 2``
      (``state.hparams['clipped_count_stddev']``). None: ``D / 20`` (the
      paper's choice), which needs ``expected_clients_per_round``; with
      ``z = 0`` and no ``D``, 0 (no noise at all).
    expected_clients_per_round: ``D = qN``, the fixed denominator; None
      divides by the number of participating clients.
    canaries: the canary clients of a privacy audit
      (:mod:`fedjx.algorithms.privacy.audit`), clipped to the round's ``C``;
      they do not enter the unclipped count. None: no audit.

  Returns:
    The :class:`~fedjx.algorithms.aggregators.Aggregator`; its state is an
    :class:`AdaptiveClipState`. Every client has weight 1. Metrics:
    ``clip_norm`` (the ``C`` of the round), ``unclipped_fraction`` (``b~``,
    privatized), ``noise_std`` (``z_Delta C``, on the sum) and
    ``update_noise_multiplier`` (``z_Delta``).

  The hyperparameters are traced, so changing them in ``state.hparams``
  reuses the compiled round; a ``sigma_b <= z / 2`` set there makes the
  noise NaN (the builder refuses it).
  """
  fn = 'adaptive_gaussian'
  aggregators.check_dp_options(fn, noise_multiplier, expected_clients_per_round,
                               initial_clip_norm=initial_clip_norm)
  base.check_number(fn, 'target_quantile', target_quantile, high=1.0)
  base.check_number(fn, 'clip_learning_rate', clip_learning_rate)
  if clipped_count_stddev is None:
    if expected_clients_per_round is not None:
      clipped_count_stddev = expected_clients_per_round / 20
    elif noise_multiplier == 0:
      clipped_count_stddev = 0.0
    else:
      raise ValueError(
          f'{fn}: clipped_count_stddev=None needs expected_clients_per_round '
          '(the default sigma_b is expected_clients_per_round / 20); give '
          'either, or noise_multiplier=0.')
  update_noise_multiplier(noise_multiplier, clipped_count_stddev)  # Checks.

  def init(params):
    del params
    return AdaptiveClipState(clip_norm=jnp.asarray(initial_clip_norm, jnp.float32))

  def weights(num_examples):
    return base.aggregation_weights(num_examples, 'uniform')

  def broadcast(state):
    return {'clip_norm': state.clip_norm}

  def encode(hparams, update, w):
    clipped, norm = aggregators.clip_update(update, hparams['clip_norm'])
    unclipped = (norm <= hparams['clip_norm']).astype(jnp.float32)
    # b_i w_i, or the norm itself where it is NaN/Inf: the guard checks this
    # value (checks_update) instead of reading the client's model again.
    bit = jnp.where(jnp.isfinite(norm), unclipped * w, norm)
    return jax.tree.map(lambda u: u * w.astype(u.dtype), clipped), bit

  def combine(state, hparams, clients, key):
    clip = state.clip_norm
    z, sigma_b = hparams['noise_multiplier'], hparams['clipped_count_stddev']
    z_delta = _traced_update_noise_multiplier(z, sigma_b)
    update_key, count_key = jax.random.split(key)
    noisy = aggregators.add_gaussian_noise(fedjx.reduce_sum(clients.update),
                                           z_delta * clip, update_key)
    count = aggregators.participants(clients)
    denom = aggregators.denominator(expected_clients_per_round, count)
    aggregate = jax.tree.map(lambda t: t / denom.astype(t.dtype), noisy)
    count_noise = sigma_b * jax.random.normal(count_key, (), jnp.float32)
    unclipped = fedjx.reduce_sum(clients.encoded)
    if expected_clients_per_round is None:
      fraction = (unclipped + count_noise) / denom
    else:  # Centred bits: sum_i (b_i - 1/2) has sensitivity 1/2.
      fraction = (unclipped - count / 2 + count_noise) / denom + 0.5
    new_clip = clip * jnp.exp(-hparams['clip_learning_rate']
                              * (fraction - hparams['target_quantile']))
    metrics = {'clip_norm': clip, 'unclipped_fraction': fraction,
               'noise_std': z_delta * clip, 'update_noise_multiplier': z_delta}
    return aggregate, AdaptiveClipState(clip_norm=new_clip), metrics

  return aggregators.audited(aggregators.Aggregator(
      init=init, combine=combine, encode=encode,
      hparams={'noise_multiplier': noise_multiplier,
               'target_quantile': target_quantile,
               'clip_learning_rate': clip_learning_rate,
               'clipped_count_stddev': clipped_count_stddev},
      weights=weights, broadcast=broadcast,
      traits=adaptive_gaussian.traits._replace(privacy=ADAPTIVE_GAUSSIAN._replace(
          noise_multiplier=noise_multiplier,
          expected_clients_per_round=expected_clients_per_round))),
      canaries, lambda state, hparams: state.clip_norm,
      expected_clients_per_round)


__all__ = ['AdaptiveClipState', 'adaptive_gaussian', 'update_noise_multiplier']
