"""Data poisoning: the malicious clients' examples, changed as they are read.

A :class:`PoisonedDataset` wraps a :class:`~fedjx.datasets.FederatedDataset`
and applies a transform to the examples of the clients in a fixed malicious
set (e.g. :func:`fedjx.algorithms.attacks.malicious_clients`) only; the other
clients, the example counts and the client names are the base dataset's.
Transforms are deterministic: one depends only on the client's examples, its
id and a seed.

* :func:`flip_labels`: label flipping, ``y -> pi(y)`` with ``pi(y) = K - 1 -
  y`` for ``K`` classes (the flip of Fang, Cao, Jia, Gong, "Local Model
  Poisoning Attacks to Byzantine-Robust Federated Learning", USENIX Security
  2020) or a given mapping ``pi``; every example of a malicious client.
* :func:`backdoor`: a pixel-pattern backdoor (Bagdasaryan, Veit, Hua, Estrin,
  Shmatikov, "How To Backdoor Federated Learning", AISTATS 2020; the pattern
  of Gu, Dolan-Gavitt, Garg, "BadNets", 2017): on a fraction ``rho`` of each
  malicious client's examples (chosen from ``(seed, client id)``), a
  ``p x p`` patch of value ``v`` at the bottom-right corner of the image and
  the label set to the target class ``t``.

:func:`add_trigger` and :func:`triggered_examples` build the held-out set
on which a backdoor's attack success rate is measured: the test examples
whose true label is not ``t``, with the trigger, relabelled ``t`` (so a
model's accuracy on them is the fraction it sends to ``t``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets.federated import Examples
from fedjx.datasets.federated import FederatedDataset
from fedjx.datasets.federated import WrappedDataset
from fedjx.datasets.federated import num_rows

Transform = Callable[[int, Examples], Examples]


class PoisonedDataset(WrappedDataset):
  """``base`` whose clients in ``malicious`` are read through ``transform``.

  Args:
    base: the population.
    malicious: the malicious client ids (ints in ``[0, N)``).
    transform: ``transform(cid, examples) -> examples`` with as many
      examples (e.g. :func:`flip_labels`).
  """

  def __init__(self, base: FederatedDataset, malicious: Sequence[int] | np.ndarray,
               transform: Transform):
    ids = np.asarray(malicious, np.int64).reshape(-1)
    for cid in ids.tolist():
      base.check_client(cid)
    self._base = base
    self._malicious = frozenset(ids.tolist())
    self._transform = transform

  @property
  def malicious(self) -> np.ndarray:
    """``int32 [F]``: the sorted malicious client ids."""
    return np.array(sorted(self._malicious), np.int32)

  def _client_data(self, cid: int) -> Examples:
    data = self._base.client_data(cid)
    if cid not in self._malicious:
      return data
    out = dict(self._transform(cid, dict(data)))
    n = num_rows(out, where=f'poisoned client {cid}')
    if n != self._base.num_examples(cid):
      raise ValueError(f'the poisoning transform changed client {cid} from '
                       f'{self._base.num_examples(cid)} to {n} examples; it must '
                       'keep the number of examples.')
    return out


def _check_int(fn: str, name: str, value: Any, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f'{fn}: {name}={value!r}; it must be an int >= {low}.')
  return int(value)


def label_mapping(num_classes: int, mapping: Sequence[int] | None = None) -> np.ndarray:
  """``int32 [K]``: ``pi`` with ``pi(y) = K - 1 - y``, or ``mapping`` checked."""
  fn = 'flip_labels'
  k = _check_int(fn, 'num_classes', num_classes, 2)
  if mapping is None:
    return np.arange(k - 1, -1, -1, dtype=np.int32)
  table = np.asarray(mapping)
  if table.shape != (k,) or not np.issubdtype(table.dtype, np.integer) or (
      table.min() < 0 or table.max() >= k):
    raise ValueError(f'{fn}: mapping={list(np.asarray(mapping).reshape(-1))!r}; '
                     f'it must list {k} ints in [0, {k}), the new label of each '
                     'class.')
  return table.astype(np.int32)


class FlipLabels:
  """Label flipping's transform ``y -> pi(y)``: what :func:`flip_labels` returns.

  Its repr is the call that builds it (``flip_labels(num_classes=10,
  mapping=None, label_key='y')``, which evaluates to an equal transform), and
  two are equal when they flip the same labels the same way.
  """

  def __init__(self, num_classes: int, mapping: Sequence[int] | None = None,
               label_key: str = 'y'):
    self.table = label_mapping(num_classes, mapping)
    self.num_classes = int(num_classes)
    self.mapping = None if mapping is None else [int(v) for v in
                                                 np.asarray(mapping).reshape(-1)]
    self.label_key = label_key

  def __call__(self, cid: int, examples: Examples) -> Examples:
    del cid
    y = np.asarray(examples[self.label_key])
    return dict(examples, **{self.label_key: self.table[y].astype(y.dtype)})

  def __repr__(self) -> str:
    return (f'flip_labels(num_classes={self.num_classes}, mapping={self.mapping!r}, '
            f'label_key={self.label_key!r})')

  def __eq__(self, other: Any) -> bool:
    return (isinstance(other, FlipLabels) and self.label_key == other.label_key
            and np.array_equal(self.table, other.table))

  def __hash__(self) -> int:
    return hash((self.label_key, self.table.tobytes()))


def flip_labels(num_classes: int, mapping: Sequence[int] | None = None, *,
                label_key: str = 'y') -> FlipLabels:
  """The transform ``y -> pi(y)`` on every example (module docstring).

  ``config.attack = dict(name='label_flip', mapping=...)`` builds
  ``flip_labels(num_classes, mapping)`` with the dataset's ``num_classes``;
  the transform's repr is that call.

  Args:
    num_classes: ``K``.
    mapping: ``pi`` as ``K`` ints (``mapping[y]`` is the new label of
      class ``y``); None for ``pi(y) = K - 1 - y``.
    label_key: the label feature.
  """
  return FlipLabels(num_classes, mapping, label_key)


def add_trigger(x: np.ndarray, patch_size: int = 2, value: float = 1.0) -> np.ndarray:
  """Images ``x [n, H, W, ...]`` with the ``p x p`` bottom-right patch set to ``value``."""
  x = np.array(x, copy=True)
  if x.ndim < 3:
    raise ValueError(f'add_trigger: images of shape {x.shape}; a pixel trigger '
                     'needs [n, height, width, ...] images.')
  p = patch_size
  if p > x.shape[1] or p > x.shape[2]:
    raise ValueError(f'add_trigger: patch_size={p} does not fit images of '
                     f'{x.shape[1]}x{x.shape[2]} pixels.')
  x[:, -p:, -p:, ...] = value
  return x


def check_backdoor(target: int, num_classes: int, patch_size: int,
                   patch_value: float, poison_fraction: float) -> None:
  """One-line errors for :func:`backdoor`'s options."""
  fn = 'backdoor'
  k = _check_int(fn, 'num_classes', num_classes, 2)
  if _check_int(fn, 'target', target, 0) >= k:
    raise ValueError(f'{fn}: target={target!r}; it must be a class in [0, {k}).')
  _check_int(fn, 'patch_size', patch_size, 1)
  if isinstance(patch_value, bool) or not isinstance(
      patch_value, (int, float, np.floating)) or not np.isfinite(patch_value):
    raise ValueError(f'{fn}: patch_value={patch_value!r}; it must be a finite '
                     'number (the trigger pixels\' value).')
  if isinstance(poison_fraction, bool) or not isinstance(
      poison_fraction, (int, float, np.floating)) or not 0 < poison_fraction <= 1:
    raise ValueError(f'{fn}: poison_fraction={poison_fraction!r}; it must be in '
                     "(0, 1], the share of a malicious client's examples poisoned.")


