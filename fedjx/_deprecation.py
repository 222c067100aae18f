"""Deprecated spellings kept working after a function moved.

Every deprecated spelling warns with :class:`FedjxDeprecationWarning` (a
``DeprecationWarning``) naming its replacement and :data:`REMOVED_IN`, the
release that removes it; CHANGELOG.md lists them all under "Deprecated".
The project's tests turn this warning into an error (setup.cfg), so fedjx
never uses its own deprecated spellings; a test that exercises one on
purpose catches it with ``pytest.deprecated_call()``.

The interpreters do not depend on the dataset layer above them, so builders
of their client sources from a dataset moved to :mod:`fedjx.datasets`; the old
classmethods forward there with a deprecation warning.
"""

import warnings
from collections.abc import Callable
from typing import Any

# The release that removes every spelling deprecated in this one (0.1.x).
REMOVED_IN = '0.3.0'


class FedjxDeprecationWarning(DeprecationWarning):
  """A deprecated fedjx spelling: it still works and goes in :data:`REMOVED_IN`."""


def warn(message: str, stacklevel: int = 2) -> None:
  """Warns ``'<message> (removed in fedjx 0.3.0)'`` as a
  :class:`FedjxDeprecationWarning`, attributed ``stacklevel`` frames up from
  the caller of this function (2: the caller's caller)."""
  warnings.warn(f'{message} (removed in fedjx {REMOVED_IN}).',
                FedjxDeprecationWarning, stacklevel=stacklevel + 1)


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
                  f'arguments; removed in fedjx {REMOVED_IN}).',
                  FedjxDeprecationWarning, stacklevel=2)
    from fedjx import datasets  # pylint: disable=g-import-not-at-top  # The deprecated path only.
    return getattr(datasets, new)(*args, **kwargs)

  forward.__name__ = old.rsplit('.', 1)[-1]
  forward.__qualname__ = old.split('.', 2)[-1]
  forward.__doc__ = f'Deprecated: ``fedjx.datasets.{new}`` (same arguments).'
  return classmethod(forward)
