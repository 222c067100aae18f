"""Beam (DirectRunner) runs of fedjx programs equal the JAX results."""

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
from fedjx.interpreters import plan as plan_lib  # noqa: E402

CLIENTS = 50


def _loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def _cohort(seed, clients=CLIENTS, steps=2, batch=4):
  rng = np.random.default_rng(seed)
  batches = {'x': rng.normal(size=(clients, steps, batch, 5)).astype(np.float32),
             'y': rng.integers(0, 3, size=(clients, steps, batch)).astype(np.int32)}
  mask = np.ones((clients, steps, batch), bool)
  mask[::3, 1] = False           # Some clients have fewer examples.
  mask[::7, 0, 2:] = False
  return datasets.Cohort(batches, mask, mask.sum((1, 2)).astype(np.float32),
                         np.arange(clients, dtype=np.int32))


def _params():
  return {'w': jnp.full((5, 3), 0.01), 'b': jnp.zeros(3)}


def _assert_close(got, want, tol=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize('build', [
    lambda: algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1)),
    lambda: algorithms.fedadam(_loss, client_optimizer=optax.sgd(0.1),
                               server_learning_rate=0.05),
], ids=['fedavg', 'fedadam'])
@pytest.mark.slow
def test_one_round_equals_jax(build):
  algo = build()
  state, cohort, key = algo.init(_params()), _cohort(0), jax.random.PRNGKey(0)
  want = algo.apply(state, cohort, key)
  got = fedjx_beam.run(algo.apply, state, fedjx_beam.ClientData.from_arrays(cohort), key)
  _assert_close(got, want)


@pytest.mark.slow
def test_several_rounds_in_one_pipeline_and_in_a_row():
  algo = algorithms.fedadam(_loss, client_optimizer=optax.sgd(0.1),
                            server_learning_rate=0.05)
  cohorts = [_cohort(r) for r in range(3)]
  keys = jax.random.split(jax.random.PRNGKey(1), 3)

  def three_rounds(state, c0, c1, c2, keys):
    for r, c in enumerate((c0, c1, c2)):
      state, metrics = algo.apply(state, c, keys[r])
    return state, metrics

  state = algo.init(_params())
  want = jax.jit(three_rounds)(state, *cohorts, keys)
  got = fedjx_beam.run(three_rounds, state,
                       *[fedjx_beam.ClientData.from_arrays(c) for c in cohorts], keys)
  _assert_close(got, want)
  # Round by round, the state passing through the driver.
  beam_state = state
  for r in range(3):
    beam_state, _ = fedjx_beam.run(algo.apply, beam_state,
                                   fedjx_beam.ClientData.from_arrays(cohorts[r]), keys[r])
  _assert_close(beam_state.params, want[0].params)


@pytest.mark.slow
def test_federated_gradient_of_a_round():
  algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1))
  cohort = _cohort(2, clients=12)

  def objective(params):
    state, _ = algo.apply(algo.init(params), cohort, jax.random.PRNGKey(0))
    return jnp.sum(state.params['w'] ** 2) + jnp.sum(state.params['b'])

  want = jax.grad(objective)(_params())
  got = fedjx_beam.run(jax.grad(objective), _params())
  _assert_close(got, want)


@pytest.mark.slow
def test_client_data_read_inside_the_pipeline_from_a_dataset():
  population = datasets.synthetic(1.0, 1.0, num_clients=20, seed=0, max_examples=60)
  ids = np.arange(0, 20, 2)
  source = datasets.beam_client_data(population, ids, batch_size=8, num_steps=3)
  cohort = datasets.make_cohort(population, ids, 8, num_steps=3, bucket=False)

  def loss(params, batch):
    logits = batch['x'] @ params['w'] + params['b']
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])

  algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(0.05))
  state = algo.init({'w': jnp.zeros((60, 10)), 'b': jnp.zeros(10)})
  want = algo.apply(state, cohort, jax.random.PRNGKey(0))
  got = fedjx_beam.run(algo.apply, state, source, jax.random.PRNGKey(0))
  _assert_close(got, want)


def test_stable_combiner_merges_partial_results():
  combine = fedjx_beam.StableReduce('weighted_mean', np.float32)
  xs = [np.full(3, v, np.float32) for v in (1.0, 2.0, 4.0)]
  ws = [np.float32(1.0), np.float32(3.0), np.float32(0.0)]
  a = combine.add_input(combine.create_accumulator(), (xs[0], ws[0]))
  b = combine.add_input(combine.add_input(combine.create_accumulator(), (xs[1], ws[1])),
                        (xs[2], ws[2]))
  np.testing.assert_allclose(combine.extract_output(combine.merge_accumulators([a, b])),
                             np.full(3, 7.0 / 4.0))
  zero = combine.add_input(combine.create_accumulator(), (xs[0], np.float32(0.0)))
  np.testing.assert_array_equal(combine.extract_output(zero), np.zeros(3))


def test_an_op_that_cannot_be_placed_is_named():
  @fedjx.program(clients=4)
  def program(x):
    return fedjx.reduce_sum(jnp.cumsum(x, axis=0))

  with pytest.raises(plan_lib.UnplaceableOperationError, match='cumsum'):
    fedjx_beam.run(program, fedjx_beam.ClientData.from_arrays(jnp.ones((4, 2))))


@pytest.mark.slow
def test_scaffold_per_client_state_is_collected_and_written_per_client():
  """SCAFFOLD looks its control variates up by client id and writes them
  back: the ids and the new variates are collected to the server."""
  algo = algorithms.scaffold(_loss, CLIENTS + 5, client_optimizer=optax.sgd(0.1))
  state = algo.init(_params())
  key = jax.random.PRNGKey(0)
  for r in range(2):  # The second round reads the variates the first wrote.
    cohort = _cohort(r, clients=8)
    cohort = cohort._replace(client_ids=np.arange(8, dtype=np.int32) * 3 + r)
    want = algo.apply(state, cohort, key)
    plan = plan_lib.trace_plan_with_clients(algo.apply, (state, cohort, key), (1,))
    assert any(isinstance(s, plan_lib.ReduceStep) and s.op == 'collect'
               for s in plan.steps)
    got = fedjx_beam.run(algo.apply, state, fedjx_beam.ClientData.from_arrays(cohort), key)
    _assert_close(got, want)
    written = np.asarray(want[0].client_states['w'])[np.asarray(cohort.client_ids)]
    assert np.abs(written).max() > 0
    state = jax.tree.map(jnp.asarray, got[0])
