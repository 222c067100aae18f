"""FedNova against the paper's update equations, FedAvg, and the true optimum."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize

import fedjx.algorithms as algos
from fedjx import datasets
from fedjx.datasets.cohort import Cohort
from test_algorithms_util import KEY, assert_trees_close, copy, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort


def _numpy_local_sgd(w, b, data, batch_size, steps, lr):
  """``steps`` SGD steps of 0.5 mean (x w + b - y)^2 over the first batches."""
  x, y = data['x'].astype(np.float64), data['y'].astype(np.float64)
  for s in range(steps):
    xb, yb = x[s * batch_size:(s + 1) * batch_size], y[s * batch_size:(s + 1) * batch_size]
    r = xb @ w + b - yb
    w, b = w - lr * xb.T @ r / len(yb), b - lr * np.mean(r)
  return w, b


def _numpy_fednova_round(w, b, data, batch_size, steps, p, lr, server_lr):
  """The paper's eq. 6 with vanilla SGD: d_i = Delta_i / tau_i, tau_eff = sum p_i tau_i."""
  p = np.asarray(p, np.float64) / np.sum(p)
  dw, db, tau_eff = np.zeros_like(w), 0.0, 0.0
  for d, tau, pi in zip(data, steps, p):
    wi, bi = _numpy_local_sgd(w, b, d, batch_size, tau, lr)
    dw += pi * (w - wi) / tau
    db += pi * (b - bi) / tau
    tau_eff += pi * tau
  return w - server_lr * tau_eff * dw, b - server_lr * tau_eff * db, tau_eff


@pytest.mark.parametrize('weighting', ['num_examples', 'uniform'])
def test_fednova_follows_the_papers_update(weighting):
  sizes, batch = [9, 3, 6, 12], 3
  data = linreg_data(np.random.default_rng(7), sizes, shift=2.0)
  cohort = make_cohort(data, batch_size=batch)
  steps = [s // batch for s in sizes]  # 3, 1, 2, 4 local steps
  lr, server_lr = 0.1, 0.7
  algo = algos.fednova(linreg_loss, client_optimizer=optax.sgd(lr),
                       server_optimizer=optax.sgd(server_lr),
                       weighting=weighting)
  params = linreg_params()
  state = algo.init(params)
  w, b = np.asarray(params['w'], np.float64), float(params['b'])
  p = sizes if weighting == 'num_examples' else [1] * len(sizes)
  for _ in range(2):
    state, metrics = algo.round(state, cohort, KEY)
    w, b, tau_eff = _numpy_fednova_round(w, b, data, batch, steps, p, lr,
                                         server_lr)
    # tau_eff: a mean of small integers with integer (or unit) weights.
    assert float(metrics['tau_eff']) == pytest.approx(tau_eff, rel=1e-6)
  assert_trees_close(state.params, {'w': w, 'b': b})


def test_equal_steps_is_fedavg_exactly():
  sizes = [6, 6, 6, 6, 6]  # Two steps of 3 for every client.
  data = linreg_data(np.random.default_rng(3), sizes, shift=3.0)
  cohort = make_cohort(data, batch_size=3)
  kw = dict(client_optimizer=optax.sgd(0.2), server_optimizer=optax.sgd(1.5))
  nova, avg = algos.fednova(linreg_loss, **kw), algos.fedavg(linreg_loss, **kw)
  s_nova, s_avg = nova.init(linreg_params()), avg.init(linreg_params())
  for _ in range(3):
    s_nova, m_nova = nova.round(s_nova, cohort, KEY)
    s_avg, m_avg = avg.round(s_avg, cohort, KEY)
  jax.tree.map(np.testing.assert_array_equal, s_nova.params, s_avg.params)
  for key in m_avg:
    np.testing.assert_array_equal(m_nova[key], m_avg[key])
  assert float(m_nova['tau_eff']) == 2.0


def test_partial_work_and_skipped_clients_leave_tau_eff():
  sizes, batch = [9, 9, 9], 3
  data = linreg_data(np.random.default_rng(1), sizes)
  full = make_cohort(data, batch_size=batch)
  # Client 1 finished one of its three steps (partial work: later steps masked).
  mask = np.asarray(full.mask).copy()
  mask[1, 1:] = False
  partial = full._replace(mask=jnp.asarray(mask))
  lr = 0.1
  algo = algos.fednova(linreg_loss, client_optimizer=optax.sgd(lr))
  state, metrics = algo.round(algo.init(linreg_params()), partial, KEY)
  w0 = np.asarray(linreg_params()['w'], np.float64)
  w, b, tau_eff = _numpy_fednova_round(w0, 0.1, data, batch, [3, 1, 3], sizes,
                                       lr, 1.0)
  assert float(metrics['tau_eff']) == pytest.approx(tau_eff, rel=1e-6)
  assert_trees_close(state.params, {'w': w, 'b': b})
  # A client with a NaN is left out as if it had not been sampled.
  bad = jax.tree.map(np.asarray, partial.batches)
  bad = {k: v.copy() for k, v in bad.items()}
  bad['y'][2, 0, 0] = np.nan
  nan_cohort = partial._replace(batches=jax.tree.map(jnp.asarray, bad))
  state, metrics = algo.round(algo.init(linreg_params()), nan_cohort, KEY)
  w, b, tau_eff = _numpy_fednova_round(w0, 0.1, data[:2], batch, [3, 1],
                                       sizes[:2], lr, 1.0)
  assert float(metrics['nonfinite_clients']) == 1
  assert float(metrics['tau_eff']) == pytest.approx(tau_eff, rel=1e-6)
  assert_trees_close(state.params, {'w': w, 'b': b})
  # Unguarded, the NaN reaches the model (what lets the runner run FedNova's
  # rounds unguarded first, fedjx.experiments.guarded_rounds).
  unguarded = algos.fednova(linreg_loss, client_optimizer=optax.sgd(lr),
                            skip_nonfinite=False)
  state, _ = unguarded.round(unguarded.init(linreg_params()), nan_cohort, KEY)
  assert not np.all(np.isfinite(np.asarray(state.params['w'])))


def test_bad_options_name_the_argument():
  with pytest.raises(ValueError, match='fednova: weighting'):
    algos.fednova(linreg_loss, weighting='size')
  with pytest.raises(ValueError, match='fednova: option aggregator'):
    algos.fednova(linreg_loss, aggregator=algos.aggregators.mean())


# ----------------------------------------------- objective inconsistency

LAM = 0.2  # L2 regularization: a strongly convex problem with one optimum.


def _synthetic_clients():
  data = datasets.synthetic(1.0, 1.0, num_clients=8, seed=0, max_examples=80)
  return [data.client_data(i) for i in range(8)]


def _loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])
  return ce + 0.5 * LAM * (jnp.sum(params['w'] ** 2) + jnp.sum(params['b'] ** 2))


