"""Execution options are checked once, where they enter, and carried as one value."""

import ml_collections
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx import execution
from fedjx import frames
from fedjx import options
from fedjx.experiments import config as config_schema
from test_algorithms_util import linreg_loss


def test_round_options_are_checked_when_made():
  assert options.RoundOptions() == options.RoundOptions(
      options.MapOptions('auto', None), 'auto', None, True)
  assert options.RoundOptions().map_strategy == 'auto'
  assert options.RoundOptions().chunk_size is None
  for make, message in [
      (lambda: options.MapOptions('pmap', where='RoundOptions: '),
       "RoundOptions: map_strategy='pmap' is not one of"),
      (lambda: options.MapOptions(chunk_size=0),
       'MapOptions: chunk_size=0; it must be a positive int'),
      (lambda: options.MapOptions(chunk_size=True), 'MapOptions: chunk_size=True'),
      (lambda: options.RoundOptions(map='vmap'), "RoundOptions: map='vmap'"),
      (lambda: options.RoundOptions(execution='fast'),
       "RoundOptions: execution='fast' is not one of"),
      (lambda: options.RoundOptions(streaming_chunk_size=-2),
       'RoundOptions: streaming_chunk_size=-2'),
      (lambda: options.RoundOptions(donate='yes'),
       "RoundOptions: donate='yes'; it must be True or False"),
  ]:
    with pytest.raises(ValueError) as info:
      make()
    assert str(info.value).startswith(message) and '\n' not in str(info.value)


def test_map_options_are_carried_as_they_are(monkeypatch):
  """Checked where they enter (the config, compile, program), the options
  reach the program's frame as the one value, checked nowhere on the way."""
  program = fedjx.program  # Its modules imported (their defaults checked) first.
  checks = []
  check = options.check_map_options
  monkeypatch.setattr(options, 'check_map_options',
                      lambda *a: checks.append(a[-1]) or check(*a))
  config = ml_collections.ConfigDict({'map_strategy': 'chunked', 'chunk_size': 2,
                                      'execution': 'auto'})
  carried = options.RoundOptions.of(config).map
  assert checks == ['config.']
  assert carried == options.MapOptions('chunked', 2)
  del checks[:]
  algo = algos.fedavg(linreg_loss).compile(carried)
  assert options.MapOptions.of(carried) is carried and checks == []
  seen = []

  @program(clients=2, map_strategy=carried)
  def frame_options():
    seen.append(frames.current_frames()[-1].map_options)

  frame_options()
  assert seen == [carried] and checks == []
  with pytest.raises(ValueError, match='give the chunk size in the MapOptions'):
    algos.fedavg(linreg_loss).compile(carried, chunk_size=4)
  assert algo.compiler is not None


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
