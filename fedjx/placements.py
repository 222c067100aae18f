"""Placement contexts: which placements (e.g. ``clients``) a program declares.

A fedjx program is an ordinary JAX function evaluated inside a *placement
context*. The context says, for each placement name, how many members it has
(its cardinality), so that ``broadcast`` knows how large a placed value is and
the reductions can check the values they reduce.

The context is a stack held in a :class:`contextvars.ContextVar`: it is entered
when a function decorated with :func:`program` is called and left when it
returns, so it is local to the thread (and asyncio task) that runs the program
and nothing is patched or shared between programs.

Nesting declares a hierarchy. ``program(placements={'silos': 2, 'clients': 4})``
(or a ``clients`` program called inside a ``silos`` program) describes
hierarchical federated learning: values placed at ``silos`` have a leading axis
of 2; inside ``map_fn`` over silos, each silo broadcasts to and reduces over its
own 4 clients. Declaring the same placement name twice is an error.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

MAP_STRATEGIES = ('auto', 'vmap', 'chunked', 'sequential')


@dataclasses.dataclass
class Placement:
  """One declared placement.

  Attributes:
    name: the placement's name, e.g. ``'clients'``. A mesh axis of the same
      name, when one is active, is where placed values are sharded.
    size: the cardinality, or ``None`` until it is inferred from the leading
      axis of the first placed value the program sees.
  """

  name: str
  size: int | None


@dataclasses.dataclass(frozen=True)
class MapOptions:
  """How ``map_fn`` executes inside a program (see :mod:`fedjx.mapping`)."""

  strategy: str = 'auto'
  chunk_size: int | None = None


@dataclasses.dataclass(frozen=True)
class _Frame:
  """One program call's placements and options.

  ``broadcasts`` maps ``id(out)`` to ``(out, x, placement)`` for each leaf
  ``out = broadcast(x)`` made during the call, so ``map_fn`` can hand the
  mapped function ``x`` itself instead of ``n`` copies of it. ``recorder`` is
  the call's :class:`fedjx.fusion.Recorder` when its maps may be fused with
  their reductions (``program(fuse=True)``), else None.
  """

  placements: tuple[Placement, ...]
  map_options: MapOptions
  mesh: Any
  recorder: Any = None
  broadcasts: dict[int, tuple[Any, Any, str]] = dataclasses.field(
      default_factory=dict, compare=False)


_STACK: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    'fedjx_placement_stack', default=())


def _check_size(name: str, size: Any) -> int | None:
  if size is None:
    return None
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise ValueError(
        f'fedjx.program: placement {name!r} has size {size!r}; a size must be '
        'a positive int (or None to infer it from the first placed input).')
  return size


def _check_map_options(strategy: str, chunk_size: int | None) -> MapOptions:
  if strategy not in MAP_STRATEGIES:
    raise ValueError(
        f'fedjx.program: map_strategy={strategy!r} is not one of '
        f'{MAP_STRATEGIES}.')
  if chunk_size is not None and (isinstance(chunk_size, bool) or
                                 not isinstance(chunk_size, int) or
                                 chunk_size < 1):
    raise ValueError(
        f'fedjx.program: chunk_size={chunk_size!r}; it must be a positive int '
        'or None.')
  return MapOptions(strategy, chunk_size)


@contextlib.contextmanager
def placement_context(placements: Mapping[str, int | None],
                      map_strategy: str = 'auto',
                      chunk_size: int | None = None,
                      mesh: Any = None, fuse: bool = False) -> Iterator[None]:
  """Enters a placement context (what :func:`program` does around a call)."""
  if not placements:
    raise ValueError('fedjx.program: declare at least one placement, e.g. '
                     "program(clients=8) or program(placements={'clients': 8}).")
  declared = {p.name for f in _STACK.get() for p in f.placements}
  frame_placements = []
  for name, size in placements.items():
    if not isinstance(name, str) or not name:
      raise ValueError(f'fedjx.program: placement name {name!r} must be a '
                       'non-empty string.')
    if name in declared:
      raise ValueError(
          f'fedjx.program: placement {name!r} is already declared by an '
          'enclosing program; nested programs must use new placement names.')
    frame_placements.append(Placement(name, _check_size(name, size)))
  recorder = None
  if fuse:
    from fedjx import fusion  # pylint: disable=g-import-not-at-top
    recorder = fusion.Recorder()
  frame = _Frame(tuple(frame_placements),
                 _check_map_options(map_strategy, chunk_size), mesh, recorder)
  token = _STACK.set(_STACK.get() + (frame,))
  try:
    yield
  finally:
    _STACK.reset(token)


def program(fn: Callable[..., Any] | None = None,
            *,
            clients: int | None = None,
            placements: Mapping[str, int | None] | None = None,
            map_strategy: str = 'auto',
            chunk_size: int | None = None,
            mesh: Any = None,
            fuse: bool = True,
            **unused_drjax_kwargs: Any) -> Any:
  """Declares the placements of a federated program.

  Usable as ``@program(clients=8)``, as DrJAX's
  ``@program(placements={'clients': 8})``, or as ``program(f, clients=8)``.
  The decorated function may be jitted on either side of the decorator.

  Args:
    fn: the function to decorate.
    clients: cardinality of the ``clients`` placement (shorthand for
      ``placements={'clients': clients}``).
    placements: placement names to cardinalities, outermost first. A
      cardinality of ``None`` is inferred from the first placed input.
    map_strategy: how ``map_fn`` runs clients: ``'auto'``, ``'vmap'``,
      ``'chunked'`` or ``'sequential'`` (see :func:`fedjx.map_fn`).
    chunk_size: clients per chunk for the ``'chunked'`` strategy.
    mesh: a ``jax.sharding.Mesh`` to place values on, for all calls in the
      program; by default the mesh set with ``jax.set_mesh``, if any.
    fuse: carry the reductions of ``map_fn`` outputs through the loop over
      chunks of clients instead of stacking the outputs (see
      :mod:`fedjx.fusion`): memory set by the chunk, not the cohort. The
      numbers are the same up to float summation order.

  Returns:
    The decorated function, or a decorator when ``fn`` is omitted.
  """
  unknown = set(unused_drjax_kwargs) - {'self_module'}
  if unknown:
    raise TypeError(f'fedjx.program: unexpected keyword arguments {sorted(unknown)}.')
  if not isinstance(fuse, bool):
    raise ValueError(f'fedjx.program: fuse={fuse!r}; it must be True or False.')
  if clients is not None and placements is not None:
    raise ValueError('fedjx.program: pass either clients= or placements=, not both.')
  if placements is None:
    placements = {'clients': clients}
  placements = dict(placements)
  _check_map_options(map_strategy, chunk_size)
  for name, size in placements.items():
    _check_size(name, size)

  def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapped(*args, **kwargs):
      with placement_context(placements, map_strategy, chunk_size, mesh, fuse):
        from fedjx import fusion  # pylint: disable=g-import-not-at-top
        return fusion.call_program(f, args, kwargs)
    return wrapped

  return decorate if fn is None else decorate(fn)


# A JAX user context, not a ContextVar: its value is part of the key of JAX's
# tracing, lowering and compilation caches, so a function jitted by the user
# and traced under a forced strategy gets its own cache entry, and neither
# trace is reused for the other.
_FORCED_STRATEGY = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def force_map_strategy(strategy: str) -> Iterator[None]:
  """Runs every ``map_fn`` in the block with ``strategy``, whatever it asks for.

  Interpreters use this to trace a program with ``'sequential'``, whose traced
  form keeps the per-client computation as the body of a ``scan``. The
  strategy is part of what JAX keys its caches on, so jitted functions traced
  in the block are cached apart from (and do not evict) their ordinary traces.
  """
  _check_map_options(strategy, None)
  with _FORCED_STRATEGY(strategy):
    yield


def forced_map_strategy() -> str | None:
  return _FORCED_STRATEGY.value


# Also a JAX user context, for the same reason: traces with and without
# fusion are cached apart.
_FUSION = jax.make_user_context(default_value=True)


@contextlib.contextmanager
def without_fusion() -> Iterator[None]:
  """Runs the programs called in the block as written, as ``fuse=False`` does.

  For measuring what fusion saves (``scripts/benchmark.py``) and for
  comparing fused and unfused rounds of code that builds its own programs.
  """
  with _FUSION(False):
    yield


def fusion_enabled() -> bool:
  return bool(_FUSION.value)


def current_frames() -> tuple[_Frame, ...]:
  return _STACK.get()


def lookup(placement: str | None, caller: str) -> tuple[Placement, _Frame]:
  """Finds a declared placement (the innermost one when ``placement`` is None)."""
  frames = _STACK.get()
  if not frames:
    raise RuntimeError(
        f'fedjx.{caller} was called outside a placement context. Decorate the '
        'function that calls it with @fedjx.program(clients=n) (or '
        "placements={'clients': n}).")
  if placement is None:
    return frames[-1].placements[-1], frames[-1]
  for frame in reversed(frames):
    for p in frame.placements:
      if p.name == placement:
        return p, frame
  names = [p.name for f in frames for p in f.placements]
  raise ValueError(f'fedjx.{caller}: placement={placement!r} is not declared; '
                   f'declared placements are {names}.')


def resolve_size(p: Placement, leading: int | None, caller: str) -> int:
  """The placement's size, checked against (or inferred from) ``leading``."""
  if p.size is None:
    if leading is None:
      raise ValueError(
          f'fedjx.{caller}: the size of placement {p.name!r} is not known yet. '
          'Declare it (program(clients=n)) or pass a placed value to map_fn or '
          'a reduction before broadcasting.')
    p.size = leading
  elif leading is not None and leading != p.size:
    raise ValueError(
        f'fedjx.{caller}: a value placed at {p.name!r} must have leading '
        f'dimension {p.size} (the placement size), but it has leading '
        f'dimension {leading}. Pass one entry per member of {p.name!r}, or '
        'change the size given to fedjx.program.')
  return p.size
