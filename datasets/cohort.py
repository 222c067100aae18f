"""Cohorts: the clients of one round, batched, padded, stacked and placed.

A round consumes a :class:`Cohort` (see ``docs/interfaces.md``):

* ``batches``: dict of ``[C, S, B, ...]`` arrays, ``S`` local steps of ``B``
  examples for each of ``C`` clients;
* ``mask``: ``[C, S, B]`` bool, True where an example is real;
* ``num_examples``: ``[C]`` float32, the distinct real examples per client;
* ``client_ids``: ``[C]`` int32, the clients' ids in the population;
* ``client_states``: for an algorithm with per-client state kept outside
  the server state (``Algorithm.client_state_init`` is set, see
  ``docs/client_state.md``), the cohort's rows of that state, a pytree of
  ``[C, ...]`` leaves in cohort order; None (the default) otherwise.

Building one takes three steps, each a function here:

1. :class:`CohortSampler` picks ``C`` client ids for round ``r``, uniformly
   without replacement, as a function of ``(seed, r)`` only.
2. :func:`make_cohort` turns each client into a stream of examples (shuffled
   per epoch, repeated for ``num_epochs`` passes or until ``num_steps`` full
   batches), cuts it into batches of ``B`` and pads every client to the same
   ``S``. With ``bucket=True``, ``S`` is rounded up to a power of two so that
   only ``O(log max_steps)`` distinct shapes ever reach the compiler.
3. :func:`place_cohort` puts the arrays on device, sharded
   ``NamedSharding(mesh, P('clients'))`` when the mesh has a ``clients`` axis.

Padding is zeros with mask False. Steps after a client's last real example are
all-False padding steps, which algorithms skip. A *padding client* (id
``PADDING_CLIENT = -1`` in ``client_ids``, ``num_examples`` 0, mask all False)
fills a cohort whose sampler drew fewer clients than its fixed size (e.g.
Poisson sampling, padded to a bucket): every algorithm gives it weight 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjx.datasets import _seeding
from fedjx.datasets.federated import FederatedDataset, IndexedDataset, num_rows
from fedjx.datasets.device_data import AUTO_MAX_BYTES, DeviceDataset
from fedjx.indexed import IndexedBatches

CLIENTS_AXIS = 'clients'

# The id of a padding client in a cohort's ``client_ids``.
PADDING_CLIENT = -1

# make_cohort of an in-memory population warns when its padded host arrays
# are at least this many bytes and this many times its examples' bytes.
PADDED_WARNING_BYTES = 16 << 20
PADDED_WARNING_RATIO = 2.0


class PaddedCohortWarning(UserWarning):
  """A cohort built on the host as padded copies of an in-memory population
  that ``on_device`` would hold once (one line, once per place)."""


class Cohort(NamedTuple):
  """One round's clients: ``[C, S, B, ...]`` batches, mask and weights."""

  batches: dict[str, Any]
  mask: Any
  num_examples: Any
  client_ids: Any
  client_states: Any = None

  @property
  def shape(self) -> tuple[int, int, int]:
    """``(clients, steps, batch_size)``."""
    return tuple(int(d) for d in self.mask.shape)  # type: ignore[return-value]

  @classmethod
  def from_clients(cls, clients: Sequence[Mapping[str, Any]], batch_size: int,
                   *, steps: int | None = None,
                   client_ids: Sequence[int] | None = None) -> 'Cohort':
    """A cohort from explicit per-client arrays, padded for you.

    Client ``i``'s examples (``clients[i]``, a dict of ``[n_i, ...]`` arrays
    with the same keys, dtypes and trailing shapes for every client) fill its
    first ``ceil(n_i / B)`` steps in the given order, without shuffling or
    repetition; every client is padded with zeros (mask False) to ``S`` steps,
    the most any client needs (or ``steps``). A client with no examples is a
    padding client (``n_i = 0``).

    Args:
      clients: the per-client dicts, in cohort order.
      batch_size: ``B``, examples per step.
      steps: ``S``; default ``max_i ceil(n_i / B)`` (at least 1).
      client_ids: the clients' ids in the population (default ``0..C-1``).

    Returns:
      A :class:`Cohort` of NumPy arrays (``place_cohort`` puts it on device).
    """
    batch_size = _check_positive('batch_size', batch_size)
    if not clients:
      raise ValueError('Cohort.from_clients: clients=[] holds no client; give '
                       'at least one dict of [n_i, ...] arrays.')
    keys = sorted(clients[0])
    sizes = []
    for i, client in enumerate(clients):
      if sorted(client) != keys:
        raise ValueError(f'Cohort.from_clients: clients[{i}] has keys '
                         f'{sorted(client)}; every client needs {keys}.')
      lengths = {k: len(np.asarray(v)) for k, v in client.items()}
      if len(set(lengths.values())) > 1:
        raise ValueError(f'Cohort.from_clients: clients[{i}] has arrays of '
                         f'lengths {lengths}; they must share n_i.')
      sizes.append(next(iter(lengths.values()), 0))
    need = max([math.ceil(n / batch_size) for n in sizes] + [1])
    steps = need if steps is None else _check_positive('steps', steps)
    if steps < need:
      raise ValueError(f'Cohort.from_clients: steps={steps} holds fewer than '
                       f'the {need} steps of {batch_size} the largest client '
                       'needs.')
    padded = [pad_batches(c, np.arange(n), batch_size, steps)
              for c, n in zip(clients, sizes)]
    ids = (np.arange(len(clients)) if client_ids is None
           else np.asarray(client_ids))
    if ids.shape != (len(clients),):
      raise ValueError(f'Cohort.from_clients: client_ids has shape {ids.shape};'
                       f' it needs one id per client, ({len(clients)},).')
    return cls(batches={k: np.stack([b[k] for b, _ in padded]) for k in keys},
               mask=np.stack([m for _, m in padded]),
               num_examples=np.asarray(sizes, np.float32),
               client_ids=ids.astype(np.int32))


