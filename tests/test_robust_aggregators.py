"""Robust aggregators (defenses against Byzantine clients) against NumPy oracles.

Each rule is run through the aggregator API the algorithms use
(``aggregators.map_clients`` then ``aggregators.aggregate`` inside a
``fedjx.program``) and compared with a float64 NumPy oracle written from the
paper's definition, on cohorts with padding clients (``num_examples == 0``,
holding garbage updates) and a client the non-finite guard skips (NaN).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx import streaming
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import nonfinite
from fedjx.algorithms.aggregators import order_statistics
from fedjx.algorithms.aggregators import robust as ra
from fedjx.interpreters import plan as plan_lib
from fedjx.experiments import parts
import float_tolerance as ft
from test_algorithms_util import KEY, linreg_data, linreg_loss, linreg_params
from test_algorithms_util import make_cohort


# ------------------------------------------------------------------ harness

def aggregate(agg, updates, num_examples, skip_nonfinite=True,
              weighting='num_examples', state=None):
  """``(aggregate, state, metrics)`` of ``agg`` on placed ``updates``."""
  c = len(num_examples)
  if state is None:
    state = agg.init(jax.tree.map(lambda u: u[0], updates))
  hp = aggregators.init_hparams(agg)

  @jax.jit
  def run(updates, n, state, hp):
    @fedjx.program(clients=c)
    def program(updates, n, state, hp):
      client_fn = lambda u: nonfinite.ClientOutput(u, {'count': jnp.float32(1)})
      clients = aggregators.map_clients(agg, hp, client_fn, (updates,), n,
                                        weighting, skip_nonfinite,
                                        aggregator_state=state)
      return aggregators.aggregate(agg, state, hp, clients, KEY)
    return program(updates, n, state, hp)

  return run(updates, jnp.asarray(num_examples, jnp.float32), state, hp)


def flat(tree):
  return np.concatenate([np.asarray(l, np.float64).reshape(-1)
                         for l in jax.tree.leaves(tree)])


def unflat(vector, like):
  leaves, treedef = jax.tree.flatten(like)
  out, start = [], 0
  for l in leaves:
    size = int(np.prod(l.shape[1:]))
    out.append(vector[start:start + size].reshape(l.shape[1:]))
    start += size
  return jax.tree.unflatten(treedef, out)


def stacked_rows(updates):
  """The updates as float64 rows ``[C, d]`` (leaves flattened, concatenated)."""
  leaves = jax.tree.leaves(updates)
  return np.concatenate([np.asarray(l, np.float64).reshape(l.shape[0], -1)
                         for l in leaves], axis=1)


def assert_close(got, want, n, scale):
  """Within ``2 gamma_n`` of the oracle, absolute in units of ``scale``.

  ``n`` is the longest chain of float32 operations behind an entry (stated
  by each test); ``scale`` the magnitude of the terms (max |update|).
  """
  tol = ft.rtol(n)
  np.testing.assert_allclose(flat(got), want, rtol=tol, atol=tol * scale)


# ------------------------------------------------------------------ oracles

def np_median(x):
  return np.median(x, axis=0)


def np_trimmed(x, beta):
  m = len(x)
  k = math.floor(beta * m)
  return np.sort(x, axis=0)[k:m - k].mean(axis=0)


def np_krum_scores(x, f):
  m = len(x)
  d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
  k = min(max(m - f - 2, 1), m - 1)
  return np.array([np.sort(np.delete(d[i], i))[:k].sum() for i in range(m)])


def np_multi_krum(x, f, selected):
  order = np.argsort(np_krum_scores(x, f), kind='stable')
  return x[order[:selected]].mean(axis=0)


def np_bulyan(x, f):
  m = len(x)
  remaining = list(range(m))
  chosen = []
  for _ in range(m - 2 * f):
    scores = np_krum_scores(x[remaining], f)
    chosen.append(remaining.pop(int(np.argmin(scores))))
  s = x[chosen]
  beta = len(chosen) - 2 * f
  med = np.median(s, axis=0)
  order = np.argsort(np.abs(s - med), axis=0, kind='stable')
  return np.take_along_axis(s, order, axis=0)[:beta].mean(axis=0)


def np_weiszfeld(x, alpha, nu, iterations):
  v = (alpha[:, None] * x).sum(0) / alpha.sum()
  for _ in range(iterations):
    beta = alpha / np.maximum(nu, np.linalg.norm(v - x, axis=1))
    v = (beta[:, None] * x).sum(0) / beta.sum()
  return v, (alpha * np.linalg.norm(v - x, axis=1)).sum() / alpha.sum()


def np_clip(z, c):
  norm = np.linalg.norm(z, axis=-1, keepdims=True)
  return z * np.minimum(1.0, c / np.where(norm > 0, norm, 1.0))


def np_norm_bounding(x, w, max_norm):
  return (w[:, None] * np_clip(x, max_norm)).sum(0) / w.sum()


def np_centered_clipping(x, center, radius, iterations):
  v = center
  for _ in range(iterations):
    v = v + np_clip(x - v, radius).mean(0)
  return v


# ----------------------------------------------------------------- cohorts

def cohort_updates(seed=0, c=10, outliers=2):
  """``c`` updates ({'a': [c, 3], 'b': [c, 2, 2]}), the last ``outliers`` far off,
  and the example counts. Clients 1 and 6 are padding (garbage updates,
  0 examples) and client 4 is NaN (skipped by the guard)."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(c, 3)).astype(np.float32)
  b = rng.normal(size=(c, 2, 2)).astype(np.float32)
  a[c - outliers:] += 8.0
  b[c - outliers:] -= 6.0
  n = rng.integers(1, 9, size=c).astype(np.float32)
  n[[1, 6]] = 0.0
  a[[1, 6]] = 1e3  # padding: never a vote
  a[4, 0] = np.nan
  return {'a': jnp.asarray(a), 'b': jnp.asarray(b)}, n


