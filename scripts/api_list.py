"""Writes docs/api.md: every public module of fedjx and its public names.

The packages are ``fedjx``, ``fedjx.algorithms``, ``fedjx.datasets``,
``fedjx.models`` and ``fedjx.experiments``. Each package is listed with its
own names (its ``__all__``), then each of its public modules (files and
subpackages not starting with ``_``, subpackages' modules too) with its
names: the module's ``__all__`` where it defines one, else the names the
package's ``__init__`` imports from it, else none (the module alone). Each
line carries a one-phrase summary: the first sentence of the object's
docstring (a constant, which has none, shows its value or its kind).

Everything is read from the source with ``ast``, nothing is imported, so
the page is the same with or without the optional dependencies installed.
A name in an ``__all__`` that its module neither defines nor imports is an
error. ``tests/test_api_list.py`` regenerates the page in memory and
compares it with the committed one.

  python scripts/api_list.py            # writes docs/api.md
  python scripts/api_list.py --check    # exit status 1 if it is stale
  python scripts/api_list.py --root DIR # read the sources of another tree
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, 'docs', 'api.md')
# The packages, where their sources live (setup.cfg's package_dir).
PACKAGES = {'fedjx': 'fedjx', 'fedjx.algorithms': 'algorithms',
            'fedjx.datasets': 'datasets', 'fedjx.models': 'models',
            'fedjx.experiments': 'experiments'}
MAX_VALUE = 60  # A constant's value is shown when its source is this short.
# Words a sentence does not end at (a period then a capital: "Acar et al. A").
ABBREVIATIONS = ('al', 'e.g', 'i.e', 'etc', 'vs', 'cf', 'Fig', 'Eq', 'Sec')


class Module:
  """One module's source, read with ``ast``."""

  def __init__(self, name: str, path: str, is_package: bool):
    self.name, self.path, self.is_package = name, path, is_package
    with open(path, encoding='utf-8') as f:
      self.source = f.read()
    self.tree = ast.parse(self.source, path)
    self.doc = ast.get_docstring(self.tree) or ''
    self.all = None         # The literal __all__, if any.
    self.defined = {}       # name -> the defining node.
    self.imported = {}      # name -> (module, name there), for from-imports.
    self.lazy = {}          # name -> module: a package's lazy ``_NAMES``.
    for node in self.tree.body:
      self._read(node)

  def _read(self, node: ast.AST) -> None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      self.defined[node.name] = node
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for target in targets:
        if isinstance(target, ast.Name):
          if target.id == '__all__':
            self.all = list(ast.literal_eval(node.value))
          elif target.id == '_NAMES' and isinstance(node.value, ast.Dict):
            self.lazy = ast.literal_eval(node.value)
          else:
            self.defined[target.id] = node
        elif isinstance(target, ast.Tuple):  # a, b = 1, 2
          values = (node.value.elts if isinstance(node.value, ast.Tuple)
                    and len(node.value.elts) == len(target.elts) else None)
          for i, element in enumerate(target.elts):
            if isinstance(element, ast.Name):
              self.defined[element.id] = (
                  ast.Assign([element], values[i]) if values else node)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      for alias in node.names:
        self.imported[alias.asname or alias.name] = (node.module, alias.name)
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.asname:
          self.imported[alias.asname] = (alias.name, None)
    elif isinstance(node, ast.If):  # E.g. TYPE_CHECKING blocks.
      for child in node.body + node.orelse:
        self._read(child)


class Source:
  """The packages' modules by dotted name."""

  def __init__(self, root: str = ROOT):
    self.modules: dict[str, Module] = {}
    self.packages: dict[str, list[str]] = {}
    for package, folder in PACKAGES.items():
      self.packages[package] = self._walk(package, os.path.join(root, folder))

  def _walk(self, package: str, folder: str) -> list[str]:
    """Reads ``package`` and its public modules; returns those modules' names."""
    self.modules[package] = Module(package, os.path.join(folder, '__init__.py'),
                                   True)
    names = []
    for entry in sorted(os.listdir(folder)):
      path = os.path.join(folder, entry)
      if entry.startswith('_'):
        continue
      if entry.endswith('.py'):
        name = f'{package}.{entry[:-3]}'
        self.modules[name] = Module(name, path, False)
        names.append(name)
      elif (os.path.isfile(os.path.join(path, '__init__.py'))
            and f'{package}.{entry}' not in PACKAGES):
        name = f'{package}.{entry}'
        names.append(name)
        names.extend(self._walk(name, path))
    return names

  def summary(self, module: str, name: str, seen: frozenset = frozenset()) -> str:
    """The one-phrase summary of ``module.name``, following re-exports."""
    if (module, name) in seen:
      raise ValueError(f'{module}.{name}: an import cycle.')
    seen = seen | {(module, name)}
    if f'{module}.{name}' in self.modules:
      return first_sentence(self.modules[f'{module}.{name}'].doc)
    m = self.modules.get(module)
    if m is None:
      return f'from `{module}`.'
    if name in m.defined:
      return describe(m, m.defined[name])
    if name in m.imported:
      source, original = m.imported[name]
      if original is None:  # ``import a.b as name``: a module.
        return (first_sentence(self.modules[source].doc)
                if source in self.modules else f'the module `{source}`.')
      return self.summary(source, original, seen)
    if name in m.lazy:
      return self.summary(m.lazy[name], name, seen)
    raise ValueError(f'{module}.__all__ names {name!r}, which {m.path} '
                     'neither defines nor imports.')

  def names(self, module: str) -> list[str]:
    """``module``'s public names: its ``__all__``, else its package's imports."""
    m = self.modules[module]
    if m.all is not None:
      return sorted(set(m.all), key=_order)
    package = self.modules[module.rsplit('.', 1)[0]]
    exported = set(package.all or ())
    names = {original for alias, (source, original) in package.imported.items()
             if source == module and original and (
                 not exported or alias in exported)}
    names.update(n for n, source in package.lazy.items() if source == module)
    return sorted(names, key=_order)


