"""The data position of a run: where every client's example stream stands.

A round's data are a pure function of the seed and the round: round ``r``'s
clients are ``sampler.sample(r)`` (a function of ``(seed, r)``), and a
client ``c`` with ``n_c`` examples visits, in round ``r``, the stream
:func:`fedjx.datasets.cohort.example_orders` builds from hashes keyed by
``(seed, r, c)``: ``m_c`` example slots, where

* ``m_c = H B`` with ``H = local_steps`` (``num_steps``) batches of ``B``;
* ``m_c = E n_c`` with ``E = local_epochs`` (default 1) otherwise;
* ``m_c = min(m_c, S_max B)`` with ``S_max = max_local_steps`` when given.

So nothing about the data is carried from one round to the next: a run that
resumes at round ``R`` rebuilds exactly the cohorts and batches of the run
that never stopped, given the same data. What a checkpoint must pin down is
that the data *are* the same. The position after ``R`` rounds
(:meth:`DataPosition.at`) is a JSON object:

* ``round``: ``R``, the next round to run;
* ``num_clients``, ``sampler`` (its kind, ``seed`` and ``cohort_size``) and
  ``batching`` (``batch_size``, ``num_epochs``, ``num_steps``, ``max_steps``);
* ``clients`` (populations of at most :data:`MAX_TRACKED_CLIENTS` clients,
  e.g. one shard per data-parallel replica; None above): per client its
  ``num_examples`` ``n_c``, the ``rounds`` ``k_c`` among ``0 .. R - 1`` it
  took part in (a replay of the sampler), the ``examples`` ``k_c m_c`` its
  streams visited, and their ``epoch = k_c m_c // n_c`` (passes over its
  examples completed) and ``offset = k_c m_c mod n_c`` (examples into the
  current one).

Cohorts drawn by a system model (``config.systems``) or an asynchronous
schedule are not replayed here: their position has ``clients`` without
``rounds``, ``examples``, ``epoch`` and ``offset``.

A checkpoint holds the position of its step
(:class:`fedjx.experiments.checkpointing.Checkpointer`, ``meta['data_position']``);
on resume the position is computed again from the restored step and the data
now configured, and a difference (:meth:`DataPosition.difference`: the
same config now reads clients of other sizes, or another ``num_shards``,
sampler or batching) refuses the checkpoint in one line.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedjx import datasets

__all__ = ['FORMAT', 'MAX_TRACKED_CLIENTS', 'DataPosition', 'examples_per_round',
           'of_experiment']

# The version of the position's layout.
FORMAT = 1
# Populations up to this many clients have per-client positions.
MAX_TRACKED_CLIENTS = 1024


def examples_per_round(n: int, batch_size: int, num_epochs: int | None = None,
                       num_steps: int | None = None,
                       max_steps: int | None = None) -> int:
  """``m``: the example slots a client of ``n`` examples visits in one round.

  ``H B`` with ``num_steps = H``, else ``E n`` (``E = num_epochs``, default
  1), capped at ``max_steps B``: the length of
  :func:`fedjx.datasets.cohort.example_orders`' stream.
  """
  total = num_steps * batch_size if num_steps is not None else (
      (1 if num_epochs is None else num_epochs) * n)
  if max_steps is not None:
    total = min(total, max_steps * batch_size)
  return int(total)


def _first_difference(key: str, saved: Any, expected: Any) -> str | None:
  """``key``'s first differing entry in words, or None when equal."""
  if isinstance(saved, list) and isinstance(expected, list) and len(saved) == len(expected):
    for i, (a, b) in enumerate(zip(saved, expected)):
      if a != b:
        return f'{key}[{i}] was {a!r}, the data now configured give {b!r}'
    return None
  if saved != expected:
    return f'{key} was {saved!r}, the data now configured give {expected!r}'
  return None


