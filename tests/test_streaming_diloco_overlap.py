"""Streaming DiLoCo's overlap of communication with computation (``tau``).

Douillard et al. 2025 (arXiv 2501.18512), Algorithm 1: the fragment sent at
the end of round ``r`` is merged into each replica ``tau`` inner steps
later, into the replica's fragment as trained by then,
``theta_k^p <- alpha theta_k^p(t + tau) + (1 - alpha) theta^p``. The oracle
is the algorithm written out as a float64 NumPy loop (plain SGD inner steps
on least squares, P = 2 fragments, outer Nesterov SGD).

Tolerance: fedjx runs in float32. Per round each parameter goes through
about 50 roundings (per inner step: a length-3 dot product, the residual,
a batch sum of 4, the mean and the SGD update, about 12, times 3 steps; the
merge; the outer gradient's weighted sum over 3 replicas, the momentum and
the update), so 5 rounds chain about 250; the shared ``CHAIN = 400``
(``assert_trees_close``: ``2 gamma_400``, relative to the leaf's largest
magnitude) leaves room for the outer step's gain (``0.7 (1 + 0.9)``) on
the error it is handed.
"""

import jax
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx import datasets
from fedjx.indexed import IndexedBatches
from test_algorithms_util import KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort
from test_algorithms_util import stack_cohorts

SIZES = [8, 4, 4]  # Three replicas; batches of 4: 2, 1 and 1 real steps.
B = 4
LR = 0.05
ROUNDS = 5


def _data():
  return linreg_data(np.random.default_rng(41), SIZES, shift=2.0)


def _grad(p, batch):
  """Gradient of the batch's mean of ``0.5 (x w + b - y)^2``, float64."""
  r = batch['x'] @ p['w'] + p['b'] - batch['y']
  return {'w': batch['x'].T @ r / len(r), 'b': np.mean(r)}


def _oracle(data, tau, alpha, inner_steps):
  """The paper's schedule in NumPy: returns the global and replica models."""
  x = {k: np.asarray(v, np.float64) for k, v in linreg_params().items()}
  reps = [dict(x) for _ in SIZES]
  traces = {k: np.zeros_like(v) for k, v in x.items()}
  batches = [[{k: np.asarray(v[i:i + B], np.float64) for k, v in d.items()}
              for i in range(0, len(d['y']), B)] for d in data]
  frags = ['b', 'w']  # Strided over the leaves in order: 'b', then 'w'.
  s = inner_steps or max(len(bs) for bs in batches)
  for r in range(ROUNDS):
    for k, bs in enumerate(batches):
      for t in range(s + 1):
        if t == tau and r > 0:  # The fragment sent last round arrives.
          q = frags[(r - 1) % 2]
          reps[k][q] = alpha * reps[k][q] + (1 - alpha) * x[q]
        if t == s:
          break
        if inner_steps is None and t >= len(bs):
          continue  # Padding: the replica's data ends here.
        g = _grad(reps[k], bs[t % len(bs)])
        reps[k] = {n: v - LR * g[n] for n, v in reps[k].items()}
    p = frags[r % 2]  # Sent now; the replicas merge it next round.
    g = sum(n * (x[p] - rep[p]) for n, rep in zip(SIZES, reps)) / sum(SIZES)
    traces[p] = g + 0.9 * traces[p]
    x[p] = x[p] - 0.7 * (g + 0.9 * traces[p])
  return x, {n: np.stack([rep[n] for rep in reps]) for n in x}


def _run(cohort, **kw):
  algo = algos.streaming_diloco(
      linreg_loss, len(SIZES), num_fragments=2, quantization_format='float32',
      inner_optimizer=optax.sgd(LR), **kw)
  state = algo.init(linreg_params())
  for _ in range(ROUNDS):
    state, metrics = algo.round(state, cohort, KEY)
  return state, metrics


@pytest.mark.parametrize('tau,alpha,inner_steps', [
    (1, 0.0, 3), (2, 0.5, 3), (3, 0.5, 3),  # tau = S: just before the outer step.
    (1, 0.5, None),  # S = the cohort's 2 steps; replicas 1, 2 pad their second.
])
def test_overlap_matches_numpy_oracle(tau, alpha, inner_steps):
  data = _data()
  state, metrics = _run(make_cohort(data, batch_size=B), mixing_factor=alpha,
                        overlap_steps=tau, inner_steps=inner_steps)
  x, reps = _oracle(data, tau, alpha, inner_steps)
  # params hold every outer step, the last one's too; the replicas' models lack the
  # merge of the last fragment sent (it would come tau steps into round 6).
  assert_trees_close(state.params, x)
  assert_trees_close(state.extras, reps)
  assert int(metrics['synced_fragment']) == (ROUNDS - 1) % 2
  assert np.isfinite(float(metrics['train_loss_after']))


