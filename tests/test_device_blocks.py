"""A cohort on a ``clients`` mesh axis runs as one block of members per
device (``fedjx.mapping.device_blocks``): each device loops over its own
clients as on one device, the fused sums joined by one ``psum``.

On the 8 host devices of tests/conftest.py. References: the same round on
one device (no mesh), and a float64 NumPy FedAvg of the same batches.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.test_util import check_grads
import pytest

import fedjx
from fedjx import algorithms
from fedjx import datasets
from fedjx import fusion
from fedjx import mapping
import float_tolerance as ft
import softmax_fedavg

N, BATCH, FEATURES, CLASSES, LR = 16, 4, 6, 3, 0.1
AUTO = jax.sharding.AxisType.Auto
EXPLICIT = jax.sharding.AxisType.Explicit


def _population():
  return softmax_fedavg.population(N, FEATURES, CLASSES, median=6)


_loss = softmax_fedavg.loss


def _params():
  return softmax_fedavg.initial_params(FEATURES, CLASSES)


def _round(strategy, mesh, shuffle_seed=None):
  """Params after one FedAvg round (SGD LR, server SGD 1.0), and the cohort."""
  sizes, x, y = _population()
  with jax.set_mesh(mesh) if mesh is not None else _null():
    population = datasets.on_device(datasets.from_arrays(
        {'x': x, 'y': y}, groups=np.repeat(np.arange(N), sizes)))
    algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(LR),
                             server_optimizer=optax.sgd(1.0),
                             client_evaluation=False).compile(
        map_strategy=strategy, chunk_size=2 if strategy == 'chunked' else None)
    state = algo.init(_params())
    cohort = datasets.place_cohort(datasets.make_cohort(
        population, np.arange(N), BATCH, round_num=0, shuffle_seed=shuffle_seed))
    state = algo.round(state, cohort, jax.random.key(0))[0]
    return [np.asarray(a) for a in state.params]


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def _numpy_fedavg():
  return softmax_fedavg.numpy_fedavg(*_population(), _params(), BATCH, LR)


def _steps():
  sizes, _, _ = _population()
  return int(np.sum(-(-sizes // BATCH)))


@pytest.mark.parametrize('devices', [2, 8])
@pytest.mark.parametrize('strategy', ['sequential', 'chunked', 'auto'])
def test_blocks_per_device_give_the_round_of_one_device(devices, strategy,
                                                        monkeypatch):
  calls = []
  run = fusion._run_on_devices
  monkeypatch.setattr(fusion, '_run_on_devices',
                      lambda spec, *a: calls.append(spec.devices[1]) or run(spec, *a))
  mesh = jax.make_mesh((devices,), ('clients',), axis_types=(AUTO,),
                       devices=jax.devices()[:devices])
  got = _round(strategy, mesh)
  # One block per device where a device runs its N / devices members in more
  # than one chunk (sequential; chunks of 2 of 8 members); a block that is a
  # single chunk (auto's vmap of this tiny model) keeps the vmapped layout.
  blocks = strategy == 'sequential' or strategy == 'chunked' and N // devices > 2
  assert calls == ([devices] if blocks else [])
  want = _numpy_fedavg()
  # Each weight: a chain of 2 S (FEATURES + BATCH) float32 roundings in the
  # local steps, then the weighted sum over N clients.
  n = 2 * _steps() * (FEATURES + BATCH) + N
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=ft.atol(n, np.abs(w).max() + 1))
  one = _round(strategy, None)
  for g, o in zip(got, one):
    np.testing.assert_allclose(g, o, rtol=0, atol=ft.atol(n, np.abs(o).max() + 1))


def test_the_stacked_client_models_never_exist(monkeypatch):
  """Fused on each device: the compiled round's temporaries stay below the
  cohort's stacked models (N copies of a 60,000-weight model)."""
  del monkeypatch
  big = 10_000
  mesh = jax.make_mesh((2,), ('clients',), axis_types=(AUTO,),
                       devices=jax.devices()[:2])

  @fedjx.program(clients=N, map_strategy='sequential')
  def program(w, xs):
    local = fedjx.map_fn(lambda w, x: w * x, (fedjx.broadcast(w), xs))
    return fedjx.reduce_mean(local)

  w = jnp.ones((6, big), jnp.float32)
  xs = jnp.arange(N, dtype=jnp.float32)
  with jax.set_mesh(mesh):
    compiled = jax.jit(program).lower(w, xs).compile()
    got = jax.jit(program)(w, xs)
  np.testing.assert_allclose(np.asarray(got), np.full((6, big), xs.mean()), rtol=1e-6)
  stacked = N * w.size * 4
  memory = compiled.memory_analysis()
  if memory is not None:
    assert memory.temp_size_in_bytes < stacked / 2


