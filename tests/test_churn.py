"""DiLoCo under churn: a seeded chaos run against a NumPy replay; resume; goodput."""

import functools

import jax
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.experiments import checkpointing
from fedjx.experiments import churn
from fedjx.experiments import network
from test_algorithms_util import KEY, assert_trees_close, copy, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

M = 4                   # Replicas.
SIZES = [8, 4, 8, 12]   # Examples per replica; batches of 4: 2, 1, 2, 3 real steps.
B = 4
H = 3                   # Inner steps, cycling through each replica's real steps.
ROUNDS = 6
INNER_LR, INNER_MU = 0.05, 0.9
OUTER_LR, OUTER_MU = 0.7, 0.9
CHAOS = dict(join=0.5, leave=0.3, fail=0.2, seed=3)


@functools.lru_cache(maxsize=None)
def _setup():
  """The data, the full cohort and DiLoCo (built once: one compilation)."""
  data = linreg_data(np.random.default_rng(41), SIZES, shift=2.0)
  cohort = make_cohort(data, batch_size=B)
  algo = algos.diloco(linreg_loss, M,
                      inner_optimizer=optax.sgd(INNER_LR, momentum=INNER_MU),
                      outer_learning_rate=OUTER_LR, outer_momentum=OUTER_MU,
                      inner_steps=H)
  return data, cohort, algo


def _run(algo, state, cohort, schedule, rounds):
  clients = []
  for r in rounds:
    state, metrics = algo.round(state, churn.round_cohort(cohort, schedule.round(r), M), KEY)
    clients.append(float(metrics['clients']))
  return state, clients


def _replay(data, schedule, rounds):
  """DiLoCo in float64 NumPy over each round's contributing replicas.

  Inner: SGD with momentum (trace <- g + mu trace; x <- x - lr trace), each
  replica's trace persisting across the rounds it contributes to; outer:
  Nesterov SGD on ``Delta = sum_C n_k (theta - theta_k) / sum_C n_k``.
  """
  p0 = linreg_params()
  theta = np.concatenate([np.asarray(p0['w'], np.float64),
                          [float(p0['b'])]])
  batches = []
  for d in data:
    x = np.concatenate([d['x'].astype(np.float64), np.ones((len(d['y']), 1))], 1)
    y = d['y'].astype(np.float64)
    batches.append([(x[i:i + B], y[i:i + B]) for i in range(0, len(y), B)])
  traces = [np.zeros_like(theta) for _ in range(M)]
  outer_trace = np.zeros_like(theta)
  for r in rounds:
    contributing = sorted(schedule.round(r).contributing)
    delta, weight = np.zeros_like(theta), 0.0
    for k in contributing:
      x_k = theta.copy()
      for t in range(H):
        x, y = batches[k][t % len(batches[k])]
        g = x.T @ (x @ x_k - y) / len(y)
        traces[k] = g + INNER_MU * traces[k]
        x_k = x_k - INNER_LR * traces[k]
      delta += SIZES[k] * (theta - x_k)
      weight += SIZES[k]
    delta /= weight
    outer_trace = delta + OUTER_MU * outer_trace
    theta = theta - OUTER_LR * (delta + OUTER_MU * outer_trace)
  return {'w': theta[:-1], 'b': theta[-1]}


def _equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               a, b)


def test_schedule_is_a_pure_function_of_seed_and_round():
  six = churn.seeded_schedule(M, ROUNDS, **CHAOS)
  assert churn.seeded_schedule(M, 3, **CHAOS).rounds == six.rounds[:3]
  assert churn.seeded_schedule(M, ROUNDS, **CHAOS) == six
  assert churn.seeded_schedule(M, ROUNDS, **dict(CHAOS, seed=4)) != six
  # The chaos run has joins, leaves and mid-round failures.
  assert any(r.joined for r in six.rounds[1:])
  assert any(r.left for r in six.rounds)
  assert any(r.failed for r in six.rounds)
  for r in six.rounds:
    assert r.contributing and r.failed <= r.present
  # No churn: everyone in every round; always failing: replica r mod M alone.
  assert all(r.present == set(range(M)) and not r.failed
             for r in churn.seeded_schedule(M, 3).rounds)
  lone = churn.seeded_schedule(M, 5, fail=1.0)
  assert [sorted(r.contributing) for r in lone.rounds] == [[0], [1], [2], [3], [0]]


def test_chaos_run_matches_numpy_replay_and_resumes_bit_for_bit(tmp_path):
  data, cohort, algo = _setup()
  schedule = churn.seeded_schedule(M, ROUNDS, **CHAOS)
  full, clients = _run(algo, algo.init(linreg_params()), cohort, schedule, range(ROUNDS))
  assert clients == [len(r.contributing) for r in schedule.rounds]
  # Float32 against float64: each round chains, per contributing replica,
  # H inner steps of about 13 rounded operations (a residual from a length-4
  # dot product, a mean over B = 4 examples, the momentum trace and the
  # parameter update, 2 each), then about 11 for the outer step (the
  # weighted mean over <= 4 replicas and its division, Nesterov's 4): n =
  # ROUNDS (13 H + 11) = 300, and the float32 run differs from the exact one
  # by at most gamma_n of the leaf's scale to first order
  # (float_tolerance.py); the 2 gamma_n of assert_trees_close leaves a factor
  # 2 for rounding errors of early rounds carried through later ones.
  assert_trees_close(full.params, _replay(data, schedule, range(ROUNDS)),
                     n=ROUNDS * (13 * H + 11))

  # Resume: 3 rounds, a checkpoint of the state, the schedule rebuilt from
  # its arguments (nothing of it is saved), 3 more rounds: the uninterrupted
  # run bit for bit.
  half, _ = _run(algo, algo.init(linreg_params()), cohort, schedule, range(3))
  saver = checkpointing.Checkpointer(str(tmp_path / 'checkpoints'), async_save=False)
  saver.save(3, half, {'round': 3})
  saver.close()
  restorer = checkpointing.Checkpointer(str(tmp_path / 'checkpoints'), async_save=False)
  restored, meta = restorer.restore(3, like=algo.init(linreg_params()))
  restorer.close()
  assert meta['round'] == 3
  resumed, _ = _run(algo, restored, cohort, churn.seeded_schedule(M, ROUNDS, **CHAOS),
                    range(3, ROUNDS))
  _equal(resumed, full)


