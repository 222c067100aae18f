"""DiLoCo with a 1-outer-step overlap: eager and delayed outer updates.

Kale, Douillard and Donchev 2025 (arXiv 2502.12996). Replica ``m`` steps on
the average sent one round earlier, ``Delta^(t-1)`` (``'delayed'``), or on
that average with its own stale term made fresh,
``Delta^(t-1) + c_m^(t) - c_m^(t-1)`` with ``c_m = (w_m / sum_k w_k)
Delta_m`` (``'eager'``; ``1/M`` for equal weights). The oracle is the
algorithm written out as a float64 NumPy loop (plain SGD inner steps on
least squares, outer Nesterov SGD, one outer model and optimizer state per
replica).

Tolerance: fedjx runs in float32. Per round each parameter goes through
about 50 roundings (per inner step: a length-3 dot product, the residual,
a batch sum of 4, the mean and the SGD update, about 12, times 3 steps;
the outer gradient; the share ``w_m / W`` times it; the sum over at most 3
replicas; the eager correction's two additions; the Nesterov trace and
update), so 5 rounds chain about 250; the shared ``CHAIN = 400``
(``assert_trees_close``: ``2 gamma_400``, relative to the leaf's largest
magnitude) leaves room for the outer step's gain (``0.7 (1 + 0.9)``) on
the error it is handed.
"""

import jax
import ml_collections
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.experiments import network
from fedjx.experiments import network_clock
from test_algorithms_util import KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

B = 4
LR = 0.05
H = 3
ROUNDS = 5


def _data(sizes):
  return linreg_data(np.random.default_rng(43), sizes, shift=2.0)


def _grad(p, batch):
  """Gradient of the batch's mean of ``0.5 (x w + b - y)^2``, float64."""
  r = batch['x'] @ p['w'] + p['b'] - batch['y']
  return {'w': batch['x'].T @ r / len(r), 'b': np.mean(r)}


def _oracle(data, outer_update, weights):
  """The paper's schedule in NumPy: the replicas' models and the last average."""
  m = len(data)
  x0 = {k: np.asarray(v, np.float64) for k, v in linreg_params().items()}
  thetas = [dict(x0) for _ in range(m)]
  traces = [{k: np.zeros_like(v) for k, v in x0.items()} for _ in range(m)]
  zero = {k: np.zeros_like(v) for k, v in x0.items()}
  in_flight, shares = dict(zero), [dict(zero) for _ in range(m)]
  batches = [[{k: np.asarray(v[i:i + B], np.float64) for k, v in d.items()}
              for i in range(0, len(d['y']), B)] for d in data]
  frac = np.asarray(weights, np.float64) / np.sum(weights)
  for r in range(ROUNDS):
    new_shares = []
    for k, bs in enumerate(batches):
      y = dict(thetas[k])
      for t in range(H):  # inner_steps=H cycles through the real steps.
        g = _grad(y, bs[t % len(bs)])
        y = {n: v - LR * g[n] for n, v in y.items()}
      new_shares.append({n: frac[k] * (thetas[k][n] - y[n]) for n in y})
    average = {n: sum(s[n] for s in new_shares) for n in x0}
    for k in range(m):
      if outer_update == 'eager':
        g = {n: in_flight[n] - shares[k][n] + new_shares[k][n] for n in x0}
      elif r == 0:  # 'delayed': nothing has arrived in the first round.
        continue
      else:
        g = in_flight
      for n in x0:
        traces[k][n] = g[n] + 0.9 * traces[k][n]
        thetas[k][n] = thetas[k][n] - 0.7 * (g[n] + 0.9 * traces[k][n])
    in_flight, shares = average, new_shares
  stacked = {n: np.stack([t[n] for t in thetas]) for n in x0}
  return stacked, in_flight


def _run(data, rounds=ROUNDS, **kw):
  algo = algos.eager_diloco(linreg_loss, len(data), inner_steps=H,
                            inner_optimizer=optax.sgd(LR), **kw)
  state = algo.init(linreg_params())
  cohort = make_cohort(data, batch_size=B)
  for _ in range(rounds):
    state, metrics = algo.round(state, cohort, KEY)
  return state, metrics


