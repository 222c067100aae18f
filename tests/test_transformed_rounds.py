"""Transformed rounds stay plans: ``jax.grad`` / ``jax.jvp`` of rounds whose
weights are client data run in Beam and split for export (a round's JVP in
one stage, its gradient in two), and match JAX.

Tolerances: float32 rounds of 6 clients; Beam reduces in float64 and JAX in
float32, so the results differ by a few float32 ulps of order-1 values
(6 terms: ~6 * 2**-24 ~ 4e-7 relative), amplified by at most a few through
the server step; 1e-5 bounds that with margin.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip('apache_beam')

import fedjx  # noqa: E402
from fedjx import algorithms  # noqa: E402
from fedjx.interpreters import beam as fedjx_beam  # noqa: E402
from fedjx import datasets  # noqa: E402
from fedjx.interpreters import export as fedjx_export  # noqa: E402
from fedjx.interpreters import plan as plan_lib  # noqa: E402

CLIENTS = 6
TOL = 1e-5


def _loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def _cohort(seed):
  rng = np.random.default_rng(seed)
  batches = {'x': rng.normal(size=(CLIENTS, 2, 4, 5)).astype(np.float32),
             'y': rng.integers(0, 3, size=(CLIENTS, 2, 4)).astype(np.int32)}
  mask = np.ones((CLIENTS, 2, 4), bool)
  mask[::3, 1] = False           # Unequal example counts: unequal weights.
  mask[1, 0, 1:] = False
  return datasets.Cohort(batches, mask, mask.sum((1, 2)).astype(np.float32),
                         np.arange(CLIENTS, dtype=np.int32))


def _params():
  return {'w': jnp.full((5, 3), 0.05), 'b': jnp.asarray([0.1, -0.2, 0.0])}


ALGORITHMS = {
    'fedavg': lambda: algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1)),
    'fedadam': lambda: algorithms.fedadam(_loss, client_optimizer=optax.sgd(0.1),
                                          server_learning_rate=0.05),
}


def _objective(algo, rounds=1):
  """A smooth function of the params after ``rounds`` rounds (each a stage)."""
  def objective(params, *cohorts):
    state = algo.init(params)
    for r in range(rounds):
      state, _ = algo.apply(state, cohorts[r], jax.random.PRNGKey(r))
    return jnp.sum(state.params['w'] ** 2) + jnp.sum(jnp.sin(state.params['b']))
  return objective


def _assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=TOL, atol=TOL)


def _tangent():
  return jax.tree.map(lambda p: jnp.linspace(-1.0, 1.0, p.size).reshape(p.shape), _params())


@pytest.mark.parametrize('name,rounds', [
    ('fedavg', 1), pytest.param('fedadam', 1, marks=pytest.mark.slow),
    pytest.param('fedavg', 2, marks=pytest.mark.slow)],
                         ids=['fedavg', 'fedadam', 'two_stage_fedavg'])
@pytest.mark.slow
def test_grad_and_jvp_of_rounds_in_beam_with_client_held_weights(name, rounds):
  objective = _objective(ALGORITHMS[name](), rounds)
  cohorts = [_cohort(r) for r in range(rounds)]
  sources = [fedjx_beam.ClientData.from_arrays(c) for c in cohorts]

  grad = jax.grad(objective)
  _assert_close(fedjx_beam.run(grad, _params(), *sources), grad(_params(), *cohorts))

  def jvp(params, tangent, *cohorts):
    return jax.jvp(lambda p: objective(p, *cohorts), (params,), (tangent,))

  _assert_close(fedjx_beam.run(jvp, _params(), _tangent(), *sources),
                jvp(_params(), _tangent(), *cohorts))


@pytest.mark.parametrize('name', sorted(ALGORITHMS))
@pytest.mark.slow
def test_grad_and_jvp_of_a_round_split_for_export(name):
  algo = ALGORITHMS[name]()
  cohort = _cohort(0)

  def jvp(params, tangent, cohort):
    return jax.jvp(lambda p: _objective(algo)(p, cohort), (params,), (tangent,))

  split = fedjx_export.split_round(jvp, _params(), _tangent(), cohort, client_args=(2,))
  got = split.run(jax.tree.leaves((_params(), _tangent())), jax.tree.leaves(cohort))
  _assert_close(got, jvp(_params(), _tangent(), cohort))

  # A gradient has two stages: the forward aggregation, then the cotangent
  # (scaled by 1 / sum of the client-held weights, itself an aggregate)
  # broadcast back to clients. split_round refuses it; split_program exports
  # it as two stages, each client keeping its residuals between them.
  grad = jax.grad(_objective(algo))
  with pytest.raises(ValueError, match='more than one'):
    fedjx_export.split_round(grad, _params(), cohort, client_args=(1,))
  _assert_split_program_matches(grad, [cohort], expected_stages=2)


def _deserialized(exported):
  return jax.export.deserialize(exported.serialize())


def _assert_split_program_matches(fn, cohorts, expected_stages):
  client_args = tuple(range(1, len(cohorts) + 1))
  program = fedjx_export.split_program(fn, _params(), *cohorts, client_args=client_args)
  assert len(program.stages) == expected_stages
  for stage in program.stages:
    stage.server_prepare = _deserialized(stage.server_prepare)
    stage.client_work = _deserialized(stage.client_work)
  program.server_update = _deserialized(program.server_update)
  got = program.run(jax.tree.leaves(_params()), jax.tree.leaves(cohorts))
  _assert_close(got, fn(_params(), *cohorts))


@pytest.mark.slow
def test_grad_of_two_rounds_split_into_four_stages():
  """Two FedAvg rounds: two forward and two backward stages."""
  objective = _objective(ALGORITHMS['fedavg'](), rounds=2)
  _assert_split_program_matches(jax.grad(objective), [_cohort(0), _cohort(1)],
                                expected_stages=4)


def test_grad_of_every_reduction_with_client_held_weights_is_a_plan():
  """Reverse and forward rules of every reduction, with client data as the
  values and as the weights, trace to plans and run in Beam."""
  rng = np.random.default_rng(0)
  data = rng.normal(size=(CLIENTS, 3)).astype(np.float32)
  weights = rng.uniform(0.5, 2.0, size=CLIENTS).astype(np.float32)

  @fedjx.program(clients=CLIENTS)
  def program(theta, data, weights):
    y = fedjx.map_fn(lambda t, d: jnp.tanh(t * d), (fedjx.broadcast(theta), data))
    scaled_w = weights * fedjx.map_fn(lambda t: jnp.exp(t[0]), fedjx.broadcast(theta))
    return (jnp.sum(fedjx.reduce_sum(y) ** 2) + jnp.sum(fedjx.reduce_mean(y))
            + jnp.sum(fedjx.reduce_weighted_mean(y, scaled_w) ** 3))

  theta = jnp.asarray([0.3, -0.5, 0.8])
  grad = jax.grad(program)
  want = grad(theta, data, weights)
  for fn in (grad, lambda t, d, w: jax.jvp(lambda t: program(t, d, w), (t,), (jnp.ones(3),))):
    plan_lib.trace_plan_with_clients(fn, (theta, data, weights), client_args=(1, 2))
  got = fedjx_beam.run(grad, theta, fedjx_beam.ClientData.from_arrays(data),
                       fedjx_beam.ClientData.from_arrays(weights))
  _assert_close(got, want)


def test_typed_prng_keys_in_beam():
  algo = ALGORITHMS['fedavg']()
  state, cohort, key = algo.init(_params()), _cohort(0), jax.random.key(7)
  want = jax.jit(algo.apply)(state, cohort, key)
  got = fedjx_beam.run(algo.apply, state, fedjx_beam.ClientData.from_arrays(cohort), key)
  _assert_close(got, want)

  @fedjx.program(clients=CLIENTS)
  def keyed(key, x):
    keys = jax.random.split(key, CLIENTS)
    noisy = fedjx.map_fn(lambda k, v: v + jax.random.normal(k, v.shape), (keys, x))
    return fedjx.reduce_mean(noisy), jax.random.split(key)[1], keys

  x = jnp.ones((CLIENTS, 2))
  want = jax.jit(keyed)(key, x)
  got = fedjx_beam.run(keyed, key, fedjx_beam.ClientData.from_arrays(x))
  _assert_close(got[0], want[0])
  for g, w in zip(got[1:], want[1:]):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))


def test_beam_run_does_not_recompile_the_users_jitted_functions():
  algo = ALGORITHMS['fedavg']()
  state, cohort, key = algo.init(_params()), _cohort(0), jax.random.PRNGKey(0)
  round_fn = jax.jit(algo.apply)
  helper = jax.jit(lambda x: jnp.cos(x) * 2)
  want = round_fn(state, cohort, key)
  helper(jnp.ones(3))
  compiles = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(event)

  sizes = (round_fn._cache_size(), helper._cache_size())
  got = fedjx_beam.run(round_fn, state, fedjx_beam.ClientData.from_arrays(cohort), key)
  _assert_close(got, want)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    round_fn(state, cohort, key)
    helper(jnp.ones(3))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
  assert (round_fn._cache_size(), helper._cache_size()) == sizes


# Every algorithm whose round is a plan (docs/beam.md). SCAFFOLD and DiLoCo
# keep per-client state by client id (collected to the server); Streaming
# DiLoCo branches on client values (a `cond`) and is not a plan.
BEAM_SUPPORTED = {
    'fedavg': lambda: algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1)),
    'fedadam': lambda: algorithms.fedadam(_loss, client_optimizer=optax.sgd(0.1)),
    'fedyogi': lambda: algorithms.fedyogi(_loss, client_optimizer=optax.sgd(0.1)),
    'fedadagrad': lambda: algorithms.fedadagrad(_loss, client_optimizer=optax.sgd(0.1)),
    'fedavgm': lambda: algorithms.fedavgm(_loss, client_optimizer=optax.sgd(0.1)),
    'fedprox': lambda: algorithms.fedprox(_loss, mu=0.1, client_optimizer=optax.sgd(0.1)),
    'dp_fedavg': lambda: algorithms.dp_fedavg(_loss, clip_norm=0.05,
                                              client_optimizer=optax.sgd(0.1)),
    'fedavg_hypergradient_tuner': lambda: algorithms.fedavg_hypergradient_tuner(_loss),
    'scaffold': lambda: algorithms.scaffold(_loss, CLIENTS,
                                            client_optimizer=optax.sgd(0.1)),
    'diloco': lambda: algorithms.diloco(_loss, CLIENTS),
}


def _grad_in_beam_matches_jax(name):
  objective = _objective(BEAM_SUPPORTED[name]())
  grad = jax.grad(objective)
  cohort = _cohort(1)
  got = fedjx_beam.run(grad, _params(), fedjx_beam.ClientData.from_arrays(cohort))
  _assert_close(got, grad(_params(), cohort))
  program = fedjx_export.split_program(grad, _params(), cohort, client_args=(1,))
  got = program.run(jax.tree.leaves(_params()), jax.tree.leaves(cohort))
  _assert_close(got, grad(_params(), cohort))


@pytest.mark.slow
def test_grad_of_every_supported_round_is_a_plan():
  """Each gradient traces to a plan: every operation on client values is
  placed (running them all in Beam is the slow test below)."""
  cohort = _cohort(1)
  for name, build in sorted(BEAM_SUPPORTED.items()):
    grad = jax.grad(_objective(build()))
    plan = plan_lib.trace_plan_with_clients(grad, (_params(), cohort), client_args=(1,))
    assert any(isinstance(s, plan_lib.ReduceStep) for s in plan.steps), name


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(BEAM_SUPPORTED))
def test_grad_of_every_supported_round_in_beam_and_split(name):
  _grad_in_beam_matches_jax(name)
