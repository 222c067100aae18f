"""Every Python block of README.md and docs/*.md runs, page by page.

A page's fenced ``python`` blocks execute in order in one namespace, as a
reader pasting them into one session would, in a temporary folder where
``configs/`` is the repository's (the pages name config files relative to
the checkout). A block preceded by an HTML comment

    <!-- skip: REASON -->

(on the lines just above its fence) is not run, and the page's test
reports REASON: a block that needs an accelerator or a download, or a
deliberate fragment (an excerpt of a config file). ``<!-- needs: MODULE -->``
runs the block where MODULE imports (an optional extra) and skips it
elsewhere; ``<!-- slow: REASON -->`` before any block of a page marks the
page's test ``slow``. A failing block's traceback points at its line of the
page. Pages with a test module of their own, which runs their blocks and
checks what they compute, are skipped here naming that module.
"""

import glob
import importlib.util
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r'^```python[ \t]*\n(.*?)^```[ \t]*$', re.S | re.M)
MARK = re.compile(r'^\s*<!--\s*(skip|slow|needs)\s*:\s*(.*?)\s*-->\s*$', re.S)

# Pages whose blocks a test module of their own runs (and checks).
TESTED_ELSEWHERE = {
    'docs/writing_an_algorithm.md': 'tests/test_writing_an_algorithm.py',
    'docs/fine_tuning.md': 'tests/test_fine_tuning_doc.py',
}


def blocks(text):
  """``[(line, code, marks)]`` of a page's ``python`` blocks, in order.

  ``marks`` maps ``skip``, ``slow`` and ``needs`` to their text, from the
  HTML comments on the lines just above the fence.
  """
  out = []
  for m in BLOCK.finditer(text):
    line = text.count('\n', 0, m.start()) + 2  # The block's first code line.
    marks = {}
    above = text[:m.start()].rstrip('\n').split('\n')
    while above and above[-1].strip().endswith('-->'):
      opening = [i for i, l in enumerate(above) if '<!--' in l]  # Comments may wrap.
      if not opening:
        break
      start = opening[-1]
      mark = MARK.search(' '.join(above[start:]))
      if mark:
        marks.setdefault(mark.group(1), re.sub(r'\s+', ' ', mark.group(2)))
      above = above[:start]
    out.append((line, m.group(1), marks))
  return out


def pages():
  found = ['README.md'] + sorted(
      os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, 'docs', '*.md')))
  params = []
  for page in found:
    with open(os.path.join(REPO, page), encoding='utf-8') as f:
      found_blocks = blocks(f.read())
    if not found_blocks:
      continue
    marks = [pytest.mark.slow] if any('slow' in b[2] for b in found_blocks) else []
    params.append(pytest.param(page, id=page, marks=marks))
  return params


def test_marks_are_read_from_the_comments_above_the_fence():
  text = ('x\n\n<!-- skip: needs a TPU -->\n```python\na = 1\n```\n'
          '<!-- slow: trains 300\n     rounds -->\n<!-- needs: apache_beam -->\n'
          '```python\nb = 2\n```\n'
          '<!-- a comment -->\n\n```python\nc = 3\n```\n')
  assert blocks(text) == [
      (5, 'a = 1\n', {'skip': 'needs a TPU'}),
      (11, 'b = 2\n', {'slow': 'trains 300 rounds', 'needs': 'apache_beam'}),
      (16, 'c = 3\n', {})]


def test_the_scan_finds_the_pages_blocks():
  ids = [p.id for p in pages()]
  assert {'README.md', 'docs/datasets.md', 'docs/primitives.md'} <= set(ids)


@pytest.mark.parametrize('page', pages())
def test_the_page_s_python_blocks_run(page, tmp_path, monkeypatch):
  if page in TESTED_ELSEWHERE:
    pytest.skip(f'run and checked by {TESTED_ELSEWHERE[page]}')
  with open(os.path.join(REPO, page), encoding='utf-8') as f:
    found = blocks(f.read())
  os.symlink(os.path.join(REPO, 'configs'), tmp_path / 'configs')
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('MPLBACKEND', 'Agg')
  namespace = {'__name__': 'docs_page'}
  skipped = []
  path = os.path.join(REPO, page)
  for line, code, marks in found:
    if 'needs' in marks and importlib.util.find_spec(marks['needs']) is None:
      marks = {'skip': f"needs {marks['needs']}, an optional extra"}
    if 'skip' in marks:
      skipped.append(f"line {line}: {marks['skip']}")
      continue
    # Padded so that line numbers in a traceback are the page's own.
    exec(compile('\n' * (line - 1) + code, path, 'exec'), namespace)  # pylint: disable=exec-used
  if skipped and len(skipped) == len(found):
    pytest.skip('; '.join(skipped))
