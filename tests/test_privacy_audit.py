"""The canary audit (fedjx.algorithms.privacy.audit): estimators against closed
forms, the canaries' participation and insertion, and the audit of whole runs
(with noise, without, with the noise halved by an injected bug)."""

import json
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate
from scipy import special
from scipy import stats

import fedjx
from fedjx.algorithms.privacy import accounting
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import nonfinite
from fedjx.algorithms.privacy import audit as pa
from fedjx.experiments import privacy
from fedjx.experiments import registry
from fedjx.experiments import runner
from fedjx.experiments.config import with_defaults
from fedjx.experiments.config_base import base_config, optimizer
from fedjx.experiments import parts
import float_tolerance as ft
from test_algorithms_util import KEY

S = accounting.Sampling


# ---------------------------------------------------------------- estimators

@pytest.mark.parametrize('mu', [0.5, 1.0, 3.0, 6.0])
@pytest.mark.parametrize('delta', [1e-5, 1e-3])
def test_equal_variance_gaussians_give_the_gaussian_mechanism_epsilon(mu, delta):
  # N(0, s^2) against N(mu s, s^2) is the Gaussian mechanism with noise
  # multiplier 1 / mu, whose exact epsilon is Balle and Wang 2018's
  # (dp_accounting.get_epsilon_gaussian). Both solve for epsilon to about
  # 1e-10 relative.
  expected = dp_accounting.get_epsilon_gaussian(1 / mu, delta)
  for scale, shift in ((1.0, 0.0), (0.01, -2.0)):
    got = pa.epsilon_between_gaussians(shift, scale, shift + mu * scale, scale,
                                       delta)
    assert got == pytest.approx(expected, rel=1e-8)


def hockey_stick_by_quadrature(mu_p, std_p, mu_q, std_q, eps):
  """``int max(p - e^eps q, 0)``, integrated numerically (scipy.integrate.quad)."""
  f = lambda x: max(stats.norm.pdf(x, mu_p, std_p)
                    - math.exp(eps) * stats.norm.pdf(x, mu_q, std_q), 0.0)
  lo = min(mu_p - 40 * std_p, mu_q - 40 * std_q)
  hi = max(mu_p + 40 * std_p, mu_q + 40 * std_q)
  points = np.linspace(lo, hi, 81)
  return sum(integrate.quad(f, a, b, epsabs=1e-14, epsrel=1e-10, limit=200)[0]
             for a, b in zip(points[:-1], points[1:]))


@pytest.mark.parametrize('p, q', [((0.0, 1.0), (1.5, 1.3)),
                                  ((2.0, 0.5), (0.0, 1.0)),
                                  ((0.0, 1.0), (0.8, 0.9))])
def test_unequal_variances_meet_delta_by_quadrature(p, q):
  delta = 1e-3
  eps = pa.epsilon_between_gaussians(*p, *q, delta)
  both = lambda e: max(hockey_stick_by_quadrature(*p, *q, e),
                       hockey_stick_by_quadrature(*q, *p, e))
  # quad's error is far below 1e-3 relative at these magnitudes.
  assert both(eps) == pytest.approx(delta, rel=1e-3)
  assert both(0.99 * eps) > delta
  assert math.exp(pa.log_hockey_stick(*p, *q, eps / 2)) == pytest.approx(
      hockey_stick_by_quadrature(*p, *q, eps / 2), rel=1e-3)
  assert pa.epsilon_between_gaussians(*q, *p, delta) == eps  # symmetric


