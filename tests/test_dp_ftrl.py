"""DP-FTRL's tree aggregation (Kairouz et al. 2021): prefix sums against a
NumPy tree, the noise variance per release, restarts, and a DP-FTRLM round."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.privacy import dp_ftrl
import float_tolerance as ft
from test_algorithms_util import (CHAIN, KEY, assert_trees_close, copy, linreg_data,
                                  linreg_loss, linreg_params, make_cohort,
                                  reference_sgd, stack_cohorts)

EXTRA = 20_000  # An unused parameter: its update is the noise alone.
f32 = np.float32


def linear_loss(params, batch):
  """``-<v, w>``: one SGD step of learning rate 1 gives ``Delta = -v``."""
  return -(batch['v'] @ params['w']) + 0.0 * jnp.sum(params['extra'])


def cohort_of(vectors):
  return make_cohort([{'v': np.asarray(v, np.float32)[None]} for v in vectors],
                     batch_size=1)


def params_of(dim, extra=1):
  return {'w': jnp.zeros(dim, jnp.float32), 'extra': jnp.zeros(extra, jnp.float32)}


def numpy_node(tree_key, level, index, like, std):
  """Node ``(level, index)``'s noise as float64 NumPy (std as the round's float32)."""
  return jax.tree.map(lambda x: np.asarray(x, np.float64),
                      dp_ftrl.node_noise(tree_key, level, index, like, std))


def numpy_tree_noise(nodes, t, num_levels):
  """The noise of ``[1, t]``: dyadic nodes taken greedily, largest first.

  ``nodes[(level, index)]`` covers ``[index 2^level + 1, (index + 1) 2^level]``.
  Returns the sum and the number of nodes used.
  """
  total, start, used = 0.0, 0, 0
  for level in reversed(range(num_levels)):
    if start + 2 ** level <= t:
      total = total + nodes[(level, start >> level)]
      start += 2 ** level
      used += 1
  assert start == t
  return total, used


@pytest.mark.parametrize('restart_every', [None, 5])
def test_prefix_sums_match_a_numpy_binary_tree(restart_every):
  """16 = 2^4 rounds; the model after round t is ``x_0 - s_t / D``."""
  rounds, clients, dim, clip, z, d = 16, 3, 4, 1.5, 0.7, 4.0
  rng = np.random.default_rng(70)
  vectors = rng.normal(size=(rounds, clients, dim)).astype(np.float32)
  algo = algos.fedavg(linear_loss, client_optimizer=optax.sgd(1.0),
                      aggregator=dp_ftrl.tree_gaussian(
                          clip, z, restart_every, expected_clients_per_round=d))
  keys = jax.random.split(KEY, rounds)
  state = algo.init(params_of(dim))
  released = []
  for t in range(rounds):
    state, metrics = algo.round(state, cohort_of(vectors[t]), keys[t])
    released.append(-np.asarray(state.params['w'], np.float64) * d)
    period = restart_every or rounds
    assert int(metrics['tree_step']) == t % period + 1
  # The state is bounded: a step, a key and one model-sized noise.
  assert jax.tree.map(jnp.shape, state.aggregator_state.noise) == {
      'w': (dim,), 'extra': (1,)}
  # NumPy: clipped sums (Delta = -v), and the tree of each restart.
  deltas = -vectors.astype(np.float64)
  norms = np.linalg.norm(deltas, axis=2, keepdims=True)
  sums = (deltas * np.minimum(1.0, clip / norms)).sum(1)
  assert np.any(norms > clip) and np.any(norms < clip)
  period = restart_every or rounds
  levels = period.bit_length()
  like = {'w': jnp.zeros(dim), 'extra': jnp.zeros(1)}
  trees = {}  # Node noises of the tree that starts after `start` rounds.
  for start in range(0, rounds, period):
    tree_key = jax.random.key_data(keys[start])
    trees[start] = {(l, j): numpy_node(tree_key, l, j, like, f32(z) * f32(clip))['w']
                    for l in range(levels) for j in range(period >> l)}
  expected, bound = [], []
  for t in range(1, rounds + 1):
    start = (t - 1) // period * period  # Rounds before the current tree.
    nodes = trees[start]
    noise, used = numpy_tree_noise(nodes, t - start, levels)
    # The last release of each earlier tree stays in the model.
    finished = sum(numpy_tree_noise(trees[s], period, levels)[0]
                   for s in range(0, start, period))
    expected.append(sums[:t].sum(0) + finished + noise)
    # Each round adds its sum (3 terms) and B_t - B_(t-1) (<= 2 levels terms);
    # the model accumulates t such aggregates: float32 sums of
    # n = t (3 + 2 levels + 2) terms of magnitude <= clip and <= max |node|.
    node_max = max(float(np.max(np.abs(v))) for v in nodes.values())
    n = t * (3 + 2 * levels + 2)
    bound.append(ft.atol(n, t * (3 * clip + 2 * levels * node_max)))
    assert used == bin(t - start).count('1')
  for t in range(rounds):
    assert np.all(np.abs(released[t] - expected[t]) <= bound[t]), t
  if restart_every is None:  # The tree's key is the first round's.
    np.testing.assert_array_equal(state.aggregator_state.tree_key,
                                  jax.random.key_data(keys[0]))


def numpy_efficient(nodes, levels):
  """Honaker's bottom-up estimates over a full tree of ``2^(levels-1)`` leaves."""
  a = [1.0]
  for _ in range(1, levels):  # Inverse-variance weights, variance a_l s^2.
    a.append(2 * a[-1] / (1 + 2 * a[-1]))
  est = {}
  for l in range(levels):
    for j in range(2 ** (levels - 1 - l)):
      est[(l, j)] = nodes[(l, j)] if l == 0 else (
          a[l] * nodes[(l, j)] + (1 - a[l]) * (est[(l - 1, 2 * j)] + est[(l - 1, 2 * j + 1)]))
  return est, a


