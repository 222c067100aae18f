"""Federated datasets: a population of clients, each a dict of NumPy arrays.

A :class:`FederatedDataset` is group-structured data. Clients are numbered
``0 .. num_clients - 1`` (their *client ids*, the indices a cohort carries in
``Cohort.client_ids``); each may also have a *name* from its source (an HDF5
group, a module name, a feature value). A client's examples are a dict of
arrays sharing their leading axis, e.g. ``{'x': [n, 8, 8, 1], 'y': [n]}``.

Access is lazy: ``client_data(cid)`` reads or generates one client when asked,
so a population of any size is never held in memory at once. Only the example
counts (one int per client) are kept.

Implementations here:

* :class:`IndexedDataset`: clients are lists of example indices into a
  random-access source (in-memory arrays, a TFDS data source, ...).
* :func:`from_arrays`: an :class:`IndexedDataset` over a dict of arrays,
  grouped by a feature or by given index groups.
* ``dataset.subset(ids)`` and ``dataset.map(fn)``: views that renumber a subset
  of the clients, or transform each client's examples as it is read.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedjx.datasets import partition

Examples = dict[str, np.ndarray]


def num_rows(examples: Mapping[str, Any], where: str = 'examples') -> int:
  """The shared leading-axis length of ``examples``, checking it is shared."""
  if not isinstance(examples, Mapping) or not examples:
    raise ValueError(f'{where} must be a non-empty dict of arrays; got '
                     f'{type(examples).__name__} of length {len(examples or ())}.'
                     if isinstance(examples, Mapping) else
                     f'{where} must be a non-empty dict of arrays; got '
                     f'{type(examples).__name__}.')
  lengths = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in examples.items()}
  if any(n is None for n in lengths.values()):
    scalars = sorted(k for k, n in lengths.items() if n is None)
    raise ValueError(f'{where}: features {scalars} are scalars; every feature '
                     'needs a leading example axis.')
  if len(set(lengths.values())) != 1:
    raise ValueError(f'{where}: features have different numbers of examples '
                     f'{lengths}; all must share the leading axis.')
  return next(iter(lengths.values()))


class FederatedDataset(abc.ABC):
  """A population of clients; each client's examples are a dict of arrays.

  Subclasses implement :attr:`num_clients`, :meth:`num_examples` and
  :meth:`_client_data`; they may override :meth:`examples_per_client` and
  :meth:`client_name` when they can do better than one call per client.
  """

  @property
  @abc.abstractmethod
  def num_clients(self) -> int:
    """How many clients the population holds."""

  @property
  def client_ids(self) -> np.ndarray:
    """``int32 [num_clients]``: ``0, 1, ..., num_clients - 1``."""
    return np.arange(self.num_clients, dtype=np.int32)

  def client_name(self, cid: int) -> str:
    """The client's name in its source (default: its id as a string)."""
    return str(self.check_client(cid))

  @abc.abstractmethod
  def num_examples(self, cid: int) -> int:
    """How many examples client ``cid`` holds (cheap: reads no examples)."""

  def examples_per_client(self) -> np.ndarray:
    """``int64 [num_clients]``: every client's example count."""
    return np.array([self.num_examples(c) for c in range(self.num_clients)],
                    dtype=np.int64)

  @abc.abstractmethod
  def _client_data(self, cid: int) -> Examples:
    """Reads client ``cid``'s examples (``cid`` already checked)."""

  def client_data(self, cid: int) -> Examples:
    """Client ``cid``'s examples: a dict of arrays with a shared leading axis."""
    return self._client_data(self.check_client(cid))

  def check_client(self, cid: Any) -> int:
    """``cid`` as an int, or a ValueError if it is not a client id."""
    try:
      index = int(cid)
    except (TypeError, ValueError):
      index = None
    if index is None or index != cid or not 0 <= index < self.num_clients:
      raise ValueError(f'client id {cid!r} is not in this dataset; ids are ints '
                       f'in [0, {self.num_clients}).')
    return index

  def subset(self, client_ids: Sequence[int] | np.ndarray) -> FederatedDataset:
    """The clients ``client_ids`` renumbered ``0 .. len - 1`` (names are kept)."""
    return SubsetDataset(self, client_ids)

  def map(self, fn: Callable[[Examples], Examples]) -> FederatedDataset:
    """Applies ``fn`` to each client's examples when they are read.

    ``fn`` maps a client's dict of arrays to a new dict with the same number of
    examples (e.g. normalising images, renaming features).
    """
    return MappedDataset(self, fn)

  def __len__(self) -> int:
    return self.num_clients

  def __repr__(self) -> str:
    return f'{type(self).__name__}(num_clients={self.num_clients})'


