"""Tokens/s and MFU rows of a language model's run; the study config and script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fedjx.experiments import cli
from fedjx.experiments import config as config_lib
from fedjx.experiments import lm_cost
from fedjx.experiments import lm_metrics
from fedjx.experiments import runner
from fedjx.models import llama_config

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
STUDY = os.path.join(ROOT, 'configs', 'diloco_study.py')
SEQ_LEN = 16
REPLICAS, BATCH, H = 2, 4, 2
TINY = dict(width=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_width=32)


def _tiny_study(tmp_path):
  spec = f'{STUDY}:{REPLICAS},500k,0.1'
  config = cli.load_config_file(spec)
  config.rounds = 3
  config.local_steps = H
  config.batch_size = BATCH
  config.eval_every = 3
  config.eval_max_examples = 32
  config.checkpoint_every = 3
  config.progress = False
  config.plot = False
  config.dataset.modules = ('json',)
  config.dataset.seq_len = SEQ_LEN
  config.model.update(TINY)
  config.algorithm = cli.load_module(spec).recipe_algorithm(config.rounds, H, REPLICAS)
  assert config.algorithm.total_steps == 3 * H and config.algorithm.warmup_steps == 1
  return runner.run(config, str(tmp_path / 'run'), log=lambda msg: None)


@pytest.mark.slow
def test_rows_report_tokens_per_s_and_mfu(tmp_path):
  result = _tiny_study(tmp_path)
  rows = [r for r in result.history if r['round'] >= 1]
  assert len(rows) == 3
  assert 'tokens_per_s' not in rows[0]  # The round that compiles is not timed.
  shape = llama_config.preset('500k', **TINY)
  flops = llama_config.train_flops_per_token(shape, SEQ_LEN)
  peak, devices = lm_metrics.peak_flops()  # Measured once per process: the run's.
  assert devices == 1 and peak > 0
  for row in rows[1:]:
    assert row['examples'] == REPLICAS * H * BATCH
    assert row['round_tokens'] == row['examples'] * SEQ_LEN
    # The quotients are computed in float64 from the same fields: equal to
    # float64 rounding (one division, one product).
    np.testing.assert_allclose(row['tokens_per_s'], row['round_tokens'] / row['round_s'],
                               rtol=1e-12)
    np.testing.assert_allclose(row['mfu'], flops * row['tokens_per_s'] / peak, rtol=1e-12)
    assert 0 < row['round_s'] < row['elapsed_s']
  for row in rows:
    assert row['inner_grad_norm'] > 0 and row['pseudo_grad_norm'] > 0
    assert row['communicated_bytes'] == REPLICAS * llama_config.num_params(shape) * 4


def test_models_other_than_llama_get_no_throughput():
  assert lm_metrics.throughput(object(), 128) is None


def test_matmul_peak_and_device_kinds():
  # 2 n^3 FLOPs in a positive time: positive and finite.
  assert 0 < lm_metrics.measure_matmul_flops(size=64, repeats=2) < float('inf')
  assert lm_metrics.device_key('NVIDIA H200') == 'h200'
  assert lm_metrics.device_key('NVIDIA A100-SXM4-40GB') == 'a100-40gb'
  assert lm_metrics.device_key('TPU v5 lite') == 'tpu-v5e'
  assert lm_metrics.device_key('TPU v4') == 'tpu-v4'
  assert lm_metrics.device_key('Some CPU') is None
  assert set(k for _, k in lm_metrics._DEVICE_KINDS) <= set(lm_cost.PEAK_BF16_FLOPS)
  with pytest.raises(ValueError, match='size=0'):
    lm_metrics.measure_matmul_flops(size=0)


def test_throughput_row_by_hand():
  t = lm_metrics.Throughput(llama_config.preset('500k'), 128)
  t._peak = (1e12, 2)  # A peak of 1 TFLOP/s on 2 devices, for the arithmetic.
  row = t.row(examples=10, round_s=4.0)
  assert row['round_tokens'] == 1280 and row['tokens_per_s'] == 320
  # 500k at T = 128: 3,391,488 FLOPs per token (docs/language_models.md).
  assert row['mfu'] == pytest.approx(3_391_488 * 320 / 2e12, rel=1e-12)
  assert t.row(examples=10, round_s=0.0) == {}


def test_study_config_rounds_batch_and_arms():
  study = cli.load_module(STUDY)
  # 20 tokens per parameter of 500,352 over 32 x 128 x 30 tokens per round.
  assert study.num_rounds('500k', 20) == round(20 * 500_352 / (32 * 128 * 30)) == 81
  for m, batch, outer in ((0, 32, (1.0, 0.0)), (1, 32, (0.7, 0.9)), (8, 4, (0.7, 0.9))):
    config = config_lib.validate(cli.load_config_file(f'{STUDY}:{m},1m'))
    assert config.batch_size == batch and config.cohort_size == max(m, 1)
    assert config.dataset.num_shards == max(m, 1)
    assert config.batch_size * config.cohort_size == study.GLOBAL_BATCH
    recipe = config.algorithm
    assert recipe.name == 'diloco_recipe'
    assert recipe.total_steps == config.rounds * 30 and recipe.clip_norm == 1.0
    assert (recipe.outer_learning_rate, recipe.outer_momentum) == outer


@pytest.mark.parametrize('arg, match', [
    ('3,500k', 'divisor of the global batch 32'), ('-1,500k', 'M=-1'),
    ('4,550m', "preset='550m'"), ('4', 'must be "M,preset"'), ('4,1m,0', 'tokens_per_param'),
])
def test_study_config_refuses_bad_arguments(arg, match):
  study = cli.load_module(STUDY)
  with pytest.raises(ValueError, match=match):
    study.parse(arg)


@pytest.mark.slow
def test_reproduce_table4_small(tmp_path):
  out = tmp_path / 'table.json'
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'scripts', 'reproduce_table4.py'), '--small',
       '--workdir', str(tmp_path / 'runs'), '--out', str(out)],
      capture_output=True, text=True, timeout=600, check=True)
  lines = [json.loads(line) for line in proc.stdout.splitlines()]
  runs = [r for r in lines if 'wall_s' in r]
  assert [r['replicas'] for r in runs] == [0, 2]
  saved = json.loads(out.read_text())
  dp, m2 = saved['table']
  assert dp['diff_pct'] is None
  want = 100 * (runs[1]['eval_loss'] - runs[0]['eval_loss']) / runs[0]['eval_loss']
  assert m2['diff_pct'] == pytest.approx(want, abs=1e-3)  # Rounded to 3 decimals.
