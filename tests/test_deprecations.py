"""Deprecated spellings: each warns once, says what replaces it and when it
goes, and is listed in CHANGELOG.md; fedjx never uses its own (setup.cfg
makes its deprecation warning an error in the tests)."""

import pathlib
import re
import warnings

import jax.numpy as jnp
import pytest

from fedjx import _deprecation

REPO = pathlib.Path(__file__).resolve().parent.parent


def _loss(params, batch):
  return jnp.square(batch['x'] @ params['w'] - batch['y'])


def _deprecated_section() -> str:
  text = (REPO / 'CHANGELOG.md').read_text(encoding='utf-8')
  match = re.search(r'^### Deprecated\n(.*?)(?=^#|\Z)', text, re.S | re.M)
  assert match, 'CHANGELOG.md has no "### Deprecated" section'
  return match.group(1)


def test_fedjx_deprecations_are_errors_in_the_tests_and_others_are_not():
  from fedjx import algorithms  # pylint: disable=import-outside-toplevel
  with pytest.raises(_deprecation.FedjxDeprecationWarning,
                     match=r'map_strategy and chunk_size .*removed in fedjx 0\.3\.0'):
    algorithms.fedavg(_loss, map_strategy='vmap')
  warnings.warn('a third-party deprecation', DeprecationWarning)  # Ignored.
  assert issubclass(_deprecation.FedjxDeprecationWarning, DeprecationWarning)


def test_every_deprecated_spelling_warns_and_still_works():
  from fedjx import algorithms, datasets, streaming  # pylint: disable=import-outside-toplevel
  with pytest.deprecated_call(match=r"fedavg: map_strategy .*removed in fedjx 0\.3\.0"):
    algo = algorithms.fedavg(_loss, map_strategy='sequential', chunk_size=None)
  assert callable(algo.round)
  population = datasets.synthetic(1.0, 1.0, num_clients=4, seed=0, max_examples=60)
  with pytest.deprecated_call(match=r'fedjx\.datasets\.streaming_clients .*0\.3\.0'):
    clients = streaming.Clients.from_dataset(population, [0, 1], batch_size=2, num_steps=1)
  assert list(clients.client_ids) == [0, 1]


def test_the_changelog_lists_every_deprecated_spelling_with_its_removal():
  section = _deprecated_section()
  for spelling in ('map_strategy', 'chunk_size', 'fedjx.beam.ClientData.from_dataset',
                   'fedjx.streaming.Clients.from_dataset'):
    assert spelling in section, spelling
  items = [i for i in re.split(r'^- ', section, flags=re.M) if i.strip()]
  assert items
  for item in items:
    assert f'removed in {_deprecation.REMOVED_IN}' in ' '.join(item.split()), item
  # No warning anywhere in the package names another release.
  for path in [*REPO.glob('fedjx/**/*.py'), *REPO.glob('algorithms/*.py'),
               *REPO.glob('experiments/*.py'), *REPO.glob('datasets/*.py')]:
    for found in re.findall(r'removed in fedjx (\d+\.\d+\.\d+)', path.read_text()):
      assert found == _deprecation.REMOVED_IN, path
