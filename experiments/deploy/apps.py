"""An experiment config's rounds on Flower: the ServerApp and ClientApp that
``flwr run`` loads.

The fedjx Flower App (:mod:`fedjx.experiments.deploy.app_dir`) names
``server_app`` and ``client_app`` here. The rounds, their messages and
failures are :mod:`fedjx.deploy.flower`'s; this module adds what a run of a
config needs around them:

* the ServerApp reads its run config (:class:`Settings`), builds the
  config's experiment (:class:`~fedjx.experiments.deploy.config_rounds.ExperimentRounds`)
  and runs its rounds with a :class:`RunStrategy`;
* :class:`RunStrategy` writes what ``fedjx-run`` writes to the workdir
  (metrics with ``fedjx-run``'s writers, ``config.json``, Orbax checkpoints
  every ``config.checkpoint_every`` rounds) and ``deploy.jsonl`` (each
  round's sampled, replied, failed and lost clients), and resumes from the
  newest intact checkpoint of the same experiment;
* the ClientApp builds its node's client from the config's dataset
  (:func:`~fedjx.experiments.deploy.config_rounds.node_data`).

Stopping: a file ``workdir/deploy.stop`` (:data:`fedjx.deploy.flower.STOP_FILE`;
the launcher ``fedjx-deploy`` writes it on SIGTERM or Ctrl-C) or
SIGTERM/SIGINT to the ServerApp's process ends the run at once: the round
in flight is dropped and a checkpoint of the last complete round is saved,
from which the same run resumes.

Run config (``[tool.flwr.app.config]``, or ``flwr run --run-config``):
``config`` (a fedjx config file, ``path[:arg]``), ``overrides`` (``"a.b=v
c=w"``, values as Python literals), ``workdir``, ``timeout`` (seconds per
round), ``wait-s`` (seconds to wait for nodes), ``min-available-nodes``
(0: the cohort size).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid
from flwr.serverapp import ServerApp
from flwr.supercore import log

from fedjx.deploy import flower
from fedjx.experiments import checkpointing
from fedjx.experiments import config as config_schema
from fedjx.experiments import metrics_writers
from fedjx.experiments.deploy import app_dir
from fedjx.experiments.deploy import config_rounds

__all__ = ['RunStrategy', 'Settings', 'client_app', 'run_server', 'server_app']


@dataclasses.dataclass(frozen=True)
class Settings:
  """The ServerApp's run config (see the module docstring)."""

  config: str
  overrides: str = ''
  workdir: str = ''
  timeout: float = 120.0
  wait_s: float = 120.0
  min_available_nodes: int = 0

  @classmethod
  def from_run_config(cls, run_config: Mapping[str, Any]) -> 'Settings':
    known = app_dir.RUN_CONFIG_DEFAULTS
    unknown = sorted(set(run_config) - set(known))
    if unknown:
      raise ValueError(f'fedjx.deploy.flower: run config keys {unknown} are '
                       f'unknown; the keys are {sorted(known)}.')
    values = {k: type(v)(run_config.get(k, v)) for k, v in known.items()}
    if not values['config']:
      raise ValueError("fedjx.deploy.flower: run config 'config' is empty; give "
                       'a fedjx config file (e.g. config="/abs/configs/fedavg_digits.py").')
    return cls(values['config'], values['overrides'], values['workdir'],
               values['timeout'], values['wait-s'], values['min-available-nodes'])


