"""A dataset's clients as the inputs of plan interpreters.

Beam (:class:`fedjx.interpreters.beam.ClientData`) and streaming
(:class:`fedjx.streaming.Clients`) read the clients' placed values with a
loader, so a cohort never has to be in one process's memory. These build
those loaders from a :class:`~fedjx.datasets.FederatedDataset`: client
``i``'s slice is ``make_cohort(dataset, [i], batch_size,
num_steps=num_steps, shuffle_seed=..., round_num=..., bucket=False)`` (the
same batches as the whole cohort made at once: each client's shuffling
depends only on ``(shuffle_seed, round_num, client_id)``). ``num_steps``
fixes every client's step count, so all clients (and chunks) have one shape.

They live here, not in ``fedjx/``, because the interpreters sit below the
dataset layer and do not import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fedjx import streaming
from fedjx.datasets.cohort import make_cohort


class CohortLoader:
  """``loader(client_ids)``: the cohort of those clients, batched where it runs.

  Picklable (Beam ships it to its workers) as long as the dataset is.
  """

  def __init__(self, dataset: Any, batch_size: int, num_steps: int,
               shuffle_seed: int | None = 0, round_num: int = 0):
    self.dataset = dataset
    self.batch_size = batch_size
    self.num_steps = num_steps
    self.shuffle_seed = shuffle_seed
    self.round_num = round_num

  def __call__(self, client_ids: Sequence[Any]) -> Any:
    return make_cohort(self.dataset, np.asarray(client_ids, np.int32),
                       self.batch_size, num_steps=self.num_steps,
                       shuffle_seed=self.shuffle_seed, round_num=self.round_num,
                       bucket=False)


class _OneClient:
  """``load(client_id)``: one client's slice of :class:`CohortLoader`'s cohort."""

  def __init__(self, cohorts: CohortLoader):
    self.cohorts = cohorts

  def __call__(self, client_id: Any) -> Any:
    return jax.tree.map(lambda a: np.asarray(a)[0], self.cohorts([client_id]))


def _spec(tree: Any) -> Any:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                      tree)


def _check(fn: str, client_ids: Sequence[Any], num_steps: Any) -> list[Any]:
  client_ids = list(client_ids)
  if not client_ids:
    raise ValueError(f'fedjx.datasets.{fn}: client_ids is empty; give at least '
                     'one client id.')
  if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) \
      or num_steps < 1:
    raise ValueError(f'fedjx.datasets.{fn}: num_steps={num_steps!r}; it must be '
                     'a positive int (every client is batched to that many steps).')
  return client_ids


def beam_client_data(dataset: Any, client_ids: Sequence[int], batch_size: int,
                     num_steps: int, *, shuffle_seed: int | None = 0,
                     round_num: int = 0) -> Any:
  """The clients ``client_ids`` of ``dataset`` as a Beam ``ClientData``.

  Each Beam worker batches its own client (:class:`CohortLoader`), so
  client data is read inside the pipeline. Needs the ``beam`` extra.

  Returns:
    A :class:`fedjx.interpreters.beam.ClientData` whose ``i``-th client is
    ``client_ids[i]``.
  """
  client_ids = _check('beam_client_data', client_ids, num_steps)
  from fedjx.interpreters import beam  # deferred: optional dependency apache_beam
  load = _OneClient(CohortLoader(dataset, batch_size, num_steps, shuffle_seed,
                                 round_num))
  return beam.ClientData(client_ids, load, _spec(load(client_ids[0])))


def streaming_clients(dataset: Any, client_ids: Sequence[int], batch_size: int,
                      num_steps: int, *, shuffle_seed: int | None = 0,
                      round_num: int = 0) -> Any:
  """The clients ``client_ids`` of ``dataset`` as streaming ``Clients``.

  :func:`fedjx.streaming.run` batches them a chunk at a time
  (:class:`CohortLoader`), never the whole cohort at once.

  Returns:
    A :class:`fedjx.streaming.Clients` whose ``i``-th client is
    ``client_ids[i]``.
  """
  client_ids = _check('streaming_clients', client_ids, num_steps)
  load = CohortLoader(dataset, batch_size, num_steps, shuffle_seed, round_num)
  first = jax.tree.map(lambda a: np.asarray(a)[0], load(client_ids[:1]))
  return streaming.Clients(client_ids, load, _spec(first))
