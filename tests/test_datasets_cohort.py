"""Cohort sampling, batching with masks, bucketing, placement and prefetch."""

import collections
import gc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjx import datasets as fd


def _dataset(sizes=(1, 5, 13, 8, 3, 2, 9, 4)):
  """Client c holds examples whose 'x' values are c * 100 + 0..size-1."""
  xs = np.concatenate([c * 100 + np.arange(n) for c, n in enumerate(sizes)])
  groups = np.repeat(np.arange(len(sizes)), sizes)
  arrays = {'x': xs.astype(np.float32), 'y': (xs % 7).astype(np.int32),
            'img': np.repeat(xs[:, None, None], 2, 1).repeat(3, 2)}
  return fd.from_arrays(arrays, groups=groups)


# --- sampling -----------------------------------------------------------------


def test_sampler_is_uniform_without_replacement_and_deterministic():
  sampler = fd.CohortSampler(20, 5, seed=7)
  counts = collections.Counter()
  for r in range(2000):
    ids = sampler.sample(r)
    assert ids.dtype == np.int32 and len(set(ids.tolist())) == 5
    assert ids.min() >= 0 and ids.max() < 20
    counts.update(ids.tolist())
  # Each client is in a cohort with probability 5/20: 500 of 2000 rounds.
  assert all(abs(counts[c] - 500) < 75 for c in range(20))
  np.testing.assert_array_equal(fd.CohortSampler(20, 5, seed=7).sample(3),
                                sampler.sample(3))
  assert not np.array_equal(sampler.sample(3), sampler.sample(4))
  assert not np.array_equal(sampler.sample(3), fd.CohortSampler(20, 5, 8).sample(3))


def test_sampler_rejects_cohort_larger_than_population():
  with pytest.raises(ValueError, match=r'cohort_size=9.*\[1, 8\]'):
    fd.CohortSampler(_dataset(), 9)
  with pytest.raises(ValueError, match='cohort_size=0'):
    fd.CohortSampler(_dataset(), 0)


# --- batching -----------------------------------------------------------------


def _real_examples(cohort, c):
  return cohort.batches['x'][c][cohort.mask[c]]


def test_one_epoch_mask_and_contents():
  ds = _dataset()
  ids = [0, 1, 2]
  cohort = fd.make_cohort(ds, ids, 4, shuffle_seed=0)
  # ceil([1, 5, 13] / 4) = [1, 2, 4] steps; bucketed to 4.
  assert cohort.shape == (3, 4, 4)
  assert cohort.batches['img'].shape == (3, 4, 4, 2, 3)
  assert cohort.mask.dtype == np.bool_
  np.testing.assert_array_equal(cohort.num_examples, [1, 5, 13])
  assert cohort.num_examples.dtype == np.float32
  np.testing.assert_array_equal(cohort.client_ids, ids)
  assert cohort.client_ids.dtype == np.int32
  np.testing.assert_array_equal(cohort.mask.sum((1, 2)), [1, 5, 13])
  for c, cid in enumerate(ids):
    np.testing.assert_array_equal(np.sort(_real_examples(cohort, c)),
                                  ds.client_data(cid)['x'])
    # Real examples come first; steps after the last are all padding.
    flat = cohort.mask[c].reshape(-1)
    assert flat[:ds.num_examples(cid)].all() and not flat[ds.num_examples(cid):].any()
    assert (cohort.batches['x'][c][~cohort.mask[c]] == 0).all()
  # Padding steps: client 0 has 1 real step of 4.
  assert not cohort.mask[0, 1:].any()
  # Features stay aligned within an example.
  m = cohort.mask
  np.testing.assert_array_equal(cohort.batches['y'][m],
                                (cohort.batches['x'][m] % 7).astype(np.int32))
  np.testing.assert_array_equal(cohort.batches['img'][m][:, 1, 2],
                                cohort.batches['x'][m])


def test_epochs_repeat_each_example_and_steps_fill_batches():
  ds = _dataset()
  cohort = fd.make_cohort(ds, [1, 2], 4, num_epochs=3, bucket=False)
  assert cohort.shape == (2, 10, 4)  # ceil(3 * 13 / 4) = 10
  for c, cid in enumerate([1, 2]):
    counts = collections.Counter(_real_examples(cohort, c).tolist())
    assert counts == {float(v): 3 for v in ds.client_data(cid)['x']}
    # Each epoch is a permutation of the client's examples.
    n = ds.num_examples(cid)
    stream = cohort.batches['x'][c].reshape(-1)[:3 * n]
    for e in range(3):
      np.testing.assert_array_equal(np.sort(stream[e * n:(e + 1) * n]),
                                    ds.client_data(cid)['x'])
  np.testing.assert_array_equal(cohort.num_examples, [5, 13])

  steps = fd.make_cohort(ds, [0, 2], 4, num_steps=3)
  assert steps.shape == (2, 3, 4) and steps.mask.all()
  # Client 0 (1 example) repeats it; client 2 sees 12 distinct of 13.
  np.testing.assert_array_equal(steps.num_examples, [1, 12])
  assert len(set(_real_examples(steps, 1).tolist())) == 12