class IndexedDataset(FederatedDataset):
  """Clients as groups of example indices into a random-access source.

  Args:
    fetch: ``fetch(indices) -> dict of arrays`` returning the examples at the
      given (sorted, int64) indices, stacked on a leading axis.
    groups: client ``c`` holds the examples ``groups[c]``; none may be empty.
    names: optional per-client names (default: the client ids).
  """

  def __init__(self, fetch: Callable[[np.ndarray], Examples],
               groups: Sequence[np.ndarray], names: Sequence[str] | None = None):
    self._fetch = fetch
    self._groups = [np.asarray(g, dtype=np.int64) for g in groups]
    if not self._groups:
      raise ValueError('groups is empty; a dataset needs at least one client.')
    for c, g in enumerate(self._groups):
      if g.ndim != 1 or g.size == 0:
        raise ValueError(f'groups[{c}] has shape {g.shape}; every client needs a '
                         'non-empty 1-D array of example indices.')
    if names is not None and len(names) != len(self._groups):
      raise ValueError(f'names has {len(names)} entries for {len(self._groups)} '
                       'clients; give one name per client.')
    self._names = None if names is None else [str(n) for n in names]
    self._sizes = np.array([g.size for g in self._groups], dtype=np.int64)

  @property
  def num_clients(self) -> int:
    return len(self._groups)

  def client_name(self, cid: int) -> str:
    cid = self.check_client(cid)
    return str(cid) if self._names is None else self._names[cid]

  def num_examples(self, cid: int) -> int:
    return int(self._sizes[self.check_client(cid)])

  def examples_per_client(self) -> np.ndarray:
    return self._sizes.copy()

  def client_indices(self, cid: int) -> np.ndarray:
    """The source indices of client ``cid``'s examples."""
    return self._groups[self.check_client(cid)].copy()

  def all_examples(self) -> Examples:
    """Every client's examples, client after client, in one fetch (what
    reading the clients in order and concatenating them gives)."""
    return dict(self._fetch(np.concatenate(self._groups)))

  def _client_data(self, cid: int) -> Examples:
    return dict(self._fetch(self._groups[cid]))


class SubsetDataset(FederatedDataset):
  """Clients ``client_ids`` of ``base``, renumbered in the given order."""

  def __init__(self, base: FederatedDataset, client_ids: Sequence[int] | np.ndarray):
    ids = [base.check_client(c) for c in np.asarray(client_ids).reshape(-1).tolist()]
    if not ids:
      raise ValueError('client_ids is empty; a subset needs at least one client.')
    if len(set(ids)) != len(ids):
      raise ValueError('client_ids has repeated ids; a subset lists each client once.')
    self._base = base
    self._ids = np.array(ids, dtype=np.int64)

  @property
  def base_ids(self) -> np.ndarray:
    """The ids in the base dataset of this subset's clients."""
    return self._ids.copy()

  @property
  def num_clients(self) -> int:
    return int(self._ids.size)

  def client_name(self, cid: int) -> str:
    return self._base.client_name(int(self._ids[self.check_client(cid)]))

  def num_examples(self, cid: int) -> int:
    return self._base.num_examples(int(self._ids[self.check_client(cid)]))

  def examples_per_client(self) -> np.ndarray:
    return self._base.examples_per_client()[self._ids]

  def _client_data(self, cid: int) -> Examples:
    return self._base.client_data(int(self._ids[cid]))


class WrappedDataset(FederatedDataset):
  """A population read through ``self._base``: its clients, names and sizes.

  Subclasses change what a client's examples are (``_client_data``), never
  who the clients are or how many examples each holds.
  """

  _base: FederatedDataset

  @property
  def num_clients(self) -> int:
    return self._base.num_clients

  def client_name(self, cid: int) -> str:
    return self._base.client_name(cid)

  def num_examples(self, cid: int) -> int:
    return self._base.num_examples(cid)

  def examples_per_client(self) -> np.ndarray:
    return self._base.examples_per_client()


