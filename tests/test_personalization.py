"""Personalization evaluation and per-client splits against NumPy float64 loops."""

import math

import jax
import numpy as np
import optax
import pytest

from fedjx import algorithms, datasets, models
from fedjx.experiments import personalization

DIM, CLASSES, BATCH = 4, 3, 2
SIZES = [7, 5, 9, 1, 6, 4]  # Client 3 holds one example: left out of the split.


def _population(sizes=SIZES, seed=0):
  rng = np.random.default_rng(seed)
  n = sum(sizes)
  arrays = {'x': rng.normal(size=(n, DIM)).astype(np.float32),
            'y': rng.integers(0, CLASSES, n).astype(np.int32)}
  bounds = np.cumsum([0] + list(sizes))
  groups = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
  return datasets.from_arrays(arrays, groups=groups,
                              names=[f'c{i}' for i in range(len(sizes))])


def _softmax(z):
  z = z - z.max(axis=1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=1, keepdims=True)


def _grad(w, b, x, y):
  """Gradient of the mean softmax cross-entropy of ``x @ w + b`` (float64)."""
  p = _softmax(x @ w + b)
  p[np.arange(len(y)), y] -= 1.0
  return x.T @ p / len(y), p.sum(0) / len(y)


def _metrics(w, b, data):
  x, y = data['x'].astype(np.float64), data['y']
  p = _softmax(x @ w + b)
  return (float(np.mean(-np.log(p[np.arange(len(y)), y]))),
          float(np.mean(np.argmax(x @ w + b, 1) == y)))


def _batches(data):
  n = len(data['y'])
  return [(data['x'][i:i + BATCH].astype(np.float64), data['y'][i:i + BATCH])
          for i in range(0, n, BATCH)]


def _setup():
  model = models.logistic_regression(CLASSES)
  pop = _population()
  splits = datasets.client_splits(pop, test_fraction=0.3, seed=1)
  params = model.init(jax.random.key(0), {k: v[:BATCH] for k, v in
                                          splits.train.client_data(0).items()})
  state = algorithms.fedavg(model.loss_fn).init(params)
  w0 = np.asarray(params['linear']['kernel'], np.float64)
  b0 = np.asarray(params['linear']['bias'], np.float64)
  return model, splits, state, w0, b0


def test_client_splits_of_partitioned_data():
  pop = _population()
  splits = datasets.client_splits(pop, test_fraction=0.3, seed=1)
  np.testing.assert_array_equal(splits.base_ids, [0, 1, 2, 4, 5])
  for k, c in enumerate(splits.base_ids):
    n = SIZES[c]
    tr, te = splits.train.client_data(k), splits.test.client_data(k)
    assert len(te['y']) == min(max(round(0.3 * n), 1), n - 1)
    assert len(tr['y']) + len(te['y']) == n
    rows = lambda d: {tuple(r) for r in d['x'].tolist()}
    assert not rows(tr) & rows(te)
    assert rows(tr) | rows(te) == rows(pop.client_data(int(c)))
  again = datasets.client_splits(pop, test_fraction=0.3, seed=1)
  np.testing.assert_array_equal(again.test.client_data(2)['x'],
                                splits.test.client_data(2)['x'])


def test_client_splits_natural_match_by_name():
  train = _population([3, 4, 5], seed=0)
  test = datasets.from_arrays(
      {'x': np.arange(6, dtype=np.float32)[:, None] * np.ones((1, DIM), np.float32),
       'y': np.zeros(6, np.int32)},
      groups=[np.array([0, 1]), np.array([2, 3, 4]), np.array([5])],
      names=['c2', 'zz', 'c0'])
  splits = datasets.client_splits(train, test)
  np.testing.assert_array_equal(splits.base_ids, [0, 2])
  np.testing.assert_array_equal(splits.test.client_data(0)['x'][:, 0], [5])
  np.testing.assert_array_equal(splits.test.client_data(1)['x'][:, 0], [0, 1])
  np.testing.assert_array_equal(splits.train.client_data(1)['x'],
                                train.client_data(2)['x'])
  with pytest.raises(ValueError, match='natural splits match clients by name'):
    datasets.client_splits(train, test.subset([1]))


