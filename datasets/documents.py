"""Language-model corpora from local documents: text, JSONL and Parquet files.

Documents are grouped into clients by a source, encoded by a tokenizer and
packed into fixed-length next-token examples.

Sources (``format``):

* ``'text'``: files under a folder (``suffixes``, default ``.txt``), one
  document per file, grouped as :func:`fedjx.datasets.text.group_files`
  does: a file directly under the folder is its own client (named after its
  stem), a subfolder's files are one client (named after it).
* ``'jsonl'``: one JSON object per line; the document is ``obj[text_field]``
  and the client ``str(obj[client_field])`` (all lines one client, named
  after the file stem, when ``client_field`` is None). Blank lines are
  skipped.
* ``'parquet'``: the columns ``text_field`` and ``client_field`` of a
  Parquet file (read with ``pyarrow.parquet``; same client rule).

Clients sort by name; a client's documents keep file (or line, or row)
order. :func:`shard_documents` (``num_shards=K``) deals the documents
round-robin to ``K`` clients instead: IID shards, one per data-parallel
replica, each read as its own client. Reading is lazy per client: construction reads each client once to
count its examples and keeps only the counts; ``client_data(c)`` reads and
encodes client ``c`` again (a JSONL client re-parses only its own lines; a
Parquet client is read with a filter on ``client_field``).

Tokenizers (:class:`Tokenizer`: ``encode(str) -> list[int]``, ``vocab_size``,
``eos_id``, ``pad_id``):

* :class:`ByteTokenizer`: UTF-8 bytes ``0..255``, EOS ``256``, PAD ``257``,
  ``vocab_size = 258``.
* :class:`SentencePieceTokenizer`: a SentencePiece ``.model`` file.
* :class:`HuggingFaceTokenizer`: a Hugging Face ``tokenizer.json``.

For the last two, EOS and PAD are the model's own tokens where it has them,
and otherwise new ids appended after its vocabulary (first EOS, then PAD),
which ``vocab_size`` counts.

Packing (:func:`pack`): a client's documents, each followed by EOS, are
concatenated into one stream ``s`` of length ``L``; every token belongs to
its document, an EOS to the document it ends. Example ``i`` has inputs
``x = s[iT : iT + T]`` and targets ``y = s[iT + 1 : iT + T + 1]`` (windows of
``T + 1`` tokens with stride ``T``, so each token after the first is a target
exactly once). A target from a different document than its input is set to
``pad_id``, which the language-model loss ignores: the EOS *is* a target
(predicted from its document's last token), the first token of the next
document (predicted from the EOS) is not. Attention is not masked: earlier
documents in a window remain context. With ``tail='pad'`` (the default) the
last ``r = (L - 1) mod T`` targets, if any, form one more example padded
with ``pad_id`` (inputs and targets); with ``tail='drop'`` they are dropped.
Documents that encode to no tokens are skipped. Examples are
``{'x': [T], 'y': [T]}`` int32, as :class:`fedjx.datasets.text.TextCorpus`.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedjx.datasets import text as text_lib
from fedjx.datasets.federated import Examples, FederatedDataset

__all__ = ['FORMATS', 'TAILS', 'TOKENIZER_KINDS', 'Tokenizer', 'ByteTokenizer',
           'SentencePieceTokenizer', 'HuggingFaceTokenizer', 'make_tokenizer',
           'DocumentSource', 'read_text_files', 'read_jsonl', 'read_parquet',
           'read_documents', 'shard_documents', 'pack', 'DocumentCorpus', 'documents_corpus']

FORMATS = ('text', 'jsonl', 'parquet')
TAILS = ('pad', 'drop')
TOKENIZER_KINDS = ('bytes', 'sentencepiece', 'huggingface')


# ------------------------------------------------------------------ tokenizers


class Tokenizer(abc.ABC):
  """Text to token ids, with the ids packing appends (EOS) and pads with (PAD).

  Attributes:
    vocab_size: ids are in ``[0, vocab_size)``, EOS and PAD included.
    eos_id: the id appended after every document.
    pad_id: the id of padding and masked targets (the loss's ``pad_id``).
  """

  vocab_size: int
  eos_id: int
  pad_id: int

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """The ids of ``text`` (no EOS; packing appends it)."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """The text of ``ids``; EOS and PAD ids are left out."""

  def __repr__(self) -> str:
    return (f'{type(self).__name__}(vocab_size={self.vocab_size}, '
            f'eos_id={self.eos_id}, pad_id={self.pad_id})')


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes ``0..255``; EOS ``256``, PAD ``257``; ``vocab_size = 258``."""

  vocab_size, eos_id, pad_id = 258, 256, 257

  def encode(self, text: str) -> list[int]:
    return list(text.encode('utf-8'))

  def decode(self, ids: Sequence[int]) -> str:
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode('utf-8', errors='replace')


def _missing(package: str, what: str) -> ImportError:
  return ImportError(f'{what} needs the {package!r} package: pip install {package}')


def _check_file(where: str, key: str, value: Any) -> str:
  if not isinstance(value, (str, os.PathLike)) or not os.path.isfile(value):
    raise FileNotFoundError(f'{where}: {key}={value!r} is not a file; give the '
                            'path of an existing file.')
  return os.fspath(value)


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model (``sentencepiece.SentencePieceProcessor``).

  ``encode`` is ``EncodeAsIds(text)`` (no BOS or EOS). EOS and PAD are the
  model's ``eos_id()`` and ``pad_id()`` where they are ``>= 0``; a missing one
  is a new id after the model's pieces (EOS first, then PAD).
  """

  def __init__(self, model_file: str | os.PathLike):
    model_file = _check_file('sentencepiece tokenizer', 'model_file', model_file)
    try:
      import sentencepiece  # deferred: optional dependency sentencepiece
    except ImportError:
      raise _missing('sentencepiece', 'the sentencepiece tokenizer') from None
    self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    self.vocab_size = self._base = int(self._sp.get_piece_size())
    self.eos_id = int(self._sp.eos_id())
    if self.eos_id < 0:
      self.eos_id, self.vocab_size = self.vocab_size, self.vocab_size + 1
    self.pad_id = int(self._sp.pad_id())
    if self.pad_id < 0:
      self.pad_id, self.vocab_size = self.vocab_size, self.vocab_size + 1

  def encode(self, text: str) -> list[int]:
    return list(self._sp.EncodeAsIds(text))

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < self._base
                               and int(i) not in (self.eos_id, self.pad_id)])


class HuggingFaceTokenizer(Tokenizer):
  """A Hugging Face ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``).

  ``encode`` is ``Tokenizer.encode(text, add_special_tokens=...).ids`` (the
  file's post-processor adds its special tokens, e.g. a BOS, when
  ``add_special_tokens``). EOS and PAD are the tokens ``eos_token`` and
  ``pad_token`` where given (they must be in the vocabulary); a token not
  given is a new id after the vocabulary with added tokens (EOS first, then
  PAD).
  """

  def __init__(self, file: str | os.PathLike, eos_token: str | None = None,
               pad_token: str | None = None, add_special_tokens: bool = True):
    file = _check_file('huggingface tokenizer', 'file', file)
    try:
      import tokenizers  # deferred: optional dependency tokenizers
    except ImportError:
      raise _missing('tokenizers', 'the huggingface tokenizer') from None
    self._tok = tokenizers.Tokenizer.from_file(file)
    self._add_special = bool(add_special_tokens)
    self.vocab_size = self._base = int(self._tok.get_vocab_size(with_added_tokens=True))
    self.eos_id = self._special('eos_token', eos_token)
    self.pad_id = self._special('pad_token', pad_token)

  def _special(self, key: str, token: str | None) -> int:
    if token is None:
      self.vocab_size += 1
      return self.vocab_size - 1
    index = self._tok.token_to_id(token)
    if index is None:
      raise ValueError(f'huggingface tokenizer: {key}={token!r} is not in the '
                       'vocabulary; give one of its tokens or None (a new id).')
    return int(index)

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=self._add_special).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self._base
                             and int(i) not in (self.eos_id, self.pad_id)])


_TOKENIZER_OPTIONS = {'bytes': (), 'sentencepiece': ('model_file',),
                      'huggingface': ('file', 'eos_token', 'pad_token',
                                      'add_special_tokens')}


def make_tokenizer(spec: str | Mapping[str, Any] | Tokenizer) -> Tokenizer:
  """A tokenizer from ``'bytes'``, ``dict(kind=..., **options)`` or itself.

  Kinds: ``'bytes'`` (:class:`ByteTokenizer`), ``'sentencepiece'``
  (``model_file``), ``'huggingface'`` (``file``, ``eos_token``,
  ``pad_token``, ``add_special_tokens``).
  """
  if isinstance(spec, Tokenizer):
    return spec
  if isinstance(spec, str):
    spec = {'kind': spec}
  if not isinstance(spec, Mapping) or 'kind' not in spec:
    raise ValueError(f'tokenizer={spec!r}; it must be one of {TOKENIZER_KINDS} '
                     "or a dict with a 'kind' key, e.g. dict(kind='sentencepiece',"
                     " model_file=...).")
  options = dict(spec)
  kind = options.pop('kind')
  if kind not in TOKENIZER_KINDS:
    raise ValueError(f'tokenizer kind={kind!r} is not one of {TOKENIZER_KINDS}.')
  unknown = sorted(set(options) - set(_TOKENIZER_OPTIONS[kind]))
  if unknown:
    raise ValueError(f'tokenizer kind={kind!r}: options {unknown} are not taken; '
                     f'it takes {list(_TOKENIZER_OPTIONS[kind])}.')
  if kind == 'bytes':
    return ByteTokenizer()
  required = _TOKENIZER_OPTIONS[kind][0]
  if required not in options:
    raise ValueError(f'tokenizer kind={kind!r} needs {required}=<path>.')
  if kind == 'sentencepiece':
    return SentencePieceTokenizer(**options)
  return HuggingFaceTokenizer(**options)


# ------------------------------------------------------------------ sources


class DocumentSource:
  """Named clients whose documents are read when asked.

  Args:
    names: client names, in client order.
    read: ``read(i) -> list[str]``, the documents of client ``i`` in order.
  """

  def __init__(self, names: Sequence[str], read: Callable[[int], list[str]]):
    self.names = [str(n) for n in names]
    self._read = read

  def __len__(self) -> int:
    return len(self.names)

  def documents(self, i: int) -> list[str]:
    """The documents of client ``i``."""
    return list(self._read(i))


def read_text_files(path: str | os.PathLike,
                    suffixes: Sequence[str] = ('.txt',)) -> DocumentSource:
  """One document per file under the folder ``path`` (UTF-8, errors replaced);
  clients as :func:`fedjx.datasets.text.group_files` groups them."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"documents: path={os.fspath(path)!r} is not a "
                            "directory; format='text' reads the files under a "
                            'folder.')
  groups = text_lib.group_files(path, tuple(suffixes), exclude=())
  if not groups:
    raise ValueError(f'documents: path={os.fspath(path)!r} has no files ending '
                     f'in {tuple(suffixes)}; set suffixes to their endings.')
  return DocumentSource(
      [n for n, _ in groups],
      lambda i: [Path(f).read_bytes().decode('utf-8', errors='replace')
                 for f in groups[i][1]])