class CohortSampler:
  """Samples ``cohort_size`` client ids per round, uniformly without replacement.

  ``sample(r)`` depends only on ``(seed, r)`` and the population size, so a run
  resumed at round ``r`` sees the same cohorts as one that never stopped. It
  touches no client data, so the population may be any size.

  Args:
    population: a :class:`FederatedDataset` or its number of clients.
    cohort_size: clients per round, ``1 <= cohort_size <= num_clients``.
    seed: the random seed.
  """

  def __init__(self, population: FederatedDataset | int, cohort_size: int,
               seed: int = 0):
    num_clients = (population.num_clients
                   if isinstance(population, FederatedDataset) else int(population))
    if isinstance(cohort_size, bool) or not isinstance(cohort_size, (int, np.integer)) \
        or not 1 <= cohort_size <= num_clients:
      raise ValueError(f'cohort_size={cohort_size!r}; it must be an int in '
                       f'[1, {num_clients}] (the number of clients).')
    self.num_clients = num_clients
    self.cohort_size = int(cohort_size)
    self.seed = int(seed)

  def sample(self, round_num: int) -> np.ndarray:
    """``int32 [cohort_size]``: the sorted client ids for round ``round_num``."""
    if round_num < 0:
      raise ValueError(f'round_num={round_num}; rounds are numbered from 0.')
    gen = _seeding.rng(_seeding.COHORT, self.seed, round_num)
    ids = gen.choice(self.num_clients, size=self.cohort_size, replace=False)
    return np.sort(ids).astype(np.int32)


class Sampler(Protocol):
  """Who takes part in each round: what :func:`cohort_iterator` asks of a sampler.

  ``sample(r)`` gives the sorted int32 ids of round ``r``'s clients as a
  function of ``(seed, r)`` only (so resumed runs repeat the same cohorts);
  at most ``cohort_size`` of them, the cohort's fixed size, which padding
  clients fill. ``seed`` also seeds the clients' example shuffles.
  """

  cohort_size: int
  seed: int

  def sample(self, round_num: int) -> np.ndarray:
    ...


