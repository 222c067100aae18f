"""Hyperparameters that follow a schedule across rounds.

Papers' FedAvg baselines decay the client learning rate from round to
round and anneal the server's (e.g. Reddi et al. 2021, "Adaptive
Federated Optimization", Section 5; Charles & Konecny 2020, "On the outsized
importance of learning rates in local update methods"). An optax schedule
inside the client optimizer cannot do it: the client optimizer starts
afresh every round, so its step count, and any schedule of it, counts the
local steps of one round. The round number lives in the server state, and
so do the hyperparameters every round reads (``state.hparams``, traced).
:func:`scheduled` therefore sets them, before each round ``t`` (``t =
state.round_index``, 0 for the first), to

    state.hparams[path] = schedule_path(t)

for any algorithm whose state has ``hparams`` and ``round_index``, and
reports each value as the metric ``hparam/<path>``. ``path`` names an
entry of ``state.hparams``: ``'client_optimizer/learning_rate'``,
``'server_optimizer/learning_rate'``, ``'epsilon'``, ... A schedule is a
callable of the round (an optax schedule: ``optax.exponential_decay(0.3,
1, 0.99)`` is ``0.3 * 0.99^t``), a number (constant), or a config spec
``{'name': <a key of SCHEDULES>, **its arguments}``.

The hyperparameter stays a traced array, so a scheduled run compiles one
round program, like any other; the schedule is part of that program.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjx import constant_hoisting
from fedjx.algorithms import base

Schedule = Callable[[jax.Array], jax.Array]

# The schedules a config can name: {'name': 'exponential_decay', ...}.
SCHEDULES: dict[str, Callable[..., Schedule]] = {
    name: getattr(optax, name) for name in (
        'constant_schedule', 'exponential_decay', 'cosine_decay_schedule',
        'linear_schedule', 'polynomial_schedule', 'piecewise_constant_schedule',
        'warmup_cosine_decay_schedule', 'warmup_exponential_decay_schedule')
}


def build_schedule(fn: str, path: str, spec: Any) -> Schedule:
  """The schedule of ``spec`` (a callable, a number or a config spec)."""
  if callable(spec):
    return spec
  if isinstance(spec, (int, float)) and not isinstance(spec, bool):
    return optax.constant_schedule(float(spec))
  if isinstance(spec, Mapping) and spec.get('name') in SCHEDULES:
    kwargs = {k: v for k, v in spec.items() if k != 'name'}
    if 'boundaries_and_scales' in kwargs:  # Config files hold string keys.
      kwargs['boundaries_and_scales'] = {
          int(k): v for k, v in kwargs['boundaries_and_scales'].items()}
    try:
      return SCHEDULES[spec['name']](**kwargs)
    except TypeError as e:
      raise ValueError(f'{fn}: hparam_schedules[{path!r}] = {dict(spec)!r}: '
                       f'{e}.') from None
  raise ValueError(f'{fn}: hparam_schedules[{path!r}] = {spec!r} is not a '
                   'schedule; give a callable of the round, a number, or '
                   f'{{"name": one of {tuple(SCHEDULES)}, ...}}.')


def check_schedules(fn: str, schedules: Any) -> dict[str, Schedule]:
  """``{path: schedule}`` from ``schedules`` (one-line errors)."""
  if not isinstance(schedules, Mapping) or not schedules:
    raise ValueError(f'{fn}: hparam_schedules={schedules!r} must be a '
                     'non-empty dict {"<entry of state.hparams>/<name>": '
                     'schedule}.')
  return {path: build_schedule(fn, path, spec) for path, spec in schedules.items()}


def _keys(path: str) -> list[str]:
  return path.split('/')


def _get(hparams: Mapping[str, Any], keys: list[str]) -> Any:
  for k in keys:
    hparams = hparams[k]
  return hparams


def _set(hparams: Mapping[str, Any], keys: list[str], value: Any) -> dict[str, Any]:
  new = dict(hparams)
  new[keys[0]] = value if len(keys) == 1 else _set(hparams[keys[0]], keys[1:], value)
  return new


def check_paths(fn: str, hparams: Mapping[str, Any],
                schedules: Mapping[str, Schedule]) -> None:
  """Every path names a scalar of ``hparams``, or a one-line error."""
  for path in schedules:
    try:
      leaf = _get(hparams, _keys(path))
    except (KeyError, TypeError):
      leaf = None
    if leaf is None or isinstance(leaf, Mapping) or jnp.ndim(leaf) != 0:
      raise ValueError(
          f'{fn}: hparam_schedules names {path!r}, which is not a scalar of '
          f'state.hparams; its entries are {_paths(hparams)}.')


def _paths(hparams: Mapping[str, Any], prefix: str = '') -> list[str]:
  out = []
  for k, v in hparams.items():
    if isinstance(v, Mapping):
      out += _paths(v, f'{prefix}{k}/')
    else:
      out.append(f'{prefix}{k}')
  return out


def at_round(state: Any, schedules: Mapping[str, Schedule]) -> Any:
  """``state`` with ``hparams[path] = schedule(state.round_index)``."""
  hparams, t = state.hparams, state.round_index
  for path, schedule in schedules.items():
    keys = _keys(path)
    old = _get(hparams, keys)
    hparams = _set(hparams, keys, jnp.asarray(schedule(t), jnp.result_type(old)))
  return state._replace(hparams=hparams)


def scheduled(algorithm: base.Algorithm, hparam_schedules: Mapping[str, Any], *,
              name: str = 'scheduled') -> base.Algorithm:
  """``algorithm`` whose hyperparameters follow ``hparam_schedules`` (module docstring).

  Args:
    algorithm: any :class:`~fedjx.algorithms.Algorithm` made with
      ``make_algorithm`` (its state has ``hparams`` and ``round_index``).
    hparam_schedules: ``{path: schedule}``; ``path`` an entry of
      ``state.hparams`` with ``/`` between levels.
    name: the builder's name in errors.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`: ``init`` sets the values of
    round 0, every round those of its ``round_index``; ``compile`` keeps the
    schedules. It is ``algorithm`` with its rounds replaced, so it keeps
    the traits of ``algorithm`` (``Algorithm.traits``): an algorithm whose
    clients keep state (``client_state_init``) is scheduled with its rows
    passed through and its ``run_rounds`` refused as it is.
  """
  schedules = check_schedules(name, hparam_schedules)
  if algorithm.compiler is None:
    raise ValueError(f'{name}: algorithm has compiler=None (it was not made '
                     'by make_algorithm), so its rounds cannot be scheduled.')

  def init(params):
    state = algorithm.init(params)
    check_paths(name, state.hparams, schedules)
    return at_round(state, schedules)

  def wrap(inner: base.Algorithm, donate: bool) -> base.Algorithm:
    def apply(state, cohort, key):
      state = at_round(state, schedules)
      used = {f'hparam/{path}': jnp.asarray(_get(state.hparams, _keys(path)),
                                            jnp.float32) for path in schedules}
      # Clients' rows, for an algorithm with per-client state, come third.
      state, metrics, *rows = inner.apply(state, cohort, key)
      return (state, {**metrics, **used}, *rows)

    def run(state, cohorts, keys):
      if inner.client_state_init is not None:  # Refused there, in one line.
        return inner.run_rounds(state, cohorts, keys)
      return base.scan_rounds(apply, state, cohorts, keys)

    donated = (0,) if donate else ()
    return inner._replace(
        init=init, round=constant_hoisting.jit(apply, donate_argnums=donated),
        run_rounds=constant_hoisting.jit(run, donate_argnums=donated), apply=apply,
        compiler=lambda m, d: wrap(inner.compiler(m, d), d))

  return wrap(algorithm, True)


__all__ = ['SCHEDULES', 'at_round', 'build_schedule', 'scheduled']
