"""A text corpus that Python itself ships: the standard library's source files.

For language-model (and DiLoCo) experiments with no download. Each client is a
top-level module of the standard library (``json``, ``email``, ``asyncio``,
``os``, ...): its ``.py`` files, in sorted path order, concatenated and cut
into fixed-length token sequences. Modules differ in size (a few hundred bytes
to megabytes) and in style, so the population has natural quantity and
distribution skew, like the Shakespeare and Stack Overflow corpora of LEAF
(Caldas et al. 2018) and TensorFlow Federated.

Tokens are bytes (vocabulary 256) or characters (code points 0..127 and one
unknown-character id 128, vocabulary 129). A client's token stream ``t`` of
length ``L`` gives ``(L - 1) // T`` examples; example ``i`` is
``t[i T : i T + T + 1]``, returned as ``{'x': t[:-1], 'y': t[1:]}`` (next-token
targets) or ``{'tokens': t}``. Files are read only when a client is (at
the character level, construction also reads each file once to count its
characters).

Any directory of text files works the same way through ``root`` and
``suffixes``; the default root is ``sysconfig.get_paths()['stdlib']`` minus
test suites, ``site-packages`` and caches.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedjx.datasets.federated import Examples, FederatedDataset

LEVELS = ('byte', 'char')
OUTPUTS = ('xy', 'tokens')
DEFAULT_EXCLUDE = ('test', 'tests', 'idle_test', 'site-packages', '__pycache__')
_UNK = 128


class TextCorpus(FederatedDataset):
  """Clients are groups of text files, examples fixed-length token windows.

  Attributes:
    vocab_size: 256 for bytes, 129 for characters.
    seq_len: ``T``, the length of ``x`` and ``y`` (``tokens`` has ``T + 1``).
    level: ``'byte'`` or ``'char'``.
  """

  def __init__(self, groups: Sequence[tuple[str, Sequence[Path]]], seq_len: int,
               level: str = 'byte', output: str = 'xy', min_examples: int = 1):
    if level not in LEVELS:
      raise ValueError(f'text_corpus: level={level!r} is not one of {LEVELS}.')
    if output not in OUTPUTS:
      raise ValueError(f'text_corpus: output={output!r} is not one of {OUTPUTS}.')
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
      raise ValueError(f'text_corpus: seq_len={seq_len!r}; it must be an int >= 1.')
    self.seq_len, self.level, self.output = seq_len, level, output
    self.vocab_size = 256 if level == 'byte' else _UNK + 1
    kept = []
    for name, files in groups:
      length = self._length(files)
      count = max(0, (length - 1) // seq_len)
      if count >= max(1, min_examples):
        kept.append((name, list(files), count))
    if not kept:
      raise ValueError(f'text_corpus: no group has {max(1, min_examples)} sequence(s)'
                       f' of {seq_len + 1} tokens; lower seq_len or add files.')
    self._names = [name for name, _, _ in kept]
    self._files = [files for _, files, _ in kept]
    self._sizes = np.array([count for _, _, count in kept], dtype=np.int64)

  def _length(self, files: Sequence[Path]) -> int:
    if self.level == 'byte':
      return sum(os.path.getsize(f) for f in files)
    return sum(len(Path(f).read_bytes().decode('utf-8', errors='replace'))
               for f in files)

  def tokenize(self, text: str | bytes) -> np.ndarray:
    """``int32`` token ids of ``text`` at this corpus's level."""
    if self.level == 'byte':
      data = text.encode('utf-8') if isinstance(text, str) else text
      return np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    if isinstance(text, bytes):
      text = text.decode('utf-8', errors='replace')
    codes = np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)
    return np.where(codes < _UNK, codes, _UNK).astype(np.int32)

  def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
    """The text of ``tokens`` (unknown characters become U+FFFD)."""
    tokens = np.asarray(tokens).reshape(-1)
    if self.level == 'byte':
      return bytes(tokens.astype(np.uint8).tolist()).decode('utf-8', errors='replace')
    return ''.join(chr(t) if t < _UNK else '\ufffd' for t in tokens.tolist())

  @property
  def num_clients(self) -> int:
    return len(self._names)

  def client_name(self, cid: int) -> str:
    return self._names[self.check_client(cid)]

  def client_files(self, cid: int) -> list[Path]:
    """The files that make up client ``cid``, in reading order."""
    return list(self._files[self.check_client(cid)])

  def num_examples(self, cid: int) -> int:
    return int(self._sizes[self.check_client(cid)])

  def examples_per_client(self) -> np.ndarray:
    return self._sizes.copy()

  def _client_data(self, cid: int) -> Examples:
    stream = np.concatenate([self.tokenize(Path(f).read_bytes())
                             for f in self._files[cid]])
    n, t = int(self._sizes[cid]), self.seq_len
    windows = np.lib.stride_tricks.sliding_window_view(stream, t + 1)[::t][:n]
    windows = np.ascontiguousarray(windows, dtype=np.int32)
    if self.output == 'tokens':
      return {'tokens': windows}
    return {'x': windows[:, :-1].copy(), 'y': windows[:, 1:].copy()}


