"""Dataset builders for configs: each returns an :class:`ExperimentData`.

A builder wraps a loader of ``fedjx.datasets`` and says how its held-out data
is evaluated and what models need to know about it (``num_classes``,
``vocab_size``). The registry (:mod:`fedjx.experiments.registry`) maps config
names to these builders.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedjx import datasets
from fedjx.datasets import documents as documents_lib
from fedjx.datasets import instructions as instructions_lib
from fedjx.datasets import tfds_source
from fedjx.experiments.errors import ConfigError


@dataclasses.dataclass
class ExperimentData:
  """What a dataset builder gives the runner.

  Attributes:
    train: the training population (a ``fedjx.datasets.FederatedDataset``).
    test: held-out data: a dict of arrays (a central split), a
      ``FederatedDataset`` (held-out clients, pooled for evaluation), or None.
    info: facts models may need (``num_classes``, ``vocab_size``, ...); the
      model builder receives those it takes, unless the config sets them.
  """

  train: Any
  test: Any = None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def population(option: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Declares that a builder's training population has at most ``option``
  clients (its keyword argument of that name, or its default).

  The declaration is read from this file's source, before JAX is imported,
  by :mod:`fedjx.experiments.preflight` (a cohort larger than the population
  is one line at once), and kept on the builder as ``population``.
  """
  def declare(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn.population = option
    return fn
  return declare


@population('num_clients')
def digits(num_clients: int = 50, alpha: float | None = 0.5, seed: int = 0,
           test_fraction: float = 0.2,
           client_test_fraction: float | None = None) -> ExperimentData:
  """scikit-learn digits over ``num_clients`` clients (Dirichlet ``alpha``).

  ``test_fraction`` of the images are held out centrally. With
  ``client_test_fraction`` instead, all images are partitioned and each
  client holds out that fraction of its own examples
  (``fedjx.datasets.split_examples``): the held-out data are the clients'
  (pooled for evaluation), so per-client accuracy can be measured.
  """
  if client_test_fraction is None:
    train, test = datasets.load_digits(num_clients=num_clients, alpha=alpha,
                                       seed=seed, test_fraction=test_fraction)
    return ExperimentData(train, test, {'num_classes': 10})
  population, _ = datasets.load_digits(num_clients=num_clients, alpha=alpha,
                                       seed=seed, test_fraction=0.0)
  train, test = datasets.split_examples(population, client_test_fraction, seed)
  return ExperimentData(train, test, {'num_classes': 10})


@population('num_clients')
def synthetic(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30,
              seed: int = 0, iid: bool = False, test_fraction: float = 0.2,
              **kwargs: Any) -> ExperimentData:
  """Synthetic(alpha, beta) of FedProx; each client holds out ``test_fraction``.

  The per-client train/test split is that of the FedProx paper (Li et al.
  2020); the test examples of all clients are pooled for evaluation. Extra
  keyword arguments go to ``fedjx.datasets.synthetic`` (``dim``,
  ``num_classes``, ``max_examples``, ...).
  """
  population = datasets.synthetic(alpha, beta, num_clients=num_clients,
                                  seed=seed, iid=iid, **kwargs)
  train, test = datasets.split_examples(population, test_fraction, seed)
  return ExperimentData(train, test, {'num_classes': population.num_classes})


def text(seq_len: int = 64, level: str = 'byte',
         modules: Sequence[str] | None = None, num_shards: int | None = None,
         test_fraction: float = 0.1, max_examples: int | None = None,
         seed: int = 0) -> ExperimentData:
  """Python's standard library source as a language-modelling corpus.

  With ``num_shards=None``, clients are the library's modules (natural,
  non-IID groups; see ``fedjx.datasets.text_corpus``) and each holds out
  ``test_fraction`` of its sequences. With ``num_shards=K``, the sequences of
  all modules are pooled, shuffled (``seed``), ``test_fraction`` held out, and
  the rest split IID into ``K`` equal shards: the data-parallel replicas of
  DiLoCo (Douillard et al. 2023). ``max_examples`` caps the pooled sequences.
  """
  corpus = datasets.text_corpus(seq_len=seq_len, level=level, modules=modules,
                                min_examples=2)
  info = {'vocab_size': corpus.vocab_size, 'max_len': seq_len}
  if num_shards is None:
    train, test = datasets.split_examples(corpus, test_fraction, seed)
    return ExperimentData(train, test, info)
  parts = [corpus.client_data(c) for c in range(corpus.num_clients)]
  pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  n = len(pooled['x'])
  order = np.random.default_rng(seed).permutation(n)
  if max_examples is not None:
    order = order[:max_examples]
  num_test = max(1, int(round(test_fraction * len(order))))
  test = {k: v[np.sort(order[:num_test])] for k, v in pooled.items()}
  train = {k: v[np.sort(order[num_test:])] for k, v in pooled.items()}
  groups = datasets.partition_iid(len(train['x']), num_shards, seed)
  return ExperimentData(datasets.from_arrays(train, groups=groups), test, info)


def config_tokenizer(tokenizer: Any) -> Any:
  """The :class:`fedjx.datasets.documents.Tokenizer` of ``config.dataset.tokenizer``.

  ``'bytes'``, ``dict(kind='sentencepiece', model_file=...)`` or
  ``dict(kind='huggingface', file=...)`` (a ConfigDict too); a bad spec is a
  one-line ``ConfigError`` naming the field.
  """
  if hasattr(tokenizer, 'to_dict'):  # A ConfigDict.
    tokenizer = tokenizer.to_dict()
  try:
    return documents_lib.make_tokenizer(tokenizer)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f'config.dataset.tokenizer={tokenizer!r}: {e}') from None


