"""docs/fine_tuning.md, run as a test.

The page's Python blocks execute in order in one namespace: a tiny Hugging
Face-layout checkpoint is written, the FlowerTune-shaped config fine-tunes
LoRA adapters on it for three short rounds from the built-in instruction
set, and the exported PEFT adapter and merged model load back. Checked
here: the run's evaluation loss is finite and below the untrained model's
(the adapters learned the response tokens), and the merged model's logits
equal the adapters-on-base logits up to float32 rounding of ``W + s a b``
through the model's depth (``2e-4`` absolute on logits of size ``O(1)``:
a few ulps per matrix product, summed over 2 layers of width 128).
"""

import os
import pathlib
import re

import numpy as np
import pytest

PAGE = pathlib.Path(__file__).resolve().parent.parent / 'docs' / 'fine_tuning.md'


def code_blocks(text):
  return re.findall(r'^```python\n(.*?)^```', text, re.S | re.M)


@pytest.fixture(scope='module')
def page():
  namespace = {'__name__': 'fine_tuning'}
  cwd = os.getcwd()
  os.chdir(PAGE.parent.parent)  # The page opens configs/ relative to the checkout.
  try:
    for i, block in enumerate(code_blocks(PAGE.read_text())):
      exec(compile(block, f'{PAGE.name}, block {i}', 'exec'), namespace)  # pylint: disable=exec-used
  finally:
    os.chdir(cwd)
  return namespace


def test_the_page_has_its_three_blocks():
  assert len(code_blocks(PAGE.read_text())) == 3


@pytest.mark.slow
def test_the_run_learns_and_exports(page):
  history = page['result'].history
  first = next(r for r in history if 'eval_loss' in r)
  last = [r for r in history if 'eval_loss' in r][-1]
  assert np.isfinite(last['eval_loss'])
  assert last['eval_loss'] < first['eval_loss']
  export = os.path.join(page['root'], 'run', 'export')
  assert sorted(os.listdir(os.path.join(export, 'adapter'))) == [
      'adapter_config.json', 'adapter_model.safetensors']


def test_the_merged_model_computes_the_adapted_model(page):
  a, b = np.asarray(page['from_merged']), np.asarray(page['from_adapters'])
  assert a.shape == b.shape
  np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)
  # The adapters moved: the merged model is not the pretrained one.
  from fedjx.models import llama
  base = llama.llama_lm(page['shape']).apply(page['base'], page['tokens'])
  assert np.max(np.abs(np.asarray(base) - a)) > 1e-4
