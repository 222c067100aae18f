"""q-FFL (q-FedAvg) against a float64 NumPy reading of the paper's Algorithm 2.

Li, Sanjabi, Beirami, Smith, ICLR 2020, Algorithm 2 (q-FedAvg), as Flower's
``QFedAvg`` computes it (``flwr/serverapp/strategy/qfedavg.py``,
``compute_delta_and_h``: ``L = 1 / client_learning_rate``, ``F_k + 1e-10``);
Flower ships no unit test with numbers for it (only an end-to-end run), so
the reference here is the algorithm itself in float64.

Tolerance: the float32 round is local SGD and an average (the chain of
``test_algorithms_util.CHAIN`` terms), then per client ``F_k^q`` (pow, a few
ulps), ``||Dw_k||^2`` (4 terms) and ``h_k`` (2 terms), the two sums over
``C = 4`` clients and one division: ``n = CHAIN + 16`` terms a round.
``L = 1 / eta`` scales ``Dw_k`` up and the step divides it out again, so
errors stay relative to the model's scale.
"""

import functools

import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
import linreg_oracle as ref
from test_algorithms_util import CHAIN, KEY, assert_trees_close
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

SIZES = [8, 5, 3, 6]
B, LR = 4, 0.1
N = CHAIN + 16


def _data(seed):
  return linreg_data(np.random.default_rng(seed), SIZES)


def _cohort(seed):
  return make_cohort(_data(seed), batch_size=B)


def reference_round(params, clients, q, lr, weighting, lipschitz=None):
  """One q-FedAvg round in float64 (the module docstring's equations)."""
  big_l = 1.0 / lr if lipschitz is None else lipschitz
  num = {k: np.zeros_like(v) for k, v in params.items()}
  den = 0.0
  for data in clients:
    f = ref.mean_loss(params, data) + 1e-10
    trained = ref.sgd(params, data, B, lr)
    dw = {k: big_l * v for k, v in ref.sub(params, trained).items()}
    h = q * f ** (q - 1) * ref.sq_norm(dw) + big_l * f ** q
    v = len(data['y']) if weighting == 'num_examples' else 1.0
    for k in num:
      num[k] += v * f ** q * dw[k]
    den += v * h
  return {k: params[k] - num[k] / den for k in params}


@pytest.mark.parametrize('q,weighting', [
    (0.5, 'uniform'),  # The paper's and Flower's uniform sum.
    (2.0, 'num_examples'),
    pytest.param(2.0, 'uniform', marks=pytest.mark.slow),
    pytest.param(0.5, 'num_examples', marks=pytest.mark.slow)])
def test_two_rounds_match_numpy(q, weighting):
  algo = algos.qffl(linreg_loss, q=q, client_optimizer=algos.default_sgd(LR),
                    weighting=weighting)
  state = algo.init(linreg_params())
  want = ref.as64(linreg_params())
  for r in range(2):
    state, metrics = algo.round(state, _cohort(r), KEY)
    want = reference_round(want, _data(r), q, LR, weighting)
    assert_trees_close(state.params, want, n=N * (r + 1))
  assert float(metrics['lipschitz']) == pytest.approx(1.0 / LR, rel=2 ** -23)


@pytest.mark.slow
def test_an_explicit_lipschitz_constant_is_used():
  algo = algos.qffl(linreg_loss, q=1.0, lipschitz=4.0,
                    client_optimizer=optax.sgd(LR))  # Not injected: L is given.
  state, _ = algo.round(algo.init(linreg_params()), _cohort(0), KEY)
  want = reference_round(ref.as64(linreg_params()), _data(0), 1.0, LR,
                         'num_examples', lipschitz=4.0)
  assert_trees_close(state.params, want, n=N)
  assert float(state.hparams['lipschitz']) == 4.0


def test_q_zero_is_fedavg():
  # h_k = L, Delta_k = L (w - wbar_k): the step is FedAvg's weighted mean.
  kw = dict(client_optimizer=algos.default_sgd(LR))
  a = algos.qffl(linreg_loss, q=0.0, **kw)
  b = algos.fedavg(linreg_loss, **kw)
  sa, sb = a.init(linreg_params()), b.init(linreg_params())
  sa, _ = a.round(sa, _cohort(0), KEY)
  sb, _ = b.round(sb, _cohort(0), KEY)
  assert_trees_close(sa.params, sb.params, n=N)


