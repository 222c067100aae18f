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
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fedjx import frames
from fedjx import fusion
from fedjx.frames import Placement, current_frames
from fedjx.options import MapOptions

__all__ = ['placement_context', 'program']


@contextlib.contextmanager
def placement_context(placements: Mapping[str, int | None],
                      map_options: MapOptions = MapOptions(),
                      mesh: Any = None, fuse: bool = False) -> Iterator[None]:
  """Enters a placement context (what :func:`program` does around a call).

  ``map_options`` is a checked :class:`fedjx.options.MapOptions`, carried
  into the frame as it is.
  """
  if not placements:
    raise ValueError('fedjx.program: declare at least one placement, e.g. '
                     "program(clients=8) or program(placements={'clients': 8}).")
  declared = {p.name for f in current_frames() for p in f.placements}
  frame_placements = []
  for name, size in placements.items():
    if not isinstance(name, str) or not name:
      raise ValueError(f'fedjx.program: placement name {name!r} must be a '
                       'non-empty string.')
    if name in declared:
      raise ValueError(
          f'fedjx.program: placement {name!r} is already declared by an '
          'enclosing program; nested programs must use new placement names.')
    frame_placements.append(Placement(name, frames.check_size(name, size)))
  recorder = fusion.Recorder() if fuse else None
  frame = frames.Frame(tuple(frame_placements), map_options, mesh, recorder)
  with frames.pushed(frame):
    yield


def program(fn: Callable[..., Any] | None = None,
            *,
            clients: int | None = None,
            placements: Mapping[str, int | None] | None = None,
            map_strategy: str | MapOptions = 'auto',
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
      ``'chunked'`` or ``'sequential'`` (see :func:`fedjx.map_fn`), or a
      :class:`fedjx.options.MapOptions` already checked (as
      ``Algorithm.compile`` passes it; then ``chunk_size`` is None).
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
  map_options = MapOptions.of(map_strategy, chunk_size, 'fedjx.program: ')
  for name, size in placements.items():
    frames.check_size(name, size)

  def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapped(*args, **kwargs):
      with placement_context(placements, map_options, mesh, fuse):
        return fusion.call_program(f, args, kwargs)
    return wrapped

  return decorate if fn is None else decorate(fn)
