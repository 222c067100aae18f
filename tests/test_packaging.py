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


def _run(code):
  import subprocess
  import sys
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_subpackages_are_reachable_after_import_fedjx_and_imported_lazily():
  out = _run(
      'import sys, fedjx\n'
      "eager = [m for m in fedjx.SUBPACKAGES if 'fedjx.' + m in sys.modules]\n"
      'print(eager)\n'
      'print(callable(fedjx.algorithms.fedavg), fedjx.datasets.Cohort.__name__,\n'
      "      callable(fedjx.models.mlp), 'fedjx.algorithms' in sys.modules)\n"
      "print(sorted(set(fedjx.SUBPACKAGES) - set(dir(fedjx))))\n")
  assert out.splitlines() == ['[]', 'True Cohort True True', '[]']


def test_import_fedjx_is_light_and_every_module_is_reachable():
  out = _run(
      'import sys, fedjx\n'
      "print('jax' in sys.modules)\n"
      'print([m for m in fedjx.MODULES if not hasattr(fedjx, m)])\n'
      'print(callable(fedjx.mapping.any_in_chunk), callable(fedjx.program),\n'
      "      fedjx.reduce_sum_p.name, 'jax' in sys.modules)\n")
  assert out.splitlines() == ['False', '[]', 'True True fedjx_reduce_sum True']


def test_the_runner_s_imports_leave_the_heavy_optional_libraries_unimported():
  # SciPy, scikit-learn, tensorflow_datasets and dp_accounting cost 1.5 s of
  # a run's start; the functions that need them import them when called.
  out = _run(
      'import sys, fedjx\n'
      'from fedjx import algorithms, datasets\n'
      'from fedjx.algorithms import privacy\n'
      'from fedjx.algorithms.privacy import audit, distributed_dp\n'
      'from fedjx.datasets import digits, tfds_source\n'
      'from fedjx.experiments import guarded_rounds, processes\n'
      "heavy = ('scipy', 'sklearn', 'tensorflow_datasets', 'dp_accounting')\n"
      'print([m for m in heavy if m in sys.modules])\n')
  assert out.splitlines() == ['[]']


def test_help_names_the_subpackages():
  out = _run('import fedjx, pydoc; print(pydoc.render_doc(fedjx, renderer=pydoc.plaintext))')
  for name in ('fedjx.algorithms', 'fedjx.datasets', 'fedjx.models', 'fedjx.experiments'):
    assert name in out
  import fedjx
  try:
    fedjx.no_such_thing  # noqa: B018
  except AttributeError as e:
    assert 'no_such_thing' in str(e)
  else:
    raise AssertionError('fedjx.no_such_thing did not raise')


# The optional dependencies (setup.cfg's extras), by the module they install.
OPTIONAL = ('apache_beam', 'flwr', 'tensorboard')


def test_help_works_and_imports_no_optional_dependency():
  # help(fedjx) reads every name dir(fedjx) lists; a lazy fedjx.beam there
  # imported Apache Beam, and without it help(fedjx) raised.
  code = (
      'import sys\n'
      f'for name in {OPTIONAL!r}:\n'
      '  sys.modules[name] = None  # importing it raises ImportError\n'
      'import contextlib, io, pydoc, fedjx, fedjx.interpreters\n'
      'with contextlib.redirect_stdout(io.StringIO()) as shown:\n'
      '  help(fedjx)\n'
      'text = pydoc.render_doc(fedjx, renderer=pydoc.plaintext)\n'
      'pydoc.render_doc(fedjx.interpreters, renderer=pydoc.plaintext)\n'
      "print('fedjx.algorithms' in shown.getvalue(), 'broadcast' in text)\n"
      'try:\n'
      '  fedjx.beam\n'
      'except ModuleNotFoundError as e:\n'
      '  print(e)\n')
  # fedjx is on no package index: from this checkout, the extra installs
  # with pip install -e (the path '.' where the command runs in it).
  here = "'.[beam]'" if pathlib.Path.cwd().resolve() == REPO else f"'{REPO}[beam]'"
  assert _run(code).splitlines() == [
      'True True',
      f'fedjx.beam needs apache_beam, which is not installed: pip install -e {here}.']
  # Installed (the test extra installs Apache Beam), they stay unimported.
  out = _run('import io, contextlib, sys, fedjx, fedjx.interpreters\n'
             'with contextlib.redirect_stdout(io.StringIO()):\n'
             '  help(fedjx)\n'
             '  help(fedjx.interpreters)\n'
             f'print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))\n'
             "print(callable(fedjx.beam.run), 'beam' in dir(fedjx))\n")
  assert out.splitlines() == ['[]', 'True True']


