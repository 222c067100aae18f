"""Command-line entry point: ``fedjx-run`` and ``python scripts/run.py``.

::

  fedjx-run --config configs/fedavg_digits.py --workdir runs/quickstart \
      --config.rounds=100 --config.algorithm.client_optimizer.learning_rate=0.05

``--config`` is an ``ml_collections`` config file (``get_config()``); every
field can be overridden with ``--config.<path>=<value>``, and so can every
option of the selected algorithm's builder and of a selected optax optimizer
even when the file does not set it (``--config.algorithm.client_evaluation=False``,
``--config.algorithm.server_optimizer.b1=0.8``): see :func:`split_overrides`.

Every error a user can cause is one line on stderr and exit status 2: an
unknown field (with "did you mean"), a bad value, a missing file, a busy
workdir, one that is a file or cannot be read or written
(:mod:`fedjx.experiments.workdir`), an unknown name, a cohort larger than a
declared population, a workdir of another experiment
(:mod:`fedjx.experiments.preflight`), all checked before JAX is imported; a
full disk (naming the file that could not be written), a non-finite run. A
workdir holding the finished run says so at once.
``--debug`` (or ``FEDJX_DEBUG=1``) shows the full traceback instead. Running
again with the same ``--workdir`` resumes from its newest intact checkpoint;
``--fresh`` starts over instead, removing what the earlier run wrote there
(named, and confirmed on a terminal or with ``--yes``). SIGINT (Ctrl-C) or
SIGTERM saves a checkpoint after the current round and exits with status 130
or 143; during start-up it exits at once with one line.

``--list`` prints what there is to run, read from the code
(:mod:`fedjx.experiments.listing`): the shipped configs, the registered
algorithms, datasets and models, or one's options (``--list=fedprox``).
"""

from __future__ import annotations

import ast
import errno
import importlib.util
import inspect
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from fedjx.experiments import errors
from fedjx.experiments import signatures
from fedjx.experiments import workdir as workdir_lib

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file (a Python file with get_config()).',
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Directory for checkpoints, metrics, event files and plots '
    '(default: runs/<config file name>).')
_DEBUG = flags.DEFINE_bool(
    'debug', False, 'Show full tracebacks instead of one-line errors (also '
    'FEDJX_DEBUG=1).')
_FRESH = flags.DEFINE_bool(
    'fresh', False, 'Start over: remove what an earlier run (or sweep) wrote in '
    '--workdir (named, and confirmed on a terminal) instead of resuming it.')
_YES = flags.DEFINE_bool(
    'yes', False, "Answer --fresh's question yes (needed where stdin is not a "
    'terminal).')

_OVERRIDE = re.compile(r'^--?config\.([A-Za-z0-9_.]+)(=|$)')
USAGE_STATUS = 2
INTERRUPTED_STATUS = 128 + signal.SIGINT  # 130; SIGTERM gives 143.
HELP_FLAGS = ('--help', '-help', '-h', '--helpshort', '-helpshort')

USAGE = """\
fedjx-run: trains the federated experiment of a config file.

usage: fedjx-run --config FILE[:ARG] [--workdir DIR] [--config.PATH=VALUE ...]
                 [--fresh [--yes]] [--debug]
       fedjx-run --list[=configs|algorithms|datasets|models|NAME]

  --config FILE[:ARG]   a Python file whose get_config([ARG]) returns an
                        ml_collections ConfigDict (see configs/)
  --workdir DIR         checkpoints, metrics, TensorBoard events and the plot
                        (default runs/<config file name>); the same DIR again
                        resumes the run
  --fresh               start over instead: removes what a run wrote in DIR
                        (it names the files and asks; --yes skips the
                        question, and is needed where stdin is no terminal)
  --list[=WHAT]         the shipped configs, the registered algorithms,
                        datasets and models; --list=NAME one's options
  --config.PATH=VALUE   overrides a config field, an option of the selected
                        algorithm's builder, or of its optax optimizers, e.g.
                        --config.rounds=100
                        --config.algorithm.client_optimizer.learning_rate=0.05
                        --config.algorithm.server_optimizer.b1=0.8
                        --config.algorithm.client_evaluation=False
  --debug               full tracebacks instead of one-line errors (or set
                        FEDJX_DEBUG=1)
  --helpfull            every flag, absl's logging flags included

example:
  fedjx-run --config configs/fedavg_digits.py --workdir runs/quickstart \\
      --config.rounds=100 --config.algorithm.client_optimizer.learning_rate=0.05

exit status: 0 done; 2 a usage or config error, a workdir in use or that
cannot be written (a file, no permission, a full disk), a non-finite run, or
--fresh not confirmed; 130/143 stopped by Ctrl-C/SIGTERM (a checkpoint was
saved if training had started: run the same command again to continue).

other commands (each has --help): fedjx-sweep (a grid of settings x seeds in
one program), fedjx-plan (memory, FLOPs and bytes on the wire before a run),
fedjx-deploy (the rounds on a local Flower federation), fedjx-plot (learning
curves of runs in one PNG).
"""