def test_one_run_p_value_and_bound_against_closed_forms():
  m, r, alpha = 1000, 100, 0.05
  # delta = 0: the p-value is the binomial tail P[Binomial(r, p) >= v].
  p = special.expit(1.3)
  assert pa.one_run_p_value(m, r, 70, 1.3, 0.0) == pytest.approx(
      stats.binom.sf(69, r, p), rel=1e-12)
  # Every guess correct: P = p^r <= alpha iff epsilon <= logit(alpha^(1/r)).
  expected = special.logit(alpha ** (1 / r))
  assert pa.one_run_epsilon(m, r, r, 0.0, alpha) == pytest.approx(expected,
                                                                  rel=1e-7)
  # delta > 0 adds 2 m delta max_i P[v - i <= B < v] / i: a smaller bound.
  with_delta = pa.one_run_epsilon(m, r, r, 1e-5, alpha)
  assert 0 < with_delta < expected
  i = np.arange(1, r + 1)
  q = special.expit(with_delta)
  tail = q ** r
  between = stats.binom.sf(r - i - 1, r, q) - tail
  assert tail + 2 * m * 1e-5 * np.max(between / i) == pytest.approx(alpha,
                                                                    rel=1e-6)


def test_one_run_bound_uses_the_best_guess_count_with_bonferroni():
  m = 400
  signs = np.where(np.arange(m) % 2 == 0, 1, -1)
  scores = signs.astype(float)  # perfectly separated
  got = pa.one_run_lower_bound(scores, signs, 0.0, confidence=0.95)
  # The largest k (m / 2 = 200, all correct) gives the largest bound.
  expected = special.logit((0.05 / len(pa.GUESS_FRACTIONS)) ** (1 / 200))
  assert (got['guesses'], got['correct']) == (200, 200)
  assert got['epsilon'] == pytest.approx(expected, rel=1e-7)


def test_one_run_bound_is_wrong_at_most_one_minus_confidence_of_the_time():
  # Scores independent of the signs: epsilon = 0 holds, so a bound above 0
  # is a false claim; it may happen with probability <= 5%. 300 audits; the
  # count of false claims is at most Binomial(300, 0.05), whose 1 - 1e-6
  # quantile is 33.
  rng = np.random.default_rng(4)
  wrong = 0
  for _ in range(300):
    signs = rng.choice([-1, 1], size=200)
    bound = pa.one_run_lower_bound(rng.normal(size=200), signs, 1e-5)
    wrong += bound['epsilon'] > 0
  assert wrong <= stats.binom.isf(1e-6, 300, 0.05)


def with_moments(x, mean, std):
  """``x`` shifted and scaled to exactly this sample mean and std."""
  x = np.asarray(x, np.float64)
  return mean + std * (x - x.mean()) / x.std(ddof=1)


def test_gaussian_fit_estimate_is_the_epsilon_of_the_fitted_gaussians():
  rng = np.random.default_rng(0)
  d, delta = 10_000, 1e-5
  inserted = with_moments(rng.normal(size=300), 0.03, 0.011)
  held_out = with_moments(rng.normal(size=300), 0.0004, 0.0098)
  got = pa.gaussian_fit_estimate(held_out, inserted, delta, null_std=d ** -0.5,
                                 resamples=200)
  assert got['epsilon'] == pytest.approx(pa.epsilon_between_gaussians(
      0.0, 0.01, 0.03, 0.011, delta), rel=1e-12)
  low, high = got['interval']
  assert low < got['epsilon'] < high
  assert got['first'] == pytest.approx((0.0004, 0.0098), rel=1e-12)
  # Without a known null: the pooled standard deviation of the two groups.
  minus = with_moments(rng.normal(size=200), -0.02, 0.01)
  plus = with_moments(rng.normal(size=300), 0.03, 0.01)
  got = pa.gaussian_fit_estimate(minus, plus, delta, resamples=0)
  assert got['epsilon'] == pytest.approx(
      dp_accounting.get_epsilon_gaussian(0.01 / 0.05, delta), rel=1e-8)
  assert got['interval'] == (got['epsilon'], got['epsilon'])


# ------------------------------------------------------------------ canaries

