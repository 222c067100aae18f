"""A fedjx experiment's rounds as the pieces a deployment runs.

The server side (:class:`ServerRounds`) builds the experiment a config
names, exactly as ``fedjx-run`` does (``fedjx.experiments.experiment.build``:
the same algorithm, initial model, round keys ``fold_in(round_key, r)`` and
cohort sampler), and splits its round with ``fedjx.export.split_round`` into

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
JAX only: a node builds its own client ``c = partition-id`` from the
:class:`DataSpec` the server sends (the config's dataset, seed and batching)
with the same builder the config names (``registry.build_dataset``) and the
same batching as the simulation (``datasets.prefetch.Batching``): client
``c``'s batches of round ``r`` are the rows of the simulated cohort.

Round ``r`` (from 0) trains the cohort ``CohortSampler(population,
cohort_size, seed).sample(r)``; its step count ``S`` is computed on the
server from the clients' example counts (``Batching.steps``), so the server
builds the dataset too (it reads sizes only to shape the round).
"""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fedjx import datasets
from fedjx.datasets import prefetch
from fedjx.deploy import programs

__all__ = ['DataSpec', 'NodeData', 'ServerRounds', 'SplitPieces', 'load_config',
           'run_client']


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """What a node needs to build its client's batches (plain JSON data).

  Attributes:
    dataset: ``config.dataset`` (``{'name': ..., **options}``).
    seed: ``config.seed``: the dataset's seed (if its builder takes one) and
      the seed of every client's per-round example shuffle.
    batch_size, num_epochs, num_steps, max_steps, bucket: the config's
      ``batch_size``, ``local_epochs``, ``local_steps``,
      ``max_local_steps`` and ``bucket_steps``.
  """

  dataset: dict[str, Any]
  seed: int
  batch_size: int
  num_epochs: int | None
  num_steps: int | None
  max_steps: int | None
  bucket: bool

  @classmethod
  def from_config(cls, config: Any) -> 'DataSpec':
    dataset = config.dataset
    dataset = dataset.to_dict() if hasattr(dataset, 'to_dict') else dict(dataset)
    return cls(json.loads(json.dumps(dataset)), int(config.seed),
               int(config.batch_size), config.local_epochs, config.local_steps,
               config.max_local_steps, bool(config.bucket_steps))

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> 'DataSpec':
    return cls(**json.loads(text))

  @property
  def batching(self) -> prefetch.Batching:
    return prefetch.Batching(self.batch_size, self.num_epochs, self.num_steps,
                             self.max_steps, shuffle=True, bucket=self.bucket)


class NodeData:
  """A node's own client: client ``partition_id`` of the spec's training set.

  Args:
    spec: the :class:`DataSpec` the server sent.
    partition_id: the node's ``partition-id`` (its client id).
    num_partitions: the node's ``num-partitions``; it must equal the
      population size, so that node and server number the same clients.
  """

  def __init__(self, spec: DataSpec, partition_id: int, num_partitions: int):
    from fedjx.experiments import registry  # pylint: disable=g-import-not-at-top
    self.spec = spec
    self.train = registry.build_dataset(spec.dataset, spec.seed).train
    n = self.train.num_clients
    if int(num_partitions) != n:
      raise ValueError(
          f'node config num-partitions={num_partitions}, but dataset '
          f'{spec.dataset.get("name")!r} has {n} training clients; give every '
          f'node num-partitions={n} (or set the dataset to {num_partitions} clients).')
    if not 0 <= int(partition_id) < n:
      raise ValueError(f'node config partition-id={partition_id}; it must be '
                       f'in [0, {n}) (num-partitions={n}).')
    self.partition_id = int(partition_id)

  def inputs(self, round_num: int, steps: int) -> list[np.ndarray]:
    """The flat leaves of this client's row of round ``round_num``'s cohort
    (``batches``, ``mask``, ``num_examples``, ``client_ids``), ``S = steps``."""
    cohort = self.spec.batching.cohort(self.train, [self.partition_id],
                                       self.spec.seed, round_num, steps=steps)
    return [np.asarray(x)[0] for x in jax.tree.leaves(cohort)]


