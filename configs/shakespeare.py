"""Federated Shakespeare next-character prediction (Reddi et al. 2021).

715 speaking roles (TensorFlow Federated's HDF5 files), 10 clients per round,
one local epoch with batch 4, 1,200 rounds, sequences of 80 characters; an
LSTM model (embedding 8, two layers of 256 units). The config argument picks
the algorithm (default fedadam) with the paper's tuned learning rates.

  fedjx-run --config configs/shakespeare.py:fedadam \
      --config.dataset.train_path=/data/shakespeare_train.h5 \
      --config.dataset.test_path=/data/shakespeare_test.h5
"""

from fedjx.experiments.config_base import base_config, fedopt_algorithm
from ml_collections import config_dict


def get_config(algorithm: str = 'fedadam'):
  config = base_config()
  config.rounds = 1200
  config.cohort_size = 10
  config.batch_size = 4
  config.local_epochs = 1
  config.eval_every = 100
  config.eval_max_examples = 20_000
  config.checkpoint_every = 100
  config.dataset = dict(name='shakespeare', seq_len=80,
                        train_path=config_dict.placeholder(str),
                        test_path=config_dict.placeholder(str))
  config.model = dict(name='lstm_lm', embed_size=8, hidden=(256, 256))
  config.algorithm = fedopt_algorithm('shakespeare', algorithm)
  return config