def test_efficient_estimates_match_a_numpy_tree_and_have_less_variance():
  rounds, dim, clip, z, d = 16, 3, 1.0, 1.2, 2.0
  algo = algos.fedavg(linear_loss, client_optimizer=optax.sgd(1.0),
                      aggregator=dp_ftrl.tree_gaussian(
                          clip, z, restart_every=rounds, efficient=True,
                          expected_clients_per_round=d))
  keys = jax.random.split(KEY, rounds)
  zero = cohort_of(np.zeros((2, dim)))  # Zero updates: the releases are noise.
  state = algo.init(params_of(dim, EXTRA))
  like = {'w': jnp.zeros(dim), 'extra': jnp.zeros(EXTRA)}
  tree_key = jax.random.key_data(keys[0])
  levels = rounds.bit_length()
  nodes = {(l, j): numpy_node(tree_key, l, j, like, f32(z) * f32(clip))['w']
           for l in range(levels) for j in range(rounds >> l)}
  est, a = numpy_efficient(nodes, levels)
  np.testing.assert_allclose(dp_ftrl.efficient_weights(levels), a, rtol=1e-15)
  for t in range(1, rounds + 1):
    state, metrics = algo.round(state, zero, keys[t - 1])
    want, _ = numpy_tree_noise(est, t, levels)
    # Each estimate is a chain of <= levels weighted sums of 3 terms; the
    # model accumulates t aggregates (B_t - B_(t-1), <= 2 levels terms).
    n = levels * 3 + t * (2 * levels + 2)
    got = -np.asarray(state.params['w'], np.float64) * d
    np.testing.assert_allclose(got, want, atol=ft.atol(n, 4 * levels * 6 * z * clip))
    var = sum(a[l] for l in range(levels) if t >> l & 1)
    np.testing.assert_allclose(metrics['noise_std'], z * clip * np.sqrt(var),
                               rtol=ft.rtol(levels + 2))
    noise = -np.asarray(state.params['extra'], np.float64) * d
    np.testing.assert_allclose(np.std(noise), z * clip * np.sqrt(var),
                               rtol=6 / np.sqrt(2 * EXTRA))
  # Less noise than the plain tree wherever a release uses a node above the
  # leaves (t = 2: 2/3 of a node's variance; t = 15: 3.11 instead of 4).
  assert a[1] == pytest.approx(2 / 3) and sum(a[:4]) < 4


