"""``fedjx-plan --config``: the round fedjx-run would run, planned from the config.

The plan builds the experiment the runner's way and compiles its first round;
its figures are checked against counts made here from the config: the MLP's
parameters and their float32 bytes, the bytes each client uploads and
downloads, three forward passes' worth of matrix-product FLOPs, the memory
rows against XLA's peak, and, for a Llama model sharded on
``clients=2,fsdp=2,tensor=2``, the parameters one device holds.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from fedjx.experiments import cli
from fedjx.experiments import config as config_lib
from fedjx.experiments import plan_report
from fedjx.experiments import round_plan
from fedjx.models import llama_config as lc

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
DIGITS = os.path.join(ROOT, 'configs', 'fedavg_digits.py')
FEDJX_PLAN = os.path.join(os.path.dirname(sys.executable), 'fedjx-plan')

# configs/fedavg_digits.py: an MLP 64 -> 128 -> 10 with biases.
MLP_MATMUL = 64 * 128 + 128 * 10
MLP_PARAMS = MLP_MATMUL + 128 + 10


@pytest.fixture(scope='module')
def digits_plan():
  config = cli.load_config_file(DIGITS)
  return round_plan.plan_config(config)


def test_the_plan_of_fedavg_on_digits_counts_what_the_config_says(digits_plan):
  p = digits_plan
  config = config_lib.with_defaults(cli.load_config_file(DIGITS))
  assert (p.algorithm, p.model, p.dataset) == ('fedavg', 'mlp', 'digits')
  assert p.params == MLP_PARAMS and p.param_bytes == 4 * MLP_PARAMS
  assert (p.clients, p.batch) == (config.cohort_size, config.batch_size)
  # Every client downloads the model and uploads its float32 update.
  assert p.download_bytes == p.upload_bytes == config.cohort_size * 4 * MLP_PARAMS
  # Three forward passes of 2 FLOPs per multiply-add, per example of the
  # round; XLA's count adds the biases, the ReLU and the loss (under 5 %).
  examples = p.clients * p.steps * p.batch
  assert 1.0 <= p.flops / (3 * 2 * MLP_MATMUL * examples) < 1.05
  # The rows are XLA's peak: the arguments are the state, the data and the key
  # (less what the round does not read: the cohort's 10 client ids).
  assert abs(p.argument_bytes - (p.param_bytes + p.state_bytes + p.data_bytes)) <= 64
  assert p.peak_bytes == p.argument_bytes + p.output_bytes - p.alias_bytes + p.temp_bytes
  assert not p.streams(80e9) and p.streams(p.auto_bytes)  # 'auto' streams above 80 %.


def test_the_table_holds_the_plan_against_the_named_or_assumed_device(digits_plan):
  named = plan_report.render_round(digits_plan, plan_report.target('tpu-v5e'), 'x.py')
  assert re.search(rf'  parameters +{MLP_PARAMS:,}\n', named)
  assert re.search(r'    total +[\d.]+ MB  XLA peak', named)
  assert re.search(r'  fits tpu-v5e +yes  17\.18 GB; named', named)
  assert re.search(r'    upload +384\.40 kB  10 x 38\.44 kB', named)
  assert 'round runs' in named and 'compiled' in named
  host = plan_report.target()
  assert host.source == 'assumed' and host.name == 'host CPU'  # No accelerator here.
  assert 'assumed: no accelerator is visible' in plan_report.render_round(
      digits_plan, host, 'x.py')
  with pytest.raises(ValueError, match="device='b200' is not one of"):
    plan_report.target('b200')


def test_fedjx_plan_prints_one_json_line_for_a_config():
  out = subprocess.run([FEDJX_PLAN, '--config', DIGITS, '--device', 'h100', '--json',
                        '--config.cohort_size=5'], capture_output=True, text=True,
                       timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  row = json.loads(out.stdout)
  assert (row['kind'], row['clients'], row['params']) == ('round', 5, MLP_PARAMS)
  assert (row['device'], row['device_source'], row['device_memory_bytes']) == (
      'h100', 'named', 80e9)
  assert row['fits'] is True and row['streams'] is False
  assert row['upload_bytes'] == 5 * 4 * MLP_PARAMS


@pytest.mark.parametrize('flags,message', [
    (['--workdir', 'w'], '--workdir: fedjx-plan trains nothing and writes nothing'),
    (['--tpu', 'v5e:2x4', '--device', 'h100'], 'give one (a topology names its chips)'),
    (['--num_slices', '2'], '--num_slices=2 needs --tpu'),
    (['--config.rounds=abc'], "--config.rounds='abc'"),
    (['--config.cohort_sise=3'], 'unknown config field config.cohort_sise'),
])
def test_fedjx_plan_refuses_a_bad_command_line_in_one_line(flags, message):
  out = subprocess.run([FEDJX_PLAN, '--config', DIGITS, *flags], capture_output=True,
                       text=True, timeout=300, check=False)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('fedjx-plan: ') and message in lines[0], (
      out.stderr)


def test_a_pod_plan_needs_a_llama_diloco_or_fedavg_round():
  config = cli.load_config_file(DIGITS)
  with pytest.raises(config_lib.ConfigError, match=r"config.model.name='mlp': --tpu plans "
                     'llama_lm models'):
    round_plan.plan_config_pod(config, 'v5e:2x4')
  config = cli.load_config_file(os.path.join(ROOT, 'configs', 'fedprox_synthetic.py'))
  with pytest.raises(config_lib.ConfigError, match=r"config.algorithm.name='fedprox': --tpu "
                     'plans the rounds of diloco, diloco_recipe, fedavg'):
    round_plan.plan_config_pod(config, 'v5e:2x4')


def test_a_pod_plan_fills_fsdp_with_the_chips_left_and_refuses_what_does_not_divide():
  config = config_lib.with_defaults(cli.load_config_file(
      os.path.join(ROOT, 'configs', 'diloco_study.py') + ':4,500k'))
  assert round_plan._mesh_sizes(config, 4, 256) == (64, 1)
  config.mesh = 'clients=4,tensor=2'
  assert round_plan._mesh_sizes(config, 4, 256) == (32, 2)
  config.mesh = 'clients=2,fsdp=2'
  with pytest.raises(config_lib.ConfigError, match='give clients=4 or -1'):
    round_plan._mesh_sizes(config, 4, 256)
  config.mesh = ''  # 4 replicas on one chip, or 8 on 4 chips: one after another.
  assert round_plan._mesh_sizes(config, 4, 1) == (1, 1)
  assert round_plan._mesh_sizes(config, 8, 4) == (1, 1)
  config.mesh = 'clients=-1,tensor=3'
  with pytest.raises(config_lib.ConfigError, match='do not divide the 256 chips'):
    round_plan._mesh_sizes(config, 4, 256)


@pytest.mark.slow
def test_a_sharded_diloco_plan_holds_a_quarter_of_the_model_per_device():
  config = cli.load_config_file(os.path.join(ROOT, 'configs', 'diloco_study.py') + ':2,500k')
  config.mesh = 'clients=2,fsdp=2,tensor=2'
  config.progress = False
  p = round_plan.plan_config(config)
  shape = lc.preset('500k')
  n = lc.num_params(shape)
  norms = 2 * shape.num_layers * shape.width + shape.width  # Replicated on every device.
  assert p.devices == 8 and p.mesh == 'clients=2,fsdp=2,tensor=2'
  assert p.param_bytes == 4 * ((n - norms) / 4 + norms)
  assert p.upload_bytes == 2 * 4 * n
  tokens = p.clients * p.steps * p.batch * shape.seq_len
  assert p.flops == lc.train_flops_per_token(shape, shape.seq_len) * tokens