def test_no_overlap_is_bit_equal_to_the_default():
  # tau = 0, alpha = 0 (the defaults) against the option absent, int4 messages.
  cohort = make_cohort(_data(), batch_size=B)
  kw = dict(quantization_format='int4', inner_steps=3,
            inner_optimizer=optax.sgd(LR))
  plain = algos.streaming_diloco(linreg_loss, len(SIZES), **kw)
  zero = algos.streaming_diloco(linreg_loss, len(SIZES), overlap_steps=0,
                                mixing_factor=0.0, **kw)
  a, b = plain.init(linreg_params()), zero.init(linreg_params())
  for _ in range(4):
    a, ma = plain.round(a, cohort, KEY)
    b, mb = zero.round(b, cohort, KEY)
    for n in ('w', 'b'):
      np.testing.assert_array_equal(np.asarray(a.params[n]), np.asarray(b.params[n]))
      np.testing.assert_array_equal(np.asarray(a.extras[n]),
                                    np.asarray(b.extras[n]))
    np.testing.assert_array_equal(np.asarray(ma['train_loss_after']),
                                  np.asarray(mb['train_loss_after']))


@pytest.mark.slow
def test_overlap_on_an_indexed_cohort_equals_the_host_cohort():
  # A gather copies values exactly: the same float32 operations, bit-equal.
  data = _data()
  host = datasets.from_arrays(
      {k: np.concatenate([d[k] for d in data]) for k in ('x', 'y')},
      groups=np.repeat(np.arange(len(SIZES)), SIZES))
  ids = np.arange(len(SIZES))
  want = datasets.make_cohort(host, ids, B)
  got = datasets.make_cohort(datasets.on_device(host), ids, B)
  assert isinstance(got.batches, IndexedBatches)
  # inner_steps=3: the index of the scheduled steps is gathered.
  a, _ = _run(want, overlap_steps=1, mixing_factor=0.5, inner_steps=3)
  b, _ = _run(got, overlap_steps=1, mixing_factor=0.5, inner_steps=3)
  for n in ('w', 'b'):
    np.testing.assert_array_equal(np.asarray(a.params[n]), np.asarray(b.params[n]))


@pytest.mark.slow
def test_overlap_scanned_guarded_and_sequential_is_the_round():
  # run_rounds (a lax.scan over rounds), skip_nonfinite and the sequential
  # map: the same per-replica float32 operations; only the order of the sums
  # over the 3 replicas may differ, well within the bound of the docstring.
  cohort = make_cohort(_data(), batch_size=B)
  want, _ = _run(cohort, overlap_steps=2, mixing_factor=0.5)
  algo = algos.streaming_diloco(
      linreg_loss, len(SIZES), num_fragments=2, quantization_format='float32',
      inner_optimizer=optax.sgd(LR), overlap_steps=2, mixing_factor=0.5,
      skip_nonfinite=True).compile(map_strategy='sequential', donate=False)
  got, _ = algo.run_rounds(algo.init(linreg_params()),
                           stack_cohorts([cohort] * ROUNDS),
                           jax.random.split(KEY, ROUNDS))
  assert_trees_close(got.params, want.params)
  assert_trees_close(got.extras, want.extras)


@pytest.mark.parametrize('tau', [-1, 4, 1.5, True, '2'])
def test_bad_overlap_steps_raise(tau):
  with pytest.raises(ValueError, match=rf"overlap_steps={tau!r} is not allowed; "
                     r"it must be an int tau with 0 <= tau <= S.*inner_steps=3"):
    algos.streaming_diloco(linreg_loss, 2, overlap_steps=tau, inner_steps=3)


def test_overlap_beyond_the_cohort_steps_raises_at_the_round():
  # inner_steps None: S is the cohort's 2 steps, known at the first round.
  algo = algos.streaming_diloco(linreg_loss, len(SIZES), overlap_steps=3)
  with pytest.raises(ValueError, match=r"overlap_steps=3 is not allowed.*"
                     r"the cohort's steps per round, inner_steps being None: 2"):
    algo.round(algo.init(linreg_params()), make_cohort(_data(), batch_size=B),
               KEY)