class UsageError(ValueError):
  """A command-line mistake: printed as one line, exit status 2."""


def debug_requested(argv: Sequence[str]) -> bool:
  """``--debug`` on the command line, or ``FEDJX_DEBUG`` set to a true value."""
  env = os.environ.get('FEDJX_DEBUG', '').strip().lower()
  return any(a in ('--debug', '-debug', '--debug=true', '--debug=1')
             for a in argv) or env not in ('', '0', 'false', 'no')


def _one_line(e: BaseException) -> str:
  return ' '.join(str(e).split()) or type(e).__name__


def _where_raised(error: BaseException, path: str) -> str:
  """``' at FILE:LINE'`` of the deepest frame of ``error`` in ``path`` (or ``''``)."""
  target = os.path.realpath(path)
  if isinstance(error, SyntaxError) and error.filename and os.path.realpath(
      error.filename) == target:
    return f' at {path}:{error.lineno}'
  line = None
  tb = error.__traceback__
  while tb is not None:
    if os.path.realpath(tb.tb_frame.f_code.co_filename) == target:
      line = tb.tb_lineno
    tb = tb.tb_next
  return f' at {path}:{line}' if line is not None else ''


def _raised(spec: str, path: str, what: str, error: BaseException) -> UsageError:
  """One line: what in config file ``path`` raised ``error``, and where."""
  return UsageError(f'--config={spec!r}: {what} raised {type(error).__name__}'
                    f'{_where_raised(error, path)}: {_one_line(error)}')


def resolve_config(spec: str) -> str:
  """``path[:arg]`` with ``path`` found relative to the current folder first,
  then to the shipped ``configs/`` folder
  (:func:`fedjx.experiments.listing.find_config`).

  Raises:
    UsageError: neither holds the file (one line, with the closest shipped
      config's name).
  """
  from fedjx.experiments import listing  # deferred: before JAX (quick start-up)
  path, colon, arg = spec.partition(':')
  found = listing.find_config(path)
  if found is not None:
    return found + colon + arg
  directory = listing.configs_dir()
  if directory is None or os.path.isabs(path):
    raise UsageError(f'--config={spec!r}: no such file {path!r}.')
  hint = errors.suggest(os.path.basename(path), listing.config_names())
  raise UsageError(
      f'--config={spec!r}: no such file {path!r} here or in {directory}.{hint} '
      'fedjx-run --list=configs lists the shipped configs.')


def load_module(spec: str, name: str = '_fedjx_config'):
  """The module of config file ``path[:arg]``, executed (one-line errors).

  ``path`` is found as :func:`resolve_config` finds it.

  Raises:
    UsageError: the file does not exist, or executing it raised (the line
      names the exception, the file and the line).
  """
  spec = resolve_config(spec)
  path = spec.partition(':')[0]
  if not os.path.isfile(path):
    raise UsageError(f'--config={spec!r}: {path!r} is not a file.')
  module_spec = importlib.util.spec_from_file_location(name, path)
  if module_spec is None:
    raise UsageError(f'--config={spec!r}: {path!r} is not a Python file.')
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except
    raise _raised(spec, path, 'loading the file', e) from e
  return module


def call_in_config_file(spec: str, module: Any, fn_name: str, *args: Any) -> Any:
  """``module.<fn_name>(*args)``; an exception becomes one line naming the file."""
  path = spec.partition(':')[0]
  shown = ', '.join(repr(a) for a in args)
  try:
    return getattr(module, fn_name)(*args)
  except Exception as e:  # pylint: disable=broad-except
    raise _raised(spec, path, f'{fn_name}({shown})', e) from e


def load_config_file(spec: str):
  """The config of ``path[:arg]``: ``get_config(arg)`` (or ``get_config()``) of the file.

  Raises:
    UsageError: (one line naming the file) the file is missing, raises
      (with the line), defines no ``get_config``, or its ``get_config``
      returns something other than an ``ml_collections.ConfigDict``.
  """
  path, _, arg = spec.partition(':')
  module = load_module(spec)
  if not callable(getattr(module, 'get_config', None)):
    raise UsageError(f'--config={spec!r}: {path} defines no get_config().')
  config = call_in_config_file(spec, module, 'get_config', *([arg] if arg else []))
  if not isinstance(config, ml_collections.ConfigDict):
    got = 'None' if config is None else f'a {type(config).__name__}'
    raise UsageError(
        f'--config={spec!r}: get_config() in {path} returned {got}; it must '
        'return an ml_collections.ConfigDict (e.g. ml_collections.ConfigDict('
        '{...}), or fedjx.experiments.config_base.base_config()).')
  return config


# --------------------------------------------------- builder-option overrides

