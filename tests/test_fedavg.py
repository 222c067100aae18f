"""FedAvg against independent references (NumPy and plain JAX loops)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
from test_algorithms_util import CHAIN, KEY, assert_trees_close, copy
from test_algorithms_util import linreg_data, linreg_loss, linreg_params
from test_algorithms_util import make_cohort, mean_loss, minibatches, reference_sgd
from test_algorithms_util import stack_cohorts, weighted_average

# Losses and norms are sums of same-sign terms along the chain of at most
# CHAIN float32 sums of test_algorithms_util: relative bound 2 gamma_CHAIN.
TOL = ft.rtol(CHAIN)


def test_one_local_step_is_one_pooled_gradient_step():
  rng = np.random.default_rng(0)
  data = linreg_data(rng, [4, 9, 6])
  params = linreg_params()
  lr = 0.3
  # One step per client over all its examples (B = largest client).
  cohort = make_cohort(data, batch_size=9)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(lr),
                      server_optimizer=optax.sgd(1.0))
  state, metrics = algo.round(algo.init(params), cohort, KEY)
  # Reference: full-batch gradient step on the pooled example-weighted loss.
  pooled = {k: np.concatenate([d[k] for d in data]) for k in data[0]}
  g = jax.grad(lambda p: mean_loss(linreg_loss, p, pooled))(params)
  expected = jax.tree.map(lambda p, g: p - lr * g, params, g)
  assert_trees_close(state.params, expected)
  np.testing.assert_allclose(metrics['train_loss_before'],
                             mean_loss(linreg_loss, params, pooled), rtol=TOL)
  assert float(metrics['clients']) == 3 and float(metrics['examples']) == 19


def test_identical_clients_equal_local_training():
  rng = np.random.default_rng(1)
  (client,) = linreg_data(rng, [12])
  params = linreg_params()
  cohort = make_cohort([client] * 4, batch_size=5)
  algo = algos.fedavg(linreg_loss,
                      client_optimizer=optax.sgd(0.1, momentum=0.5),
                      local_epochs=3)
  state, _ = algo.round(algo.init(params), cohort, KEY)
  expected, steps = reference_sgd(linreg_loss, params, client, 5, 0.1,
                                  epochs=3, momentum=0.5)
  assert steps == 9
  assert_trees_close(state.params, expected)


@pytest.mark.parametrize('weighting,map_strategy', [
    ('num_examples', 'vmap'), ('uniform', 'sequential')])
def test_padded_clients_equal_unpadded_loop(weighting, map_strategy):
  rng = np.random.default_rng(2)
  sizes = [3, 7, 20]
  data = linreg_data(rng, sizes)
  params = linreg_params()
  lr, momentum, batch, epochs = 0.05, 0.9, 4, 2
  # All clients padded to 20 examples: [C=3, S=5, B=4].
  cohort = make_cohort(data, batch_size=batch)
  assert cohort.mask.shape == (3, 5, 4)
  algo = algos.fedavg(linreg_loss,
                      client_optimizer=optax.sgd(lr, momentum=momentum),
                      local_epochs=epochs, weighting=weighting).compile(
                          map_strategy=map_strategy)
  state, metrics = algo.round(algo.init(params), cohort, KEY)
  trained = [reference_sgd(linreg_loss, params, d, batch, lr, epochs, momentum)[0]
             for d in data]
  weights = sizes if weighting == 'num_examples' else [1, 1, 1]
  assert_trees_close(state.params, weighted_average(trained, weights))
  # Metrics: pooled losses over all real examples, before and after.
  total = sum(sizes)
  before = sum(n * mean_loss(linreg_loss, params, d) for n, d in zip(sizes, data))
  after = sum(n * mean_loss(linreg_loss, p, d)
              for n, p, d in zip(sizes, trained, data))
  np.testing.assert_allclose(metrics['train_loss_before'], before / total, rtol=TOL)
  np.testing.assert_allclose(metrics['train_loss_after'], after / total, rtol=TOL)
  delta = jax.tree.map(jnp.subtract, params, weighted_average(trained, weights))
  np.testing.assert_allclose(metrics['pseudo_grad_norm'],
                             optax.tree.norm(delta), rtol=TOL)


def test_padding_client_and_local_steps():
  """An empty client changes nothing; local_steps cycles the real steps."""
  rng = np.random.default_rng(3)
  data = linreg_data(rng, [5, 3])
  empty = {k: v[:0] for k, v in data[0].items()}
  params = linreg_params()
  cohort = make_cohort(data + [empty], batch_size=2)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1),
                      local_steps=7)
  state, metrics = algo.round(algo.init(params), cohort, KEY)
  # 7 steps over client 0's 3 real batches (2, 2, 1) and client 1's 2.
  trained = []
  for d in data:
    batches = [{k: v[i:i + 2] for k, v in d.items()} for i in range(0, len(d['y']), 2)]
    cycled = {k: np.concatenate([batches[t % len(batches)][k] for t in range(7)])
              for k in d}
    sizes = [len(batches[t % len(batches)]['y']) for t in range(7)]
    p = params
    grad = jax.grad(lambda p, b: jnp.mean(linreg_loss(p, b)))
    start = 0
    for n in sizes:
      b = {k: jnp.asarray(v[start:start + n]) for k, v in cycled.items()}
      p = jax.tree.map(lambda p, g: p - 0.1 * g, p, grad(p, b))
      start += n
    trained.append(p)
  assert_trees_close(state.params, weighted_average(trained, [5, 3]))
  assert float(metrics['clients']) == 2


def test_metrics_fn_and_run_rounds_match_repeated_rounds():
  rng = np.random.default_rng(4)
  data = linreg_data(rng, [6, 4, 8])
  params = linreg_params()
  cohorts = [make_cohort([data[i], data[(i + 1) % 3]], batch_size=4)
             for i in range(3)]

  def metrics_fn(p, b):
    return {'accuracy': (jnp.abs(b['x'] @ p['w'] + p['b'] - b['y']) < 1.0
                         ).astype(jnp.float32)}

  algo = algos.fedavg(linreg_loss, client_optimizer=optax.adam(0.05),
                      server_optimizer=optax.sgd(0.5, momentum=0.9),
                      metrics_fn=metrics_fn)
  state = algo.init(params)
  history = []
  for c in cohorts:
    state, m = algo.round(state, c, KEY)
    history.append(m)
  keys = jax.random.split(KEY, 3)
  scanned, stacked = algo.run_rounds(algo.init(params), stack_cohorts(cohorts),
                                     jnp.stack([KEY] * 3))
  del keys
  assert_trees_close(scanned.params, state.params)
  for r, m in enumerate(history):
    for k, v in m.items():
      np.testing.assert_allclose(stacked[k][r], v, rtol=TOL, atol=TOL)
  # Accuracy before round 0 is the server model's, pooled over the cohort.
  pooled = {k: np.concatenate([data[0][k], data[1][k]]) for k in data[0]}
  expected = np.mean(metrics_fn(params, jax.tree.map(jnp.asarray, pooled))['accuracy'])
  np.testing.assert_allclose(history[0]['train_accuracy_before'], expected, rtol=TOL)
  assert int(state.round_index) == 3


def test_hyperparameters_are_traced_and_differentiable():
  """d(loss after a round)/d(client lr) matches a finite difference."""
  rng = np.random.default_rng(5)
  data = linreg_data(rng, [6, 9])
  params = linreg_params()
  cohort = make_cohort(data, batch_size=3)
  algo = algos.fedavg(linreg_loss, local_epochs=2)  # Injected SGD defaults.
  state0 = algo.init(params)
  assert set(state0.hparams['client_optimizer']) == {'learning_rate'}
  pooled = {k: np.concatenate([d[k] for d in data]) for k in data[0]}

  def val_loss(lr):
    hp = dict(state0.hparams)
    hp['client_optimizer'] = {'learning_rate': lr}
    state, _ = algo.apply(state0._replace(hparams=hp), cohort, KEY)
    return mean_loss(linreg_loss, state.params, pooled)

  lr = jnp.float32(0.05)
  f = jax.jit(jax.value_and_grad(val_loss))
  eps = 1e-3
  loss, g = f(lr)
  fd = (f(lr + eps)[0] - f(lr - eps)[0]) / (2 * eps)
  # Each float32 loss is within gamma_n |loss| (n = CHAIN), so the central
  # difference is within 2 gamma_n |loss| / (2 eps); its truncation error
  # eps**2 |f'''| / 6 is below eps**2 for the smooth loss of a few SGD steps.
  np.testing.assert_allclose(g, fd, rtol=0,
                             atol=TOL * abs(float(loss)) / (2 * eps) + eps ** 2)
  # Changing the traced value changes the round without a new trace.
  hp = dict(state0.hparams, client_optimizer={'learning_rate': jnp.float32(0.0)})
  state, _ = algo.round(copy(state0)._replace(hparams=hp), cohort, KEY)
  assert_trees_close(state.params, params)


def test_state_is_donated_but_init_params_survive():
  params = linreg_params()
  cohort = make_cohort(linreg_data(np.random.default_rng(6), [4, 4]), batch_size=2)
  algo = algos.fedavg(linreg_loss)
  state = algo.init(params)
  algo.round(state, cohort, KEY)
  np.testing.assert_allclose(params['w'], linreg_params()['w'])


def test_bad_inputs_name_the_argument():
  params = linreg_params()
  cohort = make_cohort(linreg_data(np.random.default_rng(7), [4, 4]), batch_size=2)
  with pytest.raises(ValueError, match='weighting'):
    algos.fedavg(linreg_loss, weighting='by_size')
  with pytest.raises(ValueError, match='map_strategy'):
    algos.fedavg(linreg_loss).compile(map_strategy='parallel')
  with pytest.raises(ValueError, match='local_epochs'):
    algos.fedavg(linreg_loss, local_epochs=0)
  with pytest.raises(ValueError, match='server_learning_rate'):
    algos.fedadam(linreg_loss, server_learning_rate=-1.0)
  with pytest.raises(ValueError, match='client_optimizer learning_rate'):
    algos.fedavg(linreg_loss, client_optimizer=optax.inject_hyperparams(
        optax.sgd)(learning_rate=-0.1)).init(params)
  with pytest.raises(ValueError, match='client_optimizer'):
    algos.fedavg(linreg_loss, client_optimizer='sgd')
  algo = algos.fedavg(linreg_loss)
  wrong = {'w': jnp.zeros(5), 'b': jnp.zeros(())}
  with pytest.raises(ValueError, match='params do not match the cohort'):
    algo.round(algo.init(wrong), cohort, KEY)
  bad = cohort._replace(num_examples=cohort.num_examples[:1])
  with pytest.raises(ValueError, match='num_examples'):
    algo.round(algo.init(params), bad, KEY)
  bad = cohort._replace(mask=cohort.mask[:, :, :1])
  with pytest.raises(ValueError, match=r"batches\['x'\]"):
    algo.round(algo.init(params), bad, KEY)


def _synthetic(alpha, beta, num_clients, dim, classes, rng):
  """Synthetic(alpha, beta) of Li et al. 2020 (FedProx), Section 5.1."""
  sizes = np.clip(rng.lognormal(3.5, 0.6, num_clients).astype(int), 12, 80)
  cov = np.diag(np.arange(1, dim + 1, dtype=np.float64) ** -1.2)
  clients = []
  for n in sizes:
    u, b_mean = rng.normal(0, alpha), rng.normal(0, beta)
    w = rng.normal(u, 1, (dim, classes))
    b = rng.normal(u, 1, classes)
    v = rng.normal(b_mean, 1, dim)
    x = rng.multivariate_normal(v, cov, n)
    y = np.argmax(x @ w + b, axis=1)
    clients.append({'x': x.astype(np.float32), 'y': y.astype(np.int32)})
  return clients


L2 = 0.1


def _softmax_loss(params, batch):
  """Multinomial logistic regression with an L2 penalty (strongly convex)."""
  logits = batch['x'] @ params['w'] + params['b']
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])
  penalty = jnp.sum(jnp.square(params['w'])) + jnp.sum(jnp.square(params['b']))
  return ce + 0.5 * L2 * penalty


def test_fedavg_converges_on_synthetic_1_1():
  # Synthetic(1, 1) with 20 features and 5 classes (the paper: 60 and 10).
  rng = np.random.default_rng(8)
  dim, classes = 20, 5
  data = _synthetic(1.0, 1.0, 12, dim, classes, rng)
  pooled = {k: jnp.asarray(np.concatenate([d[k] for d in data])) for k in data[0]}
  params = {'w': jnp.zeros((dim, classes)), 'b': jnp.zeros(classes)}
  objective = jax.jit(lambda p: jnp.mean(_softmax_loss(p, pooled)))

  # Centralized optimum of the pooled objective by full-batch gradient
  # descent, in plain JAX.
  @jax.jit
  def optimum(p):
    step = lambda _, p: jax.tree.map(lambda p, g: p - 0.2 * g, p,
                                     jax.grad(objective)(p))
    return jax.lax.fori_loop(0, 2000, step, p)

  p_star = optimum(params)
  assert float(optax.tree.norm(jax.grad(objective)(p_star))) < 1e-4
  best = float(objective(p_star))
  # Each client's data in one batch, two local steps: local GD, so the
  # clients' step counts do not reweight the objective (FedAvg then
  # optimises the pooled loss, up to client drift).
  cohort = make_cohort(data, batch_size=max(len(d['y']) for d in data))
  rounds = 300
  algo = algos.fedavg(_softmax_loss, client_optimizer=optax.sgd(0.05),
                      local_steps=2).compile(map_strategy='sequential')
  state, metrics = algo.run_rounds(algo.init(params),
                                   stack_cohorts([cohort] * rounds),
                                   jax.random.split(KEY, rounds))
  final = float(objective(state.params))
  assert best <= final <= best * 1.01, (final, best)
  np.testing.assert_allclose(metrics['train_loss_before'][0], np.log(classes),
                             rtol=TOL)


@pytest.mark.parametrize('map_strategy', ['vmap', 'sequential'])
def test_without_client_evaluation_the_training_loss_comes_free(map_strategy):
  """Same model; metrics are the losses of the local steps, pooled over examples."""
  rng = np.random.default_rng(7)
  sizes = [3, 7, 10]
  data = linreg_data(rng, sizes)
  params = linreg_params()
  lr, batch, epochs = 0.05, 4, 2
  cohort = make_cohort(data, batch_size=batch)
  build = lambda evaluate: algos.fedavg(
      linreg_loss, client_optimizer=optax.sgd(lr), local_epochs=epochs,
      client_evaluation=evaluate).compile(map_strategy=map_strategy)
  with_eval, without = build(True), build(False)
  state_a, metrics_a = with_eval.round(with_eval.init(params), cohort, KEY)
  state_b, metrics_b = without.round(without.init(params), cohort, KEY)
  assert_trees_close(state_a.params, state_b.params)
  assert 'train_loss_before' in metrics_a and 'train_loss_during' not in metrics_a
  assert 'train_loss_before' not in metrics_b
  # Reference: hand-written SGD, summing each step's minibatch losses.
  total, count = 0.0, 0
  for d in data:
    p = params
    for _ in range(epochs):
      for mb in minibatches(d, batch):
        losses = np.asarray(linreg_loss(p, mb))
        total, count = total + losses.sum(), count + losses.size
        p = reference_sgd(linreg_loss, p, mb, batch, lr)[0]
  np.testing.assert_allclose(metrics_b['train_loss_during'], total / count, rtol=TOL)
  np.testing.assert_allclose(metrics_b['examples'], sum(sizes))


def test_client_evaluation_must_be_a_bool():
  with pytest.raises(ValueError, match=r"fedavg: client_evaluation='no'"):
    algos.fedavg(linreg_loss, client_evaluation='no')
