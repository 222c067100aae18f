"""The import graph between a project's modules, read from their source.

:func:`project_modules` maps each module of the packages ``setup.cfg``
declares (with their ``package_dir``) to its file; :func:`build` parses every
one with :mod:`ast` and returns the edges ``importer -> imported`` between
them, each with the lines that make it. An edge is any import the module can
run, wherever it is written:

* ``import a.b`` and ``from a import b`` at the top level or inside a
  function (``from a import b`` is an edge to the submodule ``a.b`` when
  there is one, else to ``a``), relative imports resolved against the
  importer's package; imports under ``if TYPE_CHECKING:`` are left out;
* ``importlib.import_module('a.b')`` and ``__import__('a.b')`` with a literal
  name; with a computed name that starts with a literal prefix
  (``f'a.{name}'``), an edge to every ``prefix + s`` that is a module, for
  each string constant ``s`` of the importer (the registry tables of module
  names that such an import reads);
* the names of a package whose ``__init__`` imports them on first access
  (``__getattr__, __dir__ = _lazy.submodules(__name__, NAMES, ATTRIBUTES,
  OPTIONAL)``): the tables are read from the package's source, and reading
  ``package.name`` (an attribute of a module the importer bound, or
  ``from package import name``) is an edge to the module that defines it.
  The package itself imports none of them.

Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``; as in
other import checkers, that is not an edge (it would put every package and
its submodules in one cycle), but importing a name defined in ``a.b``'s
``__init__`` is.

A computed import the graph cannot follow (no literal prefix, outside the
lazy-import helper) is reported in :attr:`Graph.unfollowed`.
:func:`cycles` lists the graph's cycles, one per strongly connected part.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import os
from collections.abc import Iterable, Mapping

# The module whose computed imports are the lazy packages' tables.
LAZY_HELPER = 'fedjx._lazy'
_IMPORT_FUNCTIONS = ('import_module', '__import__')


@dataclasses.dataclass
class Graph:
  """Edges ``{importer: {imported: [line, ...]}}`` and unfollowed imports."""
  edges: dict[str, dict[str, list[int]]]
  files: dict[str, str]
  unfollowed: list[str]

  def where(self, importer: str, imported: str) -> str:
    lines = ','.join(str(n) for n in sorted(set(self.edges[importer][imported])))
    return f'{self.files[importer]}:{lines}'


def project_modules(root: str) -> dict[str, str]:
  """``{module name: file path}`` of the packages in ``root/setup.cfg``."""
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(root, 'setup.cfg'))
  packages = cfg['options']['packages'].split()
  package_dir = {}
  for line in cfg['options'].get('package_dir', '').splitlines():
    if '=' in line:
      name, path = (s.strip() for s in line.split('=', 1))
      package_dir[name] = path
  modules = {}
  for package in packages:
    directory = _package_directory(package, package_dir)
    for entry in sorted(os.listdir(os.path.join(root, directory))):
      if not entry.endswith('.py'):
        continue
      stem = entry[:-3]
      name = package if stem == '__init__' else f'{package}.{stem}'
      modules[name] = os.path.join(directory, entry)
  return modules


def _package_directory(package: str, package_dir: Mapping[str, str]) -> str:
  """The directory of ``package`` under setuptools' ``package_dir`` rules."""
  parts = package.split('.')
  for n in range(len(parts), 0, -1):
    prefix = '.'.join(parts[:n])
    if prefix in package_dir:
      return os.path.join(package_dir[prefix], *parts[n:])
  return os.path.join(*parts)


def build(root: str, modules: Mapping[str, str] | None = None) -> Graph:
  """The import graph of ``modules`` (default: :func:`project_modules`)."""
  modules = dict(project_modules(root) if modules is None else modules)
  trees = {}
  for name, path in modules.items():
    with open(os.path.join(root, path), encoding='utf-8') as f:
      trees[name] = ast.parse(f.read(), filename=path)
  lazy = {name: _lazy_tables(tree) for name, tree in trees.items()}
  lazy = {name: tables for name, tables in lazy.items() if tables is not None}
  graph = Graph(edges={name: {} for name in modules}, files=modules,
                unfollowed=[])
  for name, tree in trees.items():
    _Walker(name, modules, lazy, graph).visit_module(tree)
  return graph


