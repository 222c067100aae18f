"""A population held on the device once, so that a cohort is only an index.

:func:`on_device` reads every client of a :class:`FederatedDataset` once and
puts their examples on the device as one flat table per feature, client
``c``'s examples at rows ``offsets[c] .. offsets[c] + n_c - 1``. A cohort of
it (:func:`fedjx.datasets.make_cohort`, and so every cohort iterator and the
runner) is then ``batches = IndexedBatches(table, index)``
(:mod:`fedjx.indexed`): the same clients, shuffles, steps and mask as the
host cohort, but ``index[c, s, b]`` is the table row of the example that the
host cohort copies into ``batches[k][c, s, b]``. Per round the host builds
and moves ``5 C S B`` bytes (int32 index, bool mask) instead of the padded
``[C, S, B, ...]`` arrays, and each member of the round's client map gathers
its ``B`` rows per step on the device: the same numbers as the host cohort,
bit for bit.

On a CPU, rounds run one client per core: :func:`on_device` first splits
the CPU into one device per core (:func:`fedjx.distributed.split_cpu`)
where JAX has not started, and a round with no mesh set runs its cohort
over those devices by itself (:func:`fedjx.distributed.cpu_blocks`), as
``fedjx-run`` does; where JAX started on one CPU device, a one-line warning
says how to split it.

Memory: the table is the population's real data once (no padding), laid out
replicated on the mesh (every device may hold any client). It suits the
cross-device regime (many small clients, a small model), where the host
copies of padded cohorts cost more than the round; a population too large
for the device stays on the host (the runner's
``config.data_placement='auto'`` decides by :data:`AUTO_MAX_BYTES`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np
import tqdm
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjx import distributed
from fedjx.datasets.federated import (FederatedDataset, IndexedDataset,
                                      WrappedDataset, num_rows)

# Populations of at most this many bytes go on the device under the
# runner's ``config.data_placement='auto'`` (per backend: a CPU's "device" is host
# memory, so the table is only one more copy of the data).
AUTO_MAX_BYTES = {'cpu': 2 << 30, 'gpu': 4 << 30, 'tpu': 4 << 30}


class DeviceDataset(WrappedDataset):
  """``base`` with all of its examples on the device, rows per client.

  Reads of clients (``client_data``) still come from ``base``; cohorts
  (:func:`~fedjx.datasets.make_cohort`) index :attr:`table`.

  Attributes:
    table: dict of ``[N, ...]`` device arrays, every client's examples in
      client order.
    offsets: ``int64 [num_clients]``, the first row of each client.
  """

  def __init__(self, base: FederatedDataset, table: dict[str, jax.Array],
               offsets: np.ndarray):
    self._base = base
    self.table = table
    self.offsets = offsets

  def _client_data(self, cid: int) -> dict[str, np.ndarray]:
    return self._base.client_data(cid)

  def replicated(self, mesh: jax.sharding.Mesh) -> 'DeviceDataset':
    """The same population with its table laid out whole on every device of
    ``mesh`` (what :func:`on_device` does under that mesh)."""
    where = NamedSharding(mesh, P())
    return DeviceDataset(self._base, {k: jax.device_put(v, where)
                                      for k, v in self.table.items()}, self.offsets)

  def examples_per_client(self) -> np.ndarray:
    """``int64 [num_clients]``: every client's example count, from the rows."""
    return np.diff(np.append(self.offsets, self.total_examples)).astype(np.int64)

  @property
  def total_examples(self) -> int:
    """``N``, the examples of all clients (the table's rows)."""
    return int(next(iter(self.table.values())).shape[0])

  @property
  def nbytes(self) -> int:
    """Bytes of the table on each device that holds it."""
    return sum(int(v.size) * v.dtype.itemsize for v in self.table.values())

  def __repr__(self) -> str:
    return (f'DeviceDataset(num_clients={self.num_clients}, '
            f'examples={self.total_examples}, '
            f'nbytes={self.nbytes})')