def _check_input_file(path: Any, fmt: str) -> str:
  if not os.path.isfile(path):
    raise FileNotFoundError(f'documents: path={os.fspath(path)!r} is not a file;'
                            f" format={fmt!r} reads one file.")
  return os.fspath(path)


def _missing_field(path: str, where: str, key: str, field: str,
                   fields: Sequence[str]) -> ValueError:
  return ValueError(f'documents: {where} of {path!r} has no field '
                    f'{key}={field!r}; its fields are {sorted(fields)}.')


def read_jsonl(path: str | os.PathLike, text_field: str = 'text',
               client_field: str | None = None) -> DocumentSource:
  """One document per line (a JSON object) of the file ``path``.

  The document is ``obj[text_field]`` (a string); the client is
  ``str(obj[client_field])``, or the file stem for all lines when
  ``client_field`` is None. A line that is not an object, or lacks a field,
  is a ValueError naming the file, the line and the fields it has.
  """
  path = _check_input_file(path, 'jsonl')

  def parse(number: int, line: str) -> dict[str, Any]:
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'documents: line {number} of {path!r} is not JSON ({e}).'
                       ) from None
    if not isinstance(obj, dict):
      raise ValueError(f'documents: line {number} of {path!r} is a '
                       f'{type(obj).__name__}; each line must be a JSON object.')
    for key, field in (('text_field', text_field), ('client_field', client_field)):
      if field is not None and field not in obj:
        raise _missing_field(path, f'line {number}', key, field, list(obj))
    if not isinstance(obj[text_field], str):
      raise ValueError(f'documents: line {number} of {path!r}: '
                       f'text_field={text_field!r} holds a '
                       f'{type(obj[text_field]).__name__}; it must be a string.')
    return obj

  groups: dict[str, list[int]] = {}
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        obj = parse(number, line)
        name = Path(path).stem if client_field is None else str(obj[client_field])
        groups.setdefault(name, []).append(number)
  names = sorted(groups)

  def read(i: int) -> list[str]:
    wanted, out = set(groups[names[i]]), []
    with open(path, encoding='utf-8') as f:
      for number, line in enumerate(f, 1):
        if number in wanted:
          out.append(parse(number, line)[text_field])
    return out

  return DocumentSource(names, read)


