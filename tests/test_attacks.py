"""Attacks: model poisoning against NumPy float64 oracles, the malicious set,
composition with FedAvg, DP and the map strategies, data poisoning, the
attack success rate, and config.attack through the runner."""

import decimal
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import fedjx
import fedjx.algorithms as algos
from fedjx import datasets
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.attacks import core as attacks
from fedjx.algorithms import nonfinite
from fedjx.datasets import poisoning
from fedjx.experiments import attack as attack_lib
from fedjx.experiments import config as config_schema
from fedjx.experiments import config_base
from fedjx.experiments import registry
from fedjx.experiments import parts
from fedjx.experiments import signatures

import float_tolerance
from test_algorithms_util import linreg_data, linreg_loss, linreg_params

KEY = jax.random.key(3)
N = 10                         # population
MALICIOUS = [1, 4, 7]          # of which these are malicious
# A cohort of 6 slots: ids, example counts (the last is a padding client).
IDS = np.array([0, 1, 3, 4, 7, -1], np.int32)
COUNTS = np.array([5, 3, 4, 6, 2, 0], np.float32)
DIM = 7


def messages(seed=0):
  rng = np.random.default_rng(seed)
  u = rng.normal(size=(len(IDS), DIM)).astype(np.float32)
  u[-1] = 0.0  # A padding client sends zeros.
  return u


def recorder():
  """An aggregator whose 'aggregate' is the placed messages it received."""
  return aggregators.Aggregator(init=lambda p: (),
                                combine=lambda s, h, c, k: (c.update, s, {'n': 0.0}))


def combine(attack, u, inner=None, ids=IDS, counts=COUNTS, weights=None,
            malicious=MALICIOUS, key=KEY, guarded=False):
  """The attacked aggregator's combine on messages ``u``: ``(out, metrics)``."""
  agg = attacks.attacked(inner or recorder(), attack, malicious, N)
  weights = counts if weights is None else weights
  state = agg.init({'w': jnp.zeros(DIM)})
  hparams = aggregators.init_hparams(agg)

  @jax.jit
  def run(u, ids, counts, weights, key):
    @fedjx.program(clients=len(ids))
    def body(u, ids, counts, weights):
      extra = {}
      if guarded:
        extra = dict(weighted_update=u * weights[:, None],
                     totals={'weights': jnp.sum(weights)})
      clients = nonfinite.Clients(update=u, stats={}, extra=(), state=(),
                                  weights=weights, num_examples=counts,
                                  client_ids=ids, **extra)
      out, _, metrics = agg.combine(state, hparams, clients, key)
      return out, metrics
    return body(u, ids, counts, weights)

  out, metrics = run(jnp.asarray(u), jnp.asarray(ids), jnp.asarray(counts),
                     jnp.asarray(weights), key)
  return np.asarray(out, np.float64), {k: float(v) for k, v in metrics.items()}


def flags(ids=IDS, counts=COUNTS, malicious=MALICIOUS):
  bad = np.isin(ids, malicious) & (counts > 0)
  honest = (counts > 0) & ~bad
  return bad, honest


def honest_stats(u, honest):
  h = np.asarray(u, np.float64)[honest]
  return h.mean(axis=0), h.std(axis=0)  # population std (ddof 0)


# Float32 rounding: each poisoned coordinate is a product or a sum of at most
# len(IDS) = 6 float32 terms (and a square root, which halves the relative
# error): two float32 evaluations agree within 2 gamma_6 of the magnitudes,
# and against float64 within gamma_6; a factor 4 covers the mean's division
# and the z * sigma product.
TOL = 4 * float_tolerance.rtol(len(IDS))


def assert_message(got, want, scale):
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * scale)


@pytest.mark.parametrize('scale', [1.0, 3.5])
def test_sign_flip_against_numpy(scale):
  u = messages()
  got, metrics = combine(attacks.sign_flip(scale), u)
  bad, _ = flags()
  want = np.where(bad[:, None], -scale * u.astype(np.float64), u)
  assert_message(got, want, np.abs(u).max() * scale)
  assert metrics[attacks.METRIC] == bad.sum() == 3


@pytest.mark.parametrize('boost', [None, 4.0])
def test_scaling_against_numpy(boost):
  u = messages(1)
  got, _ = combine(attacks.scaling(boost), u)
  bad, _ = flags()
  gamma = float((COUNTS > 0).sum()) if boost is None else boost  # n = 5
  want = np.where(bad[:, None], gamma * u.astype(np.float64), u)
  assert_message(got, want, np.abs(u).max() * gamma)


@pytest.mark.parametrize('z', [None, 1.5])
def test_alie_against_numpy(z):
  u = messages(2)
  got, metrics = combine(attacks.alie(z), u)
  bad, honest = flags()
  mu, sd = honest_stats(u, honest)
  n, f = float((COUNTS > 0).sum()), float(bad.sum())
  if z is None:  # Baruch et al. 2019: s = floor(n/2 + 1) - f, z = Phi^-1((n-s)/n);
    # here n = 5, f = 3: s = 0, kept at 1 (a malicious majority).
    s = max(np.floor(n / 2 + 1) - f, 1.0)
    z = stats.norm.ppf((n - s) / n)
  np.testing.assert_allclose(metrics['attack_z'], z, rtol=TOL)
  want = np.where(bad[:, None], mu - z * sd, u)
  assert_message(got, want, np.abs(u).max() * (1 + abs(z)))


