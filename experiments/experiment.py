"""An experiment built from its config: data, model, algorithm, evaluator, schedule.

:func:`build` turns a validated config into an :class:`Experiment`: the
training and test populations (:mod:`fedjx.experiments.registry`), the model
and its initial parameters (from ``config.seed``), the algorithm, the
evaluator, and what decides each round's clients (``config.sampling`` and
its privacy accounting plan, ``config.systems``'s system model, or an
asynchronous algorithm's schedule). Nothing here trains or writes; the
runner (:mod:`fedjx.experiments.runner`) and the sweep
(:mod:`fedjx.experiments.sweeps.run`) drive the rounds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from fedjx import datasets
from fedjx import distributed
from fedjx import execution
from fedjx import models
from fedjx.experiments import attack as attack_lib
from fedjx.experiments import churn as churn_lib
from fedjx.experiments import config as config_schema
from fedjx.experiments import evaluation
from fedjx.experiments import guarded_rounds
from fedjx.experiments import lora_setup
from fedjx.experiments import network_clock
from fedjx.experiments import privacy as privacy_lib
from fedjx.experiments import registry
from fedjx.experiments.config import with_defaults
from fedjx.options import RoundOptions


@dataclasses.dataclass
class Experiment:
  """The built pieces of a config (see :func:`build`)."""

  config: ml_collections.ConfigDict
  data: registry.ExperimentData
  model: models.Model
  algorithm: Any
  init_params: Any
  round_key: jax.Array
  evaluate: Callable[[Any], dict[str, float]] | None
  systems: datasets.SystemModel | None = None  # config.systems, if any
  # The simulated schedule of an asynchronous algorithm (else None).
  scheduler: datasets.AsyncScheduler | None = None
  # config.sampling's sampler (None: uniform) and the DP accounting plan.
  sampler: Any = None
  privacy: privacy_lib.Plan | None = None
  # The training population on the device (config.data_placement), whose
  # cohorts are index arrays; None: cohorts are built on the host.
  resident: datasets.DeviceDataset | None = None

  def cohorts(self, start: int, stop: int) -> Iterator[Any]:
    """Placed cohorts of rounds ``start .. stop - 1`` (prefetched)."""
    c = self.config
    if self.scheduler is not None:
      return datasets.async_cohort_iterator(
          self.data.train, self.scheduler, c.batch_size, start_round=start,
          num_rounds=stop - start, num_epochs=c.local_epochs,
          num_steps=c.local_steps, max_steps=c.max_local_steps,
          bucket=c.bucket_steps, prefetch=c.prefetch)
    return datasets.cohort_iterator(
        self.resident or self.data.train, c.cohort_size, c.batch_size, seed=c.seed,
        start_round=start, num_rounds=stop - start, num_epochs=c.local_epochs,
        num_steps=c.local_steps, max_steps=c.max_local_steps,
        bucket=c.bucket_steps, prefetch=c.prefetch, sampler=self.sampler,
        order_by_steps=c.map_strategy == 'chunked')

  def system_rounds(self, start: int, stop: int, start_time: float) -> Iterator[Any]:
    """``(cohort, report)`` of rounds ``start .. stop - 1`` under ``config.systems``,
    round ``start`` starting at simulated time ``start_time`` (seconds)."""
    c = self.config
    return datasets.system_cohort_iterator(
        self.data.train, self.systems, c.cohort_size, c.batch_size,
        start_round=start, start_time=start_time, num_rounds=stop - start,
        num_epochs=c.local_epochs, num_steps=c.local_steps,
        max_steps=c.max_local_steps, bucket=c.bucket_steps, prefetch=c.prefetch)

  def lazy_cohorts(self, start: int, stop: int,
                   whole: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Rounds ``start .. stop - 1`` as unloaded cohorts, for streamed rounds.

    Each is a ``fedjx.streaming.Clients`` that reads its clients a chunk at a
    time (``datasets.prefetch.lazy_cohort_iterator``); where ``whole(it)``
    is True the round's cohort is loaded and placed ahead, as
    :meth:`cohorts` gives it.
    """
    c = self.config
    return datasets.prefetch.lazy_cohort_iterator(
        self.data.train, c.cohort_size, c.batch_size, seed=c.seed,
        start_round=start, num_rounds=stop - start, num_epochs=c.local_epochs,
        num_steps=c.local_steps, max_steps=c.max_local_steps,
        bucket=c.bucket_steps, prefetch=c.prefetch, whole=whole,
        sampler=self.sampler)

  def round_key_for(self, r: int) -> jax.Array:
    key = jax.random.fold_in(self.round_key, r)
    mesh = jax.sharding.get_mesh()
    if mesh is not None and not mesh.empty:
      key = distributed.put_global(key, mesh)
    return key


