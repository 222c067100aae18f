"""Submodules and names of a package imported on first access (PEP 562).

``__getattr__, __dir__ = submodules(__name__, names)`` in a package's
``__init__`` makes ``package.name`` import ``package.name`` the first time it
is read, so importing the package stays light, and lists ``names`` in
``dir(package)`` before they are imported. ``attributes`` does the same for
names defined in the package's modules (``package.map_fn`` from
``package.mapping``), and ``submodules`` takes them too.
"""

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def submodules(package: str, names: Sequence[str],
               attributes: Mapping[str, str] | None = None
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """The module ``__getattr__`` and ``__dir__`` of ``package``'s lazy ``names``
  (submodules) and ``attributes`` (name -> the module that defines it)."""
  names = tuple(names)
  attributes = dict(attributes or {})

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name in names:
      return importlib.import_module(f'{package}.{name}')
    if name in attributes:
      value = getattr(importlib.import_module(attributes[name]), name)
      setattr(sys.modules[package], name, value)  # Later reads skip this.
      return value
    raise AttributeError(f'module {package!r} has no attribute {name!r}')

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    return sorted(set(vars(sys.modules[package])) | set(names) | set(attributes))

  return __getattr__, __dir__
