"""Stack Overflow next-word prediction (Reddi et al. 2021).

342,477 users (TensorFlow Federated's HDF5 files), 50 clients per round, one
local epoch with batch 16 and at most 256 sentences per client, 1,500
rounds, sentences of 20 words over the 10,000 most frequent words; an LSTM
model (embedding 96, 670 units, projection 96). The config argument picks the
algorithm (default fedadam) with the paper's tuned learning rates.

  fedjx-run --config configs/stackoverflow.py:fedadam \
      --config.dataset.train_path=/data/stackoverflow_train.h5 \
      --config.dataset.test_path=/data/stackoverflow_test.h5 \
      --config.dataset.vocab_path=/data/stackoverflow_vocab.txt
"""

from fedjx.experiments.config_base import base_config, fedopt_algorithm
from ml_collections import config_dict


def get_config(algorithm: str = 'fedadam'):
  config = base_config()
  config.rounds = 1500
  config.cohort_size = 50
  config.batch_size = 16
  config.local_epochs = 1
  config.max_local_steps = 16            # 256 sentences per client
  config.eval_every = 100
  config.eval_max_examples = 10_000
  config.checkpoint_every = 100
  config.dataset = dict(name='stackoverflow', seq_len=20, vocab_size=10000,
                        train_path=config_dict.placeholder(str),
                        test_path=config_dict.placeholder(str),
                        vocab_path=config_dict.placeholder(str))
  config.model = dict(name='lstm_lm', embed_size=96, hidden=(670,),
                      projection=96)
  config.algorithm = fedopt_algorithm('stackoverflow', algorithm)
  return config