class RunStrategy(flower.FedjxStrategy):
  """:class:`fedjx.deploy.flower.FedjxStrategy` over a config's rounds, with
  ``fedjx-run``'s workdir: metrics, ``config.json``, checkpoints (resumed
  from), and ``deploy.jsonl``.

  Args:
    server: the config's :class:`~fedjx.experiments.deploy.config_rounds.ExperimentRounds`.
    workdir: where metrics, checkpoints and ``deploy.jsonl`` go; empty for
      none (then the rows are kept in ``history`` only).
    timeout, min_available_nodes, wait_s: as the base class's.
  """

  def __init__(self, server: config_rounds.ExperimentRounds, workdir: str = '', *,
               timeout: float = 120.0, min_available_nodes: int = 0,
               wait_s: float = 120.0):
    config = self.config = server.config
    self.workdir = workdir
    super().__init__(
        server, server.spec.to_json(), num_rounds=config.rounds,
        evaluate=server.exp.evaluate, eval_every=config.eval_every,
        save_every=config.checkpoint_every,
        stop_file=os.path.join(workdir, flower.STOP_FILE) if workdir else '',
        timeout=timeout, min_available_nodes=min_available_nodes, wait_s=wait_s)
    self._writer = self._ckpt = None
    if not workdir:
      return
    os.makedirs(workdir, exist_ok=True)
    self._ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                            async_save=False)
    restored = self._ckpt.restore_latest_intact(
        self.state, self._check_same_experiment,
        warn=lambda msg: log(WARNING, 'fedjx: %s', msg))
    step = None
    if restored is not None:
      self.state, meta = restored
      step = self.start_round = self.step = int(meta['step'])
      log(INFO, 'fedjx: resuming %s from the checkpoint after round %d.',
          workdir, step)
    # Rows of rounds after the checkpoint (all, without one) are redone.
    self._truncate_details(step or 0)
    self._writer = metrics_writers.make_writer(
        workdir, config.metrics_format, config.tensorboard,
        resume_round=self.start_round if step is not None else None)
    metrics_writers.write_atomically(
        os.path.join(workdir, 'config.json'),
        config.to_json_best_effort(indent=2, sort_keys=True) + '\n')

  def save(self) -> None:
    """A checkpoint of the last complete round (``self.step``), if there is
    a workdir and that round is not the one checkpointed at the start."""
    if self._ckpt is None or (self.step == self.start_round
                              and self._ckpt.latest_step() == self.step):
      return
    self._ckpt.save(self.step, self.state, {
        'step': self.step, 'next_round': self.step, 'seed': self.config.seed,
        'config': _fingerprint(self.config)})
    self._ckpt.wait()

  def record(self, step: int, row: dict[str, Any], detail: dict[str, Any] | None
             ) -> None:
    """The row to ``history`` and the metrics writers, the detail to
    ``deploy.jsonl``."""
    super().record(step, row, detail)
    if self._writer is not None:
      self._writer.write(step, row)
      self._writer.flush()
      if detail is not None:
        with open(os.path.join(self.workdir, 'deploy.jsonl'), 'a', encoding='utf-8') as f:
          f.write(json.dumps(detail, sort_keys=True) + '\n')

  def on_stop(self) -> None:
    super().on_stop()
    log(WARNING, 'fedjx: %s holds the checkpoint after round %d: the same run '
        'resumes from it.', self.workdir or 'no workdir', self.step)

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
    if self._ckpt is not None:
      self._ckpt.close()

  def _check_same_experiment(self, meta: Mapping[str, Any]) -> None:
    """Refuses to resume a workdir whose checkpoint is of another experiment
    (fields that may change on resumption, as ``rounds``, left out)."""
    saved = meta.get('config')
    if not saved:
      return
    a, b = config_schema.flatten(saved), config_schema.flatten(_fingerprint(self.config))
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
      details = ', '.join(f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in diff[:8])
      raise ValueError(f'fedjx.deploy: {self.workdir} holds a checkpoint of a '
                       f'different experiment ({details}); use a new workdir.')

  def _truncate_details(self, step: int) -> None:
    """Drops ``deploy.jsonl``'s rounds after ``step`` (an interrupted run's)."""
    path = os.path.join(self.workdir, 'deploy.jsonl')
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        kept = [line for line in f if line.strip()
                and json.loads(line)['round'] < step]
      metrics_writers.write_atomically(path, ''.join(kept))


def _fingerprint(config: Any) -> dict[str, Any]:
  return json.loads(json.dumps(config_schema.fingerprint(config)))


def run_server(grid: Grid, settings: Settings) -> RunStrategy:
  """Runs ``settings.config``'s rounds over the grid's nodes; returns the
  strategy (its ``state`` and ``history``)."""
  config = config_rounds.load_config(settings.config, settings.overrides)
  strategy = RunStrategy(config_rounds.ExperimentRounds(config), settings.workdir,
                         timeout=settings.timeout,
                         min_available_nodes=settings.min_available_nodes,
                         wait_s=settings.wait_s)
  return flower.run(grid, strategy, settings.timeout)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
  """The ServerApp: a fedjx config's rounds (run config: see the module)."""
  # absl (imported by fedjx) gives the root logger a handler; Flower's logger
  # has its own, so its lines would print twice.
  logging.getLogger('flwr').propagate = False
  run_server(grid, Settings.from_run_config(context.run_config))


client_app = flower.client_app(config_rounds.node_data)
"""The ClientApp: client ``partition-id`` of the config's dataset."""
