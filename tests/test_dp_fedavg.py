"""DP-FedAvg: clipping, noise scale and privacy accounting."""

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
from test_algorithms_util import KEY, assert_trees_close, copy, linreg_data, make_cohort
from test_algorithms_util import CHAIN, reference_sgd

EXTRA = 20_000  # An unused parameter: its update is the noise alone.


def loss_fn(params, batch):
  pred = batch['x'] @ params['w'] + params['b']
  return 0.5 * jnp.square(pred - batch['y']) + 0.0 * jnp.sum(params['extra'])


def test_clip_update_bounds_every_contribution():
  rng = np.random.default_rng(50)
  for scale in (0.01, 1.0, 100.0):
    u = {'a': jnp.asarray(rng.normal(size=(7,)) * scale, jnp.float32),
         'b': jnp.asarray(rng.normal(size=(2, 3)) * scale, jnp.float32)}
    clipped, norm = algos.aggregators.clip_update(u, 0.5)
    # Norms of 13 numbers: 13 squares summed, a square root (n = 15).
    np.testing.assert_allclose(norm, optax.tree.norm(u), rtol=ft.rtol(15))
    out = float(optax.tree.norm(clipped))
    assert out <= 0.5 * (1 + ft.rtol(15 + 2))  # (+2: the clip factor)
    if float(norm) <= 0.5:
      jax.tree.map(np.testing.assert_array_equal, clipped, u)
    else:
      np.testing.assert_allclose(out, 0.5, rtol=ft.rtol(15 + 2))
  zero, norm = algos.aggregators.clip_update({'a': jnp.zeros(3)}, 1.0)
  assert float(norm) == 0 and not np.any(np.isnan(zero['a']))


def test_round_clips_then_adds_noise_of_std_z_c():
  sizes = [6, 4, 5]
  data = linreg_data(np.random.default_rng(51), sizes, dim=3, shift=4.0)
  params = {'w': jnp.zeros(3), 'b': jnp.zeros(()), 'extra': jnp.zeros(EXTRA)}
  cohort = make_cohort(data, batch_size=3)
  clip, lr = 0.2, 0.1
  algo = algos.dp_fedavg(loss_fn, clip_norm=clip, noise_multiplier=0.0,
                         client_optimizer=optax.sgd(lr))
  state0 = algo.init(params)
  # No noise: the update is the mean of the clipped client updates.
  state, metrics = algo.round(copy(state0), cohort, KEY)
  deltas = []
  for d in data:
    y, _ = reference_sgd(loss_fn, params, d, 3, lr)
    delta = jax.tree.map(jnp.subtract, params, y)
    norm = float(optax.tree.norm(delta))
    assert norm > clip  # Every client is clipped in this setup.
    deltas.append(jax.tree.map(lambda u: u * clip / norm, delta))
  expected = jax.tree.map(lambda p, *ds: p - sum(ds) / 3, params, *deltas)
  assert_trees_close(state.params, expected)
  for d in deltas:  # No client's contribution exceeds C after clipping.
    assert float(optax.tree.norm(d)) <= clip * (1 + ft.rtol(CHAIN))
  assert float(metrics['clipped_fraction']) == 1.0
  # Noise (z traced, same compiled round): the sum gets N(0, (z C)^2); the
  # unused parameter's update is that noise over the 3 clients.
  z = 1.5
  hp = dict(state0.hparams, noise_multiplier=jnp.float32(z))
  state, metrics = algo.round(copy(state0)._replace(hparams=hp), cohort, KEY)
  noise = -np.asarray(state.params['extra']) * 3
  assert abs(np.mean(noise)) < 4 * z * clip / np.sqrt(EXTRA)
  # The sample std of EXTRA normals has relative standard error
  # 1 / sqrt(2 EXTRA) = 0.005; 6 of those is a 1e-9 chance of a false failure.
  np.testing.assert_allclose(np.std(noise), z * clip, rtol=6 / np.sqrt(2 * EXTRA))
  np.testing.assert_allclose(metrics['noise_std'], z * clip, rtol=ft.rtol(1))


def test_fixed_denominator_and_padding_clients():
  data = linreg_data(np.random.default_rng(52), [4, 4], dim=3)
  data.append({k: v[:0] for k, v in data[0].items()})  # A padding client.
  params = {'w': jnp.zeros(3), 'b': jnp.zeros(()), 'extra': jnp.zeros(4)}
  algo = algos.dp_fedavg(loss_fn, clip_norm=1e-3, noise_multiplier=0.0,
                         expected_clients_per_round=4.0,
                         client_optimizer=optax.sgd(0.1))
  state, metrics = algo.round(algo.init(params), make_cohort(data, 2), KEY)
  # Two real clients, each clipped to norm 1e-3, summed, divided by qN = 4.
  assert float(metrics['clients']) == 2
  assert float(optax.tree.norm(state.params)) <= 2 * 1e-3 / 4 * (1 + 1e-5)


def test_epsilon_matches_dp_accounting():
  z, q, rounds, delta = 1.1, 0.01, 500, 1e-5
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
      rounds)
  rdp = dp_accounting.rdp.RdpAccountant()
  rdp.compose(event)
  assert algos.privacy.dp_epsilon(z, q, rounds, delta) == pytest.approx(
      rdp.get_epsilon(delta), rel=1e-9)
  pld = dp_accounting.pld.PLDAccountant()
  pld.compose(event)
  assert algos.privacy.dp_epsilon(z, q, rounds, delta, accountant='pld') == pytest.approx(
      pld.get_epsilon(delta), rel=1e-9)
  # More noise or fewer rounds spend less privacy.
  assert algos.privacy.dp_epsilon(2 * z, q, rounds, delta) < algos.privacy.dp_epsilon(z, q, rounds, delta)
  assert algos.privacy.dp_epsilon(z, q, rounds // 2, delta) < algos.privacy.dp_epsilon(z, q, rounds, delta)


def test_dp_arguments():
  with pytest.raises(ValueError, match='clip_norm'):
    algos.dp_fedavg(loss_fn, clip_norm=0.0)
  with pytest.raises(ValueError, match='noise_multiplier'):
    algos.dp_fedavg(loss_fn, noise_multiplier=-1.0)
  with pytest.raises(ValueError, match='sampling_rate'):
    algos.privacy.dp_epsilon(1.0, 1.5, 10, 1e-5)
  with pytest.raises(ValueError, match='accountant'):
    algos.privacy.dp_epsilon(1.0, 0.1, 10, 1e-5, accountant='moments')
