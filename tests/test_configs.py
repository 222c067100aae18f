"""Every config in configs/ loads, validates, and names registered builders;
the offline ones build and run a round."""

import glob
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from config_files import load

from fedjx.experiments import client_states
from fedjx.experiments import config as config_lib
from fedjx.experiments import config_base
from fedjx.experiments import experiment
from fedjx.experiments import registry

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          'configs')
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, '*.py')))
OFFLINE = {'digits', 'synthetic', 'text'}


def test_the_issue_s_configs_exist():
  names = {os.path.basename(p)[:-3] for p in CONFIG_FILES}
  for required in ('fedavg_digits', 'fedadam_digits', 'fedyogi_digits',
                   'fedprox_synthetic', 'scaffold_synthetic', 'diloco_text',
                   'streaming_diloco_text', 'dp_fedavg_digits', 'emnist',
                   'shakespeare', 'stackoverflow', 'cifar100'):
    assert required in names


@pytest.mark.parametrize('path', CONFIG_FILES, ids=os.path.basename)
def test_config_validates(path):
  config = config_lib.validate(load(path))
  assert config.dataset.name in registry.DATASETS
  assert config.model.name in registry.MODELS
  assert config.algorithm.name in registry.ALGORITHMS


@pytest.mark.parametrize('task', sorted(config_base.REDDI_2021_LEARNING_RATES))
def test_reddi_configs_accept_every_algorithm(task):
  path = os.path.join(CONFIG_DIR, f'{task}.py')
  for algorithm in config_base.REDDI_2021_LEARNING_RATES[task]:
    config = config_lib.validate(load(path, algorithm))
    client_lr = config.algorithm.client_optimizer.learning_rate
    assert np.isclose(np.log10(client_lr),
                      config_base.REDDI_2021_LEARNING_RATES[task][algorithm][0])


OFFLINE_FILES = [p for p in CONFIG_FILES
                 if load(p).dataset.name in OFFLINE]


# The text configs (a transformer) and the secure sum's 16-bit Skellam
# draws are the slowest to build and compile: with the slow tests.
_SLOW_CONFIGS = ('async_diloco_text.py', 'streaming_diloco_text.py', 'diloco_text.py',
                 'eager_diloco_text.py', 'diloco_study.py',
                 'diloco_text_equal_compute.py', 'secagg_ddp_digits.py',
                 # FedRep's and FedAvg's rounds with another client step.
                 'fedper_digits.py', 'ditto_digits.py',
                 # Variants of rounds other configs build (clustering, the
                 # tuner, buffered async, Mime, DP-FTRL's tree).
                 'hyp_cluster_digits.py', 'fedavg_hypergradient_tuner.py',
                 'fedbuff_digits.py', 'mime_digits.py', 'mime_lite_digits.py',
                 'dp_ftrl_digits.py')


@pytest.mark.parametrize('path', [
    pytest.param(p, marks=pytest.mark.slow) if os.path.basename(p) in _SLOW_CONFIGS
    else p for p in OFFLINE_FILES], ids=os.path.basename)
def test_offline_config_builds_and_runs_a_round(path, tmp_path):
  config = config_base.smoke_sized(load(path))
  exp = experiment.build(config)
  state = exp.algorithm.init(exp.init_params)
  cohort = next(iter(exp.cohorts(0, 1)))
  # Per-client rows, if the algorithm keeps them, from the runner's store.
  store = client_states.make_store(config, exp.algorithm, exp.init_params,
                                   exp.data.train.num_clients, str(tmp_path))
  state, metrics = exp.algorithm.round(state, client_states.attach(store, cohort),
                                       exp.round_key_for(0))[:2]
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(metrics))
  assert exp.evaluate is not None
  out = exp.evaluate(state.params)
  assert 0.0 <= out['eval_accuracy'] <= 1.0 and np.isfinite(out['eval_loss'])


def test_tff_datasets_say_which_file_they_need():
  config = load(os.path.join(CONFIG_DIR, 'emnist.py'))
  with pytest.raises(ValueError, match='train_path'):
    experiment.build(config)


@pytest.mark.parametrize('name,words', [
    ('emnist', ['--config.dataset.train_path=', 'fed_emnist.tar.bz2',
                'fed_emnist_train.h5', '--config.dataset.source=tfds']),
    ('cifar100', ['fed_cifar100.tar.bz2', '--config.dataset.source=tfds']),
    ('shakespeare', ['shakespeare.tar.bz2', 'shakespeare_train.h5']),
    ('stackoverflow', ['stackoverflow.tar.bz2', '--config.dataset.vocab_path=',
                       'stackoverflow.word_count.tar.bz2'])])
def test_a_missing_data_message_says_where_the_files_come_from(name, words):
  from fedjx.experiments import registry  # pylint: disable=import-outside-toplevel
  spec = {'name': name} if name in ('emnist', 'cifar100') else {
      'name': name, 'train_path': None}
  with pytest.raises(ValueError) as e:
    registry.build_dataset(spec, 0)
  text = str(e.value)
  assert '\n' not in text and 'https://storage.googleapis.com/tff-datasets-public/' in text
  for word in words:
    assert word in text, text


