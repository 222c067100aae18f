"""Federated EMNIST-62 with the CNN and hyperparameters of Reddi et al. 2021.

3,400 writers (TensorFlow Federated's HDF5 files), 10 clients per round, one
local epoch with batch 20, 1,500 rounds; the 1.2M-parameter CNN (dropout
0.25 and 0.5). The config argument picks the algorithm (fedavg, fedavgm,
fedadagrad, fedadam, fedyogi; default fedadam) with the paper's tuned
learning rates (``REDDI_2021_LEARNING_RATES``).

  fedjx-run --config configs/emnist.py:fedyogi \
      --config.dataset.train_path=/data/fed_emnist_train.h5 \
      --config.dataset.test_path=/data/fed_emnist_test.h5

With TFDS instead (no writer ids: Dirichlet label skew over 3,400 clients):
``--config.dataset.source=tfds``.
"""

from fedjx.experiments.config_base import base_config, fedopt_algorithm
from ml_collections import config_dict


def get_config(algorithm: str = 'fedadam'):
  config = base_config()
  config.rounds = 1500
  config.cohort_size = 10
  config.batch_size = 20
  config.local_epochs = 1
  config.eval_every = 100
  config.eval_max_examples = 20_000
  config.checkpoint_every = 100
  config.dataset = dict(name='emnist', source='tff',
                        train_path=config_dict.placeholder(str),
                        test_path=config_dict.placeholder(str))
  config.model = dict(name='emnist_cnn', num_classes=62)
  config.algorithm = fedopt_algorithm('emnist', algorithm)
  return config
