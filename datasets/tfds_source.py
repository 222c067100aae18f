"""TensorFlow Datasets as federated data, through ``tfds.data_source``.

``tfds.data_source`` gives random access to a prepared dataset stored as
ArrayRecord files, with no TensorFlow dependency. :func:`from_tfds` opens one
split and makes clients either from natural groups (a feature naming the user,
e.g. the writer of an image) or from a partition of a centralized dataset (a
function of one feature's column, usually the label, from
``fedjx.datasets.partition``). A client's examples are read from the
ArrayRecord files when the client is; only the column used to group is read up
front (one pass over the split).

The dataset must be prepared in ArrayRecord format (``download=True``
prepares it with ``file_format='array_record'`` if needed). Without network,
a dataset that is not prepared yet is a one-line error within seconds (TFDS
itself would retry its downloads for minutes): when the prepared dataset
cannot be opened, a probe of TFDS's download host (``storage.googleapis.com``,
:data:`PROBE_TIMEOUT_S` seconds) runs before any download. Offline
tests use ``tfds.testing.mock_data``, under which ``tfds.data_source('mnist')``
works.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedjx.datasets.federated import Examples, IndexedDataset
from fedjx.datasets.partition import unique_groups


PROBE_HOST = ('storage.googleapis.com', 443)
PROBE_TIMEOUT_S = 3.0


def network_error(host: tuple[str, int] = PROBE_HOST,
                  timeout: float = PROBE_TIMEOUT_S) -> str | None:
  """None if a TCP connection to ``host`` opens within ``timeout`` s, else why not."""
  try:
    socket.create_connection(host, timeout=timeout).close()
    return None
  except OSError as e:
    return f'{type(e).__name__}: {e}'


def _open(tfds: Any, name: str, split: str, data_dir: str | None,
          download: bool, builder_kwargs: dict[str, Any] | None) -> Any:
  """``tfds.data_source``; offline, a missing dataset fails at once in one line."""
  kwargs = dict(split=split, data_dir=data_dir, builder_kwargs=builder_kwargs)
  if not download:
    return tfds.data_source(name, download=False, **kwargs)
  try:  # Already prepared: no network needed.
    return tfds.data_source(name, download=False, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    why = f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
  error = network_error()
  if error is not None:
    raise ConnectionError(
        f'from_tfds: {name!r} is not prepared in data_dir={data_dir!r} ({why}) and '
        f'the network is unreachable ({PROBE_HOST[0]}: {error}); prepare it where '
        f'there is network (`tfds build {name.split(":")[0]} '
        "--file_format=array_record`) and copy it to data_dir, or read TFF's "
        "HDF5 files instead (source='tff', train_path=..., see "
        'fedjx.datasets.read_tff_hdf5).') from None
  return tfds.data_source(name, download=True, **kwargs)


def _stack(records: Sequence[dict[str, Any]]) -> Examples:
  keys = records[0].keys()
  return {k: np.stack([np.asarray(r[k]) for r in records]) for k in keys}


def _name(value: Any) -> str:
  value = np.asarray(value)
  value = value.item() if value.ndim == 0 else value.tolist()
  return value.decode('utf-8', errors='replace') if isinstance(value, bytes) else str(value)


def from_tfds(name: str, split: str = 'train', *, group_key: str | None = None,
              partition: Callable[[np.ndarray], list[np.ndarray]] | None = None,
              partition_key: str = 'label', data_dir: str | None = None,
              download: bool = True, builder_kwargs: dict[str, Any] | None = None
              ) -> IndexedDataset:
  """A federated dataset over split ``split`` of the TFDS builder ``name``.

  Exactly one of ``group_key`` and ``partition``:

  * ``group_key``: one client per distinct value of that feature (sorted),
    named after the value.
  * ``partition``: ``partition(column) -> list of index arrays`` applied to the
    ``partition_key`` column, e.g.
    ``lambda y: partition_dirichlet(y, 100, alpha=0.3, seed=0)``.

  Args:
    name: the builder name, optionally with config and version
      (``'mnist'``, ``'emnist/byclass:3.1.0'``).
    split: a TFDS split string (``'train'``, ``'test[:10%]'``).
    group_key: feature whose value names the client.
    partition: index partitioner of the ``partition_key`` column.
    partition_key: the column given to ``partition``.
    data_dir: where TFDS data lives (default: TFDS's own).
    download: prepare the dataset if it is missing.
    builder_kwargs: extra arguments for ``tfds.builder``.

  Returns:
    An :class:`IndexedDataset` whose ``client_data`` reads examples as NumPy
    (features as TFDS decodes them, e.g. ``'image'`` uint8, ``'label'`` int64).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if (group_key is None) == (partition is None):
    raise ValueError('from_tfds: give exactly one of group_key (a feature name) or '
                     f'partition (a function of a column); got group_key={group_key!r}'
                     f' and partition={partition!r}.')
  source = _open(tfds, name, split, data_dir, download, builder_kwargs)
  features = sorted(source.dataset_info.features.keys())
  key = group_key if group_key is not None else partition_key
  arg = 'group_key' if group_key is not None else 'partition_key'
  if key not in features:
    raise ValueError(f'from_tfds: {arg}={key!r} is not a feature of {name!r}; '
                     f'features are {features}.')
  n = len(source)
  if n == 0:
    raise ValueError(f'from_tfds: split={split!r} of {name!r} has no examples.')
  column = np.stack([np.asarray(source[i][key]) for i in range(n)])
  if group_key is not None:
    values, groups = unique_groups(column)
    names = [_name(v) for v in values]
  else:
    groups, names = partition(column), None

  def fetch(indices: np.ndarray) -> Examples:
    return _stack([source[int(i)] for i in indices])

  return IndexedDataset(fetch, groups, names)