def sample_batch(config: ml_collections.ConfigDict,
                 data: registry.ExperimentData) -> dict[str, np.ndarray]:
  """One client's first batch ``[B, ...]``: shapes and dtypes for model init."""
  cohort = datasets.make_cohort(
      data.train, datasets.CohortSampler(data.train, 1, config.seed).sample(0),
      config.batch_size, num_steps=1, shuffle_seed=None, bucket=False)
  return {k: v[0, 0] for k, v in cohort.batches.items()}


def build_algorithm(config: ml_collections.ConfigDict, model: models.Model,
                    num_clients: int, guarded: bool | None = None,
                    placement: str | None = None, params: Any = None) -> Any:
  """The algorithm of ``config`` (defaults filled) for ``model`` and a population.

  ``guarded`` overrides ``config.nonfinite`` for the builder's
  ``skip_nonfinite`` (the runner also builds the unguarded algorithm, see
  :mod:`fedjx.experiments.guarded_rounds`). ``placement`` overrides
  ``config.client_state.placement`` (a sweep keeps per-client state on the
  device, docs/sweeps.md). An algorithm whose clients keep state outside the
  server state (``client_state_init`` set) refuses ``'device'`` unless its
  registry entry offers a dense placement. With ``config.churn`` on, the
  algorithm's round runs the churn schedule (:func:`with_churn`; ``params``,
  the initial model, sizes the simulated clock of its ``goodput``).
  """
  if guarded is None:
    guarded = config.nonfinite != 'off'
  if placement is None:
    placement = config.client_state.placement
  placement = registry.resolve_placement(config.algorithm.name, placement)
  spec = privacy_lib.algorithm_spec(config, num_clients)
  algorithm = registry.build_algorithm(
      attack_lib.algorithm_spec(config, spec, num_clients), model,
      map_options=RoundOptions.of(config).map, num_clients=num_clients,
      skip_nonfinite=guarded, placement=placement)
  if placement == 'device' and getattr(algorithm, 'client_state_init', None) is not None:
    raise registry.ConfigError(
        f"config.client_state.placement='device' but algorithm "
        f'{config.algorithm.name!r} offers no dense in-state array of its '
        "per-client state; use placement='store' (or 'auto', the default).")
  return with_churn(config, algorithm, num_clients, params)


def churn_schedule(config: ml_collections.ConfigDict,
                   num_clients: int) -> churn_lib.ChurnSchedule | None:
  """``config.churn``'s seeded schedule of ``num_clients`` replicas over
  ``config.rounds`` rounds (None when the section is off).

  The schedule of round ``r`` depends on the seed and ``r`` alone, so a run
  resumed with more rounds continues the schedule it started with.
  """
  if not config_schema.churn_on(config):
    return None
  section = config.churn
  name = config.algorithm.name
  if not registry.algorithm_traits(name).replicas_restart:
    allowed = tuple(n for n in registry.ALGORITHMS
                    if registry.algorithm_traits(n).replicas_restart)
    raise registry.ConfigError(
        f'config.churn is set but config.algorithm.name={name!r}; allowed: one of '
        f'{allowed} (replicas that join restart from the global model).')
  if config.cohort_size != num_clients:
    raise registry.ConfigError(
        f'config.churn needs every replica in every cohort: config.cohort_size='
        f'{config.cohort_size} but the training population has {num_clients} '
        f'replicas; allowed: config.cohort_size={num_clients}.')
  if config.execution == 'streaming':
    raise registry.ConfigError(
        "config.churn runs each round as one compiled program; "
        "config.execution='streaming' is not allowed (use 'jit' or 'auto').")
  seed = config.seed if section['seed'] is None else section['seed']
  return churn_lib.seeded_schedule(
      num_clients, max(1, config.rounds), join=section['join'],
      leave=section['leave'], fail=section['fail'], seed=seed)


def churn_inner_steps(config: ml_collections.ConfigDict) -> int:
  """``H``, a replica's inner steps per round: ``config.network.inner_steps``,
  else ``config.local_steps``, else the algorithm's ``inner_steps``."""
  for h in ((config.network or {}).get('inner_steps'), config.get('local_steps'),
            registry.split_name('algorithm', config.algorithm)[1].get('inner_steps')):
    if h is not None:
      return int(h)
  raise registry.ConfigError(
      'config.churn counts tokens of H inner steps a round, but config.local_steps, '
      'config.network.inner_steps and config.algorithm.inner_steps are all None; '
      'allowed: an int >= 1 in one of them.')