def documents(path: str | None = None, format: str = 'text',  # pylint: disable=redefined-builtin
              tokenizer: Any = 'bytes', seq_len: int = 128,
              text_field: str = 'text', client_field: str | None = None,
              suffixes: Sequence[str] = ('.txt',), tail: str = 'pad',
              num_shards: int | None = None, test_fraction: float = 0.1,
              seed: int = 0) -> ExperimentData:
  """A language-modelling corpus of local documents (text, JSONL, Parquet).

  ``fedjx.datasets.documents.documents_corpus``: clients from ``path``,
  ``tokenizer`` ``'bytes'``, ``dict(kind='sentencepiece', model_file=...)`` or
  ``dict(kind='huggingface', file=...)``, documents packed into ``seq_len``
  windows with the targets across document boundaries set to the tokenizer's
  ``pad_id``. ``num_shards=K`` deals the documents round-robin to ``K``
  clients (IID shards, one per data-parallel replica) instead of the
  source's clients. Each client holds out ``test_fraction`` of its sequences
  (clients need 2). ``info`` carries ``vocab_size``, ``max_len`` and
  ``pad_id``, so the model's loss ignores the padding and masked targets.
  """
  if path is None or not os.path.exists(os.path.expanduser(str(path))):
    raise ConfigError(f'config.dataset.path={path!r}: no such file or directory;'
                      " give a folder of .txt files (format='text') or a "
                      "JSONL / Parquet file (format='jsonl' / 'parquet').")
  if format not in documents_lib.FORMATS:
    raise ConfigError(f'config.dataset.format={format!r} is not one of '
                      f'{documents_lib.FORMATS}.')
  if tail not in documents_lib.TAILS:
    raise ConfigError(f'config.dataset.tail={tail!r} is not one of '
                      f'{documents_lib.TAILS}.')
  if num_shards is not None and (isinstance(num_shards, bool) or
                                 not isinstance(num_shards, int) or num_shards < 1):
    raise ConfigError(f'config.dataset.num_shards={num_shards!r}; it must be an '
                      'int >= 1 or None (the clients of the source).')
  tok = config_tokenizer(tokenizer)
  corpus = documents_lib.documents_corpus(
      os.path.expanduser(str(path)), format, tok, seq_len, text_field,
      client_field, tuple(suffixes), tail, min_examples=2,
      num_shards=num_shards)
  train, test = datasets.split_examples(corpus, test_fraction, seed)
  return ExperimentData(train, test, {'vocab_size': corpus.vocab_size,
                                      'max_len': seq_len,
                                      'pad_id': corpus.pad_id})