def read_parquet(path: str | os.PathLike, text_field: str = 'text',
                 client_field: str | None = None) -> DocumentSource:
  """One document per row of the Parquet file ``path`` (``pyarrow.parquet``).

  The document is the row's ``text_field`` column; the client is
  ``str(row[client_field])``, or the file stem for all rows when
  ``client_field`` is None. A missing column is a ValueError naming the
  columns the file has.
  """
  path = _check_input_file(path, 'parquet')
  try:
    import pyarrow.parquet as pq  # deferred: optional dependency pyarrow
  except ImportError:
    raise _missing('pyarrow', "format='parquet'") from None
  columns = pq.read_schema(path).names
  for key, field in (('text_field', text_field), ('client_field', client_field)):
    if field is not None and field not in columns:
      raise _missing_field(path, 'the schema', key, field, columns)
  if client_field is None:
    return DocumentSource([Path(path).stem], lambda i: [
        str(v) for v in pq.read_table(path, columns=[text_field])
        .column(text_field).to_pylist()])
  values = pq.read_table(path, columns=[client_field]).column(client_field).to_pylist()
  by_name: dict[str, Any] = {}
  for v in values:
    by_name.setdefault(str(v), v)
  names = sorted(by_name)

  def read(i: int) -> list[str]:
    table = pq.read_table(path, columns=[text_field],
                          filters=[(client_field, '==', by_name[names[i]])])
    return [str(v) for v in table.column(text_field).to_pylist()]

  return DocumentSource(names, read)


