"""What there is to run: ``fedjx-run --list``.

Everything here is read from the code, never from a list kept by hand: the
shipped configs from the files in ``configs/`` (each one's ``get_config``
argument and the first paragraph of its docstring, read with :mod:`ast`,
so listing them imports neither the files nor JAX), and the algorithms,
datasets and models from the registries of
:mod:`fedjx.experiments.registry` (their builders' signatures and
docstrings)::

  fedjx-run --list                 # configs, algorithms, datasets, models
  fedjx-run --list=configs         # (or algorithms, datasets, models)
  fedjx-run --list=fedprox         # one algorithm's options and defaults
  fedjx-run --list=digits          # one dataset's (or model's) options

:func:`render` returns the text printed.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedjx.experiments import config as config_schema

KINDS = ('configs', 'algorithms', 'datasets', 'models')
USAGE = ('--list=configs, --list=algorithms, --list=datasets, --list=models, or '
         '--list=NAME for one registered name')


class ListError(ValueError):
  """``--list=WHAT`` names nothing listable (one line)."""


def _plain(text: str) -> str:
  """Docstring markup as terminal text: ````x```` -> x, :class:`~a.B` -> B."""
  text = re.sub(r':\w+:`~([\w.]+)`', lambda m: m.group(1).rsplit('.', 1)[-1], text)
  text = re.sub(r':\w+:`([^`]+)`', r'\1', text)
  return re.sub(r'``([^`]+)``', r'\1', text)


def summary(doc: str | None) -> str:
  """The first paragraph of a docstring, on one line, markup removed."""
  first = inspect.cleandoc(doc or '').split('\n\n')[0]
  return _plain(' '.join(first.split()))


def _table(rows: Sequence[tuple[str, ...]], indent: str = '  ') -> str:
  """Rows as aligned columns (the last one left ragged)."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)] if rows else []
  out = []
  for row in rows:
    cells = [c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]
    out.append((indent + '  '.join(cells)).rstrip() + '\n')
  return ''.join(out)


# ------------------------------------------------------------------ configs

