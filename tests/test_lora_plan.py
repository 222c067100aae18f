"""fedjx.experiments.lora_plan: analytic LoRA bytes against the real trees, and fedjx-plan's table.

The adapter counts and frozen-base bytes are checked against the parameter
trees that fedjx.models.lora builds on the '500k' preset (integers: exact);
the published parameter counts of TinyLlama-1.1B and Llama-2-7B against
num_params; the compiled step's XLA arguments against the analytic state. The
CLI compiles 1.1B and 7B at short sequences (abstract inputs: no allocation).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjx.experiments import lora_plan
from fedjx.experiments import plan_cli
from fedjx.experiments import plan_report
from fedjx.models import llama
from fedjx.models import llama_config as lc
from fedjx.models import lora
from fedjx.models.lora_config import LoraConfig

BATCH = {'x': jnp.zeros((1, 5), jnp.int32)}


def _nbytes(tree) -> int:
  return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree)))


def _reference_adapters(c: lc.LlamaConfig, rank: int, targets) -> int:
  """NumPy count: r (n_in + n_out) per adapted projection and layer."""
  d, h, f = c.width, c.head_width, c.mlp_width
  dims = {'q_proj': (d, c.num_heads * h), 'k_proj': (d, c.num_kv_heads * h),
          'v_proj': (d, c.num_kv_heads * h), 'o_proj': (c.num_heads * h, d),
          'gate_proj': (d, f), 'up_proj': (d, f), 'down_proj': (f, d)}
  return int(np.sum([c.num_layers * rank * (dims[t][0] + dims[t][1]) for t in targets]))


def test_the_fine_tuning_shapes_have_the_published_parameter_counts():
  assert lc.num_params(lora_plan.TINYLLAMA_1_1B) == 1_100_048_384
  assert lc.num_params(lora_plan.LLAMA2_7B) == 6_738_415_616
  # Llama-2-7B, rank 8 on q and v: 32 layers x 2 x 8 x (4096 + 4096), as PEFT reports.
  assert lora_plan.adapter_count(lora_plan.LLAMA2_7B, LoraConfig(rank=8)) == 4_194_304


@pytest.mark.parametrize('targets', [('q_proj', 'v_proj'),
                                     ('k_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')])
def test_the_adapter_count_is_the_number_of_adapter_parameters_lora_model_draws(targets):
  config = LoraConfig(rank=4, targets=targets)
  model = lora.lora_model(llama.llama_lm('500k'), config, jax.random.key(0), BATCH)
  params = model.init(jax.random.key(1), BATCH)
  n = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
  c = lc.preset('500k')
  assert lora_plan.adapter_count(c, config) == n == _reference_adapters(c, 4, targets)
  assert lora_plan.trained_count(c, config) == n


@pytest.mark.parametrize('base_dtype', ['float32', 'bfloat16', 'int8'])
def test_the_base_bytes_are_the_bytes_of_lora_model_frozen(base_dtype):
  config = LoraConfig(rank=4, targets=('q_proj', 'v_proj', 'down_proj'), base_dtype=base_dtype)
  model = lora.lora_model(llama.llama_lm('500k'), config, jax.random.key(0), BATCH)
  assert lora_plan.base_bytes(lc.preset('500k'), config) == _nbytes(model.frozen)


def test_ffa_lora_trains_only_b_and_freezes_a_into_the_base():
  config = LoraConfig(rank=4, targets=('q_proj', 'v_proj'), train_a=False)
  model = lora.lora_model(llama.llama_lm('500k'), config, jax.random.key(0), BATCH)
  c = lc.preset('500k')
  assert lora_plan.trained_count(c, config) == sum(
      int(np.prod(np.shape(x))) for x in jax.tree.leaves(model.init(jax.random.key(1), BATCH)))
  assert lora_plan.base_bytes(c, config) == _nbytes(model.frozen)


def test_the_round_bytes_follow_the_cohort():
  c, config = lora_plan.TINYLLAMA_1_1B, LoraConfig(rank=8, targets=('q_proj', 'v_proj'))
  # TinyLlama: q is 2048 -> 2048, v is 2048 -> 256 (4 key/value heads of 64).
  a = 22 * 8 * ((2048 + 2048) + (2048 + 256))
  wire = lora_plan.round_bytes(c, config, cohort=100)
  assert wire == {'upload': 100 * 4 * a, 'download': 100 * 4 * a,
                  'flora_download': 100 * 100 * 4 * a}
  with pytest.raises(ValueError, match=r'round_bytes: cohort=0 must be a positive integer'):
    lora_plan.round_bytes(c, config, cohort=0)


def test_the_compiled_arguments_are_the_analytic_state_and_two_clients_share_the_base():
  c = lc.preset('500k')
  config = LoraConfig(rank=4, base_dtype='int8')
  plan = lora_plan.plan_lora(c, config, batch=2, seq_len=16, remat='none',
                             clients_per_device=2, cohort=3)
  n = _reference_adapters(c, 4, config.targets)
  assert plan.adapter_bytes == 2 * 4 * n and plan.optimizer_bytes == 2 * 2 * 4 * n
  state = plan.base_bytes + plan.adapter_bytes + plan.optimizer_bytes + plan.token_bytes
  # XLA's arguments are the same buffers plus AdamW's step counts (int32, one per client).
  assert state <= plan.xla_argument_bytes <= state + 64
  assert plan.total_bytes >= plan.xla_temp_bytes > 0
  assert plan.upload_bytes == 3 * 4 * n and plan.flora_download_bytes == 9 * 4 * n


def test_plan_lora_refuses_bad_arguments():
  c = lc.preset('500k')
  with pytest.raises(ValueError, match=r'plan_lora: batch=0 must be a positive integer'):
    lora_plan.plan_lora(c, LoraConfig(), batch=0, seq_len=8, remat='none')
  with pytest.raises(ValueError, match=r"plan_lora: remat='some' is not one of"):
    lora_plan.plan_lora(c, LoraConfig(), batch=1, seq_len=8, remat='some')
  with pytest.raises(ValueError, match=r'plan_lora: lora.rank=100 exceeds min\(n_in, n_out\)=64 '
                     r'of v_proj \(128, 64\)'):
    lora_plan.plan_lora(c, LoraConfig(rank=100), batch=1, seq_len=8, remat='none')


def _gb(out: str, label: str) -> float:
  value, unit = re.search(rf'  {label} +([\d,.]+) (GB|MB)', out).groups()
  return float(value.replace(',', '')) * (1e9 if unit == 'GB' else 1e6)


@pytest.mark.parametrize('preset,dtype,params', [('tinyllama-1.1b', 'bfloat16', 1_100_048_384),
                                                 ('llama2-7b', 'int8', 6_738_415_616)])
def test_fedjx_plan_prints_the_lora_table_for_1_1b_and_7b(capsys, preset, dtype, params):
  argv = [f'--preset={preset}', '--lora_rank=8', '--lora_targets=q_proj,v_proj',
          f'--lora_base_dtype={dtype}', '--cohort=100', '--batch=1', '--seq_len=32',
          '--remat=full', '--device=h100']
  assert plan_cli.main(argv) == 0
  out = capsys.readouterr().out
  assert f'({params:,} parameters)' in out
  for label in ('frozen base', 'adapters', 'optimizer', 'activations', 'total'):
    assert re.search(rf'  {label} +[\d,.]+ (GB|MB)', out), label
  config = lora_plan.SHAPES[preset]
  assert re.search(r'  fits h100 +yes  80\.00 GB; named', out)
  expected = lora_plan.base_bytes(config, LoraConfig(rank=8, base_dtype=dtype))
  assert abs(_gb(out, 'frozen base') / expected - 1) < 0.005  # Printed to 2 decimals of GB.
  adapters = 4 * lora_plan.adapter_count(config, LoraConfig(rank=8))
  assert re.search(rf'    upload +{plan_report.gb(100 * adapters)}  100 x '
                   rf'{plan_report.gb(adapters)}\n', out)


@pytest.mark.parametrize('flags,message', [
    (['--lora_rank=0'], '--lora_rank=0 must be an integer >= 1'),
    (['--lora_rank=4', '--lora_targets=q_proj,w_proj'], "--lora_targets='q_proj,w_proj' must be"),
    (['--lora_rank=4', '--cohort=0'], '--cohort=0 must be a positive integer'),
    (['--lora_rank=4', '--replicas=2'], '--lora_rank=4 plans one device'),
    ([], '--preset=llama2-7b is a fine-tuning shape; it needs --lora_rank'),
    (['--lora_rank=5000'], '--lora_rank=5000 exceeds min(n_in, n_out) of q_proj (4096, 4096)'),
])
def test_fedjx_plan_names_the_bad_lora_option(capsys, flags, message):
  assert plan_cli.main(['--preset=llama2-7b'] + flags) == 2
  assert message in capsys.readouterr().err
