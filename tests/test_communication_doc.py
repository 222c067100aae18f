"""The figures of docs/communication.md's DiLoCo compressors are the code's.

Each figure the page states is found in the page's text and recomputed
from the library: the bits of one 64 x 64 tile at the papers' settings
(SparseLoCo and DeMo), and the first round of the page's SparseLoCo command
on the byte-level text config, from the bit count of the tiles of that
config's model (fast) and from running the command itself (slow).
"""

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import jax
import pytest

from fedjx.algorithms.compression import dct
from fedjx.algorithms.compression import outer
from fedjx.experiments import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE_PATH = os.path.join(REPO, 'docs', 'communication.md')
with open(PAGE_PATH, encoding='utf-8') as _f:
  PAGE = _f.read()
PAGE_TEXT = re.sub(r'\s+', ' ', PAGE)  # Sentences wrap anywhere.


def _number(text):
  return int(text.replace(',', ''))


def _config_example():
  """``(args, bits per replica, communicated_bytes)`` of the page's SparseLoCo command."""
  stated = re.search(r'the first round sent ([\d,]+) bits per replica, '
                     r'`communicated_bytes` ([\d,]+) for the (\d+) replicas', PAGE_TEXT)
  assert stated, 'the page states the first round of its SparseLoCo command'
  after = PAGE[PAGE.index('the first round sent'):]
  command = re.search(r'```bash\n(.*?)```', after, re.S).group(1)
  words = shlex.split(command.replace('\\\n', ' '))
  assert words[0] == 'fedjx-run' and 'sparseloco' in command
  args = []  # Each flag as --name=value.
  for word in words[1:]:
    if args and '=' not in args[-1] and not word.startswith('--'):
      args[-1] += '=' + word
    else:
      args.append(word)
  return args, _number(stated.group(1)), _number(stated.group(2)), int(stated.group(3))


def _flag(args, name):
  return next(a.split('=', 1)[1] for a in args if a.startswith(name + '='))


def test_a_sparseloco_tile_at_the_paper_s_setting():
  assert '`64 (12 + 2) = 896` bits per tile, 0.22 bits per coordinate' in PAGE_TEXT
  assert 'plus 160 bits of table and mean per leaf' in PAGE_TEXT
  bits = outer.tiled_top_k_bits([(64, 64)], k=64, chunk=64, bits=2)
  assert bits == 896 + 160
  assert round(896 / 4096, 2) == 0.22


def test_a_demo_tile_at_the_defaults():
  assert 'a 64 x 64 tile costs `32 (32 + 12) = 1408` bits, 0.34 bits per coordinate' in PAGE_TEXT
  assert dct.tiled_dct_bits([(64, 64)], chunk=64, k=32) == 1408
  assert round(1408 / 4096, 2) == 0.34


def test_the_config_example_s_first_round_is_the_code_s_bit_count():
  args, bits, communicated, replicas = _config_example()
  path, _, arg = _flag(args, '--config').partition(':')
  spec = importlib.util.spec_from_file_location('page_config', os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(*([arg] if arg else []))
  aggregator = ast.literal_eval(_flag(args, '--config.algorithm.aggregator'))
  assert aggregator['num_replicas'] == replicas == config.cohort_size
  data = registry.build_dataset(config.dataset, config.seed)
  model = registry.build_model(config.model, data.info)
  batch = {k: v[:2] for k, v in data.train.client_data(0).items()}
  shapes = outer.leaf_shapes(jax.eval_shape(lambda: model.init(jax.random.key(0), batch)))
  side = int(aggregator['chunk_size'] ** 0.5)
  assert side * side == aggregator['chunk_size']
  assert 'the model\'s {} leaves in tiles of at most {} x {}'.format(
      len(shapes), side, side) in PAGE_TEXT
  assert outer.tiled_top_k_bits(shapes, aggregator['k'], side, 2) == bits
  assert communicated == replicas * bits // 8


@pytest.mark.slow
def test_the_config_example_s_command_reports_the_page_s_figures(tmp_path):
  args, bits, communicated, _ = _config_example()
  args = [a for a in args if not a.startswith(('--workdir', '--config.rounds'))]
  cli = os.path.join(os.path.dirname(sys.executable), 'fedjx-run')
  subprocess.run([cli, *args, f'--workdir={tmp_path / "run"}', '--config.rounds=1'],
                 cwd=REPO, check=True, capture_output=True, timeout=900)
  with open(tmp_path / 'run' / 'metrics.jsonl', encoding='utf-8') as f:
    first = next(r for r in map(json.loads, f) if 'upload_bits' in r)
  assert first['upload_bits'] == bits
  assert first['communicated_bytes'] == communicated
