"""Defenses compose: with every algorithm, every map strategy and on a mesh.

The reference is the same algorithm with an *oracle aggregator*: its
combine hands the stacked updates to the NumPy float64 rule of
test_robust_aggregators (``jax.pure_callback``), so everything but the
defense (local training, the server optimizer, SCAFFOLD's controls,
DiLoCo's outer Nesterov step) is the algorithm's own, and the defense's
output must be what the rule gives on the updates the algorithm produced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fedjx.algorithms as algos
from fedjx.algorithms import aggregators
from fedjx.algorithms.aggregators import order_statistics
from fedjx.experiments import parts
import test_robust_aggregators as oracles
from test_algorithms_util import KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

# Config specs of the defenses and their float64 rules on the participants'
# rows ``x`` (weights ``w``: the algorithm's, example counts here) given the
# oracle's state (the last aggregate, for centered clipping).
DEFENSES = {
    'median': ({'name': 'median'}, lambda x, w, s: oracles.np_median(x)),
    'trimmed_mean': ({'name': 'trimmed_mean', 'beta': 0.2},
                     lambda x, w, s: oracles.np_trimmed(x, 0.2)),
    'krum': ({'name': 'krum', 'num_byzantine': 1},
             lambda x, w, s: x[np.argmin(oracles.np_krum_scores(x, 1))]),
    'multi_krum': ({'name': 'multi_krum', 'num_byzantine': 1, 'num_selected': 3},
                   lambda x, w, s: oracles.np_multi_krum(x, 1, 3)),
    'bulyan': ({'name': 'bulyan', 'num_byzantine': 1},
               lambda x, w, s: oracles.np_bulyan(x, 1)),
    'geometric_median': ({'name': 'geometric_median'},
                         lambda x, w, s: oracles.np_weiszfeld(x, w, 1e-6, 3)[0]),
    'norm_bounding': ({'name': 'norm_bounding', 'max_norm': 0.05},
                      lambda x, w, s: oracles.np_norm_bounding(x, w, 0.05)),
    'centered_clipping': ({'name': 'centered_clipping', 'radius': 0.05},
                          lambda x, w, s: oracles.np_centered_clipping(x, s, 0.05, 1)),
}


def oracle(rule):
  """An aggregator whose combine is ``rule`` in NumPy float64 on the stacked updates."""

  def combine(state, hparams, clients, key):
    del hparams, key
    (x, w), p = order_statistics.stacked('oracle', 'a NumPy reference',
                                         clients._replace(update=(clients.update,
                                                                  clients.weights)))
    leaves, treedef = jax.tree.flatten(x)
    flat_state = jnp.concatenate([l.reshape(-1) for l in jax.tree.leaves(state)])

    def host(p, w, s, *leaves):
      rows = np.concatenate([np.asarray(l, np.float64).reshape(len(p), -1)
                             for l in leaves], axis=1)
      p = np.asarray(p)
      return rule(rows[p], np.asarray(w, np.float64)[p],
                  np.asarray(s, np.float64)).astype(np.float32)

    spec = jax.ShapeDtypeStruct((flat_state.shape[0],), jnp.float32)
    vector = jax.pure_callback(host, spec, p, w, flat_state, *leaves)
    out, start = [], 0
    for l in leaves:
      size = int(np.prod(l.shape[1:]))
      out.append(vector[start:start + size].reshape(l.shape[1:]))
      start += size
    out = jax.tree.unflatten(treedef, out)
    return out, out, {}

  return aggregators.Aggregator(init=lambda p: jax.tree.map(jnp.zeros_like, p),
                                combine=combine)


SIZES = [3, 5, 7, 2, 4, 6, 8, 0, 5, 3]  # client 7 is padding

# Each builder takes a config's aggregator spec, built as the runner builds it.
_built = parts.build_aggregator
BUILDERS = {
    'fedavg': lambda agg: algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.05),
                                       server_optimizer=optax.sgd(1.0),
                                       aggregator=_built(agg)),
    'fedadam': lambda agg: algos.fedadam(linreg_loss, aggregator=_built(agg)),
    'fedprox': lambda agg: algos.fedprox(linreg_loss, mu=0.1, aggregator=_built(agg)),
    'scaffold': lambda agg: algos.scaffold(linreg_loss, len(SIZES), aggregator=_built(agg)),
    'diloco': lambda agg: algos.diloco(linreg_loss, len(SIZES), aggregator=_built(agg)),
}


def cohort():
  data = linreg_data(np.random.default_rng(11), [max(s, 1) for s in SIZES])
  data[7] = {k: v[:0] for k, v in data[7].items()}
  return make_cohort(data, 2, client_ids=list(range(len(SIZES))))


def two_rounds(algo, cohort):
  state = algo.init(linreg_params())
  metrics = None
  for r in range(2):
    state, metrics = algo.round(state, cohort, jax.random.fold_in(KEY, r))
  return state, metrics


def check_against_oracle(algorithm, defense, map_strategy='vmap', chunk_size=None):
  spec, rule = DEFENSES[defense]
  c = cohort()
  got, metrics = two_rounds(BUILDERS[algorithm](spec).compile(map_strategy, chunk_size), c)
  want, _ = two_rounds(BUILDERS[algorithm](oracle(rule)), c)
  # Two rounds of local SGD (test_algorithms_util.CHAIN) and the defense's
  # float32 sums of <= 10 terms (Weiszfeld: 3 iterations of them).
  assert_trees_close(got.params, want.params)
  for leaf in jax.tree.leaves(metrics):
    assert np.all(np.isfinite(np.asarray(leaf)))
  return metrics


@pytest.mark.parametrize('algorithm, defense', [
    ('scaffold', 'geometric_median'),
    pytest.param('fedavg', 'median', marks=pytest.mark.slow),
    pytest.param('fedadam', 'krum', marks=pytest.mark.slow),
    pytest.param('fedprox', 'bulyan', marks=pytest.mark.slow),
    pytest.param('diloco', 'centered_clipping', marks=pytest.mark.slow)])
def test_defense_with_algorithm(algorithm, defense):
  check_against_oracle(algorithm, defense)


@pytest.mark.parametrize('defense', [
    'trimmed_mean', pytest.param('geometric_median', marks=pytest.mark.slow)])
def test_defense_in_fused_chunks(defense):
  check_against_oracle('fedavg', defense, 'chunked', 3)


@pytest.mark.slow
@pytest.mark.parametrize('defense', sorted(DEFENSES))
@pytest.mark.parametrize('algorithm', sorted(BUILDERS))
def test_every_defense_with_every_algorithm(algorithm, defense):
  check_against_oracle(algorithm, defense)


@pytest.mark.slow
@pytest.mark.parametrize('strategy, chunk', [('chunked', 4), ('sequential', None),
                                             ('auto', None)])
@pytest.mark.parametrize('defense', sorted(DEFENSES))
def test_every_defense_under_every_map_strategy(defense, strategy, chunk):
  check_against_oracle('fedavg', defense, strategy, chunk)


@pytest.mark.parametrize('defense', [
    'median', pytest.param('geometric_median', marks=pytest.mark.slow)])
def test_defense_on_an_explicit_clients_mesh(defense):
  sizes = [3, 5, 7, 2, 4, 6, 8, 1]
  data = linreg_data(np.random.default_rng(60), sizes)
  c = make_cohort(data, 2, client_ids=list(range(8)))
  algo = BUILDERS['fedavg'](DEFENSES[defense][0])
  expected, _ = algo.round(algo.init(linreg_params()), c, KEY)
  mesh = jax.make_mesh((8,), ('clients',), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    placed = jax.device_put(c, NamedSharding(mesh, P('clients')))
    state, _ = algo.round(algo.init(linreg_params()), placed, KEY)
  assert_trees_close(state.params, expected.params)


@pytest.mark.parametrize('algorithm', [
    'fedavg', pytest.param('fedprox', marks=pytest.mark.slow)])
def test_defense_with_dp_noise(algorithm):
  spec = {'name': 'dp_defense', 'defense': {'name': 'trimmed_mean', 'beta': 0.2},
          'clip_norm': 0.05, 'noise_multiplier': 0.0}
  c = cohort()
  clip = lambda x: oracles.np_clip(x, 0.05)
  rule = lambda x, w, s: clip(oracles.np_trimmed(clip(x), 0.2))
  got, metrics = two_rounds(BUILDERS[algorithm](spec), c)
  want, _ = two_rounds(BUILDERS[algorithm](oracle(rule)), c)
  assert_trees_close(got.params, want.params)


@pytest.mark.slow
def test_defense_with_dp_noise_on():
  """The traced noise multiplier turned on: the same compiled round."""
  spec = {'name': 'dp_defense', 'defense': {'name': 'trimmed_mean', 'beta': 0.2},
          'clip_norm': 0.05, 'noise_multiplier': 0.0}
  c = cohort()
  # SCAFFOLD refuses it: its control variates are summed exactly beside.
  with pytest.raises(ValueError, match='scaffold: aggregator dp_defense .* is refused'):
    BUILDERS['scaffold'](spec)
  algo = BUILDERS['fedadam'](spec)
  state = algo.init(linreg_params())
  state = state._replace(hparams=dict(state.hparams, noise_multiplier=jnp.float32(1.0)))
  state, metrics = algo.round(state, c, KEY)
  assert float(metrics['noise_std']) == pytest.approx(2 * 1.0 * 0.05)
  for leaf in jax.tree.leaves(state.params):
    assert np.all(np.isfinite(np.asarray(leaf)))


# ------------------------------------------------------------ from a config

def _digits_config(aggregator, **fields):
  import os
  from config_files import load
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = load(os.path.join(repo, 'configs', 'fedavg_digits.py'))
  config.rounds = 2
  config.eval_every = 2
  config.tensorboard = config.plot = config.progress = False
  config.algorithm.aggregator = aggregator
  for k, v in fields.items():
    setattr(config, k, v)
  return config


@pytest.mark.slow
def test_a_run_from_a_config_reports_the_defense(tmp_path):
  from fedjx.experiments import runner
  config = _digits_config(dict(name='krum', num_byzantine=2))
  rows = runner.run(config, str(tmp_path)).history
  train = [r for r in rows if 'krum_selected' in r]
  assert len(train) == 2
  for r in train:
    assert 0 <= r['krum_selected'] < config.cohort_size
    assert r['robust_bound_violated'] == 0.0


@pytest.mark.slow
def test_a_streamed_run_refuses_a_stacked_defense(tmp_path):
  from fedjx import streaming
  from fedjx.experiments import runner
  config = _digits_config(dict(name='trimmed_mean', beta=0.1), execution='streaming')
  with pytest.raises(streaming.NotStreamableError,
                     match="aggregator 'trimmed_mean' needs every client update"):
    runner.run(config, str(tmp_path))


# ------------------------------------------------------------ hypergradients

@pytest.mark.slow
@pytest.mark.parametrize('defense', ['norm_bounding', 'median', 'krum', 'geometric_median',
                                     'centered_clipping', 'bulyan'])
def test_hypergradient_through_a_defense(defense):
  """``grad`` of a round's loss with respect to ``state.hparams`` (the client
  and server learning rates, and the defense's traced clip radius) matches
  central differences."""
  from jax.test_util import check_grads
  data = linreg_data(np.random.default_rng(0), [3, 5, 7, 2, 4, 6, 8])
  c = make_cohort(data, 2)
  algo = algos.fedavg(linreg_loss, client_optimizer=algos.default_sgd(0.1),
                      aggregator=parts.build_aggregator(DEFENSES[defense][0]))
  state = algo.init(linreg_params())
  held_out = {k: jnp.asarray(v) for k, v in data[0].items()}

  @jax.jit
  def objective(hparams):
    new, _ = algo.apply(state._replace(hparams=hparams), c, KEY)
    return jnp.mean(linreg_loss(new.params, held_out))

  # Central differences with eps = 1e-3 on a float32 loss of magnitude ~1:
  # rounding u / eps ~ 6e-5, truncation eps^2 |f'''| ~ 1e-6 for O(1)
  # curvature; 2e-3 is 30 times the larger (the points are away from the
  # clip's and the order statistics' kinks).
  check_grads(objective, (state.hparams,), order=1, modes=['rev'], eps=1e-3,
              atol=2e-3, rtol=2e-3)


def test_a_privacy_budget_with_dp_defense_is_refused():
  """The accountant knows only its DP aggregators: no epsilon for dp_defense."""
  from fedjx.experiments import config as config_schema
  from fedjx.experiments import privacy
  config = _digits_config(dict(name='dp_defense', defense=dict(name='median'),
                               clip_norm=1.0, noise_multiplier=1.0))
  config.privacy = dict(target_epsilon=8.0)
  config = config_schema.with_defaults(config)
  assert privacy.mechanism_of(config.algorithm) is None
  with pytest.raises(config_schema.ConfigError, match='target_epsilon=8.0') as e:
    privacy.plan(config, 50)
  assert '\n' not in str(e.value)