def parse_value(text: str, param: inspect.Parameter, where: str) -> Any:
  """``text`` as the type of ``param`` (:func:`signatures.parse_type`: its
  annotation, else its default's type).

  Booleans accept true/false/1/0/yes/no; ``None`` is accepted when the
  parameter takes None; an option of unknown type is read as a Python
  literal, or else as a string.
  """
  kind = signatures.parse_type(param)
  types = signatures.option_types(param)
  if text == 'None' and (types is None or type(None) in types):
    return None
  if kind is bool:
    low = text.strip().lower()
    if low in ('true', '1', 'yes'):
      return True
    if low in ('false', '0', 'no'):
      return False
    raise UsageError(f'{where}={text!r}: not a bool; use True or False.')
  if kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      raise UsageError(f'{where}={text!r}: not {"an int" if kind is int else "a number"}.'
                       ) from None
  if kind is str:
    return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _config_spec(argv: Sequence[str]) -> str | None:
  spec = None
  for i, arg in enumerate(argv):
    if arg.startswith(('--config=', '-config=')):
      spec = arg.split('=', 1)[1]
    elif arg in ('--config', '-config') and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def with_config_resolved(argv: Sequence[str]) -> list[str]:
  """``argv`` with the value of ``--config`` as :func:`resolve_config` finds it."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith(('--config=', '-config=')):
      flag, value = arg.split('=', 1)
      out[i] = f'{flag}={resolve_config(value)}'
    elif arg in ('--config', '-config') and i + 1 < len(out):
      out[i + 1] = resolve_config(out[i + 1])
  return out


def _has_path(config: Any, parts: Sequence[str]) -> bool:
  node = config
  for part in parts:
    if not (hasattr(node, 'keys') and part in node.keys()):
      return False
    node = node[part]
  return True


def _get(config: Any, parts: Sequence[str]) -> Any:
  node = config
  for part in parts:
    node = node[part]
  return node


def _unknown_field(arg: str, config: Any, parts: Sequence[str],
                   extra: Sequence[str] = ()) -> UsageError:
  from fedjx.experiments import config as config_schema  # deferred: before JAX (quick start-up)
  node, walked = config, 'config'
  for part in parts:
    keys = list(node.keys()) if hasattr(node, 'keys') else []
    if part not in keys:
      valid = sorted(set(keys) | set(extra))
      return UsageError(
          f'unknown config field {walked}.{part} (in {arg}).'
          f'{config_schema.suggest(part, valid)} Valid fields of {walked}: '
          f'{valid}.')
    node, walked = node[part], f'{walked}.{part}'
  return UsageError(f'unknown config field {walked} (in {arg}).')


def _value(arg: str) -> str:
  return arg.split('=', 1)[1]


def _field_type(config: Any, parts: Sequence[str]) -> type:
  """The type ``ml_collections`` holds for field ``parts`` (NoneType for None)."""
  parent = _get(config, parts[:-1])
  try:
    return parent.get_type(parts[-1])
  except (AttributeError, KeyError):
    return type(parent[parts[-1]])


def _none_ancestor(config: Any, parts: Sequence[str]) -> int | None:
  """The length of the prefix of ``parts`` naming a field that holds None, if any."""
  node = config
  for i, part in enumerate(parts):
    if not (hasattr(node, 'keys') and part in node.keys()):
      return None
    node = node[part]
    if node is None:
      return i + 1
  return None


def _typed(kind: type | None) -> inspect.Parameter:
  """A parameter of type ``kind`` (or None) for :func:`parse_value`."""
  annotation = (inspect.Parameter.empty if kind is None
                else f'{kind.__name__} | None')
  return inspect.Parameter('value', inspect.Parameter.KEYWORD_ONLY, default=None,
                           annotation=annotation)


def _spec_text(name: Any, options: Mapping[str, Any]) -> str:
  inner = ', '.join(f'{k}={v!r}' for k, v in options.items())
  return f'{name}({inner})'


def split_overrides(argv: Sequence[str], notes: list[str] | None = None
                    ) -> tuple[list[str], list[tuple[tuple[str, ...], Any]]]:
  """Separates the overrides that ``ml_collections`` cannot apply itself.

  ``--config.<path>=<value>`` naming an existing field is left for
  ``ml_collections`` to parse, unless that field holds None (it has no type
  to parse by). The others are accepted when they are

  * ``algorithm.<option>`` (``dataset.<option>``, ``model.<option>``): an
    option of the selected builder (after any ``--config.algorithm.name=``
    override), or
  * ``algorithm.<x>optimizer.<option>``: an option of the selected optax
    optimizer of that spec (``name`` included, which creates the spec when
    the file leaves the builder's default optimizer), or
  * ``attack.<option>``: an option of the named attack's builder
    (``--config.attack.z=1.5`` with ``config.attack.name='alie'``,
    :data:`fedjx.experiments.parts.ATTACKS`), or
  * a field holding None (or a field inside one), such as
    ``privacy.target_epsilon``.

  Their values are parsed as the builder parameter's type
  (:func:`parse_value`); a field holding None by its type in
  ``fedjx.experiments.config.OPTIONAL_TYPES``, else as a Python literal.
  Anything else is an unknown field, named with a "did you mean".

  Naming another optimizer than the file's
  (``--config.algorithm.server_optimizer.name=adam`` where the file has
  ``sgd``) replaces the spec: the new optimizer gets the options given on the
  command line and its own defaults for the rest; the file's options for the
  old one are dropped. An option the new optimizer requires (optax's
  ``learning_rate``) must then be given. A line saying what was applied is
  appended to ``notes``.

  Returns:
    ``(argv without those overrides, [(path parts, value), ...])``; a value
    that is a dict replaces the whole entry at its path.
  Raises:
    UsageError: an unknown field, a value of the wrong type, or a renamed
      optimizer missing a required option.
  """
  spec = _config_spec(argv)
  if spec is None:
    return list(argv), []
  overrides = _Overrides(load_config_file(spec), argv)
  overrides.check_named()
  if not overrides.pending:
    return list(argv), []
  overrides.check_fields()
  extras = overrides.resolve(notes)
  dropped = {arg for arg, _ in overrides.pending}
  return [a for a in argv if a not in dropped], extras


class _Overrides:
  """The ``--config.`` overrides of a command line, read against the config file.

  ``pending`` are those :func:`split_overrides` applies itself (the rest are
  left to ``ml_collections``); ``renamed`` the optimizer specs whose name
  changes, ``(\'algorithm\', slot) -> name``.
  """

  def __init__(self, config: Any, argv: Sequence[str]):
    self.config = config
    parsed = []  # (arg, parts, text or None)
    for arg in argv:
      match = _OVERRIDE.match(arg)
      if match:
        parsed.append((arg, tuple(match.group(1).split('.')),
                       _value(arg) if '=' in arg else None))
    self.renamed: dict[tuple[str, ...], str] = {}
    for arg, parts, text in parsed:
      if (len(parts) == 3 and parts[0] == 'algorithm' and parts[2] == 'name'
          and parts[1].endswith('optimizer') and text is not None
          and _has_path(config, parts)
          and text.strip('\'"') != _get(config, parts)):
        self.renamed[parts[:2]] = text.strip('\'"')
    self.named: dict[tuple[str, ...], str] = {}  # Existing fields, as text.
    self.pending: list[tuple[str, tuple[str, ...]]] = []
    for arg, parts, text in parsed:
      if parts[:2] in self.renamed:
        self.pending.append((arg, parts))
      elif _has_path(config, parts) and _field_type(config, parts) is not type(None):
        if text is not None:
          self.named[parts] = text
      else:
        self.pending.append((arg, parts))
    self.new_names = {p[:-1] + ('name',): _value(a).strip('\'"')
                      for a, p in self.pending
                      if len(p) == 3 and p[0] == 'algorithm' and p[2] == 'name'
                      and '=' in a}
    self.given: dict[tuple[str, ...], dict[str, Any]] = {}  # Optimizer options set.

  def check_named(self) -> None:
    """Refuses a value that ``ml_collections`` cannot parse as its field's
    type (its parsers: absl's), naming the field, the value and the type."""
    for parts, text in self.named.items():
      kind = _field_type(self.config, parts)
      parser = _PARSERS.get(kind)
      if parser is None:
        continue
      try:
        parser.parse(text)
      except ValueError:
        path = '.'.join(parts)
        raise UsageError(
            f'--config.{path}={text!r}: config.{path} takes '
            f'{_TYPE_WORDS[kind]} (the config has {_get(self.config, parts)!r}), '
            f'not {text!r}.') from None

  def check_fields(self) -> None:
    """Refuses unknown fields outside the builders, before the registries
    (and JAX) are imported."""
    for arg, parts in self.pending:
      if parts[0] not in _BUILDERS and (
          _none_ancestor(self.config, parts) is None or '=' not in arg):
        raise _unknown_field(arg, self.config, parts)

  def name_of(self, parts: tuple[str, ...]) -> Any:
    """The name the config (or an override of it) gives the spec at ``parts``."""
    key = parts + ('name',)
    if key in self.named:
      return self.named[key].strip('\'"')
    return _get(self.config, key) if _has_path(self.config, key) else None

  def resolve(self, notes: list[str] | None) -> list[tuple[tuple[str, ...], Any]]:
    """Every pending override as ``(parts, value)``, parsed by its type."""
    from fedjx.experiments import registry  # deferred: before JAX (usage errors, config checks)
    tables = {'algorithm': registry.ALGORITHMS, 'dataset': registry.DATASETS,
              'model': registry.MODELS}
    extras = []
    for arg, parts in self.pending:
      kind = parts[0]
      if kind == 'attack' and len(parts) == 2 and '=' in arg:
        extras.append(self._attack_option(arg, parts))
        continue
      builder = self.name_of((kind,)) if kind in tables else None
      is_option = (builder in tables.get(kind, {}) and '=' in arg and (
          len(parts) == 2 or (len(parts) == 3 and kind == 'algorithm')))
      if not is_option:
        extras.append(self._none_field(arg, parts))
      elif len(parts) == 2:
        extras.append(self._builder_option(arg, parts, builder, registry))
      else:
        extras += self._optimizer_option(arg, parts, builder, registry)
    return extras + self._replaced_specs(notes, registry)

  def _none_field(self, arg: str, parts: tuple[str, ...],
                  kind_of: type | None = None, typed: bool = True) -> Any:
    """A field inside one that holds None, parsed by its declared type."""
    if _none_ancestor(self.config, parts) is None or '=' not in arg:
      raise _unknown_field(arg, self.config, parts)
    if typed:
      from fedjx.experiments import config as config_schema  # deferred: before JAX (quick start-up)
      kind_of = config_schema.OPTIONAL_TYPES.get('.'.join(parts))
    return parts, parse_value(_value(arg), _typed(kind_of),
                              f'--config.{".".join(parts)}')

  def _builder_option(self, arg: str, parts: tuple[str, ...], builder: str,
                      registry: Any) -> Any:
    kind, option = parts
    options = registry.builder_options(builder, kind)
    if option not in options:
      raise UsageError(
          f'{kind} {builder!r} has no option {option!r} (in {arg}).'
          f'{registry._suggest(option, options)} Valid options: '  # pylint: disable=protected-access
          f'{sorted(options)}.')
    return parts, parse_value(_value(arg), options[option],
                              f'--config.{".".join(parts)}')

  def _attack_option(self, arg: str, parts: tuple[str, ...]) -> Any:
    """``--config.attack.<option>``: an option of the named attack's builder
    (:data:`fedjx.experiments.parts.ATTACKS`), parsed by its type."""
    from fedjx.experiments import parts as parts_lib  # deferred: before JAX (usage errors, config checks)
    option = parts[1]
    name = self.name_of(('attack',))
    table = parts_lib.ATTACKS
    if name not in table:
      raise UsageError(
          f'config.attack.name={name!r} is not one of {sorted(table)}, so '
          f'{arg} is an option of no attack.{errors.suggest(name, table)} '
          'Name the attack too, e.g. --config.attack.name=alie.')
    params = signatures.keyword_parameters(table[name])
    if option not in params:
      raise UsageError(
          f'attack {name!r} has no option {option!r} (in {arg}).'
          f'{errors.suggest(option, params)} Valid options: '
          f'{sorted(params)} (and fraction, seed).')
    return parts, parse_value(_value(arg), params[option],
                              f'--config.{".".join(parts)}')

  def _optimizer_option(self, arg: str, parts: tuple[str, ...], builder: str,
                        registry: Any) -> list[Any]:
    """``--config.algorithm.<slot>.<option>``: an option of its optax optimizer."""
    slot, option = parts[1], parts[2]
    where = f'--config.{".".join(parts)}'
    if not slot.endswith('optimizer') or slot not in registry.builder_options(
        builder, 'algorithm'):
      return [self._none_field(arg, parts, typed=False)]
    opt_name = self.renamed.get(parts[:2]) or self.new_names.get(
        ('algorithm', slot, 'name')) or self.name_of(('algorithm', slot))
    if opt_name is None:
      raise UsageError(
          f'{where}: config.algorithm.{slot} is not set in the config file; name '
          f'its optimizer too, e.g. --config.algorithm.{slot}.name=sgd '
          f'--config.algorithm.{slot}.learning_rate=1.0.')
    fn = registry.lookup(f'algorithm.{slot} (optax optimizer)',
                         registry.OPTIMIZERS, opt_name)
    kept = parts[:2] not in self.renamed  # Else the whole spec is replaced.
    if option == 'name':
      self.given.setdefault(parts[:2], {})
      return [(parts, opt_name)] if kept else []
    params = signatures.keyword_parameters(fn)
    if option not in params:
      raise UsageError(
          f'optax optimizer {opt_name!r} (config.algorithm.{slot}) has no option '
          f'{option!r} (in {arg}).{registry._suggest(option, params)} Valid '  # pylint: disable=protected-access
          f'options: {sorted(params)}.')
    value = parse_value(_value(arg), params[option], where)
    self.given.setdefault(parts[:2], {})[option] = value
    return [(parts, value)] if kept else []

  def _replaced_specs(self, notes: list[str] | None, registry: Any) -> list[Any]:
    """The renamed optimizer specs, with only their options from the command line."""
    extras = []
    for path, opt_name in self.renamed.items():
      fn = registry.OPTIMIZERS[opt_name]
      options = self.given.get(path, {})
      old = registry.split_name(f'config.{".".join(path)}', _get(self.config, path))
      missing = [name for name, p in signatures.keyword_parameters(fn).items()
                 if p.default is inspect.Parameter.empty and name not in options]
      flag = f'--config.{".".join(path)}'
      if missing:
        raise UsageError(
            f'{flag}.name={opt_name} replaces the file\'s '
            f'{_spec_text(*old)}, whose options are dropped; {opt_name} needs '
            + ', '.join(missing) + ': give ' +
            ' '.join(f'{flag}.{m}=VALUE' for m in missing) + '.')
      extras.append((path, {'name': opt_name, **options}))
      if notes is not None:
        notes.append(
            f'config.{".".join(path)} is {_spec_text(opt_name, options)} '
            f'({opt_name}\'s defaults for the rest); it replaces the file\'s '
            f'{_spec_text(*old)}, whose options were dropped.')
    return extras


_BUILDERS = ('algorithm', 'dataset', 'model', 'attack')
# The parsers ml_collections applies to fields of these types, and their words.
_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(),
            bool: flags.BooleanParser()}
_TYPE_WORDS = {int: 'an int', float: 'a number', bool: 'True or False'}


def apply_overrides(config: Any, extras: Sequence[tuple[tuple[str, ...], Any]]) -> Any:
  """Sets the overrides of :func:`split_overrides` on ``config``.

  A dict value replaces the entry at its path (a renamed optimizer's spec);
  these are set first, then optimizer names, then the other values.
  """
  order = lambda e: (not isinstance(e[1], Mapping), e[0][-1] != 'name', len(e[0]))
  with config.unlocked():
    for parts, value in sorted(extras, key=order):
      node = config
      for part in parts[:-1]:
        if part not in node or node[part] is None:
          node[part] = ml_collections.ConfigDict()
        node = node[part]
      if isinstance(value, Mapping):
        value = ml_collections.ConfigDict(dict(value))
      if parts[-1] in node and node.get_type(parts[-1]) is type(None):
        del node[parts[-1]]  # A None field has no type; give it the value's.
      node[parts[-1]] = value
  return config


# ------------------------------------------------------------------ main

def list_request(argv: Sequence[str]) -> str | None:
  """What ``--list`` asks for (``'all'`` for a bare ``--list``), or None."""
  for i, arg in enumerate(argv):
    if arg in ('--list', '-list'):
      following = argv[i + 1] if i + 1 < len(argv) else ''
      return following if following and not following.startswith('-') else 'all'
    if arg.startswith(('--list=', '-list=')):
      return arg.split('=', 1)[1] or 'all'
  return None


def _print_list(what: str, argv: Sequence[str], prog: str) -> None:
  """``--list``: prints what there is to run (:mod:`listing`) and exits."""
  from fedjx.experiments import listing  # deferred: before JAX (quick start-up)
  try:
    text = listing.render(what)
  except listing.ListError as e:
    if debug_requested(argv):
      raise
    print(f'{prog}: {_one_line(e)}', file=sys.stderr)
    sys.exit(USAGE_STATUS)
  print(text, end='')
  sys.exit(0)


def parse_flags(argv: Sequence[str], extras: list[Any], prog: str = 'fedjx-run',
                usage: str = USAGE) -> list[str]:
  """absl flag parsing; builder-option overrides are put in ``extras``."""
  if any(a in HELP_FLAGS for a in argv[1:]):
    print(usage, end='')
    sys.exit(0)
  what = list_request(argv[1:])
  if what is not None:
    _print_list(what, argv, prog)
  try:
    notes: list[str] = []
    argv = [argv[0]] + with_config_resolved(argv[1:])
    rest, found = split_overrides(argv[1:], notes)
    extras.extend(found)
    if os.environ.get('FEDJX_PROCESS_ID', '0') == '0':  # Once per run.
      for note in notes:
        print(f'{prog}: {note}', file=sys.stderr)
    # ml_collections reads the overrides from sys.argv itself.
    sys.argv = [argv[0]] + rest
    return flags.FLAGS(sys.argv)
  except Exception as e:  # pylint: disable=broad-except
    if debug_requested(argv):
      raise
    print(f'{prog}: {_one_line(e)}', file=sys.stderr)
    sys.exit(USAGE_STATUS)


def _loaded(*names: tuple[str, str]) -> tuple[type[BaseException], ...]:
  """The exception classes ``module.attr`` of the modules already imported
  (an exception of a module never imported cannot have been raised, so the
  command line need not import JAX to classify an error)."""
  out = []
  for module, attr in names:
    if module in sys.modules:
      out.append(getattr(sys.modules[module], attr))
  return tuple(out)


def _plain_modules() -> tuple[type[BaseException], ...]:
  return _loaded(('fedjx.experiments.run_trainer', 'NonFiniteError'),
                 ('fedjx.experiments.workdir_lock', 'WorkdirLocked'),
                 ('fedjx.experiments.workdir', 'WorkdirError'),
                 ('fedjx.experiments.checkpointing', 'CheckpointError'),
                 ('fedjx.experiments.config', 'ConfigError'),
                 ('fedjx.experiments.sweeps.spec', 'SweepError'),
                 ('fedjx.execution', 'OutOfMemory'))


def _user_errors() -> tuple[type[BaseException], ...]:
  return (UsageError, app.UsageError, ValueError, TypeError, OSError,
          KeyError) + _plain_modules()


def _plain_errors() -> tuple[type[BaseException], ...]:
  """Errors whose message is the whole story (printed without their type)."""
  return (UsageError, app.UsageError) + _plain_modules()


def _train(argv: Sequence[str], extras: Sequence[Any]) -> int:
  if len(argv) > 1:
    raise UsageError(f'unexpected arguments {argv[1:]}; settings go in '
                     '--config.<field>=<value> (see --help).')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  config = loaded_config(extras)
  workdir = _WORKDIR.value
  if workdir is None:
    name = os.path.splitext(os.path.basename(
        flags.FLAGS['config'].config_filename))[0]
    workdir = os.path.join('runs', name)
  prepare_workdir(workdir, config, workdir_lib.RUN_OUTPUTS)  # Before JAX too.
  # A workdir in use, of another experiment, or already finished: at once.
  from fedjx.experiments import config as config_schema  # deferred: before JAX (quick start-up)
  from fedjx.experiments import preflight  # deferred: before JAX (quick start-up)
  finished = preflight.check_workdir(config_schema.with_defaults(config), workdir)
  if finished is not None:
    print(f'fedjx-run: {os.path.abspath(workdir)} holds this run, finished '
          f'after round {finished.step}: nothing to train (raise --config.rounds '
          'to continue it, or start over with --fresh).', file=sys.stderr)
    _print_summary(finished.row, os.path.abspath(workdir))
    return 0
  return _run(config, workdir)


def _run(config: Any, workdir: str) -> int:
  """Trains ``config`` in ``workdir``, every check passed: the only part of
  ``fedjx-run`` that imports JAX (the runner splits the CPU before JAX's
  backends start)."""
  import jax  # deferred: before JAX (usage errors, config checks)
  from fedjx.experiments import runner  # deferred: before JAX (usage errors, config checks)
  quiet_orbax()
  result = runner.run(config, workdir)
  if result.interrupted:
    return 128 + (result.signal or signal.SIGINT)
  if jax.process_index() != 0:
    return 0
  _print_summary(result.history[-1] if result.history else {}, result.workdir)
  return 0


def _print_summary(row: Mapping[str, Any], workdir: str) -> None:
  """The last metrics row's evaluation, and where the results are."""
  shown = {k: v for k, v in row.items()
           if k.startswith('eval_') or k in ('round', 'elapsed_s')}
  print(' '.join(f'{k}={v:.4f}' if isinstance(v, float) else f'{k}={v}'
                 for k, v in shown.items()))
  print(f'fedjx-run: done; metrics, checkpoints and learning_curve.png in '
        f'{workdir}')


def loaded_config(extras: Sequence[Any]) -> Any:
  """``--config``'s config with the command line's overrides, its fields checked (no JAX)."""
  config = _CONFIG.value
  if config is None:
    raise UsageError('--config is required, e.g. --config '
                     'configs/fedavg_digits.py (see --help).')
  apply_overrides(config, extras)
  from fedjx.experiments import config as config_schema  # deferred: before JAX (quick start-up)
  from fedjx.experiments import preflight  # deferred: before JAX (quick start-up)
  # Before JAX: the fields' own checks, then the names and the population.
  preflight.check_config(config_schema.with_defaults(config))
  return config


def prepare_workdir(workdir: str, config: Any, outputs: Sequence[str],
                    prog: str = 'fedjx-run') -> None:
  """Before JAX: ``workdir`` is usable (one line if not), and with
  ``--fresh`` what an earlier run wrote there (``outputs``) is removed."""
  if _YES.value and not _FRESH.value:
    raise UsageError('--yes answers the question of --fresh; give --fresh too '
                     '(or leave --yes out to resume the run).')
  workdir_lib.check(workdir)
  if not _FRESH.value:
    return
  processes = config.get('num_processes') or os.environ.get('FEDJX_NUM_PROCESSES')
  if processes is not None and str(processes).strip() not in ('', '0', '1'):
    raise UsageError(
        f'--fresh starts over in a single-process run; this one has {processes} '
        f'processes: remove {", ".join(outputs)} from {workdir} yourself '
        'before starting them.')
  workdir_lib.start_over(workdir, outputs, prog, yes=_YES.value)


def quiet_orbax() -> None:
  """Hides the tracebacks Orbax logs for a failed save or restore (each is
  also reported in one line), unless ``--debug`` is given."""
  from fedjx.experiments import checkpointing  # deferred: before JAX (usage errors, config checks)
  checkpointing.quiet_orbax_errors(not (_DEBUG.value or debug_requested(())))


class _Signals:
  """SIGINT and SIGTERM end the program at once, with one line.

  Installed first thing in :func:`main`, before anything heavy is imported.
  The runner replaces these handlers while it trains (the round finishes and
  a checkpoint is saved); before that (imports, flag parsing, data loading,
  model initialization) and after it, the handler prints one line and exits
  with ``os._exit(128 + signal)``. It does not raise KeyboardInterrupt:
  Python drops an exception raised from a signal handler when it lands in a
  callback whose exceptions it ignores (importlib's module-lock callbacks,
  while JAX imports), and the run would go on as if no signal came. Nothing
  written before training starts needs an orderly exit: a kill at any point
  is covered by the run's crash guarantees. With ``--debug`` (or
  ``FEDJX_DEBUG``) the handler raises KeyboardInterrupt, for its traceback.
  """

  def __init__(self, prog: str = 'fedjx-run', debug: bool = False):
    self.prog = prog
    self.debug = debug
    self.signum = signal.SIGINT

  def handle(self, signum, frame):
    del frame
    self.signum = signum
    if self.debug:
      raise KeyboardInterrupt
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):
        pass
    name = signal.Signals(signum).name
    os.write(2, f'{self.prog}: stopped by {name}; the workdir keeps its last '
             'complete checkpoint, if any.\n'.encode())
    os._exit(128 + signum)  # pylint: disable=protected-access

  def install(self) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
      signal.signal(s, self.handle)


def _disk_full(error: BaseException) -> OSError | None:
  """The ``ENOSPC`` OSError among ``error``, its causes and contexts, if any
  (a result file that could not be written: the file is its ``filename``)."""
  seen: set[int] = set()
  found = None
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      if found is None or (found.filename is None and error.filename is not None):
        found = error
    error = error.__cause__ or error.__context__
  return found


def run_main(body: Callable[[Sequence[str], Sequence[Any]], int], argv: Sequence[str],
             extras: Sequence[Any], signals: _Signals, prog: str = 'fedjx-run') -> int:
  """Runs ``body(argv, extras)``; user errors and signals become one line and a status."""
  debug = _DEBUG.value or debug_requested(())
  try:
    return body(argv, extras)
  except KeyboardInterrupt:
    if debug:
      raise
    name = signal.Signals(signals.signum).name
    print(f'{prog}: stopped by {name}; the workdir keeps its last complete '
          'checkpoint, if any.', file=sys.stderr)
    return 128 + signals.signum
  except Exception as e:  # pylint: disable=broad-except
    if debug:
      raise
    full = None if isinstance(e, _plain_errors()) else _disk_full(e)
    if full is not None:
      where = full.filename or 'its results'
      print(f'{prog}: no space left on the device to write {where}; free space '
            '(or choose a --workdir on another disk) and run the same command '
            'again: it continues from the newest checkpoint.', file=sys.stderr)
      return USAGE_STATUS
    user = isinstance(e, _user_errors())
    plain = isinstance(e, _plain_errors())
    text = _one_line(e) if plain else f'{type(e).__name__}: {_one_line(e)}'
    hint = '' if plain else ' (--debug shows the traceback)'
    print(f'{prog}: {text}{hint}', file=sys.stderr)
    if type(e).__name__ == 'CheckpointWriteError':
      # The checkpointer's writer threads failed with the disk; as the
      # interpreter ends they may still print (an un-awaited write, a closed
      # event loop). The one line is out: what follows is their teardown.
      sys.stderr.flush()
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, 2)
      os.close(devnull)
    return USAGE_STATUS if user else 1


def main(prog: str = 'fedjx-run',
         body: Callable[[Sequence[str], Sequence[Any]], int] | None = None,
         usage: str = USAGE) -> None:
  """Console-script entry point (``prog``, ``body`` and ``usage`` serve ``fedjx-sweep`` too)."""
  signals = _Signals(prog, debug_requested(sys.argv))
  signals.install()  # First: a signal at any time is one line and 128 + N.
  body = body or _train
  extras: list[Any] = []
  try:
    app.run(lambda argv: run_main(body, argv, extras, signals, prog),
            flags_parser=lambda argv: parse_flags(argv, extras, prog, usage))
  except KeyboardInterrupt:  # During flag parsing (the config file's imports).
    if debug_requested(sys.argv):
      raise
    print(f'{prog}: stopped by {signal.Signals(signals.signum).name} during '
          'start-up.', file=sys.stderr)
    sys.exit(128 + signals.signum)


if __name__ == '__main__':
  main()
