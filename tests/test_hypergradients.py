"""Hypergradients through rounds: against central finite differences (float64),
forward against reverse mode, checkpointed against naive, and the memory of
checkpointed reverse mode from the compiled program's memory analysis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjx import algorithms
from fedjx import datasets
from fedjx.algorithms import base
from fedjx.algorithms import hypergradients as hg

SERVER_LR = 'server_optimizer/learning_rate'
CLIENT_LR = 'client_optimizer/learning_rate'


def logreg_loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def synthetic_rounds(rounds: int, clients: int, steps: int, batch: int,
                     dtype=jnp.float64, iid: bool = False):
  """Cohorts of Synthetic(1, 1) stacked [R, C, ...], and a held-out client."""
  ds = datasets.synthetic(1.0, 1.0, num_clients=rounds * clients + 1, seed=0,
                          max_examples=60, iid=iid)
  cohorts = [datasets.make_cohort(ds, np.arange(clients) + clients * r, batch,
                                  num_steps=steps, round_num=r)
             for r in range(rounds)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *cohorts)
  stacked = stacked._replace(batches=dict(
      stacked.batches, x=stacked.batches['x'].astype(dtype)))
  val = ds.client_data(rounds * clients)
  val = {'x': jnp.asarray(val['x'], dtype), 'y': jnp.asarray(val['y'])}
  return stacked, val


@pytest.mark.slow
def test_fedavg_learning_rates_match_finite_differences_and_modes_agree():
  with jax.enable_x64(True):
    r, c, s, b = 3, 4, 2, 8
    cohorts, val = synthetic_rounds(r, c, s, b)
    val_fn = lambda p: jnp.mean(logreg_loss(p, val))
    algo = algorithms.fedavg(logreg_loss, local_steps=s,
                             client_optimizer=base.default_sgd(0.05),
                             server_optimizer=base.default_sgd(0.8))
    state = algo.init({'w': jnp.zeros((60, 10), jnp.float64),
                       'b': jnp.zeros(10, jnp.float64)})
    keys = jax.random.split(jax.random.key(0), r)
    paths = [SERVER_LR, CLIENT_LR]
    # Checkpointed reverse mode: 'sqrt' of 3 rounds is one segment of 2 rounds
    # plus a remainder round, so both code paths run.
    rev = hg.hypergradient(algo, state, paths, cohorts, keys, val_fn,
                           mode='reverse', checkpoint_every='sqrt')
    fwd = hg.hypergradient(algo, state, paths, cohorts, keys, val_fn,
                           mode='forward')
    objective = jax.jit(hg.unrolled_objective(algo, val_fn, checkpoint_every=None))

    def at(path, value):
      hp = hg.set_path(state.hparams, path, jnp.asarray(value, jnp.float64))
      return float(objective(state._replace(hparams=hp), cohorts=cohorts, keys=keys))

    assert rev.value.dtype == jnp.float64
    np.testing.assert_allclose(float(rev.value), at(SERVER_LR, 0.8), rtol=1e-12)
    for path in paths:
      h = float(hg.get_path(state.hparams, path))
      eps = 1e-5 * h
      fd = (at(path, h + eps) - at(path, h - eps)) / (2 * eps)
      for mode, result in (('reverse', rev), ('forward', fwd)):
        got = float(result.grads[path])
        print(f'{path} {mode}: {got:.12g}, central difference {fd:.12g}, '
              f'relative error {abs(got - fd) / abs(fd):.2e}')
        assert abs(got - fd) / abs(fd) < 1e-3, (path, got, fd)
      # Both modes compute in float64 (the weights' float32 is promoted), so
      # they differ only by float64 rounding along 3 rounds: ~1e-14.
      print(f'{path}: forward - reverse relative '
            f'{abs(float(fwd.grads[path]) / float(rev.grads[path]) - 1):.1e}')
      np.testing.assert_allclose(float(fwd.grads[path]), float(rev.grads[path]),
                                 rtol=1e-12)
    np.testing.assert_allclose(float(fwd.value), float(rev.value), rtol=1e-12)


def test_weighted_mean_rules_compute_in_the_promoted_dtype():
  """float64 values, float32 weights: both modes give 1/3 to float64 precision
  (in float32 the reverse rule gave 0.33333334)."""
  from fedjx import program, reduce_weighted_mean
  with jax.enable_x64(True):
    weights = jnp.ones(3, jnp.float32)
    f = program(lambda x: reduce_weighted_mean(x, weights), clients=3)
    x = jnp.asarray([1.0, 2.0, 4.0], jnp.float64)
    reverse = jax.grad(f)(x)
    forward = jax.jacfwd(f)(x)
    assert reverse.dtype == forward.dtype == jnp.float64
    np.testing.assert_allclose(reverse, np.full(3, 1 / 3), rtol=1e-15)
    np.testing.assert_allclose(forward, np.full(3, 1 / 3), rtol=1e-15)
    # And in the weights: d/dw_i = (x_i - mean) / sum w, computed in float64
    # and returned in the weights' float32 (one rounding: 2**-24 relative).
    g = program(lambda w: reduce_weighted_mean(x, w), clients=3)
    w = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)
    want = (np.asarray(x) - np.mean(np.asarray(x))) / 3
    np.testing.assert_allclose(jax.jacfwd(g)(w), want, rtol=2**-24)
    np.testing.assert_allclose(jax.jacrev(g)(w), want, rtol=2**-24)


@pytest.mark.slow
def test_checkpointed_equals_naive_and_selector_function():
  r, c, s, b = 4, 3, 2, 4
  cohorts, val = synthetic_rounds(r, c, s, b, dtype=jnp.float32)
  val_fn = lambda p: jnp.mean(logreg_loss(p, val))
  algo = algorithms.fedprox(logreg_loss, mu=0.1, local_steps=s,
                            server_optimizer=base.default_sgd(1.0, momentum=0.5))
  state = algo.init({'w': jnp.zeros((60, 10)), 'b': jnp.zeros(10)})
  keys = jax.random.split(jax.random.key(1), r)
  select = lambda t: (t['mu'], t['server_optimizer']['momentum'])
  naive = hg.hypergradient(algo, state, select, cohorts, keys, val_fn,
                           checkpoint_every=None)
  ckpt = hg.hypergradient(algo, state, select, cohorts, keys, val_fn,
                          checkpoint_every=2)
  np.testing.assert_allclose(float(ckpt.value), float(naive.value), rtol=1e-6)
  for got, want in zip(ckpt.grads, naive.grads):
    assert float(want) != 0.0
    np.testing.assert_allclose(float(got), float(want), rtol=1e-4)


def test_client_weights_gradient_matches_finite_differences():
  with jax.enable_x64(True):
    r, c, s, b = 2, 3, 2, 8
    cohorts, val = synthetic_rounds(r, c, s, b)
    val_fn = lambda p: jnp.mean(logreg_loss(p, val))
    algo = algorithms.fedavg(logreg_loss, local_steps=s)
    state = algo.init({'w': jnp.zeros((60, 10), jnp.float64),
                       'b': jnp.zeros(10, jnp.float64)})
    keys = jax.random.split(jax.random.key(0), r)
    theta = jnp.zeros(r * c, jnp.float64)
    res = hg.hypergradient(algo, state, hg.CLIENT_LOG_WEIGHTS, cohorts, keys,
                           val_fn, client_log_weights=theta)
    g = res.grads[hg.CLIENT_LOG_WEIGHTS]
    assert g.shape == (r * c,)
    # The weights are normalised, so a shift of all log-weights is free.
    assert abs(float(jnp.sum(g))) < 1e-6 * float(jnp.sum(jnp.abs(g)))
    objective = jax.jit(hg.unrolled_objective(algo, val_fn, cohorts, keys))
    eps = 1e-3  # aggregation_weights computes in float32, hence a larger step.
    for i in (0, 4):
      e = jnp.zeros_like(theta).at[i].set(eps)
      fd = (objective(state, theta + e) - objective(state, theta - e)) / (2 * eps)
      assert abs(float(g[i]) - float(fd)) < 1e-2 * abs(float(fd)), (i, g[i], fd)


@pytest.mark.slow
def test_learned_client_weights_down_weight_corrupted_clients():
  r, c, s, b = 3, 4, 2, 10
  cohorts, val = synthetic_rounds(r, c, s, b, dtype=jnp.float32, iid=True)
  # Clients 0 and 1 of every round get corrupted labels.
  y = cohorts.batches['y']
  bad = jnp.zeros(y.shape, bool).at[:, :2].set(True)
  y = jnp.where(bad, (y + 3) % 10, y)
  cohorts = cohorts._replace(batches=dict(cohorts.batches, y=y))
  val_fn = lambda p: jnp.mean(logreg_loss(p, val))
  algo = algorithms.fedavg(logreg_loss, local_steps=s,
                           client_optimizer=base.default_sgd(0.05))
  state = algo.init({'w': jnp.zeros((60, 10)), 'b': jnp.zeros(10)})
  keys = jax.random.split(jax.random.key(0), r)
  fit = hg.learn_client_weights(algo, state, cohorts, keys, val_fn,
                                num_clients=r * c, steps=15)
  theta = np.asarray(fit.client_log_weights).reshape(r, c)
  assert fit.objective[-1] < fit.objective[0]
  assert theta[:, :2].mean() < theta[:, 2:].mean() - 0.3, theta


@pytest.mark.slow
def test_checkpointing_memory_100_rounds():
  """Reverse mode through 100 rounds of 5 local steps: sqrt(R) checkpointing
  needs under a fifth of the temporary memory of the naive unrolled scan."""
  r, c, s, b, d, k = 100, 4, 5, 8, 60, 10
  algo = algorithms.fedavg(logreg_loss, local_steps=s)
  state = algo.init({'w': jnp.zeros((d, k)), 'b': jnp.zeros(k)})
  spec = jax.ShapeDtypeStruct
  cohorts = datasets.Cohort(
      batches={'x': spec((r, c, s, b, d), jnp.float32),
               'y': spec((r, c, s, b), jnp.int32)},
      mask=spec((r, c, s, b), jnp.bool_), num_examples=spec((r, c), jnp.float32),
      client_ids=spec((r, c), jnp.int32))
  keys = jax.random.split(jax.random.key(0), r)
  val = {'x': jnp.ones((16, d)), 'y': jnp.zeros(16, jnp.int32)}
  val_fn = lambda p: jnp.mean(logreg_loss(p, val))

  def temp_bytes(checkpoint_every):
    objective = hg.unrolled_objective(algo, val_fn, checkpoint_every=checkpoint_every)
    grad = jax.grad(lambda h, cs, ks: objective(state._replace(hparams=h),
                                                cohorts=cs, keys=ks))
    compiled = jax.jit(grad).lower(state.hparams, cohorts, keys).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  naive, ckpt = temp_bytes(None), temp_bytes('sqrt')
  print(f'temp bytes: naive {naive}, sqrt-checkpointed {ckpt}, '
        f'ratio {ckpt / naive:.3f}')
  assert ckpt < 0.2 * naive


def test_paths_and_errors():
  tree = {'a': {'b': jnp.asarray(1.0)}, 'c': jnp.asarray(2.0)}
  assert hg.parse_path('a/b') == ('a', 'b')
  assert float(hg.get_path(tree, ('a', 'b'))) == 1.0
  assert float(hg.set_path(tree, 'c', 3.0)['c']) == 3.0
  assert float(tree['c']) == 2.0
  with pytest.raises(ValueError, match="no key 'x' under a"):
    hg.get_path(tree, 'a/x')
  with pytest.raises(ValueError, match='non-empty'):
    hg.parse_path('')
  with pytest.raises(ValueError, match='checkpoint_every'):
    hg.check_checkpoint_every(0, 10)
  assert hg.check_checkpoint_every('sqrt', 100) == 10
  select, _ = hg.selector(['a/b'])
  moved = hg.embed(select, tree, {'a/b': jnp.asarray(5.0)})
  assert float(moved['a']['b']) == 5.0 and float(moved['c']) == 2.0
