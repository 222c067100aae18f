"""The kit is the vocabulary of every algorithm module, and is documented.

``fedjx.algorithms.kit``'s docstring states what an algorithm module
(``algorithms/*_lib.py``) may import from ``fedjx.algorithms``: the kit (for
every name it has), another algorithm's module (``*_lib``), a part of
another kind from a module of :data:`kit.PART_MODULES`, or the machinery of
a round written by hand from :data:`kit.ROUND_MODULES`, never an object the
kit exports. The walker here reads each module's source with ``ast``: top-level and
function-local imports, relative imports, ``importlib.import_module`` and
``__import__``, attributes of the modules it bound and dotted
``fedjx.algorithms.<module>.<name>`` chains; it is checked on small sources
written here, one per kind of import, legal and not.
"""

import ast
import importlib
import inspect
import pathlib
import textwrap
from typing import NamedTuple

import pytest

from fedjx.algorithms import kit

PACKAGE = 'fedjx.algorithms'
ROOT = pathlib.Path(__file__).resolve().parent.parent / 'algorithms'
SUBPACKAGES = frozenset(p.parent.name for p in ROOT.glob('*/__init__.py'))
MODULES = frozenset(p.stem for p in ROOT.glob('*.py')
                    if p.stem != '__init__') | SUBPACKAGES
ALGORITHM_MODULES = sorted(m for m in MODULES if m.endswith('_lib'))


class Ref(NamedTuple):
  """A reference to ``fedjx.algorithms.<module>`` (``'aggregators.core'`` for
  a subpackage's module, ``''``: the package itself, ``'?'``: a computed
  name) or to its attribute ``name``, at ``line``."""

  module: str
  name: str | None
  line: int


def _is_module(module: str) -> bool:
  """Whether ``fedjx.algorithms.<module>`` is a module or a subpackage."""
  path = ROOT.joinpath(*module.split('.'))
  return path.with_suffix('.py').exists() or (path / '__init__.py').exists()


def _split(dotted: str) -> tuple[str, list[str]] | None:
  """``('aggregators.core', ['mean'])`` for
  ``'fedjx.algorithms.aggregators.core.mean'``: the longest module prefix
  (``''`` for the package) and the attributes after it."""
  if dotted != PACKAGE and not dotted.startswith(PACKAGE + '.'):
    return None
  parts = dotted[len(PACKAGE) + 1:].split('.') if dotted != PACKAGE else []
  n = len(parts)
  while n and not _is_module('.'.join(parts[:n])):
    n -= 1
  return '.'.join(parts[:n]), parts[n:]


def _submodule(dotted: str) -> str | None:
  """``'base'`` for ``'fedjx.algorithms.base'``, ``''`` for the package."""
  split = _split(dotted)
  return None if split is None else (
      '.'.join(filter(None, [split[0]] + split[1][:1])))


def _dotted(node: ast.expr) -> str | None:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    return '.'.join([node.id] + parts[::-1])
  return None


def references(source: str) -> list[Ref]:
  """Every reference of an algorithm module's ``source`` to ``fedjx.algorithms``."""
  tree = ast.parse(source)
  refs, bound = [], {}  # bound: a local name -> the submodule it holds.
  for node in ast.walk(tree):  # Top-level and function-local alike.
    if isinstance(node, ast.Import):
      for alias in node.names:
        module = _submodule(alias.name)
        if module is not None:
          refs.append(Ref(module, None, node.lineno))
          if alias.asname:
            bound[alias.asname] = module
    elif isinstance(node, ast.ImportFrom):
      base = PACKAGE if node.level == 1 else None  # Relative to the package.
      name = node.module if not node.level else (
          f'{base}.{node.module}' if node.module else base)
      module = _submodule(name) if name else None
      for alias in node.names:
        inner = '.'.join(filter(None, [module, alias.name]))
        if module is not None and _is_module(inner):
          refs.append(Ref(inner, None, node.lineno))
          bound[alias.asname or alias.name] = inner
        elif module is not None:
          refs.append(Ref(module, alias.name, node.lineno))
    elif isinstance(node, ast.Call) and _dotted(node.func) in (
        'importlib.import_module', '__import__', 'import_module'):
      arg = node.args[0] if node.args else None
      if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        module = _submodule(arg.value)
        if module is not None:
          refs.append(Ref(module, None, node.lineno))
      else:
        refs.append(Ref('?', None, node.lineno))
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    if isinstance(node.value, ast.Name) and node.value.id in bound:
      refs.append(Ref(bound[node.value.id], node.attr, node.lineno))
    dotted = _dotted(node)
    split = _split(dotted) if dotted else None
    if split and split[0] and len(split[1]) <= 1:
      module, name = split
      refs.append(Ref(module, name[0] if name else None, node.lineno))
  return refs