def c4(tfds_name: str = 'c4/en:3.1.0', split: str = 'train[:10000]',
       test_split: str | None = 'validation[:1000]', tokenizer: Any = 'bytes',
       seq_len: int = 128, tail: str = 'pad', num_shards: int = 1,
       text_field: str = 'text', data_dir: str | None = None,
       download: bool = False) -> ExperimentData:
  """C4 from TFDS (Raffel et al. 2020, arXiv:1910.10683) as a language-modelling corpus.

  ``fedjx.datasets.tfds_source.c4_corpus``: the records of ``split`` of the
  TFDS builder ``tfds_name`` (read with ``tfds.data_source`` from ArrayRecord
  files) dealt round-robin into ``num_shards`` IID shards, one per
  data-parallel replica; each record's ``text_field`` tokenized by
  ``tokenizer`` (as the ``documents`` builder's) and packed into ``seq_len``
  windows with the targets across document boundaries set to ``pad_id``.
  The held-out data are ``test_split`` packed the same way as one client
  (None: none). ``download=False`` (the default) never starts a download: a
  corpus not prepared in ``data_dir`` is an error saying how to prepare it.
  ``info`` carries ``vocab_size``, ``max_len`` and ``pad_id``.
  """
  if tail not in documents_lib.TAILS:
    raise ConfigError(f'config.dataset.tail={tail!r} is not one of '
                      f'{documents_lib.TAILS}.')
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ConfigError(f'config.dataset.num_shards={num_shards!r}; it must be an '
                      'int >= 1 (one shard per data-parallel replica).')
  tok = config_tokenizer(tokenizer)
  options = dict(tokenizer=tok, seq_len=seq_len, tail=tail, text_field=text_field,
                 data_dir=None if data_dir is None else os.path.expanduser(str(data_dir)),
                 download=download)
  train = tfds_source.c4_corpus(tfds_name, split, num_shards=num_shards, **options)
  test = (None if test_split is None else
          tfds_source.c4_corpus(tfds_name, test_split, num_shards=1, **options))
  return ExperimentData(train, test, {'vocab_size': train.vocab_size,
                                      'max_len': seq_len, 'pad_id': train.pad_id})


def instructions(path: str = '', format: str = 'jsonl',  # pylint: disable=redefined-builtin
                 template: str = 'alpaca', tokenizer: Any = 'bytes', seq_len: int = 128,
                 partition: str = 'field', client_field: str | None = 'category',
                 label_field: str | None = None, num_clients: int | None = None,
                 alpha: float | None = None, num_records: int = 200,
                 test_fraction: float = 0.1, seed: int = 0) -> ExperimentData:
  """Instruction-tuning records (fine-tuning a language model): one example per record.

  ``fedjx.datasets.instructions``: Alpaca-style (instruction, input, output)
  or chat-message records from a JSONL or Parquet ``path``, rendered with the
  chat ``template`` (``'alpaca'`` or ``'chatml'``); the targets are the
  response tokens only (every other target is ``pad_id``, which the loss
  ignores). Clients by ``partition``: one per value of ``client_field``
  (``'field'``), a Dirichlet(``alpha``) label skew over ``label_field``
  (``'dirichlet'``) or ``'iid'`` into ``num_clients``. ``path=''`` uses the
  built-in toy set of ``num_records`` learnable tasks (reverse, uppercase,
  add, sort, repeat; its ``category`` field is the natural client key), so
  a run needs no download. Each client holds out ``test_fraction`` of its
  records (clients need 2).
  """
  if hasattr(tokenizer, 'to_dict'):  # A ConfigDict.
    tokenizer = tokenizer.to_dict()
  try:
    if path:
      if not os.path.exists(os.path.expanduser(str(path))):
        raise ConfigError(f"config.dataset.path={path!r}: no such file; give a JSONL or "
                          "Parquet file of instruction records, or '' for the toy set.")
      corpus = instructions_lib.instruction_dataset(
          os.path.expanduser(str(path)), format, template, tokenizer, seq_len, partition,
          client_field, label_field, num_clients, alpha, seed)
    else:
      corpus = instructions_lib.InstructionDataset(
          instructions_lib.toy_instructions(num_records, seed),
          instructions_lib.segment_tokenizer(tokenizer), seq_len, template, partition,
          client_field, label_field, num_clients, alpha, seed)
  except ValueError as e:
    raise ConfigError(f'config.dataset: {e}') from None
  train, test = datasets.split_examples(corpus, test_fraction, seed)
  return ExperimentData(train, test, {'vocab_size': corpus.vocab_size,
                                      'max_len': seq_len, 'pad_id': corpus.pad_id})


class _MissingFeature(KeyError):
  """A client's examples lack a feature a builder reads."""


def _feature(data: Any, key: str) -> Any:
  """``data[key]``, or a _MissingFeature naming the features ``data`` has."""
  if key not in data:
    raise _MissingFeature(key, sorted(data))
  return data[key]