def participants(updates, n):
  x = stacked_rows(updates)
  keep = (n > 0) & np.all(np.isfinite(x), axis=1)
  return x[keep], n[keep], keep


# ------------------------------------------------ each rule against its oracle

# (aggregator, oracle(x, n) over the participants, chain length n of float32 ops)
RULES = {
    'median': (ra.coordinate_median(), lambda x, n: np_median(x), 2),
    'trimmed_mean': (ra.trimmed_mean(0.2), lambda x, n: np_trimmed(x, 0.2), 10),
    'krum': (ra.krum(1), lambda x, n: x[np.argmin(np_krum_scores(x, 1))], 1),
    'multi_krum': (ra.multi_krum(1, 3), lambda x, n: np_multi_krum(x, 1, 3), 10),
    'bulyan': (ra.bulyan(1), lambda x, n: np_bulyan(x, 1), 10),
}


@pytest.mark.parametrize('name', sorted(RULES))
def test_order_statistic_rules_match_numpy(name):
  agg, oracle, chain = RULES[name]
  updates, n = cohort_updates()
  got, _, metrics = aggregate(agg, updates, n)
  x, counts, _ = participants(updates, n)
  # Copies, or means of at most C = 10 kept values: one float32 sum each.
  assert_close(got, oracle(x, counts), chain, np.abs(x).max())
  # The two outliers are never what these rules return.
  assert np.all(np.abs(flat(got)) < 4.0)
  if 'robust_bound_violated' in metrics:  # 7 participants >= 2f + 3 and 4f + 3.
    assert float(metrics['robust_bound_violated']) == 0.0


