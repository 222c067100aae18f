"""The command that installs one of fedjx's optional extras, as it works here.

fedjx is on no package index, so ``pip install 'fedjx[flower]'`` fails. From
a checkout (fedjx imported from a source tree that holds ``setup.cfg``) the
extra installs with ``pip install -e 'ROOT[flower]'`` (``'.[flower]'`` in the
checkout itself); otherwise with the extra's own requirements, read from
fedjx's installed metadata (``pip install 'flwr>=1.42'``). Imports neither
JAX nor any extra: it runs before they are known to be there.
"""

from __future__ import annotations

import os
import re
from importlib import metadata


def _checkout() -> str | None:
  """The source tree fedjx is imported from, if it is one."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    with open(os.path.join(root, 'setup.cfg'), encoding='utf-8') as f:
      ours = re.search(r'^name\s*=\s*fedjx\s*$', f.read(), re.M) is not None
  except OSError:
    return None
  return root if ours else None


def requirements(extra: str) -> list[str]:
  """The requirements of ``extra`` in fedjx's installed metadata (e.g.
  ``['flwr>=1.42']``); empty where fedjx is not installed."""
  try:
    declared = metadata.requires('fedjx') or []
  except metadata.PackageNotFoundError:
    return []
  marker = re.compile(r'extra\s*==\s*["\']' + re.escape(extra) + r'["\']')
  return [r.split(';')[0].strip() for r in declared
          if ';' in r and marker.search(r.split(';', 1)[1])]


def command(extra: str) -> str:
  """``pip install ...`` that installs fedjx's ``extra`` for this fedjx."""
  root = _checkout()
  if root is not None:
    where = '.' if os.path.abspath(os.getcwd()) == root else root
    return f"pip install -e '{where}[{extra}]'"
  needs = requirements(extra)
  if not needs:  # Neither a checkout nor installed: no requirement to name.
    return f"install fedjx's {extra!r} extra (setup.cfg lists its packages)"
  return 'pip install ' + ' '.join(f"'{r}'" for r in needs)
