"""Models: parameter counts, losses against NumPy, causality, dropout keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjx import models

import float_tolerance as ft


def _np_cross_entropy(logits, labels):
  logits = np.asarray(logits, np.float64)
  z = logits - logits.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, labels[..., None], -1)[..., 0]


def _random_params(model, batch, seed=0):
  """Parameters of the model's shapes drawn with NumPy (cheaper than compiling init)."""
  shapes = jax.eval_shape(model.init, jax.random.key(0), batch)
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


def test_softmax_cross_entropy_and_accuracy_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(7, 5)).astype(np.float32) * 3
  labels = rng.integers(0, 5, size=7)
  # logsumexp of 5 logits minus one: about 8 roundings, each relative to the
  # magnitudes involved (at most 2 max|z| + log 5), not to the (small) result.
  np.testing.assert_allclose(models.softmax_cross_entropy(logits, labels),
                             _np_cross_entropy(logits, labels), rtol=0,
                             atol=ft.atol(8, 2 * np.abs(logits).max() + np.log(5)))
  np.testing.assert_array_equal(models.accuracy(logits, labels),
                                (logits.argmax(-1) == labels).astype(np.float32))


def test_emnist_cnn_has_the_paper_s_parameter_count():
  model = models.emnist_cnn()
  batch = {'x': jnp.zeros((2, 28, 28, 1)), 'y': jnp.zeros((2,), jnp.int32)}
  params = jax.jit(model.init)(jax.random.key(0), batch)
  # conv 3*3*1*32+32, conv 3*3*32*64+64, dense 12*12*64*128+128, dense 128*62+62.
  assert model.num_params(params) == 320 + 18_496 + 1_179_776 + 7_998
  assert jax.jit(model.loss_fn)(params, batch).shape == (2,)


def test_logistic_regression_loss_is_the_numpy_softmax_regression():
  model = models.logistic_regression(num_classes=4)
  rng = np.random.default_rng(1)
  batch = {'x': rng.normal(size=(6, 3, 2)).astype(np.float32),
           'y': rng.integers(0, 4, size=6).astype(np.int32)}
  params = jax.jit(model.init)(jax.random.key(1), batch)
  w = np.asarray(params['linear']['kernel'])
  b = np.asarray(params['linear']['bias'])
  logits = batch['x'].reshape(6, -1) @ w + b
  # 6 products and the bias, then the cross entropy (8): n = 15 roundings
  # relative to the magnitudes sum |x w| + |b| of the logits.
  magnitude = np.abs(batch['x'].reshape(6, -1)) @ np.abs(w) + np.abs(b)
  np.testing.assert_allclose(model.loss_fn(params, batch),
                             _np_cross_entropy(logits, batch['y']), rtol=0,
                             atol=ft.atol(15, 2 * magnitude.max() + np.log(4)))
  np.testing.assert_array_equal(model.metrics_fn(params, batch)['accuracy'],
                                logits.argmax(-1) == batch['y'])


def test_mlp_gradients_are_finite_and_dropout_is_keyed_by_the_batch():
  model = models.mlp(num_classes=3, hidden=(8,), dropout_rate=0.5)
  batch = {'x': jnp.ones((4, 5)), 'y': jnp.array([0, 1, 2, 0])}
  params = jax.jit(model.init)(jax.random.key(0), batch)
  loss_fn = jax.jit(model.loss_fn)
  loss = loss_fn(params, batch)
  np.testing.assert_array_equal(loss, loss_fn(params, batch))  # Deterministic.
  other = dict(batch, x=batch['x'] * 2)
  assert not np.allclose(loss_fn(params, other),
                         jax.jit(model.eval_loss_fn)(params, other))
  grads = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch).mean()))(params)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_batch_rng_differs_between_batches():
  a = {'x': jnp.zeros((2, 3))}
  b = {'x': jnp.zeros((2, 3)).at[1, 2].set(1.0)}
  ka, kb = models.batch_rng(a), models.batch_rng(b)
  assert not np.array_equal(jax.random.key_data(ka), jax.random.key_data(kb))
  np.testing.assert_array_equal(jax.random.key_data(ka),
                                jax.random.key_data(models.batch_rng(a)))


def test_resnet_shapes_and_resnet18_size():
  model = models.resnet(num_classes=10, widths=(4, 8, 8))
  batch = {'x': jnp.zeros((2, 8, 8, 3)), 'y': jnp.zeros((2,), jnp.int32)}
  params = _random_params(model, batch)
  assert jax.jit(model.apply)(params, batch['x']).shape == (2, 10)
  r18 = models.resnet(num_classes=100, stage_sizes=(2, 2, 2, 2),
                      widths=(64, 128, 256, 512))
  shapes = jax.eval_shape(r18.init, jax.random.key(0), batch)
  # ResNet-18 for CIFAR with GroupNorm: about 11.2M parameters.
  assert 11.1e6 < r18.num_params(shapes) < 11.3e6


@pytest.mark.parametrize('builder', [
    lambda: models.transformer_lm(vocab_size=11, max_len=8, width=16, num_heads=2),
    lambda: models.lstm_lm(vocab_size=11, embed_size=4, hidden=(8,)),
])
def test_language_models_are_causal_and_ignore_padding(builder):
  model = builder()
  tokens = jnp.array([[3, 4, 5, 6, 7, 8, 9, 1], [2, 2, 2, 2, 2, 2, 2, 2]])
  params = _random_params(model, {'x': tokens})
  apply = jax.jit(model.apply)
  loss_fn = jax.jit(model.loss_fn)
  logits = apply(params, tokens)
  changed = apply(params, tokens.at[:, 5].set(10))
  # Masked positions enter the earlier ones' sums with weight exactly 0; any
  # difference is reordering, within 2 gamma_n of the logits' scale with n the
  # terms of the longest chain (2 layers of width 64, attention over 8, 256
  # outputs): n < 1000.
  np.testing.assert_allclose(logits[:, :5], changed[:, :5], rtol=0,
                             atol=ft.atol(1000, float(jnp.max(jnp.abs(logits)))))
  assert not np.allclose(logits[:, 5:], changed[:, 5:])
  # {'x': tokens} without 'y' predicts tokens[1:] from tokens[:-1].
  shifted = {'x': tokens[:, :-1], 'y': tokens[:, 1:]}
  np.testing.assert_allclose(loss_fn(params, {'x': tokens}),
                             loss_fn(params, shifted), rtol=ft.rtol(1000))
  # The loss is the mean over non-pad targets (pad id 0).
  y = tokens[:, 1:].at[0, 3:].set(0)
  per_token = _np_cross_entropy(apply(params, tokens[:, :-1]), np.asarray(y))
  want = [(per_token[0, :3]).mean(), per_token[1].mean()]
  # The model's own logits, then a 256-way cross entropy and a mean of <= 7.
  np.testing.assert_allclose(loss_fn(params, {'x': tokens[:, :-1], 'y': y}),
                             want, rtol=ft.rtol(256 + 8))