def test_krum_reports_the_selected_client():
  updates, n = cohort_updates(seed=3)
  _, _, metrics = aggregate(ra.krum(1), updates, n)
  x, _, keep = participants(updates, n)
  positions = np.flatnonzero(keep)
  assert int(metrics['krum_selected']) == positions[np.argmin(np_krum_scores(x, 1))]
  # Scores are sums of <= 4 squared distances of 7 terms: 28 same-sign terms.
  np.testing.assert_allclose(float(metrics['krum_score']),
                             np_krum_scores(x, 1).min(), rtol=ft.rtol(28))


def test_trimmed_mean_reports_trimmed_count():
  updates, n = cohort_updates()
  _, _, metrics = aggregate(ra.trimmed_mean(0.3), updates, n)
  assert float(metrics['trimmed_clients']) == 2 * math.floor(0.3 * 7)


@pytest.mark.parametrize('weighting', ['num_examples', 'uniform'])
def test_geometric_median_matches_weiszfeld(weighting):
  updates, n = cohort_updates(outliers=1)
  got, _, metrics = aggregate(ra.geometric_median(nu=1e-6, iterations=4), updates, n,
                              weighting=weighting)
  x, counts, _ = participants(updates, n)
  alpha = counts if weighting == 'num_examples' else np.ones_like(counts)
  want, objective = np_weiszfeld(x, alpha, 1e-6, 4)
  # Each iteration: a 7-term norm and 8-term weighted sums (n ~ 20), and the
  # weights 1/||v - x_i|| carry v's error on (distances here are O(1) or
  # more, so by a factor of about ||x||/||v - x_i|| < 10): 5 chains of 20,
  # times 10.
  assert_close(got, want, 10 * 5 * 20, np.abs(x).max())
  np.testing.assert_allclose(float(metrics['geometric_median_objective']), objective,
                             rtol=10 * ft.rtol(5 * 20))
  assert float(metrics['weiszfeld_iterations']) == 4


def test_norm_bounding_matches_numpy():
  updates, n = cohort_updates()
  got, _, metrics = aggregate(ra.norm_bounding(max_norm=2.0), updates, n)
  x, counts, _ = participants(updates, n)
  # A 7-term norm, a scale, a 10-term weighted sum and a division.
  assert_close(got, np_norm_bounding(x, counts, 2.0), 20, np.abs(x).max())
  norms = np.linalg.norm(x, axis=1)
  assert float(metrics['clipped_clients']) == np.sum(norms > 2.0)
  np.testing.assert_allclose(float(metrics['mean_update_norm']), norms.mean(),
                             rtol=ft.rtol(20))


@pytest.mark.parametrize('iterations', [1, 3])
def test_centered_clipping_matches_numpy_and_keeps_its_center(iterations):
  updates, n = cohort_updates()
  agg = ra.centered_clipping(radius=1.5, iterations=iterations)
  x, _, _ = participants(updates, n)
  center = np.linspace(-1.0, 1.0, x.shape[1])
  state = unflat(jnp.asarray(center, jnp.float32), updates)
  got, new_state, metrics = aggregate(agg, updates, n, state=state)
  want = np_centered_clipping(x, center, 1.5, iterations)
  # Per iteration: a 7-term norm, a clip, a 10-term sum and a division.
  assert_close(got, want, iterations * 20, np.abs(x).max())
  assert_close(new_state, want, iterations * 20, np.abs(x).max())
  assert float(metrics['clipped_clients']) == np.sum(
      np.linalg.norm(x - center, axis=1) > 1.5)


@pytest.mark.slow
def test_skipped_and_padding_clients_change_nothing():
  """A cohort with padding and a NaN client aggregates as the cohort without them."""
  updates, n = cohort_updates()
  _, _, keep = participants(updates, n)
  only = jax.tree.map(lambda l: l[np.flatnonzero(keep)], updates)
  for name in ['median', 'trimmed_mean', 'krum', 'multi_krum', 'bulyan',
               'geometric_median', 'norm_bounding']:
    agg = parts.build_aggregator({'name': name})
    got, _, _ = aggregate(agg, updates, n)
    want, _, _ = aggregate(agg, only, n[keep])
    # Same float32 operations on the same values, up to the order of sums
    # of at most 10 terms (geometric median: 3 iterations of 20-op chains).
    assert_close(got, flat(want), 3 * 20, float(np.abs(flat(only)).max()))