def test_the_install_command_of_an_extra_is_the_checkout_s_or_its_requirements(
    monkeypatch, tmp_path):
  from fedjx import _install  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(REPO)
  assert _install.command('flower') == "pip install -e '.[flower]'"
  monkeypatch.chdir(tmp_path)
  assert _install.command('flower') == f"pip install -e '{REPO}[flower]'"
  # Installed from a wheel (no checkout around it): the extra's own
  # requirements, as setup.cfg declares them.
  monkeypatch.setattr(_install, '_checkout', lambda: None)
  assert _install.requirements('flower') == ['flwr>=1.42']
  assert _install.command('flower') == "pip install 'flwr>=1.42'"
  assert _install.command('beam') == "pip install 'apache-beam>=2.60'"


def test_hypergradient_demo_writes_into_its_workdir_unless_told():
  spec = importlib.util.spec_from_file_location(
      'hypergradient_demo', REPO / 'scripts' / 'hypergradient_demo.py')
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  args = demo.parse_args([])
  assert pathlib.Path(args.plot) == pathlib.Path('runs/hypergradient_demo/tuner_lr_trajectory.png')
  assert not pathlib.Path(args.plot).resolve().is_relative_to(REPO / 'benchmarks' / 'results')
  args = demo.parse_args(['--workdir', '/tmp/x'])
  assert args.plot == '/tmp/x/tuner_lr_trajectory.png'
  assert demo.parse_args(['--plot', 'a.png']).plot == 'a.png'


def test_the_benchmark_is_the_repository_s_tooling_not_the_package_s():
  # benchmarks/ holds it; the installed package holds the framework only.
  assert importlib.util.find_spec('fedjx.experiments.benchmark') is None
  for folder in ('fedjx', 'algorithms', 'datasets', 'models', 'experiments'):
    assert not list((REPO / folder).rglob('benchmark*.py')), folder
  assert (REPO / 'benchmarks' / 'round_bench.py').is_file()
  import setuptools.config.setupcfg  # pylint: disable=import-outside-toplevel
  options = setuptools.config.setupcfg.read_configuration(REPO / 'setup.cfg')['options']
  assert not [p for p in options['packages'] if 'bench' in p]
  assert 'benchmarks' not in options['package_dir'].values()


def test_the_benchmark_script_finds_its_module_from_any_directory(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  out = subprocess.run([sys.executable, str(REPO / 'scripts' / 'benchmark.py'), '--help'],
                       capture_output=True, text=True, timeout=120, check=False,
                       cwd=tmp_path)
  assert 'ModuleNotFoundError' not in out.stderr, out.stderr
  assert '--guard_cost' in out.stdout + out.stderr


def test_the_quick_subset_names_test_files_that_exist():
  import conftest  # pylint: disable=import-outside-toplevel
  missing = [f for f in conftest.QUICK_FILES if not (REPO / 'tests' / f).is_file()]
  assert not missing, f'tests/conftest.py QUICK_FILES names missing files: {missing}'
  with open(REPO / 'setup.cfg', encoding='utf-8') as f:
    assert '\n    quick: ' in f.read()  # A registered marker.
