"""An algorithm's rounds as the pieces a deployment runs, independent of any engine.

The server side (:class:`ServerRounds`) splits an algorithm's round with
``fedjx.export.split_round`` into

* ``server_prepare(state, key) -> (to_clients, placed, residuals)``,
* ``client_work(to_clients, placed_i, cohort_i) -> outputs_i`` (one client;
  shipped to nodes as :mod:`fedjx.deploy.programs` bytes),
* the aggregations (``sum``, ``mean``, ``weighted_mean`` over the clients
  that replied, in NumPy with 64-bit accumulators), and
* ``server_update(residuals, aggregates) -> (state', metrics)``.

Whatever an aggregator encodes per client (the clipping of DP-FedAvg's
Gaussian aggregator, a compressor's quantization) is client work, so it
runs on the node; the server receives only ``outputs_i``.

The node side (:class:`NodeData`, :func:`run_client`) needs the data and
JAX only: a node holds its own client ``c = partition-id`` of the same
population, batched as the simulation batches it
(``datasets.prefetch.Batching``): client ``c``'s batches of round ``r`` are
the rows of the simulated cohort.

Round ``r`` (from 0) trains the cohort ``CohortSampler(population,
cohort_size, seed).sample(r)``; its step count ``S`` is computed on the
server from the clients' example counts (``Batching.steps``), so the server
holds the population too (it reads sizes only to shape the round).

An experiment config's rounds (the algorithm, model and dataset a config
names, as ``fedjx-run`` builds them) are the experiments layer's
(``docs/deploy.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fedjx import datasets
from fedjx.datasets import prefetch
from fedjx.deploy import programs
from fedjx.interpreters import export

__all__ = ['NodeData', 'ServerRounds', 'SplitPieces', 'as_shape', 'flat_state',
           'run_client', 'scalars']


class NodeData:
  """A node's own client: client ``partition_id`` of the training population.

  Args:
    train: the training population (a ``fedjx.datasets`` federated dataset),
      built on the node exactly as the server built it.
    batching: the batching of the simulated rounds (``datasets.prefetch.Batching``).
    seed: the seed of every client's per-round example shuffle.
    partition_id: the node's ``partition-id`` (its client id).
    num_partitions: the node's ``num-partitions``; it must equal the
      population size, so that node and server number the same clients.
  """

  def __init__(self, train: Any, batching: prefetch.Batching, seed: int,
               partition_id: int, num_partitions: int):
    self.train, self.batching, self.seed = train, batching, int(seed)
    n = self.train.num_clients
    if int(num_partitions) != n:
      raise ValueError(
          f'node config num-partitions={num_partitions}, but the dataset has {n} '
          f'training clients; give every node num-partitions={n} (or set the '
          f'dataset to {num_partitions} clients).')
    if not 0 <= int(partition_id) < n:
      raise ValueError(f'node config partition-id={partition_id}; it must be '
                       f'in [0, {n}) (num-partitions={n}).')
    self.partition_id = int(partition_id)

  def inputs(self, round_num: int, steps: int) -> list[np.ndarray]:
    """The flat leaves of this client's row of round ``round_num``'s cohort
    (``batches``, ``mask``, ``num_examples``, ``client_ids``), ``S = steps``."""
    cohort = self.batching.cohort(self.train, [self.partition_id], self.seed,
                                  round_num, steps=steps)
    return [np.asarray(x)[0] for x in jax.tree.leaves(cohort)]


def run_client(program: programs.Program, to_clients: Sequence[Any],
               placed: Sequence[Any], inputs: Sequence[Any]) -> list[np.ndarray]:
  """Runs ``client_work`` on one client: ``outputs_i`` as NumPy arrays.

  64-bit NumPy inputs are taken as JAX takes them (int32 and float32
  without ``jax_enable_x64``).

  Raises:
    ValueError: the arrays do not have the shapes and dtypes the program
      was exported for (the first mismatch is named).
  """
  avals = program.exported.in_avals
  args = list(to_clients) + list(placed) + list(inputs)
  if len(args) != len(avals):
    raise ValueError(f'fedjx.deploy: client_work takes {len(avals)} arrays, got '
                     f'{len(args)} ({len(to_clients)} from the server, '
                     f'{len(placed)} placed, {len(inputs)} of local data).')
  args = [_as_exported(as_shape(a, aval.shape), aval) for a, aval in zip(args, avals)]
  for i, (a, aval) in enumerate(zip(args, avals)):
    got = (tuple(np.shape(a)), np.dtype(np.asarray(a).dtype))
    if got != (tuple(aval.shape), np.dtype(aval.dtype)):
      raise ValueError(f'fedjx.deploy: client_work input {i} has shape/dtype '
                       f'{got}; the program was exported for '
                       f'{(tuple(aval.shape), np.dtype(aval.dtype))}.')
  return [np.asarray(o) for o in program.exported.call(*args)]


def _as_exported(x: np.ndarray, aval: Any) -> np.ndarray:
  """``x`` in the aval's dtype when JAX would have converted it so (NumPy's
  int64 and float64 are int32 and float32 without ``jax_enable_x64``)."""
  if x.dtype != aval.dtype and jax.dtypes.canonicalize_dtype(x.dtype) == aval.dtype:
    return x.astype(aval.dtype)
  return x


def as_shape(x: Any, shape: Sequence[int]) -> np.ndarray:
  """``x`` as an array of ``shape`` when it has that many elements (a
  transport may carry a scalar as ``[1]``), else unchanged."""
  x = np.asarray(x)
  return x.reshape(shape) if x.size == int(np.prod(shape)) else x


@dataclasses.dataclass
class SplitPieces:
  """One exported round shape: the split round and its client program bytes."""

  split: Any  # fedjx.export.SplitRound
  client_program: bytes
  steps: int

  @property
  def digest(self) -> str:
    return programs.read_header(self.client_program)[0]['sha256']


class ServerRounds:
  """The server's side of an algorithm's deployed rounds.

  Round ``r`` trains the cohort ``CohortSampler(train, cohort_size,
  seed).sample(r)`` with the round key ``key_for(r)``, as a simulation of
  the same algorithm does. Algorithms that collect per-client values
  (per-client state, as SCAFFOLD) are refused by :meth:`pieces`.

  Args:
    algorithm: a ``fedjx.algorithms.Algorithm`` (its ``init`` and ``apply``).
    params: the initial model.
    train: the training population (a ``fedjx.datasets`` federated dataset).
    batching: the clients' batching (``datasets.prefetch.Batching``).
    cohort_size: clients a round.
    seed: the cohort sampler's seed and every client's shuffle seed.
    key_for: ``r -> key`` of round ``r``.
    name: the algorithm's name, for errors.
  """

  def __init__(self, algorithm: Any, params: Any, train: Any,
               batching: prefetch.Batching, *, cohort_size: int, seed: int,
               key_for: Callable[[int], jax.Array], name: str = 'algorithm'):
    self.algorithm, self.params, self.train = algorithm, params, train
    self.batching, self.cohort_size, self.seed = batching, int(cohort_size), int(seed)
    self.key_for, self.name = key_for, name
    self.sampler = datasets.CohortSampler(train, self.cohort_size, self.seed)
    self._pieces: dict[int, SplitPieces] = {}

  @property
  def num_clients(self) -> int:
    """The population: the ``num-partitions`` every node must have."""
    return self.train.num_clients

  def initial_state(self) -> Any:
    return self.algorithm.init(self.params)

  def cohort(self, round_num: int) -> tuple[np.ndarray, int]:
    """``(client ids, S)`` of round ``round_num``."""
    ids = self.sampler.sample(round_num)
    return ids, self.batching.steps(self.train, ids)

  def pieces(self, state: Any, steps: int) -> SplitPieces:
    """The round split for cohorts of ``steps`` steps (exported once per ``S``)."""
    if steps not in self._pieces:
      ids = self.sampler.sample(0)
      one = self.batching.cohort(self.train, ids[:1], self.seed, 0, steps=steps)
      size = self.cohort_size
      cohort = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct((size,) + np.shape(x)[1:], np.asarray(x).dtype),
          one)
      key = jax.random.key_data(self.key_for(0))
      algorithm = self.algorithm

      def apply(state, cohort, key_data):
        return algorithm.apply(state, cohort, jax.random.wrap_key_data(key_data))

      split = export.split_round(apply, state, cohort, key, client_args=(1,))
      collected = [a for a in split.aggregations if a.op == 'collect']
      if collected:
        raise ValueError(
            f'fedjx.deploy: algorithm {self.name!r} collects '
            'per-client values (per-client state); deployed rounds aggregate '
            "with 'sum', 'mean' and 'weighted_mean' only.")
      self._pieces[steps] = SplitPieces(
          split, programs.pack(split.client_work, 'client_work'), steps)
    return self._pieces[steps]

  def prepare(self, pieces: SplitPieces, state: Any, round_num: int
              ) -> tuple[list[np.ndarray], list[np.ndarray], list[Any]]:
    """``server_prepare``: ``(to_clients, placed, residuals)``, NumPy for the
    first two (they go on the wire)."""
    key = jax.random.key_data(self.key_for(round_num))
    to_clients, placed, residuals = pieces.split.prepare(
        list(jax.tree.leaves(state)) + [key])
    return ([np.asarray(x) for x in to_clients], [np.asarray(x) for x in placed],
            residuals)

  def update(self, pieces: SplitPieces, residuals: Sequence[Any],
             outputs: Sequence[Sequence[Any]]) -> tuple[Any, dict[str, Any]]:
    """Aggregates the replied clients' ``outputs`` and runs ``server_update``:
    ``(state', metrics)``. ``outputs`` must hold at least one client."""
    if not outputs:
      raise ValueError('fedjx.deploy: no client replied; there is nothing to '
                       'aggregate.')
    avals = pieces.split.client_work.out_avals
    outputs = [[as_shape(x, a.shape) for x, a in zip(outs, avals)] for outs in outputs]
    aggregates = pieces.split.aggregate(outputs)
    outs = pieces.split.server_update.call(*residuals, *aggregates)
    state, metrics = jax.tree.unflatten(pieces.split.out_tree, list(outs))
    return state, metrics


def flat_state(state: Any) -> list[np.ndarray]:
  """The state's leaves as NumPy arrays (what a checkpoint-free server sends)."""
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  """A round's metrics as Python floats."""
  return {k: float(np.asarray(v)) for k, v in metrics.items() if np.size(v) == 1}
