"""The LoRA configs through ``fedjx-run``'s runner: FLoRA from a config, exported.

``configs/flowertune_lora.py`` switched to ``algorithm.name='fedlora'`` with
FLoRA's stacking rule and two client ranks runs a round from the runner (the
runner hands the model's LoraConfig to the builder), checkpoints the adapters
with the merged deltas, and exports a merged Hugging Face folder whose model
computes what the run's final state computes (the base plus FLoRA's merged
deltas plus the last adapters), to float32 rounding (the merged kernel is one
sum ``W + M + s a b`` per weight; the logits after 2 layers of width 128 agree
to ~1e-5; checked at 2e-4).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from config_files import load
from fedjx.experiments import runner
from fedjx.experiments import experiment
from fedjx.models import adapters
from fedjx.models import hf_checkpoint
from fedjx.models import llama

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


@pytest.mark.slow
def test_flora_from_a_config_runs_and_exports(tmp_path):
  config = load(os.path.join(CONFIGS, 'flowertune_lora.py'))
  config.algorithm = dict(name='fedlora', rule='flora', client_ranks=(4, 8),
                          client_optimizer=dict(name='sgd', learning_rate=0.05))
  config.lora.rank, config.lora.alpha = 8, 16.0
  config.dataset.template, config.dataset.seq_len = 'chatml', 96
  config.rounds, config.local_steps, config.batch_size = 2, 2, 4
  config.eval_every, config.progress = 2, False
  result = runner.run(config, str(tmp_path / 'run'))
  assert result.step == 2
  _, merged_deltas = adapters.split_merged(result.state.params)
  assert adapters.merged_pairs(merged_deltas)  # FLoRA's deltas are in the params.
  shape, merged = hf_checkpoint.load_pretrained(str(tmp_path / 'run' / 'export' / 'merged'))
  tokens = np.arange(1, 17, dtype=np.int32)[None]
  from_export = np.asarray(llama.llama_lm(shape).apply(merged, tokens))
  model = experiment.build(config).model
  from_state = np.asarray(model.apply(result.state.params, tokens))
  np.testing.assert_allclose(from_export, from_state, rtol=0, atol=2e-4)


def test_fedlora_needs_adapters():
  config = load(os.path.join(CONFIGS, 'flowertune_lora.py'))
  config.algorithm = dict(name='fedlora', rule='flexlora')
  config.lora.rank = 0
  config.lora.export = False
  with pytest.raises(Exception, match='config.lora.rank'):
    experiment.build(config)
