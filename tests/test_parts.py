"""The parts a config names (fedjx.experiments.parts): aggregators by name."""

import pytest

from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.aggregators import robust as robust_aggregators
from fedjx.experiments import parts
from fedjx.experiments.config import ConfigError


def test_a_spec_builds_the_named_aggregator():
  agg = parts.build_aggregator({'name': 'gaussian', 'clip_norm': 0.5})
  assert str(agg.traits.privacy) == 'gaussian (central DP)'
  assert agg.hparams['clip_norm'] == 0.5
  mine = aggregators.mean()
  assert parts.build_aggregator(mine) is mine


def test_a_nested_defense_is_a_spec_too():
  agg = parts.build_aggregator({'name': 'dp_defense',
                                'defense': {'name': 'krum', 'num_byzantine': 1}})
  assert agg.traits.privacy is not None
  assert agg.traits.needs_all_updates is not None
  assert parts.build_aggregator(
      {'name': 'dp_defense', 'defense': robust_aggregators.krum()}).traits.privacy


@pytest.mark.parametrize('spec, message', [
    ({'name': 'gausian'}, r"config.algorithm.aggregator.name='gausian' is not "
     r"one of \[.*'gaussian'.*\]. Did you mean 'gaussian'\?"),
    ({'clip_norm': 1.0}, r'must be a dict with a "name"'),
    ({'name': 'gaussian', 'clip': 1.0}, r"config.algorithm.aggregator.clip=1.0 "
     r"is not an option of 'gaussian'. Did you mean 'clip_norm'\? It takes "
     r"\['canaries', 'clip_norm', "),
    ({'name': 'gaussian', 'clip_norm': -1.0}, r"config.algorithm.aggregator="
     r"\{'name': 'gaussian', 'clip_norm': -1.0\}: gaussian: clip_norm=-1.0"),
    ({'name': 'dp_defense', 'defense': {'name': 'medain'}},
     r"config.algorithm.aggregator.defense.name='medain' is not one of"),
])
def test_a_bad_spec_is_one_line_naming_the_key_and_what_is_allowed(spec,
                                                                   message):
  with pytest.raises(ConfigError, match=message) as e:
    parts.build_aggregator(spec)
  assert '\n' not in str(e.value)


def test_the_library_takes_aggregators_not_names():
  with pytest.raises(ValueError, match='is a config spec; build it with '
                     'fedjx.experiments.parts.build_aggregator'):
    aggregators.check('fedavg', {'name': 'mean'})
