"""What a sweep runs: swept config fields, their values, and the seeds.

A sweep is a list of *settings* (each a mapping ``config path -> value``,
e.g. ``{'algorithm.server_learning_rate': 0.01}``) crossed with a list of
seeds; every (setting, seed) pair is a *trial*, trained exactly as
``fedjx-run`` would train the config with those fields set.

Settings come from a grid (the Cartesian product of each axis' values) or
from random search (each axis a distribution, ``num_samples`` draws from a
seeded NumPy generator, so the same sweep always draws the same settings).

Axis syntax (the ``--sweep`` flag, or :func:`parse_axis`)::

  algorithm.server_learning_rate=0.003,0.01,0.03     a grid axis
  algorithm.server_learning_rate=loguniform(1e-3,1)  random search
  algorithm.client_optimizer.momentum=uniform(0,0.99)
  model.hidden=choice((64,),(128,))                  random choice

Values are Python literals (``ast.literal_eval``); anything else is a string.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

DISTRIBUTIONS = ('uniform', 'loguniform', 'choice')
_DIST = re.compile(r'^(uniform|loguniform|choice)\((.*)\)$')
_PATH = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$')


class SweepError(ValueError):
  """A sweep specification that cannot be run (bad axis, value or field)."""


@dataclasses.dataclass(frozen=True)
class Axis:
  """One swept config field.

  Attributes:
    path: the dotted config path, e.g. ``'algorithm.server_learning_rate'``.
    values: the grid values (for a grid axis).
    distribution: ``'uniform'``, ``'loguniform'`` or ``'choice'`` (random
      search), with ``arguments`` ``(low, high)`` or the choices.
  """

  path: str
  values: tuple[Any, ...] = ()
  distribution: str | None = None
  arguments: tuple[Any, ...] = ()

  def sample(self, rng: np.random.Generator) -> Any:
    """One draw of a random-search axis."""
    if self.distribution == 'choice':
      return self.arguments[int(rng.integers(len(self.arguments)))]
    low, high = self.arguments
    if self.distribution == 'loguniform':
      return float(math.exp(rng.uniform(math.log(low), math.log(high))))
    return float(rng.uniform(low, high))


def _literal(text: str) -> Any:
  text = text.strip()
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _split_top_level(text: str) -> list[str]:
  """Splits on commas that are not inside brackets or quotes."""
  parts, depth, quote, current = [], 0, None, []
  for ch in text:
    if quote:
      quote = None if ch == quote else quote
    elif ch in '\'"':
      quote = ch
    elif ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 0:
      parts.append(''.join(current))
      current = []
      continue
    current.append(ch)
  parts.append(''.join(current))
  return [p for p in (p.strip() for p in parts) if p]


def parse_axis(text: str) -> Axis:
  """An :class:`Axis` from ``'path=v1,v2,...'`` or ``'path=dist(args)'``."""
  path, sep, rest = text.partition('=')
  path = path.strip()
  if path.startswith('config.'):
    path = path[len('config.'):]
  if not sep or not rest.strip():
    raise SweepError(f'--sweep={text!r}: expected FIELD=V1,V2,... or '
                     f'FIELD=DIST(ARGS) with DIST one of {DISTRIBUTIONS}.')
  if not _PATH.match(path):
    raise SweepError(f'--sweep={text!r}: {path!r} is not a dotted config field '
                     '(e.g. algorithm.server_learning_rate).')
  if path == 'seed':
    raise SweepError(f'--sweep={text!r}: give seeds with --seeds, not as an axis.')
  match = _DIST.match(rest.strip())
  if match:
    dist, args = match.group(1), tuple(_literal(a) for a in
                                       _split_top_level(match.group(2)))
    if dist == 'choice':
      if not args:
        raise SweepError(f'--sweep={text!r}: choice() needs at least one value.')
    else:
      if len(args) != 2 or not all(isinstance(a, (int, float)) and
                                   not isinstance(a, bool) for a in args):
        raise SweepError(f'--sweep={text!r}: {dist}(low, high) takes two numbers.')
      low, high = (float(a) for a in args)
      if not low < high or (dist == 'loguniform' and low <= 0):
        raise SweepError(f'--sweep={text!r}: {dist} needs '
                         f'{"0 < " if dist == "loguniform" else ""}low < high.')
      args = (low, high)
    return Axis(path, distribution=dist, arguments=args)
  values = tuple(_literal(v) for v in _split_top_level(rest))
  if len(set(map(repr, values))) != len(values):
    raise SweepError(f'--sweep={text!r}: a value is listed twice.')
  return Axis(path, values=values)


def parse_seeds(text: str | Sequence[int]) -> tuple[int, ...]:
  """Seeds from ``'0,1,2'``, ``'0-4'`` (inclusive range) or a sequence of ints."""
  if not isinstance(text, str):
    seeds = tuple(text)
  else:
    seeds = []
    for part in _split_top_level(text):
      lo, dash, hi = part.partition('-')
      try:
        seeds.extend(range(int(lo), int(hi) + 1) if dash else [int(part)])
      except ValueError:
        raise SweepError(f'--seeds={text!r}: {part!r} is not an int or a '
                         'range like 0-4.') from None
  if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                      for s in seeds):
    raise SweepError(f'--seeds={text!r}: give one or more non-negative ints.')
  if len(set(seeds)) != len(seeds):
    raise SweepError(f'--seeds={text!r}: a seed is listed twice.')
  return tuple(seeds)


def settings(axes: Sequence[Axis], num_samples: int | None = None,
             sample_seed: int = 0) -> list[dict[str, Any]]:
  """The settings of a sweep: the grid of ``axes``, or ``num_samples`` draws.

  Grid axes and random axes do not mix: with any random axis, every axis is
  drawn (a grid axis as a uniform choice among its values).
  """
  paths = [a.path for a in axes]
  if len(set(paths)) != len(paths):
    raise SweepError(f'a field is swept twice: {paths}.')
  if not axes:
    return [{}]
  random_axes = any(a.distribution for a in axes)
  if not random_axes:
    if num_samples is not None:
      raise SweepError('--num_samples is for random search; every --sweep axis '
                       'lists values (a grid).')
    return [dict(zip(paths, combo))
            for combo in itertools.product(*(a.values for a in axes))]
  if num_samples is None or num_samples < 1:
    raise SweepError(f'random search needs --num_samples >= 1; got {num_samples}.')
  rng = np.random.default_rng(sample_seed)
  axes = [a if a.distribution else Axis(a.path, distribution='choice',
                                        arguments=a.values) for a in axes]
  return [{a.path: a.sample(rng) for a in axes} for _ in range(num_samples)]


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
  """``tree[a][b][c] = value`` for ``path = 'a.b.c'`` (creating inner dicts)."""
  *parents, leaf = path.split('.')
  node = tree
  for i, part in enumerate(parents):
    child = node.get(part)
    if child is None:
      child = node[part] = {}
    if not isinstance(child, dict):
      raise SweepError(f'cannot sweep {path!r}: '
                       f'{".".join(parents[:i + 1])} is {child!r}, not a dict.')
    node = child
  node[leaf] = value


def short_names(paths: Iterable[str]) -> dict[str, str]:
  """Each path without its section (``algorithm.``, ``dataset.``, ``model.``).

  ``'algorithm.client_optimizer.learning_rate'`` becomes
  ``'client_optimizer.learning_rate'``; a top-level field keeps its name. If
  two paths would get the same name, both keep their full path.
  """
  paths = list(paths)
  names = {p: p.split('.', 1)[1] if '.' in p else p for p in paths}
  counts: dict[str, int] = {}
  for name in names.values():
    counts[name] = counts.get(name, 0) + 1
  return {p: (n if counts[n] == 1 else p) for p, n in names.items()}


def format_value(value: Any) -> str:
  if isinstance(value, float):
    return f'{value:.6g}'
  return str(value).replace(' ', '')


def lower_is_better(metric: str) -> bool:
  """Whether smaller values of ``metric`` are better (losses, errors, perplexity)."""
  return 'loss' in metric or 'error' in metric or 'perplexity' in metric


def finite_series(rows: Sequence[Mapping[str, Any]], metric: str
                  ) -> list[tuple[int, float]]:
  """``[(round, value)]`` of the rows' finite numbers for ``metric``."""
  out = []
  for row in rows:
    v = row.get(metric)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
      out.append((int(row['round']), float(v)))
  return out


def trial_name(setting: Mapping[str, Any], seed: int,
               names: Mapping[str, str]) -> str:
  """A directory-safe name such as ``server_learning_rate=0.01,seed=0``."""
  parts = [f'{names[p]}={format_value(v)}' for p, v in setting.items()]
  parts.append(f'seed={seed}')
  return re.sub(r'[^A-Za-z0-9_.=,+-]', '_', ','.join(parts))