def test_noise_variance_per_release_is_popcount_times_the_node_variance():
  """Var(B_t) = popcount(t) (z C)^2 per coordinate (Kairouz et al. 2021, tree aggregation)."""
  z, clip, d, rounds = 1.3, 0.5, 2.0, 8
  algo = algos.fedavg(linear_loss, client_optimizer=optax.sgd(1.0),
                      aggregator=algos.privacy.tree_gaussian(clip_norm=clip,
                                                     noise_multiplier=z,
                                                     expected_clients_per_round=d))
  state = algo.init(params_of(2, EXTRA))
  zero = cohort_of(np.zeros((2, 2)))  # Zero updates: the releases are noise.
  noises = []
  for t in range(1, rounds + 1):
    state, metrics = algo.round(state, zero, jax.random.fold_in(KEY, t))
    noise = -np.asarray(state.params['extra'], np.float64) * d
    noises.append(noise)
    std = z * clip * np.sqrt(bin(t).count('1'))
    np.testing.assert_allclose(metrics['noise_std'], std, rtol=ft.rtol(4))
    # The sample std of EXTRA normals: relative standard error
    # 1 / sqrt(2 EXTRA); 6 of those is a 1e-9 chance of a false failure.
    np.testing.assert_allclose(np.std(noise), std, rtol=6 / np.sqrt(2 * EXTRA))
    assert abs(np.mean(noise)) < 6 * std / np.sqrt(EXTRA)
  # Releases share nodes: B_3 = N(1,0) + N(0,2) and B_2 = N(1,0), so their
  # correlation is 1 / sqrt(2); B_4 = N(2,0) shares none with B_3. The
  # sample correlation has standard error <= 1 / sqrt(EXTRA).
  corr = lambda a, b: np.corrcoef(a, b)[0, 1]
  assert abs(corr(noises[2], noises[1]) - 2 ** -0.5) < 6 / np.sqrt(EXTRA)
  assert abs(corr(noises[3], noises[2])) < 6 / np.sqrt(EXTRA)
  # B_8 = N(3,0) is one node: the model's noise is that node alone.
  np.testing.assert_allclose(np.std(noises[7]), z * clip, rtol=6 / np.sqrt(2 * EXTRA))


def test_restart_draws_a_new_tree_and_keeps_the_old_noise():
  z, clip, d = 1.0, 1.0, 1.0
  algo = algos.fedavg(linear_loss, client_optimizer=optax.sgd(1.0),
                      aggregator=dp_ftrl.tree_gaussian(clip, z, restart_every=2,
                                                       expected_clients_per_round=d))
  state = algo.init(params_of(2, 1000))
  zero = cohort_of(np.zeros((1, 2)))
  keys = [jax.random.fold_in(KEY, t) for t in range(5)]
  steps, models = [], []
  for t in range(5):
    state, metrics = algo.round(state, zero, keys[t])
    steps.append(int(metrics['tree_step']))
    models.append(-np.asarray(state.params['extra'], np.float64))
    tree_first = keys[t - t % 2]
    np.testing.assert_array_equal(state.aggregator_state.tree_key,
                                  jax.random.key_data(tree_first))
  assert steps == [1, 2, 1, 2, 1]
  like = {'w': jnp.zeros(2), 'extra': jnp.zeros(1000)}
  node = lambda k, l, j: numpy_node(jax.random.key_data(k), l, j, like, f32(z) * f32(clip))['extra']
  # Tree 1 (rounds 1-2): B_1 = N(0,0), B_2 = N(1,0); tree 2 starts from it.
  first = node(keys[0], 1, 0)
  for got, want in [(models[0], node(keys[0], 0, 0)), (models[1], first),
                    (models[2], first + node(keys[2], 0, 0)),
                    (models[3], first + node(keys[2], 1, 0)),
                    (models[4], first + node(keys[2], 1, 0) + node(keys[4], 0, 0))]:
    # Up to 5 rounds of 3-term aggregates (sum, B_t, B_(t-1)), |noise| < 6.
    np.testing.assert_allclose(got, want, atol=ft.atol(15, 5 * 3 * 6.0))


