"""The placement frames a running program pushes, and the switches tracing reads.

A program call pushes one :class:`Frame` (its placements, map options,
mesh and fusion recorder) onto a stack held in a
:class:`contextvars.ContextVar`, local to the thread and asyncio task that
runs it. The primitives, ``map_fn``, fusion and the interpreters read the
stack through :func:`current_frames`, :func:`lookup` and
:func:`resolve_size`; :func:`force_map_strategy` and :func:`without_fusion`
are JAX user contexts, part of the keys of JAX's caches. Entering a frame
is :func:`fedjx.program`'s (:mod:`fedjx.placements`); this module imports
no other fedjx module but :mod:`fedjx.options`, so every module that reads
a frame can import it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

from fedjx.options import MAP_STRATEGIES, MapOptions


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
class Frame:
  """One program call's placements and options.

  ``broadcasts`` maps ``id(out)`` to ``(out, x, placement)`` for each leaf
  ``out = broadcast(x)`` made during the call, so ``map_fn`` can hand the
  mapped function ``x`` itself instead of ``n`` copies of it. ``recorder`` is
  the call's ``fedjx.fusion.Recorder`` when its maps may be fused with
  their reductions (``program(fuse=True)``), else None.
  """

  placements: tuple[Placement, ...]
  map_options: MapOptions  # checked where the program was declared
  mesh: Any
  recorder: Any = None
  broadcasts: dict[int, tuple[Any, Any, str]] = dataclasses.field(
      default_factory=dict, compare=False)


_STACK: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar(
    'fedjx_placement_stack', default=())


def check_size(name: str, size: Any) -> int | None:
  if size is None:
    return None
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise ValueError(
        f'fedjx.program: placement {name!r} has size {size!r}; a size must be '
        'a positive int (or None to infer it from the first placed input).')
  return size


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
  MapOptions(strategy, None, 'fedjx.frames.force_map_strategy: ')
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


def current_frames() -> tuple[Frame, ...]:
  return _STACK.get()


def lookup(placement: str | None, caller: str) -> tuple[Placement, Frame]:
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


@contextlib.contextmanager
def pushed(frame: Frame) -> Iterator[None]:
  """Pushes ``frame`` for the duration of the block."""
  token = _STACK.set(_STACK.get() + (frame,))
  try:
    yield
  finally:
    _STACK.reset(token)


# The vmap axes of the members run together now (innermost last), set while
# map_fn traces its function inside a chunk: what ``mapping.any_in_chunk``
# reduces over.
_CHUNK_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    'fedjx_chunk_axes', default=())
# Those of them sharded over an Explicit mesh axis, where JAX cannot psum
# over them (any_in_chunk gathers instead).
_GATHER_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    'fedjx_gather_axes', default=())


@contextlib.contextmanager
def chunk_axis(name: str | None, explicit: bool = False) -> Iterator[None]:
  """Marks the block as tracing one chunk's members, vmapped on axis ``name``
  (None: one member at a time, no axis; ``''``: vmapped on no named axis,
  so members cannot agree on a predicate); ``explicit``: the axis is
  sharded over an Explicit mesh axis."""
  token = _CHUNK_AXES.set(_CHUNK_AXES.get() + (() if name is None else (name,)))
  gather = _GATHER_AXES.set(_GATHER_AXES.get() + ((name,) if explicit and name else ()))
  try:
    yield
  finally:
    _GATHER_AXES.reset(gather)
    _CHUNK_AXES.reset(token)


def chunk_axis_name(placement: str) -> str:
  """The vmap axis of the members of one chunk of ``placement``."""
  return f'fedjx_chunk_{placement}'


def chunk_axes() -> tuple[str, ...]:
  return _CHUNK_AXES.get()


def gather_axes() -> tuple[str, ...]:
  """The chunk axes sharded over an Explicit mesh axis."""
  return _GATHER_AXES.get()