def test_everyone_present_is_diloco_bit_for_bit():
  _, cohort, algo = _setup()
  schedule = churn.seeded_schedule(M, 2)
  kept = churn.round_cohort(cohort, schedule.round(0), M)
  _equal(kept, cohort)
  a = algo.init(linreg_params())
  b = copy(a)
  for r in range(2):
    a, _ = algo.round(a, churn.round_cohort(cohort, schedule.round(r), M), KEY)
    b, _ = algo.round(b, cohort, KEY)
  _equal(a, b)


def test_absent_and_failed_replicas_keep_their_inner_state():
  _, cohort, algo = _setup()
  schedule = churn.explicit_schedule(M, [{0, 1, 2, 3}, {0, 2, 3}, {0, 1, 2, 3}],
                                     failed=[set(), {3}, set()])
  assert schedule.round(1).left == {1} and schedule.round(2).joined == {1, 3}
  state = algo.init(linreg_params())
  state, _ = algo.round(state, churn.round_cohort(cohort, schedule.round(0), M), KEY)
  before = jax.tree.map(np.array, state.client_states)
  state, metrics = algo.round(state, churn.round_cohort(cohort, schedule.round(1), M), KEY)
  assert float(metrics['clients']) == 2
  after = jax.tree.map(np.array, state.client_states)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(x[[1, 3]], y[[1, 3]])
    assert not np.array_equal(x[[0, 2]], y[[0, 2]])


def test_goodput_is_the_hand_formula():
  schedule = churn.explicit_schedule(M, [{0, 1, 2, 3}, {0, 2}, {1, 2, 3}],
                                     failed=[{1}, set(), set()])
  step, gbps, latency, payload, tokens = 0.5, 2.0, 1e-3, 1e8, 1024.0
  link = network.Link.gbps(gbps, latency_s=latency)
  rounds = churn.goodput(schedule, network.Schedule.diloco(H),
                         network.Compute.from_step_seconds(step),
                         network.Network(link), payload, tokens)
  for rnd, contributing, failed in zip(rounds, [3, 2, 3], [1, 0, 0]):
    # Ring all-reduce among the contributing replicas, blocking (o = 0).
    ring = (2 * (contributing - 1) / contributing * 8 * payload / (gbps * 1e9)
            + 2 * (contributing - 1) * latency)
    seconds = H * step + ring
    assert rnd.useful_tokens == H * tokens * contributing
    assert rnd.wasted_tokens == H * tokens * failed
    np.testing.assert_allclose(rnd.seconds, seconds, rtol=1e-12)
    np.testing.assert_allclose(rnd.goodput, H * tokens * contributing / seconds, rtol=1e-12)
  np.testing.assert_allclose(churn.run_goodput(rounds),
                             sum(r.useful_tokens for r in rounds)
                             / sum(r.seconds for r in rounds), rtol=1e-12)
  one = churn.goodput(churn.explicit_schedule(M, [{2}]), network.Schedule.diloco(H),
                      network.Compute.from_step_seconds(step), network.Network(link),
                      payload, tokens)
  assert one[0].seconds == H * step  # One replica: nothing to reduce.


@pytest.mark.parametrize('call, match', [
    (lambda: churn.seeded_schedule(0, 3), 'num_replicas=0 must be an integer >= 1'),
    (lambda: churn.seeded_schedule(4, 3, leave=1.5), r'leave=1.5 must be a probability in \[0, 1\]'),
    (lambda: churn.seeded_schedule(4, 3, seed=-1), 'seed=-1 must be an integer >= 0'),
    (lambda: churn.explicit_schedule(4, [{0, 4}]), r'present\[0\]=.* in \[0, 4\)'),
    (lambda: churn.explicit_schedule(4, [{0}], failed=[{1}]), r'failed\[0\]=\[1\] must be a subset'),
    (lambda: churn.explicit_schedule(4, [{0}], failed=[{0}]), 'round 0 has no contributing replica'),
    (lambda: churn.explicit_schedule(4, [{0}, {1}], failed=[set()]), 'failed=.* must be a list of 2'),
    (lambda: churn.seeded_schedule(4, 3).round(3), r'r=3 must be an integer in \[0, 3\)'),
    (lambda: churn.goodput(churn.seeded_schedule(4, 1), network.Schedule.data_parallel(),
                           network.Compute.from_step_seconds(1.0),
                           network.Network(network.Link.gbps(1.0)), 1.0, 1.0),
     "kind 'diloco'"),
])
def test_errors_name_argument_value_and_allowed(call, match):
  with pytest.raises(ValueError, match=match):
    call()
