"""The benchmark's records (no timing is asserted: speed is not tested)."""

import jax
import numpy as np
import optax
import pytest

import float_tolerance as ft
from fedjx import algorithms
from fedjx import datasets
import round_bench as benchmark  # benchmarks/, put on sys.path by conftest.py


def test_a_fedjx_round_equals_the_hand_written_references():
  """What the benchmark compares is the same computation."""
  workload = benchmark.workloads()['logreg']
  cohort = benchmark.make_cohort(workload, clients=4, steps=2, batch=3)
  params = workload.model.init(jax.random.key(0),
                               jax.tree.map(lambda a: a[0, 0], cohort.batches))
  placed = datasets.place_cohort(cohort)
  algo = algorithms.fedavg(workload.model.loss_fn, client_optimizer=optax.sgd(0.1),
                           local_steps=2, client_evaluation=False)
  state, _ = algo.round(algo.init(params), placed, jax.random.key(0))
  for name, ref in benchmark.reference_rounds(workload.model.loss_fn, 0.1).items():
    if name == 'central':
      continue
    got = ref(params, placed.batches, placed.num_examples)
    # Two local steps, each a 60-term logit, a 10-class softmax and a mean
    # over 3 examples, then 4 clients: n < 2 * (60 + 10 + 3) + 4 = 150 terms.
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(got)):
      tol = ft.rtol(150)
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.max(np.abs(b))),
                                 err_msg=name)


@pytest.mark.slow
def test_records_and_memory_plans():
  records = []
  benchmark.run(['logreg'], [2], ['vmap', 'chunked:1'], steps=1, batch=2,
                repeats=1, emit=records.append)
  by_strategy = {r['strategy']: r for r in records}
  assert {'vmap', 'chunked:1', 'ref_vmap', 'ref_lax_map', 'central'} <= set(by_strategy)
  assert by_strategy['chunked:1']['chunk_clients'] == 1
  for r in records:
    assert r['ms_per_round'] > 0 and r['ratio_vs_best_strategy'] > 0
  plans = []
  benchmark.compile_only(['logreg'], [8, 64], ['vmap'], steps=1, batch=2,
                         emit=plans.append)
  # The cohort (8 or 64 clients of 2 examples of 60 floats) is an argument.
  assert plans[1]['argument_bytes'] - plans[0]['argument_bytes'] >= 56 * 2 * 60 * 4
  assert all(p['peak_bytes'] >= p['argument_bytes'] for p in plans)


def test_unknown_model_is_named():
  with pytest.raises(ValueError, match=r"model='vgg'"):
    benchmark.run(['vgg'], [2], ['vmap'], steps=1, batch=2, repeats=1,
                  emit=lambda r: None)


@pytest.mark.slow  # ~6 s: compiles three experiments.
def test_the_guard_cost_in_runs_times_the_runners_round_loop():
  """One record per config, from the runner's own loop (no timing asserted)."""
  import os  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import cli  # pylint: disable=import-outside-toplevel
  config = cli.load_config_file(os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
      'fedavg_digits.py'))
  config.cohort_size, config.local_epochs = 3, 1
  records = []
  benchmark.guard_cost_in_runs({'digits': config}, rounds=2, pairs=2,
                               emit=records.append)
  (rec,) = records
  assert rec['config'] == 'digits' and rec['algorithm'] == 'fedavg'
  assert rec['pairs'] == 2 and rec['ms_skip'] > 0 and rec['ms_off'] > 0
  assert rec['ratio_on_off'] > 0 and rec['ratio_off2_off'] > 0
