"""Submodules of a package imported on first attribute access (PEP 562).

``__getattr__, __dir__ = submodules(__name__, names)`` in a package's
``__init__`` makes ``package.name`` import ``package.name`` the first time it
is read, so importing the package stays light, and lists ``names`` in
``dir(package)`` before they are imported.
"""

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any


def submodules(package: str, names: Sequence[str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """The module ``__getattr__`` and ``__dir__`` of ``package``'s lazy ``names``."""
  names = tuple(names)

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name in names:
      return importlib.import_module(f'{package}.{name}')
    raise AttributeError(f'module {package!r} has no attribute {name!r}')

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    return sorted(set(vars(sys.modules[package])) | set(names))

  return __getattr__, __dir__
