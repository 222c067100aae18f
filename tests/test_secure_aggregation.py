"""Secure sum (SecAgg / SecAgg+ with dropouts), distributed Skellam DP, local DP.

The modular arithmetic is checked against NumPy integers (exact), the
means against float64 NumPy with the bound the rounding gives (each
client's randomized rounding moves its scaled vector by less than 1 per
coordinate, so the mean of ``n`` clients by less than ``sqrt(D) / s`` in
norm), the accounting against ``dp_accounting`` where it has the same
mechanism (the Gaussian limit, local Gaussian reports) and against the
inequalities every amplification bound must satisfy.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.compression import compressors as compression
from fedjx.algorithms.privacy import distributed_dp as DD
from fedjx.algorithms.aggregators import secure as S
from fedjx.experiments import parts
import float_tolerance as ft
from test_algorithms_util import (KEY, linreg_data, linreg_loss, linreg_params,
                                  make_cohort)
from test_compression import aggregate


def updates(n, seed=0, scale=0.1):
  rng = np.random.default_rng(seed)
  return {'w': jnp.asarray(rng.normal(size=(n, 5, 2)) * scale, jnp.float32),
          'b': jnp.asarray(rng.normal(size=(n,)) * scale, jnp.float32)}


def clipped_mean(u, alive, clip):
  flat = np.concatenate([np.asarray(u['b'], np.float64)[:, None],
                         np.asarray(u['w'], np.float64).reshape(len(alive), -1)], 1)
  norms = np.linalg.norm(flat, axis=1, keepdims=True)
  flat = flat * np.minimum(1.0, clip / norms)
  return flat[np.asarray(alive, bool)].mean(0)


def flat_of(tree):
  return np.concatenate([np.asarray(tree['b'], np.float64).reshape(1),
                         np.asarray(tree['w'], np.float64).reshape(-1)])


def test_masks_cancel_in_the_modular_sum_with_dropouts():
  """sum_{alive} (v_i + mask_i) - unmasking = sum_{alive} v_i  (mod m), exactly."""
  bits, n, length = 12, 9, 33
  key = jax.random.PRNGKey(4)
  offsets = S.graph_offsets(n, 4)
  table = S.neighbor_table(key, n, offsets)
  alive = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1], bool)
  rng = np.random.default_rng(1)
  v = rng.integers(0, 2 ** bits, size=(n, length))
  masked = np.stack([np.asarray(S.masks(key, jnp.int32(i), table[i], length, bits),
                                np.int64) for i in range(n)]) + v
  total = masked[alive].sum(0)
  unmask = np.asarray(S.unmasking(key, jnp.asarray(alive), table, length, bits),
                      np.int64)
  np.testing.assert_array_equal((total - unmask) % 2 ** bits,
                                v[alive].sum(0) % 2 ** bits)
  # A single masked vector is not the value (the masks are not zero).
  assert np.mean(masked[0] % 2 ** bits == v[0]) < 0.1


def test_neighbor_table_is_a_harary_graph():
  n, k = 10, 4
  table = np.asarray(S.neighbor_table(KEY, n, S.graph_offsets(n, k)))
  for i in range(n):
    assert len(set(table[i])) == k and i not in table[i]
    for j in table[i]:
      assert i in table[j]  # symmetric
  full = np.asarray(S.neighbor_table(KEY, 5, S.graph_offsets(5, None)))
  assert all(sorted(full[i]) == [j for j in range(5) if j != i] for i in range(5))


def test_centered_modular_values():
  for bits in (8, 31, 32):
    m = 2 ** bits
    ints = np.array([0, 1, m // 2 - 1, -1, -(m // 2), 5 - m // 2], np.int64)
    res = S.to_modular(jnp.asarray(ints.astype(np.int32)), bits)
    np.testing.assert_array_equal(np.asarray(res, np.int64), ints % m)
    np.testing.assert_array_equal(np.asarray(S.centered(res, bits)), ints)


@pytest.mark.slow
@pytest.mark.parametrize('neighbors', [None, 4])
def test_secure_sum_is_the_mean_of_the_survivors(neighbors):
  n, clip = 8, 0.3
  u = updates(n)
  alive = np.array([1, 1, 0, 1, 1, 1, 1, 1], np.float32)
  agg = S.secure_sum(bits=24, clip_norm=clip, threshold=2, neighbors=neighbors)
  mean, _, metrics = aggregate(agg, u, jnp.asarray(alive))
  assert float(metrics['secagg_failed']) == 0.0
  expect = clipped_mean(u, alive, clip)
  s = (2 ** 23 - 1) / (n * clip)  # the default scale
  d_pad = 16
  err = np.linalg.norm(flat_of(mean) - expect)
  assert err <= math.sqrt(d_pad) / s + ft.gamma(64) * np.abs(expect).sum()
  k = 7 if neighbors is None else 4
  # 16 coordinates of 24 bits in 12 words, the protocol's keys and shares.
  assert float(metrics['upload_bits']) == 12 * 32 + 512 + 768 * k
  assert float(metrics['secagg_client_ops']) == k * k + 16 * k
  assert float(metrics['secagg_survivors']) == 7


@pytest.mark.slow
def test_secure_sum_fails_when_a_survivor_lacks_t_live_neighbours():
  n, k, t = 8, 2, 2
  key = S.secure_sum(threshold=t, neighbors=k).init({'w': jnp.zeros(3)}).key
  table = np.asarray(S.neighbor_table(key, n, S.graph_offsets(n, k)))
  alive = np.ones(n, bool)
  alive[table[0][0]] = False  # client 0 keeps one live neighbour of two
  u = {'w': jnp.ones((n, 3)) * 0.1}
  mean, _, metrics = aggregate(S.secure_sum(threshold=t, neighbors=k), u,
                               jnp.asarray(alive, jnp.float32))
  assert float(metrics['secagg_failed']) == 1.0
  np.testing.assert_array_equal(np.asarray(mean['w']), 0.0)
  # With t = 1 the same dropout can be unmasked.
  mean, _, metrics = aggregate(S.secure_sum(threshold=1, neighbors=k), u,
                               jnp.asarray(alive, jnp.float32))
  assert float(metrics['secagg_failed']) == 0.0


def test_secure_sum_wraps_modulo_m():
  """A scale too large for the modulus wraps the sum: the result is the
  centred residue of the true integer sum, as in Z_m."""
  u = {'w': jnp.asarray([[0.9, -0.2], [0.8, 0.1], [0.7, 0.3]], jnp.float32)}
  bits, scale = 8, 100.0
  agg = S.secure_sum(bits=bits, clip_norm=10.0, threshold=1, rotation=False,
                     scale=scale)
  mean, _, _ = aggregate(agg, u, jnp.ones(3))
  total = np.asarray(mean['w'], np.float64) * 3 * scale  # the server's sum
  exact = np.asarray(u['w'], np.float64).sum(0) * scale   # 240, 20 unrounded
  m = 2 ** bits
  wrapped = (np.round(exact) + m // 2) % m - m // 2
  # Rounding moves each client's value by < 1: the sum by < 3.
  assert np.all(np.abs(total - wrapped) < 3 + 1e-3)
  assert total[0] < 0  # 240 wraps to about -16


def test_refusals_in_one_line():
  with pytest.raises(ValueError, match='threshold=5 exceeds neighbors=4'):
    S.secure_sum(threshold=5, neighbors=4)
  with pytest.raises(ValueError, match='neighbors=3 must be an even int'):
    S.secure_sum(neighbors=3)
  with pytest.raises(ValueError, match='bits=40'):
    S.secure_sum(bits=40)
  with pytest.raises(ValueError, match='needs a cohort of at least 5'):
    aggregate(S.secure_sum(threshold=4), {'w': jnp.ones((3, 2))}, jnp.ones(3))
  with pytest.raises(ValueError, match="sampling='poisson' needs sampling_rate"):
    DD.distributed_skellam(sampling='poisson')


@pytest.mark.slow
def test_fedavg_through_secure_sum_equals_the_clipped_mean():
  """One FedAvg round with the secure sum against the noiseless Gaussian
  aggregator (the same clipped mean, uniform weights): equal to the
  secure sum's rounding bound sqrt(D) / s."""
  data = linreg_data(np.random.default_rng(80), [6, 4, 5], dim=3, shift=4.0)
  cohort = make_cohort(data, batch_size=3)
  clip = 0.5
  out = []
  for agg in (dict(name='gaussian', clip_norm=clip, noise_multiplier=0.0),
              dict(name='secure_sum', clip_norm=clip, threshold=1, bits=20)):
    algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1),
                        aggregator=parts.build_aggregator(agg))
    state, _ = algo.round(algo.init(linreg_params(3)), cohort, KEY)
    out.append(flat_of(state.params))
  s = (2 ** 19 - 1) / (3 * clip)
  assert np.linalg.norm(out[0] - out[1]) <= math.sqrt(4) / s + ft.gamma(64) * 2


