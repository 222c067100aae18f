"""Adaptive clipping (Andrew et al. 2021): one round against NumPy, the noise,
convergence of the clip norm to a quantile, z_Delta, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx.algorithms.privacy import adaptive_clipping
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import nonfinite
from fedjx.experiments import parts
import float_tolerance as ft
from test_algorithms_util import KEY, copy, make_cohort, stack_cohorts

EXTRA = 20_000  # An unused parameter: its update is the noise alone.


def linear_loss(params, batch):
  """``-<v, w>``: one SGD step of learning rate 1 gives ``Delta = -v``."""
  return -(batch['v'] @ params['w']) + 0.0 * jnp.sum(params['extra'])


def cohort_of(vectors, padding=0):
  """One client per vector (one example, one step), then padding clients."""
  data = [{'v': np.asarray(v, np.float32)[None]} for v in vectors]
  data += [{'v': np.zeros((0, len(vectors[0])), np.float32)}] * padding
  return make_cohort(data, batch_size=1)


def fedavg_adaptive(**options):
  return algos.fedavg(linear_loss, client_optimizer=optax.sgd(1.0),
                      aggregator=adaptive_clipping.adaptive_gaussian(**options))


def params_of(dim, extra=1):
  return {'w': jnp.zeros(dim, jnp.float32), 'extra': jnp.zeros(extra, jnp.float32)}


def reference_round(vectors, clip, d, gamma, eta):
  """The paper's round in NumPy (float64): new ``w`` and ``C``, and ``b~``."""
  deltas = -np.asarray(vectors, np.float64)  # Delta_i = x - y_i = -v_i.
  norms = np.linalg.norm(deltas, axis=1)
  clipped = deltas * np.minimum(1.0, clip / norms)[:, None]
  bits = (norms <= clip).astype(np.float64)
  fraction = (np.sum(bits - 0.5)) / d + 0.5  # Centred count, no noise.
  new_clip = clip * np.exp(-eta * (fraction - gamma))
  return -clipped.sum(0) / d, new_clip, fraction


def test_one_round_matches_numpy_and_the_next_uses_the_new_clip_norm():
  rng = np.random.default_rng(60)
  directions = rng.normal(size=(3, 5))
  directions /= np.linalg.norm(directions, axis=1, keepdims=True)
  vectors = directions * np.array([0.5, 1.5, 3.0])[:, None]
  c0, d, gamma, eta = 1.0, 4.0, 0.3, 0.25
  algo = fedavg_adaptive(noise_multiplier=0.0, clipped_count_stddev=0.0,
                         initial_clip_norm=c0, target_quantile=gamma,
                         clip_learning_rate=eta, expected_clients_per_round=d)
  cohort = cohort_of(vectors, padding=1)  # A padding client: no bit, no update.
  state, metrics = algo.round(algo.init(params_of(5)), cohort, KEY)
  w1, c1, b1 = reference_round(vectors, c0, d, gamma, eta)
  # Norms of 5 terms, a clip factor, a sum over 3 clients, a division: n = 10;
  # terms of magnitude <= the clip norm.
  tol = ft.atol(10, 3 * c0)
  np.testing.assert_allclose(state.params['w'], w1, atol=tol)
  assert float(metrics['clip_norm']) == c0
  # One unclipped client: b~ = (1 - 3/2) / 4 + 1/2, exact in float32.
  assert float(metrics['unclipped_fraction']) == b1 == 0.375
  assert float(metrics['noise_std']) == 0.0
  # C exp(-eta (b~ - gamma)): gamma and eta rounded to float32, then exp and
  # a product, a few roundings of relative size 2**-24.
  np.testing.assert_allclose(state.aggregator_state.clip_norm, c1, rtol=ft.rtol(4))
  # The second round clips with C_1 (broadcast from the aggregator's state).
  state2, metrics = algo.round(copy(state), cohort, KEY)
  dw, c2, b2 = reference_round(vectors, c1, d, gamma, eta)
  np.testing.assert_allclose(state2.params['w'], w1 + dw, atol=2 * tol)
  np.testing.assert_allclose(metrics['clip_norm'], c1, rtol=ft.rtol(4))
  assert float(metrics['unclipped_fraction']) == b2
  np.testing.assert_allclose(state2.aggregator_state.clip_norm, c2, rtol=ft.rtol(8))