def test_canaries_take_part_as_the_real_clients_of_the_sampler():
  rounds = jnp.arange(400)
  rate = lambda c: np.asarray(jax.vmap(lambda r: pa.participation(c, r))(rounds))
  # Poisson q = 0.3: 400 x 300 independent Bernoulli draws; their mean is
  # within 6 standard errors of q.
  poisson = rate(pa.Canaries(300, S.poisson(50, 0.3)))
  assert abs(poisson.mean() - 0.3) < 6 * math.sqrt(0.3 * 0.7 / poisson.size)
  # Fixed size 10 of 50: exactly 60 of the 300 slots each round.
  uniform = rate(pa.Canaries(300, S('uniform', 50, 10)))
  assert set(uniform.sum(axis=1)) == {60.0}
  # Shuffled epochs of 4 rounds of 10 of 45: a slot takes part at most once
  # an epoch, with probability 40 / 45, as a real client (EpochSampler).
  epochs = rate(pa.Canaries(300, S('epochs', 45, 10))).reshape(100, 4, 300)
  per_epoch = epochs.sum(axis=1)
  assert per_epoch.max() == 1.0
  p = 40 / 45
  assert abs(per_epoch.mean() - p) < 6 * math.sqrt(p * (1 - p) / per_epoch.size)
  assert S('epochs', 45, 10).rounds_per_epoch == 4


def test_canary_design_follows_the_relation_and_the_count_fits_the_cohort():
  assert pa.Canaries(10, S.poisson(50, 0.2)).design == 'insert'
  assert pa.Canaries(10, S('epochs', 50, 10)).design == 'insert'
  assert pa.Canaries(10, S('uniform', 50, 10)).design == 'swap'
  with pytest.raises(ValueError, match=r'count=12 with 10 of 50 clients per '
                     r'round: each round draws the same fraction 10/50 of the '
                     r'canaries, so count must be a multiple of 5\.'):
    pa.Canaries(12, S('uniform', 50, 10))
  with pytest.raises(ValueError, match=r'count=1; it must be an int >= 2'):
    pa.Canaries(1, S.poisson(50, 0.2))


def clients_of(updates):
  """The server's view of a cohort whose clipped updates are ``updates``."""
  n = len(updates)
  return nonfinite.Clients(update={'w': jnp.asarray(updates, jnp.float32)},
                           stats={}, extra=(), state=(), weights=jnp.ones(n),
                           num_examples=jnp.ones(n), encoded=jnp.zeros(n))


@pytest.mark.parametrize('name, denominator', [('gaussian', 4.0),
                                               ('gaussian', None),
                                               ('tree_gaussian', 4.0)])
def test_canaries_join_the_clipped_sum_before_the_noise(name, denominator):
  # Without noise the release is (sum of the clients' clipped updates + the
  # canaries' C S_i u_i) / D, for DP-FTRL the difference of the two prefix
  # sums, i.e. the round's leaf.
  dim, clip, m = 3000, 0.5, 20
  canaries = pa.Canaries(m, S('uniform', 10, 5), seed=7)  # swap, 10 a round
  agg = parts.AGGREGATORS[name](
      clip_norm=clip, noise_multiplier=0.0,
      expected_clients_per_round=denominator, canaries=canaries)
  hparams = aggregators.init_hparams(agg)
  state = agg.init({'w': jnp.zeros(dim)})
  real = np.full((3, dim), 0.01)  # three clients, updates inside the ball

  def combine(state, key):
    out, new_state, metrics = agg.combine(state, hparams, clients_of(real), key)
    return out, new_state, metrics
  program = jax.jit(fedjx.program(clients=3)(combine))
  for r in range(2):  # the second round uses the next round's slots
    out, state, metrics = program(state, KEY)
    # Independently: the slots of round r, each sending S_i C u_i.
    taking = np.asarray(pa.participation(canaries, r))
    signs = canaries.signs()
    u = np.stack([np.asarray(pa.flat_direction(7, j, dim), np.float64)
                  for j in range(m)])
    assert np.allclose(np.linalg.norm(u, axis=1), 1.0, rtol=ft.rtol(dim))
    canary_sum = clip * (taking * signs) @ u
    n, k = 3, taking.sum()
    d = denominator if denominator is not None else n + k
    expected = (real.sum(0) + canary_sum) / d
    assert float(metrics['canary_clients']) == k == 10
    # Sums of at most 13 terms of magnitude <= 0.5, one division.
    np.testing.assert_allclose(out['w'], expected, atol=ft.atol(14 + dim, 13 * clip))
    assert int(state.round) == r + 1


