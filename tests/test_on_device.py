"""A population on the device: cohorts as index arrays, the same rounds.

``datasets.on_device`` keeps every example once on the device and
``make_cohort`` of it returns ``IndexedBatches(table, index)``: these tests
check that its batches are exactly the host cohort's (every option of
``make_cohort``), that ``map_fn`` hands the table whole to each member (no
``[C, N, ...]`` copy in the program), and that rounds of every algorithm
equal the host cohort's rounds under every map strategy.

Tolerance: a gather copies values exactly, so the two cohorts feed the same
float32 operations; the strategies differ in the order of the sums over the
cohort, bounded as in test_algorithm_strategies (its ``RTOL``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx import datasets
from fedjx.indexed import IndexedBatches
import fedjx.indexed

from test_algorithm_strategies import ALL, RTOL, _assert_close
from test_algorithms_util import linreg_params
from test_nonfinite import DIM, B

SIZES = [6, 1, 13, 8, 3, 21, 5, 2]


def _population(seed=0, sizes=SIZES, dim=DIM):
  rng = np.random.default_rng(seed)
  n = int(np.sum(sizes))
  x = rng.normal(size=(n, dim)).astype(np.float32)
  w = rng.normal(size=(dim,)).astype(np.float32)
  y = (x @ w + 0.1 * rng.normal(size=n)).astype(np.float32)
  groups = np.repeat(np.arange(len(sizes)), sizes)
  return datasets.from_arrays({'x': x, 'y': y, 's': np.ones(n, np.float32)},
                              groups=groups)


OPTIONS = [
    dict(), dict(num_epochs=2), dict(num_steps=3), dict(max_steps=2),
    dict(bucket=False), dict(shuffle_seed=None), dict(order_by_steps=True),
    dict(pad_to=10), dict(steps=16, bucket=False),
    dict(pad_to=10, order_by_steps=True, num_steps=5),
    dict(steps=8, num_epochs=3, max_steps=6),
]


@pytest.mark.parametrize('options', OPTIONS, ids=lambda o: ','.join(
    f'{k}={v}' for k, v in o.items()) or 'defaults')
def test_indexed_cohort_is_the_host_cohort(options):
  host = _population()
  resident = datasets.on_device(host)
  ids = np.array([5, 0, 2, 7, 1, 3])
  want = datasets.make_cohort(host, ids, 4, round_num=3, **options)
  got = datasets.make_cohort(resident, ids, 4, round_num=3, **options)
  assert isinstance(got.batches, IndexedBatches)
  assert got.batches.index.dtype == np.int32
  for k, v in want.batches.items():
    np.testing.assert_array_equal(np.asarray(got.batches.dense()[k]), v)
  for field in ('mask', 'num_examples', 'client_ids'):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


@pytest.mark.parametrize('ids, options, message', [
    ([2, 8], {}, r'client id 8 is not in this dataset; ids are ints in \[0, 8\)'),
    ([2, -1], {}, r'client id -1 is not in this dataset'),
    ([2, 1], dict(steps=1), r'steps=1 is fewer than the 4 steps'),
])
def test_indexed_cohort_refuses_what_the_host_cohort_refuses(ids, options, message):
  host = _population()
  for dataset in (host, datasets.on_device(host)):
    with pytest.raises(ValueError, match=message):
      datasets.make_cohort(dataset, ids, 4, **options)


def test_cohort_moves_only_its_index():
  resident = datasets.on_device(_population())
  cohort = datasets.make_cohort(resident, np.arange(8), 4)
  moved = cohort.batches.index.nbytes + cohort.mask.nbytes
  c, s, b = cohort.shape
  assert moved == 5 * c * s * b
  placed = datasets.place_cohort(cohort)
  assert placed.batches.table is resident.table  # Not copied again.


def test_on_device_refuses_mismatched_clients():
  ds = datasets.from_arrays({'x': np.zeros((5, 3), np.float32)},
                            groups=[np.array([0, 1]), np.array([2, 3, 4])])
  cropped = ds.map(lambda d: {'x': d['x'][:, :2]} if len(d['x']) == 3 else d)
  with pytest.raises(ValueError, match=r'client 1 has features .*\(2,\).* but '
                     r'client 0 has .*\(3,\)'):
    datasets.on_device(cropped)
  with pytest.raises(ValueError, match="dataset='dict'"):
    datasets.on_device({'x': np.zeros(3)})


def test_map_fn_hands_the_table_whole():
  n, c = 40, 4
  table = {'x': jnp.arange(n * 3, dtype=jnp.float32).reshape(n, 3)}
  index = jnp.asarray(np.random.default_rng(0).integers(0, n, (c, 2, 5)), jnp.int32)

  @fedjx.program(clients=c, map_strategy='sequential')
  def program(batches):
    def member(b):
      assert b.table['x'].shape == (n, 3) and b.index.shape == (2, 5)
      return jnp.sum(fedjx.indexed.take(b, 1)['x'], axis=0)
    return fedjx.map_fn(member, (batches,))

  batches = IndexedBatches(table, index)
  got = jax.jit(program)(batches)
  want = np.asarray(table['x'])[np.asarray(index)[:, 1]].sum(axis=1)
  np.testing.assert_array_equal(np.asarray(got), want)
  jaxpr = str(jax.make_jaxpr(program)(batches))
  assert f'{c},{n},3]' not in jaxpr.replace(' ', '')  # No per-client copy.


def test_padding_rows_read_as_zeros():
  table = {'x': jnp.ones((3, 2), jnp.float32), 'y': jnp.ones(3, jnp.int32)}
  rows = IndexedBatches(table, jnp.array([[0, 3]], jnp.int32)).dense()
  np.testing.assert_array_equal(np.asarray(rows['x']), [[[1, 1], [0, 0]]])
  np.testing.assert_array_equal(np.asarray(rows['y']), [[1, 0]])


def _pair(seed=0):
  host = _population(seed)
  ids = np.arange(len(SIZES))
  want = datasets.make_cohort(host, ids, B, round_num=seed)
  got = datasets.make_cohort(datasets.on_device(host), ids, B, round_num=seed)
  return datasets.place_cohort(want), datasets.place_cohort(got)


def _two_rounds(name, cohorts, strategy, chunk):
  algo = ALL[name]().compile(map_strategy=strategy, chunk_size=chunk, donate=False)
  assert algo.traits.indexed_batches  # These read indexed cohorts as they are.
  state = algo.init(linreg_params(DIM))
  for r, cohort in enumerate(cohorts):
    state, metrics = algo.round(state, cohort, jax.random.key(r))
  return state, metrics


_SLOW_NAMES = ('dp_fedavg', 'fedadagrad', 'fedyogi', 'fedavgm', 'quantized')


def _algorithm_cases():
  for name in sorted(ALL):
    for strategy, chunk in (('sequential', None), ('chunked', 3), ('vmap', None)):
      slow = strategy != 'sequential' or any(s in name for s in _SLOW_NAMES)
      yield pytest.param(name, strategy, chunk, id=f'{name}-{strategy}',
                         marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize('name,strategy,chunk', list(_algorithm_cases()))
def test_every_algorithm_runs_the_same_rounds_on_device(name, strategy, chunk):
  pairs = [_pair(0), _pair(1)]
  want = _two_rounds(name, [h for h, _ in pairs], strategy, chunk)
  got = _two_rounds(name, [d for _, d in pairs], strategy, chunk)
  _assert_close(got, want)


@pytest.mark.parametrize('strategy', ['sequential', 'auto', 'vmap'])
@pytest.mark.parametrize('evaluation', [True, False])
def test_fedavg_on_device_equals_host_and_differentiates(strategy, evaluation):
  loss = lambda p, b: 0.5 * (b['x'] @ p['w'] + p['b'] - b['y']) ** 2
  metrics = lambda p, b: {'abs_err': jnp.abs(b['x'] @ p['w'] + p['b'] - b['y'])}
  algo = algos.fedavg(loss, metrics_fn=metrics, client_optimizer=optax.sgd(0.05),
                      client_evaluation=evaluation).compile(
      map_strategy=strategy, donate=False)
  host, resident = _pair(0)
  params = {'w': jnp.zeros(DIM), 'b': jnp.zeros(())}
  want = algo.round(algo.init(params), host, jax.random.key(0))
  got = algo.round(algo.init(params), resident, jax.random.key(0))
  _assert_close(got, want)

  def final_loss(lr_scale, cohort):
    state = algo.init(params)
    state = state._replace(hparams=jax.tree.map(lambda v: v * lr_scale, state.hparams))
    new = algo.round(state, cohort, jax.random.key(0))[0]
    return jnp.sum(new.params['w'] ** 2)

  g_host = jax.grad(final_loss)(1.0, host)
  g_dev = jax.grad(final_loss)(1.0, resident)
  np.testing.assert_allclose(g_dev, g_host, rtol=RTOL, atol=RTOL * abs(float(g_host)))


@pytest.mark.parametrize('strategy,chunk', [('sequential', None), ('chunked', 2),
                                            ('vmap', None)])
@pytest.mark.parametrize('axis_types', ['auto', 'explicit'])
def test_fedavg_on_device_on_a_clients_mesh(strategy, chunk, axis_types):
  # The cohort's index sharded over 8 devices; the table whole on each.
  loss = lambda p, b: 0.5 * (b['x'] @ p['w'] + p['b'] - b['y']) ** 2
  algo = algos.fedavg(loss, client_optimizer=optax.sgd(0.05)).compile(
      map_strategy=strategy, chunk_size=chunk, donate=False)
  host = _population()
  ids = np.arange(len(SIZES))
  params = {'w': jnp.zeros(DIM), 'b': jnp.zeros(())}
  want = algo.round(algo.init(params), datasets.make_cohort(host, ids, B),
                    jax.random.key(0))
  mesh = fedjx.distributed.make_mesh({'clients': -1}, axis_types=axis_types)
  with jax.set_mesh(mesh):
    resident = datasets.on_device(host)
    cohort = datasets.place_cohort(datasets.make_cohort(resident, ids, B))
    got = algo.round(algo.init(params), cohort, jax.random.key(0))
  _assert_close(got, want)


def test_other_algorithms_gather_the_cohort_first():
  """An algorithm that does not declare indexed_batches (HypCluster reads
  the cohort's batches outside map_fn) gets them gathered on the device:
  the host cohort's round."""
  loss = lambda p, b: 0.5 * (b['x'] @ p['w'] - b['y']) ** 2
  algo = algos.hyp_cluster(loss, num_clusters=2).compile(donate=False)
  assert not algo.traits.indexed_batches
  host, resident = _pair(0)
  params = [{'w': jnp.zeros(DIM)}, {'w': jnp.ones(DIM)}]
  want = algo.round(algo.init(params), host, jax.random.key(0))
  got = algo.round(algo.init(params), resident, jax.random.key(0))
  _assert_close(got, want)


def test_run_rounds_scans_the_indices_of_one_table():
  loss = lambda p, b: 0.5 * (b['x'] @ p['w'] - b['y']) ** 2
  algo = algos.fedavg(loss).compile(donate=False)
  population = _population(0)
  resident = datasets.on_device(population)
  ids = np.arange(len(SIZES))
  host = [datasets.make_cohort(population, ids, B, round_num=r) for r in (0, 1)]
  dev = [datasets.make_cohort(resident, ids, B, round_num=r) for r in (0, 1)]
  stack = lambda *xs: jnp.stack(xs)
  host = jax.tree.map(stack, *host)
  indexed = dev[0]._replace(
      batches=IndexedBatches(dev[0].batches.table,
                             stack(*[d.batches.index for d in dev])),
      mask=stack(*[d.mask for d in dev]),
      num_examples=stack(*[d.num_examples for d in dev]),
      client_ids=stack(*[d.client_ids for d in dev]))
  keys = jax.random.split(jax.random.key(0), 2)
  params = {'w': jnp.zeros(DIM)}
  want = algo.run_rounds(algo.init(params), host, keys)
  got = algo.run_rounds(algo.init(params), indexed, keys)
  _assert_close(got, want)