def test_without_a_fixed_denominator_the_count_is_over_the_participants():
  vectors = np.array([[0.1, 0.0], [0.0, 2.0], [1.0, 1.0]])  # norms 0.1, 2, 1.41.
  algo = fedavg_adaptive(noise_multiplier=0.0, initial_clip_norm=1.5,
                         clip_learning_rate=0.5)
  state, metrics = algo.round(algo.init(params_of(2)), cohort_of(vectors, padding=2),
                              KEY)
  # Two of the three real clients are unclipped: b~ = 2 / 3, and the update
  # is the mean of the clipped updates over the 3 participants.
  np.testing.assert_allclose(metrics['unclipped_fraction'], 2 / 3, rtol=ft.rtol(2))
  np.testing.assert_allclose(state.aggregator_state.clip_norm,
                             1.5 * np.exp(-0.5 * (2 / 3 - 0.5)), rtol=ft.rtol(6))
  w, _, _ = reference_round(vectors, 1.5, 3.0, 0.5, 0.5)
  np.testing.assert_allclose(state.params['w'], w, atol=ft.atol(10, 3 * 1.5))


def test_noise_on_the_updates_and_on_the_count_has_the_paper_s_std():
  z, sigma_b, d, clip = 1.0, 2.0, 4.0, 0.5
  z_delta = (z ** -2 - (2 * sigma_b) ** -2) ** -0.5
  vectors = np.array([[0.1, 0.0], [0.0, 2.0], [1.0, 1.0]])  # bits 1, 0, 0.
  algo = fedavg_adaptive(noise_multiplier=z, clipped_count_stddev=sigma_b,
                         initial_clip_norm=clip, clip_learning_rate=0.0,
                         expected_clients_per_round=d)
  state, metrics = algo.round(algo.init(params_of(2, EXTRA)), cohort_of(vectors), KEY)
  noise = -np.asarray(state.params['extra']) * d
  np.testing.assert_allclose(metrics['noise_std'], z_delta * clip, rtol=ft.rtol(8))
  np.testing.assert_allclose(metrics['update_noise_multiplier'], z_delta,
                             rtol=ft.rtol(8))
  # The sample std of EXTRA normals has relative standard error
  # 1 / sqrt(2 EXTRA); 6 of those is a 1e-9 chance of a false failure.
  assert abs(np.mean(noise)) < 6 * z_delta * clip / np.sqrt(EXTRA)
  np.testing.assert_allclose(np.std(noise), z_delta * clip, rtol=6 / np.sqrt(2 * EXTRA))
  # The count's noise, over many keys of the server step alone: one kept
  # client unclipped of three, so D (b~ - (1 - 3/2) / D - 1/2) ~ N(0, sigma_b^2).
  agg = adaptive_clipping.adaptive_gaussian(
      noise_multiplier=z, clipped_count_stddev=sigma_b, initial_clip_norm=clip,
      expected_clients_per_round=d)
  hparams, agg_state = aggregators.init_hparams(agg), agg.init(None)

  def unclipped_fraction(key):
    clients = nonfinite.Clients(
        update={'w': jnp.zeros((3, 2))}, stats={}, extra=(), state=(),
        weights=jnp.ones(3), num_examples=jnp.ones(3),
        encoded=jnp.array([1.0, 0.0, 0.0]))
    return agg.combine(agg_state, hparams, clients, key)[2]['unclipped_fraction']

  samples = 20_000
  fractions = jax.jit(jax.vmap(fedjx.program(clients=3)(unclipped_fraction)))(
      jax.random.split(KEY, samples))
  count_noise = (np.asarray(fractions, np.float64) - ((1 - 3 / 2) / d + 0.5)) * d
  assert abs(np.mean(count_noise)) < 6 * sigma_b / np.sqrt(samples)
  np.testing.assert_allclose(np.std(count_noise), sigma_b,
                             rtol=6 / np.sqrt(2 * samples))


