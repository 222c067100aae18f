"""What the registry passes an algorithm builder is declared, not guessed.

A builder declares its traits where it is defined (``builder.traits``,
:class:`fedjx.algorithms.traits.Traits`): which option takes the population
size, whether it is asynchronous, ... The registry holds builders only and
reads what they declare; nothing is passed because of a parameter's name.
"""

import functools
import inspect
import types

import pytest

from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.traits import Traits
from fedjx.experiments import registry
from fedjx.experiments import signatures

MODEL = types.SimpleNamespace(loss_fn=lambda params, batch: None,
                              metrics_fn=lambda params, batch: {})


def _recorder(calls, traits=None):
  def builder(loss_fn, num_clients=None, n_pop=None, **options):
    calls.append(dict(options, num_clients=num_clients, n_pop=n_pop))
    return 'built'
  return builder if traits is None else traits_lib.declare(traits)(builder)


@pytest.fixture
def register():
  names = []

  def add(name, builder):
    names.append(name)
    registry.register_algorithm(name, builder)
  yield add
  for name in names:
    registry.ALGORITHMS.pop(name, None)


def test_every_builder_takes_what_it_declares():
  for name in registry.ALGORITHMS:
    builder = registry.algorithm_builder(name)
    traits = registry.algorithm_traits(name)
    taken = (set(signatures.declared_options(builder))
             | set(inspect.signature(builder).parameters))
    for key in registry.runner_options(name) + tuple(
        k for k in (traits.population, traits.client_state) if k):
      assert key in taken, (name, key)


