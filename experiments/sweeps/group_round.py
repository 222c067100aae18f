"""A sweep group's round: every trial ``[seeds, settings]`` in one compiled call.

    states[s, h] <- round(states[s, h], cohort_s(r), key_s(r))  for all s, h

as ``vmap(vmap(round))`` (:func:`make_sweep_round`), with the cohorts of
every seed's run stacked (:func:`stacked_cohort`) and the trials spread over
the local devices (:func:`trial_sharding`). On a CPU the seeds run one after
another in the program (``lax.map`` over ``s`` of ``vmap`` over ``h``,
:func:`seeds_in_turn`): the settings of a seed share its cohort, so their
matrix products take one input against ``H`` weights. A trial that its run would stop
after a round (:func:`fedjx.experiments.guarded_rounds.must_stop`) keeps its
state from then on and is no longer alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjx import constant_hoisting
from fedjx import datasets
from fedjx.experiments import experiment as experiment_lib
from fedjx.experiments import guarded_rounds
from fedjx.experiments.sweeps import plan
from fedjx.experiments.sweeps import spec

SweepError = spec.SweepError


def _stack(rows: Sequence[Sequence[Any]],
           sharding: jax.sharding.NamedSharding | None = None) -> Any:
  """The ``[S][H]`` trees stacked leaf by leaf into ``[S, H, ...]`` leaves.

  Stacked on the host and put on the device once, laid out by ``sharding``
  (None: the default device, uncommitted): no program is compiled per leaf
  shape to stack or to slice the leaves over the devices, except where a
  leaf is weakly typed (``jnp.stack`` keeps that).
  """
  shape = (len(rows), len(rows[0]))

  def one(*xs):
    if _is_key(xs[0]):
      return jax.random.wrap_key_data(one(*map(jax.random.key_data, xs)),
                                      impl=jax.random.key_impl(xs[0]))
    grid = shape + tuple(np.shape(xs[0]))
    if getattr(xs[0], 'weak_type', False):
      return place(jnp.stack(xs).reshape(grid), sharding)
    return jax.device_put(np.stack([np.asarray(x) for x in xs]).reshape(grid),
                          sharding)
  return jax.tree.map(one, *(tree for row in rows for tree in row))


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def _select(keep: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``keep[s, h]``, else ``old`` (leaves ``[S, H, ...]``)."""
  def one(n, o):
    if _is_key(n):
      impl = jax.random.key_impl(n)
      return jax.random.wrap_key_data(
          one(jax.random.key_data(n), jax.random.key_data(o)), impl=impl)
    k = keep.reshape(keep.shape + (1,) * (jnp.ndim(n) - keep.ndim))
    return jnp.where(k, n, o)
  return jax.tree.map(one, new, old)