# ------------------------------------------------------- Flower's scenarios
# The scenarios and expected numbers of Flower's strategy tests
# (github.com/adap/flower, framework/py/flwr/serverapp/strategy/
# multikrum_test.py, fedmedian_test.py, fedtrimmedavg_test.py, bulyan_test.py,
# and framework/py/flwr/server/strategy/bulyan_test.py), rebuilt as fedjx
# cohorts. Flower's Krum uses max(1, n - f - 2) neighbours; with n = 3 and
# num_malicious 1 that is 1 neighbour, which is num_byzantine = 0 here (the
# paper's n > 2f + 2 is checked).

def rows(*values):
  return {'w': jnp.asarray(np.array(values, np.float32))}


def test_flower_krum():
  got, _, _ = aggregate(ra.krum(0), rows([0.2] * 4, [0.7] * 4, [1.0] * 4), [5, 5, 5])
  np.testing.assert_array_equal(got['w'], np.float32([0.7] * 4))


def test_flower_multi_krum():
  got, _, _ = aggregate(ra.multi_krum(0, 2), rows([0.2] * 4, [0.5] * 4, [1.0] * 4),
                        [5, 5, 5])
  # The mean of two float32 values: one rounding of 0.35.
  np.testing.assert_allclose(got['w'], [0.35] * 4, rtol=2 * ft.U32)


def test_flower_fed_median():
  got, _, _ = aggregate(ra.coordinate_median(),
                        rows([1.0, 0.2, 0.5, 1.0], [0.2, 0.5, 1.0, 0.2],
                             [0.5, 1.0, 0.2, 0.5]), [5, 2, 9])
  np.testing.assert_array_equal(got['w'], np.float32([0.5] * 4))
  got, _, _ = aggregate(ra.coordinate_median(), rows(1.0, 3.0, 2.0), [1, 1, 1])
  assert got['w'].shape == () and float(got['w']) == 2.0


def test_flower_fed_trimmed_avg():
  got, _, _ = aggregate(ra.trimmed_mean(0.25),
                        rows([0.5] * 4, [1.0, 0.2, 0.5, 1.0], [0.2, 0.5, 1.0, 0.2],
                             [0.5, 1.0, 0.2, 0.5]), [1, 5, 2, 9])
  np.testing.assert_array_equal(got['w'], np.float32([0.5] * 4))
  got, _, _ = aggregate(ra.trimmed_mean(0.25), rows(0.5, 1.0, 2.0, 100.0), [1] * 4)
  assert got['w'].shape == () and float(got['w']) == 1.5


def test_flower_bulyan():
  values = [[0.2] * 4, [0.5] * 4, [0.7] * 4, [12.0] * 4, [0.1] * 4, [0.1] * 4]
  got, _, metrics = aggregate(ra.bulyan(0), rows(*values), [5] * 6)
  # f = 0: every client is selected and the mean of all 6 is kept (6 terms).
  np.testing.assert_allclose(got['w'], [(0.2 + 0.5 + 0.7 + 12.0 + 0.1 + 0.1) / 6] * 4,
                             rtol=ft.rtol(6))
  assert float(metrics['bulyan_selected_clients']) == 6