class MappedDataset(WrappedDataset):
  """``base`` with ``fn`` applied to each client's examples as they are read."""

  def __init__(self, base: FederatedDataset, fn: Callable[[Examples], Examples]):
    self._base = base
    self._fn = fn

  def _client_data(self, cid: int) -> Examples:
    out = self._fn(self._base.client_data(cid))
    n = num_rows(out, where=f'map fn output for client {cid}')
    if n != self._base.num_examples(cid):
      raise ValueError(f'map fn changed client {cid} from '
                       f'{self._base.num_examples(cid)} to {n} examples; it must '
                       'keep the number of examples.')
    return dict(out)


def from_arrays(arrays: Mapping[str, Any], group_key: str | None = None,
                groups: Sequence[Any] | np.ndarray | None = None,
                names: Sequence[str] | None = None) -> IndexedDataset:
  """A federated dataset over in-memory arrays.

  Exactly one of ``group_key`` and ``groups`` says who holds which example:

  * ``group_key``: the feature whose value names the client (natural groups:
    a writer id, a speaker, ...). Clients are the distinct values in sorted
    order and are named after them.
  * ``groups``: either a sequence of index arrays (client ``c`` holds
    ``arrays[k][groups[c]]``; what the ``partition_*`` functions return) or
    an int array of length ``n`` giving each example's client.

  Args:
    arrays: dict of arrays sharing their leading (example) axis.
    group_key: name of the grouping feature.
    groups: index groups or per-example client assignment.
    names: optional client names (only with ``groups``).

  Returns:
    An :class:`IndexedDataset` whose clients slice ``arrays`` lazily.
  """
  arrays = {k: np.asarray(v) for k, v in dict(arrays).items()}
  n = num_rows(arrays, where='from_arrays: arrays')
  if (group_key is None) == (groups is None):
    raise ValueError('from_arrays: give exactly one of group_key (a feature name)'
                     f' or groups (index groups); got group_key={group_key!r} and '
                     f'groups={"None" if groups is None else "..."}.')
  if group_key is not None:
    if group_key not in arrays:
      raise ValueError(f'from_arrays: group_key={group_key!r} is not a feature; '
                       f'features are {sorted(arrays)}.')
    values, index_groups = partition.unique_groups(arrays[group_key])
    names = [_name(v) for v in values]
  else:
    index_groups = _as_index_groups(groups, n)
  return IndexedDataset(lambda idx: {k: v[idx] for k, v in arrays.items()},
                        index_groups, names)


def _name(value: Any) -> str:
  if isinstance(value, bytes):
    return value.decode('utf-8', errors='replace')
  return str(value.item() if isinstance(value, np.generic) else value)


def _as_index_groups(groups: Any, n: int) -> list[np.ndarray]:
  """Index groups from a list of index arrays or a per-example assignment."""
  if isinstance(groups, np.ndarray) and groups.ndim == 1 and groups.dtype != object:
    if groups.shape[0] != n:
      raise ValueError(f'groups has {groups.shape[0]} entries for {n} examples; a '
                       'per-example assignment needs one client index per example.')
    if not np.issubdtype(groups.dtype, np.integer) or (n and groups.min() < 0):
      raise ValueError('groups as a per-example assignment must hold ints >= 0; '
                       f'got dtype {groups.dtype}.')
    count = int(groups.max()) + 1 if n else 0
    order = np.argsort(groups, kind='stable')
    bounds = np.searchsorted(groups[order], np.arange(count + 1))
    out = [order[bounds[c]:bounds[c + 1]] for c in range(count)]
  else:
    out = [np.asarray(g, dtype=np.int64).reshape(-1) for g in groups]
  for c, g in enumerate(out):
    if g.size == 0:
      raise ValueError(f'groups: client {c} has no examples; every client needs '
                       'at least one.')
    if g.min() < 0 or g.max() >= n:
      raise ValueError(f'groups: client {c} has example indices outside '
                       f'[0, {n}) (min {g.min()}, max {g.max()}).')
  return out