def test_max_steps_caps_and_bucket_never_exceeds_it():
  ds = _dataset()
  cohort = fd.make_cohort(ds, [2, 0], 2, num_epochs=1, max_steps=3)
  assert cohort.shape == (2, 3, 2)
  np.testing.assert_array_equal(cohort.mask.sum((1, 2)), [6, 1])
  np.testing.assert_array_equal(cohort.num_examples, [6, 1])


def test_bucketing_gives_powers_of_two():
  ds = _dataset()
  sampler = fd.CohortSampler(ds, 3, seed=0)
  shapes = {fd.make_cohort(ds, sampler.sample(r), 2).shape[1] for r in range(30)}
  assert shapes <= {1, 2, 4, 8}
  assert [fd.bucket_steps(s) for s in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def test_shuffle_is_deterministic_per_seed_round_and_client():
  ds = _dataset()
  a = fd.make_cohort(ds, [2, 6], 4, shuffle_seed=1, round_num=5)
  b = fd.make_cohort(ds, [2, 6], 4, shuffle_seed=1, round_num=5)
  c = fd.make_cohort(ds, [2, 6], 4, shuffle_seed=1, round_num=6)
  np.testing.assert_array_equal(a.batches['x'], b.batches['x'])
  assert not np.array_equal(a.batches['x'], c.batches['x'])
  # A client's order does not depend on the rest of the cohort.
  alone = fd.make_cohort(ds, [6], 4, shuffle_seed=1, round_num=5)
  np.testing.assert_array_equal(alone.batches['x'][0], a.batches['x'][1])
  ordered = fd.make_cohort(ds, [2], 4, shuffle_seed=None)
  np.testing.assert_array_equal(ordered.batches['x'][0].reshape(-1)[:13],
                                ds.client_data(2)['x'])


def test_each_pass_is_a_fresh_permutation_and_every_order_is_equally_likely():
  # Passes: 3 epochs of 5 examples, each a permutation of range(5), cut to 2
  # batches of 4 by max_steps (2 passes, the second cut after 3).
  order, = fd.cohort.example_orders([5], 4, num_epochs=3, max_steps=2,
                                    shuffle=(1, 2, [3]))
  assert len(order) == 8
  assert sorted(order[:5]) == list(range(5)) and len(set(order[5:])) == 3
  # In order without a shuffle; num_steps repeats passes to fill its batches.
  np.testing.assert_array_equal(fd.cohort.example_orders([3], 2, num_steps=4)[0],
                                [0, 1, 2, 0, 1, 2, 0, 1])
  # Over 6,000 (round, client) streams of 3 examples, each of the 6 orders
  # should come 1,000 times: Pearson's chi-square with 5 degrees of freedom
  # exceeds 30 with probability 1.5e-5 for uniform permutations.
  orders = [tuple(o) for r in range(60) for o in fd.cohort.example_orders(
      [3] * 100, 3, shuffle=(0, r, np.arange(100)))]
  counts = np.array(list(collections.Counter(orders).values()))
  assert len(counts) == 6
  assert np.sum((counts - 1000) ** 2 / 1000) < 30


def test_shuffle_hash_keys_must_be_non_negative_ints():
  with pytest.raises(ValueError, match='non-negative ints'):
    fd._seeding.hashed(2, 1, np.array([3, -1]))  # pylint: disable=protected-access


def test_make_cohort_bad_input():
  ds = _dataset()
  with pytest.raises(ValueError, match='batch_size=0.*>= 1'):
    fd.make_cohort(ds, [0], 0)
  with pytest.raises(ValueError, match='not both'):
    fd.make_cohort(ds, [0], 2, num_epochs=1, num_steps=2)
  with pytest.raises(ValueError, match=r'client id 99 .*\[0, 8\)'):
    fd.make_cohort(ds, [99], 2)
  mixed = ds.map(lambda d: {'x': d['x'], 'y': d['y'], 'img': d['img'][:, :1]}
                 if len(d['x']) == 1 else d)
  with pytest.raises(ValueError, match="feature 'img'"):
    fd.make_cohort(mixed, [0, 1], 2)


# --- placement and prefetch ---------------------------------------------------


def test_place_cohort_shards_clients_axis_on_8_devices():
  assert jax.device_count() == 8
  ds = _dataset()
  mesh = jax.make_mesh((8,), ('clients',))
  cohort = fd.make_cohort(ds, np.arange(8), 4)
  placed = fd.place_cohort(cohort, mesh)
  expected = NamedSharding(mesh, P('clients'))
  for leaf in jax.tree.leaves(placed):
    assert isinstance(leaf, jax.Array)
    assert leaf.sharding.is_equivalent_to(expected, leaf.ndim)
    assert len(leaf.addressable_shards) == 8
    assert leaf.addressable_shards[0].data.shape[0] == 1
  np.testing.assert_array_equal(placed.batches['x'], cohort.batches['x'])
  np.testing.assert_array_equal(placed.mask, cohort.mask)
  with pytest.raises(ValueError, match="6 clients .* 'clients' of size 8"):
    fd.place_cohort(fd.make_cohort(ds, np.arange(6), 4), mesh)
  two_d = jax.make_mesh((4, 2), ('clients', 'model'))
  placed = fd.place_cohort(fd.make_cohort(ds, np.arange(4), 4), two_d)
  assert placed.mask.sharding.is_equivalent_to(
      NamedSharding(two_d, P('clients')), 3)
  other = jax.make_mesh((8,), ('data',))
  placed = fd.place_cohort(cohort, other)
  assert placed.mask.sharding.is_fully_replicated


def test_prefetch_matches_synchronous_loading_and_resume():
  ds = _dataset()
  mesh = jax.make_mesh((4,), ('clients',), devices=jax.devices()[:4])
  kwargs = dict(seed=3, num_epochs=2, mesh=mesh)
  with fd.cohort_iterator(ds, 4, 2, num_rounds=5, prefetch=2, **kwargs) as it:
    background = list(it)
  sync = list(fd.cohort_iterator(ds, 4, 2, num_rounds=5, prefetch=0, **kwargs))
  resumed = list(fd.cohort_iterator(ds, 4, 2, start_round=3, num_rounds=2,
                                    prefetch=1, **kwargs))
  sampler = fd.CohortSampler(ds, 4, seed=3)
  assert len(background) == len(sync) == 5
  for r in range(5):
    manual = fd.make_cohort(ds, sampler.sample(r), 2, num_epochs=2,
                            shuffle_seed=3, round_num=r)
    for got in [background[r], sync[r]] + ([resumed[r - 3]] if r >= 3 else []):
      jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), manual)
      assert got.mask.sharding.is_equivalent_to(NamedSharding(mesh, P('clients')), 3)