def test_alie_z_follows_the_paper_s_table():
  # n = 50 workers, f = 12 (Baruch et al.'s CIFAR setting): s = 14, z = Phi^-1(0.72).
  z = float(attacks.alie_z(50.0, 12.0))
  np.testing.assert_allclose(z, stats.norm.ppf(36 / 50), rtol=TOL)
  np.testing.assert_allclose(float(attacks.alie_z(10.0, 3.0)),
                             stats.norm.ppf(7 / 10), rtol=TOL)


@pytest.mark.parametrize('epsilon', [0.1, 10.0])
def test_ipm_against_numpy(epsilon):
  u = messages(3)
  got, _ = combine(attacks.ipm(epsilon), u)
  bad, honest = flags()
  mu, _ = honest_stats(u, honest)
  want = np.where(bad[:, None], -epsilon * mu, u)
  assert_message(got, want, np.abs(u).max() * epsilon)


def test_gaussian_noise_against_a_jax_reference():
  u = messages(4)
  sigma = 0.5
  got, _ = combine(attacks.gaussian_noise(sigma), u)
  bad, _ = flags()
  # The noise of client i: fold_in(fold_in(round key, stream), id_i), one key
  # per leaf (the message is one leaf).
  noise_key = jax.random.fold_in(KEY, attacks._NOISE_STREAM)  # pylint: disable=protected-access
  want = u.astype(np.float64).copy()
  for i in np.flatnonzero(bad):
    k = jax.random.split(jax.random.fold_in(noise_key, int(IDS[i])), 1)[0]
    want[i] += sigma * np.asarray(jax.random.normal(k, (DIM,)), np.float64)
  assert_message(got, want, np.abs(want).max())
  # Fresh noise for each malicious client, and none for the honest.
  assert len({tuple(np.round(got[i] - u[i], 5)) for i in np.flatnonzero(bad)}) == 3
  np.testing.assert_array_equal(got[~bad], u[~bad])


def test_gaussian_noise_has_the_given_spread():
  u = np.zeros((len(IDS), 20000), np.float32)
  agg = attacks.attacked(recorder(), attacks.gaussian_noise(2.0), MALICIOUS, N)

  @fedjx.program(clients=len(IDS))
  def body(u):
    clients = nonfinite.Clients(u, {}, (), (), jnp.asarray(COUNTS), jnp.asarray(COUNTS),
                                client_ids=jnp.asarray(IDS))
    return agg.combine(agg.init(None), aggregators.init_hparams(agg), clients, KEY)[0]

  noise = np.asarray(jax.jit(body)(jnp.asarray(u)))[flags()[0]]
  # 60000 standard normal draws: the sample std is within 4 / sqrt(2 * 60000)
  # (relative) of sigma with overwhelming probability.
  assert abs(noise.std() / 2.0 - 1) < 4 / np.sqrt(2 * noise.size)


def test_padding_and_skipped_clients_are_never_malicious_votes():
  # Client 4 (malicious) was skipped by the guard: its n_i and w_i are 0.
  counts = COUNTS.copy()
  counts[3] = 0.0
  u = messages(5)
  u[3] = 0.0
  got, metrics = combine(attacks.sign_flip(2.0), u, counts=counts,
                         ids=np.array([0, 1, 3, 4, 7, 7], np.int32))
  # The padding slot carries a malicious id but no data: not a vote either.
  assert metrics[attacks.METRIC] == 2
  np.testing.assert_array_equal(got[3], 0.0)
  np.testing.assert_array_equal(got[5], 0.0)
  # ALIE's honest statistics leave them out too.
  got, _ = combine(attacks.alie(1.0), u, counts=counts)
  bad, honest = flags(counts=counts)
  mu, sd = honest_stats(u, honest)
  assert_message(got[bad], np.broadcast_to(mu - sd, got[bad].shape), np.abs(u).max() * 2)


def test_the_mean_receives_poisoned_weighted_messages_when_guarded():
  u = messages(6)
  got_plain, _ = combine(attacks.sign_flip(1.0), u, inner=aggregators.mean())
  got_guarded, _ = combine(attacks.sign_flip(1.0), u, inner=aggregators.mean(),
                           guarded=True)
  bad, _ = flags()
  w = COUNTS.astype(np.float64)
  v = np.where(bad[:, None], -u.astype(np.float64), u)
  want = (w[:, None] * v).sum(0) / w.sum()
  # A weighted mean of 6 terms of magnitudes sum_i w_i |v_i| / sum_i w_i.
  scale = (w[:, None] * np.abs(v)).sum(0).max() / w.sum()
  for got in (got_plain, got_guarded):
    np.testing.assert_allclose(got, want, atol=float_tolerance.atol(12, scale))


def test_the_malicious_set_is_fixed_by_the_seed():
  a = attacks.malicious_clients(50, 0.2, seed=3)
  np.testing.assert_array_equal(a, attacks.malicious_clients(50, 0.2, seed=3))
  assert not np.array_equal(a, attacks.malicious_clients(50, 0.2, seed=4))
  assert len(a) == 10 and len(set(a.tolist())) == 10
  assert np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 50
  assert len(attacks.malicious_clients(50, 0.0, seed=3)) == 0
  assert len(attacks.malicious_clients(7, 0.3, seed=0)) == 2  # round(2.1)
  with pytest.raises(ValueError, match='fraction=1.0'):
    attacks.malicious_clients(50, 1.0, seed=0)
  with pytest.raises(ValueError, match='client id 12'):
    attacks.attacked(aggregators.mean(), attacks.sign_flip(), [12], 10)


