"""FedOpt (FedAdam, FedYogi, FedAdagrad, FedAvgM) against Reddi et al. 2021."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from test_algorithms_util import CHAIN, KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params
from test_algorithms_util import make_cohort, reference_sgd, weighted_average

SIZES = [5, 8, 3]
LR_CLIENT = 0.1


def _setup():
  data = linreg_data(np.random.default_rng(10), SIZES)
  return data, make_cohort(data, batch_size=4), linreg_params()


def _paper_rounds(rule, data, params, rounds, eta, b1, b2, tau, v0=None,
                  bias_correction=False):
  """Algorithm 2 of Reddi et al. in NumPy: Delta_t = mean(y_i) - x_t.

  ``v0`` (default ``tau^2``) and ``bias_correction`` (the step scaled by
  ``sqrt(1 - b2^t) / (1 - b1^t)``, Flower's ``eta_norm``) give Flower's and
  TFF's conventions.
  """
  x = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  m = jax.tree.map(np.zeros_like, x)
  v = jax.tree.map(lambda p: np.full_like(p, tau ** 2 if v0 is None else v0), x)
  for t in range(1, rounds + 1):
    xs = jax.tree.map(jnp.asarray, x)
    ys = [reference_sgd(linreg_loss, xs, d, 4, LR_CLIENT)[0] for d in data]
    y = jax.tree.map(lambda a: np.asarray(a, np.float64),
                     weighted_average(ys, SIZES))
    delta = jax.tree.map(lambda y, x: y - x, y, x)
    m = jax.tree.map(lambda m, d: b1 * m + (1 - b1) * d, m, delta)
    if rule == 'adam':
      v = jax.tree.map(lambda v, d: b2 * v + (1 - b2) * d * d, v, delta)
    elif rule == 'yogi':
      v = jax.tree.map(lambda v, d: v - (1 - b2) * d * d * np.sign(v - d * d),
                       v, delta)
    else:
      v = jax.tree.map(lambda v, d: v + d * d, v, delta)
    lr = eta
    if bias_correction:
      lr = eta * np.sqrt(1 - (0.0 if rule == 'adagrad' else b2) ** t) / (1 - b1 ** t)
    x = jax.tree.map(lambda x, m, v: x + lr * m / (np.sqrt(v) + tau), x, m, v)
  return x


@pytest.mark.parametrize('builder,rule', [
    (algos.fedadam, 'adam'), (algos.fedyogi, 'yogi'), (algos.fedadagrad, 'adagrad')])
def test_rounds_match_the_papers_equations(builder, rule):
  data, cohort, params = _setup()
  eta, b1, b2 = 0.05, 0.9, 0.99
  kwargs = dict(server_learning_rate=eta, b1=b1)
  if rule != 'adagrad':
    kwargs['b2'] = b2
  algo = builder(linreg_loss, client_optimizer=optax.sgd(LR_CLIENT), **kwargs)
  state = algo.init(params)
  assert float(state.hparams['server_optimizer']['eps']) == np.float32(1e-3)
  for _ in range(2):  # Two rounds: the moments carry over.
    state, _ = algo.round(state, cohort, KEY)
  expected = _paper_rounds(rule, data, params, 2, eta, b1, b2, 1e-3)
  # Adam-type steps scale the pseudo-gradient's relative error by at most 2
  # (m / sqrt(v): 1 + 1/2), on top of the chain of float32 sums.
  assert_trees_close(state.params, expected, n=2 * CHAIN)


# Flower's FedAdam/FedYogi/FedAdagrad: v_{-1} = 0, bias-corrected step
# (FedAdam, FedYogi); TFF's Yogi: v_{-1} = 1e-6; eps = 0 for Adagrad.
CONVENTIONS = [
    ('adam', dict(initial_accumulator_value=0.0, bias_correction=True, eps=1e-9)),
    ('yogi', dict(initial_accumulator_value=0.0, bias_correction=True, eps=1e-3)),
    ('yogi', dict(initial_accumulator_value=1e-6, bias_correction=True, eps=1e-3)),
    ('adagrad', dict(initial_accumulator_value=0.0, eps=0.0)),
]


@pytest.mark.parametrize('rule,options', CONVENTIONS)
def test_flower_and_tff_conventions_match_hand_computed_rounds(rule, options):
  from fedjx.experiments import registry
  data, cohort, params = _setup()
  eta, b1, b2 = 0.05, 0.9, 0.99
  builder = {'adam': algos.fedadam, 'yogi': algos.fedyogi,
             'adagrad': algos.fedadagrad}[rule]
  kwargs = dict(server_learning_rate=eta, b1=b1, **options)
  if rule != 'adagrad':
    kwargs['b2'] = b2
  algo = builder(linreg_loss, client_optimizer=optax.sgd(LR_CLIENT), **kwargs)
  # The same server optimizer named in a config: fedavg + server_optimizer.
  spec = dict(name={'adam': 'adaptive_adam', 'yogi': 'yogi',
                    'adagrad': 'adaptive_adagrad'}[rule], learning_rate=eta,
              **{k: v for k, v in kwargs.items() if k != 'server_learning_rate'})
  named = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(LR_CLIENT),
                       server_optimizer=registry.build_optimizer(spec))
  state, by_name = algo.init(params), named.init(params)
  for _ in range(2):
    state, _ = algo.round(state, cohort, KEY)
    by_name, _ = named.round(by_name, cohort, KEY)
  expected = _paper_rounds(rule, data, params, 2, eta, b1, b2, options['eps'],
                           v0=options['initial_accumulator_value'],
                           bias_correction=options.get('bias_correction', False))
  assert_trees_close(state.params, expected, n=2 * CHAIN)
  assert_trees_close(by_name.params, expected, n=2 * CHAIN)


def test_fedavgm_is_server_heavy_ball():
  data, cohort, params = _setup()
  algo = algos.fedavgm(linreg_loss, client_optimizer=optax.sgd(LR_CLIENT),
                       server_learning_rate=0.7, server_momentum=0.5)
  state = algo.init(params)
  x, v = params, jax.tree.map(jnp.zeros_like, params)
  for _ in range(2):
    state, _ = algo.round(state, cohort, KEY)
    ys = [reference_sgd(linreg_loss, x, d, 4, LR_CLIENT)[0] for d in data]
    g = jax.tree.map(jnp.subtract, x, weighted_average(ys, SIZES))
    v = jax.tree.map(lambda v, g: 0.5 * v + g, v, g)
    x = jax.tree.map(lambda x, v: x - 0.7 * v, x, v)
  assert_trees_close(state.params, x)


def test_yogi_is_an_optax_transformation():
  """Yogi in optax.chain / inject_hyperparams, against NumPy, three steps."""
  params = {'a': jnp.array([1.0, -2.0, 0.5])}
  grads = [np.array([0.3, -0.1, 2.0]), np.array([-0.2, 0.4, 1.0]),
           np.array([0.05, 0.0, -3.0])]
  opt = optax.inject_hyperparams(algos.yogi)(learning_rate=0.1, b1=0.8, b2=0.9,
                                             eps=1e-2)
  state = opt.init(params)
  p = params
  m, v = np.zeros(3), np.full(3, 1e-4)
  x = np.asarray(params['a'], np.float64)
  for g in grads:
    updates, state = opt.update({'a': jnp.asarray(g, jnp.float32)}, state, p)
    p = optax.apply_updates(p, updates)
    m = 0.8 * m + 0.2 * g
    v = v - 0.1 * g * g * np.sign(v - g * g)
    x = x - 0.1 * m / (np.sqrt(v) + 1e-2)
  # Three steps of about 8 roundings each against float64.
  assert_trees_close(p['a'], x, n=3 * 8)


def test_bad_fedopt_arguments():
  with pytest.raises(ValueError, match='b2'):
    algos.fedadam(linreg_loss, b2=1.5)
  with pytest.raises(ValueError, match='eps'):
    algos.fedyogi(linreg_loss, eps=-1e-3)
  with pytest.raises(ValueError, match='bias_correction'):
    algos.fedadam(linreg_loss, bias_correction='yes')
  with pytest.raises(ValueError, match='initial_accumulator_value'):
    algos.fedadagrad(linreg_loss, initial_accumulator_value=-1.0)
  with pytest.raises(ValueError, match='server_momentum'):
    algos.fedavgm(linreg_loss, server_momentum=-0.1)
  with pytest.raises(ValueError, match='server_optimizer'):
    algos.fedadam(linreg_loss, server_optimizer=optax.sgd(1.0))
  with pytest.raises(ValueError, match='rule'):
    algos.scale_by_adaptive('rmsprop')