def group_files(root: str | os.PathLike, suffixes: Sequence[str] = ('.py',),
                exclude: Sequence[str] = DEFAULT_EXCLUDE
                ) -> list[tuple[str, list[Path]]]:
  """Files under ``root`` grouped by their first path component.

  A file directly under ``root`` forms its own group named after its stem
  (``os.py`` -> ``os``); a directory's files form one group named after it.
  Paths with a component in ``exclude`` are skipped. Groups and files sort.
  """
  root = Path(root)
  if not root.is_dir():
    raise FileNotFoundError(f'text_corpus: root={str(root)!r} is not a directory.')
  groups: dict[str, list[Path]] = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in exclude)
    for filename in filenames:
      path = Path(dirpath) / filename
      if not filename.endswith(tuple(suffixes)) or not path.is_file():
        continue
      rel = path.relative_to(root)
      name = rel.parts[0] if len(rel.parts) > 1 else rel.stem
      groups.setdefault(name, []).append(path)
  return [(name, sorted(groups[name])) for name in sorted(groups)]


def text_corpus(seq_len: int = 64, level: str = 'byte',
                modules: Sequence[str] | None = None, output: str = 'xy',
                root: str | os.PathLike | None = None,
                suffixes: Sequence[str] = ('.py',),
                exclude: Sequence[str] = DEFAULT_EXCLUDE,
                min_examples: int = 1) -> TextCorpus:
  """The standard library's source as a federated corpus, one client per module.

  Args:
    seq_len: tokens per example input ``T``.
    level: ``'byte'`` (vocabulary 256) or ``'char'`` (ASCII plus unknown: 129).
    modules: keep only these groups (e.g. ``['json', 'email']``); default all.
    output: ``'xy'`` for ``{'x': [T], 'y': [T]}`` or ``'tokens'`` for
      ``{'tokens': [T + 1]}`` (int32).
    root: directory to read (default: the standard library of this Python).
    suffixes: file name endings to include.
    exclude: directory names to skip.
    min_examples: drop groups with fewer sequences than this.

  Returns:
    A :class:`TextCorpus`; ``client_name(c)`` is the module name.
  """
  root = sysconfig.get_paths()['stdlib'] if root is None else root
  groups = group_files(root, suffixes, exclude)
  if modules is not None:
    available = {name for name, _ in groups}
    unknown = sorted(set(modules) - available)
    if unknown:
      raise ValueError(f'text_corpus: modules {unknown} are not groups under '
                       f'{str(root)!r}; available are e.g. {sorted(available)[:20]} '
                       f'({len(available)} in all).')
    groups = [(name, files) for name, files in groups if name in set(modules)]
  return TextCorpus(groups, seq_len, level, output, min_examples)