# ---------------------------------------------------------- distributed DP

@pytest.mark.parametrize('mu,n', [(50.0, 20000), (2e8, 4000)])  # 2e8: 18 bits
def test_skellam_noise_has_its_variance(mu, n):
  """Sample variance of 20000 draws within 6 standard errors of ``mu``
  (the variance of a sample variance is about ``2 mu^2 / N`` for a nearly
  normal variable, plus the excess kurtosis ``mu`` term: ``(2 mu^2 + mu) / N``).
  At 2e8 a single float32 Poisson draw has 19% too much variance, 6
  standard errors are 13% with 4000 draws."""
  x = np.asarray(jax.jit(DD.skellam_noise, static_argnums=(1, 2))(KEY, n, mu),
                 np.float64)
  assert abs(x.mean()) <= 6 * math.sqrt(mu / n)
  assert abs(x.var(ddof=1) - mu) <= 6 * math.sqrt((2 * mu ** 2 + mu) / n)


def test_skellam_rdp_tends_to_the_gaussians():
  """With ``s`` large ``Delta_2 / sqrt(mu) -> 1 / z`` and the other terms
  vanish: epsilon approaches the Gaussian mechanism's at the same orders
  (dp_accounting's RDP accountant, replace-one sensitivity 2C: noise
  multiplier z / 2)."""
  import dp_accounting
  z, rounds, delta, d = 2.0, 50, 1e-5, 1024
  ours = DD.skellam_epsilon(z, 1.0, 1e9, d, rounds, delta)
  acc = dp_accounting.rdp.RdpAccountant(orders=[float(a) for a in DD.ORDERS])
  acc.compose(dp_accounting.GaussianDpEvent(z / 2), rounds)
  theirs = acc.get_epsilon(delta)
  # Delta_2 = C s + sqrt(d): relative excess sqrt(d) / s = 3.2e-8 on z.
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  # Fewer bits (smaller s): a weaker guarantee.
  assert DD.skellam_epsilon(z, 1.0, 100.0, d, rounds, delta) > ours


