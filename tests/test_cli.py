"""fedjx-run's command line: one-line errors, --help, --debug, builder options."""

import inspect
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import optax
import pytest

import config_files

from fedjx.experiments import cli
from fedjx.experiments import config as config_lib
from fedjx.experiments import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(REPO, 'configs', 'fedavg_digits.py')
FEDJX_RUN = os.path.join(os.path.dirname(sys.executable), 'fedjx-run')

TINY = textwrap.dedent('''
    from fedjx.experiments.config_base import base_config, optimizer

    def get_config():
      config = base_config()
      config.rounds = 2
      config.cohort_size = 4
      config.batch_size = 16
      config.local_steps = 1
      config.progress = False
      config.plot = False
      config.tensorboard = False
      config.dataset = dict(name='digits', num_clients=8, alpha=0.5)
      config.model = dict(name='logistic_regression')
      config.algorithm = dict(
          name='fedavg',
          client_optimizer=optimizer('sgd', learning_rate=0.1),
          server_optimizer=optimizer('adam', learning_rate=0.01))
      return config
''')


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp('cli') / 'tiny.py'
  path.write_text(TINY)
  return str(path)


def _run(*args, env=None):
  cmd = [FEDJX_RUN] if os.path.exists(FEDJX_RUN) else [
      sys.executable, '-m', 'fedjx.experiments.cli']
  full_env = dict(os.environ, JAX_PLATFORMS='cpu')
  full_env.pop('FEDJX_DEBUG', None)
  full_env.update(env or {})
  return subprocess.run(cmd + list(args), env=full_env, capture_output=True,
                        text=True, timeout=300)


def test_help_lists_the_flags_that_matter_with_an_example():
  out = _run('--help')
  assert out.returncode == 0
  for flag in ('--config FILE', '--workdir DIR', '--config.PATH=VALUE', '--debug',
               'example:', 'fedjx-run --config configs/fedavg_digits.py',
               'fedjx-sweep', 'fedjx-plan', 'fedjx-deploy', 'fedjx-plot'):
    assert flag in out.stdout
  assert len(out.stdout.splitlines()) < 40  # Not absl's hundreds of flags.


# (arguments after --config, words the one line must contain): one case of
# each way an error reaches the user (flag parsing, override checking,
# config validation before data loads, checks after data loads).
USER_ERRORS = [
    (['--config.rounds=abc'], ["--config.rounds='abc'", 'config.rounds takes an int']),
    (['--config.algorithm.server_optimizer.b11=0.8'],
     ["no option 'b11'", "Did you mean 'b1'"]),
    (['--config.algorithm.client_optimizer.learning_rate=nan'],
     ['client_optimizer.learning_rate=nan', 'finite']),
    (['--config.dataset.name=emnist', '--config.dataset.train_path=/no/such.h5'],
     ["train_path='/no/such.h5'", 'no such file']),
    (['--config.cohort_size=9'], ['config.cohort_size=9', 'population of 8']),
]

# The same checks in-process: (overrides, words of the ConfigError).
CONFIG_ERRORS = [
    ({'cohort_size': 0}, ['config.cohort_size=0', 'positive int']),
    ({'algorithm.server_optimizer.learning_rate': -0.5},
     ['server_optimizer.learning_rate=-0.5', 'non-negative']),
    ({'algorithm.client_optimizer.learning_rate': float('inf')},
     ['client_optimizer.learning_rate=inf', 'finite']),
    ({'nonfinite': 'ignore'}, ["config.nonfinite='ignore'", "'skip'"]),
    ({'checkpoints_to_keep': 0}, ['config.checkpoints_to_keep=0']),
    ({'dataset.name': 'emnist', 'dataset.test_path': '/no/test.h5'},
     ["test_path='/no/test.h5'", 'no such file']),
    ({'algorithm.skip_nonfinite': True}, ["no option 'skip_nonfinite'"]),
    # Checked before data loads, not by the algorithm or Algorithm.compile.
    ({'map_strategy': 'foo'}, ["config.map_strategy='foo'", "'sequential'"]),
    ({'chunk_size': 0}, ['config.chunk_size=0', 'positive int']),
    ({'algorithm.client_optimizer.momentum': 1.5},
     ['client_optimizer', 'momentum=1.5', '<= 1.0']),
    ({'algorithm.client_optimizer.learning_rate': 'abc'},
     ['client_optimizer', "learning_rate='abc'", 'must be a number']),
    ({'algorithm.local_epochs': 1.5}, ['config.algorithm.local_epochs=1.5', 'an int']),
    ({'algorithm.client_evaluation': 'no'},
     ["config.algorithm.client_evaluation='no'", 'a bool']),
    ({'dataset.num_clients': '8'}, ["config.dataset.num_clients='8'", 'an int']),
    ({'algorithm.server_optimizer': {'name': 'adam'}},
     ["optax optimizer 'adam' needs learning_rate"]),
]