def padded_ids(client_ids: Sequence[int] | np.ndarray, size: int) -> np.ndarray:
  """``client_ids`` followed by ``PADDING_CLIENT`` up to ``size`` entries."""
  ids = np.asarray(client_ids, np.int32).reshape(-1)
  if ids.size > size:
    raise ValueError(f'the sampler drew {ids.size} clients, more than its '
                     f'cohort_size={size}.')
  return np.concatenate([ids, np.full(size - ids.size, PADDING_CLIENT, np.int32)])


def bucket_steps(steps: int) -> int:
  """The padded step count for ``steps``: the next power of two (1, 2, 4, ...)."""
  return 1 << max(0, int(steps) - 1).bit_length()


def _check_positive(name: str, value: Any, allow_none: bool = False) -> int | None:
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f'{name}={value!r}; it must be an int >= 1'
                     f'{" or None" if allow_none else ""}.')
  return int(value)


def example_orders(sizes: Sequence[int] | np.ndarray, batch_size: int, *,
                   num_epochs: int | None = None, num_steps: int | None = None,
                   max_steps: int | None = None,
                   shuffle: tuple[int, int, Sequence[int] | np.ndarray] | None = None
                   ) -> list[np.ndarray]:
  """The example indices each client visits, in order, before batching.

  Client ``c`` (``sizes[c] = n >= 1`` examples) visits ``num_epochs`` passes
  over ``range(n)`` (or as many passes as ``num_steps`` full batches need),
  truncated to ``max_steps`` batches. Each pass is in order, or with
  ``shuffle=(seed, round_num, client_ids)`` a permutation: pass ``p`` of
  client ``client_ids[c]`` visits example ``i`` in the order of
  ``hash(SHUFFLE, seed, round_num, client_ids[c], p, i)`` (a 64-bit hash:
  a uniform permutation, the same whichever clients are batched with it),
  all clients' slots hashed and sorted at once.
  """
  examples, lengths = _flat_orders(sizes, batch_size, num_epochs=num_epochs,
                                   num_steps=num_steps, max_steps=max_steps,
                                   shuffle=shuffle)
  return np.split(examples, np.cumsum(lengths)[:-1])


