"""Every config in configs/ loads, validates, and names registered builders;
the offline ones build and run a round."""

import glob
import importlib.util
import os

import jax
import numpy as np
import pytest

from fedjx.experiments import config_base
from fedjx.experiments import registry
from fedjx.experiments import runner

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          'configs')
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, '*.py')))
OFFLINE = {'digits', 'synthetic', 'text'}


def load(path, arg=None):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def test_the_issue_s_configs_exist():
  names = {os.path.basename(p)[:-3] for p in CONFIG_FILES}
  for required in ('fedavg_digits', 'fedadam_digits', 'fedyogi_digits',
                   'fedprox_synthetic', 'scaffold_synthetic', 'diloco_text',
                   'streaming_diloco_text', 'dp_fedavg_digits', 'emnist',
                   'shakespeare', 'stackoverflow', 'cifar100'):
    assert required in names


@pytest.mark.parametrize('path', CONFIG_FILES, ids=os.path.basename)
def test_config_validates(path):
  config = runner.validate(load(path))
  assert config.dataset.name in registry.DATASETS
  assert config.model.name in registry.MODELS
  assert config.algorithm.name in registry.ALGORITHMS


@pytest.mark.parametrize('task', sorted(config_base.REDDI_2021_LEARNING_RATES))
def test_reddi_configs_accept_every_algorithm(task):
  path = os.path.join(CONFIG_DIR, f'{task}.py')
  for algorithm in config_base.REDDI_2021_LEARNING_RATES[task]:
    config = runner.validate(load(path, algorithm))
    client_lr = config.algorithm.client_optimizer.learning_rate
    assert np.isclose(np.log10(client_lr),
                      config_base.REDDI_2021_LEARNING_RATES[task][algorithm][0])


OFFLINE_FILES = [p for p in CONFIG_FILES
                 if load(p).dataset.name in OFFLINE]


@pytest.mark.parametrize('path', OFFLINE_FILES, ids=os.path.basename)
def test_offline_config_builds_and_runs_a_round(path):
  config = load(path)
  if config.dataset.name == 'text':  # Keep the test small.
    config.dataset.modules = ('json',)
    config.dataset.seq_len = 16
    config.local_steps = 2
    config.model.width = 16
    config.model.num_layers = 1
  config.local_epochs = None if config.local_steps else 1
  config.max_local_steps = 2
  config.batch_size = 4
  config.eval_max_examples = 64
  exp = runner.build(config)
  state = exp.algorithm.init(exp.init_params)
  cohort = next(iter(exp.cohorts(0, 1)))
  state, metrics = exp.algorithm.round(state, cohort, exp.round_key_for(0))
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(metrics))
  assert exp.evaluate is not None
  out = exp.evaluate(state.params)
  assert 0.0 <= out['eval_accuracy'] <= 1.0 and np.isfinite(out['eval_loss'])


def test_tff_datasets_say_which_file_they_need():
  config = load(os.path.join(CONFIG_DIR, 'emnist.py'))
  with pytest.raises(ValueError, match='train_path'):
    runner.build(config)
