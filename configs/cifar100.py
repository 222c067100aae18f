"""Federated CIFAR-100 with ResNet-18 (GroupNorm) as in Reddi et al. 2021.

500 clients of 100 images (TensorFlow Federated's HDF5 files, Pachinko
allocation), 10 clients per round, one local epoch with batch 20, 4,000
rounds. The config argument picks the algorithm (default fedadam) with the
paper's tuned learning rates. (The paper also crops images to 24x24 with
random flips; here images are used whole.)

  fedjx-run --config configs/cifar100.py:fedadam \
      --config.dataset.train_path=/data/fed_cifar100_train.h5 \
      --config.dataset.test_path=/data/fed_cifar100_test.h5
"""

from fedjx.experiments.config_base import base_config, fedopt_algorithm
from ml_collections import config_dict


def get_config(algorithm: str = 'fedadam'):
  config = base_config()
  config.rounds = 4000
  config.cohort_size = 10
  config.batch_size = 20
  config.local_epochs = 1
  config.eval_every = 100
  config.checkpoint_every = 100
  config.dataset = dict(name='cifar100', source='tff',
                        train_path=config_dict.placeholder(str),
                        test_path=config_dict.placeholder(str))
  config.model = dict(name='resnet', num_classes=100, stage_sizes=(2, 2, 2, 2),
                      widths=(64, 128, 256, 512), groups=2)
  config.algorithm = fedopt_algorithm('cifar100', algorithm)
  return config