@pytest.mark.parametrize('gamma', [0.2, 0.5, 0.8])
def test_without_noise_the_clip_norm_converges_to_the_target_quantile(gamma):
  """Clients of known norms ``r_k = 10^(k / 100)``, ``k = 0..100``.

  With ``F(C)`` the fraction of norms ``<= C`` and ``q = r_(ceil(gamma n))``
  (n = 101, so ``gamma n`` is never an integer), ``F(C) < gamma`` below ``q``
  and ``> gamma`` from ``q`` up: ``C`` rises below ``q`` by at most
  ``exp(eta gamma)`` a round and falls from ``q`` up by at most
  ``exp(-eta (1 - gamma))``, so once in ``[q exp(-eta (1 - gamma)),
  q exp(eta gamma))`` it stays there. From ``C_0 = 0.1`` it enters within
  ``ln(10) / (eta gamma) + 0.3 / (eta / 101)`` < 1000 rounds; it does so much
  sooner (the growth is faster far from ``q``), and the test checks the last
  50 of 250 rounds.
  """
  n, rounds, eta = 101, 250, 0.2
  rng = np.random.default_rng(61)
  directions = rng.normal(size=(n, 3))
  directions /= np.linalg.norm(directions, axis=1, keepdims=True)
  vectors = (directions * 10.0 ** (np.arange(n) / 100)[:, None]).astype(np.float32)
  norms = np.sort(np.linalg.norm(vectors, axis=1))
  q = np.quantile(norms, gamma, method='inverted_cdf')
  assert q == norms[int(np.ceil(gamma * n)) - 1]
  algo = fedavg_adaptive(noise_multiplier=0.0, clipped_count_stddev=0.0,
                         initial_clip_norm=0.1, target_quantile=gamma,
                         clip_learning_rate=eta)
  cohorts = stack_cohorts([cohort_of(vectors)] * rounds)
  _, metrics = algo.run_rounds(algo.init(params_of(3)), cohorts,
                               jax.random.split(KEY, rounds))
  clips = np.asarray(metrics['clip_norm'], np.float64)
  assert clips[0] == np.float32(0.1) and np.all(np.isfinite(clips))
  # Slack: the float32 norms and the float32 exp and product of each step.
  slack = ft.rtol(16)
  low = q * np.exp(-eta * (1 - gamma)) * (1 - slack)
  high = q * np.exp(eta * gamma) * (1 + slack)
  assert np.all(clips[-50:] >= low) and np.all(clips[-50:] < high), (
      q, clips[-50:].min(), clips[-50:].max())


def test_update_noise_multiplier_pays_for_the_count():
  for z, sigma_b in [(1.0, 5.0), (0.5, 0.3), (2.0, 1.01), (1.1, 100.0)]:
    z_delta = adaptive_clipping.update_noise_multiplier(z, sigma_b)
    assert z_delta == pytest.approx((z ** -2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-15)
    assert z_delta > z  # The updates need more noise than the total.
    # Theorem 1: the two mechanisms together have noise multiplier z.
    assert (z_delta ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z, rel=1e-12)
  assert adaptive_clipping.update_noise_multiplier(0.0, 0.0) == 0.0
  # The default sigma_b = D / 20 (the paper's), in state.hparams.
  agg = adaptive_clipping.adaptive_gaussian(noise_multiplier=1.0,
                                            expected_clients_per_round=100.0)
  assert agg.hparams['clipped_count_stddev'] == 5.0
  assert agg.hparams['noise_multiplier'] == 1.0


@pytest.mark.parametrize('options, match', [
    (dict(noise_multiplier=1.0, clipped_count_stddev=0.5), 'clipped_count_stddev=0.5'),
    (dict(noise_multiplier=1.0, expected_clients_per_round=10.0),
     'clipped_count_stddev=0.5 must be > noise_multiplier / 2'),
    (dict(noise_multiplier=1.0), 'clipped_count_stddev=None needs expected_clients_per_round'),
    (dict(noise_multiplier=0.0, initial_clip_norm=0.0), 'initial_clip_norm=0.0'),
    (dict(noise_multiplier=0.0, target_quantile=1.5), 'target_quantile=1.5'),
    (dict(noise_multiplier=0.0, clip_learning_rate=-1.0), 'clip_learning_rate=-1.0'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier=-1.0'),
    (dict(noise_multiplier=0.0, expected_clients_per_round=0.0),
     'expected_clients_per_round=0.0'),
])
def test_errors_are_one_line(options, match):
  with pytest.raises(ValueError, match=match) as e:
    adaptive_clipping.adaptive_gaussian(**options)
  assert '\n' not in str(e.value) and 'adaptive_gaussian' in str(e.value)


def test_config_spec_names_the_aggregator():
  algo = algos.fedavg(linear_loss, aggregator=parts.build_aggregator(dict(
      name='adaptive_gaussian', noise_multiplier=0.5, initial_clip_norm=0.3,
      expected_clients_per_round=20.0)))
  state = algo.init(params_of(2))
  assert float(state.aggregator_state.clip_norm) == np.float32(0.3)
  assert float(state.hparams['clipped_count_stddev']) == 1.0
  with pytest.raises(ValueError, match="clip=1.0 is not an option of 'adaptive_gaussian'") as e:
    parts.build_aggregator(dict(name='adaptive_gaussian', clip=1.0))
  assert '\n' not in str(e.value)
  # A custom algorithm that does not pass its aggregator state is told so.
  agg = adaptive_clipping.adaptive_gaussian(noise_multiplier=0.0)
  with pytest.raises(ValueError, match='aggregator_state=None'):
    aggregators.encode_hparams(agg, {k: 0.0 for k in agg.hparams}, None)
