"""Offline sources (digits, Synthetic(alpha, beta), stdlib text) and TFDS."""

import os

import numpy as np
import pytest

from fedjx import datasets as fd


# --- digits -------------------------------------------------------------------


def test_load_digits_split_and_partition():
  train, test = fd.load_digits(num_clients=20, alpha=0.1, seed=0, test_fraction=0.2)
  assert train.num_clients == 20
  total = train.examples_per_client().sum()
  assert total + len(test['y']) == 1797 and len(test['y']) == 359
  data = train.client_data(0)
  assert data['x'].shape[1:] == (8, 8, 1) and data['x'].dtype == np.float32
  assert data['y'].dtype == np.int32
  assert 0.0 <= data['x'].min() and data['x'].max() <= 1.0
  skewed = fd.summary(train)['label_tv_distance']
  iid_train, _ = fd.load_digits(num_clients=20, alpha=None, seed=0)
  assert fd.summary(iid_train)['label_tv_distance'] < skewed / 2
  again, test2 = fd.load_digits(num_clients=20, alpha=0.1, seed=0, test_fraction=0.2)
  np.testing.assert_array_equal(again.client_data(3)['x'], train.client_data(3)['x'])
  np.testing.assert_array_equal(test2['y'], test['y'])


# --- Synthetic(alpha, beta) ---------------------------------------------------


def test_synthetic_follows_the_generative_model():
  ds = fd.synthetic(1.0, 1.0, num_clients=5, seed=0, size_sigma=0.1,
                    min_examples=4000)
  for cid in range(3):
    data = ds.client_data(cid)
    w, b, v = ds.client_model(cid)
    assert data['x'].shape == (ds.num_examples(cid), 60) and data['x'].dtype == np.float32
    np.testing.assert_array_equal(data['y'], np.argmax(data['x'] @ w + b, axis=1))
    # x ~ N(v, diag(j^-1.2)).
    centred = data['x'] - v
    # Sampling error with n >= 4000 (fixed seeds, float64: the same on every
    # machine): a mean of variance <= 1 has standard error <= 1/sqrt(n) = 0.016,
    # a variance has relative standard error sqrt(2/n) = 0.022; bounds at ~4.
    np.testing.assert_allclose(centred.mean(0), 0, atol=0.06)
    np.testing.assert_allclose(centred.var(0), np.arange(1, 61) ** -1.2, rtol=0.1)
  np.testing.assert_array_equal(fd.synthetic(1.0, 1.0, 5, 0, size_sigma=0.1,
                                             min_examples=4000).client_data(1)['x'],
                                ds.client_data(1)['x'])


def test_synthetic_alpha_beta_control_heterogeneity():
  def spread(alpha, beta):
    ds = fd.synthetic(alpha, beta, num_clients=300, seed=1, max_examples=60)
    models = [ds.client_model(c) for c in range(300)]
    # mean(W_k) ~ N(u_k, 1/600) and mean(v_k) ~ N(B_k, 1/60), so their spread
    # across clients estimates alpha and beta.
    return (np.std([m[0].mean() for m in models]), np.std([m[2].mean() for m in models]))
  a, b = spread(1.0, 0.5)
  # A standard deviation of 300 draws: relative standard error 1/sqrt(600) = 0.04.
  assert a == pytest.approx(1.0, rel=0.15) and b == pytest.approx(0.5, rel=0.15)
  a0, b0 = spread(0.0, 0.0)
  assert a0 < 0.1 and b0 < 0.2
  iid = fd.synthetic(0, 0, num_clients=3, iid=True)
  np.testing.assert_array_equal(iid.client_model(0)[0], iid.client_model(2)[0])
  assert not iid.client_model(0)[2].any()


