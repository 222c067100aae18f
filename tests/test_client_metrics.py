"""Per-client metrics (``client_metrics=True``) of SCAFFOLD and DiLoCo.

Each client's ``[C]`` values must be what a cohort of that client alone
reports through the pooled metrics (a different code path: reductions over
one client), and asking nothing must leave the round as it was.
"""

import math

import jax
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
from test_algorithms_util import CHAIN, KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

SIZES = [3, 9, 6, 1]
B, LR = 3, 0.1
POPULATION = 6  # Client ids lie in [0, 6); the cohort uses 4 of them.
IDS = [4, 0, 5, 2]
PER_CLIENT = ('client_update_norm', 'client_num_steps', 'client_loss_before',
              'client_loss_after')


def _scaffold(**kw):
  return algos.scaffold(linreg_loss, POPULATION, client_optimizer=optax.sgd(LR),
                        weighting='uniform', **kw)


def _diloco(**kw):
  return algos.diloco(linreg_loss, POPULATION,
                      inner_optimizer=optax.inject_hyperparams(optax.adam)(
                          learning_rate=LR),
                      outer_optimizer=optax.sgd(1.0), weighting='uniform', **kw)


BUILDERS = {'scaffold': _scaffold, 'diloco': _diloco}


def _data():
  return linreg_data(np.random.default_rng(11), SIZES)


def _cohort(data, which):
  return make_cohort([data[k] for k in which], batch_size=B, steps=3,
                     client_ids=[IDS[k] for k in which])


@pytest.mark.parametrize('name', sorted(BUILDERS))
def test_each_client_s_metrics_are_those_of_a_cohort_of_that_client_alone(name):
  data = _data()
  algo = BUILDERS[name](client_metrics=True).compile(donate=False)
  everyone = _cohort(data, range(len(SIZES)))
  # One round first, so SCAFFOLD's c_i and DiLoCo's inner states are not
  # their initial zeros in the round compared.
  state, _ = algo.round(algo.init(linreg_params()), everyone, KEY)
  _, metrics = algo.round(state, everyone, KEY)
  for k in PER_CLIENT:
    assert metrics[k].shape == (len(SIZES),), k
  for i, n in enumerate(SIZES):
    _, alone = algo.round(state, _cohort(data, [i]), KEY)
    assert int(metrics['client_num_steps'][i]) == math.ceil(n / B)
    assert int(alone['client_num_steps'][0]) == math.ceil(n / B)
    # With one client of weight 1 the pseudo-gradient is that client's update
    # (a weighted mean over one client), so its norm is the update's norm.
    # Both sides are the same chain of at most CHAIN float32 roundings of
    # one client's training, compiled for 4 clients or for 1: relative bound.
    np.testing.assert_allclose(metrics['client_update_norm'][i],
                               alone['pseudo_grad_norm'], rtol=ft.rtol(CHAIN))
    np.testing.assert_allclose(metrics['client_loss_before'][i],
                               alone['train_loss_before'], rtol=ft.rtol(CHAIN))
    np.testing.assert_allclose(metrics['client_loss_after'][i],
                               alone['train_loss_after'], rtol=ft.rtol(CHAIN))
    for k in PER_CLIENT:
      np.testing.assert_allclose(metrics[k][i], alone[k][0], rtol=ft.rtol(CHAIN))


@pytest.mark.parametrize('name', sorted(BUILDERS))
def test_without_client_metrics_the_round_is_unchanged(name):
  data = _data()
  cohort = _cohort(data, range(len(SIZES)))
  default = BUILDERS[name]()
  off = BUILDERS[name](client_metrics=False)
  on = BUILDERS[name](client_metrics=True)
  state = default.init(linreg_params())

  def lowered(algo):
    return jax.jit(algo.apply).lower(state, cohort, KEY)

  # Off is the default, and it compiles to the same program.
  assert lowered(off).as_text() == lowered(default).as_text()
  # No per-client output exists without it; with it, exactly the [C] ones.
  _, info_off = lowered(off).out_info
  _, info_on = lowered(on).out_info
  assert not [k for k in info_off if k.startswith('client_')]
  assert set(info_on) - set(info_off) == set(PER_CLIENT)
  for k in PER_CLIENT:
    assert info_on[k].shape == (len(SIZES),)
  # The state and the pooled metrics do not depend on it.
  state_off, metrics_off = off.compile(donate=False).round(state, cohort, KEY)
  state_on, metrics_on = on.compile(donate=False).round(state, cohort, KEY)
  assert_trees_close(state_on, state_off)
  assert_trees_close({k: metrics_on[k] for k in metrics_off}, metrics_off)


@pytest.mark.parametrize('name', sorted(BUILDERS))
def test_client_metrics_must_be_a_bool(name):
  with pytest.raises(ValueError, match='client_metrics'):
    BUILDERS[name](client_metrics='yes')