def test_every_required_option_of_a_builder_is_its_declared_population():
  # A config names only the algorithm's own options: anything else the
  # builder requires must come from the runner, i.e. be declared.
  for name in registry.ALGORITHMS:
    builder = registry.algorithm_builder(name)
    params = list(inspect.signature(builder).parameters.values())[1:]
    required = {p.name for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    assert required <= {registry.algorithm_traits(name).population}, (name, required)


def test_population_goes_to_the_declared_option_only(register):
  calls = []
  register('by_name', _recorder(calls))
  register('declared', _recorder(calls, Traits(population='n_pop')))
  registry.build_algorithm({'name': 'by_name'}, MODEL, num_clients=7)
  registry.build_algorithm({'name': 'declared'}, MODEL, num_clients=7)
  registry.build_algorithm({'name': 'declared', 'n_pop': 3}, MODEL, num_clients=7)
  # A parameter called num_clients is not enough: it was not declared.
  assert [(c['num_clients'], c['n_pop']) for c in calls] == [
      (None, None), (None, 7), (None, 3)]


def test_runner_options_are_those_the_builder_takes(register):
  calls = []

  def nothing(loss_fn, num_clients=None):
    del loss_fn, num_clients
    calls.append({})

  def metrics_only(loss_fn, *, metrics_fn=None):
    del loss_fn
    calls.append({'metrics_fn': metrics_fn})

  register('everything', _recorder(calls))  # **options: both.
  register('nothing', nothing)
  register('metrics_only', metrics_only)
  for name in ('everything', 'nothing', 'metrics_only'):
    registry.build_algorithm({'name': name}, MODEL, skip_nonfinite=False)
  assert [sorted(set(c) - {'num_clients', 'n_pop'}) for c in calls] == [
      ['metrics_fn', 'skip_nonfinite'], [], ['metrics_fn']]
  assert calls[0]['metrics_fn'] is MODEL.metrics_fn
  assert calls[0]['skip_nonfinite'] is False
  assert registry.runner_options('metrics_only') == ('metrics_fn',)


def test_the_package_s_per_client_algorithms_get_the_population():
  assert registry.algorithm_traits('scaffold').population == 'num_clients'
  assert registry.algorithm_traits('diloco').population == 'num_replicas'
  assert registry.algorithm_traits('fedavg').population is None


def test_a_builder_whose_traits_are_not_a_record_is_one_line():
  def odd(loss_fn):
    del loss_fn
  odd.traits = {'asynchronous': True}
  with pytest.raises(registry.ConfigError,
                     match=r"^register_algorithm\('x'\): builder\.traits=.* is "
                           r"not a fedjx\.algorithms\.traits\.Traits\.$"):
    registry.register_algorithm('x', odd)
  assert 'x' not in registry.ALGORITHMS


def _having(trait: str) -> tuple[str, ...]:
  """The registered algorithms whose builder declares ``trait``, sorted."""
  return tuple(sorted(n for n in registry.ALGORITHMS
                      if getattr(registry.algorithm_traits(n), trait)))


def test_algorithms_run_unguarded_first_are_synchronous_and_guardable():
  """Builders declaring updates_reach_params (fedjx.experiments.guarded_rounds)."""
  for name in _having('updates_reach_params'):
    assert 'skip_nonfinite' in registry.runner_options(name)
  for name in ('streaming_diloco', 'async_diloco', 'fedavg_hypergradient_tuner'):
    assert name not in _having('updates_reach_params')


# ---------------------------------------- traits live where builders are

def test_the_traits_of_the_shipped_builders():
  assert len(registry.ALGORITHMS) == 29
  for name, builder in registry.ALGORITHMS.items():
    assert getattr(registry.algorithms_lib, name) is builder
  # Every builder fedjx.algorithms exports with declared traits is one.
  lib = registry.algorithms_lib
  declared = {n for n in lib.__all__
              if isinstance(getattr(getattr(lib, n), 'traits', None), Traits)}
  assert declared == set(registry.ALGORITHMS)
  assert _having('asynchronous') == tuple(sorted(
      ('fedbuff', 'async_diloco', 'fedasync')))
  assert _having('updates_reach_params') == tuple(sorted((
      'fedavg', 'fedadam', 'fedyogi', 'fedadagrad', 'fedavgm', 'fedprox',
      'fednova', 'fedexp', 'scaffold', 'dp_fedavg', 'diloco', 'diloco_recipe',
      'fedbuff', 'qffl', 'fedasync')))
  # The algorithms a privacy audit's canaries measure, and those churn takes.
  assert _having('aggregates_whole_model') == tuple(sorted((
      'fedavg', 'fedadam', 'fedyogi', 'fedadagrad', 'fedavgm', 'fedprox',
      'dp_fedavg', 'diloco')))
  assert _having('replicas_restart') == ('diloco',)
  assert _having('aggregator') == ('dp_fedavg',)
  assert 'skip_nonfinite' in registry.RESERVED
  # The built algorithm carries its builder's record.
  algo = registry.algorithms_lib.scaffold(MODEL.loss_fn, 3)
  assert algo.traits is registry.algorithm_traits('scaffold')


def test_adding_an_algorithm_is_one_declaration(register):
  from fedjx.experiments import config as config_schema  # pylint: disable=import-outside-toplevel
  from fedjx.experiments.sweeps import run  # pylint: disable=import-outside-toplevel

  @traits_lib.declare(Traits(asynchronous=True, updates_reach_params=True))
  def mine(loss_fn, *, extra=1.0, **options):
    del extra
    return registry.algorithms_lib.fedavg(loss_fn, **options)

  register('mine', mine)
  assert registry.algorithm_builder('mine') is mine
  assert 'mine' in _having('asynchronous') and registry.is_asynchronous('mine')
  assert 'mine' in _having('updates_reach_params')
  assert 'extra' in registry.builder_options('mine')
  registry.check_algorithm_kwargs('mine', {'extra': 2.0})
  with pytest.raises(registry.ConfigError, match="has no option 'skip_nonfinite'"):
    registry.check_algorithm_kwargs('mine', {'skip_nonfinite': True})
  # Asynchronous: its concurrency is checked against its buffer, and the
  # sweep refuses it, from the declaration alone.
  config = config_schema.with_defaults(
      {'algorithm': {'name': 'mine'}, 'dataset': {'name': 'digits'},
       'model': {'name': 'mlp'}, 'cohort_size': 4})
  with pytest.raises(registry.ConfigError, match='concurrency=2 is less than'):
    config_schema.check_asynchronous(config, 'mine', {'concurrency': 2})
  with pytest.raises(run.SweepError, match="'mine' is asynchronous"):
    run._check_synchronous(config)  # pylint: disable=protected-access
  registry.ALGORITHMS.pop('mine')
  assert not registry.is_asynchronous('mine')


def test_a_plain_builder_is_guarded_and_synchronous(register):
  register('plain_defaults', _recorder([]))
  traits = registry.algorithm_traits('plain_defaults')
  assert traits == traits_lib.NONE
  assert not traits.asynchronous and not traits.updates_reach_params


def test_a_wrapped_builder_keeps_its_declaration(register):
  fedbuff = registry.ALGORITHMS['fedbuff']
  wrapped = functools.wraps(fedbuff)(lambda *a, **k: fedbuff(*a, **k))
  assert registry.ALGORITHMS['fedbuff'].traits is wrapped.traits
  wrapped.traits = fedbuff.traits._replace(updates_reach_params=False)
  register('fedbuff_guarded', wrapped)
  assert registry.is_asynchronous('fedbuff_guarded')
  assert not registry.algorithm_traits('fedbuff_guarded').updates_reach_params


def test_a_new_algorithm_needs_only_public_names():
  import fedjx.algorithms as algos  # pylint: disable=import-outside-toplevel
  from fedjx.algorithms import base, kit, template, traits  # pylint: disable=import-outside-toplevel
  assert algos.kit is kit and 'kit' in algos.__all__
  for name in ('make_algorithm', 'default_sgd', 'ServerState'):
    assert getattr(kit, name) is getattr(base, name), name
  for name in ('algorithm', 'Options', 'Client', 'Upload', 'Server', 'Step'):
    assert getattr(kit, name) is getattr(template, name), name
  assert kit.Traits is traits.Traits and kit.declare is traits.declare
  assert set(kit.__all__) >= {'algorithm', 'Options', 'Traits', 'declare'}
