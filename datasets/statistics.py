"""Summaries of a partition: how many clients, how big, how skewed.

:func:`summary` returns plain numbers and arrays (a runner prints them with
:func:`format_summary` or plots ``examples_per_client`` and
``label_histogram``). Label skew is measured against the pooled label
distribution ``p`` of the summarised clients:

* ``label_tv_distance``: mean over clients of the total variation distance
  ``TV(q_c, p) = 1/2 sum_k |q_c[k] - p[k]|`` (0: IID, near 1: disjoint);
* ``classes_per_client``: mean number of distinct labels a client holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets.federated import FederatedDataset

_LABEL_KEYS = ('y', 'label', 'labels')


def summary(dataset: FederatedDataset, label_key: str | None = None,
            max_clients: int | None = 1000, seed: int = 0) -> dict[str, Any]:
  """Client counts, sizes and (when labels exist) label-histogram skew.

  Args:
    dataset: the federated dataset.
    label_key: the integer label feature; default the first of ``'y'``,
      ``'label'``, ``'labels'`` that client 0 has. Label statistics are
      skipped when there is none or it is not one integer per example.
    max_clients: read labels from at most this many clients (a uniform sample,
      deterministic in ``seed``); None reads all. Sizes always cover everyone.
    seed: seed of that sample.

  Returns:
    A dict with ``num_clients``, ``num_examples``, ``examples_per_client``
    (``[num_clients]``), ``size_min/max/mean/std/median``, and, with labels,
    ``labels`` (the classes), ``label_histogram`` (``[clients read, classes]``),
    ``label_clients`` (which clients were read), ``label_tv_distance`` and
    ``classes_per_client``.
  """
  sizes = dataset.examples_per_client()
  out: dict[str, Any] = {
      'num_clients': int(dataset.num_clients),
      'num_examples': int(sizes.sum()),
      'examples_per_client': sizes,
      'size_min': int(sizes.min()),
      'size_max': int(sizes.max()),
      'size_mean': float(sizes.mean()),
      'size_std': float(sizes.std()),
      'size_median': float(np.median(sizes)),
  }
  ids = dataset.client_ids
  if max_clients is not None and len(ids) > max_clients:
    ids = np.sort(_seeding.rng(_seeding.SUMMARY, seed).choice(
        len(ids), max_clients, replace=False)).astype(np.int32)
  first = dataset.client_data(int(ids[0]))
  if label_key is None:
    label_key = next((k for k in _LABEL_KEYS if k in first), None)
  elif label_key not in first:
    raise ValueError(f'summary: label_key={label_key!r} is not a feature; features'
                     f' are {sorted(first)}.')
  if label_key is None or not _is_label(first[label_key]):
    return out
  labels = [np.asarray(first[label_key]).reshape(-1)]
  labels += [np.asarray(dataset.client_data(int(c))[label_key]).reshape(-1)
             for c in ids[1:]]
  classes = np.unique(np.concatenate(labels))
  hist = np.stack([np.bincount(np.searchsorted(classes, y), minlength=len(classes))
                   for y in labels])
  q = hist / hist.sum(axis=1, keepdims=True)
  p = hist.sum(axis=0) / hist.sum()
  out.update(
      labels=classes,
      label_histogram=hist,
      label_clients=np.asarray(ids),
      label_tv_distance=float(0.5 * np.abs(q - p).sum(axis=1).mean()),
      classes_per_client=float((hist > 0).sum(axis=1).mean()),
  )
  return out


def _is_label(values: Any) -> bool:
  values = np.asarray(values)
  return values.ndim == 1 and np.issubdtype(values.dtype, np.integer)


def format_summary(stats: dict[str, Any]) -> str:
  """A few lines describing :func:`summary`'s result, for logs."""
  lines = [
      f"clients: {stats['num_clients']}  examples: {stats['num_examples']}",
      f"examples per client: min {stats['size_min']}  median "
      f"{stats['size_median']:g}  mean {stats['size_mean']:.1f}  max "
      f"{stats['size_max']}  std {stats['size_std']:.1f}",
  ]
  if 'label_histogram' in stats:
    lines.append(
        f"labels: {len(stats['labels'])} classes  classes per client "
        f"{stats['classes_per_client']:.2f}  label TV distance from pooled "
        f"{stats['label_tv_distance']:.3f}  (over "
        f"{len(stats['label_clients'])} clients)")
  return '\n'.join(lines)