def test_prefetcher_propagates_errors_in_order():
  def produce(r):
    if r == 3:
      raise RuntimeError('bad round 3')
    return r * 10

  with fd.Prefetcher(produce, start=1, prefetch=2) as it:
    assert next(it) == 10 and next(it) == 20
    with pytest.raises(RuntimeError, match='bad round 3'):
      next(it)
  assert list(fd.Prefetcher(produce, start=0, stop=3, prefetch=0)) == [0, 10, 20]
  with pytest.raises(ValueError, match='prefetch=-1'):
    fd.Prefetcher(produce, prefetch=-1)


# --- evaluation batches -------------------------------------------------------


def test_eval_batches_and_eval_cohorts():
  x = np.arange(10.0)
  batches, mask = fd.eval_batches({'x': x, 'y': x > 4}, 4)
  assert batches['x'].shape == (3, 4) and mask.shape == (3, 4)
  np.testing.assert_array_equal(batches['x'][mask], x)
  np.testing.assert_array_equal(mask.sum(1), [4, 4, 2])
  with pytest.raises(ValueError, match='batch_size=0'):
    fd.eval_batches({'x': x}, 0)

  ds = _dataset()
  cohorts = list(fd.eval_cohorts(ds, 3, 4, place=False))
  assert len(cohorts) == 3
  ids = np.concatenate([c.client_ids for c in cohorts])
  np.testing.assert_array_equal(ids, list(range(8)) + [-1])
  last = cohorts[-1]
  assert not last.mask[-1].any() and last.num_examples[-1] == 0
  total = sum(c.mask.sum() for c in cohorts)
  assert total == ds.examples_per_client().sum()
  for c in cohorts:
    for i, cid in enumerate(c.client_ids):
      if cid >= 0:
        np.testing.assert_array_equal(c.batches['x'][i][c.mask[i]],
                                      ds.client_data(cid)['x'])


def test_abandoned_prefetcher_stops_its_worker():
  it = fd.Prefetcher(lambda r: r, prefetch=2)
  assert next(it) == 0
  worker = it._thread  # pylint: disable=protected-access
  del it
  gc.collect()
  worker.join(timeout=2.0)
  assert not worker.is_alive()