def read_documents(path: str | os.PathLike, format: str = 'text',  # pylint: disable=redefined-builtin
                   text_field: str = 'text', client_field: str | None = None,
                   suffixes: Sequence[str] = ('.txt',)) -> DocumentSource:
  """The source of ``format`` (one of :data:`FORMATS`) at ``path``."""
  if format not in FORMATS:
    raise ValueError(f'documents: format={format!r} is not one of {FORMATS}.')
  if format == 'text':
    return read_text_files(path, suffixes)
  reader = read_jsonl if format == 'jsonl' else read_parquet
  return reader(path, text_field, client_field)


def shard_documents(source: DocumentSource, num_shards: int) -> DocumentSource:
  """``num_shards`` clients ``shard0 .. shard{K-1}`` dealt from ``source``.

  Document ``j`` in reading order (``source``'s clients in order, each one's
  documents in order) goes to shard ``j mod num_shards``: IID shards, one per
  data-parallel replica. Construction reads every client of ``source`` once
  to count its documents; reading a shard reads all of ``source``.
  """
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f'documents: num_shards={num_shards!r}; it must be an int '
                     '>= 1 or None (clients as the source groups them).')
  offsets = np.cumsum([0] + [len(source.documents(i)) for i in range(len(source))])

  def read(k: int) -> list[str]:
    out = []
    for i in range(len(source)):
      first = (k - int(offsets[i])) % num_shards
      out += source.documents(i)[first::num_shards]
    return out

  return DocumentSource([f'shard{k}' for k in range(num_shards)], read)


