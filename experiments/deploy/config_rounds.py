"""An experiment config's rounds as the pieces a deployment runs.

The server side (:class:`ExperimentRounds`) builds the experiment a config
names, exactly as ``fedjx-run`` does (``fedjx.experiments.experiment.build``:
the same algorithm, initial model, round keys ``fold_in(round_key, r)`` and
cohort sampler), and splits its round as
:class:`fedjx.deploy.rounds.ServerRounds` does.

A node builds its own client ``c = partition-id`` from the
:class:`DataSpec` the server sends (the config's dataset, seed and batching)
with the same builder the config names (``registry.build_dataset``)
(:meth:`DataSpec.node_data`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any

from fedjx.datasets import prefetch
from fedjx.deploy import rounds
from fedjx.experiments import cli
from fedjx.experiments import config as config_lib
from fedjx.experiments import experiment
from fedjx.experiments import registry

__all__ = ['DataSpec', 'ExperimentRounds', 'load_config', 'node_data']


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

  def node_data(self, partition_id: int, num_partitions: int) -> rounds.NodeData:
    """Client ``partition_id`` of the spec's training set, built with the
    builder the dataset names."""
    train = registry.build_dataset(self.dataset, self.seed).train
    try:
      return rounds.NodeData(train, self.batching, self.seed, partition_id,
                             num_partitions)
    except ValueError as e:
      raise ValueError(f'dataset {self.dataset.get("name")!r}: {e}') from None


def node_data(spec: str, partition_id: int, num_partitions: int) -> rounds.NodeData:
  """A node's client from the :class:`DataSpec` JSON the server sent."""
  return DataSpec.from_json(spec).node_data(partition_id, num_partitions)


class ExperimentRounds(rounds.ServerRounds):
  """The server's side of an experiment config's deployed rounds.

  Args:
    config: an experiment config (``ml_collections.ConfigDict``), as
      ``fedjx-run`` takes it. Synchronous algorithms with uniform cohort
      sampling are supported; asynchronous algorithms, ``config.systems``,
      ``config.sampling`` and algorithms that collect per-client values
      (per-client state, as SCAFFOLD) are refused with an error naming the
      field.
  """

  def __init__(self, config: Any):
    self.config = config_lib.validate(config)
    self.exp = exp = experiment.build(self.config)
    for field, value in (('systems', exp.systems), ('sampling', exp.sampler),
                         ('algorithm (asynchronous)', exp.scheduler)):
      if value is not None:
        raise ValueError(
            f'fedjx.deploy: config.{field} is set; deployed rounds sample '
            'cohorts uniformly (CohortSampler) from the nodes that are '
            'connected, and their failures are real ones: unset it.')
    self.spec = DataSpec.from_config(self.config)
    super().__init__(exp.algorithm, exp.init_params, exp.data.train,
                     self.spec.batching, cohort_size=self.config.cohort_size,
                     seed=self.config.seed, key_for=exp.round_key_for,
                     name=self.config.algorithm.name)


def _literal(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def load_config(spec: str, overrides: str = '') -> Any:
  """The fedjx config of file ``spec`` with ``overrides`` (``"a.b=v c=w"``,
  each value a Python literal, else a string) set, validated."""
  config = cli.load_config_file(spec)
  extras = []
  for item in overrides.split():
    path, sep, value = item.partition('=')
    if not sep or not path:
      raise ValueError(f'fedjx.deploy: override {item!r} is not '
                       "'path=value' (e.g. 'rounds=3 dataset.num_clients=3').")
    extras.append((tuple(path.split('.')), _literal(value)))
  return config_lib.validate(cli.apply_overrides(config, extras))