def test_adaptive_clipping_canaries_use_the_round_s_clip_norm_and_not_the_count():
  canaries = pa.Canaries(8, S('uniform', 4, 4), seed=1)  # every slot, swap
  agg = parts.AGGREGATORS['adaptive_gaussian'](
      noise_multiplier=0.0, clipped_count_stddev=0.0, initial_clip_norm=0.3,
      expected_clients_per_round=2.0, canaries=canaries)
  plain = parts.AGGREGATORS['adaptive_gaussian'](
      noise_multiplier=0.0, clipped_count_stddev=0.0, initial_clip_norm=0.3,
      expected_clients_per_round=2.0)
  hparams = aggregators.init_hparams(agg)
  like = {'w': jnp.zeros(500)}
  clients = clients_of(np.zeros((2, 500)))._replace(encoded=jnp.array([1.0, 0.0]))
  run = lambda a, s: jax.jit(fedjx.program(clients=2)(
      lambda s, k: a.combine(s, hparams, clients, k)))(s, KEY)
  out, state, metrics = run(agg, agg.init(like))
  out0, state0, metrics0 = run(plain, plain.init(like))
  # The count, hence the next clip norm, is the one without canaries.
  assert float(metrics['unclipped_fraction']) == float(metrics0['unclipped_fraction'])
  assert float(state.inner.clip_norm) == float(state0.clip_norm)
  u = np.stack([np.asarray(pa.flat_direction(1, j, 500)) for j in range(8)])
  expected = 0.3 * canaries.signs() @ u / 2.0
  np.testing.assert_allclose(out['w'], expected, atol=ft.atol(8 + 500, 8 * 0.3))


# ------------------------------------------------------------ whole runs

def audited_config(noise=2.0, sampling='epochs', clients=20, cohort=10,
                   rounds=20, canaries=1000, delta=1e-4, seed=0):
  """DP-FedAvg on digits with canaries: by default 20 clients in shuffled
  epochs of 2 rounds (each client, and each canary, in 10 of the 20 rounds),
  an MLP of 19,210 parameters, delta = 1e-4."""
  c = base_config()
  c.seed, c.rounds, c.cohort_size, c.batch_size = seed, rounds, cohort, 10
  c.local_epochs, c.eval_every, c.checkpoint_every = 1, rounds, rounds
  c.progress, c.plot, c.tensorboard = False, False, False
  c.nonfinite, c.execution = 'off', 'jit'
  c.dataset = dict(name='digits', num_clients=clients, alpha=0.5)
  c.model = dict(name='mlp', hidden=(256,))
  c.algorithm = dict(name='dp_fedavg', clip_norm=1.0, noise_multiplier=noise,
                     expected_clients_per_round=float(cohort),
                     client_optimizer=optimizer('sgd', learning_rate=0.1))
  c.sampling = dict(name=sampling)
  c.privacy = dict(delta=delta, audit=dict(canaries=canaries, resamples=200))
  return c


def last_row(result):
  return result.history[-1]


