"""Every relative link of the Markdown pages reaches a file, and its anchor a heading.

The pages are README.md, CHANGELOG.md, docs/*.md and the Markdown files
under benchmarks/. A link ``[text](path#anchor)`` (or an image) whose path is
not a URL must name an existing file relative to the page; an anchor into a
Markdown page must be one of that page's headings, slugged as GitHub slugs
them (lower case, punctuation other than ``-`` and ``_`` dropped, spaces to
``-``, a repeated heading suffixed ``-1``, ``-2``, ...).
"""

import collections
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^(```|~~~).*?^\1', re.S | re.M)


def pages():
  found = [os.path.join(REPO, 'README.md'), os.path.join(REPO, 'CHANGELOG.md')]
  found += sorted(glob.glob(os.path.join(REPO, 'docs', '**', '*.md'), recursive=True))
  found += sorted(glob.glob(os.path.join(REPO, 'benchmarks', '**', '*.md'), recursive=True))
  return [p for p in found if os.path.exists(p)]


def slug(heading):
  text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # A link's text only.
  text = re.sub(r'[^\w\- ]', '', text.strip().lower())
  return text.replace(' ', '-')


def anchors(path):
  """The anchors GitHub gives the headings of the Markdown file ``path``."""
  with open(path, encoding='utf-8') as f:
    text = FENCE.sub('', f.read())
  seen = collections.Counter()
  out = set()
  for heading in re.findall(r'^#{1,6}\s+(.*?)\s*#*\s*$', text, re.M):
    base = slug(heading)
    out.add(base if not seen[base] else f'{base}-{seen[base]}')
    seen[base] += 1
  return out


def links(path):
  with open(path, encoding='utf-8') as f:
    text = FENCE.sub('', f.read())
  text = re.sub(r'`[^`\n]*`', '', text)  # Code spans are not links.
  return [t for t in LINK.findall(text)
          if not re.match(r'^[a-z][a-z0-9+.-]*:', t)]  # http:, mailto:, ...


def test_the_scan_sees_the_pages_and_their_links():
  names = {os.path.relpath(p, REPO) for p in pages()}
  assert {'README.md', 'docs/README.md', 'docs/benchmarks.md'} <= names
  assert sum(len(links(p)) for p in pages()) > 100


def test_slugs_follow_github():
  assert slug('A fair hand-written floor, and cohorts (CPU, 2 cores), 2026-12-06') == (
      'a-fair-hand-written-floor-and-cohorts-cpu-2-cores-2026-12-06')
  assert slug('`fedjx-run` and [the docs](docs/README.md)') == 'fedjx-run-and-the-docs'


@pytest.mark.parametrize('page', pages(), ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_resolves(page):
  broken = []
  for target in links(page):
    path, _, anchor = target.partition('#')
    full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(full):
      broken.append(f'{target}: no file {os.path.relpath(full, REPO)}')
    elif anchor and full.endswith('.md') and anchor not in anchors(full):
      broken.append(f'{target}: no heading #{anchor} in {os.path.relpath(full, REPO)}')
  assert not broken, f'{os.path.relpath(page, REPO)}:\n' + '\n'.join(broken)
