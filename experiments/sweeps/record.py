"""A sweep's record in its workdir (``sweep.json``): what it trains, and how it grows.

``sweep.json`` holds the base config (less the fields a resumed run may
change, ``RESUMABLE_CHANGES``), every setting and seed, ``--settings_per_program``
and the *parts* trained so far: each part a block of settings x seeds,
planned into its own groups. A sweep is one part.

Running ``fedjx-sweep`` again in the same workdir:

* with the same sweep resumes it;
* with more values of the same swept fields, or more seeds (the old
  settings and seeds all still there), *extends* it (:func:`extend`): the
  trials there are kept (and resumed where unfinished), the new ones form
  new parts (the new settings with every seed, then the old settings with
  the new seeds), and the summary covers them all;
* with anything else (another base config, other swept fields, a value or a
  seed left out, another ``--settings_per_program``) is refused in one line
  naming what differs (:func:`difference`).

A group's checkpoints carry its part's :func:`part_fingerprint`, so a group
resumes only the trials it was started with.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from fedjx.experiments import config as config_schema
from fedjx.experiments.sweeps import spec

SweepError = spec.SweepError


@dataclasses.dataclass(frozen=True)
class Part:
  """A block of a sweep's trials: every one of ``settings`` with every seed."""

  settings: list[dict[str, Any]]
  seeds: list[int]


def fingerprint(config: Any, settings: Sequence[Mapping[str, Any]],
                seeds: Sequence[int], settings_per_program: int | None
                ) -> dict[str, Any]:
  """What identifies a sweep: its base config (less ``RESUMABLE_CHANGES``),
  settings, seeds and ``settings_per_program``."""
  base = json.loads(config_schema.validate(config).to_json_best_effort(sort_keys=True))
  for key in config_schema.RESUMABLE_CHANGES:  # As for runs: these may change on resume.
    base.pop(key, None)
  return {'config': base,
          'settings': json.loads(json.dumps(list(settings), sort_keys=True)),
          'seeds': list(seeds), 'settings_per_program': settings_per_program}


def part_fingerprint(sweep: Mapping[str, Any], part: Part) -> dict[str, Any]:
  """The fingerprint of one part (what its groups' checkpoints carry): the
  sweep's, with the part's settings and seeds (the first part of a sweep:
  the sweep's own)."""
  return {'config': sweep['config'], 'settings': part.settings,
          'seeds': list(part.seeds),
          'settings_per_program': sweep['settings_per_program']}


def parts(saved: Mapping[str, Any]) -> list[Part]:
  """The parts a ``sweep.json`` records (one, the whole sweep, if none)."""
  if 'parts' in saved:
    return [Part(list(p['settings']), list(p['seeds'])) for p in saved['parts']]
  return [Part(list(saved['settings']), list(saved['seeds']))]


def with_parts(sweep: Mapping[str, Any], sweep_parts: Sequence[Part]) -> dict[str, Any]:
  """``sweep.json``'s content: ``sweep`` over the union of ``sweep_parts``
  (settings and seeds in the order the parts add them) and the parts."""
  settings, seeds, seen = [], [], set()
  for part in sweep_parts:
    for s in part.settings:
      if _key(s) not in seen:
        seen.add(_key(s))
        settings.append(s)
    seeds += [s for s in part.seeds if s not in seeds]
  return dict(sweep, settings=settings, seeds=seeds,
              parts=[{'settings': p.settings, 'seeds': list(p.seeds)}
                     for p in sweep_parts])


def _key(setting: Mapping[str, Any]) -> str:
  return json.dumps(setting, sort_keys=True)


def _shown(setting: Mapping[str, Any]) -> str:
  names = spec.short_names(list(setting))
  return ', '.join(f'{names.get(p, p)}={spec.format_value(v)}'
                   for p, v in setting.items()) or 'the base config'


def difference(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """What keeps ``new`` from resuming or extending the sweep ``saved`` (both
  :func:`fingerprint` s), each a short phrase; ``[]`` when it may."""
  a, b = config_schema.flatten(saved['config']), config_schema.flatten(new['config'])
  out = [f'config.{k}: {a.get(k)!r} -> {b.get(k)!r}'
         for k in config_schema.experiment_difference(saved['config'], new['config'])]
  old_fields = list(saved['settings'][0]) if saved['settings'] else []
  new_fields = list(new['settings'][0]) if new['settings'] else []
  if sorted(old_fields) != sorted(new_fields):
    out.append(f'swept fields {old_fields} -> {new_fields}')
    return out
  if saved['settings_per_program'] != new['settings_per_program']:
    out.append(f"--settings_per_program {saved['settings_per_program']} -> "
               f"{new['settings_per_program']}")
  kept = {_key(s) for s in new['settings']}
  for s in saved['settings']:
    if _key(s) not in kept:
      out.append(f'the setting {_shown(s)} is left out')
  for seed in saved['seeds']:
    if seed not in new['seeds']:
      out.append(f'seed {seed} is left out')
  return out


def extend(saved: Mapping[str, Any], new: Mapping[str, Any], workdir: str
           ) -> list[Part]:
  """The parts to train for sweep ``new`` in a workdir whose ``sweep.json``
  is ``saved``: its parts, then (where ``new`` adds settings or seeds) the
  new settings with every seed and the old settings with the new seeds.

  Raises:
    SweepError: ``new`` neither is nor extends ``saved`` (one line naming
      what differs).
  """
  diff = difference(saved, new)
  if diff:
    shown = '; '.join(diff[:6]) + (f'; and {len(diff) - 6} more' if len(diff) > 6
                                   else '')
    raise SweepError(
        f'{workdir} holds a different sweep ({shown}). A sweep there may only '
        'add values or seeds to it (docs/sweeps.md); use a new --workdir, or '
        'start over in it with --fresh.')
  out = parts(saved)
  old = {_key(s) for s in saved['settings']}
  added = [s for s in new['settings'] if _key(s) not in old]
  more_seeds = [s for s in new['seeds'] if s not in saved['seeds']]
  all_seeds = list(saved['seeds']) + more_seeds
  if added:
    out.append(Part(added, all_seeds))
  if more_seeds:
    out.append(Part(list(saved['settings']), more_seeds))
  return out