@pytest.mark.parametrize('overrides,words', CONFIG_ERRORS)
def test_config_errors_are_found_before_data_loads(tiny, overrides, words):
  config = cli.load_config_file(tiny).to_dict()  # Plain: any type may be set.
  for path, value in overrides.items():
    node = config
    *parents, leaf = path.split('.')
    for part in parents:
      node = node[part]
    node[leaf] = value
  with pytest.raises(registry.ConfigError) as e:
    config_lib.validate(config)
  assert '\n' not in str(e.value)
  for word in words:
    assert word in str(e.value)


@pytest.mark.slow
def test_user_errors_are_one_line_with_exit_status_2(tiny, tmp_path):
  procs = []
  cmd = [FEDJX_RUN] if os.path.exists(FEDJX_RUN) else [
      sys.executable, '-m', 'fedjx.experiments.cli']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('FEDJX_DEBUG', None)
  for i, (args, _) in enumerate(USER_ERRORS):  # Two at a time.
    procs.append(subprocess.Popen(
        cmd + ['--config', tiny, '--workdir', str(tmp_path / str(i)), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    if len(procs) >= 2:
      procs[-2].wait(timeout=300)
  for proc, (args, words) in zip(procs, USER_ERRORS):
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, (args, err[-3000:])
    assert len(lines) == 1 and 'Traceback' not in err, (args, err[-3000:])
    for word in words:
      assert word in lines[0], (args, lines[0])
  missing = _run('--config', str(tmp_path / 'none.py'))
  assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
  assert 'no such file' in missing.stderr


def test_debug_flag_and_environment_variable_show_the_traceback(tiny, tmp_path,
                                                                monkeypatch):
  out = _run('--config', tiny, '--workdir', str(tmp_path), '--config.cohort_size=9',
             '--debug')
  assert out.returncode != 0
  assert 'Traceback' in out.stderr and 'population of 8' in out.stderr
  monkeypatch.delenv('FEDJX_DEBUG', raising=False)
  assert cli.debug_requested(['fedjx-run', '--debug'])
  assert not cli.debug_requested(['fedjx-run'])
  for value, wanted in (('1', True), ('true', True), ('0', False), ('', False)):
    monkeypatch.setenv('FEDJX_DEBUG', value)
    assert cli.debug_requested(['fedjx-run']) is wanted


@pytest.mark.slow
def test_builder_and_optimizer_options_absent_from_the_file_can_be_set(tiny, tmp_path):
  out = _run('--config', tiny, '--workdir', str(tmp_path), '--config.rounds=1',
             '--config.algorithm.client_evaluation=False',
             '--config.algorithm.server_optimizer.b1=0.8',
             '--config.algorithm.client_optimizer.momentum=0.9',
             '--config.algorithm.local_epochs=2')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / 'config.json', encoding='utf-8') as f:
    algorithm = json.load(f)['algorithm']
  assert algorithm['client_evaluation'] is False
  assert algorithm['server_optimizer'] == {'name': 'adam', 'learning_rate': 0.01,
                                           'b1': 0.8}
  assert algorithm['client_optimizer']['momentum'] == 0.9
  assert algorithm['local_epochs'] == 2 and isinstance(algorithm['local_epochs'], int)
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl', encoding='utf-8')]
  assert 'train_loss_during' in rows[1] and 'train_loss_before' not in rows[1]


def test_split_overrides_parses_by_the_builder_s_types(tiny):
  rest, extras = cli.split_overrides([
      '--config', tiny, '--config.rounds=3',
      '--config.algorithm.client_evaluation=false',
      '--config.algorithm.local_steps=4',
      '--config.algorithm.weighting=uniform',
      '--config.algorithm.server_optimizer.nesterov=True',
      '--config.algorithm.server_optimizer.eps=1e-3',
      '--config.algorithm.client_optimizer.momentum=0.5'])
  assert rest == ['--config', tiny, '--config.rounds=3']
  got = {'.'.join(p): v for p, v in extras}
  assert got == {'algorithm.client_evaluation': False, 'algorithm.local_steps': 4,
                 'algorithm.weighting': 'uniform',
                 'algorithm.server_optimizer.nesterov': True,
                 'algorithm.server_optimizer.eps': 1e-3,
                 'algorithm.client_optimizer.momentum': 0.5}
  assert type(got['algorithm.local_steps']) is int
  assert type(got['algorithm.client_optimizer.momentum']) is float


def test_overrides_follow_a_renamed_algorithm_or_optimizer(tiny):
  # fedprox's mu exists once the algorithm is fedprox; adam's b2 once the
  # client optimizer is adam (which replaces the file's sgd spec).
  _, extras = cli.split_overrides([
      '--config', tiny, '--config.algorithm.name=fedprox',
      '--config.algorithm.mu=0.1',
      '--config.algorithm.client_optimizer.name=adam',
      '--config.algorithm.client_optimizer.learning_rate=0.05',
      '--config.algorithm.client_optimizer.b2=0.95'])
  assert {'.'.join(p): v for p, v in extras} == {
      'algorithm.mu': 0.1, 'algorithm.client_optimizer': {
          'name': 'adam', 'learning_rate': 0.05, 'b2': 0.95}}
  with pytest.raises(cli.UsageError, match="no option 'mu'"):
    cli.split_overrides(['--config', tiny, '--config.algorithm.mu=0.1'])


def test_an_optimizer_the_file_leaves_to_the_builder_needs_its_name(tmp_path):
  path = tmp_path / 'plain.py'
  plain = re.sub(r",\s*server_optimizer=optimizer\('adam', learning_rate=0.01\)",
                 '', TINY)
  assert 'server_optimizer' not in plain
  path.write_text(plain)
  with pytest.raises(cli.UsageError, match='server_optimizer.name='):
    cli.split_overrides(['--config', str(path),
                         '--config.algorithm.server_optimizer.b1=0.8'])
  _, extras = cli.split_overrides([
      '--config', str(path), '--config.algorithm.server_optimizer.name=adam',
      '--config.algorithm.server_optimizer.learning_rate=0.01',
      '--config.algorithm.server_optimizer.b1=0.8'])
  config = cli.load_config_file(str(path))
  cli.apply_overrides(config, extras)
  assert config.algorithm.server_optimizer.to_dict() == {
      'name': 'adam', 'learning_rate': 0.01, 'b1': 0.8}
  config_lib.validate(config)


def test_parse_value_types():
  def f(a: float = 1, b: int | None = None, c: bool = False, d=(1, 2)):
    del a, b, c, d
  p = inspect.signature(f).parameters
  assert cli.parse_value('2', p['a'], 'a') == 2.0 and isinstance(
      cli.parse_value('2', p['a'], 'a'), float)
  assert cli.parse_value('None', p['b'], 'b') is None
  assert cli.parse_value('7', p['b'], 'b') == 7
  assert cli.parse_value('yes', p['c'], 'c') is True
  assert cli.parse_value('(3, 4)', p['d'], 'd') == (3, 4)
  with pytest.raises(cli.UsageError, match="'x': not an int"):
    cli.parse_value('x', p['b'], 'b')
  momentum = inspect.signature(optax.sgd).parameters['momentum']
  assert cli.parse_value('0.9', momentum, 'm') == 0.9


def test_skip_nonfinite_is_reserved_for_the_runner():
  assert 'skip_nonfinite' in registry.RESERVED
  for name in registry.ALGORITHMS:
    assert 'skip_nonfinite' not in registry.builder_options(name)


@pytest.mark.slow
def test_a_nonfinite_run_is_one_line_with_exit_status_2(tiny, tmp_path):
  out = _run('--config', tiny, '--workdir', str(tmp_path), '--config.rounds=4',
             '--config.algorithm.server_optimizer.learning_rate=1e38')
  assert out.returncode == 2, out.stderr[-3000:]
  # Before it, only the runner's progress lines about compiling the round.
  lines = [l for l in out.stderr.strip().splitlines()
           if not l.startswith('fedjx: compil')]
  assert len(lines) == 1 and 'Traceback' not in out.stderr
  assert lines[0].startswith('fedjx-run: round ') and 'NaN or Inf' in lines[0]


def test_a_fedbuff_concurrency_below_the_cohort_names_both_fields():
  config = config_files.load(os.path.join(REPO, 'configs', 'fedbuff_digits.py'))
  with config.unlocked():
    config.algorithm.concurrency = 5
  with pytest.raises(registry.ConfigError) as e:
    config_lib.validate(config)  # Before any data loads.
  text = str(e.value)
  assert 'config.algorithm.concurrency=5' in text
  assert f'config.cohort_size={config.cohort_size}' in text
  assert 'buffer_size' not in text  # The user set neither buffer nor size.


# Config files that fail: (file text, words of the one line, besides the
# file's path). The line of a raise is named.
BAD_CONFIG_FILES = {
    'raises': ('x = 1\ndef get_config():\n  raise RuntimeError("boom")\n',
               ['get_config() raised RuntimeError', ':3:', 'boom']),
    'raises_on_import': ('import math\nimport no_such_module_here\n',
                         ['loading the file raised ModuleNotFoundError', ':2:']),
    'syntax': ('def get_config(:\n  pass\n', ['SyntaxError', ':1:']),
    'dict': ('def get_config():\n  return {"rounds": 1}\n',
             ['returned a dict', 'ml_collections.ConfigDict']),
    'list': ('def get_config():\n  return [1]\n', ['returned a list']),
    'none': ('def get_config():\n  pass\n', ['returned None']),
    'no_get_config': ('rounds = 1\n', ['defines no get_config()']),
}


def test_a_config_file_that_raises_or_returns_no_configdict_is_one_line(tmp_path):
  procs = {}
  for name, (text, _) in BAD_CONFIG_FILES.items():
    (tmp_path / f'{name}.py').write_text(text)
  cmd = [FEDJX_RUN] if os.path.exists(FEDJX_RUN) else [
      sys.executable, '-m', 'fedjx.experiments.cli']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('FEDJX_DEBUG', None)
  for name in BAD_CONFIG_FILES:  # Two at a time.
    procs[name] = subprocess.Popen(
        cmd + ['--config', str(tmp_path / f'{name}.py'), '--workdir',
               str(tmp_path / 'w')],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if len(procs) >= 2:
      list(procs.values())[-2].wait(timeout=300)
  for name, proc in procs.items():
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, (name, err[-3000:])
    assert len(lines) == 1 and 'Traceback' not in err, (name, err[-3000:])
    assert str(tmp_path / f'{name}.py') in lines[0], (name, lines[0])
    for word in BAD_CONFIG_FILES[name][1]:
      assert word in lines[0], (name, lines[0])
  assert not (tmp_path / 'w').exists()


@pytest.mark.slow
def test_fields_that_hold_none_can_be_set(tiny, tmp_path):
  from fedjx.experiments import config_base  # pylint: disable=import-outside-toplevel
  assert config_base.base_config().privacy.target_epsilon is None
  out = _run('--config', tiny, '--workdir', str(tmp_path), '--config.rounds=0',
             '--config.algorithm.name=dp_fedavg',
             '--config.privacy.target_epsilon=1.5', '--config.privacy.delta=1e-5')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / 'config.json', encoding='utf-8') as f:
    privacy = json.load(f)['privacy']
  assert privacy['target_epsilon'] == 1.5 and privacy['delta'] == 1e-5
  # A None in a builder's options (not a placeholder), by the option's type;
  # a None field elsewhere, by its schema type or as a literal.
  path = tmp_path / 'nones.py'
  path.write_text(TINY.replace("alpha=0.5", "alpha=None").replace(
      'return config', 'config.local_steps = None\n'
      '  config.privacy = dict(target_epsilon=None, audit=None)\n  return config'))
  rest, extras = cli.split_overrides([
      '--config', str(path), '--config.dataset.alpha=1', '--config.local_steps=3',
      '--config.privacy.target_epsilon=2', '--config.privacy.audit.canaries=10',
      '--config.rounds=1'])
  # local_steps stays base_config's int placeholder: ml_collections sets it.
  assert rest == ['--config', str(path), '--config.local_steps=3',
                  '--config.rounds=1']
  got = {'.'.join(p): v for p, v in extras}
  assert got == {'dataset.alpha': 1.0, 'privacy.target_epsilon': 2.0,
                 'privacy.audit.canaries': 10}
  assert [type(got[k]) for k in sorted(got)] == [float, int, float]
  config = cli.apply_overrides(cli.load_config_file(str(path)), extras)
  assert config.dataset.alpha == 1.0 and config.privacy.audit.canaries == 10


SGD_SERVER = TINY.replace("optimizer('adam', learning_rate=0.01)",
                          "optimizer('sgd', learning_rate=2.0, momentum=0.9)")


def test_naming_another_optimizer_drops_the_file_s_options_for_the_old_one(tmp_path):
  path = tmp_path / 'sgd_server.py'
  path.write_text(SGD_SERVER)
  flag = '--config.algorithm.server_optimizer'
  # adam has no default learning rate: the file's sgd 2.0 is not kept.
  with pytest.raises(cli.UsageError) as e:
    cli.split_overrides(['--config', str(path), f'{flag}.name=adam'])
  assert "adam needs learning_rate" in str(e.value)
  assert "sgd(learning_rate=2.0, momentum=0.9)" in str(e.value)
  assert f'{flag}.learning_rate=VALUE' in str(e.value)
  notes = []
  rest, extras = cli.split_overrides(
      ['--config', str(path), f'{flag}.name=adam', f'{flag}.learning_rate=0.01',
       f'{flag}.b1=0.8'], notes)
  assert rest == ['--config', str(path)]
  config = cli.apply_overrides(cli.load_config_file(str(path)), extras)
  assert config.algorithm.server_optimizer.to_dict() == {
      'name': 'adam', 'learning_rate': 0.01, 'b1': 0.8}
  config_lib.validate(config)
  assert len(notes) == 1 and 'adam(learning_rate=0.01, b1=0.8)' in notes[0]
  assert 'sgd(learning_rate=2.0, momentum=0.9)' in notes[0]
  # The same name keeps the file's options.
  _, extras = cli.split_overrides(['--config', str(path), f'{flag}.name=sgd',
                                   f'{flag}.nesterov=True'])
  config = cli.apply_overrides(cli.load_config_file(str(path)), extras)
  assert config.algorithm.server_optimizer.to_dict() == {
      'name': 'sgd', 'learning_rate': 2.0, 'momentum': 0.9, 'nesterov': True}


def test_the_applied_optimizer_is_printed(tmp_path):
  path = tmp_path / 'sgd_server.py'
  path.write_text(SGD_SERVER)
  out = _run('--config', str(path), '--workdir', str(tmp_path / 'w'),
             '--config.rounds=0',
             '--config.algorithm.server_optimizer.name=adam',
             '--config.algorithm.server_optimizer.learning_rate=0.01')
  assert out.returncode == 0, out.stderr[-3000:]
  assert ('fedjx-run: config.algorithm.server_optimizer is adam(learning_rate=0.01)'
          in out.stderr)
  with open(tmp_path / 'w' / 'config.json', encoding='utf-8') as f:
    assert json.load(f)['algorithm']['server_optimizer'] == {
        'name': 'adam', 'learning_rate': 0.01}


def test_a_config_resolves_here_first_then_in_the_shipped_configs(tmp_path,
                                                                  monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert cli.resolve_config('configs/fedavg_digits.py') == DIGITS
  assert cli.resolve_config('fedavg_digits.py:arg') == DIGITS + ':arg'
  (tmp_path / 'configs').mkdir()
  own = tmp_path / 'configs' / 'fedavg_digits.py'
  own.write_text(TINY)
  assert cli.resolve_config('configs/fedavg_digits.py') == 'configs/fedavg_digits.py'
  with pytest.raises(cli.UsageError) as e:
    cli.resolve_config('fedavg_digit.py')
  text = str(e.value)
  assert "no such file 'fedavg_digit.py' here or in" in text
  assert "Did you mean 'fedavg_digits.py'?" in text and '--list=configs' in text
  with pytest.raises(cli.UsageError, match="no such file '/no/such.py'"):
    cli.resolve_config('/no/such.py')


def test_a_shipped_config_runs_from_any_folder(tmp_path):
  out = subprocess.run(
      [FEDJX_RUN, '--config', 'configs/fedavg_digits.py', '--config.rounds=abc'],
      cwd=tmp_path, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  # Found and loaded: the error is about the value, not the file.
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip() == (
      "fedjx-run: --config.rounds='abc': config.rounds takes an int (the config "
      "has 300), not 'abc'.")


@pytest.mark.parametrize('override,words', [
    ('rounds=3.5', ["--config.rounds='3.5'", 'takes an int', 'has 300']),
    ('plot=maybe', ["--config.plot='maybe'", 'takes True or False']),
    ('algorithm.client_optimizer.learning_rate=x',
     ["learning_rate='x'", 'config.algorithm.client_optimizer.learning_rate takes '
      'a number', 'has 0.3']),
])
def test_a_value_of_the_wrong_type_names_the_field_and_the_type(override, words):
  with pytest.raises(cli.UsageError) as e:
    cli.split_overrides(['--config', DIGITS, f'--config.{override}'])
  for word in words:
    assert word in str(e.value)
  # What absl parses is accepted as before.
  rest, _ = cli.split_overrides(['--config', DIGITS, '--config.rounds=0x10',
                                 '--config.plot=false'])
  assert '--config.rounds=0x10' in rest


def test_help_and_config_errors_answer_before_jax_is_imported(tiny, tmp_path):
  raising = tmp_path / 'raising.py'
  raising.write_text('def get_config():\n  raise ValueError("bad")\n')
  for args in (['--help'], ['--config', tiny, '--config.rounds=abc'],
               ['--config', tiny, '--config.rounds=-1'],
               ['--config', tiny, '--config.no_such_field=1'],
               ['--config', str(tmp_path / 'missing.py')],
               ['--config', str(raising)]):
    cmd = [sys.executable, '-X', 'importtime', FEDJX_RUN, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS='cpu'))
    imported = [l.rsplit('|', 1)[-1].strip() for l in out.stderr.splitlines()
                if l.startswith('import time:')]
    assert out.returncode == (0 if args == ['--help'] else 2), out.stderr[-2000:]
    assert 'jax' not in imported, args


def test_a_workdir_s_checkpoint_and_the_names_answer_before_jax(tiny, tmp_path):
  from fedjx.experiments import runner  # pylint: disable=import-outside-toplevel
  done = str(tmp_path / 'done')
  runner.run(cli.load_config_file(tiny), done, log=lambda m: None)
  cases = [
      (['--config.algorithm.name=fedavgg'], 2, "unknown algorithm 'fedavgg'. Did "
       "you mean 'fedavg'?"),
      (['--config.cohort_size=9'], 2, 'config.cohort_size=9 is larger than the '
       'training population of 8 clients; it must be at most 8.'),
      (['--workdir', done, '--config.seed=4'], 2, 'holds a checkpoint of a '
       'different experiment (seed: 0 -> 4)'),
      (['--workdir', done], 0, f'fedjx-run: {done} holds this run, finished after '
       'round 2: nothing to train'),
  ]
  for args, status, words in cases:
    if '--workdir' not in args:
      args = args + ['--workdir', str(tmp_path / 'new')]
    cmd = [sys.executable, '-X', 'importtime', FEDJX_RUN, '--config', tiny, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS='cpu'))
    imported = [l.rsplit('|', 1)[-1].strip() for l in out.stderr.splitlines()
                if l.startswith('import time:')]
    lines = [l for l in out.stderr.splitlines() if not l.startswith('import time:')]
    assert out.returncode == status, out.stderr[-2000:]
    assert 'jax' not in imported, args
    assert len(lines) == 1 and words in lines[0], (args, lines)
    assert not (tmp_path / 'new').exists()  # Nothing left behind.
  assert out.stdout.splitlines()[-1] == (
      f'fedjx-run: done; metrics, checkpoints and learning_curve.png in {done}')


def _wait_until_caught(pid, signum, timeout_s=60.0):
  """Waits until process ``pid`` catches ``signum`` (Linux: the SigCgt mask
  of /proc/PID/status); elsewhere half a second."""
  status = f'/proc/{pid}/status'
  if not os.path.exists(status):
    time.sleep(0.5)
    return
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    with open(status) as f:
      caught = next((int(line.split()[1], 16) for line in f
                     if line.startswith('SigCgt:')), 0)
    if caught >> (signum - 1) & 1:
      return
    time.sleep(0.01)
  raise AssertionError(f'process {pid} never caught signal {signum}')


def test_fedjx_run_handles_a_signal_while_it_imports():
  proc = subprocess.Popen([FEDJX_RUN, '--config', DIGITS], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
  # Once its SIGTERM handler is in place (its first lines), while JAX and
  # the training machinery still import (a second or more).
  _wait_until_caught(proc.pid, signal.SIGTERM)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-2000:]
  assert err.strip() == ('fedjx-run: stopped by SIGTERM; the workdir keeps its '
                         'last complete checkpoint, if any.')


def test_a_start_up_signal_is_not_lost_in_a_callback_that_swallows_exceptions():
  # While JAX imports, a signal can land in importlib's module-lock callback,
  # where Python ignores exceptions: a handler raising KeyboardInterrupt there
  # was lost and the run went on (exit status 0). A weakref callback is such
  # a place, deterministically.
  code = textwrap.dedent('''
      import os, signal, weakref
      from fedjx.experiments import cli
      cli._Signals('fedjx-run').install()
      class A: pass
      a = A()
      def callback(ref):
        os.kill(os.getpid(), signal.SIGTERM)  # Handled inside the callback.
        sum(range(1000))
      ref = weakref.ref(a, callback)
      del a
      print('went on')
  ''')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('FEDJX_DEBUG', None)
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       timeout=120, env=env)
  assert out.returncode == 143 and 'went on' not in out.stdout, out.stderr[-2000:]
  assert out.stderr.strip() == ('fedjx-run: stopped by SIGTERM; the workdir keeps '
                                'its last complete checkpoint, if any.')


def test_a_signal_at_any_time_of_start_up_is_one_line_and_128_plus_n(tmp_path):
  # scripts/run.py handles signals from its first line, before fedjx and JAX
  # are imported; the times are drawn from a seeded RNG over the imports,
  # the flag parsing and the data loading (about 2 s here).
  rng = random.Random('20261201:start-up signals')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('FEDJX_DEBUG', None)
  for i, sig in enumerate([signal.SIGTERM, signal.SIGINT, signal.SIGTERM,
                           signal.SIGTERM]):
    at = rng.uniform(0.05, 1.5)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, 'scripts', 'run.py'), '--config', DIGITS,
         '--workdir', str(tmp_path / str(i))], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(at)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (at, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and signal.Signals(sig).name in lines[0], (at, err[-2000:])
