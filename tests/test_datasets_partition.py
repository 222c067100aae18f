"""Federated datasets from arrays, partitioners, summaries and held-out splits."""

import numpy as np
import pytest

from fedjx import datasets as fd


def _labels(n=6000, classes=10, seed=0):
  return np.random.default_rng(seed).integers(0, classes, n)


def _tv_from_pooled(labels, groups):
  """Mean total variation distance of client label mixes from the pooled mix."""
  classes = np.unique(labels)
  hist = np.array([[np.sum(labels[g] == k) for k in classes] for g in groups], float)
  q = hist / hist.sum(1, keepdims=True)
  p = hist.sum(0) / hist.sum()
  return 0.5 * np.abs(q - p).sum(1).mean(), (hist > 0).sum(1).mean()


def _assert_partition(groups, n):
  """Groups are sorted, disjoint and cover range(n)."""
  for g in groups:
    assert np.all(np.diff(g) > 0)
  np.testing.assert_array_equal(np.sort(np.concatenate(groups)), np.arange(n))


# --- from_arrays --------------------------------------------------------------


def test_from_arrays_group_key_makes_one_client_per_value():
  writer = np.array([3, 1, 3, 2, 1, 3])
  x = np.arange(12).reshape(6, 2)
  ds = fd.from_arrays({'x': x, 'writer': writer}, group_key='writer')
  assert ds.num_clients == 3
  assert [ds.client_name(c) for c in range(3)] == ['1', '2', '3']
  np.testing.assert_array_equal(ds.examples_per_client(), [2, 1, 3])
  np.testing.assert_array_equal(ds.client_data(2)['x'], x[[0, 2, 5]])
  np.testing.assert_array_equal(ds.client_ids, [0, 1, 2])
  assert ds.client_ids.dtype == np.int32


def test_from_arrays_groups_as_index_lists_and_assignment():
  x = np.arange(5) * 10
  by_lists = fd.from_arrays({'x': x}, groups=[[4, 0], [1, 2, 3]])
  np.testing.assert_array_equal(by_lists.client_data(0)['x'], [40, 0])
  by_assign = fd.from_arrays({'x': x}, groups=np.array([1, 0, 0, 1, 1]))
  np.testing.assert_array_equal(by_assign.client_data(0)['x'], [10, 20])
  np.testing.assert_array_equal(by_assign.client_data(1)['x'], [0, 30, 40])


def test_from_arrays_bad_input_names_argument_and_allowed_values():
  arrays = {'x': np.zeros(4), 'y': np.zeros(4)}
  with pytest.raises(ValueError, match=r"group_key='writer'.*\['x', 'y'\]"):
    fd.from_arrays(arrays, group_key='writer')
  with pytest.raises(ValueError, match='client 1 has no examples'):
    fd.from_arrays(arrays, groups=np.array([0, 0, 2, 2]))
  with pytest.raises(ValueError, match='exactly one'):
    fd.from_arrays(arrays)
  with pytest.raises(ValueError, match='different numbers of examples'):
    fd.from_arrays({'x': np.zeros(4), 'y': np.zeros(3)}, groups=[[0]])
  with pytest.raises(ValueError, match=r'outside \[0, 4\)'):
    fd.from_arrays(arrays, groups=[[0, 4]])
  ds = fd.from_arrays(arrays, groups=[[0], [1, 2, 3]])
  with pytest.raises(ValueError, match=r'client id 2 .* \[0, 2\)'):
    ds.client_data(2)


def test_subset_and_map_are_lazy_views():
  ds = fd.from_arrays({'x': np.arange(6.0)}, groups=[[0], [1, 2], [3, 4, 5]])
  sub = ds.subset([2, 0])
  assert sub.num_clients == 2
  assert [sub.client_name(0), sub.client_name(1)] == ['2', '0']
  np.testing.assert_array_equal(sub.examples_per_client(), [3, 1])
  doubled = ds.map(lambda d: {'x': d['x'] * 2, 'y': d['x'] > 3})
  np.testing.assert_array_equal(doubled.client_data(2)['x'], [6, 8, 10])
  np.testing.assert_array_equal(doubled.client_data(2)['y'], [False, True, True])
  with pytest.raises(ValueError, match='keep the number of examples'):
    ds.map(lambda d: {'x': d['x'][:1]}).client_data(1)


# --- partitioners -------------------------------------------------------------


def test_iid_is_balanced_and_deterministic():
  labels = _labels()
  groups = fd.partition_iid(labels, 20, seed=1)
  _assert_partition(groups, len(labels))
  sizes = [len(g) for g in groups]
  assert max(sizes) - min(sizes) <= 1
  tv, classes = _tv_from_pooled(labels, groups)
  assert tv < 0.1 and classes == 10
  again = fd.partition_iid(labels, 20, seed=1)
  assert all(np.array_equal(a, b) for a, b in zip(groups, again))
  other = fd.partition_iid(labels, 20, seed=2)
  assert not all(np.array_equal(a, b) for a, b in zip(groups, other))


def test_dirichlet_small_alpha_skews_labels_large_alpha_does_not():
  labels = _labels()
  skewed = fd.partition_dirichlet(labels, 20, alpha=0.05, seed=0)
  near_iid = fd.partition_dirichlet(labels, 20, alpha=1000.0, seed=0)
  _assert_partition(skewed, len(labels))
  _assert_partition(near_iid, len(labels))
  tv_small, classes_small = _tv_from_pooled(labels, skewed)
  tv_large, classes_large = _tv_from_pooled(labels, near_iid)
  assert tv_small > 0.6 and classes_small < 3.5
  assert tv_large < 0.1 and classes_large == 10
  # Equal sizes by default (every example used).
  assert max(map(len, skewed)) - min(map(len, skewed)) <= 1
  again = fd.partition_dirichlet(labels, 20, alpha=0.05, seed=0)
  assert all(np.array_equal(a, b) for a, b in zip(skewed, again))


