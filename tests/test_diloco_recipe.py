"""DiLoCo with the scaling study's inner optimizer against a NumPy float64 loop."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx
from fedjx import streaming
from fedjx.algorithms import diloco_recipe_lib
from fedjx.datasets import Cohort
import float_tolerance as ft
from test_algorithms_util import CHAIN, KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

SIZES = [8, 4]     # Two replicas; batches of 4: 2 and 1 real steps.
H = 3              # Inner steps per round, cycling through each replica's steps.
ROUNDS = 2
PEAK, WARMUP, TOTAL, FINAL = 0.05, 2, 6, 0.1   # Warmup and decay both within 6 steps.
B1, B2, WD, CLIP = 0.9, 0.99, 0.1, 2.5
OUTER_LR, OUTER_MU = 0.7, 0.9


def _setup():
  data = linreg_data(np.random.default_rng(41), SIZES, shift=2.0)
  batches = [[{k: np.asarray(v[i:i + 4], np.float64) for k, v in d.items()}
              for i in range(0, len(d['y']), 4)] for d in data]
  params = {k: np.asarray(v, np.float64) for k, v in linreg_params().items()}
  return data, batches, params


def _lr(step: int) -> float:
  """Linear warmup from 0, then cosine from PEAK to FINAL * PEAK at TOTAL."""
  if step < WARMUP:
    return PEAK * step / WARMUP
  frac = min(step - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
  end = FINAL * PEAK
  return end + (PEAK - end) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _grad(p, batch):
  residual = batch['x'] @ p['w'] + p['b'] - batch['y']
  return {'w': batch['x'].T @ residual / len(residual), 'b': np.mean(residual)}


def _norm(tree) -> float:
  return math.sqrt(sum(float(np.sum(np.square(v))) for v in tree.values()))


def _adamw_step(p, g, state, step):
  """One optax.adamw step (eps 1e-8) at learning rate ``_lr(step)``."""
  mu = {k: B1 * state['mu'][k] + (1 - B1) * g[k] for k in p}
  nu = {k: B2 * state['nu'][k] + (1 - B2) * g[k] ** 2 for k in p}
  t = step + 1
  new = {k: p[k] - _lr(step) * ((mu[k] / (1 - B1 ** t)) /
                                (np.sqrt(nu[k] / (1 - B2 ** t)) + 1e-8) + WD * p[k])
         for k in p}
  return new, {'mu': mu, 'nu': nu}


def _reference(batches, params):
  """Per round: the model, the mean pre-clip inner gradient norm, ||Delta||."""
  x = dict(params)
  trace = {k: np.zeros_like(v) for k, v in x.items()}
  states = [{'mu': {k: np.zeros_like(v) for k, v in x.items()},
             'nu': {k: np.zeros_like(v) for k, v in x.items()}} for _ in SIZES]
  steps = [0 for _ in SIZES]
  out, clipped = [], 0
  for _ in range(ROUNDS):
    ys, norms = [], []
    for k, bs in enumerate(batches):
      y = dict(x)
      for t in range(H):
        g = _grad(y, bs[t % len(bs)])
        n = _norm(g)
        norms.append(n)
        clipped += n > CLIP
        g = {key: v * min(1.0, CLIP / n) for key, v in g.items()}
        y, states[k] = _adamw_step(y, g, states[k], steps[k])
        steps[k] += 1
      ys.append(y)
    delta = {key: sum(n * (x[key] - y[key]) for n, y in zip(SIZES, ys)) / sum(SIZES)
             for key in x}
    trace = {key: delta[key] + OUTER_MU * trace[key] for key in x}
    x = {key: x[key] - OUTER_LR * (delta[key] + OUTER_MU * trace[key]) for key in x}
    out.append((dict(x), float(np.mean(norms)), _norm(delta)))
  return out, clipped


def test_rounds_norms_and_bytes_match_numpy():
  data, batches, params = _setup()
  algorithm = diloco_recipe_lib.diloco_recipe(
      linreg_loss, len(SIZES), peak_learning_rate=PEAK, warmup_steps=WARMUP,
      total_steps=TOTAL, final_lr_fraction=FINAL, b1=B1, b2=B2, weight_decay=WD,
      clip_norm=CLIP, outer_learning_rate=OUTER_LR, outer_momentum=OUTER_MU,
      inner_steps=H)
  cohort = make_cohort(data, batch_size=4)
  state = algorithm.init({k: jnp.asarray(v, jnp.float32) for k, v in params.items()})
  expected, clipped = _reference(batches, params)
  # The test exercises clipping: some, not all, inner gradients exceed CLIP.
  assert 0 < clipped < ROUNDS * H * len(SIZES)
  num_params = sum(np.size(v) for v in params.values())
  for want_params, want_inner, want_outer in expected:
    state, metrics = algorithm.round(state, cohort, KEY)
    # float32 against float64 over 6 inner AdamW steps and 2 outer steps of a
    # 3-feature model: each step is a few sums of at most 4 terms; CHAIN (400
    # roundings) bounds the whole chain, relative to each quantity's scale.
    assert_trees_close(state.params, want_params)
    np.testing.assert_allclose(float(metrics['inner_grad_norm']), want_inner,
                               rtol=ft.rtol(CHAIN))
    np.testing.assert_allclose(float(metrics['pseudo_grad_norm']), want_outer,
                               rtol=ft.rtol(CHAIN))
    # Every replica uploads its float32 outer gradient: 2 x 4 parameters x 4 bytes.
    assert float(metrics['communicated_bytes']) == len(SIZES) * num_params * 4


def test_compiled_rounds_keep_the_metric():
  data, _, params = _setup()
  algorithm = diloco_recipe_lib.diloco_recipe(
      linreg_loss, len(SIZES), warmup_steps=1, total_steps=6, inner_steps=H)
  compiled = algorithm.compile(map_strategy='vmap')
  state = compiled.init({k: jnp.asarray(v, jnp.float32) for k, v in params.items()})
  _, metrics = compiled.round(state, make_cohort(data, batch_size=4), KEY)
  assert float(metrics['inner_grad_norm']) > 0


def test_clip_norm_zero_leaves_gradients_unclipped():
  stages = diloco_recipe_lib.inner_optimizer(1e-3, 1, 10, clip_norm=None)
  g = {'w': jnp.full((3,), 100.0)}
  state = stages.init(g)
  _, state = stages.update(g, state, g)
  np.testing.assert_allclose(float(state[0].total), math.sqrt(3) * 100.0, rtol=1e-6)
  assert len(state) == 2  # sum_grad_norms, adamw: no clipping stage.


@pytest.mark.parametrize('kwargs, match', [
    (dict(warmup_steps=10, total_steps=10), 'total_steps=10 must exceed warmup_steps=10'),
    (dict(warmup_steps=-1, total_steps=10), 'warmup_steps=-1'),
    (dict(warmup_steps=1, total_steps=10, final_lr_fraction=1.5), 'final_lr_fraction'),
])
def test_bad_schedules_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    diloco_recipe_lib.inner_optimizer(1e-3, **kwargs)


@pytest.mark.parametrize('streamed', [False, True])
def test_replica_states_in_a_store_match_numpy(streamed):
  # The replicas' AdamW states outside the server state, one row per replica
  # in a ClientStore: each round reads the rows, returns the new ones, and is
  # the same round as the dense one (the NumPy loop), compiled or streamed one
  # replica at a time.
  data, batches, params = _setup()
  algorithm = diloco_recipe_lib.diloco_recipe(
      linreg_loss, len(SIZES), peak_learning_rate=PEAK, warmup_steps=WARMUP,
      total_steps=TOTAL, final_lr_fraction=FINAL, b1=B1, b2=B2, weight_decay=WD,
      clip_norm=CLIP, outer_learning_rate=OUTER_LR, outer_momentum=OUTER_MU,
      inner_steps=H, client_state='store')
  start = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  state = algorithm.init(start)
  assert state.client_states == ()
  store = fedjx.ClientStore(jax.tree.map(np.asarray, algorithm.client_state_init(start)),
                            len(SIZES))
  cohort = make_cohort(data, batch_size=4)
  ids = np.asarray(cohort.client_ids)
  expected, _ = _reference(batches, params)
  for want_params, want_inner, want_outer in expected:
    with_rows = Cohort(*cohort, client_states=store.read(ids))
    if streamed:
      state, metrics, rows = streaming.run(
          algorithm.apply, state, streaming.Clients.from_arrays(with_rows), KEY,
          chunk_size=1)
    else:
      state, metrics, rows = algorithm.round(state, with_rows, KEY)
    store.write(ids, jax.tree.map(np.asarray, rows))
    # Tolerances as in test_rounds_norms_and_bytes_match_numpy.
    assert_trees_close(state.params, want_params)
    np.testing.assert_allclose(float(metrics['inner_grad_norm']), want_inner,
                               rtol=ft.rtol(CHAIN))
    np.testing.assert_allclose(float(metrics['pseudo_grad_norm']), want_outer,
                               rtol=ft.rtol(CHAIN))
  # Each replica's persistent step count: H inner steps in each round.
  counts = store.read(ids)[0].count
  np.testing.assert_array_equal(counts, [ROUNDS * H] * len(SIZES))


def test_client_state_names_its_choices():
  with pytest.raises(ValueError, match="client_state='host'.*'dense', 'store'"):
    diloco_recipe_lib.diloco_recipe(linreg_loss, 2, client_state='host')
