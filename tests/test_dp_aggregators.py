"""The DP aggregators (gaussian, adaptive_gaussian, tree_gaussian) with FedAvg,
FedAdam, FedProx and DiLoCo: hand-computed rounds without noise, finite
rounds with noise; the algorithms that release more than the noised
aggregate (SCAFFOLD, FedExP, Mime, ...) refuse every DP aggregator."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.experiments import parts
from test_algorithms_util import (KEY, assert_trees_close, copy, linreg_data,
                                  linreg_loss, linreg_params, make_cohort,
                                  reference_sgd)

CLIP, D, LR, ETA_C, GAMMA = 0.3, 4.0, 0.1, 0.2, 0.5

# Each aggregator without noise (its noise is a traced hyperparameter).
SPECS = {
    'gaussian': dict(name='gaussian', clip_norm=CLIP, noise_multiplier=0.0,
                     expected_clients_per_round=D),
    'adaptive_gaussian': dict(name='adaptive_gaussian', noise_multiplier=0.0,
                              initial_clip_norm=CLIP, clipped_count_stddev=0.0,
                              target_quantile=GAMMA, clip_learning_rate=ETA_C,
                              expected_clients_per_round=D),
    'tree_gaussian': dict(name='tree_gaussian', clip_norm=CLIP,
                          noise_multiplier=0.0, restart_every=None,
                          expected_clients_per_round=D),
}
# The hyperparameters that turn the noise on (sigma_b > z / 2 for adaptive).
NOISE = {'noise_multiplier': 1.0, 'clipped_count_stddev': 1.0}

BUILDERS = {
    'fedavg': lambda agg: algos.fedavg(linreg_loss, client_optimizer=optax.sgd(LR),
                                       aggregator=agg),
    'fedadam': lambda agg: algos.fedadam(linreg_loss, client_optimizer=optax.sgd(LR),
                                         aggregator=agg),
    'fedprox': lambda agg: algos.fedprox(linreg_loss, mu=0.1,
                                         client_optimizer=optax.sgd(LR),
                                         aggregator=agg),
    'diloco': lambda agg: algos.diloco(linreg_loss, num_replicas=3,
                                       inner_optimizer=optax.sgd(LR),
                                       aggregator=agg),
}


def setup():
  data = linreg_data(np.random.default_rng(80), [6, 4, 5], dim=3, shift=4.0)
  return data, make_cohort(data, batch_size=3)


def clipped(delta, clip):
  norm = float(optax.tree.norm(delta))
  return jax.tree.map(lambda u: u * min(1.0, clip / norm), delta), norm


def next_clip(norms, clip, name):
  """The clip norm of the next round: adaptive's geometric step, else fixed."""
  if name != 'adaptive_gaussian':
    return clip
  fraction = (np.sum(np.asarray(norms) <= clip) - 3 / 2) / D + 1 / 2
  return clip * np.exp(-ETA_C * (fraction - GAMMA))


def reference_fedavg(data, name, rounds=2):
  """FedAvg (server SGD 1) on the clipped sum over D, noise off."""
  x, clip = linreg_params(), CLIP
  for _ in range(rounds):
    deltas, norms = zip(*[clipped(jax.tree.map(jnp.subtract, x, reference_sgd(
        linreg_loss, x, c, 3, LR)[0]), clip) for c in data])
    x = jax.tree.map(lambda p, *ds: p - sum(ds) / D, x, *deltas)
    clip = next_clip(norms, clip, name)
  return x


REFERENCES = {'fedavg': reference_fedavg}


@pytest.mark.parametrize('aggregator', sorted(SPECS))
@pytest.mark.parametrize('algorithm', sorted(BUILDERS))
def test_dp_aggregator_runs_with_the_algorithm(algorithm, aggregator):
  data, cohort = setup()
  algo = BUILDERS[algorithm](parts.build_aggregator(SPECS[aggregator]))
  state0 = algo.init(linreg_params())
  keys = [jax.random.fold_in(KEY, r) for r in range(2)]
  state = copy(state0)
  for key in keys:  # Noise off.
    state, metrics = algo.round(state, cohort, key)
  for leaf in jax.tree.leaves((state.params, metrics)):
    assert np.all(np.isfinite(np.asarray(leaf)))
  if algorithm in REFERENCES:
    # Two rounds of local SGD and the aggregate (CHAIN covers them).
    assert_trees_close(state.params, REFERENCES[algorithm](data, aggregator))
  # Noise on (traced hyperparameters: the same compiled round).
  hparams = dict(state0.hparams, **{k: jnp.float32(v) for k, v in NOISE.items()
                                    if k in state0.hparams})
  state = copy(state0)._replace(hparams=hparams)
  for key in keys:
    state, metrics = algo.round(state, cohort, key)
  assert float(metrics['noise_std']) > 0
  for leaf in jax.tree.leaves((state.params, metrics)):
    assert np.all(np.isfinite(np.asarray(leaf)))
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params,
                       state0.params)
  assert max(jax.tree.leaves(moved)) > 0


