"""docs/api.md is what scripts/api_list.py generates from the source.

The page lists every public module of fedjx and its public names with a
phrase from each docstring; regenerating it in memory (``ast`` only, no
package imported) and comparing keeps it from going stale. When this fails
after an API change: ``python scripts/api_list.py``.
"""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
  spec = importlib.util.spec_from_file_location(
      'api_list', os.path.join(ROOT, 'scripts', 'api_list.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_committed_page_is_current():
  api_list = _script()
  with open(api_list.PAGE, encoding='utf-8') as f:
    committed = f.read()
  generated = api_list.render(api_list.Source(ROOT))
  assert committed == generated, (
      'docs/api.md is stale; regenerate it: python scripts/api_list.py')


def test_every_package_and_its_names_are_listed():
  api_list = _script()
  source = api_list.Source(ROOT)
  text = api_list.render(source)
  for package in api_list.PACKAGES:
    assert f'## `{package}`' in text
    for name in source.modules[package].all or ():
      assert f'- `{name}`: ' in text
  assert '### `fedjx.algorithms.feddyn_lib`' in text
  assert '- `feddyn`: FedDyn over a population' in text


def test_summaries_are_first_sentences():
  f = _script().first_sentence
  assert f('Adam as in Reddi et al. 2021. More.') == 'Adam as in Reddi et al. 2021.'
  assert f('Uses :func:`~fedjx.algorithms.base.make_algorithm`.\n\nMore.') == (
      'Uses `fedjx.algorithms.base.make_algorithm`.')
  assert f('``x`` e.g. this. That') == '`x` e.g. this.'
  assert f('') == '(no docstring).'