def test_subsampled_rdp_bounds_are_valid_and_amplify():
  """Zhu-Wang's Poisson bound lies between the tight subsampled Gaussian
  RDP (dp_accounting; no valid bound is below it) and the unsampled RDP."""
  import dp_accounting
  z, q = 1.5, 0.05
  orders = list(range(2, 40))
  base_rdp = np.array([a / (2 * z ** 2) for a in orders])  # Gaussian, add/remove
  ours = DD.poisson_subsampled_rdp(base_rdp, q, orders)
  acc = dp_accounting.rdp.RdpAccountant(orders=[float(a) for a in orders])
  acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
  tight = np.asarray(acc._rdp)  # pylint: disable=protected-access
  assert np.all(ours >= tight * (1 - 1e-9)) and np.all(ours <= base_rdp)
  assert ours[0] < 0.1 * base_rdp[0]
  wor = DD.without_replacement_rdp(base_rdp, q, orders)
  assert np.all(wor <= base_rdp) and wor[0] < 0.1 * base_rdp[0]


@pytest.mark.slow
def test_distributed_skellam_reports_its_epsilon_and_adds_its_noise():
  n, clip, z = 6, 0.3, 0.5
  u = updates(n)
  spec = dict(clip_norm=clip, noise_multiplier=z, bits=16, clients_per_round=n,
              threshold=2)
  agg = DD.distributed_skellam(**spec)
  state = agg.init(jax.tree.map(lambda x: x[0], u))
  errors = []
  for r in range(2):
    mean, state, metrics = aggregate(agg, u, jnp.ones(n), state=state,
                                     key=jax.random.fold_in(KEY, r))
    errors.append(flat_of(mean) - clipped_mean(u, np.ones(n), clip))
  s = DD.default_scale(16, clip, z, n, 3, 16, 3.0)
  np.testing.assert_allclose(float(metrics['ddp_scale']), s, rtol=ft.rtol(4))
  np.testing.assert_allclose(
      float(metrics['ddp_epsilon']),
      DD.skellam_epsilon(z, clip, s, 16, 2, 1e-5), rtol=1e-4)  # float32 sums of RDP
  # The sum's noise is Sk(n mu / n_min) per rotated coordinate (all six add
  # mu / 3), over the scale and n: per coordinate of the mean, variance
  # 2 (z C)^2 / n^2 (rotation is orthogonal). 2 rounds x 13 coordinates.
  var = (n / 3) * (z * clip) ** 2 / n ** 2
  sq = np.sum(np.concatenate(errors) ** 2) / (2 * 13)
  # A chi-square over 26 terms (only 13 of 16 rotated coordinates are kept,
  # a projection: the mean of the kept squares has the same expectation).
  assert abs(sq / var - 1) <= 6 * math.sqrt(2 / 26)