def _finite(params: Any, batch_dims: int = 2) -> jax.Array:
  """Per trial: every parameter finite (``[S, H]`` booleans)."""
  leaves = [x for x in jax.tree.leaves(params)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  out = None
  for x in leaves:
    f = jnp.all(jnp.isfinite(x).reshape(x.shape[:batch_dims] + (-1,)), axis=-1)
    out = f if out is None else out & f
  return out


def seeds_in_turn(sharding: jax.sharding.NamedSharding | None) -> bool:
  """Whether a group's round runs its seeds one after another (``lax.map``)
  rather than batched (``vmap``): on a CPU, where the seeds axis is not
  split over devices.

  Measured on 2 cores (the digits quickstart): 3 seeds x 2 settings, 4.9-5.3
  ms a round against 6.5-7.0 ms batched, compiled in 0.9-1.1 s against
  1.5 s; 3 seeds x 16 settings, 30 ms against 67 ms. Each seed's settings
  still run batched, against the one cohort they share.
  """
  if jax.default_backend() != 'cpu':
    return False
  return sharding is None or sharding.spec[0] is None


def make_sweep_round(algorithm: Any, policy: str = 'skip', in_turn: bool = False
                     ) -> Callable[..., tuple[Any, dict[str, jax.Array], jax.Array]]:
  """``sweep_round(states, cohorts, keys, alive) -> (states, metrics, alive)``.

  ``states`` leaves are ``[S, H, ...]`` (seeds, settings), ``cohorts`` leaves
  ``[S, ...]`` (a cohort per seed, shared by its settings), ``keys`` ``[S]``
  and ``alive`` ``[S, H]``. A trial that is not alive, or that its run
  would stop after this round (:func:`guarded_rounds.must_stop`, with the
  run's ``config.nonfinite`` as ``policy``: its new server model or round
  metrics are not finite, every client of its round was non-finite, or, with
  ``policy='stop'``, some was), keeps its state and is no longer alive.
  ``in_turn`` runs the seeds one after another (``lax.map``, see
  :func:`seeds_in_turn`) instead of batched; each trial's round is the same
  either way. Jit-compiled, donating ``states``.
  """
  # A trial's round is jax.jit(algorithm.apply), traced once per trial
  # shapes and kept by JAX: where plan.classify lowered the group's
  # algorithm for those shapes, the group's program batches that trace
  # instead of tracing the round again (XLA inlines the call: the same
  # operations).
  round_fn = jax.jit(algorithm.apply)

  def per_seed(states_h, cohort, key):
    return jax.vmap(round_fn, in_axes=(0, None, None))(states_h, cohort, key)

  def sweep_round(states, cohorts, keys, alive):
    if in_turn:
      new, metrics = jax.lax.map(lambda a: per_seed(*a), (states, cohorts, keys))
    else:
      new, metrics = jax.vmap(per_seed)(states, cohorts, keys)
    # The run's rule, trial by trial: its server model and round metrics
    # (e.g. an infinite training loss) are checked unless config.nonfinite='off'.
    finite = _finite(new.params)
    for value in metrics.values():
      if jnp.issubdtype(value.dtype, jnp.inexact) and value.ndim == 2:
        finite = finite & jnp.isfinite(value)
    finite = finite | (policy == 'off')
    bad = metrics.get('nonfinite_clients', jnp.zeros_like(finite, jnp.float32))
    stop = guarded_rounds.must_stop(finite, bad, metrics.get('clients', bad), policy)
    keep = alive & jnp.logical_not(stop)
    return _select(keep, new, states), metrics, keep

  return constant_hoisting.jit(sweep_round, donate_argnums=(0,))


def stacked_cohort(exps: Sequence[experiment_lib.Experiment], config: ml_collections.ConfigDict,
                    round_num: int) -> datasets.Cohort:
  """The cohorts of every seed's run for ``round_num``, padded to one step count."""
  c = config
  samplers = [e.sampler if e.sampler is not None else
              datasets.CohortSampler(e.data.train, c.cohort_size, e.config.seed)
              for e in exps]
  ids = [datasets.padded_ids(s.sample(round_num), s.cohort_size)
         for s in samplers]
  steps = max(datasets.cohort_steps(
      e.data.train, i, c.batch_size, num_epochs=c.local_epochs,
      num_steps=c.local_steps, max_steps=c.max_local_steps, bucket=c.bucket_steps)
              for e, i in zip(exps, ids))
  cohorts = [datasets.make_cohort(
      e.data.train, i, c.batch_size, num_epochs=c.local_epochs,
      num_steps=c.local_steps, max_steps=c.max_local_steps,
      shuffle_seed=s.seed, round_num=round_num, bucket=c.bucket_steps,
      steps=steps, pad_to=len(i)) for e, i, s in zip(exps, ids, samplers)]
  return jax.tree.map(lambda *xs: np.stack(xs), *cohorts)


def trial_sharding(shape: tuple[int, int]) -> jax.sharding.NamedSharding | None:
  """Trials spread over the local devices: on the settings axis, else the seeds axis."""
  devices = jax.local_devices()
  n = len(devices)
  if n < 2 or jax.process_count() > 1:
    return None
  mesh = jax.sharding.Mesh(np.array(devices), ('trials',))
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  if shape[1] % n == 0:
    return jax.sharding.NamedSharding(mesh, P(None, 'trials'))
  if shape[0] % n == 0:
    return jax.sharding.NamedSharding(mesh, P('trials'))
  return None


def place(tree: Any, sharding: jax.sharding.NamedSharding | None) -> Any:
  """``tree`` laid out by ``sharding``; None leaves device arrays where they
  are. Host (NumPy) leaves are put on the device(s) directly (None: the
  default device, uncommitted)."""
  def one(x):
    if _is_key(x):
      return jax.random.wrap_key_data(one(jax.random.key_data(x)),
                                      impl=jax.random.key_impl(x))
    if sharding is None and not isinstance(x, np.ndarray):
      return x
    return jax.device_put(x, sharding)
  return jax.tree.map(one, tree)


def per_trial_scalars(metrics: Mapping[str, Any], s: int, h: int) -> dict[str, float]:
  return {k: float(np.asarray(v)[s, h]) for k, v in metrics.items()
          if np.asarray(v).ndim == 2}


class Compiling:
  """``step_fn`` lowered and compiled for ``args`` on a background thread.

  XLA compiles without holding Python's lock, so the host work that
  follows (the trials' files, their first evaluation) runs meanwhile; a
  later call of ``step_fn`` with arguments of the same shapes finds the
  program in JAX's caches. :meth:`wait` returns the compiled program, or
  raises what compiling raised.
  """

  def __init__(self, step_fn: Any, args: tuple[Any, ...]):
    self._compiled: Any = None
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._compile, args=(step_fn, args),
                                    name='fedjx-sweep-compile', daemon=True)
    self._thread.start()

  def _compile(self, step_fn: Any, args: tuple[Any, ...]) -> None:
    try:
      self._compiled = step_fn.lower(*args).compile()
    except BaseException as e:  # pylint: disable=broad-exception-caught
      self._error = e  # Raised by wait(), in the thread that trains.

  def wait(self) -> Any:
    self._thread.join()
    if self._error is not None:
      raise self._error
    return self._compiled


