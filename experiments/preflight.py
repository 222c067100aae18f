"""What ``fedjx-run`` can tell before JAX is imported.

The command line checks a config's fields
(:func:`fedjx.experiments.config.with_defaults`) before it imports anything
heavy. This module goes further with what can be read without importing the
registries, the data or JAX, so that these mistakes are one line at once:

* :func:`check_config`: the algorithm, dataset and model a config names,
  against the names of :mod:`fedjx.experiments.registry` (read from the
  source of ``registry.py`` and ``data.py`` with :mod:`ast`, or from the
  registries themselves where a config file imported them to register its
  own); and a cohort larger than the training population of a dataset
  builder that declares it (:func:`fedjx.experiments.data.population`);
* :func:`check_workdir`: a workdir that another live run holds, or whose
  newest checkpoint is of a different experiment (the fields that differ),
  read from the checkpoint's JSON metadata; or one that holds the finished
  run already (:class:`Finished`: nothing to train).

Each check is conservative: where the source or the workdir cannot be read
as expected, it says nothing and the run's own checks decide, after JAX.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from fedjx.experiments import checkpoint_manifests
from fedjx.experiments import config as config_schema
from fedjx.experiments import errors
from fedjx.experiments import workdir_lock

_HERE = os.path.dirname(os.path.abspath(__file__))
# Where each kind's registered names are written: (file, the dict's name),
# and the registry's table of them (registry.DATASETS is data.BUILDERS).
SOURCES = {'algorithm': ('registry.py', 'ALGORITHMS'),
           'dataset': ('data.py', 'BUILDERS'),
           'model': ('registry.py', 'MODELS')}
_TABLES = {'algorithm': 'ALGORITHMS', 'dataset': 'DATASETS', 'model': 'MODELS'}


def _parse(filename: str) -> ast.Module | None:
  try:
    with open(os.path.join(_HERE, filename), encoding='utf-8') as f:
      return ast.parse(f.read())
  except (OSError, SyntaxError, ValueError):
    return None


def _dict_literal(tree: ast.Module, name: str) -> ast.Dict | None:
  """The dict literal assigned to module-level ``name`` in ``tree``."""
  for node in tree.body:
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, ast.AnnAssign) else [])
    if any(isinstance(t, ast.Name) and t.id == name for t in targets) and (
        isinstance(node.value, ast.Dict)):
      return node.value
  return None


def _string_keys(literal: ast.Dict) -> list[str] | None:
  keys = []
  for key in literal.keys:
    if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
      return None  # A computed key (or **other): not read here.
    keys.append(key.value)
  return keys


def registered_names(kind: str) -> list[str] | None:
  """The names ``kind`` (``'algorithm'``, ``'dataset'``, ``'model'``) may take:
  the registry's own table where it is imported already (a config file
  that registers its own), else the keys of the table's dict literal in
  its source file; None where that source cannot be read so."""
  registry = sys.modules.get('fedjx.experiments.registry')
  if registry is not None:
    return sorted(getattr(registry, _TABLES[kind]))
  return source_names(kind)


def source_names(kind: str) -> list[str] | None:
  """The keys of ``kind``'s table as written in its source file (:data:`SOURCES`)."""
  filename, name = SOURCES[kind]
  tree = _parse(filename)
  literal = None if tree is None else _dict_literal(tree, name)
  keys = None if literal is None else _string_keys(literal)
  return None if keys is None else sorted(keys)


def declared_population(name: str, options: Mapping[str, Any]) -> int | None:
  """The most clients the training population of dataset ``name`` with
  ``options`` can have, where its builder declares it
  (``@population('OPTION')`` in ``data.py``, read with :mod:`ast`): the
  option's value, or its default; None where nothing is declared."""
  if 'fedjx.experiments.registry' in sys.modules:
    registry = sys.modules['fedjx.experiments.registry']
    builder = registry.DATASETS.get(name)
    option = getattr(builder, 'population', None)
    if option is None:
      return None
    if option in options:
      return _count(options[option])
    default = inspect.signature(builder).parameters.get(option)
    return None if default is None else _count(default.default)
  return source_population(name, options)


def source_population(name: str, options: Mapping[str, Any]) -> int | None:
  """:func:`declared_population` as written in ``data.py``'s source."""
  tree = _parse(SOURCES['dataset'][0])
  literal = None if tree is None else _dict_literal(tree, SOURCES['dataset'][1])
  if literal is None:
    return None
  function = None
  for key, value in zip(literal.keys, literal.values):
    if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Name):
      function = value.id
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name == function:
      option = _declared_option(node)
      if option is None:
        return None
      if option in options:
        return _count(options[option])
      return _count(_default(node, option))
  return None


def _declared_option(node: ast.FunctionDef) -> str | None:
  for decorator in node.decorator_list:
    if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)
        and decorator.func.id == 'population' and len(decorator.args) == 1
        and isinstance(decorator.args[0], ast.Constant)):
      return decorator.args[0].value
  return None


def _default(node: ast.FunctionDef, option: str) -> Any:
  args = node.args.posonlyargs + node.args.args
  defaults = dict(zip([a.arg for a in args[len(args) - len(node.args.defaults):]],
                      node.args.defaults))
  defaults.update({a.arg: d for a, d in zip(node.args.kwonlyargs,
                                            node.args.kw_defaults) if d is not None})
  try:
    return ast.literal_eval(defaults[option]) if option in defaults else None
  except ValueError:
    return None


