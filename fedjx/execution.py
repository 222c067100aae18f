"""How a round runs: one compiled program (``'jit'``) or streamed (``'streaming'``).

``'auto'`` compiles the round for the cohort's shapes and asks XLA for its
memory plan (arguments + outputs - donated + temporaries). If the plan exceeds
``headroom`` (80%) of the device's memory and a chunk is smaller than the
cohort, the round is streamed
(:mod:`fedjx.streaming`) in chunks of ``chunk_size`` clients instead (by
default as many clients as hold 64 MiB of data, at least 64), and the
choice is logged once per cohort shape. A round that XLA refuses as larger
than the device raises :class:`OutOfMemory`, one line naming the settings to
change, before anything runs. The device's memory is its
allocator's limit (``Device.memory_stats()['bytes_limit']``) on accelerators
and the machine's physical memory on CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from fedjx import options
from fedjx import streaming
from fedjx.options import EXECUTIONS

DEFAULT_STREAMING_CHUNK = 64  # The fewest clients per streamed chunk by default.
# Without a chunk_size, a streamed chunk holds this much client data (at
# least DEFAULT_STREAMING_CHUNK clients, unless one client alone holds more:
# a DiLoCo replica with its optimizer state, streamed one at a time): two
# chunks are in memory at once (one computing, the next arriving), and each
# chunk costs a dispatch, a transfer and a wait, so small clients go in
# large chunks.
STREAMING_CHUNK_BYTES = 64 * 2**20
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


class OutOfMemory(ValueError):
  """A compiled program (a round, an evaluation) does not fit the device's memory."""


def is_out_of_memory(error: BaseException) -> bool:
  """Whether ``error`` is XLA's refusal of a program larger than the device's memory."""
  text = str(error)
  return 'RESOURCE_EXHAUSTED' in text or 'Ran out of memory' in text


def _xla_reason(error: BaseException) -> str:
  """The first line of XLA's message, without its status prefix."""
  line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return line.split('RESOURCE_EXHAUSTED: ', 1)[-1]


@contextlib.contextmanager
def naming_out_of_memory(what: str, settings: Callable[[], str]) -> Iterator[None]:
  """Inside: XLA's out-of-memory refusal becomes :class:`OutOfMemory`, one line
  ``'{what} ({XLA's reason}); {settings()}.'`` naming the program and what to change."""
  try:
    yield
  except OutOfMemory:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if not is_out_of_memory(e):
      raise
    raise OutOfMemory(f'{what} ({_xla_reason(e)}); {settings()}.') from None


def compile_to_fit(lowered: Any, what: str, settings: str) -> Any:
  """``lowered.compile()``; XLA's out-of-memory refusal becomes :class:`OutOfMemory`,
  one line naming ``what`` (the program) and ``settings`` (what to change)."""
  with naming_out_of_memory(f"{what} does not fit the device's memory", lambda: settings):
    return lowered.compile()


ROUND_SETTINGS = ("lower config.batch_size or config.cohort_size, rematerialize the model's "
                  "layers (config.model.remat='full'), or stream the cohort "
                  "(config.execution='streaming' with a smaller config.chunk_size)")
"""What to change when a round does not fit (in a config's terms)."""


def round_settings(state: Any) -> str:
  """:data:`ROUND_SETTINGS`, led by the per-client rows a server state keeps
  (``state.client_states``, e.g. DiLoCo's replicas' inner optimizer states:
  held on the device whole) when it keeps any."""
  rows = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(getattr(state, 'client_states', ())))
  if not rows:
    return ROUND_SETTINGS
  return (f'the state keeps {rows / 1e9:.2f} GB of per-client rows '
          "(state.client_states): keep them on the host "
          "(config.client_state.placement='store', streamed one replica at a time), "
          "lower config.cohort_size (fewer replicas per device) "
          "or give config.mesh a 'clients' axis over more devices; or "
          + ROUND_SETTINGS)


