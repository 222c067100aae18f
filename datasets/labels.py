"""Class labels must lie in ``[0, num_classes)``, checked where data is read.

A label outside the range does not fail inside a model: with
``optax.softmax_cross_entropy_with_integer_labels`` a label ``99`` of 3
classes gives a NaN loss, and ``-1`` silently indexes the last class. So the
labels are checked when examples are loaded, and a bad one is a one-line
``ValueError`` naming the dataset, the value, where it is and the allowed
range.

:func:`check_labels` checks a dict of arrays at once, and wraps a
:class:`~fedjx.datasets.FederatedDataset` so that each client is checked when
it is read (a population is read lazily, one client at a time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedjx.datasets.federated import Examples
from fedjx.datasets.federated import FederatedDataset
from fedjx.datasets.federated import WrappedDataset


def check_num_classes(fn: str, num_classes: Any) -> int:
  if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
      or num_classes < 1:
    raise ValueError(f'{fn}: num_classes={num_classes!r} must be a positive int.')
  return int(num_classes)


def check_label_values(examples: Mapping[str, Any], num_classes: int, *,
                       dataset: str, key: str = 'y', where: str = '') -> None:
  """Raises a one-line ValueError unless ``examples[key]`` lies in ``[0, num_classes)``.

  Args:
    examples: a dict of arrays holding the labels under ``key``.
    num_classes: the number of classes.
    dataset: the dataset's name, for the message.
    key: the label feature.
    where: where the examples come from (e.g. ``'client 3'``), for the message.
  """
  if key not in examples:
    raise ValueError(f'dataset {dataset!r}: no label feature {key!r}; features '
                     f'are {sorted(examples)}.')
  labels = np.asarray(examples[key])
  at = f' of {where}' if where else ''
  if not (np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_):
    if not np.issubdtype(labels.dtype, np.floating) or not np.all(
        np.isfinite(labels) & (labels == np.round(labels))):
      raise ValueError(f'dataset {dataset!r}: labels {key!r}{at} have dtype '
                       f'{labels.dtype} with values that are not integers; '
                       f'labels must be ints in [0, {num_classes}).')
  if labels.size == 0:
    return
  bad = (labels < 0) | (labels >= num_classes)
  if np.any(bad):
    value = labels.reshape(-1)[np.argmax(bad.reshape(-1))]
    count = int(np.sum(bad))
    raise ValueError(
        f'dataset {dataset!r}: label {value.item()!r} in feature {key!r}{at} is '
        f'outside [0, {num_classes}) (num_classes={num_classes}; {count} such '
        f'label{"s" if count > 1 else ""}).')


class LabelCheckedDataset(WrappedDataset):
  """``base`` whose clients' labels are checked as each client is read."""

  def __init__(self, base: FederatedDataset, num_classes: int, dataset: str,
               key: str = 'y'):
    self._base, self._num_classes = base, num_classes
    self._dataset, self._key = dataset, key

  def _client_data(self, cid: int) -> Examples:
    out = self._base.client_data(cid)
    name = self._base.client_name(cid)
    where = f'client {cid}' + (f' ({name})' if name != str(cid) else '')
    check_label_values(out, self._num_classes, dataset=self._dataset,
                       key=self._key, where=where)
    return out

  def __getattr__(self, name: str) -> Any:
    # Anything else (e.g. ``num_classes`` of a synthetic population) is the base's.
    if name.startswith('_'):
      raise AttributeError(name)
    return getattr(self._base, name)


def check_labels(data: Any, num_classes: int, *, dataset: str,
                 key: str = 'y') -> Any:
  """``data`` with its labels ``data[key]`` checked against ``[0, num_classes)``.

  Args:
    data: a dict of arrays (checked now and returned as is), a
      :class:`~fedjx.datasets.FederatedDataset` (returned wrapped: each client
      is checked when read), or None (returned as is).
    num_classes: the number of classes.
    dataset: the dataset's name, for messages.
    key: the label feature.

  Raises:
    ValueError: one line naming the dataset, the label, where it is, and the
      range, for the first out-of-range label found.
  """
  num_classes = check_num_classes('check_labels', num_classes)
  if data is None:
    return None
  if isinstance(data, FederatedDataset):
    return LabelCheckedDataset(data, num_classes, dataset, key)
  if isinstance(data, Mapping):
    check_label_values(data, num_classes, dataset=dataset, key=key)
    return data
  raise ValueError(f'check_labels: data of type {type(data).__name__} is neither '
                   'a dict of arrays nor a FederatedDataset.')