def population_bytes(dataset: FederatedDataset) -> int:
  """Bytes :func:`on_device` would hold for ``dataset`` (reads one client)."""
  first = dataset.client_data(0)
  n0 = max(num_rows(first, where='client 0'), 1)
  row = sum(np.asarray(v).nbytes // n0 for v in first.values())
  return int(row * int(np.sum(dataset.examples_per_client())))


def fits_on_device(dataset: FederatedDataset) -> bool:
  """Whether ``config.data_placement='auto'`` would hold ``dataset`` on the
  device: its :func:`population_bytes` within :data:`AUTO_MAX_BYTES` for the
  default backend (a backend not listed takes the GPU's)."""
  limit = AUTO_MAX_BYTES.get(jax.default_backend(), AUTO_MAX_BYTES['gpu'])
  return population_bytes(dataset) <= limit


def on_device(dataset: FederatedDataset, mesh: jax.sharding.Mesh | None = None,
              progress: bool = False) -> DeviceDataset:
  """``dataset``'s examples on the device once: a :class:`DeviceDataset`.

  Where JAX has not started (and may make its CPU devices:
  :func:`fedjx.distributed.may_split_cpu`), the CPU is first split into one
  device per core, over which rounds of many small clients run by
  themselves (:func:`fedjx.distributed.cpu_blocks`); other backends are
  unaffected.

  Args:
    dataset: the population; every client must have the same features,
      per-example shapes and dtypes, and at least one example.
    mesh: lay the table out replicated over this mesh (default: the mesh set
      with ``jax.set_mesh``, if any; else the default device).
    progress: show a progress bar while the clients are read.

  Returns:
    A :class:`DeviceDataset` whose cohorts are index arrays into the table.
  """
  if isinstance(dataset, DeviceDataset):
    return dataset
  if not isinstance(dataset, FederatedDataset):
    raise ValueError(f'on_device: dataset={type(dataset).__name__!r}; it must '
                     'be a fedjx.datasets.FederatedDataset.')
  if distributed.may_split_cpu():
    distributed.split_cpu()
  elif _one_of_many_cores():
    warnings.warn(
        'on_device: JAX started on one CPU device, so each round runs on one '
        'core; call fedjx.distributed.split_cpu() (or datasets.on_device) '
        'before any other JAX work for one device per core (about 2x faster '
        'rounds of small models).', stacklevel=2)
  if isinstance(dataset, IndexedDataset):  # In memory: one gather, no loop.
    examples = dataset.all_examples()
    sizes = dataset.examples_per_client()
    num_rows(examples, where='on_device: the examples')
    return _placed(dataset, {k: np.asarray(v) for k, v in examples.items()},
                   sizes, mesh)
  ids = range(dataset.num_clients)
  if progress:
    ids = tqdm.tqdm(ids, desc='population to device', unit='client',
                    leave=False)
  parts: dict[str, list[np.ndarray]] = {}
  spec = None
  sizes = np.zeros(dataset.num_clients, np.int64)
  for cid in ids:
    data = dataset.client_data(cid)
    n = num_rows(data, where=f'client {cid}')
    if n < 1:
      raise ValueError(f'on_device: client {cid} ({dataset.client_name(cid)!r}) '
                       'has no examples; every client needs at least one.')
    got = {k: (np.shape(v)[1:], np.asarray(v).dtype) for k, v in data.items()}
    if spec is None:
      spec = got
    elif got != spec:
      raise ValueError(f'on_device: client {cid} has features {got} but client '
                       f'0 has {spec}; every client needs the same features, '
                       'per-example shapes and dtypes.')
    sizes[cid] = n
    for k, v in data.items():
      parts.setdefault(k, []).append(np.asarray(v))
  return _placed(dataset, {k: np.concatenate(v) for k, v in parts.items()},
                 sizes, mesh)


def _placed(dataset: FederatedDataset, examples: dict[str, np.ndarray],
            sizes: np.ndarray, mesh: Any) -> DeviceDataset:
  """The :class:`DeviceDataset` of ``examples`` (every client's, in client
  order; client ``c`` has ``sizes[c]``)."""
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
  if int(sizes.sum()) >= np.iinfo(np.int32).max:
    raise ValueError(f'on_device: {int(sizes.sum())} examples do not fit int32 '
                     'row indices; keep this population on the host.')
  mesh = _active(mesh)
  where = None if mesh is None else NamedSharding(mesh, P())
  table = {k: jax.device_put(v, where) for k, v in examples.items()}
  return DeviceDataset(dataset, table, offsets)


def _one_of_many_cores() -> bool:
  """Whether JAX runs on one CPU device (of one process) that the user did
  not ask for, on a machine of several cores."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else 1
  return (cores > 1 and jax.default_backend() == 'cpu' and
          jax.process_count() == 1 and len(jax.devices('cpu')) == 1 and
          jax.config.jax_num_cpu_devices < 0 and
          'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''))


def _active(mesh: Any) -> Any:
  if mesh is None:
    mesh = jax.sharding.get_mesh()
    if mesh is None or getattr(mesh, 'empty', False):
      return None
  return mesh


__all__ = ['AUTO_MAX_BYTES', 'DeviceDataset', 'fits_on_device', 'on_device', 'population_bytes']