def test_local_gaussian_and_its_epsilon():
  import dp_accounting
  n = 5
  u = updates(n, scale=1.0)
  mean, _, metrics = aggregate(DD.local_gaussian(clip_norm=0.5, noise_multiplier=0.0),
                               u, jnp.ones(n))
  np.testing.assert_allclose(flat_of(mean), clipped_mean(u, np.ones(n), 0.5),
                             atol=ft.atol(8, 0.5))
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.GaussianDpEvent(2.0), 10)
  assert DD.local_gaussian_epsilon(4.0, 10, 1e-5) == acc.get_epsilon(1e-5)
  with pytest.raises(ValueError, match='noise_multiplier=0'):
    DD.local_gaussian_epsilon(0, 1, 1e-5)


def test_the_runner_refuses_a_budget_on_a_self_accounted_aggregator():
  import ml_collections
  from fedjx.experiments import privacy
  from fedjx.experiments.config import ConfigError
  config = ml_collections.ConfigDict(dict(
      algorithm=dict(name='fedavg', aggregator=dict(name='distributed_skellam')),
      privacy=dict(target_epsilon=8.0), sampling=dict(name='uniform'),
      cohort_size=10, rounds=5))
  with pytest.raises(ConfigError, match="ddp_epsilon metric"):
    privacy.plan(config, 50)
  config.privacy.target_epsilon = None
  assert privacy.plan(config, 50) is None


def _skellam_run_config(**aggregator):
  """FedAvg through distributed Skellam on 50 digits clients, 20 a round."""
  from fedjx.experiments.config_base import base_config, optimizer
  c = base_config()
  c.seed, c.rounds, c.cohort_size, c.batch_size = 0, 2, 20, 32
  c.local_epochs, c.max_local_steps = 1, 1
  c.eval_every, c.checkpoint_every = 100, 100
  c.progress, c.plot, c.tensorboard = False, False, False
  c.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  c.model = dict(name='logistic_regression')
  c.algorithm = dict(
      name='fedavg', client_optimizer=optimizer('sgd', learning_rate=0.1),
      aggregator=dict(name='distributed_skellam', clip_norm=0.5,
                      noise_multiplier=1.0, bits=12, threshold=5, **aggregator))
  return c


def test_the_runner_gives_distributed_dp_the_runs_sampling():
  """The issue's run: 20 of 50 digits clients a round, the MLP (d = 9,610,
  D_pad = 16,384), 12 bits, the scale chosen for 10 clients, 50 rounds. The
  aggregator the runner builds accounts 50 rounds at the epsilon of
  ``skellam_epsilon`` called with the run's sampling (uniform, 20 / 50):
  262, where its own defaults (no amplification) gave another number."""
  from fedjx.algorithms import aggregators
  from fedjx.experiments import privacy
  from fedjx.experiments.config import with_defaults
  config = with_defaults(_skellam_run_config(clients_per_round=10))
  spec = privacy.algorithm_spec(config, 50)['aggregator']
  agg = parts.build_aggregator(dict(spec))
  d = 64 * 128 + 128 + 128 * 10 + 10
  state = agg.init({'w': jnp.zeros((d,), jnp.float32)})
  pad = compression.next_power_of_two(d)
  clip, z, delta = 0.5, 1.0, 1e-5
  s = DD.default_scale(12, clip, z, 10, 6, pad, 3.0)
  expect = DD.skellam_epsilon(z, clip, s, pad, 50, delta, 'uniform', 20 / 50)
  assert round(expect) == 262
  rdp = DD.skellam_round_rdp(z, clip, s, pad, 'uniform', 20 / 50)
  # The aggregator keeps the round's RDP in float32 (relative u = 2^-24).
  np.testing.assert_allclose(np.asarray(state.round_rdp), rdp, rtol=ft.rtol(1))
  assert DD.rdp_to_epsilon(50 * np.asarray(state.round_rdp, np.float64),
                           delta) == pytest.approx(expect, rel=ft.rtol(50))