def test_a_tff_client_without_a_feature_names_the_path_and_the_client(tmp_path):
  from fedjx import datasets  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import data  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / 'emnist.h5')
  datasets.write_tff_hdf5(path, {
      'w0': {'pixels': np.zeros((2, 28, 28), np.float32),
             'label': np.zeros(2, np.int32)},
      'w1': {'pixels': np.zeros((2, 28, 28), np.float32)}})  # No label.
  train = data.emnist(train_path=path).train
  assert train.num_examples(0) == 2
  with pytest.raises(ValueError) as e:
    train.client_data(1)
  assert path in str(e.value) and "client 'w1'" in str(e.value)
  assert "no feature 'label'; it has ['pixels']" in str(e.value)
  so_path = str(tmp_path / 'so.h5')
  datasets.write_tff_hdf5(so_path, {'u0': {'title': np.array([b'a b'])}})
  with pytest.raises(ValueError, match=r"client 'u0'.*no feature 'tokens'"):
    data.stackoverflow(so_path)  # Counting the vocabulary reads the clients.


def test_tff_builders_read_small_generated_files(tmp_path):
  from fedjx import datasets  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import data  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  emnist_path = str(tmp_path / 'emnist.h5')
  datasets.write_tff_hdf5(emnist_path, {
      f'w{i}': {'pixels': rng.random((3 + i, 28, 28), dtype=np.float32),
                'label': rng.integers(0, 62, 3 + i).astype(np.int32)}
      for i in range(3)})
  out = data.emnist(train_path=emnist_path, test_path=emnist_path)
  first = out.train.client_data(0)
  assert first['x'].shape == (3, 28, 28, 1) and first['y'].dtype == np.int32
  assert out.info == {'num_classes': 62}

  shakespeare_path = str(tmp_path / 'shakespeare.h5')
  datasets.write_tff_hdf5(shakespeare_path, {
      'ROLE': {'snippets': np.array([b'To be, or not', b'ay'], dtype=object)}})
  out = data.shakespeare(shakespeare_path, seq_len=8)
  ex = out.train.client_data(0)
  # [begin] 'To be, or not' [end] = 15 ids: windows of 9 starting at 0 and 8;
  # [begin] 'ay' [end] = 4 ids: one window.
  assert ex['x'].shape == (3, 8)
  np.testing.assert_array_equal(ex['x'][0], [129] + [ord(c) for c in 'To be, '])
  np.testing.assert_array_equal(ex['y'][2], [ord('a'), ord('y'), 130, 0, 0, 0, 0, 0])
  assert out.train.num_examples(0) == 3

  so_path = str(tmp_path / 'so.h5')
  datasets.write_tff_hdf5(so_path, {
      'u1': {'tokens': np.array([b'a b c', b'a a d'], dtype=object)}})
  out = data.stackoverflow(so_path, vocab_size=2, seq_len=4)
  ex = out.train.client_data(0)
  # Vocabulary: 'a' -> 4 (3 uses), 'b' -> 5; others unknown (1).
  np.testing.assert_array_equal(ex['x'], [[2, 4, 5, 1], [2, 4, 4, 1]])
  np.testing.assert_array_equal(ex['y'], [[4, 5, 1, 3], [4, 4, 1, 3]])
  assert out.info['vocab_size'] == 6


def test_loading_a_config_file_imports_no_training_machinery():
  """Config files import the schema only: no Orbax, matplotlib or algorithm."""
  code = (
      'import glob, importlib.util, sys\n'
      f'for path in {CONFIG_FILES!r}:\n'
      '  spec = importlib.util.spec_from_file_location("c", path)\n'
      '  module = importlib.util.module_from_spec(spec)\n'
      '  spec.loader.exec_module(module)\n'
      '  module.get_config()\n'
      'heavy = [m for m in sys.modules if m.split(".")[0] in ("orbax", "matplotlib")\n'
      '         or m.startswith(("fedjx.algorithms", "fedjx.experiments.runner",\n'
      '                          "fedjx.experiments.registry"))]\n'
      'print(heavy)\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == '[]', out.stdout


def test_the_quickstart_s_split_is_the_one_its_docs_describe():
  from sklearn import datasets as sk_datasets  # pylint: disable=import-outside-toplevel
  total = len(sk_datasets.load_digits().target)
  held_out = round(0.2 * total)  # test_fraction=0.2 of the 1,797 images.
  data = registry.build_dataset(load(os.path.join(CONFIG_DIR, 'fedavg_digits.py')).dataset,
                                seed=0)
  sizes = [data.train.num_examples(c) for c in range(data.train.num_clients)]
  assert (total, held_out, len(data.test['y'])) == (1797, 359, 359)
  assert sum(sizes) == total - held_out == 1438
  assert sorted(set(sizes)) == [28, 29]  # Equal sizes; the labels are skewed.
  docs = os.path.join(os.path.dirname(CONFIG_DIR), 'docs', 'experiments.md')
  for path in (docs, os.path.join(CONFIG_DIR, 'fedavg_digits.py')):
    with open(path, encoding='utf-8') as f:
      text = ' '.join(f.read().split())
    assert '359' in text and '1,438' in text and '28 or 29' in text, path
    assert '1,437' not in text and '360 held out' not in text, path