def test_noise_drawn_in_groups_equals_a_draw_per_leaf():
  """normal_like draws leaves of a dtype together as rows of one vmapped
  draw (fewer threefry programs to compile); every leaf must get exactly
  jax.random.normal(k_i, shape_i, dtype_i), bit for bit: sizes from 0 to
  beyond the padding allowance, a scalar, odd shapes, two dtypes."""
  shapes = [(300, 301), (64, 128), (128,), (), (0, 3), (7, 5, 3), (1,), (2 ** 17,)]
  leaves = [jnp.zeros(s, jnp.float32) for s in shapes]
  leaves += [jnp.zeros((33, 9), jnp.bfloat16), jnp.zeros((4,), jnp.bfloat16)]
  keys = jax.random.split(jax.random.key(11), len(leaves))
  got = jax.jit(algos.aggregators.normal_like)(leaves, keys)
  for x, k, z in zip(leaves, keys, got):
    want = jax.random.normal(k, x.shape, x.dtype)
    assert z.shape == x.shape and z.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(z, np.float32), np.asarray(want, np.float32))


# Every DP aggregator, central, distributed and local, as a config spec.
DP_SPECS = {
    'gaussian': dict(name='gaussian'),
    'adaptive_gaussian': dict(name='adaptive_gaussian',
                              expected_clients_per_round=100.0),
    'tree_gaussian': dict(name='tree_gaussian'),
    'dp_defense': dict(name='dp_defense', defense=dict(name='median')),
    'distributed_skellam': dict(name='distributed_skellam'),
    'local_gaussian': dict(name='local_gaussian'),
}
# Algorithms whose round releases more than the aggregate of the messages a
# DP aggregator noises (their trait Traits.unprivatized), and why.
UNPRIVATIZED = {
    'fedexp': (lambda agg: algos.fedexp(linreg_loss, aggregator=agg),
               'sum_i ||Delta_i||^2'),
    'mime': (lambda agg: algos.mime(linreg_loss, aggregator=agg),
             'full-batch gradients'),
    'feddyn': (lambda agg: algos.feddyn(linreg_loss, num_clients=3,
                                        aggregator=agg), 'g_k'),
    'qffl': (lambda agg: algos.qffl(linreg_loss, aggregator=agg), 'h_k'),
    'afl': (lambda agg: algos.afl(linreg_loss, num_domains=2, aggregator=agg),
            'per-domain losses'),
    'hyp_cluster': (lambda agg: algos.hyp_cluster(linreg_loss, aggregator=agg),
                    'which cluster'),
    'scaffold': (lambda agg: algos.scaffold(linreg_loss, num_clients=3,
                                            aggregator=agg),
                 'control variate change'),
}


def test_dp_aggregators_declare_their_privacy():
  from fedjx.algorithms import aggregators
  for name in parts.AGGREGATORS:
    spec = DP_SPECS.get(name, {'name': name})
    try:
      agg = parts.build_aggregator(spec)
    except ValueError:  # Builders with required options (top_k's k, ...).
      assert name not in DP_SPECS
      continue
    if name in DP_SPECS:
      assert agg.traits.privacy is not None, name
      assert str(agg.traits.privacy).startswith(name), name
      # Declared by its builder, where it is defined.
      assert parts.AGGREGATORS[name].traits.privacy.name == name
    else:
      assert agg.traits.privacy is None, name


@pytest.mark.parametrize('aggregator', sorted(DP_SPECS))
@pytest.mark.parametrize('algorithm', sorted(UNPRIVATIZED))
def test_algorithms_that_release_more_refuse_every_dp_aggregator(algorithm,
                                                                 aggregator):
  """One rule (the algorithm's declared trait, read by
  base.check_private_uploads): one line naming the algorithm, the
  aggregator and why."""
  build, why = UNPRIVATIZED[algorithm]
  with pytest.raises(ValueError) as e:
    build(parts.build_aggregator(DP_SPECS[aggregator]))
  text = str(e.value)
  assert '\n' not in text
  assert text.startswith(f'{algorithm}: aggregator {aggregator} (')
  assert ' DP) is refused: ' in text and why in text
  # The same algorithm with a non-private aggregator declares its trait.
  assert build(None).traits.unprivatized is not None


def test_algorithms_whose_message_is_all_they_release_take_dp_aggregators():
  for spec in map(parts.build_aggregator, DP_SPECS.values()):
    for algo in (algos.mime_lite(linreg_loss, aggregator=spec),
                 algos.fedavg(linreg_loss, aggregator=spec)):
      assert algo.traits.unprivatized is None
