"""Deprecated spellings kept working after a function moved.

The interpreters do not depend on the dataset layer above them, so builders
of their client sources from a dataset moved to :mod:`fedjx.datasets`; the old
classmethods forward there with a ``DeprecationWarning``.
"""

import warnings
from collections.abc import Callable
from typing import Any


def moved_to_datasets(old: str, new: str) -> Callable[..., Any]:
  """A classmethod ``old`` that warns, then returns ``fedjx.datasets.<new>(*args, **kwargs)``.

  Args:
    old: the deprecated spelling, e.g. ``'fedjx.beam.ClientData.from_dataset'``.
    new: the name of its replacement in :mod:`fedjx.datasets`, taking the
      same arguments.
  """

  def forward(cls, *args, **kwargs):
    del cls
    warnings.warn(f'{old} is deprecated; use fedjx.datasets.{new} (same '
                  'arguments).', DeprecationWarning, stacklevel=2)
    from fedjx import datasets  # pylint: disable=g-import-not-at-top  # The deprecated path only.
    return getattr(datasets, new)(*args, **kwargs)

  forward.__name__ = old.rsplit('.', 1)[-1]
  forward.__qualname__ = old.split('.', 2)[-1]
  forward.__doc__ = f'Deprecated: ``fedjx.datasets.{new}`` (same arguments).'
  return classmethod(forward)
