"""No import cycle between fedjx's modules (tests/import_graph.py).

The graph holds every import a module can run: top-level and function-local
imports, ``importlib.import_module`` of a literal name or of a prefix and a
table of names, and the names a lazy package imports on first access. The
walker itself is checked on small packages written here, one per kind of
import.
"""

import os
import textwrap

import pytest

import import_graph

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def test_no_import_cycle_between_fedjx_modules():
  graph = import_graph.build(ROOT)
  assert not graph.unfollowed, (
      'imports of a computed name the graph cannot follow (import a literal '
      'name, or a literal prefix and a table of names):\n'
      + '\n'.join(graph.unfollowed))
  found = import_graph.cycles(graph)
  assert not found, 'import cycles:\n' + '\n\n'.join(
      import_graph.describe(graph, c) for c in found)


def test_every_package_of_setup_cfg_is_walked():
  modules = import_graph.project_modules(ROOT)
  for package in ('fedjx', 'fedjx.algorithms', 'fedjx.algorithms.aggregators',
                  'fedjx.algorithms.attacks', 'fedjx.algorithms.compression',
                  'fedjx.algorithms.privacy', 'fedjx.algorithms.transforms',
                  'fedjx.datasets', 'fedjx.models',
                  'fedjx.experiments', 'fedjx.experiments.sweeps',
                  'fedjx.interpreters', 'fedjx.deploy'):
    assert package in modules
  assert modules['fedjx.experiments.sweeps.run'] == os.path.join(
      'experiments', 'sweeps', 'run.py')
  assert modules['fedjx.algorithms.aggregators.core'] == os.path.join(
      'algorithms', 'aggregators', 'core.py')
  assert modules['fedjx.interpreters.plan'] == os.path.join(
      'fedjx', 'interpreters', 'plan.py')


def test_the_graph_sees_imports_of_every_kind():
  graph = import_graph.build(ROOT)
  edges = graph.edges
  # A function-local import.
  assert 'fedjx.experiments.registry' in edges['fedjx.experiments.config']
  # Attributes of a lazy package: ``import fedjx`` then ``fedjx.reduce_sum``.
  assert 'fedjx.api' in edges['fedjx.algorithms.aggregators.core']
  # A lazy subpackage's name is an edge to the module that defines it.
  assert 'fedjx.algorithms.aggregators.robust' in edges['fedjx.experiments.parts']
  # The lazy package itself imports none of its names.
  assert 'fedjx.algorithms' not in edges['fedjx']


def _package(tmp_path, files):
  """A package ``pkg`` of ``files`` ({name: source}) under ``tmp_path``."""
  os.makedirs(tmp_path / 'pkg', exist_ok=True)
  modules = {}
  for name, source in files.items():
    path = os.path.join('pkg', f'{name}.py')
    (tmp_path / path).write_text(textwrap.dedent(source))
    modules['pkg' if name == '__init__' else f'pkg.{name}'] = path
  return import_graph.build(str(tmp_path), modules)


LAZY = '''
    from fedjx import _lazy
    NAMES = ('a',)
    __getattr__, __dir__ = _lazy.submodules(__name__, NAMES, {'f': 'pkg.b'})
'''


@pytest.mark.parametrize('files, cycle', [
    ({'__init__': '', 'a': 'from pkg import b\n',
      'b': 'def f():\n  from . import a\n'}, ['pkg.a', 'pkg.b', 'pkg.a']),
    ({'__init__': '', 'a': 'import importlib\nimportlib.import_module("pkg.b")\n',
      'b': 'import pkg.a\n'}, ['pkg.a', 'pkg.b', 'pkg.a']),
    ({'__init__': '', 'a': 'import pkg.b as b\n',
      'b': 'import importlib\nTABLE = {"x": "a"}\n'
           'def get(k):\n  return importlib.import_module(f"pkg.{TABLE[k]}")\n'},
     ['pkg.a', 'pkg.b', 'pkg.a']),
    ({'__init__': LAZY, 'a': 'import pkg\npkg.f()\n', 'b': 'from pkg import a\n'},
     ['pkg.a', 'pkg.b', 'pkg.a']),
    ({'__init__': 'from pkg import a\n', 'a': 'from pkg import NAME\n'},
     ['pkg', 'pkg.a', 'pkg']),
], ids=['function-local', 'import_module', 'registry table', 'lazy attribute',
        'package name'])
def test_cycles_are_found_through_every_kind_of_import(tmp_path, files, cycle):
  graph = _package(tmp_path, files)
  assert import_graph.cycles(graph) == [cycle]
  assert 'pkg' in import_graph.describe(graph, cycle)


def test_type_checking_imports_and_lazy_packages_make_no_cycle(tmp_path):
  graph = _package(tmp_path, {
      '__init__': LAZY,
      'a': 'from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
           '  from pkg import b\nimport pkg\n',
      'b': 'import pkg.a\n'})
  assert import_graph.cycles(graph) == []


def test_a_computed_import_without_a_prefix_is_reported(tmp_path):
  graph = _package(tmp_path, {
      '__init__': '', 'a': 'import importlib\n'
                           'def get(n):\n  return importlib.import_module(n)\n'})
  assert len(graph.unfollowed) == 1 and 'a.py:3' in graph.unfollowed[0]