def test_gradients_through_the_blocks_equal_one_device_s():
  """Hypergradient of a mapped-and-reduced loss with respect to the broadcast
  weights, per device and on one device (and finite differences)."""
  rng = np.random.default_rng(3)
  xs = jnp.asarray(rng.normal(size=(N, 5)).astype(np.float32))
  counts = jnp.asarray(rng.integers(1, 9, size=N).astype(np.float32))

  def make():
    @fedjx.program(clients=N, map_strategy='sequential')
    def program(w, xs, counts):
      local = fedjx.map_fn(lambda w, x: jnp.tanh(w * x) ** 2, (fedjx.broadcast(w), xs))
      return jnp.sum(fedjx.reduce_weighted_mean(local, counts))
    return program

  w = jnp.asarray(rng.normal(size=5).astype(np.float32))
  one = jax.grad(make())(w, xs, counts)
  mesh = jax.make_mesh((8,), ('clients',), axis_types=(AUTO,))
  with jax.set_mesh(mesh):
    blocks = jax.jit(jax.grad(make()))(w, xs, counts)
    check_grads(jax.jit(lambda w: make()(w, xs, counts)), (w,), order=1,
                              modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-2)
  np.testing.assert_allclose(np.asarray(blocks), np.asarray(one), rtol=0,
                             atol=ft.atol(2 * N, float(np.abs(one).max()) + 1))


@pytest.mark.parametrize('axes,types,n,blocks', [
    ((8,), (AUTO,), 16, 8),            # Whole models on each device.
    ((8,), (AUTO,), 12, None),         # 8 does not divide 12.
    ((8,), (EXPLICIT,), 16, None),     # Explicit axes keep the vmapped layout.
    ((2, 4), (AUTO, AUTO), 16, None),  # A model split over fsdp.
])
def test_device_blocks_only_where_each_device_holds_whole_models(axes, types, n, blocks):
  names = ('clients', 'fsdp')[:len(axes)]
  mesh = jax.make_mesh(axes, names, axis_types=types)
  got = mapping.device_blocks('clients', mesh, n)
  assert (None if got is None else got[1]) == blocks


def test_split_cpu_refuses_bad_counts_and_leaves_a_started_jax_alone():
  with pytest.raises(ValueError, match=r"split_cpu: devices=0; it must be a positive int or 'auto'"):
    fedjx.distributed.split_cpu(0)
  jax.devices()  # Started: nothing changes.
  assert fedjx.distributed.split_cpu(4) == 1
  assert len(jax.devices('cpu')) == 8


SPLIT = textwrap.dedent('''
    import sys
    import fedjx
    made = fedjx.distributed.split_cpu(int(sys.argv[1]), divides=int(sys.argv[2]))
    import jax
    print(made, len(jax.devices('cpu')))
''')


