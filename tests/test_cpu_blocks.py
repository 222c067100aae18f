"""The loop a user writes from the docs gets fedjx-run's CPU split by itself:
``datasets.on_device`` splits the CPU into one device per core where JAX
has not started, a round with no mesh set runs a cohort of small clients as
one block per device (``fedjx.distributed.cpu_blocks``), compiled once; a
host population copied into padded cohorts says how to avoid it.

References: a float64 NumPy FedAvg of the same batches and the one-device
round. In-process tests use the 8 host devices of tests/conftest.py (forced
through ``XLA_FLAGS``, which the rule leaves alone unless told the CPU was
split on purpose); the others run a fresh process, as a user's loop does.
"""

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjx import algorithms
from fedjx import datasets
from fedjx import distributed
from fedjx import mapping
import softmax_fedavg

N, BATCH, FEATURES, CLASSES, LR = 64, 4, 5, 3, 0.1


def _population(n=N):
  return softmax_fedavg.population(n, FEATURES, CLASSES)


_loss = softmax_fedavg.loss


def _params():
  return softmax_fedavg.initial_params(FEATURES, CLASSES)


def _numpy_fedavg(n=N):
  return softmax_fedavg.numpy_fedavg(*_population(n), _params(), BATCH, LR)


def _tolerance(want, n=N):
  return softmax_fedavg.tolerance(want, _population(n)[0], FEATURES, BATCH)


class _Plans(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.how = []

  def emit(self, record):
    if record.msg == mapping.PLAN_MESSAGE:
      self.how.append(record.args[-1])


def _rounds(n=N, rounds=1, loss=_loss):
  sizes, x, y = _population(n)
  population = datasets.on_device(datasets.from_arrays(
      {'x': x, 'y': y}, groups=np.repeat(np.arange(n), sizes)))
  algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(LR),
                           server_optimizer=optax.sgd(1.0),
                           client_evaluation=False).compile(map_strategy='sequential')
  state = algo.init(_params())
  plans = _Plans()
  log = logging.getLogger('fedjx.fusion')
  level = log.level
  log.setLevel(logging.DEBUG)
  log.addHandler(plans)
  try:
    for r, cohort in enumerate(datasets.cohort_iterator(
        population, n, BATCH, num_rounds=rounds, shuffle=False)):
      state, _ = algo.round(state, cohort, jax.random.key(r))
  finally:
    log.removeHandler(plans)
    log.setLevel(level)
  return state, plans.how, algo


@pytest.fixture
def split_on_purpose(monkeypatch):
  """As if the CPU's 8 devices had been made by split_cpu."""
  monkeypatch.setattr(distributed, '_split_on_purpose', lambda: True)


@pytest.mark.parametrize('n,blocks', [(64, 4), (48, 3), (24, None)])
def test_a_round_with_no_mesh_runs_a_block_per_cpu_device(n, blocks, split_on_purpose):
  # The most devices of the 8 that divide n with 16 clients each.
  state, how, algo = _rounds(n, rounds=2)
  want = 'one block of %d per device' % (n // blocks) if blocks else None
  assert any(want in h for h in how) if blocks else not any('block' in h for h in how)
  if blocks:
    params = jax.tree.leaves(state.params)
    assert len(params[0].sharding.device_set) == blocks
    assert algo.round._cache_size() == 1  # The second round compiled nothing.
  one, _, _ = _rounds(n, rounds=1)
  for g, w in zip(one.params, _numpy_fedavg(n)):
    np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=_tolerance(w, n))


def test_devices_forced_through_xla_flags_are_left_alone():
  _, how, _ = _rounds(N)
  assert not any('block' in h for h in how)


def test_large_shared_values_keep_the_round_on_one_device(split_on_purpose):
  """A model the members close over (a frozen base of 4 MB) would be copied
  to every device: the round stays on one."""
  base = jnp.ones((1 << 20,), jnp.float32)

  def loss(params, batch):
    return _loss(params, batch) + 0.0 * base[0]

  _, how, _ = _rounds(N, loss=loss)
  assert not any('block' in h for h in how)
  assert distributed.cpu_blocks('clients', N, 1 << 20) is not None
  assert distributed.cpu_blocks('clients', N, 4 << 20) is None


SCRIPT = textwrap.dedent('''
    import json, sys, warnings
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import test_cpu_blocks as t
    sizes, x, y = t._population()
    with warnings.catch_warnings(record=True) as got:
      warnings.simplefilter('always')
      if sys.argv[2] == 'split':
        import fedjx
        fedjx.distributed.split_cpu(4)
      state, how, algo = t._rounds(rounds=3)
    import jax
    print(json.dumps({
        'devices': len(jax.devices('cpu')), 'how': how,
        'compiled': algo.round._cache_size(),
        'warnings': [str(w.message) for w in got],
        'params': [np.asarray(p).tolist() for p in state.params]}))
''')


def _fresh(mode):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  here = os.path.dirname(os.path.abspath(__file__))
  out = subprocess.run([sys.executable, '-c', SCRIPT, here, mode], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  import json
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_documented_loop_splits_the_cpu_and_compiles_once():
  """split_cpu(4) before JAX starts (what on_device does with one device
  per core): three rounds of 64 clients, one block of 16 per device, one
  program, the same rounds as one device's (here, in this process)."""
  got = _fresh('split')
  assert got['devices'] == 4
  assert all('one block of 16 per device' in h for h in got['how'])
  assert got['compiled'] == 1
  assert not got['warnings']
  one, how, _ = _rounds(rounds=3)
  assert not any('block' in h for h in how)
  for a, b in zip(got['params'], one.params):
    a, b = np.asarray(a), np.asarray(b)
    # Three rounds of the chain of _tolerance, summed in another order.
    np.testing.assert_allclose(a, b, rtol=0, atol=3 * _tolerance(b))
  # Without split_cpu, on_device splits the CPU itself: one device per core.
  assert _fresh('auto')['devices'] == len(os.sched_getaffinity(0))


def test_padded_copies_of_an_in_memory_population_warn_once_per_place():
  rng = np.random.default_rng(0)
  sizes = np.array([400] + [4] * 99)  # One large client pads the others.
  x = rng.random((sizes.sum(), 300), dtype=np.float32)
  data = datasets.from_arrays({'x': x}, groups=np.repeat(np.arange(100), sizes))
  with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter('always')
    cohort = datasets.make_cohort(data, np.arange(100), 4)
    datasets.make_cohort(data, np.arange(1, 100), 4)  # No large client.
    datasets.make_cohort(datasets.on_device(data), np.arange(100), 4)
  # [100, 128, 4, 300] float32: 61 MB for 940 examples of 1.2 KB.
  assert cohort.batches['x'].nbytes >= datasets.cohort.PADDED_WARNING_BYTES
  assert [type(w.message) for w in got] == [datasets.PaddedCohortWarning]
  assert 'datasets.on_device(dataset)' in str(got[0].message)
  assert got[0].filename == __file__  # Where the user called make_cohort.


def test_on_device_gathers_an_in_memory_population_in_client_order():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, 2)).astype(np.float32)
  groups = [np.array([7, 1]), np.array([0, 9, 4]), np.array([2, 3, 5, 6, 8])]
  data = datasets.from_arrays({'x': x}, groups=groups)
  resident = datasets.on_device(data)
  np.testing.assert_array_equal(resident.table['x'], x[np.concatenate(groups)])
  np.testing.assert_array_equal(resident.offsets, [0, 2, 5])