@pytest.mark.slow
def test_the_runner_accounts_distributed_dp_for_the_runs_own_sampling(tmp_path):
  """``ddp_epsilon`` of a run of 20 of 50 clients a round is the Skellam
  accountant's for that sampling: ``skellam_epsilon`` called with the run's
  parameters (uniform, m / N = 20 / 50; the scale chosen for n = 20
  clients, the run's cohort), not the aggregator's defaults (no
  amplification, n = 10)."""
  from fedjx.experiments import runner
  config = _skellam_run_config()
  result = runner.run(config, str(tmp_path))
  rows = [h for h in result.history if h['round'] > 0]
  clip, z, delta = 0.5, 1.0, 1e-5
  d = compression.next_power_of_two(64 * 10 + 10)  # logistic regression on 8x8 digits
  s = DD.default_scale(12, clip, z, 20, 6, d, 3.0)
  for r, row in enumerate(rows, start=1):
    assert row['secagg_failed'] == 0.0
    expect = DD.skellam_epsilon(z, clip, s, d, r, delta, 'uniform', 20 / 50)
    # In the round: the round's RDP cast to float32 and summed r <= 2 times,
    # then per order 4 float32 terms of magnitude at most eps + |log delta|
    # each (n <= 8 roundings).
    assert row['ddp_epsilon'] == pytest.approx(
        expect, abs=ft.atol(8, 4 * (expect + abs(math.log(delta)))))
  np.testing.assert_allclose(rows[-1]['ddp_scale'], s, rtol=ft.rtol(4))


def test_the_runner_refuses_a_skellam_sampling_that_is_not_the_runs():
  from fedjx.experiments import privacy
  from fedjx.experiments.config import ConfigError, with_defaults
  config = with_defaults(_skellam_run_config(sampling='uniform',
                                             sampling_rate=0.2))
  with pytest.raises(ConfigError) as e:
    privacy.algorithm_spec(config, 50)
  text = str(e.value)
  assert '\n' not in text and "sampling_rate=0.2 is not the run's" in text
  assert '20 of 50 clients' in text and 'rate 0.4' in text
  # The run's own values are accepted; Poisson needs the fixed denominator.
  config = with_defaults(_skellam_run_config(sampling='uniform',
                                             sampling_rate=0.4))
  spec = privacy.algorithm_spec(config, 50)['aggregator']
  assert spec['sampling'] == privacy.sampling_of(config, 50)
  assert spec['clients_per_round'] == 20 and 'sampling_rate' not in spec
  config = with_defaults(_skellam_run_config())
  config.sampling = dict(name='poisson')
  with pytest.raises(ConfigError, match='set expected_clients_per_round=20'):
    privacy.algorithm_spec(config, 50)


def test_skellam_accounting_takes_its_relation_from_the_sampling():
  """The run's Sampling gives the relation (accounting.sensitivity): fixed
  cohorts are replace-one (2 Delta), Poisson add-or-remove (Delta), epochs
  zero-out (Delta) with ceil(R / E) compositions and no amplification."""
  from fedjx.algorithms.privacy import accounting
  z, clip, s, d, delta = 1.0, 0.5, 300.0, 1024, 1e-5
  uniform = accounting.Sampling('uniform', 50, 20)
  poisson = accounting.Sampling.poisson(50, 0.4)
  epochs = accounting.Sampling('epochs', 50, 10)  # E = 5
  assert DD.skellam_epsilon(z, clip, s, d, 7, delta, uniform) == \
      DD.skellam_epsilon(z, clip, s, d, 7, delta, 'uniform', 0.4)
  assert DD.skellam_epsilon(z, clip, s, d, 7, delta, poisson) == \
      DD.skellam_epsilon(z, clip, s, d, 7, delta, 'poisson', 0.4)
  l2, l1 = DD.skellam_sensitivity(clip, s, d)
  rdp = DD.skellam_rdp(DD.ORDERS, l2, l1, (z * clip * s) ** 2)
  assert DD.skellam_epsilon(z, clip, s, d, 7, delta, epochs) == \
      DD.rdp_to_epsilon(2 * rdp, delta)  # ceil(7 / 5) = 2 epochs
