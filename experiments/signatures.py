"""What a builder's signature says about the options a config may give it.

The one reader of function signatures for the experiments layer: the
config checks (:mod:`fedjx.experiments.registry`), the command line
(:mod:`fedjx.experiments.cli`) and the listing read a builder's keyword
options and their types here. It imports neither JAX nor the registries,
so the command line checks overrides before either is loaded.

A parameter's types come from a plain annotation (``float``, ``int | None``,
``Optional[str]``, also as the strings that ``from __future__ import
annotations`` leaves), else from its default's type; anything else
(``Any``, ``Sequence[int]``, a callable) has no declared type and is not
checked.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

__all__ = ['accepted_kwargs', 'declared_options', 'keyword_parameters',
           'option_types', 'parse_type']

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY)

_SIMPLE_TYPES = {'int': int, 'float': float, 'bool': bool, 'str': str,
                 'None': type(None), 'NoneType': type(None)}


def keyword_parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
  """The parameters of ``fn`` that may be given by keyword, by name."""
  return {p.name: p for p in inspect.signature(fn).parameters.values()
          if p.kind in _KEYWORD}


def accepted_kwargs(fn: Callable[..., Any]) -> tuple[list[str], bool]:
  """The keyword names ``fn`` takes, and whether it takes ``**kwargs``."""
  params = inspect.signature(fn).parameters.values()
  names = [p.name for p in params if p.kind in _KEYWORD]
  return names, any(p.kind == p.VAR_KEYWORD for p in params)


def declared_options(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
  """The options ``fn``'s ``**options`` takes, as its traits declare them
  (``fn.traits.options``, :class:`fedjx.algorithms.traits.Traits`), by name,
  with their defaults and types (``{}`` for a builder that declares none)."""
  names = getattr(getattr(fn, 'traits', None), 'options', ())
  if not names:
    return {}
  # A builder that declares options is loaded, and with it the template
  # that defines them (this module imports neither).
  return sys.modules['fedjx.algorithms.template'].option_parameters(names)


def _annotation_types(annotation: Any) -> tuple[type, ...] | None:
  """The types of a plain annotation, or None for any other annotation."""
  if annotation is inspect.Parameter.empty:
    return None
  if isinstance(annotation, type):
    text = annotation.__name__
  else:
    text = str(annotation).replace('typing.', '')
  match = re.fullmatch(r'(Optional|Union)\[(.*)\]', text)
  if match:
    parts = match.group(2).split(',') + (
        ['None'] if match.group(1) == 'Optional' else [])
  else:
    parts = text.split('|')
  parts = [p.strip() for p in parts]
  if not parts or any(p not in _SIMPLE_TYPES for p in parts):
    return None
  return tuple(_SIMPLE_TYPES[p] for p in parts)


def option_types(param: inspect.Parameter) -> tuple[type, ...] | None:
  """The types a config value of parameter ``param`` may have.

  From a plain annotation (``float``, ``int | None``), else from the
  default's type; a float also takes ints, and a None default adds None.
  None when neither tells (no check).
  """
  types = _annotation_types(param.annotation)
  default = param.default
  if types is None:
    if isinstance(default, bool):
      types = (bool,)
    elif isinstance(default, int):
      types = (int,)
    elif isinstance(default, float):
      types = (float,)
    elif isinstance(default, str):
      types = (str,)
    else:
      return None
  if float in types and int not in types:
    types += (int,)
  if default is None and type(None) not in types:
    types += (type(None),)
  return types


def parse_type(param: inspect.Parameter) -> type | None:
  """The one type that text for ``param`` is read as (a command-line value):
  ``float`` for a number that may be a float, else its single type of
  :func:`option_types` besides None; None (read as a Python literal) when
  it has no declared type or several."""
  types = option_types(param)
  if types is None:
    return None
  kinds = {t for t in types if t is not type(None)}
  if float in kinds:
    kinds.discard(int)
  return kinds.pop() if len(kinds) == 1 else None
