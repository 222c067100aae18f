"""What fedjx-run tells before JAX: names, population, the workdir's checkpoint.

References: the registries and the data builders themselves (the names and
populations read from their source must be theirs), the run's own checks
(each line the preflight gives must be the line the run gives), and a run
made here (the finished and the different-experiment workdirs).
"""

import inspect
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from fedjx.experiments import config as config_lib
from fedjx.experiments import experiment
from fedjx.experiments import preflight
from fedjx.experiments import registry
from fedjx.experiments import runner
from fedjx.experiments import workdir as workdir_lib
from fedjx.experiments import workdir_lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**changes):
  config = ml_collections.ConfigDict({
      'rounds': 2, 'cohort_size': 4, 'batch_size': 16, 'local_steps': 1,
      'eval_every': 1, 'checkpoint_every': 1, 'progress': False,
      'tensorboard': False, 'plot': False,
      'dataset': {'name': 'digits', 'num_clients': 8, 'alpha': 0.5},
      'model': {'name': 'logistic_regression'},
      'algorithm': {'name': 'fedavg'}})
  for path, value in changes.items():
    node = config
    *parents, leaf = path.split('.')
    for part in parents:
      node = node[part]
    with config.unlocked():
      node[leaf] = value
  return config_lib.with_defaults(config)


def test_the_names_read_from_the_source_are_the_registries():
  # In a fresh process: the shipped registries, nothing registered by a test.
  code = ('import json; from fedjx.experiments import preflight, registry; '
          'print(json.dumps([[preflight.source_names(k), sorted(getattr(registry, t))] '
          'for k, t in (("algorithm", "ALGORITHMS"), ("dataset", "DATASETS"), '
          '("model", "MODELS"))]))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  for from_source, registered in json.loads(out.stdout.strip().splitlines()[-1]):
    assert from_source == registered and registered


def test_the_populations_read_from_the_source_are_the_builders():
  declared = []
  for name, builder in registry.DATASETS.items():
    option = getattr(builder, 'population', None)
    params = inspect.signature(builder).parameters
    want = None if option is None else params[option].default
    assert preflight.source_population(name, {}) == want, name
    if option is not None:
      assert preflight.source_population(name, {option: 7}) == 7
      declared.append(name)
  assert sorted(declared) == ['digits', 'synthetic']
  # What is declared holds: the population has at most that many clients.
  for name in declared:
    data = registry.build_dataset({'name': name, 'num_clients': 7}, seed=0)
    assert data.train.num_clients <= 7


@pytest.mark.parametrize('changes', [
    {'algorithm.name': 'fedavgg'}, {'dataset.name': 'digit'},
    {'model.name': 'mlpp'}])
def test_an_unknown_name_is_the_run_s_line(changes):
  config = _config(**changes)
  with pytest.raises(config_lib.ConfigError) as want:
    config_lib.validate(config)
  with pytest.raises(config_lib.ConfigError) as got:
    preflight.check_config(config)
  assert str(got.value) == str(want.value)
  assert 'Did you mean' in str(got.value)


@pytest.mark.parametrize('changes', [
    {'cohort_size': 9}, {'cohort_size': 51, 'dataset.num_clients': None},
    {'cohort_size': 31, 'dataset': {'name': 'synthetic', 'alpha': 1.0}}])
def test_a_cohort_larger_than_the_population_is_the_run_s_line(changes):
  dataset = changes.pop('dataset', None)
  config = _config(**changes)
  with config.unlocked():
    if dataset is not None:
      config.dataset = dataset
    if 'num_clients' in config.dataset and config.dataset.num_clients is None:
      del config.dataset['num_clients']  # The builder's default, 50.
  with pytest.raises(config_lib.ConfigError) as want:
    experiment.build(config)
  with pytest.raises(config_lib.ConfigError) as got:
    preflight.check_config(config)
  assert str(got.value) == str(want.value)
  preflight.check_config(_config(cohort_size=8))  # At most the population: fine.


def test_names_registered_by_a_config_file_are_known():
  registry.register_model('preflight_model', registry.MODELS['mlp'])
  try:
    preflight.check_config(_config(**{'model.name': 'preflight_model'}))
  finally:
    registry.MODELS.pop('preflight_model')


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('preflight') / 'done')
  runner.run(_config(), workdir, log=lambda m: None)
  return workdir