def _exported_objects() -> set[int]:
  return {id(getattr(kit, n)) for n in kit.__all__
          if not isinstance(getattr(kit, n), (str, int, float, bool, type(None)))}


def violations(source: str, itself: str = '') -> list[str]:
  """The references of ``source`` that break the kit's rule, one line each."""
  exported = _exported_objects()
  found = []
  for ref in references(source):
    where = f'line {ref.line}: '
    if ref.module == 'kit':
      if ref.name is not None and ref.name not in kit.__all__:
        found.append(where + f'kit.{ref.name} is not in kit.__all__')
      continue
    allowed = ((ref.module.endswith('_lib') and ref.module != itself)
               or ref.module.split('.')[0] in kit.PART_MODULES
               or ref.module in kit.ROUND_MODULES)
    if not allowed:
      what = {'': PACKAGE, '?': 'a computed module name'}.get(
          ref.module, f'{PACKAGE}.{ref.module}')
      found.append(where + f'imports {what}' + (
          f' ({ref.name})' if ref.name else '') + '; an algorithm module '
          'imports the kit, another *_lib, one of kit.PART_MODULES or '
          'kit.ROUND_MODULES')
    elif ref.name is not None:
      obj = getattr(importlib.import_module(f'{PACKAGE}.{ref.module}'),
                    ref.name, None)
      if obj is not None and id(obj) in exported:
        found.append(where + f'{ref.module}.{ref.name} is exported by the '
                     'kit; take it from the kit')
  return found


@pytest.mark.parametrize('module', ALGORITHM_MODULES)
def test_algorithm_module_imports_only_what_the_kit_allows(module):
  source = (ROOT / f'{module}.py').read_text()
  assert violations(source, itself=module) == []


def test_every_algorithm_module_is_written_from_the_kit():
  assert 'fedavg_lib' in ALGORITHM_MODULES and len(ALGORITHM_MODULES) > 15
  without_kit = [m for m in ALGORITHM_MODULES if not any(
      r.module == 'kit' for r in references((ROOT / f'{m}.py').read_text()))]
  # yogi_lib holds FedOpt's server optimizers (optax), no algorithm.
  assert without_kit == ['yogi_lib']


GOOD = {
    'the kit': 'from fedjx.algorithms import kit\nkit.make_algorithm\n',
    'another algorithm': 'from fedjx.algorithms.fedavg_lib import TRAITS\n',
    'a part of another kind': (
        'from fedjx.algorithms import aggregators, kit\n'
        'aggregators.gaussian(1.0, 1.0)\naggregators.mean()\n'),
    'the machinery of a round by hand': (
        'from fedjx.algorithms import nonfinite\nnonfinite.map_clients\n'),
    'primitives': 'import fedjx\nimport jax\nfedjx.broadcast\n',
}

