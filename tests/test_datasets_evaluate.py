"""``fedjx.datasets.evaluate``: masked, example-weighted means against NumPy.

The reference is the plain mean over the ``n`` examples in float64,
``mean(v) = sum_i v_i / n``, of the same per-example function written in
NumPy. fedjx sums ``n`` float32 terms per leaf (batch sums, then the sum over
batches): the two agree within ``2 gamma_n sum_i |v_i| / n`` plus the
float32 rounding of each ``v_i`` itself (a softmax cross entropy of 10
logits of a ``D``-feature linear model: a dot product of ``D`` terms and a
log-sum-exp of 10; bounded here by ``gamma_{D + 10}`` of the magnitudes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float_tolerance as ft
from fedjx import datasets
from fedjx import models

D, K = 12, 10


def _examples(n, seed=0):
  rng = np.random.default_rng(seed)
  return {'x': rng.normal(size=(n, D)).astype(np.float32),
          'y': rng.integers(0, K, size=n).astype(np.int32)}


def _params(seed=1):
  rng = np.random.default_rng(seed)
  return {'w': rng.normal(size=(D, K)).astype(np.float32),
          'b': rng.normal(size=K).astype(np.float32)}


def _metrics(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  loss = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
      logits, batch['y'][:, None], axis=-1)[:, 0]
  return {'loss': loss, 'accuracy': jnp.argmax(logits, -1) == batch['y']}


def _numpy_metrics(params, examples):
  logits = examples['x'].astype(np.float64) @ params['w'] + params['b']
  top = logits.max(-1, keepdims=True)
  lse = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
  loss = lse - logits[np.arange(len(logits)), examples['y']]
  return {'loss': loss, 'accuracy': (logits.argmax(-1) == examples['y']).astype(np.float64)}


@pytest.mark.parametrize('n, batch_size', [(1, 4), (37, 8), (64, 16), (100, 256)])
def test_the_means_are_numpy_s_over_every_example(n, batch_size):
  examples, params = _examples(n), _params()
  got = datasets.evaluate(_metrics, params, examples, batch_size=batch_size)
  want = _numpy_metrics(params, examples)
  assert set(got) == {'loss', 'accuracy'}
  assert all(isinstance(v, float) for v in got.values())
  # The accuracy is a count of 0/1 terms: exact in float32 up to 2**24.
  assert got['accuracy'] == pytest.approx(want['accuracy'].mean(), abs=1e-12)
  # The loss: each term's own float32 rounding, then a sum of n terms.
  magnitude = np.abs(want['loss']).mean()
  tol = ft.atol(n, magnitude) + 4 * ft.gamma(D + K) * (
      1 + np.abs(examples['x']).sum(-1).max() * np.abs(params['w']).max())
  np.testing.assert_allclose(got['loss'], want['loss'].mean(), rtol=0, atol=tol)


def test_padding_rows_count_for_nothing_even_as_nan():
  # 1 / x[0] is inf on the zero rows that pad the last batch; the real rows
  # are all >= 1, so a mean that let a padded row in would not be finite.
  examples = {'x': np.arange(1.0, 8.0, dtype=np.float32)}
  got = datasets.evaluate(lambda p, b: p / b['x'], 1.0, examples, batch_size=3)
  np.testing.assert_allclose(got, np.mean(1.0 / np.arange(1.0, 8.0)), rtol=ft.rtol(7) + 1e-7)


def test_a_model_s_functions_are_evaluated_as_the_runner_evaluates_them():
  train, test = datasets.load_digits(num_clients=5, seed=0)
  model = models.logistic_regression(num_classes=10)
  params = model.init(jax.random.key(0), {k: v[:2] for k, v in test.items()})
  got = datasets.evaluate(model.metrics_fn, params, test, batch_size=50)
  loss = datasets.evaluate(model.eval_loss_fn, params, test, batch_size=50)
  accuracy = np.asarray(model.metrics_fn(params, test)['accuracy'], np.float64)
  assert got == {'accuracy': pytest.approx(accuracy.mean(), abs=1e-12)}
  losses = np.asarray(model.eval_loss_fn(params, test), np.float64)
  np.testing.assert_allclose(loss, losses.mean(), rtol=ft.rtol(len(losses)))
  del train


def test_the_same_function_is_compiled_once_and_results_repeat():
  examples, params = _examples(40), _params()
  first = datasets.evaluate(_metrics, params, examples, batch_size=16)
  size = datasets.evaluation._masked_sums._cache_size()  # pylint: disable=protected-access
  assert datasets.evaluate(_metrics, params, examples, batch_size=16) == first
  assert datasets.evaluation._masked_sums._cache_size() == size  # pylint: disable=protected-access


@pytest.mark.parametrize('examples, batch_size, match', [
    ({'x': np.zeros((0, 3), np.float32)}, 4, 'examples is empty'),
    ({'x': np.zeros((5, 3), np.float32)}, 0, 'batch_size=0'),
    ({'x': np.zeros((5, 3), np.float32)}, 2.0, 'batch_size=2.0'),
])
def test_bad_input_is_one_clear_error(examples, batch_size, match):
  with pytest.raises(ValueError, match=match):
    datasets.evaluate(lambda p, b: b['x'][:, 0], None, examples, batch_size=batch_size)


def test_an_output_that_is_not_one_value_per_example_is_named():
  examples = {'x': np.zeros((5, 3), np.float32)}
  with pytest.raises(ValueError, match=r"shape \(2, 3\) at \['x'\].*shape \(2,\)"):
    datasets.evaluate(lambda p, b: {'x': b['x']}, None, examples, batch_size=2)