def _missing_feature(dataset: str, base: Any, cid: int,
                     error: _MissingFeature) -> ValueError:
  key, features = error.args
  path = getattr(base, 'path', None)
  where = f' in {path!r}' if path else ''
  return ValueError(
      f'dataset {dataset!r}: client {base.client_name(cid)!r}{where} has no '
      f'feature {key!r}; it has {features}. TensorFlow Federated\'s '
      f'{dataset} files have {_TFF_FEATURES.get(dataset, [key])}.')


class _Reshaped(datasets.FederatedDataset):
  """Clients of ``base`` turned into new examples by ``fn`` (count may change).

  ``fn(client_examples) -> examples``. Example counts are computed on first
  use of a client and cached. A feature ``fn`` needs and a client lacks is a
  ValueError naming the dataset ``name``, the file and the client.
  """

  def __init__(self, base: Any, fn: Callable[[dict[str, np.ndarray]],
                                             dict[str, np.ndarray]],
               name: str = 'dataset'):
    self._base, self._fn, self._sizes, self._name = base, fn, {}, name

  @property
  def num_clients(self) -> int:
    return self._base.num_clients

  def client_name(self, cid: int) -> str:
    return self._base.client_name(cid)

  def num_examples(self, cid: int) -> int:
    cid = self.check_client(cid)
    if cid not in self._sizes:
      self._client_data(cid)
    return self._sizes[cid]

  def _client_data(self, cid: int) -> dict[str, np.ndarray]:
    try:
      out = self._fn(self._base.client_data(cid))
    except _MissingFeature as e:
      raise _missing_feature(self._name, self._base, cid, e) from None
    self._sizes[cid] = len(next(iter(out.values())))
    return out


# The features each TensorFlow Federated HDF5 file has per client (those the
# builders below read first).
_TFF_FEATURES = {'emnist': ['label', 'pixels'], 'cifar100': ['image', 'label'],
                 'shakespeare': ['snippets'], 'stackoverflow': ['tokens']}


def _images(pixels_key: str, label_key: str, scale: float):
  def fn(data):
    x = np.asarray(_feature(data, pixels_key), dtype=np.float32) / scale
    return {'x': x[..., None] if x.ndim == 3 else x,
            'y': np.asarray(_feature(data, label_key)).astype(np.int32)}
  return fn


def _tfds_partitioned(name: str, split: str, num_clients: int, alpha: float | None,
                      seed: int, data_dir: str | None):
  if alpha is None:
    part = lambda y: datasets.partition_iid(y, num_clients, seed)
  else:
    part = lambda y: datasets.partition_dirichlet(y, num_clients, alpha, seed)
  return datasets.from_tfds(name, split, partition=part, data_dir=data_dir)


def _pooled(dataset: Any, max_clients: int | None) -> Any:
  if max_clients is None or max_clients >= dataset.num_clients:
    return dataset
  return dataset.subset(np.arange(max_clients))


def emnist(source: str = 'tff', train_path: str | None = None,
           test_path: str | None = None, num_clients: int = 3400,
           alpha: float | None = 0.5, tfds_name: str = 'emnist/byclass',
           data_dir: str | None = None, seed: int = 0,
           max_test_clients: int | None = None) -> ExperimentData:
  """Federated EMNIST-62 (Caldas et al. 2018): 28x28 characters, 62 classes.

  ``source='tff'``: TensorFlow Federated's HDF5 files
  (``fed_emnist_train.h5``, ``fed_emnist_test.h5``: one client per writer,
  features ``pixels`` and ``label``). ``source='tfds'``: the TFDS builder
  ``tfds_name``, which has no writer ids, partitioned over ``num_clients``
  clients with Dirichlet ``alpha`` (IID if None); its test split is central.
  """
  _check_source('emnist', source)
  if source == 'tff':
    train = _Reshaped(_read_tff('emnist', train_path), _images('pixels', 'label', 1.0),
                      'emnist')
    test = (None if test_path is None else _pooled(
        _Reshaped(_read_tff('emnist', test_path), _images('pixels', 'label', 1.0),
                  'emnist'),
        max_test_clients))
  else:
    raw = _tfds_partitioned(tfds_name, 'train', num_clients, alpha, seed, data_dir)
    train = raw.map(_images('image', 'label', 255.0))
    test = _pooled(_tfds_partitioned(tfds_name, 'test', 100, None, seed, data_dir)
                   .map(_images('image', 'label', 255.0)), max_test_clients)
  return ExperimentData(train, test, {'num_classes': 62})