def backdoor(target: int, num_classes: int, *, patch_size: int = 2,
             patch_value: float = 1.0, poison_fraction: float = 0.5,
             seed: int = 0, image_key: str = 'x', label_key: str = 'y') -> Transform:
  """The pixel-pattern backdoor transform (module docstring).

  Client ``cid``'s poisoned examples are the first ``ceil(rho n)`` of a
  permutation of its ``n`` examples drawn from ``(seed, cid)``; they get
  :func:`add_trigger` and the label ``target``; the others are unchanged.
  """
  check_backdoor(target, num_classes, patch_size, patch_value, poison_fraction)
  _check_int('backdoor', 'seed', seed, 0)

  def transform(cid: int, examples: Examples) -> Examples:
    x, y = np.asarray(examples[image_key]), np.asarray(examples[label_key])
    n = len(y)
    rng = _seeding.rng(_seeding.POISON, seed, cid)
    chosen = rng.permutation(n)[:int(np.ceil(poison_fraction * n))]
    x, y = np.array(x, copy=True), np.array(y, copy=True)
    x[chosen] = add_trigger(x[chosen], patch_size, patch_value).astype(x.dtype)
    y[chosen] = target
    return dict(examples, **{image_key: x, label_key: y})

  return transform


def triggered_examples(examples: Mapping[str, Any], target: int, *,
                       patch_size: int = 2, patch_value: float = 1.0,
                       image_key: str = 'x', label_key: str = 'y'
                       ) -> dict[str, np.ndarray] | None:
  """The backdoor's held-out set: examples whose label is not ``target``,
  triggered and relabelled ``target`` (None if there are none)."""
  y = np.asarray(examples[label_key])
  keep = y != target
  if not np.any(keep):
    return None
  out = {k: np.asarray(v)[keep] for k, v in examples.items()}
  out[image_key] = add_trigger(out[image_key], patch_size, patch_value).astype(
      out[image_key].dtype)
  out[label_key] = np.full_like(out[label_key], target)
  return out


def flipped_examples(examples: Mapping[str, Any], num_classes: int,
                     mapping: Sequence[int] | None = None, *,
                     label_key: str = 'y') -> dict[str, np.ndarray] | None:
  """Label flipping's held-out set: examples whose label ``pi`` moves,
  relabelled ``pi(y)`` (None if there are none)."""
  table = label_mapping(num_classes, mapping)
  y = np.asarray(examples[label_key])
  keep = table[y] != y
  if not np.any(keep):
    return None
  out = {k: np.asarray(v)[keep] for k, v in examples.items()}
  out[label_key] = table[out[label_key]].astype(y.dtype)
  return out


__all__ = ['FlipLabels', 'PoisonedDataset', 'add_trigger', 'backdoor',
           'check_backdoor', 'flip_labels', 'flipped_examples', 'label_mapping',
           'triggered_examples']