def with_churn(config: ml_collections.ConfigDict, algorithm: Any, num_clients: int,
               params: Any = None) -> Any:
  """``algorithm`` under ``config.churn`` (unchanged when the section is off).

  Each round ``r`` applies the schedule's round ``r`` to its cohort
  (:func:`fedjx.experiments.churn.with_schedule`, the round index read from
  the state) and reports the replica counts and ``useful_tokens`` /
  ``wasted_tokens`` with ``D = config.batch_size config.churn.tokens_per_example``
  tokens a replica step; and ``goodput``, useful tokens per simulated second,
  when ``config.network`` gives a fixed ``step_seconds`` (its clock's
  ``simulated_round_s`` of the round; with a measured step time the clock
  is known only after the round, and the row has tokens only).
  """
  schedule = churn_schedule(config, num_clients)
  if schedule is None:
    return algorithm
  tokens = (churn_inner_steps(config) * config.batch_size
            * float(config.churn['tokens_per_example']))
  return churn_lib.with_schedule(algorithm, schedule, tokens,
                                 _churn_round_seconds(config, params))


def _churn_round_seconds(config: ml_collections.ConfigDict,
                         params: Any) -> Callable[[float, float], float] | None:
  """``seconds(communicated_bytes, clients)``: the round's ``simulated_round_s``
  by ``config.network``'s clock, or None (no clock, a measured step time, or
  no model to size it)."""
  if params is None:
    return None
  clock = network_clock.make(config, params, None)
  if clock is None or clock.step_seconds is None:
    return None
  def seconds(communicated_bytes: float, clients: float) -> float:
    row = {'communicated_bytes': communicated_bytes, 'clients': clients}
    timing = clock.timing(row, clock.step_seconds)
    return timing.round_seconds / clock.rounds_per_schedule
  return seconds


def round_algorithms(config: ml_collections.ConfigDict,
                     exp: Experiment) -> tuple[Any, Any | None]:
  """``(guarded, unguarded)``: what the loop runs rounds with.

  ``guarded`` is the experiment's algorithm, whose round also checks the new
  server model when ``config.nonfinite`` is not ``'off'``; ``unguarded`` is
  the same algorithm built without its guard, whose round checks its new
  server model and metrics, where rounds run unguarded first (else None; see
  :mod:`fedjx.experiments.guarded_rounds`).
  """
  if config.nonfinite == 'off':
    return exp.algorithm, None
  guarded = guarded_rounds.checking_finiteness(exp.algorithm)
  name = config.algorithm.name
  reach = (registry.algorithm_traits(name).updates_reach_params
           and 'skip_nonfinite' in registry.runner_options(name))
  if not guarded_rounds.runs_unguarded(exp.algorithm, reach):
    return guarded, None
  unguarded = build_algorithm(config, exp.model, exp.data.train.num_clients,
                              guarded=False, params=exp.init_params)
  return guarded, guarded_rounds.checking_finiteness(unguarded, whole=True)


def on_mesh(exp: Experiment, mesh: jax.sharding.Mesh) -> Experiment:
  """``exp`` with its population table (if on the device) replicated over
  ``mesh``, for a mesh chosen after the experiment was built."""
  if exp.resident is None:
    return exp
  return dataclasses.replace(exp, resident=exp.resident.replicated(mesh))


