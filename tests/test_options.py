"""Execution options are given once and checked by one set of functions."""

import ml_collections
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx import execution
from fedjx import options
from fedjx.experiments import config as config_schema
from test_algorithms_util import linreg_loss


def test_round_options_are_checked_when_made():
  assert options.RoundOptions() == options.RoundOptions(
      'auto', None, 'auto', None, True)
  for kwargs, message in [
      (dict(map_strategy='pmap'), "RoundOptions: map_strategy='pmap' is not one of"),
      (dict(chunk_size=0), 'RoundOptions: chunk_size=0; it must be a positive int'),
      (dict(chunk_size=True), 'RoundOptions: chunk_size=True'),
      (dict(execution='fast'), "RoundOptions: execution='fast' is not one of"),
      (dict(streaming_chunk_size=-2), 'RoundOptions: streaming_chunk_size=-2'),
      (dict(donate='yes'), "RoundOptions: donate='yes'; it must be True or False"),
  ]:
    with pytest.raises(ValueError) as info:
      options.RoundOptions(**kwargs)
    assert str(info.value).startswith(message) and '\n' not in str(info.value)


def test_every_place_that_takes_a_map_strategy_says_the_same_thing():
  """program, map_fn, Algorithm.compile, round_runner and the config refuse
  a bad value with the same sentence, each naming its own argument."""
  tail = f"map_strategy='pmap' is not one of {options.MAP_STRATEGIES}."
  with pytest.raises(ValueError) as info:
    fedjx.program(lambda x: x, clients=2, map_strategy='pmap')
  assert str(info.value) == f'fedjx.program: {tail}'
  with pytest.raises(ValueError) as info:
    algos.fedavg(linreg_loss).compile(map_strategy='pmap')
  assert str(info.value) == f'Algorithm.compile: {tail}'
  config = ml_collections.ConfigDict({'map_strategy': 'pmap', 'chunk_size': None,
                                      'execution': 'auto'})
  with pytest.raises(ValueError) as info:
    options.RoundOptions.of(config)
  assert str(info.value) == f'config.{tail}'
  with pytest.raises(ValueError) as info:
    execution.round_runner(algos.fedavg(linreg_loss), 'fast')
  assert "execution='fast' is not one of" in str(info.value)
  assert fedjx.MAP_STRATEGIES == options.MAP_STRATEGIES
  assert config_schema.EXECUTIONS == execution.EXECUTIONS == options.EXECUTIONS


def test_the_streamed_chunk_has_its_own_field():
  config = config_schema.with_defaults(ml_collections.ConfigDict({
      'dataset': {}, 'model': {}, 'algorithm': {}}))
  assert config.streaming_chunk_size is None
  assert config_schema.streaming_chunk(config) is None
  config.streaming_chunk_size = 8
  config.chunk_size = 2
  assert config_schema.streaming_chunk(config) == 8
  config.streaming_chunk_size = None  # The map's chunk sizes no streamed chunk.
  for execution_mode in ('auto', 'streaming', 'jit'):
    config.execution = execution_mode
    assert config_schema.streaming_chunk(config) is None
  # It changes no result, so a run may be resumed with another value.
  assert 'streaming_chunk_size' in config_schema.RESUMABLE_CHANGES