@pytest.mark.parametrize('reference, values, beta, want', [
    ([1.0], [[1.0], [2.0], [0.5]], 2, [0.75]),
    ([1.0, 2.0], [[1.1, 2.1], [0.9, 1.9], [5.0, 5.0]], 2, [1.0, 2.0]),
    ([0.0, 1.0], [[0.2, 1.2], [-0.1, 0.8], [10.0, 10.0]], 2, [0.05, 1.0]),
    ([0.0], [[1.0], [-0.5], [10.0]], 1, [-0.5]),
    ([0.0, 0.0], [[1.0, 2.0], [-1.0, 0.0], [3.0, 4.0]], 3, [1.0, 2.0]),
    ([42.0, -1.0], [[5.0, 5.0]] * 3, 2, [5.0, 5.0]),
])
def test_flower_closest_to_reference(reference, values, beta, want):
  """Flower's ``aggregate_n_closest_weights`` cases (Bulyan's last step)."""
  got = order_statistics.closest_mean(jnp.asarray(reference, jnp.float32),
                                      jnp.asarray(values, jnp.float32), beta)
  # Means of at most 3 float32 values.
  np.testing.assert_allclose(got, want, rtol=ft.rtol(3), atol=ft.rtol(3))


# --------------------------------------------------------- options, config

@pytest.mark.parametrize('build, message', [
    (lambda: ra.trimmed_mean(0.5), 'beta=0.5'),
    (lambda: ra.trimmed_mean(-0.1), 'beta=-0.1'),
    (lambda: ra.krum(-1), 'num_byzantine=-1'),
    (lambda: ra.krum(1.5), 'num_byzantine=1.5'),
    (lambda: ra.multi_krum(1, 0), 'num_selected=0'),
    (lambda: ra.bulyan(True), 'num_byzantine=True'),
    (lambda: ra.geometric_median(nu=0.0), 'nu=0.0'),
    (lambda: ra.geometric_median(iterations=0), 'iterations=0'),
    (lambda: ra.norm_bounding(max_norm=-1.0), 'max_norm=-1.0'),
    (lambda: ra.centered_clipping(radius=float('inf')), 'radius=inf'),
    (lambda: ra.centered_clipping(iterations=2.0), 'iterations=2.0'),
    (lambda: ra.dp_defense(ra.centered_clipping()), 'keeps state'),
])
def test_bad_options_are_one_line_errors(build, message):
  with pytest.raises(ValueError, match=message) as e:
    build()
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('defense, leaves, sent', [
    ({'name': 'centered_clipping'}, '1 array', ", sends 'center' of it to the "
     'clients each round'),
    ({'name': 'tree_gaussian'}, '3 arrays', ''),
])
def test_dp_defense_names_what_of_a_stateful_defense_outlives_a_round(defense, leaves,
                                                                      sent):
  # The error named centered_clipping's center whatever the defense was.
  state = parts.build_aggregator(defense).init({'x': jnp.zeros((1,))})
  assert f'{len(jax.tree.leaves(state))} array' in leaves
  with pytest.raises(ValueError) as e:
    ra.dp_defense(parts.build_aggregator(defense))
  assert str(e.value) == (
      f'dp_defense: the defense keeps state between rounds '
      f'({type(state).__name__}, {leaves}){sent}; the guarantee of dp_defense '
      'covers only the output it clips and noises, not state kept between rounds; '
      'use a stateless defense (median, trimmed_mean, krum, multi_krum, bulyan, '
      'geometric_median, norm_bounding).')
  with pytest.raises(ValueError, match="has a hyperparameter 'clip_norm' of its own"):
    ra.dp_defense(aggregators.gaussian(clip_norm=1.0, noise_multiplier=1.0))


@pytest.mark.parametrize('name, f, c, bound', [('krum', 2, 6, 7), ('multi_krum', 2, 6, 7),
                                               ('bulyan', 1, 6, 7)])
def test_cohort_bound_is_checked_when_the_round_is_traced(name, f, c, bound):
  agg = parts.build_aggregator({'name': name, 'num_byzantine': f})
  updates = rows(*[[float(i)] for i in range(c)])
  with pytest.raises(ValueError, match=f'at least .* = {bound} clients; this '
                     f"round's cohort has {c}"):
    aggregate(agg, updates, [1] * c)