def test_scanned_rounds_equal_single_rounds():
  """``run_rounds`` (one ``lax.scan``) gives the rounds one at a time."""
  rng = np.random.default_rng(72)
  cohorts = [cohort_of(rng.normal(size=(2, 2))) for _ in range(5)]
  algo = algos.fedavg(linear_loss, client_optimizer=optax.sgd(1.0),
                      aggregator=dp_ftrl.tree_gaussian(1.0, 0.8, restart_every=2,
                                                       expected_clients_per_round=2.0))
  keys = jax.random.split(KEY, 5)
  state = algo.init(params_of(2, 4))
  for cohort, key in zip(cohorts, keys):
    state, _ = algo.round(state, cohort, key)
  scanned, metrics = algo.run_rounds(algo.init(params_of(2, 4)),
                                     stack_cohorts(cohorts), keys)
  np.testing.assert_array_equal(metrics['tree_step'], [1, 2, 1, 2, 1])
  # Same operations; 5 rounds of 3-term aggregates of magnitude < 6.
  for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(state)):
    np.testing.assert_allclose(a, b, atol=ft.atol(15, 5 * 3 * 6.0))


def test_dp_ftrlm_round_matches_the_hand_computed_ftrl_form():
  """Server SGD with heavy-ball momentum on ``(s_t - s_(t-1)) / D`` is
  ``x_t = x_0 - eta V_t / D``, ``V_t = beta V_(t-1) + s_t`` (DP-FTRLM)."""
  sizes, lr_client, lr, beta, clip, z, d = [6, 4, 5], 0.1, 0.5, 0.9, 0.3, 0.4, 3.0
  data = linreg_data(np.random.default_rng(71), sizes, dim=3, shift=4.0)
  cohort = make_cohort(data, batch_size=3)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(lr_client),
                      server_optimizer=optax.sgd(lr, momentum=beta),
                      aggregator=dp_ftrl.tree_gaussian(
                          clip, z, expected_clients_per_round=d))
  x0 = linreg_params()
  state = algo.init(x0)
  keys = [jax.random.fold_in(KEY, t) for t in range(3)]
  like = jax.tree.map(jnp.zeros_like, x0)
  tree_key = jax.random.key_data(keys[0])
  node = lambda l, j: dp_ftrl.node_noise(tree_key, l, j, like, f32(z) * f32(clip))
  prefix_noise = [node(0, 0), node(1, 0), jax.tree.map(jnp.add, node(0, 2), node(1, 0))]
  x, g_sum = x0, jax.tree.map(jnp.zeros_like, x0)
  v = jax.tree.map(jnp.zeros_like, x0)
  for t in range(3):
    state, _ = algo.round(copy(state), cohort, keys[t])
    for c in data:  # The clipped sum g_t at the current model x_t.
      y, _ = reference_sgd(linreg_loss, x, c, 3, lr_client)
      delta = jax.tree.map(jnp.subtract, x, y)
      norm = float(optax.tree.norm(delta))
      g_sum = jax.tree.map(lambda s, u: s + u * min(1.0, clip / norm), g_sum, delta)
    s_t = jax.tree.map(jnp.add, g_sum, prefix_noise[t])
    v = jax.tree.map(lambda v, s: beta * v + s, v, s_t)
    x = jax.tree.map(lambda p0, v: p0 - lr * v / d, x0, v)
    # CHAIN covers the local training and a round; each round adds the noise
    # of <= 2 nodes and the momentum's 2 terms: 3 rounds, n = CHAIN + 12.
    assert_trees_close(state.params, x, n=CHAIN + 12)


@pytest.mark.parametrize('options, match', [
    (dict(restart_every=0), 'restart_every=0 must be a positive int or None'),
    (dict(restart_every=2.5), 'restart_every=2.5'),
    (dict(restart_every=True), 'restart_every=True'),
    (dict(clip_norm=0.0), 'clip_norm=0.0'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier=-1.0'),
    (dict(expected_clients_per_round=-2.0), 'expected_clients_per_round=-2.0'),
    (dict(efficient=True), 'efficient=True needs restart_every'),
    (dict(efficient=1, restart_every=4), 'efficient=1'),
])
def test_errors_are_one_line(options, match):
  with pytest.raises(ValueError, match=match) as e:
    dp_ftrl.tree_gaussian(**options)
  assert '\n' not in str(e.value) and 'tree_gaussian' in str(e.value)
