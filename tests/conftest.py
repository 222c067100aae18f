"""Test configuration: 8 host CPU devices for multi-device tests.

XLA_FLAGS must be set before jax is imported, which is why it happens here.
"""

import os
import sys

# The repository's benchmarks (benchmarks/, not installed) for their tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                os.pardir, 'benchmarks'))

os.environ.setdefault('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
# Runs keep their compiled programs in a user cache folder by default
# (config.compilation_cache): the tests' go to a folder of their own.
if 'FEDJX_TEST_CACHE_HOME' not in os.environ:
  import tempfile  # pylint: disable=g-import-not-at-top
  os.environ['FEDJX_TEST_CACHE_HOME'] = tempfile.mkdtemp(prefix='fedjx-tests-')
os.environ['XDG_CACHE_HOME'] = os.environ['FEDJX_TEST_CACHE_HOME']


# The quick subset, `pytest -m quick` (README): the default tests of one file
# or two per layer (primitives, algorithms, datasets, models, execution,
# packaging, the command line and its workdir).
QUICK_FILES = ('test_primitives.py', 'test_reductions.py', 'test_fedavg.py',
               'test_algorithms_fedopt.py', 'test_datasets_partition.py',
               'test_datasets_cohort.py', 'test_sampling.py', 'test_models.py',
               'test_execution.py', 'test_packaging.py', 'test_listing.py',
               'test_result_files.py', 'test_workdir.py')


def pytest_collection_modifyitems(config, items):
  del config
  import pytest  # pylint: disable=g-import-not-at-top
  for item in items:
    if item.path.name in QUICK_FILES and item.get_closest_marker('slow') is None:
      item.add_marker(pytest.mark.quick)
