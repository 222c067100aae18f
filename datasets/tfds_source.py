"""TensorFlow Datasets as federated data, through ``tfds.data_source``.

``tfds.data_source`` gives random access to a prepared dataset stored as
ArrayRecord files, with no TensorFlow dependency. :func:`from_tfds` opens one
split and makes clients either from natural groups (a feature naming the user,
e.g. the writer of an image) or from a partition of a centralized dataset (a
function of one feature's column, usually the label, from
``fedjx.datasets.partition``). A client's examples are read from the
ArrayRecord files when the client is; only the column used to group is read up
front (one pass over the split).

The dataset must be prepared in ArrayRecord format (``download=True``
prepares it with ``file_format='array_record'`` if needed). Without network,
a dataset that is not prepared yet is a one-line error within seconds (TFDS
itself would retry its downloads for minutes): when the prepared dataset
cannot be opened, a probe of TFDS's download host (``storage.googleapis.com``,
:data:`PROBE_TIMEOUT_S` seconds) runs before any download. Offline
tests use ``tfds.testing.mock_data``, under which ``tfds.data_source('mnist')``
works.

Language-model corpora (:func:`tfds_documents`, :func:`c4_corpus`): the
documents of a TFDS text dataset, by default C4 (Raffel et al. 2020,
"Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", arXiv:1910.10683; TFDS ``c4/en:3.1.0``), are read through
``tfds.data_source``: record ``j`` of the split goes to shard ``j mod K``
(IID shards, one per data-parallel replica, the rule of
:func:`fedjx.datasets.documents.shard_documents`), and a shard reads its
records from the ArrayRecord files only when it is read. The ``text_field``
feature is tokenized and packed with document boundaries masked as
:mod:`fedjx.datasets.documents` does (:class:`~fedjx.datasets.documents.DocumentCorpus`).
A corpus is not downloaded unless ``download=True``: a missing one is a
one-line ``FileNotFoundError`` saying how to prepare it
(``tfds build c4/en:3.1.0 --file_format=array_record``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedjx.datasets import documents as documents_lib
from fedjx.datasets.federated import Examples, IndexedDataset
from fedjx.datasets.partition import unique_groups


PROBE_HOST = ('storage.googleapis.com', 443)
PROBE_TIMEOUT_S = 3.0
# The TFDS name of C4's English split (cleaned), the corpus of c4_corpus.
C4 = 'c4/en:3.1.0'


def network_error(host: tuple[str, int] = PROBE_HOST,
                  timeout: float = PROBE_TIMEOUT_S) -> str | None:
  """None if a TCP connection to ``host`` opens within ``timeout`` s, else why not."""
  try:
    socket.create_connection(host, timeout=timeout).close()
    return None
  except OSError as e:
    return f'{type(e).__name__}: {e}'


_TFF_INSTEAD = ("or read TFF's HDF5 files instead (source='tff', train_path=..., see "
                'fedjx.datasets.read_tff_hdf5)')


def _why(e: BaseException) -> str:
  return f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'


def _build_command(name: str, extra: str = '') -> str:
  return f'`tfds build {name} --file_format=array_record{extra}`'


def _open(tfds: Any, name: str, split: str, data_dir: str | None,
          download: bool, builder_kwargs: dict[str, Any] | None,
          caller: str = 'from_tfds', instead: str = _TFF_INSTEAD) -> Any:
  """``tfds.data_source``; offline, a missing dataset fails at once in one line.

  With ``download=False`` a dataset that is not prepared is a
  ``FileNotFoundError`` naming it, ``data_dir`` and the command that
  prepares it; ``caller`` names the function in the message, ``instead`` an
  alternative source.
  """
  kwargs = dict(split=split, data_dir=data_dir, builder_kwargs=builder_kwargs)
  try:  # Already prepared: no network needed.
    return tfds.data_source(name, download=False, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    why = _why(e)
  if not download:
    raise FileNotFoundError(
        f'{caller}: {name!r} (split {split!r}) is not prepared in data_dir='
        f'{data_dir!r} ({why}); prepare it where there is network and disk '
        f'({_build_command(name, " --data_dir=DIR")}) and pass data_dir=DIR, or give '
        f'download=True to prepare it here{"; " + instead if instead else ""}.'
    ) from None
  error = network_error()
  if error is not None:
    raise ConnectionError(
        f'{caller}: {name!r} is not prepared in data_dir={data_dir!r} ({why}) and '
        f'the network is unreachable ({PROBE_HOST[0]}: {error}); prepare it where '
        f'there is network ({_build_command(name.split(":")[0])}) and copy it to '
        f'data_dir{", " + instead if instead else ""}.') from None
  return tfds.data_source(name, download=True, **kwargs)


def _stack(records: Sequence[dict[str, Any]]) -> Examples:
  keys = records[0].keys()
  return {k: np.stack([np.asarray(r[k]) for r in records]) for k in keys}


def _name(value: Any) -> str:
  value = np.asarray(value)
  value = value.item() if value.ndim == 0 else value.tolist()
  return value.decode('utf-8', errors='replace') if isinstance(value, bytes) else str(value)


def from_tfds(name: str, split: str = 'train', *, group_key: str | None = None,
              partition: Callable[[np.ndarray], list[np.ndarray]] | None = None,
              partition_key: str = 'label', data_dir: str | None = None,
              download: bool = True, builder_kwargs: dict[str, Any] | None = None
              ) -> IndexedDataset:
  """A federated dataset over split ``split`` of the TFDS builder ``name``.

  Exactly one of ``group_key`` and ``partition``:

  * ``group_key``: one client per distinct value of that feature (sorted),
    named after the value.
  * ``partition``: ``partition(column) -> list of index arrays`` applied to the
    ``partition_key`` column, e.g.
    ``lambda y: partition_dirichlet(y, 100, alpha=0.3, seed=0)``.

  Args:
    name: the builder name, optionally with config and version
      (``'mnist'``, ``'emnist/byclass:3.1.0'``).
    split: a TFDS split string (``'train'``, ``'test[:10%]'``).
    group_key: feature whose value names the client.
    partition: index partitioner of the ``partition_key`` column.
    partition_key: the column given to ``partition``.
    data_dir: where TFDS data lives (default: TFDS's own).
    download: prepare the dataset if it is missing.
    builder_kwargs: extra arguments for ``tfds.builder``.

  Returns:
    An :class:`IndexedDataset` whose ``client_data`` reads examples as NumPy
    (features as TFDS decodes them, e.g. ``'image'`` uint8, ``'label'`` int64).
  """
  if (group_key is None) == (partition is None):
    raise ValueError('from_tfds: give exactly one of group_key (a feature name) or '
                     f'partition (a function of a column); got group_key={group_key!r}'
                     f' and partition={partition!r}.')
  import tensorflow_datasets as tfds  # deferred: heavy, used by the sources only
  source = _open(tfds, name, split, data_dir, download, builder_kwargs)
  features = sorted(source.dataset_info.features.keys())
  key = group_key if group_key is not None else partition_key
  arg = 'group_key' if group_key is not None else 'partition_key'
  if key not in features:
    raise ValueError(f'from_tfds: {arg}={key!r} is not a feature of {name!r}; '
                     f'features are {features}.')
  n = len(source)
  if n == 0:
    raise ValueError(f'from_tfds: split={split!r} of {name!r} has no examples.')
  column = np.stack([np.asarray(source[i][key]) for i in range(n)])
  if group_key is not None:
    values, groups = unique_groups(column)
    names = [_name(v) for v in values]
  else:
    groups, names = partition(column), None

  def fetch(indices: np.ndarray) -> Examples:
    return _stack([source[int(i)] for i in indices])

  return IndexedDataset(fetch, groups, names)


# ------------------------------------------------------------------ documents


def _text(value: Any) -> str:
  """A decoded Text feature as ``str`` (TFDS gives ``str`` or ``bytes``)."""
  if isinstance(value, np.ndarray):
    value = value.item()
  if isinstance(value, bytes):
    return value.decode('utf-8', errors='replace')
  if not isinstance(value, str):
    raise TypeError(f'tfds_documents: the text feature holds a {type(value).__name__}; '
                    'give text_field the name of a Text feature.')
  return value


def _check_shards(caller: str, num_shards: Any) -> int:
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f'{caller}: num_shards={num_shards!r}; it must be an int >= 1 '
                     '(one shard per data-parallel replica).')
  return num_shards


def tfds_documents(name: str = C4, split: str = 'train', *, text_field: str = 'text',
                   num_shards: int = 1, data_dir: str | None = None,
                   download: bool = False,
                   builder_kwargs: dict[str, Any] | None = None
                   ) -> documents_lib.DocumentSource:
  """The documents of a TFDS text dataset as ``num_shards`` IID shards.

  Record ``j`` of the split (``tfds.data_source``, random access over
  ArrayRecord files) goes to shard ``j mod K``, client ``shard{k}``; the
  document is the record's ``text_field`` feature. Only the split's length is
  read up front; a shard's records are read each time the shard is.

  Args:
    name: the builder with config and version, default :data:`C4`.
    split: a TFDS split string; a slice (``'train[:10000]'``,
      ``'train[:1%]'``) limits the documents.
    text_field: the Text feature holding the document.
    num_shards: ``K``, the shards (one per replica), at most the records.
    data_dir: where the prepared dataset lives (default: TFDS's own).
    download: let TFDS download and prepare a missing dataset (else a
      missing one is a ``FileNotFoundError`` saying how to prepare it).
    builder_kwargs: extra arguments for ``tfds.builder``.

  Returns:
    A :class:`fedjx.datasets.documents.DocumentSource` of ``K`` clients.
  """
  num_shards = _check_shards('tfds_documents', num_shards)
  import tensorflow_datasets as tfds  # deferred: heavy, used by the sources only
  source = _open(tfds, name, split, data_dir, download, builder_kwargs,
                 caller='tfds_documents', instead='')
  features = sorted(source.dataset_info.features.keys())
  if text_field not in features:
    raise ValueError(f'tfds_documents: text_field={text_field!r} is not a feature of '
                     f'{name!r}; features are {features}.')
  n = len(source)
  if n < num_shards:
    raise ValueError(f'tfds_documents: split={split!r} of {name!r} has {n} records, '
                     f'fewer than num_shards={num_shards}; each shard needs one.')

  def read(k: int) -> list[str]:
    return [_text(source[j][text_field]) for j in range(k, n, num_shards)]

  return documents_lib.DocumentSource([f'shard{k}' for k in range(num_shards)], read)


def c4_corpus(name: str = C4, split: str = 'train[:10000]', *,
              tokenizer: str | Mapping[str, Any] | documents_lib.Tokenizer = 'bytes',
              seq_len: int = 128, tail: str = 'pad', num_shards: int = 1,
              text_field: str = 'text', data_dir: str | None = None,
              download: bool = False, min_examples: int = 1
              ) -> documents_lib.DocumentCorpus:
  """C4 (or another TFDS text dataset) as a packed language-model corpus.

  :func:`tfds_documents` (``num_shards`` IID shards of the split's records),
  each shard's documents encoded by ``tokenizer``
  (:func:`fedjx.datasets.documents.make_tokenizer`) and packed into
  ``seq_len`` windows whose targets across a document boundary are
  ``pad_id`` (:func:`fedjx.datasets.documents.pack`). Construction reads and
  encodes every shard once to count its examples; ``client_data`` reads and
  encodes the shard again, so ``split`` should be a slice that fits in host
  memory one shard at a time (the default is the first 10000 records).

  Returns:
    A :class:`fedjx.datasets.documents.DocumentCorpus` whose clients are
    ``shard0 .. shard{K-1}`` (shards with fewer than ``min_examples``
    examples dropped).
  """
  source = tfds_documents(name, split, text_field=text_field, num_shards=num_shards,
                          data_dir=data_dir, download=download)
  return documents_lib.DocumentCorpus(source, documents_lib.make_tokenizer(tokenizer),
                                      seq_len, tail, min_examples)