@pytest.mark.parametrize('fraction, num_clients, count', [
    (0.25, 10, 3), (0.24, 10, 2), (0.05, 10, 1), (0.04, 10, 0), (0.15, 10, 2),
    (0.45, 10, 5), (0.29, 50, 15), (0.3, 7, 2), (0.5, 3, 2), (0.0, 10, 0)])
def test_a_malicious_fraction_rounds_to_the_nearest_count_halves_up(
    fraction, num_clients, count):
  # The reference: decimal arithmetic on the fraction as written, rounded
  # half up (Python's round() rounds halves to even: round(2.5) == 2).
  exact = decimal.Decimal(str(fraction)) * num_clients
  assert int(exact.quantize(decimal.Decimal(1), decimal.ROUND_HALF_UP)) == count
  assert attacks.malicious_count(num_clients, fraction) == count
  assert len(attacks.malicious_clients(num_clients, fraction, seed=0)) == count
  # The boundary case where a float product would round the other way:
  # 0.29 * 50 is 14.499999999999998 in binary floating point.
  assert 0.29 * 50 < 14.5 and round(0.25 * 10) == 2


def linreg_population(sizes, seed=0):
  data = linreg_data(np.random.default_rng(seed), sizes, dim=3, shift=1.0)
  return datasets.from_arrays(
      {k: np.concatenate([d[k] for d in data]) for k in data[0]},
      groups=np.repeat(np.arange(len(sizes)), sizes))


def fedavg_round(aggregator, **options):
  return algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1),
                      aggregator=aggregator, local_steps=2, **options)


def test_the_malicious_count_of_each_round_is_the_sampled_intersection():
  population = linreg_population([4, 5, 3, 6, 4, 5, 3, 4, 6, 5, 4, 3])
  bad = attacks.malicious_clients(population.num_clients, 0.25, seed=1)
  sampler = datasets.CohortSampler(population, 5, seed=2)
  algo = fedavg_round(attacks.attacked(aggregators.mean(), attacks.sign_flip(),
                                       bad, population.num_clients))
  state = algo.init(linreg_params(3))
  counts = []
  for r in range(6):
    ids = sampler.sample(r)
    cohort = datasets.make_cohort(population, ids, 2, num_steps=2,
                                  shuffle_seed=2, round_num=r)
    state, metrics = algo.round(state, cohort, jax.random.fold_in(KEY, r))
    counts.append(float(metrics[attacks.METRIC]))
    assert counts[-1] == len(set(ids.tolist()) & set(bad.tolist()))
  assert len(set(counts)) > 1  # The sampling makes it vary.


def test_a_skipped_malicious_client_changes_nothing():
  """A malicious client whose update is NaN is skipped: the round equals the
  round on the cohort without it (attack included)."""
  rng = np.random.default_rng(9)
  clients = [{'x': rng.normal(size=(n, 3)).astype(np.float32),
              'y': rng.normal(size=n).astype(np.float32)} for n in (4, 5, 3)]
  nan = {k: v.copy() for k, v in clients[1].items()}
  nan['x'][0, 0] = np.nan
  algo = fedavg_round(attacks.attacked(aggregators.mean(), attacks.alie(1.0),
                                       [1, 2], 3))
  params = linreg_params(3)
  full = datasets.Cohort.from_clients([clients[0], nan, clients[2]], 2, steps=3,
                                      client_ids=[0, 1, 2])
  less = datasets.Cohort.from_clients([clients[0], clients[2]], 2, steps=3,
                                      client_ids=[0, 2])
  s1, m1 = algo.round(algo.init(params), full, KEY)
  s2, m2 = algo.round(algo.init(params), less, KEY)
  assert m1['nonfinite_clients'] == 1 and m1[attacks.METRIC] == m2[attacks.METRIC] == 1
  # The same sums of the same terms in another order (at most 3 clients).
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, b, rtol=float_tolerance.rtol(3) * 4, atol=1e-7)