BAD = {
    'a module outside the rule': ('from fedjx.algorithms import schedules\n',
                                  'schedules'),
    'a name from one': ('from fedjx.algorithms.tuner import TunerState\n',
                        'tuner'),
    'a function-local import': (
        'def f():\n  from fedjx.algorithms import hypergradients\n',
        'hypergradients'),
    'a relative import': ('from . import aggregators, schedules\n', 'schedules'),
    'a relative name': ('from .schedules import at_round\n', 'schedules'),
    'import_module': ('import importlib\n'
                      'importlib.import_module("fedjx.algorithms.tuner")\n',
                      'tuner'),
    'a computed import': ('import importlib\nimportlib.import_module(name)\n',
                          'computed'),
    'a dotted chain': ('import fedjx\nfedjx.algorithms.schedules.at_round\n',
                       'schedules'),
    'import as': ('import fedjx.algorithms.schedules as s\n', 'schedules'),
    'the package': ('from fedjx.algorithms import feddyn\n', 'feddyn'),
    'a kit object from a round module': (
        'from fedjx.algorithms import base\nbase.make_algorithm\n',
        'base.make_algorithm is exported by the kit'),
    'a kit name from the template': (
        'from fedjx.algorithms.template import Options\n', 'template.Options'),
    'a kit name from a module': (
        'from fedjx.algorithms import template\ntemplate.algorithm\n',
        'template.algorithm is exported by the kit'),
    'a part of another kind than allowed': (
        'from fedjx.algorithms.attacks import core\n', 'attacks.core'),
    'a name the kit lacks': ('from fedjx.algorithms import kit\nkit.nothing\n',
                             'kit.nothing is not in kit.__all__'),
    'itself': ('from fedjx.algorithms.fedavg_lib import TRAITS\n', 'fedavg_lib'),
}


@pytest.mark.parametrize('case', sorted(GOOD))
def test_walker_allows(case):
  assert violations(GOOD[case]) == []


@pytest.mark.parametrize('case', sorted(BAD))
def test_walker_refuses(case):
  source, expected = BAD[case]
  found = violations(source, itself='fedavg_lib' if case == 'itself' else '')
  assert found and expected in ' '.join(found), found


def test_walker_sees_function_local_imports_and_attributes():
  refs = references(textwrap.dedent('''
      def f():
        from fedjx.algorithms.aggregators import core as agg
        return agg.gaussian
  '''))
  assert ('aggregators.core', None) in [(r.module, r.name) for r in refs]
  assert ('aggregators.core', 'gaussian') in [(r.module, r.name) for r in refs]


# ---------------------------------------------------------------- documented

def _definition(name: str) -> tuple[str, str]:
  """``(module, name)`` where the kit's ``name`` is defined (its own or
  imported with ``from fedjx.algorithms.<module> import <name> [as ...]``)."""
  for node in ast.parse((ROOT / 'kit.py').read_text()).body:
    if isinstance(node, ast.ImportFrom):
      for alias in node.names:
        if (alias.asname or alias.name) == name:
          return node.module[len(PACKAGE) + 1:], alias.name
  return 'kit', name


def _attribute_docstring(module: str, name: str) -> str:
  """The string right after ``name = ...`` at the top level of ``module``."""
  path = ROOT.joinpath(*module.split('.')).with_suffix('.py')
  body = ast.parse(path.read_text()).body
  for node, following in zip(body, body[1:]):
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, ast.AnnAssign) else [])
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      if (isinstance(following, ast.Expr)
          and isinstance(following.value, ast.Constant)
          and isinstance(following.value.value, str)):
        return following.value.value
  return ''


@pytest.mark.parametrize('name', sorted(kit.__all__))
def test_every_kit_name_exists_and_is_documented(name):
  assert hasattr(kit, name)
  obj = getattr(kit, name)
  module, defined = _definition(name)
  if inspect.isfunction(obj) or (inspect.isclass(obj) and obj.__name__ == defined):
    doc = obj.__doc__ or ''
    assert not doc.startswith(f'{defined}('), f'{name}: a NamedTuple docstring'
  else:  # A constant or a type: the string after its assignment.
    doc = _attribute_docstring(module, defined)
  assert doc.strip(), f'kit.{name} ({module}.{defined}) has no docstring'


def test_kit_public_list_is_sorted_out():
  assert len(set(kit.__all__)) == len(kit.__all__)
  assert set(kit.PART_MODULES) <= MODULES
  assert set(kit.ROUND_MODULES) <= MODULES
  assert 'kit' not in kit.PART_MODULES + kit.ROUND_MODULES
  assert not any(m.endswith('_lib') for m in kit.PART_MODULES + kit.ROUND_MODULES)
  assert len(kit.__all__) <= 26  # About 25 names, one per thing.
