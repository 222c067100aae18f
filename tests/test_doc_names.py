"""Every dotted ``fedjx.`` name the documentation gives resolves.

The names are those in backticks (inline code and fenced blocks) of
README.md and docs/*.md; each is resolved as a user would reach it:
``import fedjx``, then attribute by attribute, importing a submodule where
the attribute is not there yet (``fedjx.algorithms.fedrep_lib`` is both).
A name whose module needs an optional dependency that is not installed
(Flower's ``flwr``) is left out, as ``import`` would be.
"""

import glob
import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Inline code and fenced blocks.
CODE = re.compile(r'```.*?```|`[^`\n]+`', re.S)
NAME = re.compile(r'(?<![\w.])fedjx(?:\.[A-Za-z_]\w*)+')
# Optional extras: a name under them resolves only with the extra installed.
OPTIONAL = ('flwr', 'apache_beam', 'tensorboard')


def documented_names():
  """``{name: first file that gives it}`` over README.md and docs/*.md."""
  paths = [os.path.join(ROOT, 'README.md')] + sorted(
      glob.glob(os.path.join(ROOT, 'docs', '*.md')))
  names = {}
  for path in paths:
    with open(path, encoding='utf-8') as f:
      text = f.read()
    for span in CODE.findall(text):
      for name in NAME.findall(span):
        names.setdefault(name, os.path.relpath(path, ROOT))
  return names


def resolve(name):
  """The object ``name`` names (attributes, importing submodules as needed)."""
  parts = name.split('.')
  obj = importlib.import_module(parts[0])
  for i, part in enumerate(parts[1:], start=1):
    if hasattr(obj, part):
      obj = getattr(obj, part)
    else:
      obj = importlib.import_module('.'.join(parts[:i + 1]))
  return obj


def test_every_documented_dotted_name_resolves():
  names = documented_names()
  assert len(names) > 100  # The docs give many; an empty scan would pass.
  failed = []
  for name, path in sorted(names.items()):
    try:
      resolve(name)
    except ModuleNotFoundError as e:
      if e.name is None or e.name.split('.')[0] not in OPTIONAL:
        failed.append(f'{name} ({path}: {e})')
    except (AttributeError, ImportError) as e:
      failed.append(f'{name} ({path}: {type(e).__name__}: {e})')
  assert not failed, f'{len(failed)} documented names do not resolve: ' + '; '.join(failed)
