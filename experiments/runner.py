"""The training loop: config in, trained model, metrics, checkpoints and plot out.

:func:`run` builds the dataset, model and algorithm that a config names (see
:mod:`fedjx.experiments.registry`) and trains for ``config.rounds`` rounds:

* round ``r`` (numbered from 0) trains on the cohort ``sampler.sample(r)``
  with the key ``fold_in(round_key, r)``, where ``round_key`` comes from
  ``config.seed``: everything random in a round is a function of
  ``(seed, r)``, so a resumed run repeats the uninterrupted one exactly;
* after round ``r`` the step is ``r + 1`` (rounds completed); metrics of that
  step go to ``workdir/metrics.jsonl`` (or ``.csv``) and TensorBoard;
* every ``eval_every`` steps (and at steps 0 and ``rounds``) the server model
  is evaluated on held-out data (``eval_loss``, ``eval_accuracy``);
* every ``checkpoint_every`` steps (and at the end, and on SIGINT or
  SIGTERM) an Orbax checkpoint holds the algorithm state, the step and the
  data position (:mod:`fedjx.experiments.data_position`); a
  save runs in the background during the next round, which waits for it
  before its metrics are written, so a crash redoes at most
  ``checkpoint_every`` rounds;
* after every round the server parameters are checked to be finite
  (``config.nonfinite``), inside the round's compiled program: a non-finite
  state, or a round in which every client's update was non-finite (nothing
  to aggregate), stops the run with :class:`NonFiniteError` and is never
  checkpointed. Non-finite clients are skipped by the algorithms' guard;
  synchronous algorithms run each round without it first and redo a round
  with it only when the result is not finite
  (:mod:`fedjx.experiments.guarded_rounds`);
* at the end ``workdir/learning_curve.png`` plots the metrics.

Starting again with the same workdir resumes from the newest intact
checkpoint (see :mod:`fedjx.experiments.checkpointing`), unless its data
position differs from the data now configured (one line,
:class:`fedjx.experiments.checkpointing.DataPositionMismatch`). One process at a
time may run in a workdir (:mod:`fedjx.experiments.workdir_lock`). Only
process 0 writes metrics and plots.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections

from fedjx import distributed
from fedjx.experiments import checkpointing
from fedjx.experiments import client_states
from fedjx.experiments import compilation_cache
from fedjx.experiments import config as config_lib
from fedjx.experiments import data_position
from fedjx.experiments import experiment
from fedjx.experiments import lora_setup
from fedjx.experiments import processes
from fedjx.experiments import run_trainer
from fedjx.experiments import workdir as workdir_lib
from fedjx.experiments import workdir_lock

__all__ = ['build_experiment', 'load_state', 'run']


def run(config: Any, workdir: str, *, hooks: Sequence[run_trainer.Hook] = (),
        log: Callable[[str], None] | None = None) -> run_trainer.RunResult:
  """Trains the experiment of ``config`` in ``workdir``, resuming if possible.

  Args:
    config: an ``ml_collections.ConfigDict`` (or dict) with ``dataset``,
      ``model``, ``algorithm`` and the fields of
      :data:`fedjx.experiments.config.DEFAULTS`.
    workdir: where checkpoints, metrics, event files and the plot go. If it
      holds a checkpoint of the same experiment, training continues from it.
    hooks: ``hook(step, state, row)`` called after every round (after its
      metrics are written and any checkpoint is started).
    log: where to print one-line messages (default: stderr on process 0).

  Returns:
    A :class:`fedjx.experiments.run_trainer.RunResult`.
  """
  config = config_lib.validate(config)
  processes.check_coordinator_port(config)
  split = processes.split_cpu(config)
  try:
    distributed.initialize(config.coordinator_address or None, config.num_processes,
                           config.process_id, timeout_s=config.coordinator_timeout_s)
  except distributed.CoordinatorError as e:
    raise config_lib.ConfigError(str(e)) from None
  lead = jax.process_index() == 0
  if log is None:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if lead else (
        lambda msg: None)
  # A refused run (an error before it writes anything) removes the workdir
  # it made.
  with workdir_lib.made(workdir, clean=jax.process_count() == 1) as workdir:
    config = client_states.for_processes(config, workdir, log)
    try:
      compilation_cache.enable(config.compilation_cache, workdir)
    except ValueError as e:
      raise config_lib.ConfigError(str(e)) from None
    # config.mesh='auto' is resolved once the model is built (in _run).
    mesh = None if config.mesh == 'auto' else processes.make_mesh(config)
    with contextlib.ExitStack() as stack:
      if lead:
        stack.enter_context(workdir_lock.hold(workdir))
      if mesh is not None:
        stack.enter_context(jax.set_mesh(mesh))
      return _run(config, workdir, hooks, log, lead, split, stack)


def _run(config: ml_collections.ConfigDict, workdir: str,
         hooks: Sequence[run_trainer.Hook], log: Callable[[str], None],
         lead: bool, split: int, stack: contextlib.ExitStack
         ) -> run_trainer.RunResult:
  """The body of :func:`run`, inside the mesh context if there is one."""
  exp = build_experiment(config, split, log, stack)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                    max_to_keep=max(2, config.checkpoints_to_keep),
                                    position=data_position.of_experiment(exp))
  try:
    trainer = run_trainer.RunTrainer(config, exp, workdir, log, lead, hooks, ckpt)
    result = trainer.train()
    if lead and not result.interrupted:  # config.lora.export's folders.
      for folder in lora_setup.export(config, exp.model, result.state.params, workdir):
        log(f'wrote {folder}')
    return result
  finally:
    ckpt.close()


def build_experiment(config: ml_collections.ConfigDict, split: int,
                     log: Callable[[str], None],
                     stack: contextlib.ExitStack) -> experiment.Experiment:
  """The experiment of ``config`` on the run's mesh (what :func:`run` trains).

  Called inside the mesh context of ``config.mesh``, if any. With
  ``config.mesh='auto'`` it resolves the mesh (``config.mesh`` is set to the
  choice), enters it on ``stack`` and lays the experiment on it; ``split``
  is the number of CPU devices :func:`fedjx.experiments.processes.split_cpu`
  made.
  """
  exp = experiment.build(config)
  if config.mesh == 'auto':
    # A large model's flops are measured on a sample batch; a small one needs none.
    batch = (None if processes.splits_model(exp.init_params)
             else experiment.sample_batch(config, exp.data))
    config.mesh = processes.auto_mesh(config, split, exp.init_params,
                                      exp.model.eval_loss_fn, batch)
    if config.mesh:
      log(f'the cohort runs over {split} CPU devices, one per core '
          "(config.mesh='auto'; '' keeps one device)")
      mesh = processes.make_mesh(config)
      stack.enter_context(jax.set_mesh(mesh))
      exp = experiment.on_mesh(exp, mesh)
  return exp


def load_state(workdir: str, step: int | None = None) -> tuple[Any, int]:
  """The algorithm state saved in ``workdir`` (latest step unless given).

  Rebuilds the experiment from ``workdir/config.json`` for the state's
  structure, then restores the checkpoint. Returns ``(state, step)``.
  """
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  exp = experiment.build(config)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'{workdir} holds no checkpoint.')
    like = exp.algorithm.init(exp.init_params)
    state, meta = ckpt.restore(step, like)
    expected = meta.get('checksum')
    if expected is not None and checkpointing.checksum(state) != expected:
      raise checkpointing.CheckpointError(
          f'the checkpoint of step {step} in {workdir} does not match its '
          'checksum (the files were altered or damaged).')
  finally:
    ckpt.close()
  return state, step