@pytest.mark.slow
def test_with_noise_the_estimate_stays_below_the_accountant_s_epsilon(tmp_path):
  # Each canary is in 10 of the 20 rounds, the noise of all 20 is in the
  # final model: the final-model statistic sees mean shift 10 C over noise
  # sqrt(20) z C, against the accountant's sqrt(10) / z (ten Gaussian
  # mechanisms): about 0.71 of it. In 5,000 simulations of the cosines in
  # this model (inserted: 10 + N(0, 20 z^2), in units of C / D; held out:
  # the exact null) the estimate from 1,000 canaries was below the
  # accountant's 7.22 in all, at most 7.07, median 4.75; with 400 canaries
  # it was above in 89 of them (the fitted standard deviation is noisier).
  lines = []
  result = runner.run(audited_config(), str(tmp_path), log=lines.append)
  row = last_row(result)
  assert row['epsilon'] == pytest.approx(accounting.epsilon(
      2.0, 20, 1e-4, sampling=S('epochs', 20, 10)), rel=1e-12)
  assert row['audit_epsilon'] < row['epsilon']
  assert row['audit_epsilon_lower_bound'] < row['epsilon']
  assert row['audit_epsilon_low'] <= row['audit_epsilon'] <= row['audit_epsilon_high']
  statement = json.loads((tmp_path / 'privacy.json').read_text())
  audit = statement['audit']
  assert audit['epsilon_estimate'] == row['audit_epsilon']
  assert audit['accountant_epsilon'] == statement['epsilon'] == row['epsilon']
  assert (audit['design'], audit['relation'], audit['dimension']) == (
      'insert', 'zero_out', 64 * 256 + 256 + 256 * 10 + 10)
  # The held-out canaries' cosines are those of directions the model never
  # saw: mean 0 and standard deviation 1 / sqrt(d), within sampling error.
  held = audit['cosine_held_out']
  d = audit['dimension']
  assert abs(held['mean']) < 6 * d ** -0.5 / math.sqrt(held['count'])
  assert held['std'] == pytest.approx(d ** -0.5, rel=6 / math.sqrt(2 * held['count']))
  assert [l for l in lines if l.startswith('fedjx: privacy audit: ')] == [
      f"fedjx: privacy audit: {audit['statement']}"]
  # Resuming the finished run audits the saved model again: the same numbers.
  runner.run(audited_config(), str(tmp_path), log=lines.append)
  again = json.loads((tmp_path / 'privacy.json').read_text())['audit']
  assert again == audit


@pytest.mark.slow
def test_without_noise_the_estimate_is_large(tmp_path):
  result = runner.run(audited_config(noise=0.0), str(tmp_path), log=print)
  row = last_row(result)
  assert row['epsilon'] == math.inf
  # Without noise only the other updates' projections spread the cosines:
  # several times the estimate with z = 2 (about 5), above any epsilon a
  # useful guarantee states.
  assert row['audit_epsilon_low'] > 20
  # Every one of the auditor's best guesses is right; the one-run bound is
  # then the closed form of that count.
  audit = json.loads((tmp_path / 'privacy.json').read_text())['audit']
  k = audit['lower_bound_guesses']
  assert audit['lower_bound_correct'] == k == 500
  assert row['audit_epsilon_lower_bound'] == pytest.approx(pa.one_run_epsilon(
      1000, k, k, 1e-4, 0.05 / len(pa.GUESS_FRACTIONS)), rel=1e-12)


@pytest.mark.slow
def test_with_the_noise_halved_the_estimate_exceeds_the_reported_epsilon(
    tmp_path, monkeypatch):
  # An injected bug: the aggregator adds half the noise the accountant
  # assumes. The statistic's shift over its noise doubles (about 1.41 of
  # the accountant's); in the 5,000 simulations above the estimate was at
  # least 9.46, median 10.8.
  original = aggregators.add_gaussian_noise
  monkeypatch.setattr(aggregators, 'add_gaussian_noise',
                      lambda tree, std, key: original(tree, std / 2, key))
  result = runner.run(audited_config(), str(tmp_path), log=print)
  row = last_row(result)
  assert row['epsilon'] == pytest.approx(7.2216, abs=1e-4)  # still reported
  assert row['audit_epsilon_low'] > row['epsilon']


