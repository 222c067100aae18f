"""scripts/bits_vs_loss.py: bits counting and the simulated clock from fake metrics."""

import importlib.util
import json
import pathlib

import pytest

from fedjx.experiments import metrics_writers
from fedjx.experiments import network

REPO = pathlib.Path(__file__).resolve().parent.parent


def _script():
  spec = importlib.util.spec_from_file_location(
      '_bits_vs_loss', REPO / 'scripts' / 'bits_vs_loss.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _fake_workdir(tmp_path, per_round_bytes, clients, rounds=4):
  """A metrics.jsonl: round 0 evaluated, then ``rounds`` training rounds."""
  rows = [dict(round=0, eval_loss=6.0)]
  for r in range(1, rounds + 1):
    row = dict(round=r, clients=float(clients),
               communicated_bytes=float(per_round_bytes[(r - 1) % len(per_round_bytes)]))
    if r % 2 == 0:
      row['eval_loss'] = 6.0 - r / 2
    rows.append(row)
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  return metrics_writers.read_metrics(str(tmp_path))


def test_diloco_bits_are_the_sum_of_communicated_bytes(tmp_path):
  s = _script()
  rows = _fake_workdir(tmp_path, [4000.0], clients=4)
  assert s.total_bits(rows, 'diloco') == 4 * 4000 * 8
  assert s.payload_bytes(rows) == 1000.0
  assert s.eval_curve(rows) == [(0, 6.0), (2, 5.0), (4, 4.0)]


def test_data_parallel_bits_are_every_step_of_every_replica(tmp_path):
  s = _script()
  d = 250   # parameters: one replica's float32 model is 1000 bytes
  rows = _fake_workdir(tmp_path, [4.0 * d], clients=1)
  # 4 rounds x 16 steps x 4 replicas x 32 d bits.
  assert s.total_bits(rows, 'data_parallel', inner_steps=16, replicas=4) == (
      4 * 16 * 4 * 32 * d)


def test_streaming_payload_is_all_fragments(tmp_path):
  s = _script()
  rows = _fake_workdir(tmp_path, [600.0, 200.0], clients=4)   # per replica 150, 50
  assert s.payload_bytes(rows, fragments=2) == 200.0


def test_clock_matches_the_network_model(tmp_path):
  s = _script()
  step, gbps, h, k = 0.01, 1.0, 16, 4
  net = network.Network(network.Link.gbps(gbps))
  compute = network.Compute.from_step_seconds(step)
  # DiLoCo: H steps then one blocking ring all-reduce of 1000 bytes.
  rows = _fake_workdir(tmp_path, [4000.0], clients=4)
  ring = 2 * (k - 1) / k * 8 * 1000 / (gbps * 1e9)
  got = s.round_seconds(dict(schedule='diloco'), rows, step, gbps, h, k)
  assert got == pytest.approx(h * step + ring)
  # Data-parallel: the same reduction after every step.
  got = s.round_seconds(dict(schedule='data_parallel'), rows, step, gbps, h, k)
  assert got == pytest.approx(h * (step + ring))
  # Streaming, P = 2: a round of S = H steps is half of the model's H = 2 S
  # round; with tau = 0 every fragment's transfer is exposed.
  arm = dict(schedule='streaming_diloco', fragments=2, overlap_steps=0)
  got = s.round_seconds(arm, rows, step, gbps, h, k)
  want = network.simulate(network.Schedule.streaming_diloco(2 * h, 2, 0), compute,
                          net, 2000.0, k).round_seconds / 2
  assert got == pytest.approx(want) == pytest.approx(h * step + ring)
  # A fragment's transfer shorter than tau steps is hidden.
  arm = dict(schedule='streaming_diloco', fragments=2, overlap_steps=4)
  assert s.round_seconds(arm, rows, step, gbps, h, k) == pytest.approx(h * step)


def test_summary_scales_the_clock_and_bits_to_every_evaluation(tmp_path):
  s = _script()
  rows = _fake_workdir(tmp_path, [4000.0], clients=4)
  arm = dict(name='x', label='x', schedule='diloco')
  line = s.summarize(arm, rows, 0.01, [1.0, 100.0])
  assert line['final_eval_loss'] == 4.0 and line['rounds'] == 4
  assert line['curve_bits'] == [0.0, 2 * 32000.0, 4 * 32000.0]
  per_round = s.round_seconds(arm, rows, 0.01, 100.0)
  assert line['wall_clock_s_100gbps'] == pytest.approx(4 * per_round)
  assert line['curve_wall_clock_s_1gbps'][1] == pytest.approx(
      line['wall_clock_s_1gbps'] / 2)
  assert 'x' in s.table([line], [1.0, 100.0])
