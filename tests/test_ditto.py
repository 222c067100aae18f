"""Ditto against a float64 NumPy oracle of Li et al. 2021, Algorithm 1: two
rounds with a client drawn twice (its stored personal model read back), a
padding client and a skipped (non-finite) client whose rows come back
unchanged, under every map strategy; DP on the global update;
personalization; one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import aggregators
from fedjx.algorithms.ditto_lib import personalize_fn
from client_rows import Rows, batches_of, linreg_grad, run_round, theta_of
from test_algorithms_util import CHAIN, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

B, LR, PERSONAL_LR, LAM, SERVER_LR = 2, 0.1, 0.05, 0.5, 0.8
SIZES = [5, 3, 4, 6]
ROUNDS = [[0, 2, 1, -1], [2, 3, 1, -1]]   # Client 2 twice; 1 is NaN in round 2.


def _population():
  return linreg_data(np.random.default_rng(8), SIZES, shift=2.0)


def _cohort(population, ids, nan=()):
  data = []
  for i in ids:
    d = dict(population[max(i, 0)])
    if i < 0:
      d = {k: v[:0] for k, v in d.items()}
    elif i in nan:
      d['x'] = np.full_like(d['x'], np.nan)
    data.append(d)
  return make_cohort(data, B, steps=3, client_ids=ids)


def _as_params(theta):
  return {'w': theta[:-1], 'b': theta[-1]}


def _oracle(w, personal, population, ids, theta0, *, personal_epochs,
            clip=None, skip=()):
  """One Ditto round in float64: the new global model and personal models."""
  deltas, sizes, personal = [], [], dict(personal)
  for i in ids:
    if i < 0 or i in skip:
      continue
    batches = batches_of(population[i], B)
    wk = w.copy()
    for x, y in batches:                      # The global update: FedAvg's.
      wk = wk - LR * linreg_grad(wk, x, y)
    v = personal.get(i, theta0)               # v_k = w^0 until it first trains.
    for _ in range(personal_epochs):
      for x, y in batches:
        v = v - PERSONAL_LR * (linreg_grad(v, x, y) + LAM * (v - w))
    personal[i] = v
    deltas.append(w - wk)
    sizes.append(len(population[i]['y']))
  if clip is None:
    mean = np.average(deltas, axis=0, weights=sizes)
  else:
    mean = np.mean([d * min(1.0, clip / np.linalg.norm(d)) for d in deltas], 0)
  return w - SERVER_LR * mean, personal


def _run(algo, *, personal_epochs, clip=None):
  population = _population()
  params = linreg_params()
  state = algo.init(params)
  store = Rows(algo.client_state_init(params))
  theta0 = theta_of(params)
  w, personal = theta0, {}
  for r, ids in enumerate(ROUNDS):
    nan = (1,) if r == 1 else ()
    before = {i: store.row(i) for i in ids}
    state, metrics, rows = run_round(algo, state, _cohort(population, ids, nan),
                                     store, jax.random.key(r))
    w, personal = _oracle(w, personal, population, ids, theta0,
                          personal_epochs=personal_epochs, clip=clip, skip=nan)
    assert_trees_close(theta_of(state.params), w, n=CHAIN)
    for j, i in enumerate(ids):
      row = jax.tree.map(lambda x: x[j], rows)
      if i < 0 or i in nan:  # Padding and skipped clients: rows unchanged.
        jax.tree.map(np.testing.assert_array_equal, row, before[i])
      else:
        assert_trees_close(theta_of(row), personal[i], n=CHAIN)
    assert float(metrics['nonfinite_clients']) == len(nan)
  return state, store


def _strategies(default):
  return [pytest.param(s, c, id=s, marks=() if s in default else pytest.mark.slow)
          for s, c in [('vmap', None), ('chunked', 2), ('sequential', None)]]


@pytest.mark.parametrize('strategy, chunk', _strategies(('vmap', 'sequential')))
def test_two_rounds_against_numpy(strategy, chunk):
  algo = algos.ditto(linreg_loss, lam=LAM, personal_epochs=2,
                     personal_optimizer=optax.sgd(PERSONAL_LR),
                     server_optimizer=optax.sgd(SERVER_LR)).compile(strategy, chunk)
  state, _ = _run(algo, personal_epochs=2)
  assert float(state.hparams['lam']) == LAM


def test_with_a_dp_aggregator_on_the_global_update():
  clip = 0.05
  algo = algos.ditto(linreg_loss, lam=LAM, personal_optimizer=optax.sgd(PERSONAL_LR),
                     server_optimizer=optax.sgd(SERVER_LR),
                     aggregator=aggregators.gaussian(clip, 0.0))
  _run(algo, personal_epochs=1, clip=clip)


@pytest.mark.slow
def test_dp_noise_reaches_the_global_model_not_the_personal_ones():
  algo = algos.ditto(linreg_loss, aggregator=aggregators.gaussian(1.0, 1.0)
                     ).compile(donate=False)
  params = linreg_params()
  state = algo.init(params)
  cohort = _cohort(_population(), [0, 2, 1, -1])
  outs = [run_round(algo, state, cohort, Rows(algo.client_state_init(params)),
                    jax.random.key(k)) for k in (1, 2)]
  assert float(jnp.max(jnp.abs(outs[0][0].params['w'] - outs[1][0].params['w']))) > 1e-3
  jax.tree.map(np.testing.assert_array_equal, outs[0][2], outs[1][2])


def test_lam_zero_trains_the_personal_model_alone_and_personalize_returns_it():
  # lambda = 0: v_k is local SGD from w^0 on the client's data, whatever w is.
  population = _population()
  algo = algos.ditto(linreg_loss, lam=0.0, personal_optimizer=optax.sgd(PERSONAL_LR))
  params = linreg_params()
  state = algo.init(params)
  store = Rows(algo.client_state_init(params))
  cohort = _cohort(population, [0, 2, 1, -1])
  state, _, _ = run_round(algo, state, cohort, store, jax.random.key(0))
  v = theta_of(params)
  for x, y in batches_of(population[2], B):
    v = v - PERSONAL_LR * linreg_grad(v, x, y)
  got = personalize_fn()(state, store.row(2), None)
  assert_trees_close(theta_of(got), v, n=CHAIN)


@pytest.mark.parametrize('kwargs, match', [
    (dict(lam=-1.0), r'ditto: lam=-1.0 is not allowed'),
    (dict(lam=float('nan')), r'ditto: lam=nan'),
    (dict(personal_steps=0), r'personal_steps=0'),
    (dict(personal_epochs=2, personal_steps=3), r'personal_steps=3 or personal_epochs=2'),
    (dict(personal_optimizer='sgd'), r'personal_optimizer'),
    (dict(client_transform=optax.sgd(1.0)), r'option client_transform=.* is not taken'),
])
def test_errors_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match) as e:
    algos.ditto(linreg_loss, **kwargs)
  assert '\n' not in str(e.value)