def _flat_orders(sizes, batch_size, *, num_epochs, num_steps, max_steps, shuffle
                 ) -> tuple[np.ndarray, np.ndarray]:
  """:func:`example_orders` as one array: the clients' streams end to end,
  and each stream's length."""
  sizes = np.asarray(sizes, np.int64).reshape(-1)
  if sizes.size and sizes.min() < 1:
    raise ValueError(f'a client with n={int(sizes.min())} examples cannot be '
                     'batched; clients need at least one example.')
  if num_steps is not None:
    total = np.full_like(sizes, num_steps * batch_size)
    passes = -(-total // np.maximum(sizes, 1))
  else:
    passes = np.full_like(sizes, 1 if num_epochs is None else num_epochs)
    total = passes * sizes
  if max_steps is not None:
    total = np.minimum(total, max_steps * batch_size)
    passes = np.minimum(passes, -(-total // np.maximum(sizes, 1)))
  slots = passes * sizes  # Whole passes; each client's stream is cut to total.
  client = np.repeat(np.arange(sizes.size), slots)
  within = np.arange(int(slots.sum())) - np.repeat(np.cumsum(slots) - slots, slots)
  epoch, example = np.divmod(within, np.repeat(sizes, slots))
  if shuffle is not None:
    seed, round_num, ids = shuffle
    ids = np.asarray(ids, np.int64).reshape(-1)
    keys = _seeding.hashed(_seeding.SHUFFLE, seed, round_num, ids[client], epoch, example)
    # Grouped by client and pass (the slots are in that order, so one running
    # pass number orders both), each group in its keys' order.
    group = np.repeat(np.cumsum(passes) - passes, slots) + epoch
    example = example[np.lexsort((keys, group))]
  if (total < slots).any():
    example = example[within < np.repeat(total, slots)]
  return example, total


def pad_batches(examples: Mapping[str, np.ndarray], order: np.ndarray,
                batch_size: int, steps: int) -> tuple[dict[str, np.ndarray],
                                                      np.ndarray]:
  """Gathers ``examples[order]`` into ``[steps, batch_size, ...]`` plus a mask.

  Positions past ``len(order)`` are zeros with mask False.
  """
  size = steps * batch_size
  if len(order) > size:
    raise ValueError(f'{len(order)} examples do not fit in {steps} steps of '
                     f'{batch_size}.')
  out = {}
  for key, value in examples.items():
    value = np.asarray(value)
    padded = np.zeros((size,) + value.shape[1:], dtype=value.dtype)
    padded[:len(order)] = value[order]
    out[key] = padded.reshape((steps, batch_size) + value.shape[1:])
  mask = np.zeros(size, dtype=bool)
  mask[:len(order)] = True
  return out, mask.reshape(steps, batch_size)


def make_cohort(dataset: FederatedDataset, client_ids: Sequence[int] | np.ndarray,
                batch_size: int, *, num_epochs: int | None = None,
                num_steps: int | None = None, max_steps: int | None = None,
                shuffle_seed: int | None = 0, round_num: int = 0,
                bucket: bool = True, steps: int | None = None,
                pad_to: int | None = None, order_by_steps: bool = False) -> Cohort:
  """Batches clients ``client_ids`` of ``dataset`` into a NumPy :class:`Cohort`.

  Each client's examples are visited as :func:`example_orders` describes:
  shuffled afresh each epoch by hashes of ``(shuffle_seed, round_num,
  client_id, epoch, example)`` (no shuffling when ``shuffle_seed`` is None), repeated for
  ``num_epochs`` passes (default 1; only the last batch may be partial) or for
  exactly ``num_steps`` full batches, then cut to at most ``max_steps``
  batches. Clients are padded to a common step count ``S``: the largest
  client's, rounded up to a power of two when ``bucket`` is True (but not
  beyond ``max_steps``; with ``num_steps``, ``S`` is that number).

  Args:
    dataset: the population.
    client_ids: ids of the cohort's clients, ``[C]``.
    batch_size: examples per step, ``>= 1``.
    num_epochs: passes over each client's data (exclusive with ``num_steps``).
    num_steps: full batches per client, repeating data as needed.
    max_steps: an upper bound on steps per client.
    shuffle_seed: seed of the per-epoch shuffles, or None for data order.
    round_num: the round, so each round shuffles differently.
    bucket: pad ``S`` to a power of two.
    steps: pad to exactly this ``S`` (at least what the clients need), e.g.
      the step count of the whole cohort when each process of a multi-process
      run builds only its own clients (see :func:`cohort_steps`).
    pad_to: the cohort's size ``C``: ids equal to ``PADDING_CLIENT`` and
      ``pad_to - len(client_ids)`` more become padding clients (default: no
      padding; ``client_ids`` may then not hold ``PADDING_CLIENT``).
    order_by_steps: lay the clients out by descending step count (ties in
      the given order; ``client_ids`` of the result says who is where), so
      that clients run together in a chunk (``map_strategy='chunked'``)
      have similar step counts and a step that is padding for all of them
      is skipped (``fedjx.mapping.any_in_chunk``). A reduction over the
      cohort then sums its clients in another order: the same result up to
      float rounding.

  Returns:
    A :class:`Cohort` of NumPy arrays; ``num_examples[c]`` counts the distinct
    examples of client ``c`` that appear in its batches.
  """
  batch_size = _check_positive('batch_size', batch_size)
  num_epochs = _check_positive('num_epochs', num_epochs, allow_none=True)
  num_steps = _check_positive('num_steps', num_steps, allow_none=True)
  max_steps = _check_positive('max_steps', max_steps, allow_none=True)
  if num_epochs is not None and num_steps is not None:
    raise ValueError(f'give num_epochs={num_epochs} or num_steps={num_steps}, '
                     'not both.')
  ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
  if pad_to is not None:
    pad_to = _check_positive('pad_to', pad_to)
    if ids.size > pad_to:
      raise ValueError(f'pad_to={pad_to} is smaller than the {ids.size} '
                       'clients given.')
    ids = np.concatenate([ids, np.full(pad_to - ids.size, PADDING_CLIENT)])
  if ids.size == 0:
    raise ValueError('client_ids is empty; a cohort needs at least one client.')
  if isinstance(dataset, DeviceDataset):  # Only counts are read, no examples.
    return _resident_cohort(
        dataset, ids, batch_size, num_epochs=num_epochs, num_steps=num_steps,
        max_steps=max_steps, shuffle_seed=shuffle_seed, round_num=round_num,
        bucket=bucket, steps=steps, padded=pad_to is not None,
        order_by_steps=order_by_steps)
  clients = []
  for cid in ids.tolist():
    if pad_to is not None and cid == PADDING_CLIENT:
      clients.append((PADDING_CLIENT, None, np.zeros(0, np.int64), 0))
      continue
    cid = dataset.check_client(cid)
    data = dataset.client_data(cid)
    n = num_rows(data, where=f'client {cid}')
    if n < 1:
      raise ValueError(f'client {cid} ({dataset.client_name(cid)!r}) has no '
                       'examples; every client in a cohort needs at least one.')
    clients.append((cid, data, None, n))
  held = [c for c in clients if c[0] != PADDING_CLIENT]
  held_ids = [c[0] for c in held]
  orders = iter(example_orders(
      [c[3] for c in held], batch_size, num_epochs=num_epochs, num_steps=num_steps,
      max_steps=max_steps,
      shuffle=None if shuffle_seed is None else (shuffle_seed, round_num, held_ids)))
  clients = [c if c[0] == PADDING_CLIENT else (c[0], c[1], next(orders), c[3])
             for c in clients]
  real = [c for c in clients if c[0] != PADDING_CLIENT]
  if len(real) < len(clients):
    # Padding clients take real clients' shapes.
    template = real[0][1] if real else dataset.client_data(0)
    clients = [c if c[0] != PADDING_CLIENT else (c[0], template, c[2], c[3])
               for c in clients]
  _check_features(real or clients[:1])
  if order_by_steps:
    clients.sort(key=lambda c: -math.ceil(len(c[2]) / batch_size))
  steps = _padded_steps(max(math.ceil(len(order) / batch_size)
                            for _, _, order, _ in clients),
                        num_steps=num_steps, max_steps=max_steps, bucket=bucket,
                        steps=steps, any_real=bool(real))
  stacked = [pad_batches(data, order, batch_size, steps)
             for _, data, order, _ in clients]
  batches = {k: np.stack([b[k] for b, _ in stacked]) for k in stacked[0][0]}
  mask = np.stack([m for _, m in stacked])
  distinct = np.array([min(n, len(order)) for _, _, order, n in clients],
                      dtype=np.float32)
  cids = np.array([cid for cid, _, _, _ in clients], dtype=np.int32)
  if isinstance(dataset, IndexedDataset):
    _warn_if_padded(dataset, batches, mask)
  return Cohort(batches, mask, distinct, cids)


def _warn_if_padded(dataset: IndexedDataset, batches: dict[str, np.ndarray],
                    mask: np.ndarray) -> None:
  """Warns (:class:`PaddedCohortWarning`) where a cohort of an in-memory
  population is :data:`PADDED_WARNING_BYTES` or more of padded copies,
  :data:`PADDED_WARNING_RATIO` times its examples' bytes or more, and the
  population fits where ``on_device`` would put it."""
  padded = sum(int(v.nbytes) for v in batches.values())
  row = padded / max(mask.size, 1)
  if (padded < PADDED_WARNING_BYTES or
      padded < PADDED_WARNING_RATIO * row * int(mask.sum()) or
      row * int(np.sum(dataset.examples_per_client())) > min(AUTO_MAX_BYTES.values())):
    return
  warnings.warn(
      'make_cohort copies padded batches of this in-memory population on the '
      'host for every cohort; put it on the device once '
      '(population = datasets.on_device(dataset)) and each cohort is an index '
      'into it, built and moved at 5 bytes per example slot '
      '(docs/datasets.md, "Cohorts").', PaddedCohortWarning, stacklevel=3)


def _padded_steps(needed: int, *, num_steps, max_steps, bucket,
                  steps, any_real: bool) -> int:
  """``S``, the cohort's step count, from the most steps a client needs."""
  needed = max(1, needed)
  if not any_real and num_steps is not None:  # The shape real clients would give.
    needed = num_steps if max_steps is None else min(num_steps, max_steps)
  if steps is None:
    steps = needed
    if bucket and num_steps is None:
      steps = bucket_steps(steps)
      if max_steps is not None:
        steps = min(steps, max_steps)
  elif steps < needed:
    raise ValueError(f'steps={steps} is fewer than the {needed} steps these '
                     'clients need.')
  return steps


def _resident_cohort(dataset: DeviceDataset, ids: np.ndarray, batch_size: int, *,
                     num_epochs, num_steps, max_steps, shuffle_seed, round_num,
                     bucket, steps, padded, order_by_steps) -> Cohort:
  """:func:`make_cohort` of a population on the device, for the whole cohort
  at once: the clients' counts, orders and rows as arrays, no loop over
  clients."""
  pad = (ids == PADDING_CLIENT) if padded else np.zeros(ids.shape, bool)
  bad = ~pad & ((ids < 0) | (ids >= dataset.num_clients))
  if bad.any():
    dataset.check_client(int(ids[np.argmax(bad)]))  # Raises, naming the id.
  counts = dataset.examples_per_client()
  n = np.where(pad, 0, counts[np.where(pad, 0, ids)])
  empty = ~pad & (n < 1)
  if empty.any():
    cid = int(ids[np.argmax(empty)])
    raise ValueError(f'client {cid} ({dataset.client_name(cid)!r}) has no '
                     'examples; every client in a cohort needs at least one.')
  real = np.flatnonzero(~pad)
  examples, real_lengths = _flat_orders(
      n[real], batch_size, num_epochs=num_epochs, num_steps=num_steps,
      max_steps=max_steps,
      shuffle=None if shuffle_seed is None else (shuffle_seed, round_num, ids[real]))
  lengths = np.zeros(ids.size, np.int64)
  lengths[real] = real_lengths
  client_steps = -(-lengths // batch_size)
  place = np.arange(ids.size)
  if order_by_steps:
    place = np.empty_like(place)
    place[np.argsort(-client_steps, kind='stable')] = np.arange(ids.size)
  steps = _padded_steps(int(client_steps.max()), num_steps=num_steps,
                        max_steps=max_steps, bucket=bucket, steps=steps,
                        any_real=real.size > 0)
  size = steps * batch_size
  index = np.full((ids.size, size), dataset.total_examples, np.int32)
  mask = np.zeros((ids.size, size), bool)
  row = np.repeat(place[real], real_lengths)
  slot = np.arange(examples.size) - np.repeat(np.cumsum(real_lengths) - real_lengths,
                                              real_lengths)
  index[row, slot] = examples + np.repeat(dataset.offsets[ids[real]], real_lengths)
  mask[row, slot] = True
  order = np.argsort(place)
  shape = (ids.size, steps, batch_size)
  return Cohort(IndexedBatches(dataset.table, index.reshape(shape)),
                mask.reshape(shape),
                np.minimum(n, lengths)[order].astype(np.float32),
                ids[order].astype(np.int32))


def cohort_steps(dataset: FederatedDataset, client_ids: Sequence[int] | np.ndarray,
                 batch_size: int, *, num_epochs: int | None = None,
                 num_steps: int | None = None, max_steps: int | None = None,
                 bucket: bool = True) -> int:
  """The step count ``S`` that :func:`make_cohort` gives these clients.

  Computed from example counts alone (no client data is read), so every
  process of a multi-process run agrees on the shape of the whole cohort.
  """
  if num_steps is not None:
    return int(num_steps)
  sizes = [1]
  for cid in np.asarray(client_ids).reshape(-1).tolist():
    if cid == PADDING_CLIENT:
      continue
    n = int(dataset.num_examples(dataset.check_client(cid)))
    total = (1 if num_epochs is None else num_epochs) * n
    if max_steps is not None:
      total = min(total, max_steps * batch_size)
    sizes.append(math.ceil(total / batch_size))
  steps = max(sizes)
  if bucket:
    steps = bucket_steps(steps)
    if max_steps is not None:
      steps = min(steps, max_steps)
  return steps


def local_client_slice(mesh: jax.sharding.Mesh, num_clients: int) -> slice:
  """The clients of a ``[C]`` cohort sharded ``P('clients')`` that this
  process's devices hold (a contiguous range)."""
  sharding = NamedSharding(mesh, P(CLIENTS_AXIS))
  indices = sharding.addressable_devices_indices_map((num_clients,)).values()
  starts = [ix[0].start or 0 for ix in indices]
  stops = [num_clients if ix[0].stop is None else ix[0].stop for ix in indices]
  return slice(min(starts), max(stops))


def place_local_cohort(local: Cohort, mesh: jax.sharding.Mesh,
                       num_clients: int) -> Cohort:
  """Assembles a global cohort from each process's own clients.

  ``local`` holds this process's clients (:func:`local_client_slice`); the
  result is sharded ``P('clients')`` over all processes' devices, built with
  ``jax.make_array_from_process_local_data`` so no process loads another's
  clients.
  """
  if isinstance(local.batches, IndexedBatches):
    raise ValueError('place_local_cohort: the cohort indexes a population on '
                     'the device (datasets.on_device); a multi-process run '
                     'builds each process\'s clients on the host (keep the '
                     'dataset off the device: data.on_device=\'host\').')
  sharding = NamedSharding(mesh, P(CLIENTS_AXIS))
  return jax.tree.map(
      lambda a: jax.make_array_from_process_local_data(
          sharding, np.asarray(a), (num_clients,) + np.shape(a)[1:]), local)


def _check_features(clients: list[tuple[int, dict, np.ndarray, int]]) -> None:
  """Every client must have the same features, per-example shapes and dtypes."""
  cid0, first = clients[0][0], clients[0][1]
  spec = {k: (np.shape(v)[1:], np.asarray(v).dtype) for k, v in first.items()}
  for cid, data, _, _ in clients[1:]:
    if set(data) != set(spec):
      raise ValueError(f'client {cid} has features {sorted(data)} but client {cid0}'
                       f' has {sorted(spec)}; a cohort needs the same features.')
    for k, v in data.items():
      got = (np.shape(v)[1:], np.asarray(v).dtype)
      if got != spec[k]:
        raise ValueError(f'feature {k!r}: client {cid} has per-example shape/dtype '
                         f'{got} but client {cid0} has {spec[k]}; pad or crop '
                         'features to one shape (e.g. with dataset.map).')


def place_cohort(cohort: Cohort, mesh: jax.sharding.Mesh | None = None) -> Cohort:
  """Puts a NumPy cohort on device.

  With a mesh that has a ``'clients'`` axis (passed, or set with
  ``jax.set_mesh``), every array is laid out ``NamedSharding(mesh,
  P('clients'))``: each device along that axis holds its slice of the clients.
  With a mesh without that axis, arrays are replicated over it. With no mesh,
  they go to the default device.
  """
  if mesh is None:
    mesh = jax.sharding.get_mesh()
    if mesh is None or getattr(mesh, 'empty', False):
      mesh = None
  # The table of an indexed cohort is on the device already, laid out by
  # on_device: only the index moves.
  table = (cohort.batches.table if isinstance(cohort.batches, IndexedBatches)
           else None)
  if table is not None:
    cohort = cohort._replace(batches=cohort.batches.index)
  if mesh is None:
    placed = jax.device_put(cohort)
  elif CLIENTS_AXIS not in mesh.axis_names:
    placed = jax.device_put(cohort, NamedSharding(mesh, P()))
  else:
    shards = mesh.shape[CLIENTS_AXIS]
    clients = int(np.shape(cohort.mask)[0])
    if clients % shards:
      raise ValueError(f'cohort of {clients} clients cannot be split over the '
                       f"mesh axis 'clients' of size {shards}; use a cohort_size"
                       f' that is a multiple of {shards}.')
    placed = jax.device_put(cohort, NamedSharding(mesh, P(CLIENTS_AXIS)))
  if table is not None:
    placed = placed._replace(batches=IndexedBatches(table, placed.batches))
  return placed
