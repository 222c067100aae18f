"""scikit-learn's handwritten digits, partitioned into clients (no download).

The UCI optical recognition of handwritten digits data that scikit-learn ships
(``sklearn.datasets.load_digits``): 1,797 images of 8x8 pixels with values
0..16, ten classes. Writer ids are not included, so
clients are made by partitioning: Dirichlet label skew (Hsu et al. 2019) by
default, IID when ``alpha`` is None. Small enough for quickstarts and tests
on a laptop CPU.
"""

from __future__ import annotations

import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets.federated import FederatedDataset, from_arrays
from fedjx.datasets.partition import partition_dirichlet, partition_iid


def load_digits(num_clients: int = 50, alpha: float | None = 0.5, seed: int = 0,
                test_fraction: float = 0.2
                ) -> tuple[FederatedDataset, dict[str, np.ndarray]]:
  """Federated digits: ``(train clients, central test split)``.

  A random ``test_fraction`` of the 1,797 images (from ``seed``) forms the
  central test split; the rest is divided among ``num_clients`` clients with
  ``partition_dirichlet(labels, num_clients, alpha, seed)`` (or
  ``partition_iid`` when ``alpha`` is None).

  Features: ``'x'``: float32 ``[8, 8, 1]`` in [0, 1] (pixel / 16); ``'y'``:
  int32 label in 0..9.

  Args:
    num_clients: how many training clients.
    alpha: Dirichlet concentration (smaller: more label skew), or None for IID.
    seed: seeds the test split and the partition.
    test_fraction: fraction of images held out centrally, in [0, 1).

  Returns:
    The training :class:`FederatedDataset` and the test split as a dict of
    arrays (empty arrays when ``test_fraction`` is 0).
  """
  if not 0.0 <= test_fraction < 1.0:
    raise ValueError(f'test_fraction={test_fraction!r}; it must be in [0, 1).')
  from sklearn import datasets as sk_datasets  # deferred: heavy (SciPy), used here only
  raw = sk_datasets.load_digits()
  x = (raw.images.astype(np.float32) / 16.0)[..., None]
  y = raw.target.astype(np.int32)
  perm = _seeding.rng(_seeding.SPLIT, seed, 2).permutation(len(y))
  num_test = int(round(test_fraction * len(y)))
  test_idx, train_idx = np.sort(perm[:num_test]), np.sort(perm[num_test:])
  train = {'x': x[train_idx], 'y': y[train_idx]}
  test = {'x': x[test_idx], 'y': y[test_idx]}
  if alpha is None:
    groups = partition_iid(train['y'], num_clients, seed)
  else:
    groups = partition_dirichlet(train['y'], num_clients, alpha, seed)
  return from_arrays(train, groups=groups), test