def test_cohort_from_explicit_per_client_arrays():
  rng = np.random.default_rng(5)
  clients = [{'x': rng.normal(size=(n, 2)).astype(np.float32),
              'y': np.arange(n, dtype=np.int32)} for n in (5, 0, 3)]
  cohort = fd.Cohort.from_clients(clients, 2, client_ids=[7, 1, 4])
  assert cohort.shape == (3, 3, 2)
  np.testing.assert_array_equal(cohort.num_examples, [5, 0, 3])
  np.testing.assert_array_equal(cohort.client_ids, [7, 1, 4])
  for i, c in enumerate(clients):  # In order, then zeros with mask False.
    n = len(c['y'])
    flat = cohort.batches['x'][i].reshape(-1, 2)
    np.testing.assert_array_equal(flat[:n], c['x'])
    assert not flat[n:].any()
    np.testing.assert_array_equal(cohort.mask[i].reshape(-1),
                                  np.arange(6) < n)
  assert fd.Cohort.from_clients(clients, 2, steps=4).shape == (3, 4, 2)
  for kwargs, match in ((dict(steps=2), 'steps=2'),
                        (dict(client_ids=[1]), 'client_ids'),
                        (dict(batch_size=0), 'batch_size')):
    args = dict(batch_size=2, **kwargs) if 'batch_size' not in kwargs else kwargs
    with pytest.raises(ValueError, match=match):
      fd.Cohort.from_clients(clients, **args)
  with pytest.raises(ValueError, match='keys'):
    fd.Cohort.from_clients([{'x': np.ones(2)}, {'z': np.ones(2)}], 2)


class _ThreeOfFive:
  """A sampler that draws 3 clients into cohorts of 5 (padding fills the rest)."""

  cohort_size = 5
  seed = 0

  def sample(self, round_num):
    return np.array([round_num % 4, 4, 6], np.int32)


def test_a_sampler_drawing_fewer_clients_gets_padding_clients():
  population = fd.from_arrays(
      {'x': np.arange(40, dtype=np.float32)[:, None],
       'c': np.repeat(np.arange(8), 5)}, group_key='c')
  it = fd.cohort_iterator(population, 5, 2, sampler=_ThreeOfFive(),
                                num_rounds=2, prefetch=0)
  cohorts = list(it)
  assert [c.client_ids.tolist() for c in cohorts] == [
      [0, 4, 6, -1, -1], [1, 4, 6, -1, -1]]
  for c in cohorts:
    assert np.asarray(c.num_examples).tolist() == [5, 5, 5, 0, 0]
    assert not np.asarray(c.mask)[3:].any()
    assert np.asarray(c.mask)[:3].any(axis=(1, 2)).all()
    np.testing.assert_array_equal(np.asarray(c.batches['x'])[3:], 0)
  # The real clients' batches are those of an unpadded cohort.
  plain = fd.make_cohort(population, [1, 4, 6], 2, round_num=1)
  np.testing.assert_array_equal(np.asarray(cohorts[1].batches['x'])[:3],
                                plain.batches['x'])


def test_a_cohort_of_only_padding_clients_has_the_real_shapes():
  population = fd.from_arrays(
      {'x': np.ones((6, 3), np.float32), 'c': np.repeat(np.arange(3), 2)},
      group_key='c')
  c = fd.make_cohort(population, [], 2, num_steps=4, pad_to=2)
  assert c.batches['x'].shape == (2, 4, 2, 3)
  assert not c.mask.any() and c.num_examples.tolist() == [0, 0]
  with pytest.raises(ValueError, match='pad_to=1 is smaller than the 2'):
    fd.make_cohort(population, [0, 1], 2, pad_to=1)


@pytest.mark.parametrize('name', ['fedavg', 'scaffold'])
def test_padding_clients_leave_a_round_unchanged(name):
  import jax.numpy as jnp
  import optax
  from fedjx import algorithms as fa
  rng = np.random.RandomState(0)
  pop = fd.from_arrays({'x': rng.randn(40, 3).astype(np.float32),
                        'y': rng.randn(40).astype(np.float32),
                        'c': np.repeat(np.arange(8), 5)}, group_key='c')
  loss = lambda p, b: (b['x'] @ p['w'] - b['y']) ** 2
  opts = dict(client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0))
  algo = (fa.fedavg(loss, **opts) if name == 'fedavg' else
          fa.scaffold(loss, num_clients=8, client_learning_rate=0.1, **opts))
  key = jax.random.key(0)
  padded, _ = algo.round(algo.init({'w': jnp.zeros(3)}),
                         fd.make_cohort(pop, [1, 4, 6], 2, pad_to=5), key)
  plain, _ = algo.round(algo.init({'w': jnp.zeros(3)}),
                        fd.make_cohort(pop, [1, 4, 6], 2), key)
  # Padding clients add exact zeros to every sum: the results are identical.
  jax.tree.map(np.testing.assert_array_equal, padded, plain)