@pytest.mark.slow
def test_large_q_steps_along_the_worst_client():
  # F_k^q of the client with the largest loss dominates both sums as q grows.
  q = 40.0
  algo = algos.qffl(linreg_loss, q=q, client_optimizer=algos.default_sgd(LR),
                    weighting='uniform')
  params = ref.as64(linreg_params())
  state, _ = algo.round(algo.init(linreg_params()), _cohort(0), KEY)
  worst = max(_data(0), key=lambda d: ref.mean_loss(params, d))
  trained = ref.sgd(params, worst, B, LR)
  step = np.concatenate([np.ravel(params[k] - np.asarray(state.params[k])) for k in params])
  own = np.concatenate([np.ravel(v) for v in ref.sub(params, trained).values()])
  cos = step @ own / np.linalg.norm(step) / np.linalg.norm(own)
  assert cos > 0.99


@pytest.mark.slow
def test_a_nonfinite_client_is_left_out():
  data = _data(0)
  bad = [dict(d) for d in data]
  bad[1]['x'] = np.full_like(bad[1]['x'], np.nan)
  algo = algos.qffl(linreg_loss, q=1.0, client_optimizer=algos.default_sgd(LR))
  state, metrics = algo.round(algo.init(linreg_params()),
                              make_cohort(bad, batch_size=B), KEY)
  assert float(metrics['nonfinite_clients']) == 1
  want = reference_round(ref.as64(linreg_params()), [data[0]] + data[2:], 1.0,
                         LR, 'num_examples')
  assert_trees_close(state.params, want, n=N)


STRATEGIES = [('chunked', 2), ('sequential', None), ('auto', None)]


@functools.lru_cache(maxsize=None)
def _two_rounds(strategy, chunk):
  algo = algos.qffl(linreg_loss, q=2.0, client_optimizer=algos.default_sgd(LR))
  algo = algo.compile(map_strategy=strategy, chunk_size=chunk)
  state = algo.init(linreg_params())
  for r in range(2):
    state, _ = algo.round(state, _cohort(r), KEY)
  return state.params


@pytest.mark.slow
@pytest.mark.parametrize('strategy,chunk', STRATEGIES)
def test_every_map_strategy_gives_the_vmap_rounds(strategy, chunk):
  # Same per-client float32 work; only the order of the cohort sums differs.
  assert_trees_close(_two_rounds(strategy, chunk), _two_rounds('vmap', None),
                     n=2 * N)


def test_dp_aggregators_are_refused_with_the_reason():
  with pytest.raises(ValueError, match=r'qffl: aggregator gaussian \(central DP\) is refused: .*h_k'):
    algos.qffl(linreg_loss, aggregator=algos.aggregators.gaussian(clip_norm=1.0))
  algos.qffl(linreg_loss, aggregator=algos.aggregators.mean())  # The plain mean is it.


def test_bad_options_are_one_line_errors():
  with pytest.raises(ValueError, match=r"qffl: q=-1\.0 is not allowed"):
    algos.qffl(linreg_loss, q=-1.0)
  with pytest.raises(ValueError, match=r'qffl: lipschitz=0\.0'):
    algos.qffl(linreg_loss, lipschitz=0.0)
  algo = algos.qffl(linreg_loss, client_optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match='no injected learning_rate; pass lipschitz'):
    algo.init(linreg_params())


def test_digits_with_per_client_held_out_examples():
  # configs/qffl_digits.py: every image goes to a client, which holds out 20%.
  from fedjx.experiments import data  # pylint: disable=import-outside-toplevel
  out = data.digits(num_clients=5, alpha=0.5, seed=0, client_test_fraction=0.2)
  assert out.test.num_clients == out.train.num_clients == 5
  total = 0
  for c in range(5):
    n_train, n_test = out.train.num_examples(c), out.test.num_examples(c)
    n = n_train + n_test
    total += n
    assert n_test == min(max(round(0.2 * n), 1), n - 1)
  assert total == 1797  # scikit-learn's digits, none held out centrally.