def test_too_few_participants_is_reported():
  updates = rows(*[[float(i)] for i in range(7)])
  _, _, metrics = aggregate(ra.krum(2), updates, [1, 1, 1, 1, 1, 1, 0])
  assert float(metrics['robust_bound_violated']) == 1.0


@pytest.mark.parametrize('name', ['median', 'trimmed_mean', 'krum', 'multi_krum',
                                  'bulyan', 'geometric_median', 'norm_bounding',
                                  'centered_clipping'])
def test_config_names_select_the_defense(name):
  agg = parts.build_aggregator({'name': name})
  assert isinstance(agg, aggregators.Aggregator)
  assert (agg.traits.needs_all_updates is not None) == (name in (
      'median', 'trimmed_mean', 'krum', 'multi_krum', 'bulyan'))
  with pytest.raises(ValueError, match=(
      rf'config.algorithm.aggregator.no_such_option=1 is not an option of '
      rf'{name!r}\. It takes \[')):
    parts.build_aggregator({'name': name, 'no_such_option': 1})


def test_existing_aggregators_do_not_need_all_updates():
  assert aggregators.mean().traits.needs_all_updates is None
  assert aggregators.gaussian().traits.needs_all_updates is None


# ------------------------------------------- streaming, plans and Beam

def _round_setup(aggregator, sizes=(3, 5, 7, 2, 4, 6), seed=5):
  data = linreg_data(np.random.default_rng(seed), list(sizes))
  cohort = make_cohort(data, 2)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1),
                      server_optimizer=optax.sgd(1.0),
                      aggregator=parts.build_aggregator(aggregator))
  return data, cohort, algo


@pytest.mark.parametrize('name, why', [('median', 'order statistic'),
                                       ('krum', 'distances between all pairs')])
def test_streaming_refuses_rules_that_need_every_update(name, why):
  _, cohort, algo = _round_setup({'name': name, 'num_byzantine': 1} if name == 'krum'
                                 else {'name': name})
  state = algo.init(linreg_params())
  with pytest.raises(streaming.NotStreamableError,
                     match=f"aggregator '{name}' needs every client update at "
                     f'once .*{why}.*execution=.jit') as e:
    streaming.run(algo.apply, state, streaming.Clients.from_arrays(cohort), KEY,
                  chunk_size=2)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('spec', [
    {'name': 'geometric_median'},
    pytest.param({'name': 'centered_clipping', 'iterations': 2}, marks=pytest.mark.slow)])
def test_iterated_defenses_stream_by_training_again_in_each_pass(spec):
  """Weiszfeld's and further clipping iterations read each update after a
  weighted mean: each streamed pass trains the clients again (the same
  updates, from the same inputs and keys) and folds them into its sums, so
  the round equals the compiled one without keeping any update."""
  _, cohort, algo = _round_setup(spec)
  state = algo.init(linreg_params())
  want, want_metrics = jax.jit(algo.apply)(state, cohort, KEY)
  got, got_metrics = streaming.run(algo.apply, state,
                                   streaming.Clients.from_arrays(cohort), KEY,
                                   chunk_size=2)
  # As test_one_pass_defenses_stream, once per weighted mean (at most 4: the
  # start and 3 iterations), each iteration's weights from the previous one.
  np.testing.assert_allclose(flat(got.params), flat(want.params), rtol=ft.rtol(1600),
                             atol=ft.rtol(1600))
  assert float(got_metrics['clients']) == float(want_metrics['clients'])


@pytest.mark.parametrize('spec', [
    {'name': 'norm_bounding', 'max_norm': 0.3},
    pytest.param({'name': 'centered_clipping', 'radius': 0.2}, marks=pytest.mark.slow)])