# ------------------------------------------------------------------ packing


def _stream(documents: Sequence[Sequence[int]], eos_id: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """The token stream (each non-empty document then EOS) and each token's document."""
  docs = [np.asarray(d, dtype=np.int32).reshape(-1) for d in documents if len(d)]
  if not docs:
    return np.zeros(0, np.int32), np.zeros(0, np.int64)
  stream = np.concatenate([np.append(d, np.int32(eos_id)) for d in docs])
  owner = np.repeat(np.arange(len(docs)), [d.size + 1 for d in docs])
  return stream.astype(np.int32), owner


def _count(length: int, seq_len: int, tail: str) -> int:
  targets = max(0, length - 1)
  return targets // seq_len if tail == 'drop' else -(-targets // seq_len)


def _check_pack(seq_len: Any, tail: Any) -> None:
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
    raise ValueError(f'documents: seq_len={seq_len!r}; it must be an int >= 1.')
  if tail not in TAILS:
    raise ValueError(f'documents: tail={tail!r} is not one of {TAILS}.')


def pack(documents: Sequence[Sequence[int]], seq_len: int, eos_id: int,
         pad_id: int, tail: str = 'pad') -> Examples:
  """Token-id documents packed into ``{'x': [n, T], 'y': [n, T]}`` int32.

  The rule of the module docstring: documents that have tokens, each then
  ``eos_id``, form the stream ``s``; example ``i`` is ``x = s[iT : iT + T]``,
  ``y = s[iT + 1 : iT + T + 1]``; a target whose document differs from its
  input's (the token after an EOS) becomes ``pad_id``; ``tail='pad'`` pads a
  last partial example with ``pad_id``, ``tail='drop'`` drops it.
  """
  _check_pack(seq_len, tail)
  stream, owner = _stream(documents, eos_id)
  n = _count(stream.size, seq_len, tail)
  size = n * seq_len + 1
  if n == 0:
    empty = np.zeros((0, seq_len), np.int32)
    return {'x': empty, 'y': empty.copy()}
  if stream.size < size:
    extra = size - stream.size
    stream = np.concatenate([stream, np.full(extra, pad_id, np.int32)])
    owner = np.concatenate([owner, np.full(extra, -1, owner.dtype)])
  stream, owner = stream[:size], owner[:size]
  x = stream[:-1].reshape(n, seq_len)
  y = np.where(owner[1:] == owner[:-1], stream[1:], pad_id).astype(np.int32)
  return {'x': np.ascontiguousarray(x), 'y': y.reshape(n, seq_len)}


# ------------------------------------------------------------------ corpus


class DocumentCorpus(FederatedDataset):
  """Clients of a :class:`DocumentSource`, tokenized and packed (:func:`pack`).

  Construction reads and encodes every client once to count its examples
  (only the counts are kept); clients with fewer than ``max(1,
  min_examples)`` examples are dropped. ``client_data`` reads and encodes
  the client again.

  Attributes:
    tokenizer: the :class:`Tokenizer`.
    vocab_size, pad_id, eos_id: the tokenizer's.
    seq_len: ``T``, the length of ``x`` and ``y``.
    tail: ``'pad'`` or ``'drop'``.
  """

  def __init__(self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int,
               tail: str = 'pad', min_examples: int = 1):
    _check_pack(seq_len, tail)
    self._source, self.tokenizer = source, tokenizer
    self.seq_len, self.tail = seq_len, tail
    self.vocab_size = tokenizer.vocab_size
    self.eos_id, self.pad_id = tokenizer.eos_id, tokenizer.pad_id
    kept = []
    for i, name in enumerate(source.names):
      length = self._stream(i)[0].size
      count = _count(length, seq_len, tail)
      if count >= max(1, min_examples):
        kept.append((i, name, count))
    if not kept:
      raise ValueError(f'documents: no client has {max(1, min_examples)} '
                       f'example(s) of {seq_len} targets; lower seq_len or add '
                       'documents.')
    self._index = [i for i, _, _ in kept]
    self._names = [name for _, name, _ in kept]
    self._sizes = np.array([c for _, _, c in kept], dtype=np.int64)

  def _encoded(self, i: int) -> list[list[int]]:
    return [self.tokenizer.encode(d) for d in self._source.documents(i)]

  def _stream(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    return _stream(self._encoded(i), self.eos_id)

  def client_documents(self, cid: int) -> list[str]:
    """The documents of client ``cid``, in order."""
    return self._source.documents(self._index[self.check_client(cid)])

  @property
  def num_clients(self) -> int:
    return len(self._names)

  def client_name(self, cid: int) -> str:
    return self._names[self.check_client(cid)]

  def num_examples(self, cid: int) -> int:
    return int(self._sizes[self.check_client(cid)])

  def examples_per_client(self) -> np.ndarray:
    return self._sizes.copy()

  def _client_data(self, cid: int) -> Examples:
    return pack(self._encoded(self._index[cid]), self.seq_len, self.eos_id,
                self.pad_id, self.tail)


def documents_corpus(path: str | os.PathLike, format: str = 'text',  # pylint: disable=redefined-builtin
                     tokenizer: str | Mapping[str, Any] | Tokenizer = 'bytes',
                     seq_len: int = 128, text_field: str = 'text',
                     client_field: str | None = None,
                     suffixes: Sequence[str] = ('.txt',), tail: str = 'pad',
                     min_examples: int = 1,
                     num_shards: int | None = None) -> DocumentCorpus:
  """A federated language-model corpus of the documents at ``path``.

  Args:
    path: a folder (``format='text'``) or a file (``'jsonl'``, ``'parquet'``).
    format: one of :data:`FORMATS`.
    tokenizer: ``'bytes'``, ``dict(kind='sentencepiece', model_file=...)``,
      ``dict(kind='huggingface', file=..., eos_token=None, pad_token=None)``
      or a :class:`Tokenizer` (see :func:`make_tokenizer`).
    seq_len: ``T``, tokens per example input.
    text_field, client_field: the JSONL / Parquet fields of the document and
      of its client (None: one client).
    suffixes: file endings read by ``format='text'``.
    tail: ``'pad'`` or ``'drop'`` (the last partial example).
    min_examples: drop clients with fewer examples than this.
    num_shards: None for the source's clients, or ``K`` IID shards of its
      documents (:func:`shard_documents`), one per replica.

  Returns:
    A :class:`DocumentCorpus`; ``client_name(c)`` is the client's name.
  """
  _check_pack(seq_len, tail)
  source = read_documents(path, format, text_field, client_field, suffixes)
  if num_shards is not None:
    source = shard_documents(source, num_shards)
  return DocumentCorpus(source, make_tokenizer(tokenizer), seq_len, tail,
                        min_examples)
