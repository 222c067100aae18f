"""Algorithms built from parts, against hand-written rounds.

Client transforms (``proximal``, ``control_variate``) chained with client
optimizers, aggregators (``gaussian`` DP, ``quantized_mean``) taken by any
algorithm, and ``Algorithm.compile``. Every reference is NumPy or plain JAX
(the noise drawn with ``jax.random`` from the same key, leaf by leaf).
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import float_tolerance as ft
from fedjx.algorithms import aggregators
from fedjx.algorithms.transforms import core as client_transforms
from fedjx.algorithms.compression import quantization
from fedjx.experiments import parts
from test_algorithms_util import KEY, assert_trees_close, copy, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort
from test_algorithms_util import mean_loss, minibatches, reference_sgd
from test_algorithms_util import weighted_average

SIZES = [3, 9, 6]
B, LR = 3, 0.1


def _data(seed=30):
  return linreg_data(np.random.default_rng(seed), SIZES, shift=3.0)


def _sub(a, b):
  return jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)


def _clip(u, c):
  norm = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                     for x in jax.tree.leaves(u)))
  return jax.tree.map(lambda x: x * min(1.0, c / norm), u), norm


def _noisy_mean(updates, clip, z, denom, key):
  """``(sum_k clip(Delta_k) + N(0, (z C)^2)) / D``, noise leaf by leaf from ``key``."""
  clipped = [_clip(u, clip)[0] for u in updates]
  total = jax.tree.map(lambda *xs: sum(xs), *clipped)
  leaves, treedef = jax.tree.flatten(total)
  keys = jax.random.split(key, len(leaves))
  noise = [np.asarray(jax.random.normal(k, np.shape(t), jnp.float32), np.float64)
           for t, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, [(t + z * clip * n) / denom
                                      for t, n in zip(leaves, noise)])


# --------------------------------------------------------- client transforms

def test_proximal_chained_with_sgd_is_the_proximal_gradient_step():
  x = {'w': jnp.asarray([1.0, -2.0]), 'b': jnp.asarray(0.5)}
  y = {'w': jnp.asarray([0.5, 1.0]), 'b': jnp.asarray(-1.0)}
  g = {'w': jnp.asarray([0.25, 0.75]), 'b': jnp.asarray(2.0)}
  mu = 0.5
  opt = optax.chain(client_transforms.proximal(mu), optax.sgd(LR))
  updates, _ = opt.update(g, opt.init(x), y)  # Anchored at x, evaluated at y.
  want = jax.tree.map(lambda g, y, x: -LR * (g + mu * (y - x)), g, y, x)
  assert_trees_close(updates, want, n=4)
  with pytest.raises(ValueError, match='params'):
    client_transforms.proximal(mu).update(g, opt.init(x)[0])


def test_control_variate_adds_c_minus_c_i():
  c = {'w': jnp.asarray([1.0, 2.0])}
  ci = {'w': jnp.asarray([0.5, -1.0])}
  g = {'w': jnp.asarray([3.0, 4.0])}
  t = client_transforms.control_variate(c, ci)
  out, _ = t.update(g, t.init(g))
  np.testing.assert_array_equal(out['w'], [3.5, 7.0])


def test_learning_rate_of_reads_injected_rates_only():
  p = {'w': jnp.zeros(2)}
  sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.03)
  chained = optax.chain(client_transforms.proximal(0.1), sgd)
  assert float(client_transforms.learning_rate_of(sgd, p)) == np.float32(0.03)
  assert float(client_transforms.learning_rate_of(chained, p)) == np.float32(0.03)
  assert client_transforms.learning_rate_of(optax.sgd(0.03), p) is None


def test_fedavg_with_proximal_and_adam_matches_a_hand_written_round():
  """FedProx with any client optimizer: Adam on grad F_i(y) + mu (y - x)."""
  data, params, mu = _data(), linreg_params(), 0.5
  cohort = make_cohort(data, batch_size=B)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.adam(0.05),
                      client_transform=algos.transforms.proximal(mu))
  state, _ = algo.round(algo.init(params), cohort, KEY)
  grad = jax.grad(lambda p, b: jnp.mean(linreg_loss(p, b)))
  ys = []
  for d in data:  # Adam (Kingma & Ba, with bias correction), by hand.
    y = params
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    for t, batch in enumerate(minibatches(d, B), start=1):
      gr = jax.tree.map(lambda g, y, x: g + mu * (y - x), grad(y, batch), y, params)
      m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, gr)
      v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, gr)
      y = jax.tree.map(
          lambda y, m, v: y - 0.05 * (m / (1 - 0.9 ** t)) /
          (jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8), y, m, v)
    ys.append(y)
  assert_trees_close(state.params, weighted_average(ys, SIZES))


def test_fedprox_is_fedavg_with_the_proximal_transform():
  data, params = _data(), linreg_params()
  cohort = make_cohort(data, batch_size=B)
  a = algos.fedprox(linreg_loss, mu=0.3, client_optimizer=optax.sgd(LR))
  b = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(LR),
                   client_transform=optax.inject_hyperparams(algos.transforms.proximal)(mu=0.3))
  sa, _ = a.round(a.init(params), cohort, KEY)
  sb, _ = b.round(b.init(params), cohort, KEY)
  assert sorted(sa.hparams) == sorted(sb.hparams) == [
      'client_optimizer', 'mu', 'server_optimizer']
  np.testing.assert_array_equal(sa.params['w'], sb.params['w'])


# --------------------------------------------------------------- aggregators

def test_dp_fedadam_matches_a_hand_computed_round():
  data, params = _data(), linreg_params()
  clip, z, denom, lr, b1, b2, eps = 0.4, 0.5, 4.0, 0.05, 0.9, 0.99, 1e-3
  cohort = make_cohort(data, batch_size=B)
  algo = algos.fedadam(
      linreg_loss, client_optimizer=optax.sgd(LR), server_learning_rate=lr,
      b1=b1, b2=b2, eps=eps,
      aggregator=aggregators.gaussian(clip, z, expected_clients_per_round=denom))
  state = algo.init(params)
  assert float(state.hparams['clip_norm']) == np.float32(clip)
  key = jax.random.key(7)
  state, metrics = algo.round(state, cohort, key)
  ys = [reference_sgd(linreg_loss, params, d, B, LR)[0] for d in data]
  deltas = [_sub(params, y) for y in ys]
  g = _noisy_mean(deltas, clip, z, denom, key)
  # Reddi et al. 2021, Alg. 2: m = (1-b1) g, v = b2 tau^2 + (1-b2) g^2.
  want = jax.tree.map(
      lambda x, g: np.asarray(x, np.float64) - lr * ((1 - b1) * g) /
      (np.sqrt(b2 * eps ** 2 + (1 - b2) * g * g) + eps), params, g)
  # Adam's step m / (sqrt(v) + eps) is ~1 in magnitude, and amplifies the
  # pseudo-gradient's relative error at most 2x.
  assert_trees_close(state.params, want, n=2 * 400)
  norms = [_clip(d, clip)[1] for d in deltas]
  # Delta_k = x - y_k carries the trained y_k's error (2 gamma_400 of its
  # scale, at most max|y_k|), relative to ||Delta_k||.
  scale = max(float(np.max(np.abs(np.asarray(l)))) for y in ys
              for l in jax.tree.leaves(y))
  np.testing.assert_allclose(metrics['mean_update_norm'], np.mean(norms),
                             rtol=ft.rtol(400) * scale / min(norms))
  assert float(metrics['clipped_fraction']) == np.float32(
      np.mean([n > clip for n in norms]))
  np.testing.assert_allclose(metrics['noise_std'], z * clip, rtol=1e-7)


def test_dp_diloco_clips_and_noises_the_outer_gradient():
  data, params = _data(), linreg_params()
  clip, z, lr, momentum = 0.3, 0.7, 0.7, 0.9
  cohort = make_cohort(data, batch_size=B)
  algo = algos.diloco(
      linreg_loss, len(SIZES), inner_optimizer=optax.sgd(LR),
      outer_learning_rate=lr, outer_momentum=momentum,
      aggregator=aggregators.gaussian(clip, z))  # D = participating replicas.
  key = jax.random.key(3)
  state, metrics = algo.round(algo.init(params), cohort, key)
  thetas = [reference_sgd(linreg_loss, params, d, B, LR)[0] for d in data]
  g = _noisy_mean([_sub(params, t) for t in thetas], clip, z, len(SIZES), key)
  # Nesterov SGD from a zero trace: theta - lr (g + momentum g).
  want = jax.tree.map(lambda x, g: np.asarray(x, np.float64) - lr * (1 + momentum) * g,
                      params, g)
  assert_trees_close(state.params, want)
  assert float(metrics['communicated_bytes']) == len(SIZES) * 4 * 4


def test_quantized_fedavg_averages_quantized_updates():
  data, params = _data(), linreg_params()
  cohort = make_cohort(data, batch_size=B)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(LR),
                      aggregator=aggregators.quantized_mean('int4'))
  state, _ = algo.round(algo.init(params), cohort, KEY)
  ys = [reference_sgd(linreg_loss, params, d, B, LR)[0] for d in data]
  deltas = [quantization.quantize(jax.tree.map(jnp.subtract, params, y), 'int4')
            for y in ys]
  want = jax.tree.map(lambda x, d: x - d, params, weighted_average(deltas, SIZES))
  assert_trees_close(state.params, want)


def test_dp_fedavg_is_fedavg_with_the_gaussian_aggregator():
  data, params = _data(), linreg_params()
  cohort = make_cohort(data, batch_size=B)
  a = algos.dp_fedavg(linreg_loss, clip_norm=0.2, noise_multiplier=0.4,
                      client_optimizer=optax.sgd(LR))
  b = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(LR),
                   aggregator=aggregators.gaussian(clip_norm=0.2,
                                                   noise_multiplier=0.4))
  sa, ma = a.round(a.init(params), cohort, KEY)
  sb, mb = b.round(b.init(params), cohort, KEY)
  np.testing.assert_array_equal(sa.params['w'], sb.params['w'])
  assert sorted(ma) == sorted(mb)


def test_aggregator_errors_are_one_line():
  for bad, match in ((dict(name='mean'), 'is a config spec'), (3, 'aggregator=3')):
    with pytest.raises(ValueError, match=match) as e:
      algos.fedavg(linreg_loss, aggregator=bad)
    assert '\n' not in str(e.value)
  for bad, match in ((dict(name='geometric_mean'), "name='geometric_mean'"),
                     (dict(name='gaussian', clip=1.0), "clip=1.0 is not an option of 'gaussian'")):
    with pytest.raises(ValueError, match=match) as e:
      parts.build_aggregator(bad)
    assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match='not both'):
    algos.diloco(linreg_loss, 2, quantization_format='int8',
                 aggregator=aggregators.mean())
  with pytest.raises(ValueError, match='clip_norm'):
    aggregators.gaussian(clip_norm=0.0)


# ------------------------------------------------------------------- compile

def test_compile_options_give_the_same_round_and_donate_false_keeps_the_state():
  data, params = _data(), linreg_params()
  cohort = make_cohort(data, batch_size=B)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(LR))
  state0 = algo.init(params)
  want, _ = algo.round(copy(state0), cohort, KEY)
  kept = algo.compile(map_strategy='sequential', donate=False)
  got, _ = kept.round(state0, cohort, KEY)
  again, _ = kept.round(state0, cohort, KEY)  # state0 was not donated.
  assert_trees_close(got.params, want.params, n=len(SIZES))
  np.testing.assert_array_equal(again.params['w'], got.params['w'])
  chunked = algo.compile(map_strategy='chunked', chunk_size=2)
  got, _ = chunked.round(copy(state0), cohort, KEY)
  assert_trees_close(got.params, want.params, n=len(SIZES))
  for kw, match in ((dict(map_strategy='pmap'), "map_strategy='pmap'"),
                    (dict(chunk_size=0), 'chunk_size=0'),
                    (dict(donate='no'), "donate='no'")):
    with pytest.raises(ValueError, match=match):
      algo.compile(**kw)


def test_builders_take_no_execution_options():
  # How clients run is Algorithm.compile's business only.
  for builder in (algos.fedavg, algos.fedprox, algos.fedadam):
    for option in ('map_strategy', 'chunk_size'):
      with pytest.raises(ValueError, match=f'option {option}=.* is not taken'):
        builder(linreg_loss, **{option: 'sequential' if option == 'map_strategy'
                                else 2})
  with pytest.raises(TypeError, match='map_strategy'):
    algos.fedavg_hypergradient_tuner(linreg_loss, map_strategy='vmap')  # pylint: disable=unexpected-keyword-arg


# ----------------------------------------------------------- client metrics

def test_client_metrics_are_each_client_s_own_against_hand_computed_values():
  data, params = _data(), linreg_params()
  cohort = make_cohort(data, batch_size=B)
  algo = algos.fedprox(linreg_loss, mu=0.2, client_optimizer=optax.sgd(LR),
                       client_metrics=True)
  _, metrics = algo.round(algo.init(params), cohort, KEY)
  prox = lambda g, y: jax.tree.map(lambda y, x: 0.2 * (y - x), y, params)
  for i, d in enumerate(data):
    y, steps = reference_sgd(linreg_loss, params, d, B, LR, correction=prox)
    norm = np.sqrt(sum(np.sum(np.square(l)) for l in jax.tree.leaves(_sub(params, y))))
    assert int(metrics['client_num_steps'][i]) == steps
    # Each value is a chain of at most CHAIN float32 roundings of terms of
    # its own sign: a relative bound.
    np.testing.assert_allclose(metrics['client_update_norm'][i], norm,
                               rtol=ft.rtol(400))
    np.testing.assert_allclose(metrics['client_loss_before'][i],
                               mean_loss(linreg_loss, params, d), rtol=ft.rtol(400))
    np.testing.assert_allclose(metrics['client_loss_after'][i],
                               mean_loss(linreg_loss, y, d), rtol=ft.rtol(400))
  plain = algos.fedprox(linreg_loss, mu=0.2, client_optimizer=optax.sgd(LR))
  _, without = plain.round(plain.init(params), cohort, KEY)
  assert not [k for k in without if k.startswith('client_')]


# ------------------------------------------------------------- the docs' example

def test_the_write_your_own_algorithm_example_of_the_docs_runs_and_is_right():
  import os
  import re
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      'docs', 'algorithms.md')
  text = open(path).read()
  section = text[text.index('## Write your own algorithm from parts'):]
  blocks = re.findall(r'```python\n(.*?)```', section, re.S)
  assert len(blocks) == 2
  ns = {}
  for block in blocks:
    exec(compile(block, path, 'exec'), ns)  # pylint: disable=exec-used
  assert ns['metrics']['client_update_norm'].shape == (3,)
  np.testing.assert_array_equal(ns['new'].params['w'], ns['again'].params['w'])
  # The unit-norm DiLoCo round by hand: SGD inner steps, Delta_k / ||Delta_k||
  # averaged with w_k = n_k, Nesterov outer step from a zero trace.
  theta = {'w': jnp.zeros(3), 'b': jnp.zeros(())}
  units, sizes = [], []
  for client in ns['clients']:
    y, _ = reference_sgd(ns['loss_fn'], theta, client, 2, 0.1)
    delta = _sub(theta, y)
    norm = np.sqrt(sum(np.sum(np.square(l)) for l in jax.tree.leaves(delta)))
    units.append(jax.tree.map(lambda d: d / norm, delta))
    sizes.append(len(client['y']))
  g = weighted_average(units, sizes)
  want = jax.tree.map(lambda x, g: np.asarray(x) - 0.7 * 1.9 * g, theta, g)
  assert_trees_close(ns['diloco_state'].params, want, n=2 * 400)


def test_a_wrapped_algorithm_compiles_with_its_inner_round():
  data, params = _data(), linreg_params()
  cohort = make_cohort(data, batch_size=B)
  tuner = algos.hypergradient_tuner(
      algos.fedavg(linreg_loss), linreg_loss,
      tune='server_optimizer/learning_rate')
  state0 = tuner.init(params)
  want, _ = tuner.round(copy(state0), cohort, KEY)
  kept = tuner.compile(map_strategy='sequential', donate=False)
  got, metrics = kept.round(state0, cohort, KEY)
  kept.round(state0, cohort, KEY)  # Not donated.
  # The same per-client float32 work; only the order of the C-term
  # reductions may differ.
  assert_trees_close(got.inner.params, want.inner.params, n=400)
  np.testing.assert_allclose(
      metrics['hparams/server_optimizer/learning_rate'],
      want.inner.hparams['server_optimizer']['learning_rate'], rtol=ft.rtol(400))


def test_hyperparameters_two_parts_share_are_refused_in_one_line():
  """A client transform's ``clip_norm`` next to a DP aggregator's.

  Both would be ``state.hparams['clip_norm']``, one value for two parts
  (0.001 silently replaced by 5.0): init refuses, naming both parts.
  """
  loss = lambda p, b: (b['x'] @ p['w'] - b['y']) ** 2
  clip = optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=0.001)
  algo = algos.fedavg(
      loss, client_transform=optax.inject_hyperparams(
          lambda clip_norm: optax.clip_by_global_norm(clip_norm))(clip_norm=0.001),
      aggregator=aggregators.gaussian(clip_norm=5.0, noise_multiplier=0.0))
  with pytest.raises(ValueError) as info:
    algo.init({'w': jnp.zeros(3)})
  message = str(info.value)
  assert '\n' not in message
  assert message.startswith("fedavg: state.hparams['clip_norm'] would be set by both "
                            'the client transform and the aggregator')
  # Distinct names combine as before.
  ok = algos.fedavg(loss, client_transform=clip,
                         aggregator=aggregators.gaussian(5.0, 0.0))
  hparams = ok.init({'w': jnp.zeros(3)}).hparams
  assert float(hparams['max_norm']) == pytest.approx(0.001)
  assert float(hparams['clip_norm']) == 5.0