def run_client(program: programs.Program, to_clients: Sequence[Any],
               placed: Sequence[Any], inputs: Sequence[Any]) -> list[np.ndarray]:
  """Runs ``client_work`` on one client: ``outputs_i`` as NumPy arrays.

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
  args = [as_shape(a, aval.shape) for a, aval in zip(args, avals)]
  for i, (a, aval) in enumerate(zip(args, avals)):
    got = (tuple(np.shape(a)), np.dtype(np.asarray(a).dtype))
    if got != (tuple(aval.shape), np.dtype(aval.dtype)):
      raise ValueError(f'fedjx.deploy: client_work input {i} has shape/dtype '
                       f'{got}; the program was exported for '
                       f'{(tuple(aval.shape), np.dtype(aval.dtype))}.')
  return [np.asarray(o) for o in program.exported.call(*args)]


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
  """The server's side of an experiment's deployed rounds.

  Args:
    config: an experiment config (``ml_collections.ConfigDict``), as
      ``fedjx-run`` takes it. Synchronous algorithms with uniform cohort
      sampling are supported; asynchronous algorithms, ``config.systems``,
      ``config.sampling`` and algorithms that collect per-client values
      (per-client state, as SCAFFOLD) are refused with an error naming the
      field.
  """

  def __init__(self, config: Any):
    from fedjx.experiments import config as config_lib  # pylint: disable=g-import-not-at-top
    from fedjx.experiments import experiment  # pylint: disable=g-import-not-at-top
    self.config = config_lib.validate(config)
    self.exp = experiment.build(self.config)
    exp = self.exp
    for field, value in (('systems', exp.systems), ('sampling', exp.sampler),
                         ('algorithm (asynchronous)', exp.scheduler)):
      if value is not None:
        raise ValueError(
            f'fedjx.deploy: config.{field} is set; deployed rounds sample '
            'cohorts uniformly (CohortSampler) from the nodes that are '
            'connected, and their failures are real ones: unset it.')
    self.spec = DataSpec.from_config(self.config)
    self.train = exp.data.train
    self.sampler = datasets.CohortSampler(self.train, self.config.cohort_size,
                                          self.config.seed)
    self._pieces: dict[int, SplitPieces] = {}

  @property
  def num_clients(self) -> int:
    """The population: the ``num-partitions`` every node must have."""
    return self.train.num_clients

  def initial_state(self) -> Any:
    return self.exp.algorithm.init(self.exp.init_params)

  def cohort(self, round_num: int) -> tuple[np.ndarray, int]:
    """``(client ids, S)`` of round ``round_num``."""
    ids = self.sampler.sample(round_num)
    return ids, self.spec.batching.steps(self.train, ids)

  def pieces(self, state: Any, steps: int) -> SplitPieces:
    """The round split for cohorts of ``steps`` steps (exported once per ``S``)."""
    if steps not in self._pieces:
      from fedjx.interpreters import export  # pylint: disable=g-import-not-at-top
      ids = self.sampler.sample(0)
      one = self.spec.batching.cohort(self.train, ids[:1], self.spec.seed, 0,
                                      steps=steps)
      size = self.config.cohort_size
      cohort = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct((size,) + np.shape(x)[1:], np.asarray(x).dtype),
          one)
      key = jax.random.key_data(self.exp.round_key_for(0))
      algorithm = self.exp.algorithm

      def apply(state, cohort, key_data):
        return algorithm.apply(state, cohort, jax.random.wrap_key_data(key_data))

      split = export.split_round(apply, state, cohort, key, client_args=(1,))
      collected = [a for a in split.aggregations if a.op == 'collect']
      if collected:
        raise ValueError(
            f'fedjx.deploy: algorithm {self.config.algorithm.name!r} collects '
            'per-client values (per-client state); deployed rounds aggregate '
            "with 'sum', 'mean' and 'weighted_mean' only.")
      self._pieces[steps] = SplitPieces(
          split, programs.pack(split.client_work, 'client_work'), steps)
    return self._pieces[steps]

  def prepare(self, pieces: SplitPieces, state: Any, round_num: int
              ) -> tuple[list[np.ndarray], list[np.ndarray], list[Any]]:
    """``server_prepare``: ``(to_clients, placed, residuals)``, NumPy for the
    first two (they go on the wire)."""
    key = jax.random.key_data(self.exp.round_key_for(round_num))
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


def _literal(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def load_config(spec: str, overrides: str = '') -> Any:
  """The fedjx config of file ``spec`` with ``overrides`` (``"a.b=v c=w"``,
  each value a Python literal, else a string) set, validated."""
  from fedjx.experiments import cli  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import config as config_lib  # pylint: disable=g-import-not-at-top
  config = cli.load_config_file(spec)
  extras = []
  for item in overrides.split():
    path, sep, value = item.partition('=')
    if not sep or not path:
      raise ValueError(f'fedjx.deploy: override {item!r} is not '
                       "'path=value' (e.g. 'rounds=3 dataset.num_clients=3').")
    extras.append((tuple(path.split('.')), _literal(value)))
  return config_lib.validate(cli.apply_overrides(config, extras))


def flat_state(state: Any) -> list[np.ndarray]:
  """The state's leaves as NumPy arrays (what a checkpoint-free server sends)."""
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  """A round's metrics as Python floats."""
  return {k: float(np.asarray(v)) for k, v in metrics.items() if np.size(v) == 1}
