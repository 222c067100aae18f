"""Rounds on an 8-device mesh give the numbers of rounds without one."""

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fedjx.algorithms as algos
from test_algorithms_util import KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort


def test_scaffold_on_an_explicit_clients_mesh():
  data = linreg_data(np.random.default_rng(60), [3, 5, 7, 2, 4, 6, 8, 1])
  cohort = make_cohort(data, 2, client_ids=[9, 3, 0, 7, 1, 5, 2, 4])
  params = linreg_params()
  algo = algos.scaffold(linreg_loss, 10, local_epochs=2)
  expected, _ = algo.round(algo.init(params), cohort, KEY)
  mesh = jax.make_mesh((8,), ('clients',), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    placed = jax.device_put(cohort, NamedSharding(mesh, P('clients')))
    state, metrics = algo.round(algo.init(params), placed, KEY)
  assert_trees_close(state.params, expected.params)
  assert_trees_close(state.client_states, expected.client_states)
  assert float(metrics['clients']) == 8
