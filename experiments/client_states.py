"""A run's per-client state on the host: its :class:`fedjx.ClientStore`.

An algorithm whose clients keep state between rounds
(``Algorithm.client_state_init`` set: SCAFFOLD under
``config.client_state.placement='store'``, FedRep's heads, Ditto's personal
models) gets one store for the run (:func:`make_store`): ``N`` rows, the
population's, of which only the clients that have trained hold an entry.
The runner (:mod:`fedjx.experiments.run_trainer`):

* before a round, attaches the cohort's rows as of that round
  (:func:`attach`: ``store.read(cohort.client_ids)``, placed like the
  cohort's arrays; a streamed round reads them chunk by chunk into host
  memory reused from round to round, and stages its new rows in the store
  chunk by chunk as they reach the host, ``store.stage``);
* after the round is accepted (past the non-finite guard), writes the rows
  the round returned, or commits the staged ones (:func:`write_back`); a
  round redone guarded writes once, the redone rows;
* at every checkpoint of step ``s``, saves the store as step ``s`` before
  the checkpoint is started (``store.save``: the rows written since the last
  save), so a checkpoint on disk always has its store step;
* on resumption, and on the fall back to an older checkpoint when the newest
  is damaged, restores the store to the step actually restored.

A store is one process's: a multi-process run keeps per-client state on the
devices instead (:func:`for_processes` turns ``placement='store'`` into
``'device'`` for an algorithm that offers a dense placement, SCAFFOLD) and
refuses an algorithm whose rows live only in a store.

``docs/client_state.md`` ("In the runner") gives the guarantees.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from fedjx import client_store as client_store_lib
from fedjx import streaming
from fedjx.experiments import registry
from fedjx.experiments.config import ConfigError


def directory(config: Any, workdir: str) -> str:
  """``config.client_state.directory``, or ``<workdir>/client_states``."""
  return config.client_state.directory or os.path.join(workdir, 'client_states')


def for_processes(config: Any, workdir: str, log: Any) -> Any:
  """``config`` with its placement resolved: ``'auto'`` made the algorithm's
  (:func:`fedjx.experiments.registry.resolve_placement`), so the workdir's
  config and checkpoints name where the rows live, and ``'device'`` where a
  store cannot serve the run.

  A :class:`fedjx.ClientStore` holds its rows in one process's memory and
  files, while a cohort's clients are drawn afresh each round and land on
  whichever process's devices hold their slot: the row a client reads may
  have been written by another process. In a multi-process run
  (``jax.process_count() > 1``) an algorithm whose registry entry offers a
  dense placement (SCAFFOLD's ``client_state='dense'``) therefore keeps its
  per-client state in the server state, sharded over the mesh like the rest
  of it, and the run says so in one line. The config returned (and saved as
  the workdir's ``config.json``) names ``'device'``; a later single-process
  run in a workdir whose ``config.json`` names ``'device'`` keeps it, so the
  workdir resumes under any process layout. Other algorithms are left as
  they are (:func:`make_store` refuses them in a multi-process run).
  """
  resolved = registry.resolve_placement(config.algorithm.name,
                                       config.client_state.placement)
  if resolved != config.client_state.placement:
    config = config.copy_and_resolve_references()
    with config.unlocked():
      config.client_state.placement = resolved
  if resolved != 'store':
    return config
  option = registry.algorithm_traits(config.algorithm.name).client_state
  if option is None or option in config.algorithm:
    return config
  if jax.process_count() > 1:
    why = (f'a run of {jax.process_count()} processes has no host store '
           "(placement='store' is for single-process runs)")
  else:
    try:
      with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
        saved = json.load(f).get('client_state', {}).get('placement')
    except (OSError, ValueError, AttributeError):
      saved = None
    if saved != 'device':
      return config
    why = f"the run in {workdir} keeps it there (its config.json)"
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.client_state.placement = 'device'
  log(f'fedjx: config.algorithm.name={config.algorithm.name!r} keeps its '
      "per-client state on the devices (config.client_state.placement='device'): "
      f'{why}.')
  return config


def make_store(config: Any, algorithm: Any, init_params: Any, num_clients: int,
               workdir: str) -> client_store_lib.ClientStore | None:
  """The run's store, or None for an algorithm without per-client state."""
  init = getattr(algorithm, 'client_state_init', None)
  if init is None:
    return None
  if jax.process_count() > 1:
    raise ConfigError(
        f'config.algorithm.name={config.algorithm.name!r} keeps its per-client '
        'state only in a host store (config.client_state.placement='
        f"{config.client_state.placement!r}), which serves single-process runs; "
        f'this run has {jax.process_count()} processes: run it on one process, '
        "or choose an algorithm that offers placement='device' (scaffold).")
  initial = jax.tree.map(np.asarray, jax.device_get(init(init_params)))
  budget = int(config.client_state.memory_budget_mb * 2**20)
  return client_store_lib.ClientStore(initial, num_clients,
                                      directory=directory(config, workdir),
                                      memory_budget_bytes=budget)


def attach(store: client_store_lib.ClientStore | None, cohort: Any,
           scratch: dict[int, Any] | None = None) -> Any:
  """``cohort`` with its clients' rows as ``client_states``, placed like it.

  A streamed cohort (a ``fedjx.streaming.Clients``) reads its rows chunk by
  chunk with its data, as each chunk loads (into ``scratch``'s arrays, kept
  by the caller from round to round, when given), and stages the round's
  new rows in ``store`` chunk by chunk (:func:`write_back` commits them).
  """
  if store is None:
    return cohort
  if isinstance(cohort, streaming.Clients):
    return with_rows(store, cohort, scratch).with_keep(_stage(store))
  ids = np.asarray(jax.device_get(cohort.client_ids))
  rows = store.read(ids)
  sharding = getattr(cohort.mask, 'sharding', None)
  rows = (jax.device_put(rows, sharding) if isinstance(cohort.mask, jax.Array)
          else rows)
  return cohort._replace(client_states=rows)


def with_rows(store: client_store_lib.ClientStore, clients: streaming.Clients,
              scratch: dict[int, Any] | None = None) -> streaming.Clients:
  """``clients`` whose every chunk carries its clients' rows from ``store``,
  read into ``scratch[chunk length]`` (allocated on first use) when given."""
  def load(chunk):
    part = clients.load(chunk)
    ids = np.asarray(part.client_ids)
    out = None
    if scratch is not None:
      out = scratch.get(len(ids))
      if out is None:
        out = scratch[len(ids)] = jax.tree.map(
            lambda s: np.empty((len(ids),) + s.shape, s.dtype), store.row_spec)
    return part._replace(client_states=store.read(ids, out=out))

  # The row's shapes, not store.initial: a copy of a row (1.17 GB for a
  # 180M replica's AdamW state) each round.
  spec = clients.spec._replace(client_states=store.row_spec)
  return streaming.Clients(clients.client_ids, load, spec)


def _stage(store: client_store_lib.ClientStore):
  """``keep(ids, outputs)`` for a streamed round ``(state, metrics, rows)``:
  stages each chunk's new ``rows`` in ``store``."""
  def keep(ids, outputs):
    *rest, rows = outputs
    if jax.tree.leaves(rest):
      raise ValueError('a store-backed round returns per-client values besides '
                       'its rows (state, metrics, rows); only the rows may be '
                       'per-client.')
    store.stage(np.asarray(ids), rows)
  return keep


def write_back(store: client_store_lib.ClientStore | None, cohort: Any,
               rows: Any) -> None:
  """Writes a round's new ``rows`` (cohort order) for ``cohort``'s clients;
  rows with no arrays (a streamed round returns None for each) commit the
  rows it staged."""
  if store is None:
    return
  if not jax.tree.leaves(rows):
    store.commit()
    return
  store.discard()
  ids = np.asarray(jax.device_get(cohort.client_ids))
  store.write(ids, jax.tree.map(np.asarray, jax.device_get(rows)))


class StoreSteps:
  """The store's saves as the loop makes them: each step once, in order."""

  def __init__(self, store: client_store_lib.ClientStore | None):
    self.store = store
    self.saved: int | None = None

  def save(self, step: int) -> None:
    if self.store is not None and step != self.saved:
      self.store.save(step)
      self.saved = step

  def restore(self, step: int, workdir: str) -> None:
    """The store as of saved ``step`` (that of the checkpoint restored)."""
    if self.store is None:
      return
    try:
      self.store.restore(step)
    except (ValueError, OSError) as e:
      raise ConfigError(
          f'{workdir}: the per-client state of the checkpoint of step {step} '
          f'cannot be restored ({" ".join(str(e).split())}); start over with '
          '--fresh (or delete the workdir).') from None
    self.saved = step
