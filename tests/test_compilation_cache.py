"""config.compilation_cache: where a run keeps its compiled programs.

The folder each setting names, the one-line error of a bad setting, and a
run in a fresh process that fills the folder, then a second run of the same
config that finds every program there (it adds no entry).
"""

import os
import subprocess
import sys

import pytest

from fedjx.experiments import compilation_cache
from fedjx.experiments import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_setting_names_its_folder(monkeypatch, tmp_path):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert compilation_cache.directory('user', '/w') == str(tmp_path / 'xdg' / 'fedjx' / 'xla')
  monkeypatch.delenv('XDG_CACHE_HOME')
  assert compilation_cache.directory('user', '/w') == os.path.join(
      os.path.expanduser('~'), '.cache', 'fedjx', 'xla')
  assert compilation_cache.directory('workdir', '/w') == '/w/xla_cache'
  assert compilation_cache.directory('off', '/w') is None
  assert compilation_cache.directory(str(tmp_path / 'c'), '/w') == str(tmp_path / 'c')


@pytest.mark.parametrize('bad', ['', 3, None])
def test_a_bad_setting_is_one_line(bad):
  config = {'dataset': {'name': 'digits'}, 'model': {'name': 'mlp'},
            'algorithm': {'name': 'fedavg'}, 'compilation_cache': bad}
  with pytest.raises(config_lib.ConfigError, match='config.compilation_cache='):
    config_lib.with_defaults(config)


_RUN = """
import sys
from fedjx.experiments import runner
config = {'dataset': {'name': 'digits', 'num_clients': 8}, 'model': {'name': 'mlp'},
          'algorithm': {'name': 'fedavg'}, 'rounds': 2, 'cohort_size': 4,
          'eval_every': 2, 'checkpoint_every': 2, 'progress': False,
          'plot': False, 'tensorboard': False,
          'compilation_cache': sys.argv[2]}
runner.run(config, sys.argv[1], log=lambda m: None)
"""


def _entries(folder):
  return sorted(f for f in os.listdir(folder) if not f.startswith('.'))


@pytest.mark.slow
def test_a_second_run_compiles_nothing_new(tmp_path):
  cache = tmp_path / 'cache'
  env = dict(os.environ)
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  for name in ('first', 'second'):
    subprocess.run([sys.executable, '-c', _RUN, str(tmp_path / name), str(cache)],
                   check=True, env=env, cwd=REPO, capture_output=True)
    if name == 'first':
      first = _entries(cache)
      assert first, 'the first run cached nothing'
  assert _entries(cache) == first
  off = tmp_path / 'off'
  subprocess.run([sys.executable, '-c', _RUN, str(off), 'off'], check=True,
                 env=env, cwd=REPO, capture_output=True)
  assert not (off / 'xla_cache').exists()


_SWEEP = """
import sys
import ml_collections
from fedjx.experiments.sweeps import run
config = {'dataset': {'name': 'digits', 'num_clients': 8},
          'model': {'name': 'logistic_regression'},
          'algorithm': {'name': 'fedavg'}, 'rounds': 2, 'cohort_size': 4,
          'eval_every': 2, 'checkpoint_every': 2, 'progress': False,
          'plot': False, 'tensorboard': False,
          'compilation_cache': sys.argv[2]}
run.run_sweep(ml_collections.ConfigDict(config), sys.argv[1], [{}], [0, 1],
              log=lambda m: None)
"""


@pytest.mark.slow
def test_a_sweep_keeps_its_programs_as_a_run_does(tmp_path):
  cache = tmp_path / 'cache'
  env = dict(os.environ)
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  for name in ('first', 'second'):
    subprocess.run([sys.executable, '-c', _SWEEP, str(tmp_path / name), str(cache)],
                   check=True, env=env, cwd=REPO, capture_output=True)
    if name == 'first':
      first = _entries(cache)
      assert any('sweep_round' in f for f in first), first
  assert _entries(cache) == first
