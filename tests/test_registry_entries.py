"""What the registry passes an algorithm builder is declared, not guessed.

The entry of an algorithm says which runner options it takes and which option
takes the population size; nothing is passed because of a parameter's name.
"""

import inspect
import types

import pytest

from fedjx.experiments import registry

MODEL = types.SimpleNamespace(loss_fn=lambda params, batch: None,
                              metrics_fn=lambda params, batch: {})


def _recorder(calls):
  def builder(loss_fn, num_clients=None, n_pop=None, **options):
    calls.append(dict(options, num_clients=num_clients, n_pop=n_pop))
    return 'built'
  return builder


@pytest.fixture
def register():
  names = []

  def add(name, builder, **kw):
    names.append(name)
    registry.register_algorithm(name, builder, **kw)
  yield add
  for name in names:
    registry.ALGORITHMS.pop(name)


def test_every_entry_takes_what_it_declares():
  for name in registry.ALGORITHMS:
    entry = registry.algorithm_entry(name)
    params = inspect.signature(entry.builder).parameters
    for key in entry.runner_options + ((entry.population,) if entry.population else ()):
      assert key in params, (name, key)
    assert inspect.signature(entry) == inspect.signature(entry.builder)


def test_every_required_option_of_a_builder_is_its_declared_population():
  # A config names only the algorithm's own options: anything else the
  # builder requires must come from the runner, i.e. be declared.
  for name in registry.ALGORITHMS:
    entry = registry.algorithm_entry(name)
    params = list(inspect.signature(entry.builder).parameters.values())[1:]
    required = {p.name for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    assert required <= {entry.population}, (name, required)


def test_population_goes_to_the_declared_option_only(register):
  calls = []
  register('by_name', _recorder(calls))
  register('declared', _recorder(calls), population='n_pop')
  registry.build_algorithm({'name': 'by_name'}, MODEL, num_clients=7)
  registry.build_algorithm({'name': 'declared'}, MODEL, num_clients=7)
  registry.build_algorithm({'name': 'declared', 'n_pop': 3}, MODEL, num_clients=7)
  # A parameter called num_clients is not enough: it was not declared.
  assert [(c['num_clients'], c['n_pop']) for c in calls] == [
      (None, None), (None, 7), (None, 3)]


def test_runner_options_are_those_declared(register):
  calls = []
  register('everything', _recorder(calls))  # **options: both, read once here.
  register('nothing', _recorder(calls), runner_options=())
  register('metrics_only', _recorder(calls), runner_options=('metrics_fn',))
  for name in ('everything', 'nothing', 'metrics_only'):
    registry.build_algorithm({'name': name}, MODEL, skip_nonfinite=False)
  assert [sorted(set(c) - {'num_clients', 'n_pop'}) for c in calls] == [
      ['metrics_fn', 'skip_nonfinite'], [], ['metrics_fn']]
  assert calls[0]['metrics_fn'] is MODEL.metrics_fn
  assert calls[0]['skip_nonfinite'] is False


def test_a_builder_without_skip_nonfinite_is_registered_without_it(register):
  calls = []

  def plain(loss_fn, *, metrics_fn=None):
    calls.append(metrics_fn)
  register('plain', plain)
  assert registry.algorithm_entry('plain').runner_options == ('metrics_fn',)
  registry.build_algorithm({'name': 'plain'}, MODEL, skip_nonfinite=True)
  assert calls == [MODEL.metrics_fn]


def test_an_entry_declaring_more_than_its_builder_takes_is_one_line(register):
  def plain(loss_fn, *, metrics_fn=None):
    del loss_fn, metrics_fn
  registry.ALGORITHMS['undeclared'] = plain  # A plain entry: both options.
  try:
    with pytest.raises(registry.ConfigError,
                       match=r"^algorithm 'undeclared': its builder does not take "
                             r"'skip_nonfinite'.*runner_options=\('metrics_fn',\)\)\.$"):
      registry.build_algorithm({'name': 'undeclared'}, MODEL)
  finally:
    registry.ALGORITHMS.pop('undeclared')


def test_the_package_s_per_client_algorithms_get_the_population():
  assert registry.algorithm_entry('scaffold').population == 'num_clients'
  assert registry.algorithm_entry('diloco').population == 'num_replicas'
  assert registry.algorithm_entry('fedavg').population is None


def test_an_unknown_runner_option_is_one_line():
  with pytest.raises(registry.ConfigError,
                     match=r"^register_algorithm\('x'\): runner_options has 'mesh'; "
                           r"valid runner options: \['metrics_fn', 'skip_nonfinite'\]\.$"):
    registry.register_algorithm('x', _recorder([]), runner_options=('mesh',))
  assert 'x' not in registry.ALGORITHMS


def _having(trait: str) -> tuple[str, ...]:
  """The registered algorithms whose entry has ``trait`` set."""
  return tuple(n for n in registry.ALGORITHMS
               if getattr(registry.algorithm_entry(n), trait))


def test_algorithms_run_unguarded_first_are_synchronous_and_guardable():
  """Entries with updates_reach_params (fedjx.experiments.guarded_rounds)."""
  for name in _having('updates_reach_params'):
    assert 'skip_nonfinite' in registry.algorithm_entry(name).runner_options
  for name in ('streaming_diloco', 'async_diloco', 'fedavg_hypergradient_tuner'):
    assert name not in _having('updates_reach_params')


# ------------------------------------------------- traits live in the entries

def _forwarding(loss_fn, *, extra=1.0, **kwargs):
  """A builder passing **kwargs on to fedavg, as the FedOpt conveniences do."""
  del extra
  return registry.algorithms_lib.fedavg(loss_fn, **kwargs)


def test_the_traits_of_the_shipped_entries():
  assert _having('asynchronous') == ('fedbuff', 'async_diloco', 'fedasync')
  assert _having('updates_reach_params') == (
      'fedavg', 'fedadam', 'fedyogi', 'fedadagrad', 'fedavgm', 'fedprox',
      'fednova', 'fedexp', 'scaffold', 'dp_fedavg', 'diloco', 'diloco_recipe',
      'fedbuff', 'qffl', 'fedasync')
  assert {n: registry.forwarded_name(n) for n in _having('forwards_to')} == {
      'fedadam': 'fedavg', 'fedyogi': 'fedavg', 'fedadagrad': 'fedavg',
      'fedavgm': 'fedavg', 'diloco_recipe': 'diloco'}
  assert registry.forwarded_builder('fedadam') is registry.algorithms_lib.fedavg
  assert registry.forwarded_builder('scaffold') is None
  assert 'skip_nonfinite' in registry.RESERVED


def test_adding_an_algorithm_is_one_entry(register):
  from fedjx.experiments import config as config_schema  # pylint: disable=import-outside-toplevel
  from fedjx.experiments.sweeps import run  # pylint: disable=import-outside-toplevel
  entry = registry.AlgorithmEntry(_forwarding, asynchronous=True,
                                  updates_reach_params=True, forwards_to='fedavg')
  register('mine', entry)
  assert registry.algorithm_entry('mine') is entry
  assert _having('asynchronous')[-1] == 'mine' and registry.is_asynchronous('mine')
  assert _having('updates_reach_params')[-1] == 'mine'
  assert registry.forwarded_name('mine') == 'fedavg'
  # The options a config may give are both builders'.
  options = registry.builder_options('mine')
  assert {'extra', 'client_optimizer', 'weighting'} <= set(options)
  assert 'skip_nonfinite' not in options
  registry.check_kwargs('algorithm', 'mine', entry, {'weighting': 'uniform'},
                        registry.RESERVED, entry.forwarded())
  with pytest.raises(registry.ConfigError, match="has no option 'weightin'"):
    registry.check_kwargs('algorithm', 'mine', entry, {'weightin': 'uniform'},
                          registry.RESERVED, entry.forwarded())
  # Asynchronous: its concurrency is checked against its buffer, and the
  # sweep refuses it, from the entry alone.
  config = config_schema.with_defaults(
      {'algorithm': {'name': 'mine'}, 'dataset': {'name': 'digits'},
       'model': {'name': 'mlp'}, 'cohort_size': 4})
  with pytest.raises(registry.ConfigError, match='concurrency=2 is less than'):
    config_schema.check_asynchronous(config, 'mine', {'concurrency': 2})
  with pytest.raises(run.SweepError, match="'mine' is asynchronous"):
    run._check_synchronous(config)  # pylint: disable=protected-access
  registry.ALGORITHMS.pop('mine')
  assert not registry.is_asynchronous('mine') and registry.forwarded_name('mine') is None
  registry.ALGORITHMS['mine'] = entry  # The fixture removes it again.


def test_register_algorithm_takes_the_traits_as_keywords(register):
  register('kw', _forwarding, forwards_to=registry.algorithms_lib.fedavg,
           updates_reach_params=True)
  entry = registry.algorithm_entry('kw')
  assert (entry.asynchronous, entry.updates_reach_params) == (False, True)
  assert entry.forwarded() is registry.algorithms_lib.fedavg
  assert registry.forwarded_name('kw') == 'fedavg'  # Named by its entry when it has one.
  assert 'kw' not in _having('asynchronous') and 'kw' in _having('updates_reach_params')


def test_a_plain_builder_is_guarded_and_synchronous(register):
  register('plain_defaults', _recorder([]))
  entry = registry.algorithm_entry('plain_defaults')
  assert not entry.asynchronous and not entry.updates_reach_params
  assert entry.forwards_to is None and registry.forwarded_builder('plain_defaults') is None


def test_bad_registrations_are_one_line():
  with pytest.raises(registry.ConfigError,
                     match=r"^register_algorithm\('x'\): forwards_to='fedav' is not a "
                           r"registered algorithm\. Did you mean 'fedavg'\?$"):
    registry.register_algorithm('x', _forwarding, forwards_to='fedav')
  with pytest.raises(registry.ConfigError, match='give its fields in it'):
    registry.register_algorithm('x', registry.AlgorithmEntry(_forwarding),
                                asynchronous=True)
  assert 'x' not in registry.ALGORITHMS


def test_a_new_algorithm_needs_only_public_names():
  import fedjx.algorithms as algos  # pylint: disable=import-outside-toplevel
  from fedjx.algorithms import base, client_update, kit  # pylint: disable=import-outside-toplevel
  assert algos.kit is kit and 'kit' in algos.__all__
  for name in ('make_algorithm', 'default_sgd', 'server_update',
               'with_options', 'COMMON_OPTIONS', 'ServerState'):
    assert getattr(kit, name) is getattr(base, name), name
    assert name in kit.__all__
  assert kit.stats_metrics is base.round_metrics
  for name in ('local_update', 'check_schedule', 'LocalSchedule'):
    assert getattr(kit, name) is getattr(client_update, name), name
    assert name in kit.__all__