@pytest.mark.parametrize('sizes,outer_update,weighting', [
    ([8, 4], 'eager', 'num_examples'),
    ([8, 4, 4], 'eager', 'num_examples'),
    ([8, 4, 4], 'eager', 'uniform'),
    ([8, 4, 4], 'delayed', 'num_examples'),
    ([8, 4], 'delayed', 'uniform'),
])
def test_matches_numpy_oracle(sizes, outer_update, weighting):
  data = _data(sizes)
  state, metrics = _run(data, outer_update=outer_update, weighting=weighting)
  weights = sizes if weighting == 'num_examples' else [1.0] * len(sizes)
  thetas, average = _oracle(data, outer_update, weights)
  assert_trees_close(state.extras['replica_params'], thetas)
  assert_trees_close(state.params, jax.tree.map(lambda t: t.mean(0), thetas))
  assert_trees_close(state.extras['in_flight'], average)
  assert int(state.round_index) == ROUNDS
  assert float(metrics['clients']) == len(sizes)
  if outer_update == 'delayed':  # One model for all.
    for leaf in jax.tree.leaves(state.extras['replica_params']):
      np.testing.assert_array_equal(np.asarray(leaf)[1:], np.asarray(leaf)[:-1])


@pytest.mark.parametrize('weighting', ['uniform', 'num_examples'])
def test_one_eager_replica_is_diloco(weighting):
  # M = 1: the eager step is Delta_1^(t), DiLoCo's outer gradient.
  data = _data([8])
  cohort = make_cohort(data, batch_size=B)
  kw = dict(inner_steps=H, weighting=weighting,
            inner_optimizer=optax.adamw(1e-2, weight_decay=0.1))
  eager = algos.eager_diloco(linreg_loss, 1, **kw)
  plain = algos.diloco(linreg_loss, 1, **kw)
  a, b = eager.init(linreg_params()), plain.init(linreg_params())
  for _ in range(4):
    a, ma = eager.round(a, cohort, KEY)
    b, mb = plain.round(b, cohort, KEY)
  trace_a = jax.tree.map(lambda t: t[0], a.opt_state.inner_state[0].trace)
  trace_b = b.opt_state.inner_state[0].trace
  if weighting == 'uniform':  # Bit for bit: the mean of one is the message itself.
    for x, y in ((a.params, b.params), (trace_a, trace_b),
                 (jax.tree.map(lambda t: t[0], a.extras['replica_params']), b.params)):
      for n in ('w', 'b'):
        np.testing.assert_array_equal(np.asarray(x[n]), np.asarray(y[n]))
    assert float(ma['pseudo_grad_norm']) == float(mb['pseudo_grad_norm'])
  else:
    # DiLoCo's mean of one is (n x) / n, the eager share (n / n) x: each
    # round's outer gradient one rounding (u) apart, carried by 4 rounds.
    assert_trees_close(a.params, b.params, n=16)
    assert_trees_close(trace_a, trace_b, n=16)
  assert float(ma['communicated_bytes']) == float(mb['communicated_bytes'])


def test_delayed_takes_no_outer_step_in_the_first_round():
  data = _data([8, 4, 4])
  state, _ = _run(data, rounds=1, outer_update='delayed')
  for leaf, want in zip(jax.tree.leaves(state.extras['replica_params']),
                        jax.tree.leaves(linreg_params())):
    np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(want, leaf.shape))
  counts = jax.tree.leaves(state.opt_state.inner_state[0].trace)
  assert all(not np.any(np.asarray(c)) for c in counts)
  assert np.any(np.asarray(state.extras['in_flight']['w']))  # Sent, not yet applied.


def test_eager_replicas_differ_only_by_their_latest_share():
  # Outer SGD with learning rate 1: the steps telescope, theta_m^(T) =
  # theta^(0) - sum_{t<T} Delta^(t) - c_m^(T); replicas differ by c_k - c_m.
  data = _data([8, 4, 4])
  state, _ = _run(data, outer_optimizer=optax.sgd(1.0))
  leaves = jax.tree.leaves(state.extras['replica_params'])
  shares = jax.tree.leaves(state.extras['own_share'])
  for theta, share in zip(leaves, shares):
    theta, share = np.asarray(theta, np.float64), np.asarray(share, np.float64)
    np.testing.assert_allclose(theta - theta[0], share[0] - share,
                               atol=1e-5 * np.max(np.abs(theta)))