def streaming_chunk(client_bytes: int, num_clients: int) -> int:
  """Clients per streamed chunk when none is given: ``STREAMING_CHUNK_BYTES``
  of client data, at least ``DEFAULT_STREAMING_CHUNK`` clients, at most the
  cohort; one client at a time where one client's data exceeds
  ``STREAMING_CHUNK_BYTES``."""
  if client_bytes > STREAMING_CHUNK_BYTES:
    return 1
  by_bytes = STREAMING_CHUNK_BYTES // max(int(client_bytes), 1)
  return max(1, min(num_clients, max(DEFAULT_STREAMING_CHUNK, by_bytes)))


def _spec(x: Any) -> Any:
  """``x``'s shape, dtype and (for a JAX array) sharding, as lowering reads them."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  sharding = getattr(x, 'sharding', None) if isinstance(x, jax.Array) else None
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _shape_key(spec: Any) -> str:
  """The shapes and dtypes of a cohort's (or its specs') leaves, as a key."""
  return str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), spec))


class RoundRunner:
  """``run(state, cohort, key) -> (state, metrics)``, compiled or streamed.

  ``cohort`` is a placed :class:`fedjx.datasets.Cohort`, or a
  :class:`fedjx.streaming.Clients` that loads its clients when asked (e.g.
  from :func:`fedjx.datasets.prefetch.lazy_cohort_iterator`). A streamed
  round reads a ``Clients`` cohort ``chunk_size`` clients at a time, so the
  cohort is never whole in host memory; a compiled round loads it whole.
  """

  def __init__(self, algorithm: Any, execution: str, chunk_size: int | None,
               log: Callable[[str], None], headroom: float):
    self.algorithm = algorithm
    self.execution = execution
    self.chunk_size = chunk_size
    self._log = log
    self._headroom = headroom
    self._streamers: dict[int, streaming.Streamer] = {}
    self._streams: dict[str, bool] = {}  # cohort shape -> whether to stream
    # cohort shape -> the round compiled for the memory plan, run as it is:
    # calling algorithm.round would compile the same program again (its jit
    # cache is not shared with lower().compile()).
    self._compiled: dict[str, Any] = {}

  @property
  def may_stream(self) -> bool:
    """Whether some cohort may be streamed (then cohorts are best given lazily)."""
    return self.execution == 'streaming' or (
        self.execution == 'auto' and hasattr(self.algorithm.round, 'lower'))

  def streams(self, state: Any, cohort: Any, key: Any) -> bool:
    """Whether ``cohort`` (arrays, ``Clients`` or shapes) is streamed.

    For ``'auto'``: XLA's memory plan of the compiled round (arguments,
    outputs and temporaries), lowered from shapes alone, against
    ``headroom`` of the device's memory; decided once per cohort shape, and
    logged when it streams. A round that runs compiled runs that same
    executable (``algorithm.round`` would compile it a second time), or
    ``algorithm.round`` where its arguments' shardings differ. Thread-safe enough to be
    asked from a prefetching thread: a repeated decision only recompiles.
    """
    if self.execution != 'auto':
      return self.execution == 'streaming'
    if not hasattr(self.algorithm.round, 'lower'):
      return False  # Not a jitted round: no memory plan to read.
    spec = (cohort.placed_spec() if isinstance(cohort, streaming.Clients)
            else jax.tree.map(_spec, cohort))
    shape = _shape_key(spec)
    if shape not in self._streams:
      compiled = compile_to_fit(
          self.algorithm.round.lower(jax.tree.map(_spec, state), spec, _spec(key)),
          'the round', round_settings(state))
      analysis = compiled.memory_analysis()
      planned = int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes -
                    analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
      limit = device_memory_bytes()
      # Streaming in chunks as large as the cohort would only run it again.
      clients = int(jax.tree.leaves(spec)[0].shape[0])
      stream = (limit is not None and planned > self._headroom * limit and
                self.chunk_for(spec) < clients)
      if stream:
        self._log(f'fedjx: execution=auto: the compiled round plans '
                  f'{planned / 2**30:.2f} GiB, more than {self._headroom:.0%} of the '
                  f"device's {limit / 2**30:.2f} GiB; streaming the cohort in chunks "
                  f'of {self.chunk_for(spec)} clients.')
      if not stream:
        self._compiled[shape] = compiled
      self._streams[shape] = stream
    return self._streams[shape]

  def chunk_for(self, cohort: Any) -> int:
    """Clients per streamed chunk: ``chunk_size``, else :func:`streaming_chunk`."""
    leaves = jax.tree.leaves(cohort.placed_spec() if isinstance(cohort, streaming.Clients)
                             else cohort)
    n = int(leaves[0].shape[0])
    if self.chunk_size is not None:
      return min(self.chunk_size, n)
    client_bytes = sum(int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize
                       for x in leaves)
    return streaming_chunk(client_bytes, n)

  def loads_whole(self, state: Any, key: Any) -> Callable[[Any], bool]:
    """``whole(cohort)``: whether a cohort runs compiled (so is loaded whole).

    Reads only the shapes of ``state`` and ``key`` (taken now), so it may be
    called on another thread while the loop's state is donated and replaced.
    """
    state, key = jax.tree.map(_spec, state), _spec(key)
    return lambda cohort: not self.streams(state, cohort, key)

  def __call__(self, state: Any, cohort: Any, key: Any) -> Any:
    """Runs the round; running out of the device's memory while it runs (what
    the compiled plan did not see: fragmentation, buffers held beside it)
    raises :class:`OutOfMemory`, one line naming the settings to change."""
    with naming_out_of_memory("the round ran out of the device's memory while running",
                              lambda: round_settings(state)):
      return self._run(state, cohort, key)

  def _run(self, state: Any, cohort: Any, key: Any) -> Any:
    if self.streams(state, cohort, key):
      chunk = self.chunk_for(cohort)
      if chunk not in self._streamers:
        self._streamers[chunk] = streaming.Streamer(self.algorithm.apply, chunk)
      if not isinstance(cohort, streaming.Clients):
        cohort = streaming.Clients.from_arrays(cohort)
      return self._streamers[chunk](state, cohort, key)
    if isinstance(cohort, streaming.Clients):
      cohort = jax.device_put(cohort.load(cohort.client_ids))
    compiled = self._compiled.get(_shape_key(jax.tree.map(_spec, cohort)))
    if compiled is not None:
      try:  # Arguments are checked before anything runs or is donated.
        return compiled(state, cohort, key)
      except (TypeError, ValueError) as e:  # e.g. other shardings: jit's own cache
        if is_out_of_memory(e):
          raise
        self._compiled = {}
    return self.algorithm.round(state, cohort, key)


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
    chunk_size: clients per streamed chunk (default: as many as hold
      ``STREAMING_CHUNK_BYTES`` of client data, at least 64;
      :func:`streaming_chunk`).
    log: where ``'auto'`` reports its choice.
    headroom: the fraction of the device's memory a compiled round may plan.

  Returns:
    ``algorithm.round`` for ``'jit'`` (and on several processes, where
    ``'auto'`` compiles); otherwise a :class:`RoundRunner`, which takes a
    placed cohort or a :class:`fedjx.streaming.Clients` that loads its
    clients lazily.
  """
  options.check_execution(execution, chunk_size, 'fedjx.execution.round_runner: ')
  if execution == 'jit':
    return algorithm.round
  if jax.process_count() > 1:
    if execution == 'streaming':
      raise ValueError("fedjx.execution: execution='streaming' runs on one "
                       f'process; this run has {jax.process_count()}. Use '
                       "execution='jit'.")
    return algorithm.round
  return RoundRunner(algorithm, execution, chunk_size, log, headroom)
