"""How rounds execute, given once: the options and their one set of checks.

Every option of how a round runs (not what it computes) is here:

* ``map_strategy``: how ``map_fn`` runs clients (``'auto'``, ``'vmap'``,
  ``'chunked'``, ``'sequential'``; :mod:`fedjx.mapping`);
* ``chunk_size``: clients per chunk of ``map_fn`` (``'chunked'``);
* ``execution``: one compiled program (``'jit'``), streamed (``'streaming'``)
  or chosen from the compiled round's memory plan (``'auto'``;
  :mod:`fedjx.execution`);
* ``streaming_chunk_size``: clients per streamed chunk;
* ``donate``: whether a compiled round consumes the state passed in.

:class:`MapOptions` holds the first two as one frozen value, checked when
it is made, and :class:`RoundOptions` holds them all. An option is checked
once, where it enters (the config, ``Algorithm.compile``, ``fedjx.program``,
an explicit ``map_fn`` argument), each naming its own argument in the
error; from there the checked :class:`MapOptions` is carried (by the
compiled algorithm, its program and the program's frame) and read, not
checked again. This module imports nothing, so the command line checks a
config without JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MAP_STRATEGIES = ('auto', 'vmap', 'chunked', 'sequential')
EXECUTIONS = ('auto', 'jit', 'streaming')


def _positive_int_or_none(value: Any) -> bool:
  return value is None or (isinstance(value, int) and not isinstance(value, bool)
                           and value >= 1)


def check_map_options(strategy: Any, chunk_size: Any, where: str = 'fedjx.program: '
                      ) -> tuple[str, int | None]:
  """``(strategy, chunk_size)``, or a one-line ``ValueError`` prefixed ``where``."""
  if strategy not in MAP_STRATEGIES:
    raise ValueError(f'{where}map_strategy={strategy!r} is not one of '
                     f'{MAP_STRATEGIES}.')
  if not _positive_int_or_none(chunk_size):
    raise ValueError(f'{where}chunk_size={chunk_size!r}; it must be a positive int '
                     'or None (the map strategy chooses).')
  return strategy, chunk_size


@dataclasses.dataclass(frozen=True)
class MapOptions:
  """How ``map_fn`` runs clients, checked when made (see :mod:`fedjx.mapping`).

  Attributes:
    strategy: one of :data:`MAP_STRATEGIES`.
    chunk_size: at most this many clients per chunk (``'chunked'``), or None
      for the strategy to choose.

  ``where`` (not a field) prefixes the error: the argument's name where the
  options entered, e.g. ``'config.'`` or ``'Algorithm.compile: '``.
  """

  strategy: str = 'auto'
  chunk_size: int | None = None
  where: dataclasses.InitVar[str] = 'MapOptions: '

  def __post_init__(self, where: str) -> None:
    check_map_options(self.strategy, self.chunk_size, where)

  @classmethod
  def of(cls, strategy: 'str | MapOptions', chunk_size: int | None = None,
         where: str = 'MapOptions: ') -> 'MapOptions':
    """``strategy`` itself when it is already a ``MapOptions`` (checked when
    it was made; then ``chunk_size`` must be None), else the checked options."""
    if isinstance(strategy, MapOptions):
      if chunk_size is not None:
        raise ValueError(f'{where}chunk_size={chunk_size!r} with map options '
                         f'{strategy}; give the chunk size in the MapOptions.')
      return strategy
    return cls(strategy, chunk_size, where)


def check_execution(execution: Any, streaming_chunk_size: Any = None,
                    where: str = 'fedjx.execution: ') -> tuple[str, int | None]:
  """``(execution, streaming_chunk_size)``, or a one-line ``ValueError``."""
  if execution not in EXECUTIONS:
    raise ValueError(f'{where}execution={execution!r} is not one of {EXECUTIONS}.')
  if not _positive_int_or_none(streaming_chunk_size):
    raise ValueError(f'{where}streaming_chunk_size={streaming_chunk_size!r}; it must '
                     'be a positive int or None (sized from the clients\' data).')
  return execution, streaming_chunk_size


def check_donate(donate: Any, where: str = 'Algorithm.compile: ') -> bool:
  if donate is not True and donate is not False:
    raise ValueError(f'{where}donate={donate!r}; it must be True or False.')
  return donate


@dataclasses.dataclass(frozen=True)
class RoundOptions:
  """How rounds execute (see the module docstring), checked when made.

  Attributes:
    map: how ``map_fn`` runs clients (:class:`MapOptions`, checked when it
      was made).
    execution, streaming_chunk_size, donate: as in the module docstring.

  ``RoundOptions.of(config)`` reads them from an experiment config, each
  error naming the config field; ``map_strategy`` and ``chunk_size`` read
  ``map``'s.
  """

  map: MapOptions = MapOptions()
  execution: str = 'auto'
  streaming_chunk_size: int | None = None
  donate: bool = True

  def __post_init__(self):
    if not isinstance(self.map, MapOptions):
      raise ValueError(f'RoundOptions: map={self.map!r}; it must be a '
                       'fedjx.options.MapOptions.')
    check_execution(self.execution, self.streaming_chunk_size, 'RoundOptions: ')
    check_donate(self.donate, 'RoundOptions: ')

  @property
  def map_strategy(self) -> str:
    return self.map.strategy

  @property
  def chunk_size(self) -> int | None:
    return self.map.chunk_size

  @classmethod
  def of(cls, config: Any, where: str = 'config.') -> 'RoundOptions':
    """The options of an experiment config (``config.map_strategy``, ...),
    each error naming the config field."""
    get = lambda name, default=None: getattr(config, name, default)
    map_options = MapOptions(get('map_strategy', 'auto'), get('chunk_size'), where)
    check_execution(get('execution', 'auto'), get('streaming_chunk_size'), where)
    return cls(map_options, get('execution', 'auto'), get('streaming_chunk_size'))
