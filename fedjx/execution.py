"""How a round runs: one compiled program (``'jit'``) or streamed (``'streaming'``).

``'auto'`` compiles the round for the cohort's shapes and asks XLA for its
memory plan (arguments + outputs + temporaries). If the plan exceeds
``headroom`` (80%) of the device's memory, the round is streamed
(:mod:`fedjx.streaming`) in chunks of ``chunk_size`` clients instead, and
the choice is logged once per cohort shape. The device's memory is its
allocator's limit (``Device.memory_stats()['bytes_limit']``) on accelerators
and the machine's physical memory on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax

from fedjx import streaming

EXECUTIONS = ('auto', 'jit', 'streaming')
DEFAULT_STREAMING_CHUNK = 64
HEADROOM = 0.8


def device_memory_bytes(device: Any = None) -> int | None:
  """The memory one device can allocate, or None if it cannot be told."""
  device = device or jax.devices()[0]
  stats = None
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # Backends without stats.
    stats = None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  if device.platform == 'cpu' and hasattr(os, 'sysconf'):
    return int(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
  return None


def round_runner(algorithm: Any, execution: str, chunk_size: int | None = None,
                 log: Callable[[str], None] = print,
                 headroom: float = HEADROOM) -> Callable[[Any, Any, jax.Array], Any]:
  """``run(state, cohort, key) -> (state, metrics)`` for ``execution``.

  Args:
    algorithm: a :class:`fedjx.algorithms.Algorithm` (its ``round`` and
      ``apply``).
    execution: ``'jit'`` (``algorithm.round``), ``'streaming'``
      (:func:`fedjx.streaming.run` on the cohort in chunks of
      ``chunk_size``) or ``'auto'`` (streaming when the compiled round's
      memory plan does not fit the device with ``headroom``).
    chunk_size: clients per streamed chunk (default 64).
    log: where ``'auto'`` reports its choice.
    headroom: the fraction of the device's memory a compiled round may plan.
  """
  if execution not in EXECUTIONS:
    raise ValueError(f'fedjx.execution: execution={execution!r} is not one of '
                     f'{EXECUTIONS}.')
  chunk = chunk_size or DEFAULT_STREAMING_CHUNK

  streamer = streaming.Streamer(algorithm.apply, chunk)

  def stream(state, cohort, key):
    return streamer(state, streaming.Clients.from_arrays(cohort), key)

  if execution == 'jit':
    return algorithm.round
  if jax.process_count() > 1:
    if execution == 'streaming':
      raise ValueError("fedjx.execution: execution='streaming' runs on one "
                       f'process; this run has {jax.process_count()}. Use '
                       "execution='jit'.")
    return algorithm.round
  if execution == 'streaming':
    return stream
  if not hasattr(algorithm.round, 'lower'):
    return algorithm.round  # Not a jitted round: no memory plan to read.
  streams: dict[str, bool] = {}  # cohort shape -> whether to stream

  def auto(state, cohort, key):
    shape = str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), (state, cohort)))
    if shape not in streams:
      # Lowered and compiled through algorithm.round's own cache, which the
      # round then reuses when it runs compiled (and recompiles by itself if
      # a later state arrives with other shardings).
      analysis = algorithm.round.lower(state, cohort, key).compile().memory_analysis()
      planned = int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes +
                    analysis.temp_size_in_bytes)
      limit = device_memory_bytes()
      streams[shape] = limit is not None and planned > headroom * limit
      if streams[shape]:
        log(f'fedjx: execution=auto: the compiled round plans {planned / 2**30:.2f} '
            f"GiB, more than {headroom:.0%} of the device's {limit / 2**30:.2f} GiB; "
            f'streaming the cohort in chunks of {chunk} clients.')
    if streams[shape]:
      return stream(state, cohort, key)
    return algorithm.round(state, cohort, key)

  return auto
