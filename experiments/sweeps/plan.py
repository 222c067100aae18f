"""A sweep's plan: its trials, and which swept fields share one compiled program.

A field is *traced* when changing it leaves the lowered round (StableHLO)
unchanged and only changes the initial state (:func:`classify`); trials
that differ only in traced fields and the seed form one :class:`Group`,
trained together as ``[seeds, settings]`` (:mod:`fedjx.experiments.sweeps.run`).
Every other field is *structural*: each structural setting is its own group.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from fedjx.experiments import config as config_schema
from fedjx.experiments import experiment as experiment_lib
from fedjx.experiments import registry
from fedjx.experiments.sweeps import spec

SweepError = spec.SweepError

@dataclasses.dataclass(frozen=True)
class Trial:
  """One (setting, seed) pair of a sweep."""

  name: str
  setting: dict[str, Any]
  seed: int


@dataclasses.dataclass
class Group:
  """Trials that share one compiled program: ``[seeds, settings]``."""

  index: int
  settings: list[dict[str, Any]]
  seeds: tuple[int, ...]
  trials: list[list[Trial]]  # [seed][setting]

  @property
  def name(self) -> str:
    return f'group_{self.index:03d}'

def trial_config(config: Any, setting: Mapping[str, Any],
                 seed: int) -> ml_collections.ConfigDict:
  """``config`` with the setting's fields and the seed set (defaults filled)."""
  tree = (config.to_dict() if hasattr(config, 'to_dict') else
          json.loads(json.dumps(dict(config))))
  for path, value in setting.items():
    spec.set_path(tree, path, value)
  tree['seed'] = seed
  return config_schema.validate(ml_collections.ConfigDict(tree))


# A sweep's trials are vmapped rounds of one program: per-client state stays
# in each trial's server state (a dense array, where the algorithm offers
# one); an algorithm that keeps it only in a host store is refused
# (docs/sweeps.md).
PLACEMENT = 'device'


def _placement(config: ml_collections.ConfigDict) -> str | None:
  """Where a trial's algorithm keeps per-client state: :data:`PLACEMENT`
  for an algorithm that keeps any, else the config's."""
  traits = registry.algorithm_traits(config.algorithm.name)
  return PLACEMENT if traits.client_state is not None else None


def build_trial(config: ml_collections.ConfigDict) -> experiment_lib.Experiment:
  """``experiment.build(config)`` with per-client state on the device and the
  training population on the host (the sweep stacks its seeds' cohorts)."""
  name = config.algorithm.name
  exp = experiment_lib.build(config, placement=_placement(config), resident=False)
  if getattr(exp.algorithm, 'client_state_init', None) is not None:
    raise registry.ConfigError(
        f'fedjx-sweep: algorithm {name!r} keeps per-client state in a host '
        "store, which a sweep's vmapped trials cannot share; sweep an "
        'algorithm that keeps it in its state (SCAFFOLD) or run the trials '
        'with fedjx-run.')
  return exp


class Built:
  """Experiments built ahead, each handed out once by its trial config.

  :func:`classify` builds the first trial's experiment to trace its round;
  the group that trains that trial takes it (:meth:`take`) instead of
  building it again. Nothing is kept once taken.
  """

  def __init__(self):
    self._built: dict[str, experiment_lib.Experiment] = {}

  @staticmethod
  def _key(config: ml_collections.ConfigDict) -> str:
    return config.to_json_best_effort(sort_keys=True)

  def build(self, config: ml_collections.ConfigDict) -> experiment_lib.Experiment:
    """``build_trial(config)``, kept for :meth:`take`."""
    key = self._key(config)
    if key not in self._built:
      self._built[key] = build_trial(config)
    return self._built[key]

  def take(self, config: ml_collections.ConfigDict) -> experiment_lib.Experiment:
    """The experiment built for ``config`` (and forgotten here), else a new one."""
    exp = self._built.pop(self._key(config), None)
    return build_trial(config) if exp is None else exp


def trial_algorithm(config: ml_collections.ConfigDict, exp: experiment_lib.Experiment) -> Any:
  """The algorithm of ``config`` built for ``exp``'s model and data, as
  :func:`build_trial` builds ``exp.algorithm`` for its own config."""
  return experiment_lib.build_algorithm(config, exp.model, exp.data.train.num_clients,
                                        placement=_placement(config),
                                        params=exp.init_params)


def _lowered_round(algorithm: Any, args: tuple[Any, ...]) -> str:
  """The round of ``algorithm`` on ``args`` lowered to StableHLO (what XLA
  compiles: operations, shapes and constants, dead code left out).

  Traced as ``jax.jit(algorithm.apply)``, whose trace JAX keeps: the group
  that trains ``algorithm`` runs each trial's round as that same function
  (:func:`fedjx.experiments.sweeps.group_round.make_sweep_round`), so its
  program batches this trace rather than tracing the round again.
  """
  return jax.jit(algorithm.apply).lower(*args).as_text()


