"""The layout of the installed package."""

import importlib.util
import pathlib

import fedjx
import fedjx.algorithms
import fedjx.datasets

REPO = pathlib.Path(fedjx.__file__).resolve().parent.parent


def test_subpackages_come_from_their_top_level_folders():
  assert pathlib.Path(fedjx.algorithms.__file__).resolve().parent == REPO / 'algorithms'
  assert pathlib.Path(fedjx.datasets.__file__).resolve().parent == REPO / 'datasets'


def test_no_top_level_algorithms_or_datasets_module_is_installed():
  # HuggingFace's `datasets` must not be shadowed by this repository.
  for name in ('algorithms', 'datasets', 'models', 'experiments'):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
      assert REPO not in pathlib.Path(spec.origin).resolve().parents, spec.origin


def test_public_api():
  for name in ('program', 'broadcast', 'map_fn', 'reduce_sum', 'reduce_mean',
               'reduce_weighted_mean'):
    assert name in fedjx.__all__ and callable(getattr(fedjx, name))
