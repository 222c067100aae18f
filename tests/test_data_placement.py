"""Where fedjx-run keeps the training population (config.data_placement)."""

import ml_collections
import numpy as np
import pytest

from fedjx import datasets
from fedjx.datasets import device_data
from fedjx.experiments import experiment
from fedjx.experiments import registry


def _population(sizes=(3, 5, 2)):
  n = sum(sizes)
  x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
  y = np.arange(n, dtype=np.int32)
  return datasets.from_arrays({'x': x, 'y': y}, groups=np.repeat(np.arange(len(sizes)), sizes))


def _config(placement, execution='jit'):
  return ml_collections.ConfigDict({'data_placement': placement, 'execution': execution})


def test_population_bytes_counts_every_example():
  # 10 examples of 4 float32 features and one int32 label.
  assert device_data.population_bytes(_population()) == 10 * (4 * 4 + 4)


def test_fits_on_device_compares_with_the_backends_limit(monkeypatch):
  population = _population()
  assert device_data.fits_on_device(population)
  limits = {name: 10 * 20 for name in device_data.AUTO_MAX_BYTES}
  monkeypatch.setattr(device_data, 'AUTO_MAX_BYTES', limits)
  assert device_data.fits_on_device(population)  # 200 bytes <= 200
  monkeypatch.setattr(device_data, 'AUTO_MAX_BYTES', {k: v - 1 for k, v in limits.items()})
  assert not device_data.fits_on_device(population)


@pytest.mark.parametrize('placement,fits,want', [
    ('auto', True, True), ('auto', False, False),
    ('device', False, True), ('host', True, False),
])
def test_data_on_device(monkeypatch, placement, fits, want):
  monkeypatch.setattr(device_data, 'fits_on_device', lambda dataset: fits)
  assert experiment.data_on_device(_config(placement), _population()) is want


def test_auto_keeps_streamed_runs_on_the_host():
  assert not experiment.data_on_device(_config('auto', 'streaming'), _population())


def test_device_refuses_a_streamed_run():
  with pytest.raises(registry.ConfigError, match="data_placement='device'"):
    experiment.data_on_device(_config('device', 'streaming'), _population())