def cycles(graph: Graph) -> list[list[str]]:
  """One cycle ``[m_0, m_1, ..., m_0]`` per strongly connected part."""
  out = []
  for part in _strongly_connected(graph.edges):
    if len(part) > 1:
      out.append(_shortest_cycle(graph.edges, part))
  return sorted(out)


def describe(graph: Graph, cycle: list[str]) -> str:
  """The cycle's edges, one a line, each with the lines that import."""
  return '\n'.join(f'  {a} -> {b}  ({graph.where(a, b)})'
                   for a, b in zip(cycle, cycle[1:]))


# ------------------------------------------------------------------ walking

def _lazy_tables(tree: ast.Module) -> tuple[set[str], dict[str, str]] | None:
  """The submodule names and ``{attribute: module}`` a lazy package imports
  on first access, read from its ``_lazy.submodules(...)`` call, or None."""
  constants: dict[str, ast.expr] = {}
  call = None
  for node in tree.body:
    if isinstance(node, ast.Assign):
      for target in node.targets:
        if isinstance(target, ast.Name):
          constants[target.id] = node.value
      value = node.value
      if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
          and value.func.attr == 'submodules'):
        call = value
  if call is None:
    return None
  args = list(call.args[1:])
  keywords = {k.arg: k.value for k in call.keywords}
  names = _evaluate(args[0] if args else keywords['names'], constants)
  attributes = _evaluate(args[1] if len(args) > 1 else
                         keywords.get('attributes'), constants) or {}
  optional = _evaluate(args[2] if len(args) > 2 else
                       keywords.get('optional'), constants) or {}
  return set(names) | set(optional), dict(attributes)


def _evaluate(node: ast.expr | None, constants: Mapping[str, ast.expr]):
  """A literal, a module-level name bound to one, or a sum of those."""
  if node is None:
    return None
  if isinstance(node, ast.Name):
    return _evaluate(constants[node.id], constants)
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    return _evaluate(node.left, constants) + _evaluate(node.right, constants)
  return ast.literal_eval(node)