def cifar100(source: str = 'tff', train_path: str | None = None,
             test_path: str | None = None, num_clients: int = 500,
             alpha: float | None = 0.1, data_dir: str | None = None,
             seed: int = 0) -> ExperimentData:
  """Federated CIFAR-100: 500 training clients of 100 images (Reddi et al. 2021).

  ``source='tff'``: TensorFlow Federated's HDF5 files (features ``image``
  uint8 ``[32, 32, 3]``, ``label``; clients from Pachinko allocation).
  ``source='tfds'``: TFDS ``cifar100`` split over ``num_clients`` clients by
  Dirichlet ``alpha`` label skew. Images are scaled to [0, 1].
  """
  _check_source('cifar100', source)
  if source == 'tff':
    train = _Reshaped(_read_tff('cifar100', train_path),
                      _images('image', 'label', 255.0), 'cifar100')
    test = (None if test_path is None else
            _Reshaped(_read_tff('cifar100', test_path),
                      _images('image', 'label', 255.0), 'cifar100'))
  else:
    train = _tfds_partitioned('cifar100', 'train', num_clients, alpha, seed,
                              data_dir).map(_images('image', 'label', 255.0))
    test = _tfds_partitioned('cifar100', 'test', 100, None, seed,
                             data_dir).map(_images('image', 'label', 255.0))
  return ExperimentData(train, test, {'num_classes': 100})


# Shakespeare: characters as code points below 128, 0 for padding, 128 for
# any other character, 129 for begin- and 130 for end-of-snippet.
_SHAKESPEARE_VOCAB = 131


def _shakespeare_sequences(seq_len: int):
  def fn(data):
    rows = []
    for snippet in np.asarray(_feature(data, 'snippets')).reshape(-1):
      text = snippet.decode('utf-8', 'replace') if isinstance(snippet, bytes) else str(snippet)
      ids = [129] + [ord(c) if 0 < ord(c) < 128 else 128 for c in text] + [130]
      for start in range(0, max(len(ids) - 1, 1), seq_len):
        chunk = ids[start:start + seq_len + 1]
        rows.append(chunk + [0] * (seq_len + 1 - len(chunk)))
    arr = np.asarray(rows, dtype=np.int32).reshape(-1, seq_len + 1)
    return {'x': arr[:, :-1], 'y': arr[:, 1:]}
  return fn


def shakespeare(train_path: str, test_path: str | None = None,
                seq_len: int = 80) -> ExperimentData:
  """Federated Shakespeare (Caldas et al. 2018) from TensorFlow Federated HDF5.

  One client per speaking role; each ``snippets`` string becomes
  ``[begin] chars [end]`` cut into windows of ``seq_len + 1`` characters
  (next-character prediction, padding id 0 ignored by the loss).
  """
  fn = _shakespeare_sequences(seq_len)
  train = _Reshaped(_read_tff('shakespeare', train_path), fn, 'shakespeare')
  test = None if test_path is None else _Reshaped(
      _read_tff('shakespeare', test_path), fn, 'shakespeare')
  return ExperimentData(train, test, {'vocab_size': _SHAKESPEARE_VOCAB,
                                      'max_len': seq_len})


def _word_vocab(dataset: Any, vocab_path: str | None, vocab_size: int,
                vocab_clients: int) -> dict[str, int]:
  """Word -> id (ids 4.. by frequency); 0 pad, 1 unknown, 2 begin, 3 end."""
  if vocab_path is not None:
    with open(vocab_path, encoding='utf-8') as f:
      words = [line.split()[0] for line in f if line.strip()][:vocab_size]
  else:
    counts: collections.Counter = collections.Counter()
    for cid in range(min(vocab_clients, dataset.num_clients)):
      try:
        tokens = _feature(dataset.client_data(cid), 'tokens')
      except _MissingFeature as e:
        raise _missing_feature('stackoverflow', dataset, cid, e) from None
      for sentence in np.asarray(tokens).reshape(-1):
        text = sentence.decode('utf-8', 'replace') if isinstance(sentence, bytes) else str(sentence)
        counts.update(text.split())
    words = [w for w, _ in counts.most_common(vocab_size)]
  return {w: i + 4 for i, w in enumerate(words)}