def _order(name: str) -> tuple[str, str]:
  return (name.lower(), name)


def first_sentence(doc: str) -> str:
  """The docstring's first sentence (of its first paragraph), markup plain."""
  paragraph = doc.strip().split('\n\n')[0]
  text = ' '.join(line.strip() for line in paragraph.splitlines())
  text = re.sub(r':[a-z]+:`~?([^`]+)`', r'`\1`', text)   # :func:`x` -> `x`
  text = re.sub(r'``([^`]+)``', r'`\1`', text)            # ``x`` -> `x`
  for match in re.finditer(r'\.(\s+|$)', text):
    before, after = text[:match.start()], text[match.end():match.end() + 1]
    word = re.search(r'[\w.]*$', before).group()
    if not after or (after.isupper() and word not in ABBREVIATIONS
                     and not before.endswith('.')):
      text = text[:match.start() + 1]
      break
  text = text.strip()
  if not text:
    return '(no docstring).'
  return text if text[-1] in '.:!?)' else text + '.'


def describe(module: Module, node: ast.AST) -> str:
  """The summary of a definition: its docstring, or a constant's value."""
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return first_sentence(ast.get_docstring(node) or '')
  value = node.value
  if value is None:
    return '(no docstring).'
  text = ast.get_source_segment(module.source, value) or ''
  text = ' '.join(text.split())
  if len(text) <= MAX_VALUE and '`' not in text:
    return f'`= {text}`.'
  kinds = {ast.Dict: 'a dict', ast.Tuple: 'a tuple', ast.List: 'a list',
           ast.Set: 'a set', ast.Call: 'built by a call', ast.Lambda: 'a lambda'}
  return f'a constant, {kinds.get(type(value), "an expression")}.'


def render(source: Source | None = None) -> str:
  """The page's markdown."""
  source = source or Source()
  out = ['# Public API', '',
         'Every public module of `fedjx`, `fedjx.algorithms`, `fedjx.datasets`,',
         '`fedjx.models` and `fedjx.experiments`, with its public names: the',
         "module's `__all__` where it defines one, else the names its package",
         'imports from it (a module without either is listed alone). Each',
         "summary is the first sentence of the object's docstring. Generated",
         'by `python scripts/api_list.py` from the source;',
         '`tests/test_api_list.py` fails when this page is stale.', '']
  for package, modules in source.packages.items():
    m = source.modules[package]
    out += [f'## `{package}`', '', first_sentence(m.doc), '']
    if m.all:
      out += [f'Names of `{package}`:', '']
      out += [f'- `{n}`: {source.summary(package, n)}'
              for n in sorted(set(m.all), key=_order)]
      out.append('')
    for name in modules:
      mod = source.modules[name]
      out += [f'### `{name}`', '', first_sentence(mod.doc), '']
      if mod.is_package and mod.all is None:
        names = []
      else:
        names = source.names(name)
      if names:
        out += [f'- `{n}`: {source.summary(name, n)}' for n in names]
        out.append('')
  return '\n'.join(out).rstrip('\n') + '\n'


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--check', action='store_true',
                      help='compare with docs/api.md instead of writing it')
  parser.add_argument('--root', default=ROOT,
                      help='the source tree to read (default: this checkout)')
  args = parser.parse_args(argv)
  text = render(Source(args.root))
  if args.check:
    with open(PAGE, encoding='utf-8') as f:
      stale = f.read() != text
    if stale:
      print(f'{PAGE} is stale: run python scripts/api_list.py', file=sys.stderr)
    return int(stale)
  with open(PAGE, 'w', encoding='utf-8') as f:
    f.write(text)
  print(f'wrote {PAGE}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