class _Walker:
  """Adds one module's imports to the graph."""

  def __init__(self, name: str, modules: Mapping[str, str],
               lazy: Mapping[str, tuple[set[str], dict[str, str]]],
               graph: Graph):
    self.name = name
    self.modules = modules
    self.lazy = lazy
    self.graph = graph
    self.is_package = modules[name].endswith('__init__.py')
    self.bound: dict[str, str] = {}   # local name -> the project module

  def visit_module(self, tree: ast.Module) -> None:
    nodes = list(_runtime_nodes(tree))
    for node in nodes:
      if isinstance(node, ast.Import):
        self._import(node)
      elif isinstance(node, ast.ImportFrom):
        self._import_from(node)
    strings = {n.value for n in nodes
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    for node in nodes:
      if isinstance(node, ast.Call) and _is_import_call(node):
        self._import_call(node, strings)
      elif isinstance(node, ast.Attribute):
        self._attribute(node)

  def _edge(self, target: str, line: int) -> None:
    if target in self.modules and target != self.name:
      self.graph.edges[self.name].setdefault(target, []).append(line)

  def _member(self, module: str, attr: str) -> str | None:
    """The project module ``module.attr`` imports: a submodule, or a lazy
    package's attribute's module; None if it is a plain attribute."""
    if f'{module}.{attr}' in self.modules:
      return f'{module}.{attr}'
    names, attributes = self.lazy.get(module, ((), {}))
    if attr in names:
      return f'{module}.{attr}'
    return attributes.get(attr)

  def _import(self, node: ast.Import) -> None:
    for alias in node.names:
      self._edge(alias.name, node.lineno)
      if alias.asname:
        self.bound[alias.asname] = alias.name
      else:
        top = alias.name.partition('.')[0]
        self.bound[top] = top

  def _import_from(self, node: ast.ImportFrom) -> None:
    base = self._absolute(node.module, node.level)
    for alias in node.names:
      member = None if alias.name == '*' else self._member(base, alias.name)
      if member is None:
        self._edge(base, node.lineno)
      else:
        self._edge(member, node.lineno)
        self.bound[alias.asname or alias.name] = member

  def _absolute(self, module: str | None, level: int) -> str:
    if not level:
      return module or ''
    parts = self.name.split('.')
    keep = len(parts) - level + (1 if self.is_package else 0)
    base = '.'.join(parts[:keep])
    return f'{base}.{module}' if module else base

  def _import_call(self, node: ast.Call, strings: set[str]) -> None:
    if not node.args:
      return
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
      self._edge(arg.value, node.lineno)
      return
    prefix = _literal_prefix(arg)
    if prefix:
      for s in strings:
        self._edge(prefix + s, node.lineno)
    elif self.name != LAZY_HELPER:
      self.graph.unfollowed.append(
          f'{self.graph.files[self.name]}:{node.lineno}: '
          f'{ast.unparse(node)}')

  def _attribute(self, node: ast.Attribute) -> None:
    chain = []
    inner: ast.expr = node
    while isinstance(inner, ast.Attribute):
      chain.append(inner.attr)
      inner = inner.value
    if not isinstance(inner, ast.Name) or inner.id not in self.bound:
      return
    module = self.bound[inner.id]
    for attr in reversed(chain):
      member = self._member(module, attr)
      if member is None:
        break
      self._edge(member, node.lineno)
      module = member


def _runtime_nodes(tree: ast.AST) -> Iterable[ast.AST]:
  """Every node of ``tree`` but those under ``if TYPE_CHECKING:``."""
  stack = [tree]
  while stack:
    node = stack.pop()
    yield node
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and 'TYPE_CHECKING' in ast.unparse(child.test):
        stack.extend(child.orelse)
        continue
      stack.append(child)


def _is_import_call(node: ast.Call) -> bool:
  func = node.func
  name = func.attr if isinstance(func, ast.Attribute) else getattr(func, 'id', '')
  return name in _IMPORT_FUNCTIONS


def _literal_prefix(node: ast.expr) -> str:
  """The literal start of an f-string or ``'...' + x``, or ``''``."""
  if isinstance(node, ast.JoinedStr) and node.values:
    first = node.values[0]
    if isinstance(first, ast.Constant):
      return first.value
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    if isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
      return node.left.value
  return ''


# ------------------------------------------------------------------- cycles

def _strongly_connected(edges: Mapping[str, Mapping[str, object]]
                        ) -> list[list[str]]:
  """Tarjan's strongly connected components, iteratively."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  on_stack: set[str] = set()
  stack: list[str] = []
  parts = []
  for start in sorted(edges):
    if start in index:
      continue
    work = [(start, iter(sorted(edges[start])))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(edges[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        part = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          part.append(member)
          if member == node:
            break
        parts.append(sorted(part))
  return parts


def _shortest_cycle(edges: Mapping[str, Mapping[str, object]],
                    part: list[str]) -> list[str]:
  """A shortest cycle through the first module of ``part``, within it."""
  members = set(part)
  start = part[0]
  previous = {start: None}
  frontier = [start]
  while frontier:
    following = []
    for node in frontier:
      for child in sorted(edges[node]):
        if child not in members:
          continue
        if child == start:
          path = [node]
          while path[-1] != start:
            path.append(previous[path[-1]])
          return path[::-1] + [start]
        if child not in previous:
          previous[child] = node
          following.append(child)
    frontier = following
  raise AssertionError(f'{part} is not strongly connected')