def check_memory(compiling: Compiling, group: plan.Group) -> None:
  """Refuses a group whose compiled round would not fit the device's memory.

  Only where the backend reports a memory limit (GPUs, TPUs), after the
  round is compiled (``compiling``); XLA's memory plan of the compiled
  round (arguments, outputs and temporaries, less donated buffers) must fit
  in 90% of it.
  """
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get('bytes_limit')
  if not limit:
    return
  m = compiling.wait().memory_analysis()
  if m is None:
    return
  need = (m.argument_size_in_bytes + m.output_size_in_bytes +
          m.temp_size_in_bytes - m.alias_size_in_bytes)
  if need > 0.9 * limit:
    per_setting = need / len(group.settings)
    k = max(1, int(0.9 * limit // per_setting))
    raise SweepError(
        f'{group.name}: {len(group.seeds)} seeds x {len(group.settings)} settings '
        f'need {need / 2**30:.1f} GiB of the device\'s {limit / 2**30:.1f} GiB; '
        f'rerun in a new workdir with --settings_per_program={k} (or fewer seeds).')


def group_states(config: Any, group: plan.Group, built: plan.Built | None = None,
                 sharding: jax.sharding.NamedSharding | None = None
                 ) -> tuple[list[experiment_lib.Experiment], Any, Any,
                            list[list[ml_collections.ConfigDict]]]:
  """Each seed's experiment (taken from ``built`` where it was built ahead),
  the group's algorithm, the ``[S, H]`` initial states (laid out by
  ``sharding``, :func:`trial_sharding`) and the trials' configs
  ``[seed][setting]``."""
  seeds, settings = group.seeds, group.settings
  configs = [[plan.trial_config(config, h, s) for h in settings] for s in seeds]
  take = plan.build_trial if built is None else built.take
  exps = [take(configs[i][0]) for i in range(len(seeds))]
  rows = []
  for i, exp in enumerate(exps):
    row = [exp.algorithm.init(exp.init_params)]
    row += [plan.trial_algorithm(configs[i][j], exp).init(exp.init_params)
            for j in range(1, len(settings))]
    rows.append(row)
  return exps, exps[0].algorithm, _stack(rows, sharding), configs