def configs_dir() -> str | None:
  """The shipped ``configs/`` folder: beside the package's source (a
  checkout or an editable install), else ``./configs``; None if neither."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for candidate in (os.path.join(here, 'configs'), os.path.abspath('configs')):
    if os.path.isdir(candidate):
      return candidate
  return None


def find_config(path: str) -> str | None:
  """The config file ``path`` names: relative to the current folder first,
  then to the shipped ``configs/`` folder (``configs/NAME.py`` and
  ``NAME.py`` both name a shipped config from any folder); None if neither
  holds it."""
  if os.path.exists(path) or os.path.isabs(path):
    return path if os.path.exists(path) else None
  directory = configs_dir()
  if directory is None:
    return None
  parts = os.path.normpath(path).split(os.sep)
  candidates = [os.path.join(directory, *parts)]
  if len(parts) > 1 and parts[0] == os.path.basename(directory):
    candidates.insert(0, os.path.join(directory, *parts[1:]))
  for candidate in candidates:
    if os.path.exists(candidate):
      return candidate
  return None


def config_names() -> list[str]:
  """The file names of the shipped configs (``[]`` without a configs/ folder)."""
  directory = configs_dir()
  if directory is None:
    return []
  return sorted(f for f in os.listdir(directory)
                if f.endswith('.py') and not f.startswith('_'))


def _shown_path(path: str) -> str:
  relative = os.path.relpath(path)
  return relative if not relative.startswith(os.pardir) else path


def config_entry(path: str) -> tuple[str, str]:
  """``(name[:ARG=default], summary)`` of a config file, read with ``ast``."""
  name = os.path.basename(path)
  try:
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), filename=path)
  except (OSError, SyntaxError, ValueError) as e:
    return name, f'(cannot be read: {" ".join(str(e).split())})'
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name == 'get_config':
      args = node.args.posonlyargs + node.args.args
      if args:
        defaults = [None] * (len(args) - len(node.args.defaults)) + list(
            node.args.defaults)
        arg, default = args[0].arg, defaults[0]
        shown = '' if default is None else f'={ast.literal_eval(default)}'
        name += f'[:{arg}{shown}]' if default is not None else f':{arg}'
      break
  else:
    return name, '(defines no get_config())'
  return name, summary(ast.get_docstring(tree))


def list_configs() -> str:
  """Every ``configs/*.py`` with its argument and what it runs."""
  directory = configs_dir()
  if directory is None:
    return ('configs: no configs/ folder here or beside the package (it ships '
            'with the repository, not the wheel).\n')
  rows = [config_entry(os.path.join(directory, f)) for f in config_names()]
  where = _shown_path(directory)
  return (f'{where}/ ({len(rows)} configs; fedjx-run --config '
          'configs/NAME.py[:ARG] runs one from any folder):\n' + _table(rows))


# --------------------------------------------------------------- registries

def _registry() -> Any:
  from fedjx.experiments import registry  # deferred: before JAX (usage errors, config checks)
  return registry


def _algorithm_summary(registry: Any, name: str) -> str:
  builder = registry.algorithm_builder(name)
  declared = registry.algorithm_traits(name)
  text = summary(builder.__doc__)
  if 'module docstring' in text:  # The builder's docstring points to its module's.
    module = sys.modules.get(getattr(builder, '__module__', ''))
    text = summary(getattr(module, '__doc__', None)) or text
  traits = []
  if declared.asynchronous:
    traits.append('asynchronous')
  if declared.population is not None:
    traits.append(f'per-client state over {declared.population}')
  return text + (f' [{"; ".join(traits)}]' if traits else '')


def list_algorithms() -> str:
  registry = _registry()
  rows = [(name, _algorithm_summary(registry, name)) for name in registry.ALGORITHMS]
  return (f'algorithms ({len(rows)}; config.algorithm.name; fedjx-run '
          '--list=NAME shows one\'s options):\n' + _table(rows))


def _builders(kind: str) -> Mapping[str, Callable[..., Any]]:
  registry = _registry()
  return {'datasets': registry.DATASETS, 'models': registry.MODELS}[kind]


def list_builders(kind: str) -> str:
  """The registered datasets or models with their summaries."""
  table = _builders(kind)
  rows = [(name, summary(inspect.getdoc(fn))) for name, fn in table.items()]
  field = kind[:-1]
  return (f'{kind} ({len(rows)}; config.{field}.name; fedjx-run --list=NAME '
          'shows one\'s options):\n' + _table(rows))


def _default(param: inspect.Parameter) -> str:
  if param.default is inspect.Parameter.empty:
    return '(required)'
  return repr(param.default)


def _annotation(param: inspect.Parameter) -> str:
  if param.annotation is inspect.Parameter.empty:
    return ''
  text = param.annotation if isinstance(param.annotation, str) else getattr(
      param.annotation, '__name__', str(param.annotation))
  return str(text).replace('typing.', '')


def _option_rows(params: Mapping[str, inspect.Parameter],
                 notes: Mapping[str, str]) -> list[tuple[str, str, str]]:
  """``(option, default, type and notes)`` of each option."""
  rows = []
  for name, p in params.items():
    kind = _annotation(p)
    if name.endswith('optimizer'):
      kind = "optax optimizer {'name': ..., ...}"
    if name in notes:
      kind = f'{kind} ({notes[name]})'.strip()
    rows.append((name, _default(p), kind))
  return [('option', 'default', 'type'), *rows]


def describe_algorithm(name: str) -> str:
  """Algorithm ``name``'s options with their defaults, as a config sets them."""
  registry = _registry()
  options = registry.builder_options(name)
  notes = {}
  population = registry.algorithm_traits(name).population
  if population is not None:
    notes[population] = 'the runner sets the population size unless given'
  set_by_runner = ', '.join(r for r in registry.RESERVED)
  return (f'algorithm {name}: {_algorithm_summary(registry, name)}\n'
          f'options (--config.algorithm.OPTION=VALUE; the runner sets '
          f'{set_by_runner}):\n' + _table(_option_rows(options, notes)))


def describe_builder(kind: str, name: str) -> str:
  """Dataset or model ``name``'s options with their defaults."""
  field = kind[:-1]
  fn = _builders(kind)[name]
  options = _registry().builder_options(name, field)
  return (f'{field} {name}: {summary(inspect.getdoc(fn))}\n'
          f'options (--config.{field}.OPTION=VALUE):\n'
          + _table(_option_rows(options, {})))


# ------------------------------------------------------------------- render

def render(what: str) -> str:
  """The text of ``fedjx-run --list=WHAT`` (``'all'``: every kind).

  Raises:
    ListError: ``what`` is neither a kind nor a registered name.
  """
  if what in ('', 'all'):
    return '\n'.join(render(kind) for kind in KINDS)
  if what == 'configs':
    return list_configs()
  if what == 'algorithms':
    return list_algorithms()
  if what in ('datasets', 'models'):
    return list_builders(what)
  registry = _registry()
  parts = []
  if what in registry.ALGORITHMS:
    parts.append(describe_algorithm(what))
  for kind in ('datasets', 'models'):
    if what in _builders(kind):
      parts.append(describe_builder(kind, what))
  if parts:
    return '\n'.join(parts)
  names = [*registry.ALGORITHMS, *registry.DATASETS, *registry.MODELS]
  raise ListError(f'--list={what!r} is not listable.'
                  f'{config_schema.suggest(what, [*KINDS, *names])} Give '
                  f'{USAGE}.')
