"""config.network: each round's simulated wall clock and compute utilization."""

import math

import numpy as np
import pytest

from fedjx.experiments import config as config_lib
from fedjx.experiments import config_base
from fedjx.experiments import network
from fedjx.experiments import network_clock
from fedjx.experiments import runner
from fedjx.experiments.errors import ConfigError

PARAMS = {'w': np.zeros((10, 30), np.float32), 'b': np.zeros((30,), np.float32)}
MODEL_BYTES = 4 * (300 + 30)


def _config(algorithm, **section):
  config = config_base.base_config()
  config.cohort_size = 4
  config.local_steps = 16
  config.dataset = dict(name='digits')
  config.model = dict(name='logistic_regression')
  config.algorithm = algorithm
  config.network = dict(section)
  return config_lib.with_defaults(config)


def _ring(n, nbytes, gbps, latency_s):
  """A ring all-reduce by hand: 2 (n - 1) steps of nbytes / n each."""
  return 2 * (n - 1) * (8 * nbytes / n / (gbps * 1e9) + latency_s)


def test_diloco_round_is_a_blocking_ring_all_reduce_of_one_replicas_bytes():
  config = _config(dict(name='diloco'), bandwidth_gbps=0.01, latency_ms=20,
                   step_seconds=0.5)
  clock = network_clock.make(config, PARAMS, None)
  row = {'communicated_bytes': 4 * 100_000.0, 'clients': 4.0}  # All replicas' bytes.
  got = clock.advance(row, wall_seconds=None)
  comm = _ring(4, 100_000, 0.01, 0.02)
  assert got['simulated_round_s'] == pytest.approx(16 * 0.5 + comm, rel=1e-12)
  assert got['simulated_step_s'] == pytest.approx((8 + comm) / 16, rel=1e-12)
  assert got['compute_utilization'] == pytest.approx(8 / (8 + comm), rel=1e-12)
  want = network.simulate(network.Schedule.diloco(16), network.Compute.from_step_seconds(0.5),
                          network.Network(network.Link.gbps(0.01, 0.02)), 100_000, 4)
  assert got['simulated_round_s'] == want.round_seconds
  assert got['compute_utilization'] == want.utilization
  again = clock.advance(dict(row, clients=3.0, communicated_bytes=3 * 100_000.0), None)
  assert again['simulated_elapsed_s'] == pytest.approx(
      got['simulated_round_s'] + 8 + _ring(3, 100_000, 0.01, 0.02), rel=1e-12)
  assert clock.meta() == {'simulated_elapsed_s': again['simulated_elapsed_s']}


def test_overlap_layers_and_wire_bytes_reach_the_model():
  config = _config(dict(name='diloco'), bandwidth_gbps=0.01, step_seconds=0.5,
                   overlap_fraction=0.5, layers=2, wire_bytes=2, topology='tree')
  got = network_clock.make(config, PARAMS, None).advance(
      {'communicated_bytes': 1e9, 'clients': 4.0}, None)
  want = network.simulate(network.Schedule.diloco(16, 0.5, 2),
                          network.Compute.from_step_seconds(0.5),
                          network.Network(network.Link.gbps(0.01), 'tree'), 330 * 2, 4)
  assert got['simulated_round_s'] == want.round_seconds


def test_streaming_diloco_spans_its_fragments_rounds():
  """P fragments, one a round of H steps: the model's round is P H steps of
  the whole model (P times this round's fragment), each round 1 / P of it."""
  algorithm = dict(name='streaming_diloco', num_fragments=2, overlap_steps=3)
  config = _config(algorithm, bandwidth_gbps=0.001, step_seconds=0.01)
  fragment = 50_000.0
  got = network_clock.make(config, PARAMS, None).advance(
      {'communicated_bytes': 4 * fragment, 'clients': 4.0}, None)
  t, step = _ring(4, fragment, 0.001, 0.0), 0.01
  exposed = max(2 * max(0.0, t - 3 * step), 2 * t - 32 * step, 0.0)
  assert got['simulated_round_s'] == pytest.approx((32 * step + exposed) / 2, rel=1e-12)
  assert got['compute_utilization'] == pytest.approx(32 * step / (32 * step + exposed),
                                                     rel=1e-12)
  want = network.simulate(network.Schedule.streaming_diloco(32, 2, 3),
                          network.Compute.from_step_seconds(step),
                          network.Network(network.Link.gbps(0.001)), 2 * fragment, 4)
  assert got['simulated_step_s'] == want.step_seconds


def test_streaming_defaults_come_from_the_builder():
  config = _config(dict(name='streaming_diloco'), bandwidth_gbps=1.0)
  knobs = network_clock.schedule_knobs(config)
  assert (knobs['schedule'], knobs['inner_steps'], knobs['fragments'],
          knobs['overlap_steps']) == ('streaming_diloco', 32, 2, 0.0)