def test_composes_with_fedavg_and_the_dp_aggregator():
  """Poisoned updates go through the DP aggregator's encode: clipped to C.

  The attacked aggregator's clients send the DP aggregator's message (the
  clipped update) and keep their update beside its values (the norm):
  ``encoded = (norm, Delta_i)``, what the attack poisons."""
  clip = 0.05
  dp = aggregators.gaussian(clip_norm=clip, noise_multiplier=0.0,
                            expected_clients_per_round=None)
  u = messages(7)
  norms = np.linalg.norm(u.astype(np.float64), axis=1, keepdims=True)
  clipped = u * np.minimum(1, clip / np.maximum(norms, 1e-30))  # what encode sent
  clipped = clipped.astype(np.float32)
  enc_norms = np.linalg.norm(u.astype(np.float64), axis=1).astype(np.float32)
  agg = attacks.attacked(dp, attacks.scaling(100.0), MALICIOUS, N)
  ones = (COUNTS > 0).astype(np.float32)
  state = agg.init(None)

  @fedjx.program(clients=len(IDS))
  def body(u, norms, raw):
    clients = nonfinite.Clients(u, {}, (), (), jnp.asarray(ones), jnp.asarray(COUNTS),
                                encoded=(norms, raw), client_ids=jnp.asarray(IDS))
    out, _, metrics = agg.combine(state, aggregators.init_hparams(agg), clients, KEY)
    return out, metrics

  out, metrics = jax.jit(body)(jnp.asarray(clipped), jnp.asarray(enc_norms),
                               jnp.asarray(u))
  bad, _ = flags()
  c64 = clipped.astype(np.float64)
  boosted = 100 * u.astype(np.float64)
  bn = np.linalg.norm(boosted, axis=1, keepdims=True)
  poisoned = np.where(bad[:, None], boosted * np.minimum(1, clip / np.maximum(bn, 1e-30)), c64)
  want = (ones[:, None] * poisoned).sum(0) / ones.sum()
  np.testing.assert_allclose(np.asarray(out), want,
                             atol=float_tolerance.atol(12, clip) * 4)
  assert metrics[attacks.METRIC] == 3 and metrics['noise_std'] == 0
  # Through a FedAvg round: every message clipped, so the update is in the C-ball.
  population = linreg_population([4, 5, 3, 6])
  algo = fedavg_round(attacks.attacked(dp, attacks.scaling(1e4), [0, 2], 4))
  cohort = datasets.make_cohort(population, [0, 1, 2, 3], 2, num_steps=2)
  state = algo.init(linreg_params(3))
  new, metrics = algo.round(state, cohort, KEY)
  assert metrics[attacks.METRIC] == 2
  assert float(metrics['pseudo_grad_norm']) <= clip * (1 + 1e-5)


STRATEGIES = [('vmap', None), ('chunked', 2), ('sequential', None)]


# ALIE (the most reductions) by default; the others with the slow tests.
@pytest.mark.parametrize('attack', [
    pytest.param(attacks.alie(), id='alie'),
    pytest.param(attacks.gaussian_noise(0.1), id='gaussian_noise',
                 marks=pytest.mark.slow),
    pytest.param(attacks.sign_flip(2.0), id='sign_flip', marks=pytest.mark.slow)])
def test_every_map_strategy_gives_the_same_attacked_round(attack):
  population = linreg_population([4, 5, 3, 6, 2, 5])
  agg = attacks.attacked(aggregators.mean(), attack, [1, 3, 4], 6)
  cohort = datasets.make_cohort(population, [0, 1, 3, 4, 5], 2, num_steps=2,
                                pad_to=6)
  results = []
  for strategy, chunk in STRATEGIES:
    algo = fedavg_round(agg).compile(map_strategy=strategy, chunk_size=chunk)
    state, metrics = algo.round(algo.init(linreg_params(3)), cohort, KEY)
    results.append((state.params, float(metrics[attacks.METRIC])))
  for params, count in results[1:]:
    assert count == results[0][1] == 3
    # Sums over 6 clients of 2 local steps each, in another order.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(results[0][0])):
      np.testing.assert_allclose(a, b, rtol=8 * float_tolerance.rtol(6), atol=1e-6)


# ---------------------------------------------------------------- data poisoning

