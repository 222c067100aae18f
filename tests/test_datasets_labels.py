"""Labels outside [0, num_classes) are a one-line error where data is read."""

import numpy as np
import pytest

from fedjx import datasets
from fedjx.experiments import data as data_lib
from fedjx.experiments import registry


def _arrays(labels):
  labels = np.asarray(labels)
  return {'x': np.arange(len(labels) * 2, dtype=np.float32).reshape(-1, 2),
          'y': labels}


@pytest.mark.parametrize('bad', [99, 3, -1])
def test_a_dict_with_a_bad_label_is_one_line_naming_value_and_range(bad):
  with pytest.raises(ValueError) as e:
    datasets.check_labels(_arrays([0, 1, bad, 2]), 3, dataset='toy')
  message = str(e.value)
  assert '\n' not in message
  assert f"dataset 'toy': label {bad} in feature 'y'" in message
  assert 'outside [0, 3)' in message


def test_valid_labels_pass_unchanged():
  arrays = _arrays([0, 1, 2, 2])
  assert datasets.check_labels(arrays, 3, dataset='toy') is arrays
  assert datasets.check_labels(None, 3, dataset='toy') is None


def test_a_population_is_checked_client_by_client_as_it_is_read():
  population = datasets.from_arrays(_arrays([0, 1, 2, 0, 7, 1]),
                                    groups=[[0, 1], [2, 3], [4, 5]])
  checked = datasets.check_labels(population, 3, dataset='toy')
  assert checked.num_clients == 3
  np.testing.assert_array_equal(checked.examples_per_client(), [2, 2, 2])
  np.testing.assert_array_equal(checked.client_data(1)['y'], [2, 0])
  with pytest.raises(ValueError, match=r"label 7 in feature 'y' of client 2 is "
                                       r'outside \[0, 3\)'):
    checked.client_data(2)
  with pytest.raises(ValueError, match='label 7'):  # Where cohorts are built.
    datasets.make_cohort(checked, [0, 2], batch_size=2)


def test_non_integer_float_labels_and_bad_num_classes_are_errors():
  with pytest.raises(ValueError, match='not integers'):
    datasets.check_labels(_arrays([0.0, 1.5]), 3, dataset='toy')
  with pytest.raises(ValueError, match='not integers'):
    datasets.check_labels(_arrays([0.0, np.nan]), 3, dataset='toy')
  datasets.check_labels(_arrays([0.0, 2.0]), 3, dataset='toy')  # Whole floats pass.
  with pytest.raises(ValueError, match='num_classes=0 must be a positive int'):
    datasets.check_labels(_arrays([0]), 0, dataset='toy')


def test_experiment_datasets_are_checked_against_their_num_classes():
  def bad_builder(seed=0):
    train = datasets.from_arrays(_arrays([0, 1, 2, 5]), groups=[[0, 1], [2, 3]])
    return data_lib.ExperimentData(train, _arrays([0, 1]), {'num_classes': 3})

  registry.register_dataset('bad_labels_for_test', bad_builder)
  try:
    data = registry.build_dataset({'name': 'bad_labels_for_test'}, seed=0)
    data.train.client_data(0)
    with pytest.raises(ValueError, match=r"dataset 'bad_labels_for_test': label 5"):
      data.train.client_data(1)
  finally:
    del registry.DATASETS['bad_labels_for_test']


def test_shipped_datasets_have_labels_in_range():
  data = registry.build_dataset({'name': 'digits', 'num_clients': 5}, seed=0)
  for c in range(data.train.num_clients):
    data.train.client_data(c)
  assert isinstance(data.train, datasets.LabelCheckedDataset)