def test_a_finished_run_is_told_from_its_files(finished):
  done = preflight.check_workdir(_config(), finished)
  assert done is not None and done.step == 2
  with open(os.path.join(finished, 'metrics.jsonl'), encoding='utf-8') as f:
    rows = [json.loads(line) for line in f]
  assert done.row == [r for r in rows if r['round'] == 2][-1]
  assert 'eval_accuracy' in done.row
  # More rounds, or a plot the run would still draw: the run decides.
  assert preflight.check_workdir(_config(rounds=3), finished) is None
  assert preflight.check_workdir(_config(plot=True), finished) is None
  # A change that may come with resumption: still finished.
  assert preflight.check_workdir(_config(eval_every=2), finished) is not None
  # The run saved its placement resolved from 'auto' (the default); rerun
  # under 'auto' or under what it resolved to, the run is finished.
  with open(os.path.join(finished, 'config.json'), encoding='utf-8') as f:
    assert json.load(f)['client_state']['placement'] == 'store'
  explicit = _config()
  explicit.client_state = {'placement': 'store'}
  assert preflight.check_workdir(explicit, finished) is not None


def test_another_experiment_is_the_run_s_line(finished, tmp_path):
  other = _config(seed=3)
  with pytest.raises(config_lib.ConfigError) as got:
    preflight.check_workdir(other, finished)
  with pytest.raises(config_lib.ConfigError) as want:
    runner.run(other, finished, log=lambda m: None)
  assert str(got.value) == str(want.value)
  assert 'seed: 0 -> 3' in str(got.value)


def test_a_workdir_in_use_is_refused(finished, tmp_path):
  with workdir_lock.hold(finished):
    with pytest.raises(workdir_lock.WorkdirLocked, match='is in use by pid'):
      preflight.check_workdir(_config(), finished)
  # One that a run holds before it has written anything, too; a free one
  # is left as it is (no lock file made).
  starting = tmp_path / 'starting'
  starting.mkdir()
  with workdir_lock.hold(str(starting)):
    with pytest.raises(workdir_lock.WorkdirLocked, match='is in use by pid'):
      preflight.check_workdir(_config(), str(starting))
  free = tmp_path / 'free'
  free.mkdir()
  assert preflight.check_workdir(_config(), str(free)) is None
  assert os.listdir(free) == []


def test_a_damaged_checkpoint_is_left_to_the_run(finished, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  copy = str(tmp_path / 'copy')
  shutil.copytree(finished, copy)
  meta = os.path.join(copy, 'checkpoints', '2', 'meta', 'metadata')
  with open(meta, 'a', encoding='utf-8') as f:
    f.write(' ')  # Its manifest no longer matches.
  assert preflight.check_workdir(_config(), copy) is None
  assert preflight.saved_meta(copy) is None


def test_a_refused_run_leaves_nothing_behind(tmp_path):
  # Found by the run itself (once the data loads), not before.
  nested = tmp_path / 'runs' / 'a' / 'b'
  with pytest.raises(config_lib.ConfigError, match='population of 8'):
    runner.run(_config(cohort_size=9), str(nested), log=lambda m: None)
  assert not (tmp_path / 'runs').exists()
  kept = tmp_path / 'kept'
  kept.mkdir()
  (kept / 'notes.txt').write_text('mine')
  with pytest.raises(config_lib.ConfigError):
    runner.run(_config(cohort_size=9), str(kept), log=lambda m: None)
  assert kept.is_dir() and os.listdir(kept) == ['notes.txt']


def test_a_made_folder_is_kept_once_something_else_is_written(tmp_path):
  path = tmp_path / 'w'
  with pytest.raises(RuntimeError):
    with workdir_lib.made(str(path)) as made:
      (path / '.lock').write_text('')
      (path / 'metrics.jsonl').write_text('{}\n')
      (path / 'checkpoints').mkdir()
      assert made == str(path)
      raise RuntimeError
  assert sorted(os.listdir(path)) == ['.lock', 'checkpoints', 'metrics.jsonl']
  with workdir_lib.made(str(tmp_path / 'ok')):
    pass
  assert (tmp_path / 'ok').is_dir()