def _numpy_optimum(clients, weights):
  """argmin sum_i q_i F_i / sum_i q_i in float64 (L-BFGS to gtol 1e-12)."""
  d, k = clients[0]['x'].shape[1], 10
  q = np.asarray(weights, np.float64) / np.sum(weights)

  def objective(theta):
    w, b = theta[:d * k].reshape(d, k), theta[d * k:]
    f, g = 0.5 * LAM * theta @ theta, LAM * theta.copy()
    for qi, c in zip(q, clients):
      x, y = c['x'].astype(np.float64), c['y']
      z = x @ w + b
      z -= z.max(1, keepdims=True)
      prob = np.exp(z) / np.exp(z).sum(1, keepdims=True)
      f -= qi * np.mean(np.log(prob[np.arange(len(y)), y]))
      prob[np.arange(len(y)), y] -= 1
      g[:d * k] += qi * (x.T @ prob).ravel() / len(y)
      g[d * k:] += qi * prob.mean(0)
    return f, g

  res = scipy.optimize.minimize(objective, np.zeros(d * k + k), jac=True,
                                method='L-BFGS-B',
                                options=dict(gtol=1e-12, ftol=1e-15,
                                             maxiter=10_000))
  return res.x


@pytest.mark.slow  # ~15 s: two compiled 300-round scans and two L-BFGS fits.
def test_fednova_removes_the_objective_inconsistency_of_fedavg():
  """Wang et al. 2020, Theorem 1 and Fig. 1, on Synthetic(1, 1).

  Eight clients run full-batch local gradient descent for tau_i = 1 ... 12
  steps. FedAvg's fixed point minimizes the surrogate sum_i p_i tau_i F_i;
  FedNova's minimizes F = sum_i p_i F_i. Both statements are about small
  learning rates: local drift moves either fixed point by O(lr tau L), here
  (lr = 0.004) a sixth of the distance between the two optima, so each
  fixed point must be at least 4x closer to its own optimum than to the
  other. A server learning rate of 5 speeds convergence without moving the
  fixed points (g(x) = 0 for any server step).
  """
  clients = _synthetic_clients()
  n = np.array([len(c['y']) for c in clients])
  tau = np.array([1, 2, 3, 4, 6, 8, 10, 12])
  c, s, b, d = 8, tau.max(), n.max(), clients[0]['x'].shape[1]
  x = np.zeros((c, s, b, d), np.float32)
  y = np.zeros((c, s, b), np.int32)
  mask = np.zeros((c, s, b), bool)
  for i, cl in enumerate(clients):  # Every step is the client's full batch.
    x[i, :, :n[i]], y[i, :, :n[i]], mask[i, :tau[i], :n[i]] = cl['x'], cl['y'], True
  cohort = Cohort({'x': jnp.asarray(x), 'y': jnp.asarray(y)}, jnp.asarray(mask),
                  jnp.asarray(n, jnp.float32), jnp.arange(c, dtype=jnp.int32))
  rounds, server_lr = 300, 5.0
  cohorts = jax.tree.map(lambda a: jnp.broadcast_to(a, (rounds,) + a.shape),
                         cohort)
  keys = jax.random.split(KEY, rounds)
  params = {'w': jnp.zeros((d, 10)), 'b': jnp.zeros((10,))}
  flat = lambda p: np.concatenate([np.ravel(p['w']), np.ravel(p['b'])])
  optimum = _numpy_optimum(clients, n)
  surrogate = _numpy_optimum(clients, n * tau)
  gap = np.linalg.norm(optimum - surrogate)
  assert gap > 0.1  # The two objectives differ.
  points = {}
  for name, builder in (('fedavg', algos.fedavg), ('fednova', algos.fednova)):
    algo = builder(_loss, client_optimizer=optax.sgd(0.004),
                   server_optimizer=optax.sgd(server_lr),
                   client_evaluation=False)
    state, metrics = algo.run_rounds(algo.init(copy(params)), cohorts, keys)
    # Converged: at a linear rate ~0.97 a round, what is left is ~40x the
    # last step; that must be under 4% of the gap.
    assert 40 * server_lr * float(metrics['pseudo_grad_norm'][-1]) < 0.04 * gap
    points[name] = flat(state.params)
  dist = lambda a, b: float(np.linalg.norm(a - b))
  assert dist(points['fedavg'], surrogate) < dist(points['fedavg'], optimum) / 4
  assert dist(points['fednova'], optimum) < dist(points['fednova'], surrogate) / 4
  assert dist(points['fednova'], optimum) < dist(points['fedavg'], optimum) / 4
