"""The non-finite guard: a NaN/Inf client is left out of the round and counted.

Every fault below hits client 2 of a five-client cohort; the guarded round
must equal the same algorithm's round on the four-client cohort without it
(and a second, clean round must then agree too, so the skipped client's
stored state, SCAFFOLD's ``c_i`` or DiLoCo's inner optimizer state, was left
as it was).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import nonfinite
from fedjx.experiments import parts
import float_tolerance as ft
from test_algorithms_util import copy, linreg_data, linreg_params, make_cohort

C, BAD, T, DIM, B = 5, 2, 2, 3, 4  # Clients, the faulty one, local steps,
                                   # features, batch size.

# Tolerance of "equals the round without the client". The two rounds run the
# same per-client float32 operations; they may differ in (a) the order of the
# weighted sum over the cohort (C terms, the skipped one an exact zero), (b)
# how the weighted mean is formed (the guard: a sum of w_i Delta_i and one
# division; unguarded: a dot product and a division, two roundings), and (c)
# XLA choosing other kernels for a vmap over 4 instead of 5 clients, which
# reorders each of the T local steps' DIM-term predictions and B-example
# means: n = C + 2 + T (DIM + B) terms, so 2 gamma_n (float_tolerance.rtol)
# of the scale. The server optimizers used here amplify a relative error of
# the pseudo-gradient at most 2x (Adam's m / sqrt(v) with eps), hence
RTOL = 2 * ft.rtol(C + 2 + T * (DIM + B))


def scaled_loss(params, batch):
  """Squared error times a per-example scale ``s``.

  SGD with learning rate ``eta`` on ``s * loss`` is SGD with learning rate
  ``s * eta`` on ``loss``: a client whose examples have ``s = inf`` trains
  with ``learning_rate=inf`` while the others train with ``eta``.
  """
  pred = batch['x'] @ params['w'] + params['b']
  return batch['s'] * 0.5 * jnp.square(pred - batch['y'])


def _clean_cohort(seed=0):
  data = linreg_data(np.random.default_rng(seed), [6, 8, 5, 7, 8], dim=DIM)
  for d in data:
    d['s'] = np.ones(len(d['y']), np.float32)
  return make_cohort(data, batch_size=B)


def _with_fault(cohort, fault):
  batches = {k: np.array(v) for k, v in cohort.batches.items()}
  n = np.array(cohort.num_examples)
  if fault == 'nan_data':
    batches['x'][BAD, 0, 1, 0] = np.nan
  elif fault == 'inf_data':
    batches['y'][BAD, 1, 0] = np.inf
  elif fault == 'nan_weight':
    n[BAD] = np.nan
  elif fault == 'inf_learning_rate':
    batches['s'][BAD] = np.inf
  else:
    raise ValueError(fault)
  return cohort._replace(batches=jax.tree.map(jnp.asarray, batches),
                         num_examples=jnp.asarray(n))


def _without(cohort, i):
  keep = np.array([j for j in range(C) if j != i])
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[keep]), cohort)


sgd = functools.partial(algos.base.default_sgd, 0.1)
BUILDERS = {
    'fedavg': lambda **kw: algos.fedavg(
        scaled_loss, client_optimizer=sgd(), local_steps=T, **kw),
    'fedadam': lambda **kw: algos.fedadam(
        scaled_loss, client_optimizer=sgd(), server_learning_rate=0.05,
        local_steps=T, **kw),
    'fedprox': lambda **kw: algos.fedprox(
        scaled_loss, mu=0.5, client_optimizer=sgd(), local_steps=T, **kw),
    'scaffold': lambda **kw: algos.scaffold(
        scaled_loss, C, client_learning_rate=0.1, local_steps=T, **kw),
    'dp_fedavg': lambda **kw: algos.dp_fedavg(
        scaled_loss, clip_norm=0.5, noise_multiplier=0.3,
        client_optimizer=sgd(), local_steps=T, **kw),
    'diloco': lambda **kw: algos.diloco(
        scaled_loss, C, inner_optimizer=optax.inject_hyperparams(optax.adam)(
            learning_rate=0.05), inner_steps=T, **kw),
    'streaming_diloco': lambda **kw: algos.streaming_diloco(
        scaled_loss, C, num_fragments=2, quantization_format='float32',
        inner_steps=T, **kw),
    'eager_diloco': lambda **kw: algos.eager_diloco(
        scaled_loss, C, inner_optimizer=sgd(), inner_steps=T, **kw),
    # Aggregators on other algorithms: the guard works with every one.
    'dp_fedadam': lambda **kw: algos.fedadam(
        scaled_loss, client_optimizer=sgd(), server_learning_rate=0.05,
        local_steps=T, aggregator=algos.aggregators.gaussian(0.5, 0.3), **kw),
    'dp_diloco': lambda **kw: algos.diloco(
        scaled_loss, C, inner_optimizer=sgd(), inner_steps=T,
        aggregator=algos.aggregators.gaussian(0.5, 0.3), **kw),
    # The DP aggregators check their norms ||Delta_i|| (checks_update).
    'dp_adaptive_fedavg': lambda **kw: algos.fedavg(
        scaled_loss, client_optimizer=sgd(), local_steps=T,
        aggregator=parts.AGGREGATORS['adaptive_gaussian'](
            noise_multiplier=0.3, initial_clip_norm=0.5,
            clipped_count_stddev=0.5), **kw),
    'dp_ftrl_fedavg': lambda **kw: algos.fedavg(
        scaled_loss, client_optimizer=sgd(), local_steps=T,
        aggregator=parts.AGGREGATORS['tree_gaussian'](
            clip_norm=0.5, noise_multiplier=0.3), **kw),
    'int8_fedavg': lambda **kw: algos.fedavg(
        scaled_loss, client_optimizer=sgd(), local_steps=T,
        aggregator=algos.aggregators.quantized_mean('int8'), **kw),
}
FAULTS = ('nan_data', 'inf_data', 'nan_weight', 'inf_learning_rate')


def _assert_states_close(got, want):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    if np.issubdtype(w.dtype, np.floating):
      scale = float(np.max(np.abs(w))) if w.size else 0.0
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * scale,
                                 err_msg=jax.tree_util.keystr(path))
    else:
      np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


@functools.lru_cache(maxsize=None)
def _algo(name, skip=True):
  return BUILDERS[name](skip_nonfinite=skip)


@pytest.mark.parametrize('name', list(BUILDERS))
def test_a_nonfinite_client_is_skipped_and_counted(name):
  algo = _algo(name)
  clean = _clean_cohort()
  state0 = algo.init(linreg_params(DIM))
  key1, key2 = jax.random.split(jax.random.key(1))
  # The reference: the cohort without client 2, then a clean round.
  ref, ref_metrics = algo.round(copy(state0), _without(clean, BAD), key1)
  ref_next, _ = algo.round(copy(ref), clean, key2)
  for fault in FAULTS:
    state, metrics = algo.round(copy(state0), _with_fault(clean, fault), key1)
    assert float(metrics['nonfinite_clients']) == 1, fault
    assert float(ref_metrics['nonfinite_clients']) == 0
    assert float(metrics['clients']) == C - 1
    assert float(metrics['examples']) == float(ref_metrics['examples'])
    for k, v in ref_metrics.items():
      if k != 'nonfinite_clients':
        np.testing.assert_allclose(metrics[k], v, rtol=RTOL, atol=RTOL,
                                   err_msg=f'{fault} {k}')
    _assert_states_close(state, ref)
    state, _ = algo.round(state, clean, key2)
    _assert_states_close(state, ref_next)


@pytest.mark.parametrize('name', ['fedavg', 'scaffold', 'diloco'])
def test_without_the_guard_one_nan_client_poisons_the_model(name):
  algo = _algo(name, skip=False)
  state, metrics = algo.round(algo.init(linreg_params(DIM)),
                              _with_fault(_clean_cohort(), 'nan_data'),
                              jax.random.key(1))
  assert 'nonfinite_clients' not in metrics
  assert not np.all(np.isfinite(np.asarray(state.params['w'])))


@pytest.mark.parametrize('name', list(BUILDERS))
def test_on_finite_cohorts_the_guard_changes_nothing(name):
  cohort, key = _clean_cohort(3), jax.random.key(2)
  params = linreg_params(DIM)
  on, off = _algo(name), _algo(name, skip=False)
  got, got_metrics = on.round(on.init(params), cohort, key)
  want, want_metrics = off.round(off.init(params), cohort, key)
  assert float(got_metrics.pop('nonfinite_clients')) == 0
  assert got_metrics.keys() == want_metrics.keys()
  _assert_states_close(got, want)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(got_metrics[k], v, rtol=RTOL, atol=RTOL, err_msg=k)


def test_padding_clients_are_not_counted_and_all_bad_changes_nothing():
  algo = _algo('fedavg')
  cohort = _with_fault(_clean_cohort(), 'nan_data')
  # Client 0 becomes padding (no examples); every real client is non-finite.
  mask = np.array(cohort.mask)
  mask[0] = False
  n = np.array(cohort.num_examples)
  n[0] = 0
  x = np.array(cohort.batches['x'])
  x[1:, 0, 0, 0] = np.nan
  cohort = cohort._replace(mask=jnp.asarray(mask), num_examples=jnp.asarray(n),
                           batches=dict(cohort.batches, x=jnp.asarray(x)))
  params = linreg_params(DIM)
  state, metrics = algo.round(algo.init(params), cohort, jax.random.key(0))
  assert float(metrics['nonfinite_clients']) == C - 1
  assert float(metrics['clients']) == 0 and float(metrics['examples']) == 0
  np.testing.assert_array_equal(state.params['w'], params['w'])
  np.testing.assert_array_equal(state.params['b'], params['b'])


def test_uniform_weighting_and_fedopt_conveniences_take_the_flag():
  for build in (algos.fedyogi, algos.fedadagrad, algos.fedavgm):
    algo = build(scaled_loss, skip_nonfinite=False, weighting='uniform')
    _, metrics = algo.round(algo.init(linreg_params(DIM)), _clean_cohort(),
                            jax.random.key(0))
    assert 'nonfinite_clients' not in metrics
  with pytest.raises(ValueError, match=r"skip_nonfinite='yes' must be True or False"):
    algos.fedavg(scaled_loss, skip_nonfinite='yes')


@pytest.mark.parametrize('name', ['fedavg', 'fedadam', 'fedprox'])
def test_guarded_round_and_its_gradient_are_plans(name):
  # The guard lives inside the clients' one map, and the weights of the
  # weighted mean never come out of it, so the round (the cohort held by the
  # clients) and its gradient are MapReduce plans.
  from fedjx import plan as plan_lib
  cohort = _clean_cohort()
  maps = []
  for skip in (True, False):
    algo = _algo(name, skip)
    plan = plan_lib.trace_plan_with_clients(
        algo.apply, (algo.init(linreg_params(DIM)), cohort, jax.random.key(0)),
        client_args=(1,))
    maps.append(sum(isinstance(s, plan_lib.MapStep) for s in plan.steps))
  assert maps[0] <= maps[1]  # No map added: the guard runs in the clients' map.
  algo = _algo(name)

  def objective(params):
    new, _ = algo.apply(algo.init(params), cohort, jax.random.key(0))
    return jnp.sum(new.params['w'] ** 2)

  plan_lib.trace_plan(jax.grad(objective), linreg_params(DIM))


def test_all_finite():
  assert bool(nonfinite.all_finite({'a': jnp.ones(3), 'b': (jnp.zeros(2),)}))
  assert not bool(nonfinite.all_finite({'a': jnp.array([1.0, jnp.inf])}))
  assert not bool(nonfinite.all_finite([jnp.ones(2), jnp.array(jnp.nan)]))
  assert bool(nonfinite.all_finite(jnp.arange(3)))  # Integers are finite.


# Large float32 matrices: checked on the CPU with a matrix-vector product.
LARGE = (nonfinite.DOT_CHECK_MIN_SIZE // 64, 64)


@pytest.mark.parametrize('shape', [LARGE, (3, LARGE[0], 32), (LARGE[0] * 64, 1)])
def test_all_finite_of_large_matrices_is_numpys(shape):
  rng = np.random.default_rng(0)
  # Finite values up to the float32 maximum: x * 0 is 0 for all of them, so
  # nothing overflows into a false alarm.
  x = (rng.uniform(-1, 1, size=shape) * np.finfo(np.float32).max).astype(np.float32)
  checks = (nonfinite.all_finite, jax.jit(nonfinite.all_finite))
  for check in checks:
    assert bool(check(x)) is bool(np.all(np.isfinite(x))) is True
  flat = x.reshape(-1)
  corners = [0, shape[-1] - 1, flat.size - shape[-1], flat.size - 1, flat.size // 2 + 7]
  for i in corners:
    for bad in (np.nan, np.inf, -np.inf):
      y = flat.copy()
      y[i] = bad
      y = y.reshape(shape)
      for check in checks:
        assert bool(check(y)) is bool(np.all(np.isfinite(y))) is False, (i, bad)
      batched = np.stack([x, y, x])
      got = jax.jit(jax.vmap(nonfinite.all_finite))(batched)
      want = [bool(np.all(np.isfinite(b))) for b in batched]
      assert [bool(g) for g in got] == want == [True, False, True], (i, bad)


def _matrix_loss(params, batch):
  """``s * 0.5 * ||x W - y||^2`` per example, ``W`` one large matrix."""
  pred = batch['x'] @ params['w']
  return batch['s'] * 0.5 * jnp.sum(jnp.square(pred - batch['y']), axis=-1)


def test_a_client_nonfinite_in_one_column_of_a_large_matrix_is_skipped():
  k_in, k_out = LARGE
  rng = np.random.default_rng(4)
  data = []
  for n in [6, 8, 5, 7, 8]:
    x = rng.normal(size=(n, k_in)).astype(np.float32) / np.sqrt(k_in)
    y = rng.normal(size=(n, k_out)).astype(np.float32)
    data.append({'x': x, 'y': y, 's': np.ones(n, np.float32)})
  clean = make_cohort(data, batch_size=B)
  batches = {k: np.array(v) for k, v in clean.batches.items()}
  # Only the last output column of client 2's model becomes Inf/NaN.
  batches['y'][BAD, 1, 0, k_out - 1] = np.inf
  bad = clean._replace(batches=jax.tree.map(jnp.asarray, batches))
  algo = algos.fedavg(_matrix_loss, client_optimizer=sgd(), local_steps=T)
  params = {'w': jnp.asarray(rng.normal(size=LARGE).astype(np.float32) * 0.1)}
  key = jax.random.key(0)
  state, metrics = algo.round(algo.init(params), bad, key)
  ref, ref_metrics = algo.round(algo.init(params), _without(clean, BAD), key)
  assert float(metrics['nonfinite_clients']) == 1
  assert float(metrics['clients']) == C - 1
  # As RTOL, with k_in-term predictions in each local step.
  rtol = 2 * ft.rtol(C + 2 + T * (k_in + B))
  got, want = np.asarray(state.params['w']), np.asarray(ref.params['w'])
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=rtol,
                             atol=rtol * float(np.max(np.abs(want))))


@pytest.mark.parametrize('value', [np.inf, -np.inf, np.nan])
def test_nonfinite_hyperparameters_are_one_line_errors(value):
  with pytest.raises(ValueError, match=r"fedprox: mu=.* must be a finite number >= 0"):
    algos.fedprox(scaled_loss, mu=value)
  algo = algos.fedavg(scaled_loss, client_optimizer=algos.base.default_sgd(value))
  with pytest.raises(ValueError, match=r'client_optimizer learning_rate=.*finite'):
    algo.init(linreg_params(DIM))


def test_derivatives_stay_finite_when_a_client_is_skipped_for_its_weight():
  algo = _algo('fedavg')
  cohort = _with_fault(_clean_cohort(), 'nan_weight')

  def objective(params, cohort):
    state, _ = algo.apply(algo.init(params), cohort, jax.random.key(0))
    return jnp.sum(state.params['w'] ** 2)

  got = jax.grad(objective)(linreg_params(DIM), cohort)
  want = jax.grad(objective)(linreg_params(DIM), _without(_clean_cohort(), BAD))
  _assert_states_close(got, want)


@pytest.mark.parametrize('name', ['gaussian', 'adaptive_gaussian', 'tree_gaussian'])
def test_dp_encodings_are_nonfinite_exactly_when_the_update_is(name):
  """``checks_update``: the guard reads the DP encoder's values (the norm)
  instead of the client's model, so they must be NaN/Inf exactly then."""
  from fedjx.algorithms.aggregators import core as aggregators  # pylint: disable=import-outside-toplevel
  agg = parts.AGGREGATORS[name](noise_multiplier=0.3, **(
      {'clipped_count_stddev': 0.5} if name == 'adaptive_gaussian' else {}))
  assert agg.traits.checks_update
  hparams = dict(aggregators.init_hparams(agg),
                 **(agg.broadcast(agg.init(None)) if agg.broadcast else {}))
  w = jnp.float32(1.0)
  for update, finite in (({'a': jnp.array([3.0, -4.0]), 'b': jnp.zeros(2)}, True),
                         ({'a': jnp.zeros(2), 'b': jnp.zeros(2)}, True),
                         ({'a': jnp.array([3.0, jnp.nan]), 'b': jnp.zeros(2)}, False),
                         ({'a': jnp.zeros(2), 'b': jnp.array([jnp.inf, 0.0])}, False),
                         ({'a': jnp.array([-jnp.inf, 1.0]), 'b': jnp.zeros(2)}, False)):
    _, encoded = agg.encode(hparams, update, w)
    assert bool(nonfinite.all_finite(encoded)) is finite, update