def _count(value: Any) -> int | None:
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_config(config: Any) -> None:
  """Refuses, before JAX, an unknown algorithm, dataset or model name and a
  cohort larger than a declared training population (one line each, the
  same line the run's own checks give).

  ``config`` has its defaults filled
  (:func:`fedjx.experiments.config.with_defaults`).

  Raises:
    ConfigError: as above.
  """
  for kind in ('dataset', 'model', 'algorithm'):
    spec = config[kind]
    name = spec.get('name') if hasattr(spec, 'get') else None
    names = registered_names(kind)
    if names is None or not isinstance(name, str) or name in names:
      continue
    raise errors.ConfigError(f'unknown {kind} {name!r}.{errors.suggest(name, names)} '
                             f'Valid {kind} names: {names}.')
  dataset = dict(config.dataset)
  population = declared_population(dataset.pop('name', None), dataset)
  if population is not None and config.cohort_size > population:
    raise errors.ConfigError(
        f'config.cohort_size={config.cohort_size} is larger than the training '
        f'population of {population} clients; it must be at most {population}.')


@dataclasses.dataclass(frozen=True)
class Finished:
  """A workdir holding the finished run of this config.

  Attributes:
    step: the rounds its newest checkpoint holds (at least ``config.rounds``).
    row: the last metrics row (the one the run prints).
  """

  step: int
  row: dict[str, Any]


def _newest_step(checkpoints: str) -> int | None:
  try:
    names = os.listdir(checkpoints)
  except OSError:
    return None
  steps = [int(n) for n in names
           if n.isdigit() and os.path.isdir(os.path.join(checkpoints, n))]
  return max(steps) if steps else None


def saved_meta(workdir: str) -> tuple[int, dict[str, Any]] | None:
  """``(step, meta)`` of the newest checkpoint in ``workdir``: its JSON
  metadata (what :meth:`fedjx.experiments.checkpointing.Checkpointer.save`
  wrote, in Orbax's ``<step>/meta/metadata`` file), read with ``json``;
  None where there is none, or its files do not match their manifest or
  cannot be read (the run then decides, falling back to an older one)."""
  checkpoints = os.path.join(workdir, 'checkpoints')
  step = _newest_step(checkpoints)
  if step is None:
    return None
  try:
    if checkpoint_manifests.problem(
        checkpoints, os.path.join(workdir, 'checkpoint_manifests'), step):
      return None
    with open(os.path.join(checkpoints, str(step), 'meta', 'metadata'),
              encoding='utf-8') as f:
      meta = json.load(f)
  except (OSError, ValueError, TypeError):
    return None
  return (step, meta) if isinstance(meta, dict) else None


def _single_process(config: Any) -> bool:
  return (config.num_processes in (None, 1) and not config.coordinator_address
          and not os.environ.get('FEDJX_COORDINATOR')  # fedjx.distributed's
          and os.environ.get('FEDJX_NUM_PROCESSES', '1').strip() in ('', '0', '1'))


def check_workdir(config: Any, workdir: str) -> Finished | None:
  """Refuses, before JAX, a ``workdir`` another live run holds, or whose
  newest checkpoint is of a different experiment; says whether it holds
  the finished run of ``config`` (defaults filled).

  Finished means: one process; the newest checkpoint intact per its
  manifest, of this experiment, of at least ``config.rounds`` rounds; its
  metrics row there; and nothing left that the run would still do at its
  end (a plot it would draw, a privacy statement or audit, LoRA exports).

  Raises:
    WorkdirLocked: another live process holds the workdir.
    ConfigError: its newest checkpoint is of a different experiment.
  """
  workdir_lock.check_free(workdir)
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    return None
  with workdir_lock.hold(workdir):
    found = saved_meta(workdir)
    if found is None:
      return None
    step, meta = found
    saved = meta.get('config')
    if not isinstance(saved, Mapping):
      return None
    current = config_schema.fingerprint(config)
    placed = (saved.get('client_state') or {}).get('placement')
    if current.get('client_state', {}).get('placement') == 'auto' and placed:
      # The run saved 'auto' resolved for its algorithm (the runner does
      # so again and holds the two against each other).
      current = {**current, 'client_state': {**current['client_state'], 'placement': placed}}
    diff = config_schema.experiment_difference(saved, current)
    if diff == ['client_state.placement']:
      return None  # The run may keep it as the workdir's config.json says.
    config_schema.check_same_experiment(saved, current, os.path.abspath(workdir))
    if (step < config.rounds or not _single_process(config)
        or os.path.exists(os.path.join(workdir, 'privacy.json'))
        or dict(config.lora or {}).get('export')
        or (config.plot and not os.path.exists(
            os.path.join(workdir, 'learning_curve.png')))):
      return None
    row = _row(workdir, config.metrics_format, step)
    return None if row is None else Finished(step, row)


def _row(workdir: str, fmt: str, step: int) -> dict[str, Any] | None:
  """The metrics row of round ``step``, or None."""
  from fedjx.experiments import metrics_writers  # deferred: before JAX (quick start-up)
  try:
    rows = metrics_writers.read_metrics(metrics_writers.metrics_path(workdir, fmt))
  except (OSError, ValueError, KeyError):
    return None
  rows = [r for r in rows if r.get('round') == step]
  return rows[-1] if rows else None
