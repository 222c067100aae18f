"""A round split into exported server and client computations."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
from fedjx import algorithms
from fedjx import datasets
from fedjx import export as fedjx_export


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


def test_split_needs_exactly_one_map():
  @fedjx.program(clients=3)
  def two_maps(x):
    y = fedjx.map_fn(jnp.sin, fedjx.broadcast(x))
    return fedjx.reduce_sum(fedjx.map_fn(jnp.cos, y))

  with pytest.raises(ValueError, match='exactly one'):
    fedjx_export.split_round(two_maps, jnp.ones(2))