def test_measured_step_time_and_the_compiling_round():
  config = _config(dict(name='fedavg'), bandwidth_gbps=math.inf)
  clock = network_clock.make(config, PARAMS, {'simulated_elapsed_s': 5.0})
  row = {'clients': 4.0}  # No communicated_bytes: the model's float32 bytes.
  assert clock.payload_bytes(row) == (MODEL_BYTES, 4)
  assert clock.payload_bytes(dict(row, upload_bits=800.0)) == (100.0, 4)
  assert clock.advance(row, wall_seconds=None) == {}  # The round that compiled.
  got = clock.advance(row, wall_seconds=8.0)
  assert got == {'simulated_round_s': 8.0, 'simulated_step_s': 0.5,
                 'compute_utilization': 1.0, 'simulated_elapsed_s': 13.0}


@pytest.mark.parametrize('section,match', [
    (dict(bandwidth=1), r"config\.network\['bandwidth'\] is unknown.*bandwidth_gbps"),
    (dict(bandwidth_gbps=0), r'bandwidth_gbps=0; allowed: a number > 0'),
    (dict(bandwidth_gbps='fast'), r"bandwidth_gbps='fast'; allowed"),
    (dict(bandwidth_gbps=1, latency_ms=-1), r'latency_ms=-1; allowed: a finite number >= 0'),
    (dict(bandwidth_gbps=1, topology='hierarchical'),
     r"topology='hierarchical'; allowed: one of \('ring', 'tree', 'parameter_server'\)"),
    (dict(bandwidth_gbps=1, step_seconds=0), r'step_seconds=0; allowed'),
    (dict(bandwidth_gbps=1, wire_bytes=True), r'wire_bytes=True; allowed'),
    (dict(bandwidth_gbps=1, overlap_fraction=1.5), r'overlap_fraction=1.5; allowed: .*\[0, 1\]'),
    (dict(bandwidth_gbps=1, layers=0), r'layers=0; allowed: an int >= 1'),
    (dict(bandwidth_gbps=1, inner_steps=2.5), r'inner_steps=2.5; allowed: an int >= 1'),
])
def test_bad_sections_are_one_config_error(section, match):
  with pytest.raises(ConfigError, match=match):
    _config(dict(name='diloco'), **section)


def test_inner_steps_are_needed_and_the_schedule_is_checked():
  config = config_base.base_config()
  config.algorithm = dict(name='fedavg')
  config.network = dict(bandwidth_gbps=1.0)
  with pytest.raises(ConfigError, match=r'inner_steps=None and config\.local_steps=None'):
    config_lib.with_defaults(config)
  config = _config(dict(name='streaming_diloco'), bandwidth_gbps=1.0, overlap_fraction=0.5)
  with pytest.raises(ConfigError, match=r"config\.network with .*'streaming_diloco'.*"
                                        r'overlap_fraction=0\.5'):
    network_clock.make(config, PARAMS, None)


def test_the_section_changes_neither_the_experiment_nor_a_run_without_it():
  off = _config(dict(name='diloco'))
  on = _config(dict(name='diloco'), bandwidth_gbps=1.0)
  assert config_lib.config_hash(off) == config_lib.config_hash(on)
  assert network_clock.make(off, PARAMS, None) is None
  config = config_base.base_config()
  config.network = None
  assert config_lib.with_defaults(config).network.to_dict() == config_lib.NETWORK_DEFAULTS


@pytest.mark.slow
def test_a_run_with_the_section_has_the_same_training_metrics(tmp_path):
  def config(**section):
    c = config_base.base_config()
    c.rounds, c.cohort_size, c.batch_size, c.local_steps = 2, 3, 8, 2
    c.eval_every, c.progress, c.plot, c.tensorboard = 1, False, False, False
    c.dataset = dict(name='digits', num_clients=6, alpha=0.5)
    c.model = dict(name='logistic_regression')
    c.algorithm = dict(name='fedavg', client_optimizer=config_base.optimizer(
        'sgd', learning_rate=0.1))
    if section:
      c.network = section
    return c
  off = runner.run(config(), str(tmp_path / 'off')).history
  on = runner.run(config(bandwidth_gbps=0.1, step_seconds=0.01),
                  str(tmp_path / 'on')).history
  assert len(off) == len(on) == 3
  for a, b in zip(off, on):
    assert not set(network_clock.METRICS) & set(a)
    added = set(network_clock.METRICS) if b['round'] else set()
    assert set(b) == set(a) | added
    assert {k: v for k, v in a.items() if k != 'elapsed_s'} == {
        k: v for k, v in b.items() if k not in added and k != 'elapsed_s'}
  timing = network.simulate(network.Schedule.diloco(2), network.Compute.from_step_seconds(0.01),
                            network.Network(network.Link.gbps(0.1)), 4 * (64 * 10 + 10), 3)
  assert on[1]['simulated_round_s'] == timing.round_seconds
  assert on[2]['simulated_elapsed_s'] == 2 * timing.round_seconds