@pytest.mark.slow
def test_the_swap_audit_catches_the_fixed_size_sensitivity_defect(tmp_path):
  # Fixed-size cohorts, every client every round (10 of 10, as in
  # configs/dp_diloco_digits.py): canaries send +C u or -C u, replace-one
  # neighbours. The corrected accountant composes z / 2; the defect composed
  # z, as if the sensitivity were C. The audit measures the replace-one
  # shift 2 K C and lands near the corrected epsilon, far above the old one.
  config = audited_config(noise=3.0, sampling='uniform', clients=10, cohort=10,
                          rounds=10)
  result = runner.run(config, str(tmp_path), log=print)
  row = last_row(result)
  old = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  with accounting.quiet_rdp():
    old.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            10, 10, dp_accounting.GaussianDpEvent(3.0)), 10))
  reported_before = old.get_epsilon(1e-4)
  assert reported_before == pytest.approx(4.443, abs=1e-3)
  assert row['epsilon'] == pytest.approx(10.309, abs=1e-3)
  assert row['audit_epsilon_low'] > reported_before
  audit = json.loads((tmp_path / 'privacy.json').read_text())['audit']
  assert (audit['design'], audit['relation']) == ('swap', 'replace_one')


def test_canaries_do_not_enter_the_utility_metrics(tmp_path):
  with_audit = audited_config(rounds=2)
  without = audited_config(rounds=2)
  without.privacy = dict(delta=1e-4)
  a = runner.run(with_audit, str(tmp_path / 'a'), log=print).history
  b = runner.run(without, str(tmp_path / 'b'), log=print).history
  assert a[0] == {**b[0], 'elapsed_s': a[0]['elapsed_s']}  # the initial model
  first_a, first_b = a[1], b[1]
  # Round 1 trains the same clients from the same model: every client metric
  # (clients, examples, train_loss_*, train_accuracy_*, clipped_fraction,
  # mean_update_norm) is the same. The canaries show in canary_clients and
  # in pseudo_grad_norm, the norm of the aggregate the server applies.
  client_metrics = set(first_b) - {'pseudo_grad_norm', 'elapsed_s'}
  assert {'clients', 'examples', 'train_loss_before', 'train_loss_after',
          'clipped_fraction', 'mean_update_norm'} <= client_metrics
  for key in client_metrics:
    assert first_a[key] == first_b[key], key
  assert first_a['pseudo_grad_norm'] != first_b['pseudo_grad_norm']
  assert 'canary_clients' not in first_b and first_a['canary_clients'] > 0
  assert 'audit_epsilon' in a[-1] and 'audit_epsilon' not in b[-1]


def streaming_diloco():
  c = audited_config()
  c.algorithm = dict(name='streaming_diloco', aggregator=dict(
      name='gaussian', noise_multiplier=1.0, expected_clients_per_round=10.0))
  return c


def fedavg():
  c = audited_config()
  c.algorithm = dict(name='fedavg')
  return c


@pytest.mark.parametrize('make, message', [
    (fedavg,
     r"config.privacy.audit is set but algorithm 'fedavg' adds no DP noise"),
    (streaming_diloco,
     r"algorithm 'streaming_diloco' does not aggregate the whole model once "
     r'a round'),
    (lambda: audited_config(sampling='uniform', cohort=6, canaries=25),
     r'config.privacy.audit: Canaries: count=25 with 6 of 20 clients per '
     r'round: each round draws the same fraction 6/20 of the canaries, so '
     r'count must be a multiple of 10\.'),
])
def test_an_audit_that_cannot_run_is_refused_in_one_line(make, message):
  with pytest.raises(registry.ConfigError, match=message) as e:
    privacy.plan(with_defaults(make()), 20)
  assert '\n' not in str(e.value)


def test_audit_options_are_checked():
  config = audited_config()
  config.privacy = dict(delta=1e-4, audit=dict(canary=10))
  with pytest.raises(registry.ConfigError,
                     match=r"config.privacy.audit\['canary'\] is unknown"):
    with_defaults(config)
  config.privacy = dict(delta=1e-4, audit=dict(canaries=1))
  with pytest.raises(registry.ConfigError,
                     match=r"config.privacy.audit\['canaries'\]=1; it must be "
                           r'an int >= 2'):
    with_defaults(config)
  config.privacy = dict(delta=1e-4, audit=dict(canaries=10))
  filled = with_defaults(config).privacy.audit
  assert dict(filled) == {'canaries': 10, 'seed': None, 'confidence': 0.95,
                          'resamples': 1000}