def test_synthetic_sizes_are_lognormal_plus_50():
  ds = fd.synthetic(0.5, 0.5, num_clients=4000, seed=2)
  extra = ds.examples_per_client() - 50
  assert extra.min() >= 0
  # floor(LogNormal(4, 2)): median e^4, and P(> e^6) = P(Z > 1) = 0.159.
  # 4000 draws: the median's log has standard error sqrt(pi/2) 2 / sqrt(4000)
  # = 0.04; the binomial share sqrt(0.159 * 0.841 / 4000) = 0.006.
  assert np.median(extra) == pytest.approx(np.exp(4), rel=0.1)
  assert np.mean(extra >= np.exp(6)) == pytest.approx(0.159, abs=0.02)
  capped = fd.synthetic(0.5, 0.5, num_clients=4000, seed=2, max_examples=100)
  np.testing.assert_array_equal(capped.examples_per_client(),
                                np.minimum(extra + 50, 100))


def test_large_synthetic_population_is_generated_on_demand():
  calls = []

  class Counting(fd.SyntheticDataset):
    def _client_data(self, cid):
      calls.append(cid)
      return super()._client_data(cid)

  ds = Counting(0.5, 0.5, num_clients=100_000, seed=0, max_examples=64)
  sampler = fd.CohortSampler(ds, 8, seed=0)
  ids = sampler.sample(12)
  cohort = fd.make_cohort(ds, ids, 16, num_steps=2)
  assert sorted(calls) == sorted(ids.tolist())
  assert cohort.batches['x'].shape == (8, 2, 16, 60)
  assert ids.max() < 100_000
  with pytest.raises(ValueError, match='synthetic: alpha=-1'):
    fd.synthetic(-1, 0)


# --- text corpus --------------------------------------------------------------


def test_text_corpus_bytes_reconstructs_the_module_source():
  corpus = fd.text_corpus(seq_len=32, modules=['json', 'this'])
  assert corpus.vocab_size == 256
  assert [corpus.client_name(c) for c in range(corpus.num_clients)] == ['json', 'this']
  files = corpus.client_files(0)
  assert all(f.parts[-2] == 'json' for f in files)
  raw = b''.join(f.read_bytes() for f in files)
  assert corpus.num_examples(0) == (len(raw) - 1) // 32
  data = corpus.client_data(0)
  n = corpus.num_examples(0)
  assert data['x'].shape == data['y'].shape == (n, 32) and data['x'].dtype == np.int32
  np.testing.assert_array_equal(data['x'].reshape(-1), np.frombuffer(raw, np.uint8)[:n * 32])
  np.testing.assert_array_equal(data['y'].reshape(-1),
                                np.frombuffer(raw, np.uint8)[1:n * 32 + 1])
  assert corpus.decode(data['x'][0]) == raw[:32].decode()
  tokens = fd.text_corpus(seq_len=32, modules=['this'], output='tokens').client_data(0)
  np.testing.assert_array_equal(tokens['tokens'][:, :-1], corpus.client_data(1)['x'])


def test_text_corpus_chars_and_errors():
  corpus = fd.text_corpus(seq_len=16, level='char', modules=['this'])
  assert corpus.vocab_size == 129
  text = corpus.client_files(0)[0].read_text()
  data = corpus.client_data(0)
  assert corpus.num_examples(0) == (len(text) - 1) // 16
  assert corpus.decode(data['x'][0]) == text[:16]
  assert corpus.tokenize('a\u00e9').tolist() == [97, 128]
  with pytest.raises(ValueError, match=r"modules \['no_such_module'\]"):
    fd.text_corpus(modules=['no_such_module'])
  with pytest.raises(ValueError, match="level='word'"):
    fd.text_corpus(level='word', modules=['this'])
  with pytest.raises(FileNotFoundError, match='missing_dir'):
    fd.text_corpus(root='/nonexistent/missing_dir')


def test_text_corpus_groups_a_directory_by_first_component(tmp_path):
  (tmp_path / 'pkg').mkdir()
  (tmp_path / 'pkg' / 'a.txt').write_text('abcdefghij')
  (tmp_path / 'pkg' / 'b.txt').write_text('klmnop')
  (tmp_path / 'solo.txt').write_text('0123456789')
  (tmp_path / 'skip.md').write_text('0123456789')
  corpus = fd.text_corpus(seq_len=4, root=tmp_path, suffixes=('.txt',))
  assert [corpus.client_name(c) for c in range(2)] == ['pkg', 'solo']
  np.testing.assert_array_equal(corpus.examples_per_client(), [3, 2])
  assert corpus.decode(corpus.client_data(0)['x'][2]) == 'ijkl'
  assert corpus.decode(corpus.client_data(0)['y'][2]) == 'jklm'