def test_distribution_against_hand_computed():
  v = np.array([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 1.0, 0.4, 0.6, 0.8, 0.0])
  s = np.sort(v)
  def pct(q):  # Linear interpolation between order statistics.
    pos = q / 100 * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (pos - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo])
  got = personalization.distribution(v)
  assert got['mean'] == pytest.approx(v.mean())
  for name, q in (('p10', 10), ('p25', 25), ('median', 50), ('p75', 75), ('p90', 90)):
    assert got[name] == pytest.approx(pct(q))
  assert got['worst10'] == pytest.approx((0.0 + 0.1) / 2)  # ceil(11 / 10) = 2.
  assert personalization.distribution(v, lower_is_worse=False)['worst10'] == \
      pytest.approx((1.0 + 0.9) / 2)


@pytest.mark.parametrize('schedule,strategy', [(dict(epochs=2), 'vmap'),
                                               (dict(steps=5), 'auto')])
def test_fine_tune_eval_against_numpy_sgd(schedule, strategy):
  model, splits, state, w0, b0 = _setup()
  lr = 0.5
  personalize = personalization.fine_tune(model.loss_fn, optax.sgd(lr), **schedule)
  result = personalization.personalization_eval(
      personalize, state, model, splits.train, splits.test, batch_size=BATCH,
      cohort_size=2, map_strategy=strategy)  # Five clients: blocks of 2, 2 and 1 + a padding client.
  np.testing.assert_array_equal(result.client_ids, np.arange(5))
  for k in range(5):
    batches = _batches(splits.train.client_data(k))
    order = (batches * schedule['epochs'] if 'epochs' in schedule else
             [batches[t % len(batches)] for t in range(schedule['steps'])])
    w, b = w0.copy(), b0.copy()
    for x, y in order:
      gw, gb = _grad(w, b, x, y)
      w, b = w - lr * gw, b - lr * gb
    test = splits.test.client_data(k)
    assert result.num_examples[k] == len(test['y'])
    loss, acc = _metrics(w, b, test)
    loss0, acc0 = _metrics(w0, b0, test)
    # float32 over a handful of steps of a 4x3 model: ~1e-6 relative.
    np.testing.assert_allclose(result.personal['loss'][k], loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.personal['accuracy'][k], acc, atol=1e-6)
    np.testing.assert_allclose(result.global_['loss'][k], loss0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.global_['accuracy'][k], acc0, atol=1e-6)
  summary = result.summary()
  assert summary['personal/accuracy_mean'] == pytest.approx(
      float(np.mean(result.personal['accuracy'])))
  assert summary['global/loss_worst10'] == pytest.approx(
      float(np.max(result.global_['loss'])))  # ceil(5 / 10) = 1 client.
  assert summary['personal/num_clients'] == 5


def test_stateful_personalize_reads_each_clients_row():
  model, splits, state, w0, b0 = _setup()
  rows = {c: {'kernel': np.full((DIM, CLASSES), 0.1 * (c + 1), np.float32),
              'bias': np.full(CLASSES, -0.2 * c, np.float32)} for c in range(5)}
  seen = []

  def read(ids):
    seen.append(np.asarray(ids).tolist())
    pick = [rows.get(int(c), {'kernel': np.zeros((DIM, CLASSES), np.float32),
                              'bias': np.zeros(CLASSES, np.float32)}) for c in ids]
    return jax.tree.map(lambda *x: np.stack(x), *pick)

  def personalize(server_state, row, train):
    del train
    p = server_state.params['linear']
    return {'linear': {'kernel': p['kernel'] + row['kernel'],
                       'bias': p['bias'] + row['bias']}}

  result = personalization.personalization_eval(
      personalize, state, model, splits.train, splits.test, batch_size=BATCH,
      client_ids=[4, 1, 3], client_states=read, cohort_size=2)
  assert seen == [[4, 1], [3, -1]]
  for k, c in enumerate([4, 1, 3]):
    loss, acc = _metrics(w0 + rows[c]['kernel'], b0 + rows[c]['bias'],
                         splits.test.client_data(c))
    np.testing.assert_allclose(result.personal['loss'][k], loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.personal['accuracy'][k], acc, atol=1e-6)


def test_errors_are_one_line():
  with pytest.raises(ValueError, match='give exactly one of steps'):
    personalization.fine_tune(lambda p, b: 0.0, optax.sgd(0.1))
  with pytest.raises(ValueError, match='steps=0; it must be an int >= 1'):
    personalization.fine_tune(lambda p, b: 0.0, optax.sgd(0.1), steps=0)
  with pytest.raises(ValueError, match='values is empty'):
    personalization.distribution([])