def test_dirichlet_client_sizes_and_errors():
  labels = _labels(1000)
  sizes = fd.quantity_skew_sizes(900, 10, sigma=1.0, seed=3)
  groups = fd.partition_dirichlet(labels, 10, alpha=0.5, client_sizes=sizes)
  np.testing.assert_array_equal([len(g) for g in groups], sizes)
  assert len(np.unique(np.concatenate(groups))) == 900
  with pytest.raises(ValueError, match=r'alpha=0\.0.*> 0'):
    fd.partition_dirichlet(labels, 10, alpha=0.0)
  with pytest.raises(ValueError, match=r'num_clients=2000 .* only 1000'):
    fd.partition_dirichlet(labels, 2000, alpha=1.0)


def test_quantity_skew_sizes():
  n = 10000
  for distribution in ('lognormal', 'power_law'):
    groups = fd.partition_quantity_skew(n, 50, distribution=distribution,
                                        sigma=1.5, exponent=1.0, seed=0,
                                        min_examples=5)
    _assert_partition(groups, n)
    sizes = np.array([len(g) for g in groups])
    assert sizes.min() >= 5
    assert sizes.max() > 3 * np.median(sizes)
  sizes = fd.quantity_skew_sizes(n, 50, sigma=1.5, seed=0, min_examples=5)
  # Independent check of the allocation: min + largest-remainder shares.
  w = np.random.default_rng(np.random.SeedSequence([3, 0, 2])).lognormal(0, 1.5, 50)
  share = (n - 250) * w / w.sum()
  assert np.all(np.abs(sizes - 5 - share) < 1)
  with pytest.raises(ValueError, match=r"distribution='zipf' .*lognormal"):
    fd.partition_quantity_skew(n, 5, distribution='zipf')


def test_partition_by_feature():
  groups = fd.partition_by_feature(np.array(['b', 'a', 'b', 'c']))
  assert [g.tolist() for g in groups] == [[1], [0, 2], [3]]


# --- summary ------------------------------------------------------------------


def test_summary_matches_independent_statistics():
  labels = _labels(2000)
  groups = fd.partition_dirichlet(labels, 8, alpha=0.3, seed=4)
  ds = fd.from_arrays({'x': np.zeros((2000, 3)), 'y': labels}, groups=groups)
  stats = fd.summary(ds)
  sizes = np.array([len(g) for g in groups])
  assert stats['num_clients'] == 8 and stats['num_examples'] == 2000
  np.testing.assert_array_equal(stats['examples_per_client'], sizes)
  assert stats['size_std'] == pytest.approx(sizes.std())
  hist = np.array([np.bincount(labels[g], minlength=10) for g in groups])
  np.testing.assert_array_equal(stats['label_histogram'], hist)
  tv, classes = _tv_from_pooled(labels, groups)
  assert stats['label_tv_distance'] == pytest.approx(tv)
  assert stats['classes_per_client'] == pytest.approx(classes)
  text = fd.format_summary(stats)
  assert 'clients: 8' in text and 'classes per client' in text
  sampled = fd.summary(ds, max_clients=3)
  assert sampled['label_histogram'].shape[0] == 3
  with pytest.raises(ValueError, match="label_key='z'"):
    fd.summary(ds, label_key='z')


# --- held-out splits ----------------------------------------------------------


def test_split_examples_is_a_per_client_partition():
  x = np.arange(40)
  ds = fd.from_arrays({'x': x}, groups=[np.arange(0, 10), np.arange(10, 13),
                                        np.arange(13, 40)])
  train, test = fd.split_examples(ds, test_fraction=0.25, seed=0)
  assert train.num_clients == test.num_clients == 3
  for c in range(3):
    a, b = train.client_data(c)['x'], test.client_data(c)['x']
    assert len(a) == train.num_examples(c) and len(b) == test.num_examples(c)
    assert len(b) == min(max(1, round(0.25 * ds.num_examples(c))),
                         ds.num_examples(c) - 1)
    np.testing.assert_array_equal(np.sort(np.concatenate([a, b])),
                                  ds.client_data(c)['x'])
  np.testing.assert_array_equal(
      fd.split_examples(ds, 0.25, seed=0)[1].client_data(2)['x'],
      test.client_data(2)['x'])
  tiny = fd.from_arrays({'x': x[:3]}, groups=[[0, 1], [2]])
  with pytest.raises(ValueError, match="client 1 .* 1 example"):
    fd.split_examples(tiny)


def test_split_clients_is_disjoint_and_covering():
  ds = fd.from_arrays({'x': np.arange(10)}, groups=np.arange(10))
  train, test = fd.split_clients(ds, test_fraction=0.3, seed=5)
  assert (train.num_clients, test.num_clients) == (7, 3)
  names = [train.client_name(c) for c in range(7)] + [
      test.client_name(c) for c in range(3)]
  assert sorted(names, key=int) == [str(i) for i in range(10)]
  with pytest.raises(ValueError, match=r'test_fraction=1\.5'):
    fd.split_clients(ds, test_fraction=1.5)
