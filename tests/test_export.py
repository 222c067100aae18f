"""A round split into exported server and client computations."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
from fedjx import algorithms
from fedjx import datasets
from fedjx.interpreters import export as fedjx_export


def _loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def _cohort(clients=10, steps=2, batch=4):
  rng = np.random.default_rng(0)
  batches = {'x': rng.normal(size=(clients, steps, batch, 5)).astype(np.float32),
             'y': rng.integers(0, 3, size=(clients, steps, batch)).astype(np.int32)}
  mask = np.ones((clients, steps, batch), bool)
  mask[::2, 1] = False
  return datasets.Cohort(batches, mask, mask.sum((1, 2)).astype(np.float32),
                         np.arange(clients, dtype=np.int32))


@pytest.mark.parametrize('build', [
    lambda: algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1)),
    lambda: algorithms.fedyogi(_loss, client_optimizer=optax.sgd(0.1)),
], ids=['fedavg', 'fedyogi'])
def test_exported_pieces_reproduce_the_round(build):
  algo = build()
  state = algo.init({'w': jnp.full((5, 3), 0.01), 'b': jnp.zeros(3)})
  cohort, key = _cohort(), jax.random.PRNGKey(0)
  want = jax.jit(algo.apply)(state, cohort, key)

  split = fedjx_export.split_round(algo.apply, state, cohort, key, client_args=(1,))
  # Each piece survives serialisation, as it would when shipped to devices.
  for name in ('server_prepare', 'client_work', 'server_update'):
    exported = getattr(split, name)
    setattr(split, name, jax.export.deserialize(exported.serialize()))
  got = split.run(jax.tree.leaves((state, key)), jax.tree.leaves(cohort))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  # The client computation sees one client's data.
  x_shape = cohort.batches['x'].shape[1:]
  assert any(tuple(a.shape) == x_shape for a in split.client_work.in_avals)


BUILDERS = {
    'fedavg': lambda: algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1)),
    'fedadam': lambda: algorithms.fedadam(_loss, client_optimizer=optax.sgd(0.1),
                                          server_learning_rate=0.05),
    'dp_fedavg': lambda: algorithms.dp_fedavg(_loss, clip_norm=0.05,
                                              noise_multiplier=0.5,
                                              client_optimizer=optax.sgd(0.1)),
    # Combinations of parts are plans too.
    'dp_fedadam': lambda: algorithms.fedadam(
        _loss, client_optimizer=optax.sgd(0.1), server_learning_rate=0.05,
        aggregator=algorithms.aggregators.gaussian(0.05, 0.5)),
    'int8_fedprox': lambda: algorithms.fedprox(
        _loss, mu=0.1, client_optimizer=optax.adam(0.01),
        aggregator=algorithms.aggregators.quantized_mean('int8')),
}


def _numpy_aggregate(agg, outputs):
  """An aggregation spec executed by hand in float64 NumPy."""
  xs = np.stack([np.asarray(o[agg.value], np.float64) for o in outputs])
  if agg.op == 'sum':
    out = xs.sum(0)
  elif agg.op == 'mean':
    out = xs.mean(0)
  else:
    assert agg.op == 'weighted_mean'
    w = np.asarray([np.asarray(o[agg.weight], np.float64) for o in outputs])
    total = w.sum()
    out = np.tensordot(w, xs, axes=1) / total if total != 0 else np.zeros(xs.shape[1:])
  return out.astype(agg.dtype)


@pytest.mark.parametrize('name', sorted(BUILDERS))
def test_four_pieces_composed_by_hand_with_numpy_aggregation(name):
  algo = BUILDERS[name]()
  state = algo.init({'w': jnp.full((5, 3), 0.01), 'b': jnp.zeros(3)})
  cohort, key = _cohort(), jax.random.PRNGKey(3)
  want = jax.jit(algo.apply)(state, cohort, key)
  split = fedjx_export.split_round(algo.apply, state, cohort, key, client_args=(1,))

  # Only serialised bytes and plain data cross the boundary.
  prepare, client, update = (
      jax.export.deserialize(getattr(split, piece).serialize())
      for piece in ('server_prepare', 'client_work', 'server_update'))
  specs = [fedjx_export.Aggregation(**a.to_dict()) for a in split.aggregations]
  assert {a.op for a in specs} <= set(fedjx_export.AGGREGATION_OPS)

  prepared = prepare.call(*jax.tree.leaves((state, key)))
  to_clients = prepared[:split.num_to_clients]
  placed = prepared[split.num_to_clients:split.num_to_clients + split.num_placed]
  residuals = prepared[split.num_to_clients + split.num_placed:]
  assert len(residuals) == split.num_residuals
  client_leaves = jax.tree.leaves(cohort)
  outputs = [client.call(*to_clients, *[x[c] for x in placed],
                         *[np.asarray(x)[c] for x in client_leaves])
             for c in range(split.num_clients)]
  aggregates = [_numpy_aggregate(a, outputs) for a in specs]
  got = jax.tree.unflatten(split.out_tree, list(update.call(*residuals, *aggregates)))
  # float32 client work; the aggregates are float64 sums of 10 clients
  # rounded once to float32, the jitted round sums in float32: a few ulps of
  # the (order 1) results, amplified by at most the server step.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=1e-5, atol=1e-6)
  # client_work sees one client's data; the weighted means weight by client
  # outputs of shape [].
  assert any(tuple(a.shape) == cohort.batches['x'].shape[1:]
             for a in split.client_work.in_avals)
  for a in specs:
    if a.weight is not None:
      assert split.client_work.out_avals[a.weight].shape == ()


def test_aggregation_spec_is_plain_data_in_server_update_order():
  @fedjx.program(clients=3)
  def program(x, w, data):
    y = fedjx.map_fn(lambda x, d: x * d, (fedjx.broadcast(x), data))
    return (fedjx.reduce_sum(y), fedjx.reduce_mean(y) * 2,
            fedjx.reduce_weighted_mean(y, w))

  data = jnp.arange(6.0).reshape(3, 2)
  w = jnp.asarray([1.0, 0.0, 3.0])
  split = fedjx_export.split_round(program, jnp.ones(2), w, data, client_args=(1, 2))
  assert [a.op for a in split.aggregations] == ['sum', 'mean', 'weighted_mean']
  assert split.aggregations[0].value == split.aggregations[2].value
  assert split.aggregations[2].to_dict() == {
      'op': 'weighted_mean', 'value': split.aggregations[2].value,
      'weight': split.aggregations[2].weight, 'dtype': 'float32'}
  got = split.run([jnp.ones(2)], [w, data])
  np.testing.assert_allclose(got[0], data.sum(0))
  np.testing.assert_allclose(got[1], 2 * data.mean(0))
  np.testing.assert_allclose(got[2], (data[0] + 3 * data[2]) / 4)


def test_a_second_stage_is_an_error():
  @fedjx.program(clients=3)
  def two_stages(x):
    y = fedjx.reduce_sum(fedjx.map_fn(jnp.sin, fedjx.broadcast(x)))
    return fedjx.reduce_sum(fedjx.map_fn(jnp.cos, fedjx.broadcast(y)))

  with pytest.raises(ValueError, match='more than one'):
    fedjx_export.split_round(two_stages, jnp.ones(2))
  program = fedjx_export.split_program(two_stages, jnp.ones(2))
  assert len(program.stages) == 2
  assert [s.num_client_carry for s in program.stages] == [0, 0]
  x = jnp.asarray([0.5, -1.0])
  want = 3 * np.cos(3 * np.sin(np.asarray(x, np.float64)))
  np.testing.assert_allclose(program.run([x], []), want, rtol=1e-6)


def test_client_values_carried_between_stages():
  @fedjx.program(clients=3)
  def carried(x, data):
    local = fedjx.map_fn(lambda x, d: x * d, (fedjx.broadcast(x), data))
    total = fedjx.reduce_sum(local)
    # Stage 2 reads `local` again: each client keeps it.
    again = fedjx.map_fn(lambda t, l: t - l, (fedjx.broadcast(total), local))
    return fedjx.reduce_mean(again ** 2)

  data = jnp.arange(6.0).reshape(3, 2)
  x = jnp.asarray([1.0, -2.0])
  program = fedjx_export.split_program(carried, x, data, client_args=(1,))
  assert [s.num_client_carry for s in program.stages] == [1, 0]
  local = np.asarray(x) * np.asarray(data)
  want = ((local.sum(0) - local) ** 2).mean(0)
  np.testing.assert_allclose(program.run([x], [data]), want, rtol=1e-6)


def test_placed_outputs_are_an_error():
  @fedjx.program(clients=3)
  def placed(x, data):
    return fedjx.map_fn(lambda x, d: x * d, (fedjx.broadcast(x), data))

  with pytest.raises(ValueError, match='placed at the clients'):
    fedjx_export.split_round(placed, jnp.ones(2), jnp.ones((3, 2)), client_args=(1,))
