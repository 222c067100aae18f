"""Mime and MimeLite: FedJAX's test scenarios, and float64 NumPy oracles of
one and two rounds under every map strategy, with a DP aggregator for
MimeLite."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import aggregators
from fedjx.algorithms.mime_lib import svrg_loss
import float_tolerance as ft
from test_algorithms_util import CHAIN, Cohort, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

SIZES = [8, 4, 6]   # Batches of 4: 2, 1 and 2 steps (one padded client step).
B = 4


# ------------------------------------------------ FedJAX's scenarios

def _linear_loss(params, batch):
  # FedJAX's mime_test.py / mime_lite_test.py: per-example loss x * w.
  return batch['x'] * params['w']


def _fedjax_cohort(xs):
  # Two clients of 3 and 2 examples in batches of 2 (the first one's second
  # batch half padding), as FedJAX's ShuffleRepeatBatchHParams(batch_size=2,
  # num_epochs=1, seed=0) orders them.
  return Cohort({'x': jnp.asarray(xs, jnp.float32)},
                jnp.asarray([[[1, 1], [1, 0]], [[1, 1], [0, 0]]], bool),
                jnp.asarray([3.0, 2.0]), jnp.arange(2, dtype=jnp.int32))


@pytest.mark.parametrize('builder, xs, w, pseudo, grad', [
    # fedjax/algorithms/mime_lite_test.py, test_mime_lite: w 4 -> 3.88
    # (client updates 0.7 and 0.45, their weighted mean 0.6, and the full
    # batch gradient (0.2 + 0.4 + 0.6 + 0.8 + 0.1) / 5 = 0.42).
    (algos.mime_lite, [[[0.6, 0.4], [0.2, 0.0]], [[0.8, 0.1], [0.0, 0.0]]],
     3.88, 0.6, 0.42),
    # fedjax/algorithms/mime_test.py, test_mime: w 4 -> 2.08 (c = 6: each
    # step moves w by c, so updates 12 and 6, their weighted mean 9.6).
    (algos.mime, [[[2.0, 4.0], [6.0, 0.0]], [[8.0, 10.0], [0.0, 0.0]]],
     2.08, 9.6, 6.0),
])
def test_fedjax_scenarios(builder, xs, w, pseudo, grad):
  algo = builder(_linear_loss, base_optimizer=optax.sgd(1.0),
                 server_optimizer=optax.sgd(0.2), client_evaluation=False)
  state = algo.init({'w': jnp.array(4.0)})
  state, metrics = algo.round(state, _fedjax_cohort(xs), jax.random.key(0))
  # A handful of float32 sums of <= 5 terms of magnitude <= 12.
  np.testing.assert_allclose(state.params['w'], w, rtol=0, atol=ft.atol(20, 12.0))
  np.testing.assert_allclose(metrics['pseudo_grad_norm'], pseudo, rtol=ft.rtol(20))
  np.testing.assert_allclose(metrics['server_gradient_norm'], grad, rtol=ft.rtol(20))


# ------------------------------------------------ float64 NumPy oracles

def _features(d):
  return np.concatenate([d['x'], np.ones((len(d['y']), 1), np.float32)],
                        1).astype(np.float64), d['y'].astype(np.float64)


def _grad(theta, x, y):
  """Mean gradient of 0.5 (x w + b - y)^2 (theta = [w, b], x with a 1 column)."""
  return x.T @ (x @ theta - y) / len(y)


class _Momentum:
  """optax.sgd(lr, momentum): U(g, m) = -lr (g + beta m), V(g, m) = g + beta m."""

  def __init__(self, lr, beta):
    self.lr, self.beta = lr, beta

  def init(self, theta):
    return np.zeros_like(theta)

  def step(self, g, m):
    return -self.lr * (g + self.beta * m)

  def next(self, g, m):
    return g + self.beta * m


class _Adam:
  """optax.adam(lr, b1, b2, eps): bias-corrected moments of count t + 1."""

  def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8):
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

  def init(self, theta):
    return np.zeros_like(theta), np.zeros_like(theta), 0

  def next(self, g, s):
    mu, nu, t = s
    return self.b1 * mu + (1 - self.b1) * g, self.b2 * nu + (1 - self.b2) * g * g, t + 1

  def step(self, g, s):
    mu, nu, t = self.next(g, s)
    mu_hat, nu_hat = mu / (1 - self.b1 ** t), nu / (1 - self.b2 ** t)
    return -self.lr * mu_hat / (np.sqrt(nu_hat) + self.eps)


def _oracle_round(theta, s, data, base_opt, server_lr, mime, clip=None):
  """One Mime / MimeLite round in float64 (module docstring of
  fedjx.algorithms.mime_lib); ``clip``: MimeLite under a DP aggregator with
  noise 0 (the joint (Delta_i, grad f_i(x)) clipped to ``clip``, the sum
  over the participants divided by their number, uniform weights)."""
  feats = [_features(d) for d in data]
  n = np.array([len(y) for _, y in feats], np.float64)
  full = [_grad(theta, x, y) for x, y in feats]
  c = sum(ni * g for ni, g in zip(n, full)) / n.sum()
  deltas = []
  for x, y in feats:
    yi = theta.copy()
    for i in range(0, len(y), B):
      xb, yb = x[i:i + B], y[i:i + B]
      g = _grad(yi, xb, yb)
      if mime:
        g = g - _grad(theta, xb, yb) + c
      yi = yi + base_opt.step(g, s)
    deltas.append(theta - yi)
  if clip is None:
    delta = sum(ni * d for ni, d in zip(n, deltas)) / n.sum()
    grad = c
  else:
    joint = [np.concatenate([d, g]) for d, g in zip(deltas, full)]
    joint = [j * min(1.0, clip / np.linalg.norm(j)) for j in joint]
    mean = sum(joint) / len(joint)
    delta, grad = mean[:theta.size], mean[theta.size:]
  return theta - server_lr * delta, base_opt.next(grad, s)


def _theta(params):
  return np.concatenate([np.asarray(params['w'], np.float64),
                         np.asarray(params['b'], np.float64)[None]])


def _data(seed):
  return linreg_data(np.random.default_rng(seed), SIZES, shift=2.0)


BASES = {
    'momentum': (lambda: optax.inject_hyperparams(optax.sgd)(
        learning_rate=0.05, momentum=0.9), _Momentum(0.05, 0.9)),
    'adam': (lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.02),
             _Adam(0.02)),
}
# Two rounds of <= 2 local steps of the CHAIN's kind (each gradient of
# <= 4 examples over d = 4 features, a momentum or Adam update of <= 4
# terms), a full-batch gradient (<= 8 examples) and a weighted mean over
# 3 clients: inside CHAIN (test_algorithms_util).
# The default run: momentum under vmap and sequential, Adam under vmap; the
# rest with the slow tests.
_SLOW = pytest.mark.slow
CASES = [pytest.param(base, strategy, chunk, id=f'{base}-{strategy}',
                      marks=() if (strategy == 'vmap' or (
                          base, strategy) == ('momentum', 'sequential')) else _SLOW)
         for base in ('momentum', 'adam')
         for strategy, chunk in [('vmap', None), ('chunked', 2),
                                 ('sequential', None), ('auto', None)]]


@pytest.mark.parametrize('base, strategy, chunk', CASES)
@pytest.mark.parametrize('name', ['mime_lite', 'mime'])
def test_two_rounds_against_numpy(name, base, strategy, chunk):
  make_opt, oracle_opt = BASES[base]
  server_lr = 0.5
  algo = getattr(algos, name)(
      linreg_loss, base_optimizer=make_opt(),
      server_optimizer=optax.sgd(server_lr)).compile(strategy, chunk)
  params = linreg_params()
  state = algo.init(params)
  theta, s = _theta(params), oracle_opt.init(_theta(params))
  for r in range(2):
    data = _data(r)
    state, metrics = algo.round(state, make_cohort(data, B), jax.random.key(r))
    theta, s = _oracle_round(theta, s, data, oracle_opt, server_lr,
                             mime=name == 'mime')
    assert_trees_close(_theta(state.params), theta, n=CHAIN)
  assert float(metrics['clients']) == 3.0


def test_mime_reports_the_loss_not_the_corrected_objective():
  # svrg_loss changes the gradient, never the value.
  data = _data(0)
  params = linreg_params()
  x = jax.tree.map(lambda p: p + 0.3, params)
  c = jax.tree.map(lambda p: jnp.full_like(p, 0.7), params)
  batch = {k: jnp.asarray(v[:B]) for k, v in data[0].items()}
  loss = jax.jit(svrg_loss(linreg_loss, x, c))
  np.testing.assert_array_equal(loss(params, batch), linreg_loss(params, batch))
  g = jax.jit(jax.grad(lambda p: jnp.mean(loss(p, batch))))(params)
  plain = jax.jit(jax.grad(lambda p: jnp.mean(linreg_loss(p, batch))))
  want = jax.tree.map(lambda a, b, c: a - b + c, plain(params), plain(x), c)
  assert_trees_close(g, want, n=CHAIN)


def test_mime_lite_with_a_dp_aggregator_against_numpy():
  # Noise 0 leaves the clipping and the fixed denominator to check.
  make_opt, oracle_opt = BASES['momentum']
  clip = 0.05
  algo = algos.mime_lite(
      linreg_loss, base_optimizer=make_opt(), server_optimizer=optax.sgd(1.0),
      aggregator=aggregators.gaussian(clip_norm=clip, noise_multiplier=0.0))
  params = linreg_params()
  state = algo.init(params)
  theta, s = _theta(params), oracle_opt.init(_theta(params))
  for r in range(2):
    data = _data(r)
    state, metrics = algo.round(state, make_cohort(data, B), jax.random.key(r))
    theta, s = _oracle_round(theta, s, data, oracle_opt, 1.0, mime=False,
                             clip=clip)
    assert_trees_close(_theta(state.params), theta, n=CHAIN)
  assert float(metrics['clipped_fraction']) == 1.0  # The clip binds.


@pytest.mark.slow
def test_mime_lite_dp_noise_reaches_the_model_and_the_statistics():
  algo = algos.mime_lite(
      linreg_loss, aggregator=aggregators.gaussian(clip_norm=1.0,
                                                   noise_multiplier=1.0))
  a = algo.init(linreg_params())
  cohort = make_cohort(_data(0), B)
  one, _ = algo.round(a, cohort, jax.random.key(1))
  two, _ = algo.round(algo.init(linreg_params()), cohort, jax.random.key(2))
  for field in ('params', 'extras'):  # x and the base optimizer's s.
    diff = jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))),
                        getattr(one, field), getattr(two, field))
    assert max(jax.tree.leaves(diff)) > 1e-3, field


@pytest.mark.parametrize('kwargs, match', [
    (dict(aggregator=aggregators.gaussian(1.0, 1.0)), r'mime: aggregator .*DP'),
    (dict(base_optimizer='sgd'), r'base_optimizer'),
    (dict(weighting='count'), r"weighting='count'"),
    (dict(local_steps=0), r'local_steps=0'),
    (dict(momentum=0.9), r'option momentum=0.9 is not taken'),
])
def test_errors_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match):
    algos.mime(linreg_loss, **kwargs)