def build(config: Any, placement: str | None = None, *,
          resident: bool = True) -> Experiment:
  """Builds the dataset, model, algorithm and evaluator a config names.

  ``placement`` overrides ``config.client_state.placement`` (see
  :func:`build_algorithm`). ``resident=False`` keeps the training
  population on the host whatever ``config.data_placement`` says (a sweep
  stacks its seeds' cohorts on the host, :mod:`fedjx.experiments.sweeps`).
  """
  config = with_defaults(config)
  data = registry.build_dataset(config.dataset, config.seed)
  data = attack_lib.poison_data(config, data)  # config.attack's, if any
  model = registry.build_model(config.model, data.info)
  if config.cohort_size > data.train.num_clients:
    raise registry.ConfigError(
        f'config.cohort_size={config.cohort_size} is larger than the training '
        f'population of {data.train.num_clients} clients; it must be at most '
        f'{data.train.num_clients}.')
  plan = privacy_lib.plan(config, data.train.num_clients)
  sampler = privacy_lib.make_sampler(config, data.train)
  init_key, round_key = seed_keys(config.seed)
  batch = sample_batch(config, data)
  model = lora_setup.adapt(config, model, data.info, batch, init_key)  # config.lora's
  params = init_params(model, init_key, batch)
  algorithm = build_algorithm(config, model, data.train.num_clients,
                              placement=placement, params=params)
  held = state_bytes(algorithm, params) if jax.default_backend() != 'cpu' else 0
  step_memory = language_model_step_memory(model, held)
  if step_memory is not None:  # The model plans its remat around the algorithm's state.
    model = models.llama.with_step_memory(model, step_memory)
    algorithm = build_algorithm(config, model, data.train.num_clients,
                                placement=placement, params=params)
  examples = evaluation.pool_examples(data.test, config.eval_max_examples)
  evaluate = (evaluation.make_evaluator(model, examples, config.eval_batch_size, params,
                                        held_bytes=held)
              if examples is not None else None)
  evaluate = attack_lib.with_success_rate(config, model, data, evaluate)
  system_model = _system_model(config, data.train.num_clients, params)
  scheduler = async_scheduler(config, data.train, system_model)
  if scheduler is not None:  # The system model supplies its durations only.
    system_model = None
  _check_sampling(config, plan, sampler, system_model, scheduler)
  resident = (datasets.on_device(data.train, progress=config.progress)
              if resident and data_on_device(config, data.train, system_model,
                                             scheduler)
              else None)
  return Experiment(config, data, model, algorithm, params, round_key, evaluate,
                    systems=system_model, scheduler=scheduler, sampler=sampler,
                    privacy=plan, resident=resident)


@jax.jit
def seed_keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """``(init_key, round_key) = split(key(seed))``: the keys of a run's initial
  model and of its rounds, in one compiled program."""
  init_key, round_key = jax.random.split(jax.random.key(seed))
  return init_key, round_key


@functools.partial(jax.jit, static_argnums=0)
def _init_compiled(model: models.Model, key: jax.Array, batch: Any) -> Any:
  return model.init(key, batch)


def init_params(model: models.Model, key: jax.Array, batch: Any) -> Any:
  """``model.init(key, batch)``: the initial parameters, bit for bit.

  Computed as one compiled program (the forward pass that initialisation
  traces is dead code in it) instead of one small program per operation;
  the program is kept per model, so experiments of the same model and
  batch shapes (a sweep's seeds) share it. A model that cannot be a static
  argument (not hashable, e.g. one holding pretrained arrays) is
  initialised operation by operation, as before.
  """
  try:
    hash(model)
  except TypeError:
    return model.init(key, batch)
  return _init_compiled(model, key, batch)


def state_bytes(algorithm: Any, params: Any) -> int:
  """Bytes of the algorithm's state for ``params`` (its shapes, by ``jax.eval_shape``)."""
  state = jax.eval_shape(algorithm.init, params)
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(state))


def language_model_step_memory(model: models.Model, held_bytes: int) -> int | None:
  """The bytes a language model's training step may plan for, or None.

  For a model whose ``remat`` or ``loss_chunk`` is ``'auto'``
  (:func:`fedjx.models.llama.step_plan`) on an accelerator: the device's
  memory less ``held_bytes``, the algorithm's state (:func:`state_bytes`),
  so that e.g. DiLoCo's replicas' inner optimizer states, which stay on the
  device while one replica trains, are left room. None on a CPU, for other
  models, or when a ``step_memory`` is already set.
  """
  config = getattr(model.module, 'config', None)
  if (not model.head_loss or not isinstance(config, models.LlamaConfig) or
      config.step_memory is not None or 'auto' not in (config.remat, config.loss_chunk) or
      jax.default_backend() == 'cpu'):
    return None
  memory = execution.device_memory_bytes()
  if memory is None:
    return None
  return max(memory - held_bytes, 1)


def data_on_device(config: ml_collections.ConfigDict, train: Any,
                   system_model: Any = None, scheduler: Any = None) -> bool:
  """Whether ``config.data_placement`` puts the training population on the
  device (see ``config.DATA_PLACEMENTS``)."""
  if config.data_placement == 'host':
    return False
  simple = (jax.process_count() == 1 and config.execution != 'streaming'
            and system_model is None and scheduler is None)
  if config.data_placement == 'device':
    if not simple:
      raise registry.ConfigError(
          "config.data_placement='device' needs a single-process run that is "
          'not streamed, without config.systems or an asynchronous schedule '
          "(their cohorts are built on the host); use 'auto' or 'host'.")
    return True
  return simple and datasets.device_data.fits_on_device(train)