def test_stdlib_corpus_has_one_client_per_module():
  corpus = fd.text_corpus(seq_len=128)
  names = {corpus.client_name(c) for c in range(corpus.num_clients)}
  assert {'json', 'email', 'asyncio', 'os', 'collections'} <= names
  assert 'test' not in names and 'site-packages' not in names
  assert corpus.num_clients > 100


# --- TFDS ---------------------------------------------------------------------


@pytest.fixture
def mock_mnist(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=40, data_dir=os.fspath(tmp_path)):
    yield tfds


def test_from_tfds_grouped_by_feature_matches_the_source(mock_mnist):
  source = mock_mnist.data_source('mnist', split='train')
  labels = np.array([source[i]['label'] for i in range(len(source))])
  ds = fd.from_tfds('mnist', 'train', group_key='label')
  classes = np.unique(labels)
  assert ds.num_clients == len(classes)
  assert [ds.client_name(c) for c in range(ds.num_clients)] == [str(k) for k in classes]
  np.testing.assert_array_equal(ds.examples_per_client(),
                                [np.sum(labels == k) for k in classes])
  data = ds.client_data(1)
  assert data['image'].shape == (np.sum(labels == classes[1]), 28, 28, 1)
  assert (data['label'] == classes[1]).all()
  first = int(np.flatnonzero(labels == classes[1])[0])
  np.testing.assert_array_equal(data['image'][0], source[first]['image'])


def test_from_tfds_partitioned_and_errors(mock_mnist):
  ds = fd.from_tfds('mnist', 'train',
                    partition=lambda y: fd.partition_iid(y, 4, seed=0))
  assert ds.num_clients == 4
  np.testing.assert_array_equal(ds.examples_per_client(), [10, 10, 10, 10])
  np.testing.assert_array_equal(ds.client_indices(2), fd.partition_iid(40, 4)[2])
  cohort = fd.make_cohort(ds.map(lambda d: {'x': d['image'] / 255.0, 'y': d['label']}),
                          [0, 3], 4)
  assert cohort.batches['x'].shape == (2, 4, 4, 28, 28, 1)
  with pytest.raises(ValueError, match=r"group_key='writer' .*\['image', 'label'\]"):
    fd.from_tfds('mnist', 'train', group_key='writer')
  with pytest.raises(ValueError, match='exactly one'):
    fd.from_tfds('mnist', 'train')


def test_from_tfds_offline_fails_in_one_line_within_seconds(tmp_path, monkeypatch):
  tfds = pytest.importorskip('tensorflow_datasets')
  import time
  from fedjx.datasets import tfds_source

  def unreachable(address, timeout=None):
    raise OSError(101, 'Network is unreachable')

  real_source = tfds.data_source

  def no_download(*args, download=True, **kwargs):
    assert not download, 'a download was attempted'
    return real_source(*args, download=False, **kwargs)

  monkeypatch.setattr(tfds_source.socket, 'create_connection', unreachable)
  monkeypatch.setattr(tfds, 'data_source', no_download)
  start = time.perf_counter()
  with pytest.raises(ConnectionError) as e:
    fd.from_tfds('mnist', 'train', group_key='label', data_dir=os.fspath(tmp_path))
  assert time.perf_counter() - start < 30
  message = str(e.value)
  assert '\n' not in message
  assert "'mnist' is not prepared" in message and 'network is unreachable' in message
  assert 'read_tff_hdf5' in message


def test_tfds_preparation_imports_are_installed():
  # TFDS imports these when it prepares a dataset; a fresh install must have them.
  import importlib_resources  # noqa: F401
  pytest.importorskip('tensorflow_datasets')
  from tensorflow_datasets.core import dataset_builder  # noqa: F401
