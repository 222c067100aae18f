"""The hypergradient tuner: its hypergradient against finite differences of
the one-round objective, learning-rate recovery, the Algorithm interface and
the config."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import float_tolerance as ft
from fedjx import algorithms
from fedjx import datasets
from fedjx.algorithms import base
from fedjx.algorithms import hypergradients as hg
from fedjx.algorithms import tuner as tuner_lib

SERVER_LR = 'server_optimizer/learning_rate'
ROOT = pathlib.Path(__file__).resolve().parents[1]


def logreg_loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def cohorts_of(rounds, clients=4, steps=3, batch=8, dtype=jnp.float32):
  ds = datasets.synthetic(1.0, 1.0, num_clients=20, seed=0, max_examples=60)
  sampler = datasets.CohortSampler(ds, clients, seed=0)
  out = [datasets.make_cohort(ds, sampler.sample(r), batch, num_steps=steps,
                              round_num=r) for r in range(rounds)]
  return [c._replace(batches=dict(c.batches, x=jnp.asarray(c.batches['x'], dtype)))
          for c in out]


def params_of(dtype=jnp.float32):
  return {'w': jnp.zeros((60, 10), dtype), 'b': jnp.zeros(10, dtype)}


@pytest.mark.slow
def test_hypergradient_metric_matches_finite_differences():
  with jax.enable_x64(True):
    cohort = cohorts_of(1, dtype=jnp.float64)[0]
    algo = algorithms.fedavg(logreg_loss, local_steps=3,
                             server_optimizer=base.default_sgd(0.5))
    tuned = algorithms.hypergradient_tuner(algo, logreg_loss, tune=SERVER_LR,
                                           hyper_learning_rate=0.1)
    state = tuned.init(params_of(jnp.float64))
    key = jax.random.key(0)
    new, metrics = tuned.apply(state, cohort, key)
    objective = tuner_lib.cohort_objective(logreg_loss)
    inner = algo.init(params_of(jnp.float64))

    @jax.jit
    def loss_at(log_lr):
      hp = hg.set_path(inner.hparams, SERVER_LR, jnp.exp(log_lr))
      after, _ = algo.apply(inner._replace(hparams=hp), cohort, key)
      return objective(after.params, cohort)

    u, eps = np.log(0.5), 1e-5
    fd = (loss_at(u + eps) - loss_at(u - eps)) / (2 * eps)
    got = metrics[f'hypergrad/{SERVER_LR}']
    # In float64: the central difference is off by ~ n 2**-53 |f| / eps
    # (< 1e-9 |f|) plus eps**2 |f'''| / 6 (eps**2 = 1e-10); the metric is
    # rounded to float32 (2**-24). 1e-4 relative allows |f'''| / |f'| up to 6e6.
    assert abs(float(got) - float(fd)) < 1e-4 * abs(float(fd)), (got, fd)
    # Metrics are float32: one rounding of the float64 objective.
    np.testing.assert_allclose(float(metrics['tuner_objective']), float(loss_at(u)),
                               rtol=ft.rtol(1))
    # The objective falls with the learning rate here, so Adam's first step
    # raises it by a factor exp(hyper_learning_rate).
    assert float(fd) < 0
    # exp(log(0.5) + 0.1) after one Adam step: a few roundings, and Adam's
    # step is lr m / (sqrt(v) + eps) = 0.1 up to eps / |g| (eps = 1e-8).
    np.testing.assert_allclose(float(metrics[f'hparams/{SERVER_LR}']),
                               0.5 * np.exp(0.1), rtol=ft.rtol(8))
    np.testing.assert_allclose(float(hg.get_path(new.hparams, SERVER_LR)),
                               0.5 * np.exp(0.1), rtol=ft.rtol(8))


@pytest.mark.slow
def test_tuner_recovers_a_small_server_learning_rate():
  rounds = 30
  cohorts = cohorts_of(rounds)
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *cohorts)
  keys = jax.random.split(jax.random.key(0), rounds)
  make = lambda: algorithms.fedavg(logreg_loss, local_steps=3,
                                   server_optimizer=base.default_sgd(0.01))
  tuned = algorithms.hypergradient_tuner(make(), logreg_loss,
                                         hyper_learning_rate=0.2)
  state, metrics = tuned.run_rounds(tuned.init(params_of()), stacked, keys)
  plain = make()
  plain_state, plain_metrics = plain.run_rounds(plain.init(params_of()), stacked, keys)
  lrs = np.asarray(metrics[f'hparams/{SERVER_LR}'])
  assert lrs.shape == (rounds,)
  assert lrs[-1] > 20 * 0.01  # Grew by more than 20x in 30 rounds.
  assert float(state.round_index) == rounds
  loss = np.asarray(metrics['train_loss_before'])
  plain_loss = np.asarray(plain_metrics['train_loss_before'])
  assert loss[-5:].mean() < plain_loss[-5:].mean() - 0.1


def test_interface_round_donation_horizon_and_two_learning_rates():
  cohorts = cohorts_of(3)
  algo = algorithms.fedavg(logreg_loss, local_steps=3)
  tuned = algorithms.hypergradient_tuner(
      algo, logreg_loss, tune=[SERVER_LR, 'client_optimizer/learning_rate'],
      horizon_decay=0.9, hyper_optimizer=optax.sgd(1.0))
  state = tuned.init(params_of())
  assert isinstance(state, algorithms.TunerState)
  # One [k, ...] tangent per floating leaf of FedAvg's state.
  floats = [x for x in jax.tree.leaves(state.inner)
            if jnp.issubdtype(x.dtype, jnp.floating)]
  assert [t.shape for t in state.tangents] == [(2,) + x.shape for x in floats]
  for r, cohort in enumerate(cohorts):
    state, metrics = tuned.round(state, cohort, jax.random.key(r))
  assert state.params['w'].shape == (60, 10)
  for name in (SERVER_LR, 'client_optimizer/learning_rate'):
    assert np.isfinite(float(metrics[f'hypergrad/{name}']))
    assert float(metrics[f'hparams/{name}']) > 0
  assert max(float(jnp.abs(t).sum()) for t in state.tangents) > 0


def test_errors_name_the_argument():
  algo = algorithms.fedavg(logreg_loss)
  with pytest.raises(ValueError, match='no key'):
    algorithms.hypergradient_tuner(algo, logreg_loss, tune='server/lr').init(params_of())
  with pytest.raises(ValueError, match='horizon_decay'):
    algorithms.hypergradient_tuner(algo, logreg_loss, horizon_decay=2.0)
  with pytest.raises(ValueError, match='objective'):
    algorithms.hypergradient_tuner(algo, logreg_loss, objective='validation')
  with pytest.raises(ValueError, match='algo'):
    algorithms.hypergradient_tuner(object(), logreg_loss)


def test_config_builds_through_the_registry():
  from fedjx.experiments import registry
  spec = importlib.util.spec_from_file_location(
      'tuner_config', ROOT / 'configs' / 'fedavg_hypergradient_tuner.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  name = config.algorithm.name
  added = name not in registry.ALGORITHMS
  if added:
    registry.register_algorithm(name, algorithms.fedavg_hypergradient_tuner)
  try:
    model = registry.build_model(config.model)
    algo = registry.build_algorithm(config.algorithm, model)
  finally:
    if added:
      registry.ALGORITHMS.pop(name)
  assert isinstance(algo, base.Algorithm)
  params = {'w': jnp.zeros((60, 10)), 'b': jnp.zeros(10)}
  tuned = algorithms.fedavg_hypergradient_tuner(
      logreg_loss, server_optimizer=base.default_sgd(0.1), local_steps=3)
  state, metrics = tuned.round(tuned.init(params), cohorts_of(1)[0], jax.random.key(0))
  assert f'hparams/{SERVER_LR}' in metrics
