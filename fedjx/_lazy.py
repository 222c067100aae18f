"""Submodules and names of a package imported on first access (PEP 562).

``__getattr__, __dir__ = submodules(__name__, names)`` in a package's
``__init__`` makes ``package.name`` import ``package.name`` the first time it
is read, so importing the package stays light, and lists ``names`` in
``dir(package)`` before they are imported. ``attributes`` does the same for
names defined in the package's modules (``package.map_fn`` from
``package.mapping``), and ``submodules`` takes them too.

``optional`` names the submodules that need an optional dependency
(``{'beam': ('apache_beam', 'beam')}``: the module, the package it needs and
the extra that installs it). They are read as the others are, but
``dir(package)`` lists them only once imported: ``help(package)`` and
``pydoc`` read every name ``dir`` lists, and so would import the optional
dependency, or fail without it. Where the dependency is missing, reading
the name raises ``ModuleNotFoundError`` saying which extra to install.
"""

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedjx import _install


def submodules(package: str, names: Sequence[str],
               attributes: Mapping[str, str] | None = None,
               optional: Mapping[str, tuple[str, str]] | None = None
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """The module ``__getattr__`` and ``__dir__`` of ``package``'s lazy ``names``
  (submodules), ``attributes`` (name -> the module that defines it) and
  ``optional`` submodules (name -> (the package it needs, its extra))."""
  optional = dict(optional or {})
  names = tuple(names) + tuple(n for n in optional if n not in names)
  attributes = dict(attributes or {})

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name in names:
      if name not in optional:
        return importlib.import_module(f'{package}.{name}')
      needs, extra = optional[name]
      try:
        return importlib.import_module(f'{package}.{name}')
      except ModuleNotFoundError as e:
        if e.name is None or e.name.partition('.')[0] != needs:
          raise
        raise ModuleNotFoundError(
            f'{package}.{name} needs {needs}, which is not installed: '
            f'{_install.command(extra)}.', name=e.name) from e
    if name in attributes:
      value = getattr(importlib.import_module(attributes[name]), name)
      setattr(sys.modules[package], name, value)  # Later reads skip this.
      return value
    raise AttributeError(f'module {package!r} has no attribute {name!r}')

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    listed = {n for n in names
              if n not in optional or f'{package}.{n}' in sys.modules}
    return sorted(set(vars(sys.modules[package])) | listed | set(attributes))

  return __getattr__, __dir__
