"""fedjx.streaming: rounds with clients streamed in chunks equal compiled rounds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
from fedjx import algorithms
from fedjx import datasets
from fedjx import distributed
from fedjx import streaming

CLIENTS = 23  # Not a multiple of the chunk sizes below: the last chunk is padded.


def _loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def _cohort(seed, clients=CLIENTS, steps=2, batch=4):
  rng = np.random.default_rng(seed)
  batches = {'x': rng.normal(size=(clients, steps, batch, 5)).astype(np.float32),
             'y': rng.integers(0, 3, size=(clients, steps, batch)).astype(np.int32)}
  mask = np.ones((clients, steps, batch), bool)
  mask[::3, 1] = False
  mask[::7, 0, 2:] = False
  return datasets.Cohort(batches, mask, mask.sum((1, 2)).astype(np.float32),
                         np.arange(clients, dtype=np.int32))


def _params():
  return {'w': jnp.full((5, 3), 0.01), 'b': jnp.zeros(3)}


def _assert_close(got, want, tol=1e-5):
  # The streamed sums run in another order (chunks, compensated across
  # chunks): float32 summation-order differences of O(n eps) ~ 1e-6.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jax.dtypes.issubdtype(jnp.result_type(w), jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=tol, atol=tol)


SUPPORTED = {
    'fedavg': lambda: algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1)),
    'fedadam': lambda: algorithms.fedadam(_loss, client_optimizer=optax.sgd(0.1)),
    'fedprox': lambda: algorithms.fedprox(_loss, mu=0.1, client_optimizer=optax.sgd(0.1)),
    'dp_fedavg': lambda: algorithms.dp_fedavg(_loss, clip_norm=0.05, noise_multiplier=0.5,
                                              client_optimizer=optax.sgd(0.1)),
    'scaffold': lambda: algorithms.scaffold(_loss, CLIENTS + 5,
                                            client_optimizer=optax.sgd(0.1)),
    'diloco': lambda: algorithms.diloco(_loss, CLIENTS),
}


@pytest.mark.parametrize('name', sorted(SUPPORTED))
@pytest.mark.slow
def test_streamed_round_equals_compiled_round(name):
  algo = SUPPORTED[name]()
  state, key = algo.init(_params()), jax.random.key(3)
  cohort = _cohort(0)
  want = jax.jit(algo.apply)(state, cohort, key)
  got = streaming.run(algo.apply, state, streaming.Clients.from_arrays(cohort), key,
                      chunk_size=5)
  _assert_close(got, want)


@pytest.mark.parametrize('inner', [1, 2])
@pytest.mark.slow
def test_clients_inside_a_chunk_one_at_a_time_or_in_groups(monkeypatch, inner):
  # Large clients run one at a time inside a chunk (small ones vmapped): the
  # chunk's sums are carried from client to client, never stacked.
  monkeypatch.setattr(streaming, '_inner_chunk', lambda *args: inner)
  for name in ('fedavg', 'scaffold'):  # SCAFFOLD also collects per-client state.
    algo = SUPPORTED[name]()
    state, key = algo.init(_params()), jax.random.key(3)
    cohort = _cohort(1)
    want = jax.jit(algo.apply)(state, cohort, key)
    got = streaming.run(algo.apply, state, streaming.Clients.from_arrays(cohort), key,
                        chunk_size=6)
    _assert_close(got, want)



def _round_under_mesh(name, axis_types):
  """The streamed round under a mesh of every host device, and the
  unstreamed round (compiled, no mesh) it must equal."""
  algo = SUPPORTED[name]()
  state, key = algo.init(_params()), jax.random.key(3)
  cohort = _cohort(4)
  want = jax.jit(algo.apply)(state, cohort, key)
  with jax.set_mesh(distributed.make_mesh({'clients': -1}, axis_types)):
    # 5 clients a chunk, rounded up to 8 (one per device) on an Auto mesh;
    # 23 clients: the last chunk is padded.
    got = streaming.run(algo.apply, state, streaming.Clients.from_arrays(cohort), key,
                        chunk_size=5)
  return got, want


def test_a_streamed_round_under_the_auto_mesh_equals_the_unstreamed_round():
  # config.mesh='auto' sets a mesh with a 'clients' axis over every device:
  # the plan is traced with no mesh (map_fn would lay the clients over the
  # devices, and the per-client computation could not be recovered), and
  # each chunk's clients are split over the devices.
  devices = len(jax.devices())
  assert devices > 1  # tests/conftest.py: 8 host devices.
  with jax.set_mesh(distributed.make_mesh({'clients': -1})):
    mesh, d = streaming._devices('clients', 5)
    assert (d, mesh.shape['clients']) == (devices, devices)
  with jax.set_mesh(distributed.make_mesh({'clients': -1}, 'explicit')):
    assert streaming._devices('clients', 5) == (None, 1)  # One device runs a chunk.
  got, want = _round_under_mesh('fedprox', 'auto')
  _assert_close(got, want)


@pytest.mark.parametrize('axis_types', ['auto', 'explicit'])
@pytest.mark.parametrize('name', sorted(SUPPORTED))
@pytest.mark.slow
def test_every_streamable_round_under_a_mesh_equals_the_unstreamed_round(name, axis_types):
  got, want = _round_under_mesh(name, axis_types)
  _assert_close(got, want)

@pytest.mark.slow
def test_rounds_in_a_row_trace_once_and_chunks_of_one():
  algo = SUPPORTED['scaffold']()
  traces = []

  def apply(*args):
    traces.append(1)
    return algo.apply(*args)

  streamer = streaming.Streamer(apply, chunk_size=5)
  state, key = algo.init(_params()), jax.random.key(0)
  want, got = state, state
  for r in range(2):
    cohort = _cohort(r)
    want, _ = jax.jit(algo.apply)(want, cohort, key)
    got, _ = streamer(got, streaming.Clients.from_arrays(cohort), key)
  _assert_close(got, want)
  assert len(traces) == 1  # The plan and the compiled chunk work are reused.
  got_one, _ = streaming.run(algo.apply, state, streaming.Clients.from_arrays(_cohort(0)),
                             key, chunk_size=1)
  _assert_close(got_one, jax.jit(algo.apply)(state, _cohort(0), key)[0])


def test_clients_from_a_dataset_are_loaded_in_chunks():
  population = datasets.synthetic(1.0, 1.0, num_clients=9, seed=0, max_examples=60)
  ids = [4, 0, 7, 2, 8]
  loads = []
  source = datasets.streaming_clients(population, ids, batch_size=2, num_steps=3)
  counting = streaming.Clients(source.client_ids,
                               lambda chunk: loads.append(list(chunk)) or source.load(chunk),
                               source.spec)
  algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.05))
  state = algo.init({'w': jnp.zeros((60, 10)), 'b': jnp.zeros(10)})
  key = jax.random.key(0)
  cohort = datasets.make_cohort(population, np.asarray(ids, np.int32), 2, num_steps=3,
                                shuffle_seed=0, bucket=False)
  want = jax.jit(algo.apply)(state, cohort, key)
  got = streaming.run(algo.apply, state, counting, key, chunk_size=2)
  _assert_close(got, want)
  assert loads == [[4, 0], [7, 2], [8]]  # One chunk at a time, never all.


def test_compensated_sum_of_many_small_terms():
  # 3,000 chunks of one client adding 1e-4 to 1.0: float32 running sums lose
  # ~half of every addend; the compensated sum is exact to float32.
  n = 3000

  @fedjx.program(clients=n)
  def total(x):
    return fedjx.reduce_sum(fedjx.map_fn(lambda v: v, x))

  x = np.full((n,), 1e-4, np.float32)
  x[0] = 1.0
  got = streaming.run(total, streaming.Clients.from_arrays(x), chunk_size=1)
  want = 1.0 + (n - 1) * np.float64(np.float32(1e-4))
  assert abs(float(got) - want) <= 2 * 2.0**-24 * want


def test_per_client_outputs_come_back_on_the_host_gathered_chunk_by_chunk():
  @fedjx.program(clients=7)
  def per_client(x):
    return fedjx.map_fn(lambda v: v * 2, x), fedjx.reduce_sum(x)

  x = np.arange(14, dtype=np.float32).reshape(7, 2)
  doubled, total = streaming.run(per_client, streaming.Clients.from_arrays(x),
                                 chunk_size=3)
  assert isinstance(doubled, np.ndarray)
  np.testing.assert_array_equal(doubled, 2 * x)  # Exact: one product each.
  np.testing.assert_array_equal(np.asarray(total), x.sum(0))  # Small integers.


def test_a_client_value_used_after_its_reduction_is_computed_again():
  """The variance around the cohort's mean reads each client's y after the
  mean: the second pass runs the client work that made y again (nothing
  per client is kept), and the result is the variance."""
  @fedjx.program(clients=5)
  def variance(x):
    y = fedjx.map_fn(lambda v: v * 2, x)
    mean = fedjx.reduce_mean(y)
    return fedjx.reduce_mean(fedjx.map_fn(lambda a, m: (a - m) ** 2,
                                          (y, fedjx.broadcast(mean))))

  x = np.array([0.5, -1.0, 2.0, 3.5, 1.25], np.float32)
  got = streaming.run(variance, streaming.Clients.from_arrays(jnp.asarray(x)),
                      chunk_size=2)
  # float32 sums of 5 terms: a few ulps of the largest term (2 * 3.5)^2.
  np.testing.assert_allclose(float(got), np.var(2 * x.astype(np.float64)),
                             rtol=0, atol=8 * 49 * 2 ** -24)


def test_chunk_size_is_checked():
  with pytest.raises(ValueError, match='chunk_size=0'):
    streaming.run(lambda x: x, streaming.Clients.from_arrays(jnp.ones(2)), chunk_size=0)


def test_a_round_that_is_not_a_plan_is_a_clear_error():
  # Streaming DiLoCo branches on client values outside map_fn (docs/beam.md).
  algo = algorithms.streaming_diloco(_loss, CLIENTS)
  state = algo.init(_params())
  with pytest.raises(ValueError, match="'cond' at streaming_diloco_lib.py.*inside a loop or a branch"):
    streaming.run(algo.apply, state, streaming.Clients.from_arrays(_cohort(0)),
                  jax.random.key(0), chunk_size=5)


def test_a_store_backed_round_streams_its_rows_in_and_out_chunk_by_chunk():
  # SCAFFOLD with its c_i in a ClientStore: the rows come in with each chunk
  # of clients (read from the store as the chunk loads) and the new rows come
  # back as a host array gathered chunk by chunk; both equal the compiled round.
  algo = algorithms.scaffold(_loss, CLIENTS + 5, client_optimizer=optax.sgd(0.1),
                             client_state='store')
  params = _params()
  store = fedjx.ClientStore(jax.tree.map(np.asarray, algo.client_state_init(params)),
                            CLIENTS + 5)
  ids = np.arange(CLIENTS, dtype=np.int32)
  store.write(ids[::2], jax.tree.map(  # Some clients already hold a row.
      lambda a: np.random.default_rng(0).normal(
          size=(len(ids[::2]),) + a.shape).astype(np.float32) * 0.01,
      algo.client_state_init(params)))
  cohort = _cohort(2)
  reads = []

  def load(chunk):
    chunk = np.asarray(chunk)
    reads.append(len(chunk))
    part = jax.tree.map(lambda a: a[chunk], cohort)
    return part._replace(client_states=store.read(ids[chunk]))

  spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                      cohort._replace(client_states=store.read(ids)))
  state, key = algo.init(params), jax.random.key(5)
  want = jax.jit(algo.apply)(state, cohort._replace(client_states=store.read(ids)), key)
  got = streaming.run(algo.apply, state, streaming.Clients(range(CLIENTS), load, spec),
                      key, chunk_size=5)
  assert max(reads) <= 5  # Never the whole cohort's rows at once.
  rows = got[2]
  assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(rows))
  _assert_close(got, want)


def test_keep_takes_each_chunks_per_client_outputs_and_loads_may_reuse_memory():
  # The program's per-client output handed to ``keep`` chunk by chunk (in
  # order, padding dropped) equals the gathered one; the program returns None
  # in its place. The source reuses one buffer for every chunk it loads (a
  # chunk is on the device before the next load), and an input of the
  # per-client output's shape is donated to the chunk's work: the results
  # are those of fresh memory.
  @fedjx.program(clients=7)
  def per_client(x):
    return fedjx.map_fn(lambda v: v * 2 + 1, x), fedjx.reduce_sum(x)

  x = np.arange(14, dtype=np.float32).reshape(7, 2)
  # Aligned to 64 bytes: memory a CPU device would alias rather than copy.
  raw = np.empty(6 + 16, np.float32)
  start = (-raw.ctypes.data % 64) // 4
  buffer = raw[start:start + 6].reshape(3, 2)
  assert buffer.ctypes.data % 64 == 0

  def load(ids):
    ids = np.asarray(ids)
    out = buffer[:len(ids)]
    np.take(x, ids, axis=0, out=out)
    return out

  kept = []
  clients = streaming.Clients(range(7), load, jax.ShapeDtypeStruct((2,), np.float32))
  clients = clients.with_keep(lambda ids, outs: kept.append((list(ids), outs[0].copy(),
                                                              outs[1])))
  doubled, total = streaming.run(per_client, clients, chunk_size=3)
  assert doubled is None
  assert [ids for ids, _, _ in kept] == [[0, 1, 2], [3, 4, 5], [6]]
  assert all(rest is None for _, _, rest in kept)
  np.testing.assert_array_equal(np.concatenate([rows for _, rows, _ in kept]), 2 * x + 1)
  np.testing.assert_array_equal(np.asarray(total), x.sum(0))  # Small integers.
