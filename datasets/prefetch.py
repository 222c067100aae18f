"""Preparing the next cohorts in a background thread while a round runs.

:class:`Prefetcher` calls ``produce(r)`` for ``r = start, start + 1, ...`` on a
worker thread and hands the results out in order, keeping up to ``prefetch``
ready. Because every cohort is a function of ``(seed, r)`` alone, the items are
the same as calling ``produce(r)`` in the loop; only the waiting differs.

:func:`cohort_iterator` is the usual use: sample, batch and place the cohort
of each round, so that reading clients, padding and the host-to-device copy of
round ``r + 1`` overlap the computation of round ``r``.

:func:`lazy_cohort_iterator` gives each round's cohort *unloaded*: its client
ids, its step count (from example counts alone) and a loader of any chunk of
its clients (a :class:`fedjx.streaming.Clients`), so that a streamed round
reads a chunk of clients at a time and the cohort is never in host memory.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import jax

import numpy as np

from fedjx import streaming
from fedjx.datasets.cohort import (Cohort, CohortSampler, Sampler, cohort_steps,
                                   local_client_slice, make_cohort, padded_ids,
                                   place_cohort, place_local_cohort)
from fedjx.datasets.federated import FederatedDataset

T = TypeVar('T')

_POLL_S = 0.05


def _work(produce: Callable[[int], object], index: int, stop: int | None,
          out: queue.Queue, closed: threading.Event) -> None:
  """Puts ``(r, produce(r), None)`` (or ``(r, None, error)``) for r = index, ..."""
  while not closed.is_set() and (stop is None or index < stop):
    try:
      item, error = produce(index), None
    except BaseException as e:  # pylint: disable=broad-except
      item, error = None, e
    while not closed.is_set():
      try:
        out.put((index, item, error), timeout=_POLL_S)
        break
      except queue.Full:
        continue
    if error is not None:
      return
    index += 1


class Prefetcher(Generic[T], Iterator[T]):
  """Iterates ``produce(start), produce(start + 1), ...`` computed ahead.

  Args:
    produce: ``produce(r) -> item``; a pure function of ``r``.
    start: the first index.
    stop: one past the last index, or None to run forever.
    prefetch: items computed ahead on a background thread; 0 computes each
      item in ``__next__`` on the caller's thread.

  An exception in ``produce`` is raised from ``__next__`` for the index that
  failed. Use as a context manager, or call :meth:`close`, to stop the worker.
  """

  def __init__(self, produce: Callable[[int], T], start: int = 0,
               stop: int | None = None, prefetch: int = 1):
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
      raise ValueError(f'prefetch={prefetch!r}; it must be an int >= 0.')
    self._produce = produce
    self._next = start
    self._stop = stop
    self._prefetch = prefetch
    self._closed = threading.Event()
    self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
    self._thread = None
    if prefetch > 0:
      # The worker holds no reference to self, so an abandoned iterator is
      # garbage collected and its __del__ stops the worker.
      self._thread = threading.Thread(
          target=_work, args=(produce, start, stop, self._queue, self._closed),
          name='fedjx-prefetch', daemon=True)
      self._thread.start()

  def __iter__(self) -> Prefetcher[T]:
    return self

  def __next__(self) -> T:
    if self._closed.is_set() or (self._stop is not None and self._next >= self._stop):
      raise StopIteration
    if self._thread is None:
      item = self._produce(self._next)
    else:
      while True:
        try:
          index, item, error = self._queue.get(timeout=_POLL_S)
          break
        except queue.Empty:
          if not self._thread.is_alive() and self._queue.empty():
            raise RuntimeError('prefetch worker stopped unexpectedly') from None
      if error is not None:
        self.close()
        raise error
      assert index == self._next, (index, self._next)
    self._next += 1
    return item

  def close(self) -> None:
    """Stops the worker thread and drops prepared items."""
    self._closed.set()
    if self._thread is not None:
      while True:
        try:
          self._queue.get_nowait()
        except queue.Empty:
          break
      self._thread.join()

  def __enter__(self) -> Prefetcher[T]:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    closed = getattr(self, '_closed', None)
    if closed is not None:
      closed.set()


def calling_thread_mesh(mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
  """``mesh``, else the mesh set with ``jax.set_mesh`` on this thread (None: none).

  The iterators resolve it when they are made: the prefetch thread does not
  see a mesh set on the thread that made them.
  """
  if mesh is None:
    mesh = jax.sharding.get_mesh()
    if mesh is None or getattr(mesh, 'empty', False):
      mesh = None
  return mesh


@dataclasses.dataclass(frozen=True)
class Batching:
  """How a run batches each round's clients: :func:`make_cohort`'s fixed options.

  Every cohort iterator (:func:`cohort_iterator`,
  :func:`lazy_cohort_iterator`,
  :func:`~fedjx.datasets.async_cohort_iterator`,
  :func:`~fedjx.datasets.system_cohort_iterator`) builds its rounds with one
  ``Batching``, so client ``c``'s batches in round ``r`` are the same function
  of ``(seed, r, c)`` in all of them.

  Attributes:
    batch_size: examples per step.
    num_epochs, num_steps, max_steps, bucket, order_by_steps: as in
      :func:`make_cohort`.
    shuffle: shuffle each client's examples per epoch, seeded from
      ``(seed, round_num, client)``; else data order.
  """

  batch_size: int
  num_epochs: int | None = None
  num_steps: int | None = None
  max_steps: int | None = None
  shuffle: bool = True
  bucket: bool = True
  order_by_steps: bool = False

  def cohort(self, dataset: FederatedDataset, client_ids: Sequence[int] | np.ndarray,
             seed: int, round_num: int, *, steps: int | None = None,
             pad_to: int | None = None) -> Cohort:
    """The NumPy cohort of ``client_ids`` in round ``round_num`` (``steps``,
    ``pad_to`` as in :func:`make_cohort`)."""
    return make_cohort(dataset, client_ids, self.batch_size,
                       num_epochs=self.num_epochs, num_steps=self.num_steps,
                       max_steps=self.max_steps,
                       shuffle_seed=seed if self.shuffle else None,
                       round_num=round_num, bucket=self.bucket, steps=steps,
                       pad_to=pad_to, order_by_steps=self.order_by_steps)

  def steps(self, dataset: FederatedDataset,
            client_ids: Sequence[int] | np.ndarray) -> int:
    """The step count ``S`` of :meth:`cohort` (from example counts alone)."""
    return cohort_steps(dataset, client_ids, self.batch_size,
                        num_epochs=self.num_epochs, num_steps=self.num_steps,
                        max_steps=self.max_steps, bucket=self.bucket)

  def check(self, dataset: FederatedDataset,
            client_ids: Sequence[int] | np.ndarray) -> None:
    """Raises :func:`make_cohort`'s error for bad options now, on the calling
    thread, not later on the prefetch thread (builds the first client only)."""
    self.cohort(dataset, client_ids[:1], None, 0, pad_to=1)


def cohort_for_round(dataset: FederatedDataset, sampler: Sampler,
                     round_num: int, batch_size: int, *,
                     num_epochs: int | None = None, num_steps: int | None = None,
                     max_steps: int | None = None, shuffle: bool = True,
                     bucket: bool = True) -> Cohort:
  """The NumPy cohort of round ``round_num``: sampled, shuffled with the sampler's seed.

  A sampler that draws fewer than ``sampler.cohort_size`` clients (e.g.
  Poisson sampling) gets its cohort filled with padding clients.
  """
  batching = Batching(batch_size, num_epochs, num_steps, max_steps, shuffle, bucket)
  return batching.cohort(dataset, sampler.sample(round_num), sampler.seed,
                         round_num, pad_to=sampler.cohort_size)


def cohort_iterator(dataset: FederatedDataset, cohort_size: int, batch_size: int,
                    *, seed: int = 0, start_round: int = 0,
                    num_rounds: int | None = None,
                    num_epochs: int | None = None, num_steps: int | None = None,
                    max_steps: int | None = None, shuffle: bool = True,
                    bucket: bool = True, mesh: jax.sharding.Mesh | None = None,
                    prefetch: int = 1,
                    sampler: Sampler | None = None,
                    order_by_steps: bool = False) -> Prefetcher[Cohort]:
  """Placed cohorts for rounds ``start_round, start_round + 1, ...``.

  Round ``r``'s cohort is ``place_cohort(cohort_for_round(dataset,
  CohortSampler(dataset, cohort_size, seed), r, ...), mesh)``: it depends only
  on ``(seed, r)``, so resuming at ``start_round = r`` continues the same
  sequence. With ``prefetch > 0`` the next cohorts are built and transferred on
  a background thread.

  Args:
    dataset: the population.
    cohort_size: clients per round (a multiple of the mesh's ``clients`` axis).
    batch_size: examples per step.
    seed: seeds both cohort sampling and per-client shuffling.
    start_round: the first round to yield.
    num_rounds: how many rounds to yield (None: forever).
    num_epochs, num_steps, max_steps, bucket, order_by_steps: as in
      :func:`make_cohort`.
    shuffle: shuffle each client's examples per epoch.
    mesh: where to place cohorts (default: the mesh set with ``jax.set_mesh``,
      if any); sharded over its ``clients`` axis.
    prefetch: cohorts prepared ahead (0: synchronous).
    sampler: who takes part in each round (default
      ``CohortSampler(dataset, cohort_size, seed)``: ``cohort_size`` clients
      uniformly without replacement); its ``cohort_size`` is the cohort's
      size, filled with padding clients when it draws fewer.
  """
  if sampler is None:
    sampler = CohortSampler(dataset, cohort_size, seed)
  cohort_size = sampler.cohort_size
  mesh = calling_thread_mesh(mesh)
  batching = Batching(batch_size, num_epochs, num_steps, max_steps, shuffle, bucket,
                      order_by_steps)
  batching.check(dataset, sampler.sample(start_round))
  if mesh is not None and 'clients' in mesh.axis_names \
      and cohort_size % mesh.shape['clients']:
    raise ValueError(f'cohort_size={cohort_size} cannot be split over the mesh '
                     f"axis 'clients' of size {mesh.shape['clients']}; use a "
                     'multiple of it.')

  multi_process = (jax.process_count() > 1 and mesh is not None and
                   'clients' in mesh.axis_names)

  def produce(round_num: int) -> Cohort:
    if multi_process:  # Each process builds only the clients it holds.
      ids = padded_ids(sampler.sample(round_num), cohort_size)
      mine = ids[local_client_slice(mesh, len(ids))]
      local = batching.cohort(dataset, mine, sampler.seed, round_num,
                              steps=batching.steps(dataset, ids), pad_to=len(mine))
      return place_local_cohort(local, mesh, len(ids))
    cohort = batching.cohort(dataset, sampler.sample(round_num), sampler.seed,
                             round_num, pad_to=cohort_size)
    return place_cohort(cohort, mesh)

  stop = None if num_rounds is None else start_round + num_rounds
  return Prefetcher(produce, start=start_round, stop=stop, prefetch=prefetch)


def lazy_cohort_for_round(dataset: FederatedDataset, sampler: Sampler,
                          round_num: int, batch_size: int, *,
                          num_epochs: int | None = None,
                          num_steps: int | None = None,
                          max_steps: int | None = None, shuffle: bool = True,
                          bucket: bool = True) -> streaming.Clients:
  """Round ``round_num``'s cohort as a loader of chunks of its clients.

  The result's ``client_ids`` are ``sampler.sample(round_num)`` followed by
  padding clients up to ``sampler.cohort_size``, and ``load(ids)`` gives the
  rows of :func:`cohort_for_round`'s cohort for those clients (the same
  batches, mask, counts and ids): each client's batches depend only on
  ``(seed, round_num, client)`` and on the cohort's step count ``S``, which
  :func:`~fedjx.datasets.cohort.cohort_steps` computes from example counts
  without reading any client's data. Only one client is read here (for the
  spec).
  """
  batching = Batching(batch_size, num_epochs, num_steps, max_steps, shuffle, bucket)
  ids = padded_ids(sampler.sample(round_num), sampler.cohort_size)
  steps = batching.steps(dataset, ids)
  if num_steps is not None and max_steps is not None:
    steps = min(steps, max_steps)  # As make_cohort cuts num_steps.

  def load(chunk) -> Cohort:
    chunk = np.asarray(chunk, np.int32)
    return batching.cohort(dataset, chunk, sampler.seed, round_num, steps=steps,
                           pad_to=len(chunk))

  spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype),
                      load(ids[:1]))
  return streaming.Clients(ids, load, spec)


def lazy_cohort_iterator(dataset: FederatedDataset, cohort_size: int,
                         batch_size: int, *, seed: int = 0, start_round: int = 0,
                         num_rounds: int | None = None,
                         num_epochs: int | None = None,
                         num_steps: int | None = None,
                         max_steps: int | None = None, shuffle: bool = True,
                         bucket: bool = True,
                         mesh: jax.sharding.Mesh | None = None,
                         prefetch: int = 1, sampler: Sampler | None = None,
                         whole: Callable[[streaming.Clients], bool] | None = None
                         ) -> Prefetcher[streaming.Clients | Cohort]:
  """Unloaded cohorts (:func:`lazy_cohort_for_round`) for rounds ``start_round, ...``.

  Sampling and step counts are prepared ``prefetch`` rounds ahead on a
  background thread; no client data is read beyond one client per round.
  Arguments are those of :func:`cohort_iterator`, plus:

  Args:
    whole: optional ``whole(clients) -> bool``, asked on the background
      thread for each round: where True, that round's item is the whole
      cohort loaded and placed (exactly :func:`cohort_iterator`'s item),
      built ahead as :func:`cohort_iterator` builds it. This is how
      ``execution='auto'`` keeps the transfer overlap for rounds it compiles
      and streams the others.
  """
  if sampler is None:
    sampler = CohortSampler(dataset, cohort_size, seed)
  mesh = calling_thread_mesh(mesh)
  Batching(batch_size, num_epochs, num_steps, max_steps, shuffle,
           bucket).check(dataset, sampler.sample(start_round))

  def produce(round_num: int) -> streaming.Clients | Cohort:
    clients = lazy_cohort_for_round(
        dataset, sampler, round_num, batch_size, num_epochs=num_epochs,
        num_steps=num_steps, max_steps=max_steps, shuffle=shuffle, bucket=bucket)
    if whole is not None and whole(clients):
      return place_cohort(clients.load(clients.client_ids), mesh)
    return clients

  stop = None if num_rounds is None else start_round + num_rounds
  return Prefetcher(produce, start=start_round, stop=stop, prefetch=prefetch)