@pytest.mark.parametrize('devices,divides,want', [(4, 12, 4), (4, 10, 2), (3, 7, 1)])
def test_split_cpu_makes_the_largest_count_that_divides_the_cohort(devices, divides, want):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  out = subprocess.run([sys.executable, '-c', SPLIT, str(devices), str(divides)],
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == [str(want), str(want)]


def _config(**fields):
  from fedjx.experiments import config as config_lib
  config = config_lib.with_defaults(dict(
      dataset=dict(name='digits', num_clients=40), model=dict(name='logistic_regression'),
      algorithm=dict(name='fedavg'), **fields))
  return config


@pytest.mark.parametrize('fields,split,want', [
    (dict(cohort_size=32), 2, 'clients=-1'),      # 16 clients per device.
    (dict(cohort_size=30), 2, ''),                # Fewer: the split costs more.
    (dict(cohort_size=32), 1, ''),                # JAX was running already.
    (dict(cohort_size=32, sampling=dict(name='poisson')), 2, ''),  # Sizes vary.
])
def test_auto_mesh_splits_cohorts_of_many_clients_on_cpu(fields, split, want):
  from fedjx.experiments import processes
  small = [np.zeros((784, 200), np.float32)]  # The 2NN's largest layer.
  assert processes.auto_mesh(_config(**fields), split, small) == want


def test_auto_mesh_keeps_large_models_on_one_device_unless_they_stream_their_weights():
  from fedjx import models
  from fedjx.experiments import processes
  large = [np.zeros((10_000, 500), np.float32)]  # 20 MB.
  config = _config(cohort_size=64)
  assert processes.auto_mesh(config, 2, large) == ''  # No loss to measure.
  # A dense layer: 2 D K forward flops (and K more for the bias and loss
  # terms: under 1 %) per example for D K weights.
  dense = lambda params, batch: jnp.sum(batch['x'] @ params[0], -1)
  batch = {'x': np.ones((3, 10_000), np.float32)}
  ratio = processes.flops_per_parameter(dense, large, batch)
  assert 2.0 <= ratio <= 2.02
  assert processes.auto_mesh(config, 2, large, dense, batch) == 'clients=-1'
  # A CNN of 4.8 MB reuses its kernels at every position.
  cnn = models.emnist_cnn(dropout=False)
  images = {'x': np.zeros((2, 28, 28, 1), np.float32), 'y': np.zeros(2, np.int32)}
  params = cnn.init(jax.random.key(0), images)
  assert processes.flops_per_parameter(cnn.eval_loss_fn, params, images) > 4
  assert processes.auto_mesh(config, 2, params, cnn.eval_loss_fn, images) == ''


def test_a_run_in_a_started_jax_keeps_its_devices():
  from fedjx.experiments import processes
  assert processes.split_cpu(_config(cohort_size=32)) == 1


def test_cpu_devices_errors_name_the_field():
  from fedjx.experiments import config as config_lib
  with pytest.raises(config_lib.ConfigError,
                     match=r"config.cpu_devices=0; it must be a positive int or 'auto'"):
    config_lib.validate(_config(cpu_devices=0))


def _fedjx_run(workdir, *overrides):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, '-m', 'fedjx.experiments.cli', '--config',
       os.path.join(repo, 'configs', 'fedavg_digits.py'), '--workdir', str(workdir),
       '--config.rounds=3', '--config.cohort_size=32', '--config.eval_every=3',
       '--config.progress=False', '--config.plot=False',
       '--config.compilation_cache=off', *overrides],
      env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  import json
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return out.stderr, [json.loads(line) for line in f]


@pytest.mark.slow
def test_fedjx_run_splits_the_cpu_and_gives_the_one_device_rounds(tmp_path):
  log, split = _fedjx_run(tmp_path / 'split', '--config.cpu_devices=2')
  assert 'the cohort runs over 2 CPU devices' in log
  log, one = _fedjx_run(tmp_path / 'one', '--config.mesh=')
  assert 'CPU devices' not in log
  assert len(split) == len(one) >= 3
  for a, b in zip(split, one):
    for key in ('train_loss_before', 'train_loss_after', 'eval_loss'):
      if key in b:
        # A mean over the cohort's examples of float32 losses, summed in
        # another order: a few ulps of each of ~32 clients' terms.
        assert abs(a[key] - b[key]) <= ft.atol(64, abs(b[key]) + 1), (key, a, b)
