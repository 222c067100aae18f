"""The data position (fedjx.experiments.data_position) against a NumPy replay.

The reference replays each sampler with NumPy alone: ``default_rng`` seeded
by ``SeedSequence([purpose, seed, round...])`` exactly as the samplers
document (uniform ``choice`` without replacement for the cohort sampler,
epoch permutations for the epoch sampler), and counts each client's example
slots by the batching rule written out again here. Everything is integer
arithmetic: the comparisons are exact.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fedjx import datasets
from fedjx.datasets import sampling
from fedjx.experiments import checkpointing
from fedjx.experiments import data_position

COHORT, EPOCH = 1, 9  # The purpose tags of fedjx.datasets._seeding.


def _population(sizes):
  n = int(sum(sizes))
  groups = np.split(np.arange(n), np.cumsum(sizes)[:-1])
  return datasets.from_arrays({'x': np.arange(n, dtype=np.float32)}, groups=groups)


def _numpy_uniform(seed, num_clients, cohort_size, r):
  gen = np.random.default_rng(np.random.SeedSequence([COHORT, seed, r]))
  return gen.choice(num_clients, size=cohort_size, replace=False)


def _numpy_epochs(seed, num_clients, cohort_size, r):
  epoch, j = divmod(r, num_clients // cohort_size)
  perm = np.random.default_rng(np.random.SeedSequence([EPOCH, seed, epoch])).permutation(
      num_clients)
  return perm[j * cohort_size:(j + 1) * cohort_size]


def _numpy_position(sizes, draw, rounds, batch_size, epochs=None, steps=None,
                    max_steps=None):
  taken = np.zeros(len(sizes), np.int64)
  for r in range(rounds):
    for c in draw(r):
      taken[c] += 1
  slots = []
  for n in sizes:
    m = steps * batch_size if steps is not None else (epochs or 1) * n
    slots.append(m if max_steps is None else min(m, max_steps * batch_size))
  seen = taken * np.array(slots)
  return taken, seen, seen // np.array(sizes), seen % np.array(sizes)


SIZES = [7, 12, 5, 9, 30, 3]


@pytest.mark.parametrize('kind,batching', [
    ('uniform', dict(steps=3)), ('uniform', dict(epochs=2, max_steps=3)),
    ('epochs', dict(epochs=1)), ('epochs', dict(steps=2))])
def test_position_is_the_numpy_replay(kind, batching):
  seed, cohort_size, rounds, batch_size = 4, 2, 11, 4
  ds = _population(SIZES)
  if kind == 'uniform':
    sampler = datasets.CohortSampler(ds, cohort_size, seed)
    draw = lambda r: _numpy_uniform(seed, len(SIZES), cohort_size, r)
  else:
    sampler = sampling.EpochSampler(ds, cohort_size, seed)
    draw = lambda r: _numpy_epochs(seed, len(SIZES), cohort_size, r)
  position = data_position.DataPosition(
      ds, sampler, batch_size, num_epochs=batching.get('epochs'),
      num_steps=batching.get('steps'), max_steps=batching.get('max_steps'))
  for r in (rounds, 3, rounds):  # Forwards, backwards (a replay from 0), forwards.
    taken, seen, epoch, offset = _numpy_position(SIZES, draw, r, batch_size, **batching)
    got = position.at(r)
    assert got['round'] == r and got['num_clients'] == len(SIZES)
    assert got['sampler'] == {'kind': type(sampler).__name__, 'seed': seed,
                              'cohort_size': cohort_size}
    clients = got['clients']
    assert clients['num_examples'] == SIZES
    assert clients['rounds'] == taken.tolist()
    assert clients['examples'] == seen.tolist()
    assert clients['epoch'] == epoch.tolist() and clients['offset'] == offset.tolist()
    assert position.difference(json.loads(json.dumps(got)), r) is None


def test_examples_per_round_is_the_length_of_example_orders():
  for n, b, e, s, m in [(7, 3, None, None, None), (7, 3, 2, None, None),
                        (7, 3, None, 5, None), (7, 3, 3, None, 2), (2, 4, None, 3, 2)]:
    order, = datasets.cohort.example_orders([n], b, num_epochs=e, num_steps=s,
                                            max_steps=m, shuffle=(0, 0, [0]))
    assert data_position.examples_per_round(n, b, e, s, m) == len(order)


def test_a_changed_dataset_or_sampler_is_the_first_difference():
  ds = _population(SIZES)
  position = data_position.DataPosition(ds, datasets.CohortSampler(ds, 2, 0), 4,
                                        num_steps=2)
  saved = position.at(5)
  bigger = _population(SIZES[:1] + [13] + SIZES[2:])
  other = data_position.DataPosition(bigger, datasets.CohortSampler(bigger, 2, 0), 4,
                                     num_steps=2)
  assert other.difference(saved, 5) == (
      'clients.num_examples[1] was 12, the data now configured give 13')
  fewer = _population(SIZES[:4])
  shards = data_position.DataPosition(fewer, datasets.CohortSampler(fewer, 2, 0), 4,
                                      num_steps=2)
  assert shards.difference(saved, 5) == (
      'num_clients was 6, the data now configured give 4')
  reseeded = data_position.DataPosition(ds, datasets.CohortSampler(ds, 2, 1), 4,
                                        num_steps=2)
  assert reseeded.difference(saved, 5).startswith('sampler was ')
  assert position.difference(saved, 4) == 'round was 5, the data now configured give 4'
  with pytest.raises(ValueError, match=r'DataPosition.at: round_num=-1'):
    position.at(-1)


def test_large_populations_and_unreplayed_cohorts_keep_what_they_can():
  big = _population([1] * (data_position.MAX_TRACKED_CLIENTS + 1))
  position = data_position.DataPosition(big, datasets.CohortSampler(big, 3, 0), 1)
  assert position.at(2)['clients'] is None
  ds = _population(SIZES)
  systems = data_position.DataPosition(ds, None, 4, kind='systems')
  got = systems.at(3)
  assert got['sampler'] == {'kind': 'systems'}
  assert got['clients'] == {'num_examples': SIZES}
  with pytest.raises(ValueError, match="kind='systems'"):
    systems.rounds_taken_part(3)


def test_the_checkpointer_saves_and_checks_the_position(tmp_path):
  ds = _population(SIZES)
  position = data_position.DataPosition(ds, datasets.CohortSampler(ds, 2, 0), 4,
                                        num_steps=2)
  directory = os.path.join(tmp_path, 'checkpoints')
  ckpt = checkpointing.Checkpointer(directory, async_save=False, position=position)
  state = {'w': np.arange(3, dtype=np.float32)}
  ckpt.save(3, state, {'step': 3})
  ckpt.wait()
  assert ckpt.read_meta(3)['data_position'] == position.at(3)
  restored, meta = ckpt.restore_latest_intact(state)
  np.testing.assert_array_equal(restored['w'], state['w'])
  ckpt.close()
  bigger = _population(SIZES[:-1] + [4])
  changed = data_position.DataPosition(bigger, datasets.CohortSampler(bigger, 2, 0), 4,
                                       num_steps=2)
  other = checkpointing.Checkpointer(directory, async_save=False, position=changed)
  try:
    with pytest.raises(checkpointing.DataPositionMismatch) as e:
      other.restore_latest_intact(state)
  finally:
    other.close()
  message = str(e.value)
  assert '\n' not in message
  assert 'step 3 written with other data: clients.num_examples[5] was 3' in message
  assert '--fresh' in message