def test_the_safe_norm_keeps_nan_and_inf_and_a_zero_gradient_at_zero():
  from fedjx.algorithms.aggregators import core as aggregators  # pylint: disable=import-outside-toplevel
  norm = aggregators.safe_global_norm
  assert float(norm({'a': jnp.array([3.0, 4.0])})) == 5.0
  assert float(norm({'a': jnp.zeros(3)})) == 0.0
  assert np.isnan(float(norm({'a': jnp.array([1.0, jnp.nan])})))
  assert np.isinf(float(norm({'a': jnp.array([1.0, -jnp.inf])})))
  grad = jax.grad(lambda x: norm({'a': x}))(jnp.zeros(3))
  np.testing.assert_array_equal(np.asarray(grad), np.zeros(3))


@pytest.mark.parametrize('name', [n for n in BUILDERS if n != 'streaming_diloco'])
def test_without_the_guard_every_fault_reaches_the_model_or_the_metrics(name):
  """What lets the runner run rounds unguarded first
  (fedjx.experiments.guarded_rounds): for the algorithms whose client outputs
  reach the server model in the same round, a client the guard would skip
  always makes the unguarded round's new model or metrics non-finite."""
  algo = _algo(name, skip=False)
  state0 = algo.init(linreg_params(DIM))
  clean, key = _clean_cohort(), jax.random.key(1)
  state, metrics = algo.round(copy(state0), clean, key)
  assert bool(nonfinite.all_finite((state.params, metrics)))
  for fault in FAULTS:
    state, metrics = algo.round(copy(state0), _with_fault(clean, fault), key)
    assert not bool(nonfinite.all_finite((state.params, metrics))), fault