def stackoverflow(train_path: str, test_path: str | None = None,
                  vocab_path: str | None = None, vocab_size: int = 10000,
                  vocab_clients: int = 1000, seq_len: int = 20,
                  max_test_clients: int | None = 1000) -> ExperimentData:
  """Stack Overflow next-word prediction (Reddi et al. 2021) from TFF HDF5.

  One client per user; each ``tokens`` sentence becomes ``[begin] words
  [end]`` over the ``vocab_size`` most frequent words (from ``vocab_path``,
  one word per line most frequent first, or counted over the first
  ``vocab_clients`` clients), truncated or padded to ``seq_len + 1``.
  """
  raw = _read_tff('stackoverflow', train_path)
  vocab = _word_vocab(raw, vocab_path, vocab_size, vocab_clients)

  def fn(data):
    rows = []
    for sentence in np.asarray(_feature(data, 'tokens')).reshape(-1):
      text = sentence.decode('utf-8', 'replace') if isinstance(sentence, bytes) else str(sentence)
      ids = ([2] + [vocab.get(w, 1) for w in text.split()] + [3])[:seq_len + 1]
      rows.append(ids + [0] * (seq_len + 1 - len(ids)))
    arr = np.asarray(rows, dtype=np.int32).reshape(-1, seq_len + 1)
    return {'x': arr[:, :-1], 'y': arr[:, 1:]}

  train = _Reshaped(raw, fn, 'stackoverflow')
  test = None if test_path is None else _pooled(
      _Reshaped(_read_tff('stackoverflow', test_path), fn, 'stackoverflow'),
      max_test_clients)
  return ExperimentData(train, test, {'vocab_size': vocab_size + 4,
                                      'max_len': seq_len})


SOURCES = ('tff', 'tfds')


def _check_source(name: str, source: str) -> None:
  if source not in SOURCES:
    raise ValueError(f'dataset {name!r}: source={source!r} is not one of {SOURCES}.')


# Where TensorFlow Federated's HDF5 files come from: the archive that
# tff.simulation.datasets.<name>.load_data() downloads (to ~/.keras/datasets)
# and the files in it, and what else can stand in for them.
TFF_DOWNLOADS = 'https://storage.googleapis.com/tff-datasets-public/'
TFF_FILES = {
    'emnist': ('fed_emnist.tar.bz2', 'fed_emnist_train.h5', 'fed_emnist_test.h5',
               "or --config.dataset.source=tfds (TFDS's emnist/byclass, "
               'partitioned by Dirichlet label skew)'),
    'cifar100': ('fed_cifar100.tar.bz2', 'fed_cifar100_train.h5',
                 'fed_cifar100_test.h5',
                 "or --config.dataset.source=tfds (TFDS's cifar100, "
                 'partitioned by Dirichlet label skew)'),
    'shakespeare': ('shakespeare.tar.bz2', 'shakespeare_train.h5',
                    'shakespeare_test.h5', ''),
    'stackoverflow': ('stackoverflow.tar.bz2', 'stackoverflow_train.h5',
                      'stackoverflow_test.h5',
                      'the vocabulary: --config.dataset.vocab_path= a word per '
                      'line, most frequent first, e.g. stackoverflow.word_count '
                      'from stackoverflow.word_count.tar.bz2 there (without it, '
                      'words are counted over the first vocab_clients clients)'),
}


def missing_data_message(name: str) -> str:
  """Which flags a TFF-file dataset needs, and where its files come from."""
  archive, train, test, more = TFF_FILES[name]
  text = (f'dataset {name!r} needs the path of its TensorFlow Federated HDF5 '
          f'file: set config.dataset.train_path (and test_path), e.g. '
          f'--config.dataset.train_path=/data/{train} '
          f'--config.dataset.test_path=/data/{test}. The files are in '
          f'{TFF_DOWNLOADS}{archive} (what tff.simulation.datasets.{name}.'
          'load_data() downloads to ~/.keras/datasets)')
  return text + (f'; {more}.' if more else '.')


def _read_tff(name: str, path: str | None) -> Any:
  if path is None:
    raise ValueError(missing_data_message(name))
  if not os.path.exists(path):
    raise FileNotFoundError(f'dataset {name!r}: no such file {path!r}.')
  return datasets.read_tff_hdf5(path)


BUILDERS: dict[str, Callable[..., ExperimentData]] = {
    'digits': digits,
    'synthetic': synthetic,
    'text': text,
    'documents': documents,
    'c4': c4,
    'instructions': instructions,
    'emnist': emnist,
    'cifar100': cifar100,
    'shakespeare': shakespeare,
    'stackoverflow': stackoverflow,
}