class DataPosition:
  """The data position of a population sampled by ``sampler`` (module docstring).

  Args:
    dataset: the training population (``num_clients``, ``num_examples(c)``).
    sampler: ``sample(r) -> ids`` (padding ids ``< 0`` ignored), with
      ``seed`` and ``cohort_size``; None when the cohorts are not a sampler's
      (a system model or an asynchronous schedule): ``kind`` then names them.
    batch_size, num_epochs, num_steps, max_steps: the batching of a round.
    kind: the sampler's name in the position (default its class name).
  """

  def __init__(self, dataset: Any, sampler: Any, batch_size: int,
               num_epochs: int | None = None, num_steps: int | None = None,
               max_steps: int | None = None, kind: str | None = None):
    self.num_clients = int(dataset.num_clients)
    self._dataset, self._sampler = dataset, sampler
    self.batching = {'batch_size': int(batch_size), 'num_epochs': num_epochs,
                     'num_steps': num_steps, 'max_steps': max_steps}
    self.kind = kind if kind is not None else type(sampler).__name__
    self._sizes: np.ndarray | None = None
    self._round, self._rounds = 0, np.zeros(self.num_clients, np.int64)

  @property
  def tracked(self) -> bool:
    """Whether the position lists every client (at most MAX_TRACKED_CLIENTS)."""
    return self.num_clients <= MAX_TRACKED_CLIENTS

  def sizes(self) -> np.ndarray:
    """``int64 [N]``: every client's example count (read once)."""
    if self._sizes is None:
      self._sizes = np.array([self._dataset.num_examples(c)
                              for c in range(self.num_clients)], np.int64)
    return self._sizes

  def rounds_taken_part(self, round_num: int) -> np.ndarray:
    """``int64 [N]``: how many of rounds ``0 .. round_num - 1`` each client took part in."""
    if self._sampler is None:
      raise ValueError(f'DataPosition: the cohorts of kind={self.kind!r} are not '
                       "a sampler's; they cannot be replayed.")
    if round_num < self._round:  # Replayed from the start again.
      self._round, self._rounds = 0, np.zeros(self.num_clients, np.int64)
    for r in range(self._round, round_num):
      ids = np.asarray(self._sampler.sample(r)).reshape(-1)
      np.add.at(self._rounds, ids[ids >= 0], 1)
    self._round = max(self._round, round_num)
    return self._rounds.copy()

  def _sampler_entry(self) -> dict[str, Any]:
    entry = {'kind': self.kind}
    if self._sampler is not None:
      entry.update(seed=int(self._sampler.seed),
                   cohort_size=int(self._sampler.cohort_size))
    return entry

  def _clients(self, round_num: int) -> dict[str, list[int]] | None:
    if not self.tracked:
      return None
    sizes = self.sizes()
    out = {'num_examples': sizes.tolist()}
    if self._sampler is None:
      return out
    rounds = self.rounds_taken_part(round_num)
    per_round = np.array([examples_per_round(int(n), **self.batching) for n in sizes],
                         np.int64)
    seen = rounds * per_round
    out.update(rounds=rounds.tolist(), examples=seen.tolist(),
               epoch=(seen // np.maximum(sizes, 1)).tolist(),
               offset=(seen % np.maximum(sizes, 1)).tolist())
    return out

  def at(self, round_num: int) -> dict[str, Any]:
    """The position before round ``round_num`` (after ``round_num`` rounds), JSON-ready."""
    if isinstance(round_num, bool) or not isinstance(round_num, (int, np.integer)) or (
        round_num < 0):
      raise ValueError(f'DataPosition.at: round_num={round_num!r}; it must be an '
                       'int >= 0 (rounds completed).')
    return {'format': FORMAT, 'round': int(round_num), 'num_clients': self.num_clients,
            'sampler': self._sampler_entry(), 'batching': dict(self.batching),
            'clients': self._clients(int(round_num))}

  def difference(self, saved: dict[str, Any], round_num: int) -> str | None:
    """How ``saved`` differs from the position after ``round_num`` rounds, or None.

    Fields are compared in the order ``format``, ``round``, ``num_clients``,
    ``sampler``, ``batching``, then each ``clients`` list (first differing
    client named).
    """
    expected = self.at(round_num)
    for key in ('format', 'round', 'num_clients', 'sampler', 'batching'):
      diff = _first_difference(key, saved.get(key), expected[key])
      if diff is not None:
        return diff
    got, want = saved.get('clients'), expected['clients']
    if (got is None) != (want is None):
      return _first_difference('clients', got, want)
    for key in sorted(set(got or {}) | set(want or {})):
      diff = _first_difference(f'clients.{key}', got.get(key), want.get(key))
      if diff is not None:
        return diff
    return None


def of_experiment(exp: Any) -> DataPosition:
  """The data position of a built :class:`fedjx.experiments.experiment.Experiment`.

  The sampler is ``config.sampling``'s (``exp.sampler``) or the runner's
  default ``CohortSampler(train, cohort_size, seed)``; a system model's or an
  asynchronous schedule's cohorts have no sampler to replay.
  """
  c, train = exp.config, exp.data.train
  batching = dict(batch_size=c.batch_size, num_epochs=c.local_epochs,
                  num_steps=c.local_steps, max_steps=c.max_local_steps)
  if exp.systems is not None:
    return DataPosition(train, None, kind='systems', **batching)
  if exp.scheduler is not None:
    return DataPosition(train, None, kind='async_schedule', **batching)
  sampler = exp.sampler
  if sampler is None:
    try:
      sampler = datasets.CohortSampler(train, c.cohort_size, c.seed)
    except ValueError:  # The cohorts' own check reports it, in its words.
      return DataPosition(train, None, kind='CohortSampler', **batching)
  return DataPosition(train, sampler, **batching)

