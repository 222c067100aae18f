"""The error of a config that names something unknown, and its suggestion.

The bottom of the experiments layer: the schema
(:mod:`fedjx.experiments.config`), the registries and the parts' tables
raise :class:`ConfigError`, and import it from here rather than from one
another.
"""

from __future__ import annotations

import difflib
from typing import Any


class ConfigError(ValueError):
  """A config names something unknown or passes an argument not accepted."""


def suggest(name: Any, choices: Any) -> str:
  """`` Did you mean 'x'?`` for the closest of ``choices``, or ``''``."""
  close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
  return f' Did you mean {close[0]!r}?' if close else ''