def _same_state_layout(a: Any, b: Any) -> bool:
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  return ta == tb and all(
      jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)
      for x, y in zip(la, lb))


def classify(config: Any, axes_values: Mapping[str, Sequence[Any]],
             seed: int = 0, built: Built | None = None
             ) -> tuple[list[str], list[str]]:
  """Splits swept fields into traced (vectorizable) and structural ones.

  A field under ``algorithm.`` is traced when the rounds built with its first
  and last value lower to the same StableHLO and their initial states have the
  same layout: the value then lives only in the state, and one program
  serves every value. Any other field is structural. The round of the
  first values (the algorithm of their experiment, built through ``built``
  for the group that trains it to take) is lowered once for every field,
  and that group's program reuses its trace (:func:`_lowered_round`).
  """
  traced, structural = [], []
  base: dict[str, Any] = {p: v[0] for p, v in axes_values.items()}
  exp = args = program = None
  for path, values in axes_values.items():
    if len(values) < 2 or not path.startswith('algorithm.'):
      (traced if len(values) < 2 else structural).append(path)
      continue
    if exp is None:
      exp = (built or Built()).build(trial_config(config, base, seed))
      base_algo = exp.algorithm  # What the group that takes exp trains.
      cohorts = exp.cohorts(0, 1)
      try:
        cohort = next(cohorts)
      finally:
        cohorts.close()
      # The run's round key itself stands for round 0's (fold_in(round_key,
      # 0), of the same type): the lowering depends on types only.
      args = (base_algo.init(exp.init_params), cohort, exp.round_key)
      program = _lowered_round(base_algo, args)
    other = trial_algorithm(trial_config(config, {**base, path: values[-1]}, seed),
                            exp)
    state = other.init(exp.init_params)
    same = _same_state_layout(args[0], state) and (
        program == _lowered_round(other, (state,) + args[1:]))
    (traced if same else structural).append(path)
  return traced, structural


def plan(config: Any, settings: Sequence[Mapping[str, Any]],
         seeds: Sequence[int], settings_per_program: int | None = None,
         built: Built | None = None, first: int = 0
         ) -> tuple[list[Group], list[str], list[str]]:
  """Groups the trials by their structural fields.

  Settings that share their structural fields form one group, split into
  groups of at most ``settings_per_program`` settings when that is given
  (each group a compiled program over ``[seeds, settings]``), numbered
  from ``first``. The experiment :func:`classify` builds goes to ``built``.

  Returns ``(groups, traced_fields, structural_fields)``.
  """
  if settings_per_program is not None and (
      isinstance(settings_per_program, bool) or
      not isinstance(settings_per_program, int) or settings_per_program < 1):
    raise SweepError(f'settings_per_program={settings_per_program!r} must be a '
                     'positive int or None (all settings of a group at once).')
  paths = list(settings[0]) if settings else []
  values = {p: list(dict.fromkeys(
      (json.dumps(s[p], sort_keys=True) for s in settings))) for p in paths}
  values = {p: [json.loads(v) for v in vs] for p, vs in values.items()}
  for s in settings:
    for seed in seeds:
      trial_config(config, s, seed)  # Every trial's config is valid.
  traced, structural = classify(config, values, seeds[0], built)
  names = spec.short_names(paths)
  keyed: dict[str, list[dict[str, Any]]] = {}
  for s in settings:
    key = json.dumps({p: s[p] for p in structural}, sort_keys=True)
    keyed.setdefault(key, []).append(dict(s))
  chunks = []
  for group_settings in keyed.values():
    k = settings_per_program or len(group_settings)
    chunks += [group_settings[i:i + k] for i in range(0, len(group_settings), k)]
  groups = []
  for i, group_settings in enumerate(chunks):
    trials = [[Trial(spec.trial_name(s, seed, names), s, seed)
               for s in group_settings] for seed in seeds]
    groups.append(Group(first + i, group_settings, tuple(seeds), trials))
  return groups, traced, structural

def check_trials(config: Any, settings: Sequence[Mapping[str, Any]],
                 seeds: Sequence[int]) -> None:
  """Raises a one-line SweepError naming the first setting whose trial config
  is not valid (``config_schema.validate``: names, options, types, ranges),
  without loading data or writing anything."""
  names = spec.short_names(list(settings[0]) if settings else [])
  for setting in settings:
    for seed in seeds:
      try:
        trial_config(config, setting, seed)
      except (ValueError, TypeError) as e:
        shown = ', '.join(f'{names.get(p, p)}={spec.format_value(v)}'
                          for p, v in setting.items()) or 'the base config'
        text = ' '.join(str(e).split())
        raise SweepError(f'the setting {shown} (seed {seed}) is not a valid '
                         f'config: {text} Nothing was written; correct the '
                         'sweep and run it again.') from None