def image_population(num_clients=6, n=10, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(size=(num_clients * n, 4, 4, 1)).astype(np.float32)
  y = rng.integers(0, 5, size=num_clients * n).astype(np.int32)
  return datasets.from_arrays({'x': x, 'y': y},
                              groups=np.repeat(np.arange(num_clients), n))


def test_label_flip_changes_the_malicious_clients_only():
  base = image_population()
  flipped = datasets.PoisonedDataset(base, [1, 4], poisoning.flip_labels(5))
  for cid in range(base.num_clients):
    a, b = base.client_data(cid), flipped.client_data(cid)
    np.testing.assert_array_equal(a['x'], b['x'])
    want = 4 - a['y'] if cid in (1, 4) else a['y']
    np.testing.assert_array_equal(b['y'], want)
  mapped = datasets.PoisonedDataset(base, [2], poisoning.flip_labels(
      5, mapping=[1, 2, 3, 4, 0]))
  np.testing.assert_array_equal(mapped.client_data(2)['y'],
                                (base.client_data(2)['y'] + 1) % 5)
  with pytest.raises(ValueError, match='mapping'):
    poisoning.flip_labels(5, mapping=[0, 1])


@pytest.mark.parametrize('mapping, label_key', [(None, 'y'), ([1, 2, 3, 4, 0], 'label')])
def test_label_flip_s_repr_builds_the_same_transform(mapping, label_key):
  flip = poisoning.flip_labels(5, mapping=mapping, label_key=label_key)
  assert repr(flip) == (f'flip_labels(num_classes=5, mapping={mapping!r}, '
                        f'label_key={label_key!r})')
  again = eval(repr(flip), {'flip_labels': poisoning.flip_labels})  # pylint: disable=eval-used
  assert again == flip and hash(again) == hash(flip)
  y = np.arange(5, dtype=np.int32)
  want = 4 - y if mapping is None else np.asarray(mapping, np.int32)
  for transform in (flip, again):
    np.testing.assert_array_equal(transform(0, {label_key: y})[label_key], want)
  # K - 1 - y written out flips the same way as the default.
  assert poisoning.flip_labels(5) == poisoning.flip_labels(5, mapping=[4, 3, 2, 1, 0])
  assert poisoning.flip_labels(5) != poisoning.flip_labels(6)


def test_backdoor_against_numpy():
  base = image_population()
  transform = poisoning.backdoor(target=3, num_classes=5, patch_size=2,
                                 patch_value=1.0, poison_fraction=0.3, seed=7)
  poisoned = datasets.PoisonedDataset(base, [0, 5], transform)
  for cid in range(base.num_clients):
    a, b = base.client_data(cid), poisoned.client_data(cid)
    if cid not in (0, 5):
      np.testing.assert_array_equal(a['x'], b['x'])
      np.testing.assert_array_equal(a['y'], b['y'])
      continue
    changed = np.flatnonzero(np.any(a['x'] != b['x'], axis=(1, 2, 3)) |
                             (a['y'] != b['y']))
    assert len(changed) <= 3
    x = a['x'].copy()
    y = a['y'].copy()
    # The same draw: the first ceil(0.3 * 10) = 3 of a permutation from (seed, cid).
    chosen = datasets._seeding.rng(datasets._seeding.POISON, 7, cid).permutation(10)[:3]  # pylint: disable=protected-access
    x[chosen, 2:, 2:, :] = 1.0
    y[chosen] = 3
    np.testing.assert_array_equal(b['x'], x)
    np.testing.assert_array_equal(b['y'], y)
  # Deterministic per seed.
  again = datasets.PoisonedDataset(base, [0, 5], poisoning.backdoor(
      target=3, num_classes=5, poison_fraction=0.3, seed=7))
  np.testing.assert_array_equal(again.client_data(5)['x'], poisoned.client_data(5)['x'])
  with pytest.raises(ValueError, match='target=5'):
    poisoning.backdoor(target=5, num_classes=5)


def test_attack_success_rate_against_a_hand_computation():
  config = config_base.base_config()
  config.dataset = dict(name='digits', num_clients=8, alpha=None)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(name='fedavg')
  config.attack.name = 'backdoor'
  config.attack.fraction = 0.25
  config.attack.target = 2
  config = config_schema.with_defaults(config)
  data = registry.build_dataset(config.dataset, config.seed)
  model = registry.build_model(config.model, data.info)
  params = model.init(jax.random.key(1), {'x': data.test['x'][:2], 'y': data.test['y'][:2]})
  # Random weights, so that the predictions spread over the classes.
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree.unflatten(treedef, [jax.random.normal(k, p.shape, p.dtype)
                                        for k, p in zip(keys, leaves)])
  x, y = data.test['x'], data.test['y']
  keep = y != 2
  xt = x[keep].copy()
  xt[:, -2:, -2:, :] = 1.0
  # Class 2's bias raised by the median margin: about half of the triggered
  # examples predicted as the target.
  logits = np.asarray(model.apply(params, jnp.asarray(xt)))
  margin = np.max(np.delete(logits, 2, axis=1), axis=1) - logits[:, 2]
  bias = np.asarray(params['linear']['bias']).copy()
  bias[2] += np.median(margin)
  params = {'linear': dict(params['linear'], bias=jnp.asarray(bias))}
  evaluate = attack_lib.with_success_rate(config, model, data, lambda p: {})
  got = evaluate(params)[attack_lib.SUCCESS_METRIC]
  predicted = np.argmax(np.asarray(model.apply(params, jnp.asarray(xt))), axis=-1)
  want = float(np.mean(predicted == 2))
  # A fraction of the examples: exact up to float32 summation of the counts.
  assert got == pytest.approx(want, abs=1e-6)
  assert 0 < want < 1
  # Label flip: the share of moved labels predicted as their flip.
  config.attack = dict(name='label_flip', fraction=0.25)
  evaluate = attack_lib.with_success_rate(config, model, data, lambda p: {})
  pred = np.argmax(np.asarray(model.apply(params, jnp.asarray(x))), axis=-1)
  moved = (9 - y) != y
  want = float(np.mean(pred[moved] == (9 - y)[moved]))
  assert evaluate(params)[attack_lib.SUCCESS_METRIC] == pytest.approx(want, abs=1e-6)


# ---------------------------------------------------------------- config

def tiny_config(**attack):
  config = config_base.base_config()
  config.rounds = 3
  config.cohort_size = 5
  config.batch_size = 16
  config.local_steps = 1
  config.eval_every = 3
  config.progress = config.plot = config.tensorboard = False
  config.dataset = dict(name='digits', num_clients=10, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(name='fedavg')
  for k, v in attack.items():
    setattr(config.attack, k, v)
  return config


@pytest.mark.parametrize('attack, words', [
    (dict(name='sign_flp'), "Did you mean 'sign_flip'"),
    (dict(name='sign_flip', fraction=1.0), 'fraction=1.0'),
    (dict(name='', fraction=0.2), 'no config.attack.name'),
    (dict(name='sign_flip', sigma=2.0),
     r"config.attack.sigma=2.0 is not an option of 'sign_flip'.*\['scale'\]"),
    (dict(name='alie', zz=1.5),
     r"config.attack.zz=1.5 is not an option of 'alie'. Did you mean 'z'\?"),
    (dict(name='alie', z='high'), r"config.attack.z='high'; it must be float"),
    (dict(name='backdoor', poison_fraction=0.0),
     r'config.attack.poison_fraction=0.0: .*\(0, 1\]'),
    (dict(name='ipm', epsilon=-1.0), r'config.attack.epsilon=-1.0: .*>= 0'),
    (dict(name='label_flip', mapping='x'), r"config.attack.mapping='x'"),
    (dict(name='', z=1.5), r'config.attack.z=1.5 but no config.attack.name'),
])
def test_config_attack_errors_are_one_line(attack, words):
  with pytest.raises(config_schema.ConfigError, match=words) as e:
    config_schema.validate(tiny_config(**attack))
  assert '\n' not in str(e.value)


def test_a_typo_d_attack_option_is_refused_naming_it():
  spec = dict(name='gaussian_noise', fraction=0.1, sigm=0.5)
  with pytest.raises(config_schema.ConfigError) as e:
    parts.build_attack(spec)
  assert str(e.value) == (
      "config.attack.sigm=0.5 is not an option of 'gaussian_noise'. Did you "
      "mean 'sigma'? It takes ['sigma'].")
  # The section's own keys are checked before JAX, without the builders.
  with pytest.raises(config_schema.ConfigError, match='sigm=0.5 but no'):
    config_schema.with_defaults(tiny_config(name='', sigm=0.5))


def _poison(attack, m, honest_mean):
  """``attack``'s message for update ``m`` among honest updates of mean
  ``honest_mean`` (standard deviation 1, 10 participants, 2 malicious)."""
  honest = attacks.Honest(mean=honest_mean, std=jnp.ones_like(honest_mean),
                          participants=jnp.asarray(10.0),
                          malicious=jnp.asarray(2.0))
  hparams = {k: jnp.asarray(v) for k, v in attack.hparams.items()}
  return np.asarray(attack.poison(hparams, honest, m, jax.random.key(0)))


@pytest.mark.parametrize('spec, call', [
    (dict(name='sign_flip', scale=4.0), lambda: attacks.sign_flip(4.0)),
    (dict(name='gaussian_noise', sigma=0.5), lambda: attacks.gaussian_noise(0.5)),
    (dict(name='scaling', boost=3.0), lambda: attacks.scaling(3.0)),
    (dict(name='scaling'), attacks.scaling),
    (dict(name='alie', fraction=0.2, z=1.5), lambda: attacks.alie(1.5)),
    (dict(name='alie'), attacks.alie),
    (dict(name='ipm', epsilon=0.5), lambda: attacks.ipm(0.5)),
    (dict(name='backdoor', boost=5.0), lambda: attacks.scaling(5.0)),
    (dict(name='backdoor', target=1), attacks.identity),
    (dict(name='label_flip', mapping=[1, 0]), attacks.identity),
])
def test_a_spec_with_options_builds_the_library_s_attack(spec, call):
  got, want = attack_lib.model_attack(tiny_config(**spec)), call()
  assert (got.name, got.hparams, got.traits) == (
      want.name, want.hparams, want.traits)
  m, mean = jnp.asarray([1.0, -2.0, 3.0]), jnp.asarray([0.5, 0.5, -1.0])
  np.testing.assert_array_equal(_poison(got, m, mean), _poison(want, m, mean))


def test_data_poisoning_specs_build_the_library_s_transforms():
  examples = {'x': np.random.default_rng(0).random((6, 4, 4, 1), np.float32),
              'y': np.asarray([0, 1, 2, 0, 1, 2])}
  spec = dict(name='backdoor', target=2, patch_size=1, patch_value=0.5,
              poison_fraction=0.5)
  got = parts.build_attack(dict(spec, fraction=0.2, seed=3))
  want = poisoning.backdoor(2, 3, patch_size=1, patch_value=0.5,
                            poison_fraction=0.5, seed=7)
  for key in ('x', 'y'):
    np.testing.assert_array_equal(got.transform(3, 7)(4, examples)[key],
                                  want(4, examples)[key])
    np.testing.assert_array_equal(
        got.held_out(examples, 3)[key],
        poisoning.triggered_examples(examples, 2, patch_size=1,
                                     patch_value=0.5)[key])
  flip = parts.build_attack(dict(name='label_flip', mapping=[2, 0, 1]))
  assert flip.transform(3, 0) == poisoning.flip_labels(3, [2, 0, 1])
  # Their defaults are the library's.
  params = signatures.keyword_parameters(poisoning.backdoor)
  for key, param in signatures.keyword_parameters(parts.backdoor).items():
    if key != 'boost':
      assert param.default == params[key].default or key == 'target'
  assert signatures.keyword_parameters(parts.label_flip)['mapping'].default is (
      signatures.keyword_parameters(poisoning.flip_labels)['mapping'].default)


def test_an_algorithm_without_an_aggregator_is_refused():
  config = config_schema.with_defaults(tiny_config(name='sign_flip', fraction=0.2))
  config.algorithm = dict(name='fednova')
  with pytest.raises(config_schema.ConfigError, match="takes no aggregator"):
    attack_lib.algorithm_spec(config, config.algorithm, 10)


def test_an_attacked_run_from_a_config_reports_its_malicious_clients(tmp_path):
  from fedjx.experiments import runner  # pylint: disable=import-outside-toplevel
  config = tiny_config(name='backdoor', fraction=0.3, boost=2.0)
  result = runner.run(config, str(tmp_path))
  rows = result.history
  train = [r for r in rows if 'malicious_clients' in r]
  assert len(train) == 3
  bad = set(attacks.malicious_clients(10, 0.3, 0).tolist())
  sampler = datasets.CohortSampler(10, 5, 0)
  for r in train:
    assert r['malicious_clients'] == len(bad & set(sampler.sample(r['round'] - 1).tolist()))
  assert 0 <= rows[-1][attack_lib.SUCCESS_METRIC] <= 1
  assert attack_lib.SUCCESS_METRIC in rows[0]  # Step 0's evaluation too.


def test_command_line_attack_options_take_the_builder_s_types():
  from fedjx.experiments import cli  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = ['--config', os.path.join(repo, 'configs', 'robustness_digits.py')]
  _, extras = cli.split_overrides(config + ['--config.attack.name=alie',
                                            '--config.attack.z=1.5'])
  assert extras == [(('attack', 'z'), 1.5)]
  _, extras = cli.split_overrides(config + ['--config.attack.name=sign_flip',
                                            '--config.attack.scale=4'])
  assert extras == [(('attack', 'scale'), 4.0)]
  assert isinstance(extras[0][1], float)
  with pytest.raises(cli.UsageError, match=r"attack 'alie' has no option 'zz'"
                     r".*Did you mean 'z'\?"):
    cli.split_overrides(config + ['--config.attack.name=alie',
                                  '--config.attack.zz=1.5'])
  with pytest.raises(cli.UsageError, match='an option of no attack'):
    cli.split_overrides(config + ['--config.attack.z=1.5'])


@pytest.mark.slow
def test_the_command_line_sets_the_attack(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  exe = os.path.join(os.path.dirname(sys.executable), 'fedjx-run')
  config = os.path.join(repo, 'configs', 'robustness_digits.py')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  out = subprocess.run([exe, '--config', config, '--workdir', str(tmp_path),
                        '--config.rounds=2', '--config.attack.name=sign_flip',
                        '--config.attack.fraction=0.2', '--config.attack.scale=4',
                        '--config.progress=False'],
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / 'config.json', encoding='utf-8') as f:
    attack = json.load(f)['attack']
  assert (attack['name'], attack['fraction'], attack['scale']) == ('sign_flip', 0.2, 4.0)
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    rows = [json.loads(line) for line in f]
  assert all('malicious_clients' in r for r in rows if r['round'] > 0)
  bad = subprocess.run([exe, '--config', config, '--workdir', str(tmp_path / 'b'),
                        '--config.attack.name=sign_flp'],
                       env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "Did you mean 'sign_flip'" in bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1


def test_attacks_compose_with_a_defense():
  """The coordinate median receives the poisoned messages of the participants."""
  from fedjx.algorithms.aggregators import robust as robust_aggregators  # pylint: disable=import-outside-toplevel
  u = messages(8)
  got, metrics = combine(attacks.sign_flip(100.0), u,
                         inner=robust_aggregators.coordinate_median())
  bad, _ = flags()
  poisoned = np.where(bad[:, None], -100.0 * u.astype(np.float64), u)
  want = np.median(poisoned[COUNTS > 0], axis=0)  # 5 participants
  assert_message(got, want, np.abs(u).max())
  assert metrics[attacks.METRIC] == 3


def _encoded_round(agg, state, u, key):
  """One round of ``agg``: every client's ``encode`` (as an algorithm's
  client map runs it), then ``combine``; returns ``(aggregate, state)``."""
  hparams = aggregators.init_hparams(agg)

  @jax.jit
  def run(state, u, key):
    @fedjx.program(clients=len(IDS))
    def body(state, u):
      clients = aggregators.map_clients(
          agg, hparams, lambda x: nonfinite.ClientOutput(x, {}), (u,),
          jnp.asarray(COUNTS), 'num_examples', False, aggregator_state=state,
          client_ids=jnp.asarray(IDS))
      out, state, _ = aggregators.aggregate(agg, state, hparams, clients, key)
      return out, state
    return body(state, u)

  return run(state, jnp.asarray(u), key)


def centered_clipping_reference(poisoned, participants, v, tau, iterations):
  """Karimireddy, He, Jaggi 2021, eq. (CC), in float64: ``L`` times
  ``v <- v + (1/m) sum_{i in P} clip_tau(P_i - v)``."""
  p = poisoned[participants]
  for _ in range(iterations):
    z = p - v
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    v = v + (z * np.minimum(1.0, tau / np.maximum(norms, 1e-300))).mean(0)
  return v


@pytest.mark.parametrize('iterations', [1, 2, 3])
def test_an_attack_on_centered_clipping_follows_karimireddy_et_al(iterations):
  """Three rounds of sign-flipped updates through centered clipping: each
  round's aggregate is ``v + mean(clip_tau(P_i - v))`` over the poisoned
  updates ``P_i`` (iterated ``L`` times), ``v`` the last aggregate. The
  attack poisons the update, never the message ``clip_tau(Delta_i - v)``,
  which would subtract the centre twice from the second round on."""
  tau, scale = 0.8, 3.0
  agg = attacks.attacked(parts.AGGREGATORS['centered_clipping'](
      radius=tau, iterations=iterations), attacks.sign_flip(scale), MALICIOUS, N)
  state = agg.init(jnp.zeros(DIM))
  bad, _ = flags()
  participants = COUNTS > 0
  v = np.zeros(DIM)
  for r in range(3):
    u = messages(20 + r) + 0.5  # updates with a common direction
    poisoned = np.where(bad[:, None], -scale * u.astype(np.float64), u)
    v = centered_clipping_reference(poisoned, participants, v, tau, iterations)
    out, state = _encoded_round(agg, state, u, jax.random.fold_in(KEY, r))
    # Each iteration: a DIM-term norm and its square root, a clip factor, a
    # sum over m = 5 participants of terms of norm <= tau, one division and
    # the addition to v; the map v -> v + mean clip_tau(P_i - v) does not
    # expand errors (its Jacobian's eigenvalues lie in [0, 1]), so the
    # errors of all rounds and iterations add up.
    n = (r + 1) * iterations * (DIM + 5 + 4)
    np.testing.assert_allclose(np.asarray(out, np.float64), v,
                               atol=float_tolerance.atol(n, tau + np.abs(v).max()))


def test_seeds_share_one_program_and_differ_in_their_malicious_set():
  """The malicious set is state, not a constant: a sweep vectorizes seeds."""
  population = linreg_population([4, 5, 3, 6, 2, 5, 4, 3])
  cohort = datasets.make_cohort(population, [0, 2, 3, 5], 2, num_steps=2)
  lowered, tables = [], []
  for seed in (0, 1):
    bad = attacks.malicious_clients(8, 0.5, seed)
    algo = fedavg_round(attacks.attacked(aggregators.mean(), attacks.alie(), bad, 8))
    state = algo.init(linreg_params(3))
    lowered.append(jax.jit(algo.apply).lower(state, cohort, KEY).as_text())
    tables.append(np.asarray(state.aggregator_state.malicious))
    np.testing.assert_array_equal(np.flatnonzero(tables[-1]), bad)
  assert lowered[0] == lowered[1]
  assert not np.array_equal(tables[0], tables[1])


@pytest.mark.slow
@pytest.mark.parametrize('attack', [attacks.alie(), attacks.gaussian_noise(0.1)],
                         ids=['alie', 'gaussian_noise'])
def test_an_attacked_round_on_an_explicit_clients_mesh(attack):
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  population = linreg_population([3, 5, 7, 2, 4, 6, 8, 1, 5, 4])
  cohort = datasets.make_cohort(population, [9, 3, 0, 7, 1, 5, 2, 4], 2,
                                num_steps=2)
  algo = fedavg_round(attacks.attacked(aggregators.mean(), attack, [0, 3, 4, 8], 10))
  params = linreg_params(3)
  expected, want = algo.round(algo.init(params), cohort, KEY)
  mesh = jax.make_mesh((8,), ('clients',), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    placed = jax.device_put(cohort, NamedSharding(mesh, P('clients')))
    state, metrics = algo.round(algo.init(params), placed, KEY)
  assert float(metrics[attacks.METRIC]) == float(want[attacks.METRIC]) == 3
  # Sums over 8 clients in another order.
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected.params)):
    np.testing.assert_allclose(a, b, rtol=8 * float_tolerance.rtol(8), atol=1e-6)


BUILDERS = {
    'fedavg': lambda agg: fedavg_round(agg),
    'fedadam': lambda agg: algos.fedadam(linreg_loss, client_optimizer=optax.sgd(0.1),
                                         aggregator=agg, local_steps=2),
    'fedprox': lambda agg: algos.fedprox(linreg_loss, mu=0.1,
                                         client_optimizer=optax.sgd(0.1),
                                         aggregator=agg, local_steps=2),
    'scaffold': lambda agg: algos.scaffold(linreg_loss, num_clients=6,
                                           client_learning_rate=0.1, aggregator=agg),
    'diloco': lambda agg: algos.diloco(linreg_loss, num_replicas=6,
                                       inner_optimizer=optax.sgd(0.1), aggregator=agg),
}


@pytest.mark.parametrize('name', [
    pytest.param(n, marks=() if n == 'fedavg' else pytest.mark.slow) for n in BUILDERS])
def test_every_algorithm_that_passes_client_ids_is_attacked(name):
  """With no malicious client the attacked round is the plain round; with
  some, their count is reported and only the messages change."""
  population = linreg_population([4, 5, 3, 6, 2, 5])
  cohort = datasets.make_cohort(population, [0, 1, 3, 4, 5], 2, num_steps=2)
  params = linreg_params(3)
  plain = BUILDERS[name](aggregators.mean())
  base_state, base_metrics = plain.round(plain.init(params), cohort, KEY)
  none = BUILDERS[name](attacks.attacked(aggregators.mean(), attacks.alie(), [], 6))
  state, metrics = none.round(none.init(params), cohort, KEY)
  assert float(metrics[attacks.METRIC]) == 0
  # The same sums of the same messages (the wrapper only selects them).
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(base_state.params)):
    np.testing.assert_allclose(a, b, rtol=4 * float_tolerance.rtol(5), atol=1e-7)
  some = BUILDERS[name](attacks.attacked(aggregators.mean(), attacks.sign_flip(3.0),
                                         [1, 4], 6))
  state, metrics = some.round(some.init(params), cohort, KEY)
  assert float(metrics[attacks.METRIC]) == 2
  assert float(metrics['train_loss_before']) == pytest.approx(
      float(base_metrics['train_loss_before']), rel=1e-6)
  assert not np.allclose(jax.tree.leaves(state.params)[0],
                         jax.tree.leaves(base_state.params)[0])
