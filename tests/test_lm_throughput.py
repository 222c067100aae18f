"""``lm_cost.measure_inner_step`` and ``scripts/benchmark_lm.py`` on the ``500k`` preset.

The first step's loss is checked against a cross-entropy written here from
the model's logits (float32 over ``2 x 16`` tokens of a vocabulary of 256:
the mean of 32 log-softmax terms, each within a few ulps of ``ln 256``, so
``rtol = 1e-5`` is ample); the reported rates follow from the timed step.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjx.experiments import lm_cost
from fedjx.models import llama
from fedjx.models import llama_config as lc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_measured_step_trains_the_model_and_reports_consistent_rates():
  batch, seq_len = 2, 16
  row = lm_cost.measure_inner_step('500k', batch=batch, seq_len=seq_len, steps=2,
                                   repeats=2, peak_flops=1e12, seed=3)
  config = lc.preset('500k')
  k_init, k_tokens = jax.random.split(jax.random.key(3))
  tokens = jax.random.randint(k_tokens, (1, batch, seq_len + 1), 1, config.vocab_size,
                              jnp.int32)[0]
  model = llama.llama_lm(config)
  params = model.module.init(k_init, jnp.zeros((batch, seq_len), jnp.int32),
                             train=False)['params']
  logits = model.module.apply({'params': params}, tokens[:, :-1])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  expected = -np.mean(np.take_along_axis(np.asarray(logp), np.asarray(tokens[:, 1:])[..., None],
                                         axis=-1))
  np.testing.assert_allclose(row['first_loss'], expected, rtol=1e-5)
  assert row['last_loss'] < row['first_loss']  # 4 more AdamW steps on the same batch.
  assert row['steps'] == 1 + 2 * 2
  assert row['params'] == lc.num_params(config)
  flops = lc.train_flops_per_token(config, seq_len) * batch * seq_len
  assert row['model_flops_per_step'] == flops
  np.testing.assert_allclose(row['tokens_per_s'] * row['step_s'], batch * seq_len, rtol=1e-12)
  np.testing.assert_allclose(row['mfu'], flops / row['step_s'] / 1e12, rtol=1e-12)
  assert row['planned_peak_bytes'] > 3 * 4 * row['params']  # parameters and AdamW's moments


@pytest.mark.parametrize('arg, value', [('batch', 0), ('steps', 1.5), ('repeats', True)])
def test_bad_sizes_are_refused_by_name(arg, value):
  with pytest.raises(ValueError, match=f'{arg}={value!r} must be a positive integer'):
    lm_cost.measure_inner_step('500k', **{arg: value})


@pytest.mark.slow
def test_the_script_refuses_an_unknown_preset_in_one_line():
  proc = subprocess.run([sys.executable, 'scripts/benchmark_lm.py', '--presets=35m,7b'],
                        capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 2
  assert "--presets holds '7b'; allowed: 500k" in proc.stderr