def test_bytes_are_diloco_s_and_quantized_messages_are_counted():
  data = _data([8, 4, 4])
  cohort = make_cohort(data, batch_size=B)
  for fmt in ('float32', 'int8'):
    kw = dict(inner_steps=H, inner_optimizer=optax.sgd(LR), quantization_format=fmt)
    _, me = algos.eager_diloco(linreg_loss, 3, **kw).round(
        algos.eager_diloco(linreg_loss, 3, **kw).init(linreg_params()), cohort, KEY)
    _, md = algos.diloco(linreg_loss, 3, **kw).round(
        algos.diloco(linreg_loss, 3, **kw).init(linreg_params()), cohort, KEY)
    assert float(me['communicated_bytes']) == float(md['communicated_bytes']) > 0


def test_quantized_eager_removes_exactly_the_stale_message():
  # With int8 messages the shares are quantized; the oracle's eager step on
  # the same messages: Delta^(t-1) - c_m^(t-1) + c_m^(t).
  data = _data([8, 4])
  algo = algos.eager_diloco(linreg_loss, 2, inner_steps=H, quantization_format='int8',
                            inner_optimizer=optax.sgd(LR),
                            outer_optimizer=optax.sgd(1.0))
  state = algo.init(linreg_params())
  cohort = make_cohort(data, batch_size=B)
  state, _ = algo.round(state, cohort, KEY)
  before = jax.tree.map(np.asarray, state)
  state, _ = algo.round(state, cohort, KEY)
  for n in ('w', 'b'):  # theta_m <- theta_m - g_m (outer SGD, learning rate 1).
    g = before.extras['in_flight'][n] - before.extras['own_share'][n] + np.asarray(state.extras['own_share'][n])
    np.testing.assert_allclose(np.asarray(state.extras['replica_params'][n]),
                               before.extras['replica_params'][n] - g, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('kw,words', [
    (dict(outer_update='lazy'), ["outer_update='lazy'", "('eager', 'delayed')"]),
    (dict(outer_update=True), ['outer_update=True', "('eager', 'delayed')"]),
    (dict(quantization_format='int3'), ["quantization_format='int3'"]),
    (dict(num_replicas=0), ['num_replicas=0']),
    (dict(unknown=1), ['option unknown=1', "'inner_steps'"]),
])
def test_bad_options_name_the_argument_value_and_what_is_allowed(kw, words):
  kw = dict(dict(num_replicas=2), **kw)
  with pytest.raises(ValueError) as e:
    algos.eager_diloco(linreg_loss, **kw)
  assert str(e.value).startswith('eager_diloco: ')
  for w in words:
    assert w in str(e.value)


def test_the_clock_hides_the_all_reduce_behind_the_next_inner_phase():
  config = ml_collections.ConfigDict(dict(
      algorithm=dict(name='eager_diloco'), local_steps=16,
      network=dict(inner_steps=None, overlap_fraction=0.0, layers=None)))
  knobs = network_clock.schedule_knobs(config)
  assert (knobs['schedule'], knobs['inner_steps'], knobs['fragments'],
          knobs['overlap_steps'], knobs['rounds_per_schedule']) == (
              'streaming_diloco', 16, 1, 16.0, 1)
  schedule = network.Schedule.streaming_diloco(16, 1, 16)
  net = network.Network(network.Link.gbps(1.0), 'ring')
  compute = network.Compute.from_step_seconds(0.1)
  for payload in (1e6, 1e9):  # Hidden; then exposed by what exceeds H T.
    full = net.allreduce_seconds(payload, 4)
    timing = network.simulate(schedule, compute, net, payload, 4)
    assert timing.exposed_seconds == pytest.approx(max(0.0, full - 16 * 0.1))
  with pytest.raises(ValueError, match='overlap_steps=5 must be < inner_steps=4'):
    network.Schedule.streaming_diloco(4, 2, 5)