def _check_sampling(config: ml_collections.ConfigDict, plan: Any, sampler: Any,
                    system_model: Any, scheduler: Any) -> None:
  """One sampler per run: config.sampling (and DP accounting), the system
  model's availability, or an asynchronous schedule; never two at once."""
  if plan is None and sampler is None:
    return
  if scheduler is not None:
    raise registry.ConfigError(
        f'config.algorithm.name={config.algorithm.name!r} is asynchronous: its '
        'clients come from its schedule, so config.sampling and differential '
        "privacy's accounting do not apply; leave config.sampling uniform and "
        'use a synchronous algorithm for a DP run.')
  if system_model is not None:
    raise registry.ConfigError(
        'config.systems chooses clients by availability and drops some, which '
        'config.sampling and the privacy accountant do not model; use '
        'config.systems={} for a DP run or a non-DP algorithm with '
        'config.sampling uniform.')


def _system_model(config: ml_collections.ConfigDict, num_clients: int,
                  params: Any) -> datasets.SystemModel | None:
  """``config.systems`` as a system model (its model bytes: ``params``'), or None."""
  try:
    model = datasets.systems.from_config(
        config.systems, num_clients, config.seed,
        model_bytes=sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
                        for x in jax.tree.leaves(params)))
  except ValueError as e:
    raise registry.ConfigError(f'config.{e}') from None
  if model is None:
    return None
  if jax.process_count() > 1:
    raise registry.ConfigError('config.systems is set; the system model runs '
                               'in single-process runs only.')
  algo = registry.split_name('algorithm', config.algorithm)[1]
  if model.deadline.late == 'partial' and (
      algo.get('local_steps') is not None or algo.get('local_epochs', 1) != 1):
    raise registry.ConfigError(
        "config.systems.deadline.late='partial' masks a client's later steps "
        'in the cohort, so the algorithm must run each cohort step once: '
        'leave algorithm.local_steps and local_epochs unset and give '
        'config.local_epochs or config.local_steps instead.')
  return model


def async_scheduler(config: ml_collections.ConfigDict, train: Any,
                    systems: datasets.SystemModel | None = None
                    ) -> datasets.AsyncScheduler | None:
  """The schedule of an asynchronous algorithm (its registry entry's ``asynchronous``).

  ``K = config.cohort_size`` updates per server step; the concurrency ``M``
  (``config.algorithm.concurrency``, default ``K``) and the duration model
  (``config.algorithm.client_durations``) come from the algorithm's entry,
  or the durations from ``config.systems`` (``systems``): a client's
  communication time plus its local steps (as its cohort would hold them)
  times its step time. ``train`` is the training population (or, without
  ``systems``, its number of clients).
  """
  name, spec = registry.split_name('algorithm', config.algorithm)
  if not registry.is_asynchronous(name):
    return None
  num_clients = train if isinstance(train, int) else train.num_clients
  k = config.cohort_size
  config_schema.check_asynchronous(config, name, spec)
  if spec.get('buffer_size') not in (None, k):
    raise registry.ConfigError(
        f'config.algorithm.buffer_size={spec["buffer_size"]} differs from '
        f'config.cohort_size={k}; a server step takes cohort_size updates.')
  if systems is not None and spec.get('client_durations') is not None:
    raise registry.ConfigError(
        f'config.algorithm.client_durations and config.systems are both set '
        f'for {name!r}; give one of them.')
  try:
    if systems is not None:
      duration = _system_durations(config, train, systems)
    else:
      duration = datasets.async_schedule.make_durations(
          spec.get('client_durations'), num_clients, config.seed)
    return datasets.AsyncScheduler(num_clients, spec.get('concurrency') or k, k,
                                   duration, seed=config.seed)
  except ValueError as e:
    raise registry.ConfigError(f'config.algorithm ({name}): {e}') from None


def _system_durations(config: ml_collections.ConfigDict, train: Any,
                      systems: datasets.SystemModel) -> Callable[[int, float], float]:
  """``duration(client_id, start_time)`` of ``systems`` for the cohort steps
  each client gets under ``config``."""
  def duration(client_id: int, start_time: float) -> float:
    steps = datasets.cohort_steps(
        train, [client_id], config.batch_size, num_epochs=config.local_epochs,
        num_steps=config.local_steps, max_steps=config.max_local_steps,
        bucket=False)
    return systems.duration(client_id, start_time, steps)
  return duration
