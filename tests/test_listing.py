"""``fedjx-run --list``: the shipped configs and the registries, read from the code."""

import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest

from fedjx import algorithms
from fedjx.experiments import listing
from fedjx.experiments import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, 'configs')
FEDJX_RUN = os.path.join(os.path.dirname(sys.executable), 'fedjx-run')


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('FEDJX_DEBUG', None)
  return subprocess.run([sys.executable, '-X', 'importtime', FEDJX_RUN, *args],
                        capture_output=True, text=True, timeout=120, cwd=REPO,
                        env=env)


def _imported(stderr):
  return [l.rsplit('|', 1)[-1].strip() for l in stderr.splitlines()
          if l.startswith('import time:')]


def _config_module(path):
  name = '_listed_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_config_file_is_listed_with_its_argument_and_docstring():
  out = _run('--list=configs')
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'jax' not in _imported(out.stderr)  # Read with ast, nothing imported.
  lines = out.stdout.splitlines()
  files = sorted(f for f in os.listdir(CONFIGS) if f.endswith('.py'))
  assert lines[0] == (f'configs/ ({len(files)} configs; fedjx-run --config '
                      'configs/NAME.py[:ARG] runs one from any folder):')
  rows = {l.split()[0]: l.split(None, 1)[1] for l in lines[1:]}
  # The reference: each file executed, its get_config's signature and
  # docstring read by Python itself.
  expected = {}
  for name in files:
    module = _config_module(os.path.join(CONFIGS, name))
    params = list(inspect.signature(module.get_config).parameters.values())
    if params:
      name += f'[:{params[0].name}={params[0].default}]'
    expected[name] = ' '.join(module.__doc__.split('\n\n')[0].split())
  assert {k: re.sub(r'``([^`]+)``', r'\1', v) for k, v in expected.items()} == rows
  assert rows['diloco_text.py[:replicas=4]'] == (
      "DiLoCo on the standard library's source: K data-parallel replicas.")


def test_the_algorithms_listed_are_the_registry_s_in_its_order():
  text = listing.render('algorithms')
  lines = text.splitlines()
  assert lines[0].startswith(f'algorithms ({len(registry.ALGORITHMS)}; ')
  assert [l.split()[0] for l in lines[1:]] == list(registry.ALGORITHMS)
  assert 'fedbuff ' in text and re.search(r'\n  fedbuff .*\[asynchronous\]\n', text)
  assert re.search(r'\n  scaffold .*\[per-client state over num_clients\]\n', text)


def test_one_algorithm_s_options_are_its_builder_s_parameters():
  text = listing.render('fedprox')
  rows = {l.split()[0]: l.split()[1] for l in text.splitlines()[3:]}
  # Its own parameters and the options its traits declare (FedAvg's but the
  # client transform it sets), less the runner's.
  expected = {n: repr(p.default)
              for n, p in registry.builder_options('fedprox').items()}
  assert rows == expected
  own = inspect.signature(algorithms.fedprox).parameters
  assert rows['mu'] == repr(own['mu'].default)
  assert rows['local_epochs'] == '1' and 'client_transform' not in rows
  assert not set(rows) & set(registry.RESERVED)
  scaffold = listing.render('scaffold')
  assert re.search(r'\n  num_clients +\(required\) +int \(the runner sets the '
                   r'population size unless given\)\n', scaffold)
  fedadam = listing.render('fedadam')  # FedAvg's options but the one it sets.
  assert re.search(r'\n  client_optimizer +None +optax optimizer', fedadam)
  assert not re.search(r'\n  server_optimizer ', fedadam)
  digits = listing.render('digits')
  assert digits.splitlines()[0].startswith('dataset digits: ')
  assert re.search(r'\n  num_clients +50 +int\n', digits)


def test_listing_something_unknown_is_one_line():
  out = _run('--list=fedavgg')
  assert out.returncode == 2
  assert out.stdout == ''
  lines = [l for l in out.stderr.splitlines() if not l.startswith('import time:')]
  assert lines == [
      "fedjx-run: --list='fedavgg' is not listable. Did you mean 'fedavg'? Give "
      '--list=configs, --list=algorithms, --list=datasets, --list=models, or '
      '--list=NAME for one registered name.']


def _listed_in_docs():
  """``(file, what, shown)`` for every ``$ fedjx-run --list=WHAT`` in the docs."""
  found = []
  paths = [os.path.join(REPO, 'README.md')] + [
      os.path.join(REPO, 'docs', f) for f in sorted(os.listdir(os.path.join(REPO, 'docs')))
      if f.endswith('.md')]
  for path in paths:
    with open(path, encoding='utf-8') as f:
      text = f.read()
    for block in re.findall(r'```[^\n]*\n(.*?)```', text, re.S):
      parts = re.split(r'^\$ fedjx-run --list(?:=(\S+))?\n', block, flags=re.M)
      for what, shown in zip(parts[1::2], parts[2::2]):
        found.append((os.path.relpath(path, REPO), what or 'all', shown))
  return found


def test_the_docs_show_what_the_list_command_prints(monkeypatch):
  monkeypatch.chdir(REPO)  # The docs show configs/ as seen from the repository.
  shown = _listed_in_docs()
  assert {what for _, what, _ in shown} >= set(listing.KINDS)
  for path, what, text in shown:
    assert text == listing.render(what), (
        f'{path}: the output of fedjx-run --list={what} differs from the code; '
        f'paste the output of `fedjx-run --list={what}` (run in the repository).')


@pytest.mark.parametrize('args', [['--list'], ['--list', 'models']])
def test_a_bare_list_prints_every_kind_and_a_value_may_follow(args, monkeypatch):
  monkeypatch.chdir(REPO)
  out = _run(*args)
  assert out.returncode == 0, out.stderr[-2000:]
  text = out.stdout
  assert text == listing.render('all' if args == ['--list'] else 'models')
