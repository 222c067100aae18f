"""The parts a config names inside an experiment, and their builders.

Every part of a config is ``{'name': ..., **options}``: the name picks a
builder of :mod:`fedjx.algorithms` from a table here, and the options are
that builder's keyword arguments::

  config.algorithm.aggregator = dict(name='krum', num_byzantine=2)
  config.attack = dict(name='alie', fraction=0.2, z=1.5)

The library's builders take the objects these build (an
:class:`~fedjx.algorithms.aggregators.Aggregator`, an
:class:`~fedjx.algorithms.attacks.Attack`), not names: the tables from
names to builders live here, in the layer that reads configs.

* :data:`AGGREGATORS` and :func:`build_aggregator`: the aggregators,
  defenses, compressors, secure sums and DP mechanisms a config names
  (``dp_defense``'s ``defense`` is itself a spec);

An unknown name, an option the builder does not take, or a value it
refuses is one :class:`~fedjx.experiments.config.ConfigError` naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from fedjx import algorithms
from fedjx.algorithms import aggregators
from fedjx.experiments import errors

ConfigError = errors.ConfigError

# The aggregators a config can name: ``aggregator=dict(name='gaussian', ...)``.
AGGREGATORS: dict[str, Callable[..., aggregators.Aggregator]] = {
    'mean': aggregators.mean,
    'quantized_mean': aggregators.quantized_mean,
    'gaussian': aggregators.gaussian,
    'adaptive_gaussian': algorithms.adaptive_gaussian,
    'tree_gaussian': algorithms.tree_gaussian,
    # Compressors (their bits counted), secure sums and distributed DP.
    **{name: getattr(algorithms.compression, name) for name in (
        'stochastic_quantization', 'eden', 'drive', 'qsgd', 'terngrad',
        'sign_majority', 'top_k', 'random_k', 'uncompressed')},
    'secure_sum': algorithms.secure_sum,
    'distributed_skellam': algorithms.distributed_skellam,
    'local_gaussian': algorithms.local_gaussian,
    # Defenses against Byzantine clients (``median`` is ``coordinate_median``).
    'median': algorithms.coordinate_median,
    **{name: getattr(algorithms.robust_aggregators, name) for name in (
        'trimmed_mean', 'krum', 'multi_krum', 'bulyan', 'geometric_median',
        'norm_bounding', 'centered_clipping', 'dp_defense')},
}
# Options of an aggregator that are aggregators themselves (specs in a config).
NESTED_AGGREGATORS = {'dp_defense': ('defense',)}

def options_of(builder: Callable[..., Any]) -> tuple[str, ...]:
  """The keyword options ``builder`` takes."""
  return tuple(p.name for p in inspect.signature(builder).parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def split(where: str, spec: Any, table: Mapping[str, Any]
          ) -> tuple[str, dict[str, Any]]:
  """``(name, options)`` of ``spec``, a ``{'name': <a key of table>, ...}``."""
  if hasattr(spec, 'to_dict'):
    spec = spec.to_dict()
  if not isinstance(spec, Mapping) or 'name' not in spec:
    raise ConfigError(f'config.{where}={spec!r} must be a dict with a "name" '
                      f'(one of {sorted(table)}) and its options.')
  options = dict(spec)
  name = options.pop('name')
  if name not in table:
    raise ConfigError(f'config.{where}.name={name!r} is not one of '
                      f'{sorted(table)}.{errors.suggest(name, table)}')
  return name, options


def check_options(where: str, name: str, builder: Callable[..., Any],
                  options: Mapping[str, Any]) -> None:
  """A ConfigError for an option ``builder`` does not take."""
  valid = options_of(builder)
  for key, value in options.items():
    if key not in valid:
      raise ConfigError(
          f'config.{where}.{key}={value!r} is not an option of {name!r}.'
          f'{errors.suggest(key, valid)} It takes {sorted(valid)}.')


def build_aggregator(spec: Any, where: str = 'algorithm.aggregator'
                     ) -> aggregators.Aggregator:
  """The :class:`~fedjx.algorithms.aggregators.Aggregator` a spec names.

  ``spec`` is ``{'name': <a key of AGGREGATORS>, **options}``, or already
  an Aggregator (returned as it is). The options of
  :data:`NESTED_AGGREGATORS` are specs too. ``where`` is the spec's place in
  the config, for the errors.
  """
  if isinstance(spec, aggregators.Aggregator):
    return spec
  name, options = split(where, spec, AGGREGATORS)
  builder = AGGREGATORS[name]
  check_options(where, name, builder, options)
  for key in NESTED_AGGREGATORS.get(name, ()):
    if key in options:
      options[key] = build_aggregator(options[key], f'{where}.{key}')
  try:
    return builder(**options)
  except (TypeError, ValueError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f'config.{where}={spec!r}: {e}') from None