def test_one_pass_defenses_stream(spec):
  _, cohort, algo = _round_setup(spec)
  state = algo.init(linreg_params())
  want, _ = jax.jit(algo.apply)(state, cohort, KEY)
  got, _ = streaming.run(algo.apply, state, streaming.Clients.from_arrays(cohort), KEY,
                         chunk_size=4)
  # Compensated chunk sums against pairwise sums of 6 terms after ~40 ops of
  # local training (test_algorithms_util.CHAIN covers both).
  np.testing.assert_allclose(flat(got.params), flat(want.params), rtol=ft.rtol(400),
                             atol=ft.rtol(400))


@pytest.mark.slow
@pytest.mark.parametrize('spec', [{'name': 'median'}, {'name': 'geometric_median'}])
def test_plan_evaluates_defenses_as_the_compiled_round(spec):
  """The MapReduce plan (Beam's input) of a round with a defense: a 'collect'
  for the stacked rules, maps and sums for Weiszfeld; its reference
  interpreter gives the compiled round's numbers."""
  _, cohort, algo = _round_setup(spec)
  state = algo.init(linreg_params())
  want, _ = jax.jit(algo.apply)(state, cohort, KEY)
  plan = plan_lib.trace_plan_with_clients(algo.apply, [state, cohort, KEY], [1])
  collects = [s for s in plan.steps if isinstance(s, plan_lib.ReduceStep) and s.why]
  assert bool(collects) == (spec['name'] == 'median')
  flat_args = jax.tree.leaves((state, cohort, KEY))
  got = jax.tree.unflatten(plan.out_tree, plan_lib.evaluate(plan, *flat_args))[0]
  np.testing.assert_allclose(flat(got.params), flat(want.params), rtol=ft.rtol(400),
                             atol=ft.rtol(400))


@pytest.mark.slow
@pytest.mark.parametrize('spec', [{'name': 'krum', 'num_byzantine': 1},
                                  {'name': 'geometric_median'}])
def test_defenses_run_on_beam(spec):
  beam = pytest.importorskip('fedjx.interpreters.beam')
  _, cohort, algo = _round_setup(spec)
  state = algo.init(linreg_params())
  want, _ = jax.jit(algo.apply)(state, cohort, KEY)
  got, _ = beam.run(algo.apply, state, beam.ClientData.from_arrays(cohort), KEY)
  # Beam's float64 combiners against the compiled float32 round (CHAIN).
  np.testing.assert_allclose(flat(got.params), flat(want.params), rtol=ft.rtol(400),
                             atol=ft.rtol(400))


# --------------------------------------------------------------- DP composition

def test_dp_defense_clips_inputs_and_output():
  updates, n = cohort_updates()
  agg = ra.dp_defense(ra.krum(num_byzantine=1), clip_norm=1.0,
                      noise_multiplier=0.0)
  got, _, metrics = aggregate(agg, updates, n)
  x, _, _ = participants(updates, n)
  clipped = np_clip(x, 1.0)
  want = np_clip(clipped[np.argmin(np_krum_scores(clipped, 1))], 1.0)
  # Two clips of a 7-term norm.
  assert_close(got, want, 20, 1.0)
  assert float(metrics['noise_std']) == 0.0
  np.testing.assert_allclose(float(metrics['clipped_fraction']),
                             np.mean(np.linalg.norm(x, axis=1) > 1.0), rtol=1e-6)


def test_dp_defense_noise_and_no_epsilon_reported():
  from fedjx.experiments import privacy
  updates, n = cohort_updates()
  spec = {'name': 'dp_defense', 'defense': {'name': 'median'}, 'clip_norm': 0.5,
          'noise_multiplier': 2.0}
  got, _, metrics = aggregate(parts.build_aggregator(spec), updates, n)
  assert float(metrics['noise_std']) == pytest.approx(2.0 * 2.0 * 0.5)
  # 7 coordinates of N(0, 2^2) noise around a point in the 0.5-ball.
  assert 0.5 < np.linalg.norm(flat(got)) < 25.0
  assert privacy.mechanism_of({'name': 'fedavg', 'aggregator': spec}) is None
