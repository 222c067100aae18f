"""Instruction-tuning data for federated fine-tuning of language models.

Records are read from JSONL (one JSON object per line) or Parquet files, in
one of two schemas (field names configurable with :class:`RecordFields`):

* Alpaca: ``instruction``, an optional ``input`` (absent, null or ``''``:
  none) and ``output``, all strings.
* Chat: ``messages``, a list of ``{'role': r, 'content': s}`` with ``r`` in
  ``('system', 'user', 'assistant')`` and at least one assistant turn.

An Alpaca record is the chat ``[user(instruction, input), assistant(output)]``.
Every record keeps its other fields (e.g. ``category``, ``user``), which the
partitions read.

Rendering (:func:`render`) turns a record into text segments ``(text_j,
r_j)``, ``r_j`` true for a response, with a :class:`ChatTemplate` of plain
format strings: a system turn is ``system.format(content=...)`` (the
template's ``default_system`` when the record has no system turn), a user
turn ``user.format(content=...)`` (``user_with_input`` when an Alpaca input
is present), an assistant turn the prompt text ``assistant`` followed by the
response ``content + end_of_turn``, and ``after_turn`` (prompt) between an
assistant turn and the next turn. Consecutive prompt texts are joined.
Built-ins: ``'alpaca'``, the prompt of Stanford Alpaca (Taori et al. 2023,
"Stanford Alpaca: An Instruction-following LLaMA Model",
github.com/tatsu-lab/stanford_alpaca) with a newline after ``### Response:``,
and ``'chatml'``, ``<|im_start|>role\\n...<|im_end|>\\n`` turns.

Encoding (:func:`encode_example`): every segment is tokenized on its own, so
the response boundary is exact, and EOS is appended after each response.
This gives tokens ``s_0 .. s_{L-1}`` and a mask ``m_i`` (true for response
tokens and their EOS). With ``T = seq_len``, only ``s_0 .. s_T`` are kept
(truncation from the right: a record longer than ``T + 1`` tokens loses its
end), and

    x[t] = s_t                      for t < min(L, T), else pad_id
    y[t] = s_{t+1} if m_{t+1}       for t + 1 < min(L, T + 1)
    y[t] = pad_id                   otherwise,

so the language-model loss, which ignores targets equal to ``pad_id``, is
the loss on response tokens only. One example per record: records are never
packed together.

Clients (:class:`InstructionDataset`, ``partition``):

* ``'field'``: natural clients, one per distinct ``str(record[client_field])``
  (e.g. a category or a user), named after it, in sorted order.
* ``'dirichlet'``: label skew over ``record[label_field]``, client ``k``'s label
  mix ``q_k ~ Dir(alpha * p)`` (Hsu, Qi and Brown 2019, "Measuring the Effects
  of Non-Identical Data Distribution for Federated Visual Classification",
  arXiv:1909.06335), by :func:`fedjx.datasets.partition.partition_dirichlet`.
* ``'iid'``: a uniformly random split into ``num_clients`` near-equal clients
  (:func:`fedjx.datasets.partition.partition_iid`).

Both random partitions are functions of ``seed``. A client's records keep
file order. This is the setting of federated instruction tuning (Zhang et
al. 2023, "Towards Building the Federated GPT: Federated Instruction
Tuning", arXiv:2305.05644; Ye et al. 2024, "OpenFedLLM: Training Large
Language Models on Decentralized Private Data via Federated Learning",
arXiv:2402.06954). Records are held in memory as text; a client is
tokenized when it is read. Examples are ``{'x': [n, T], 'y': [n, T]}`` int32.

:func:`write_toy_instructions` writes a small synthetic instruction set
(reverse, uppercase, add, sort, repeat) for runs with no download.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedjx.datasets import _seeding
from fedjx.datasets import partition as partition_lib
from fedjx.datasets.documents import Tokenizer, make_tokenizer
from fedjx.datasets.federated import Examples, IndexedDataset

__all__ = ['FORMATS', 'SCHEMAS', 'ROLES', 'PARTITIONS', 'TOY_CATEGORIES',
           'RecordFields', 'ChatTemplate', 'ALPACA', 'CHATML', 'TEMPLATES',
           'get_template', 'check_record', 'read_jsonl', 'read_parquet',
           'read_instructions', 'render', 'encode_example', 'encode_records',
           'partition_records', 'InstructionDataset', 'instruction_dataset',
           'write_toy_instructions']

FORMATS = ('jsonl', 'parquet')
SCHEMAS = ('auto', 'alpaca', 'chat')
ROLES = ('system', 'user', 'assistant')
PARTITIONS = ('field', 'dirichlet', 'iid')
TOY_CATEGORIES = ('reverse', 'uppercase', 'add', 'sort', 'repeat')

TOY = 40  # purpose tag of the toy records' random stream (fedjx.datasets._seeding)

Segments = list[tuple[str, bool]]


# ------------------------------------------------------------------ records


@dataclasses.dataclass(frozen=True)
class RecordFields:
  """The field names of a record's parts.

  Attributes:
    instruction, input, output: the Alpaca fields (``input`` optional).
    messages: the chat field, a list of ``{'role', 'content'}`` dicts.
  """

  instruction: str = 'instruction'
  input: str = 'input'
  output: str = 'output'
  messages: str = 'messages'


def _as_fields(fields: RecordFields | Mapping[str, str] | None, where: str) -> RecordFields:
  if fields is None:
    return RecordFields()
  if isinstance(fields, RecordFields):
    return fields
  names = [f.name for f in dataclasses.fields(RecordFields)]
  if not isinstance(fields, Mapping) or set(fields) - set(names) or not all(
      isinstance(v, str) for v in fields.values()):
    raise ValueError(f'{where}: fields={fields!r}; give a RecordFields or a dict '
                     f'of field names (strings) with keys from {names}.')
  return RecordFields(**fields)


def _check_schema(schema: Any, where: str) -> str:
  if schema not in SCHEMAS:
    raise ValueError(f'{where}: schema={schema!r} is not one of {SCHEMAS}.')
  return schema


def _kind(record: Mapping[str, Any], fields: RecordFields, schema: str) -> str:
  if schema != 'auto':
    return schema
  return 'chat' if record.get(fields.messages) is not None else 'alpaca'


def _no_field(where: str, key: str | None, field: str, record: Mapping[str, Any]
              ) -> ValueError:
  name = repr(field) if key is None else f'{key}={field!r}'
  return ValueError(f'instructions: {where} has no field {name} (missing or null); '
                    f'its fields are {sorted(record)}.')


def _check_string(where: str, key: str, field: str, value: Any) -> None:
  if not isinstance(value, str):
    raise ValueError(f'instructions: {where}: {key}={field!r} holds a '
                     f'{type(value).__name__}; it must be a string.')


def _check_messages(where: str, field: str, messages: Any) -> None:
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError(f'instructions: {where}: messages={field!r} holds '
                     f'{type(messages).__name__} {messages!r:.60}; it must be a '
                     'non-empty list of {role, content} objects.')
  for j, m in enumerate(messages):
    if not isinstance(m, Mapping) or 'role' not in m or 'content' not in m:
      raise ValueError(f'instructions: {where}: {field}[{j}]={m!r:.60} must be an '
                       "object with fields 'role' and 'content'.")
    if m['role'] not in ROLES:
      raise ValueError(f'instructions: {where}: {field}[{j}] has role={m["role"]!r};'
                       f' roles are {ROLES}.')
    if not isinstance(m['content'], str):
      raise ValueError(f'instructions: {where}: {field}[{j}] content is a '
                       f'{type(m["content"]).__name__}; it must be a string.')
  if not any(m['role'] == 'assistant' for m in messages):
    raise ValueError(f'instructions: {where}: {field} has no assistant turn; a '
                     'record needs one to train on.')


def check_record(record: Any, where: str, fields: RecordFields | None = None,
                 schema: str = 'auto', require: Sequence[str] = ()) -> None:
  """Raises a one-line ValueError naming ``where`` if ``record`` is malformed.

  Args:
    record: a dict (one JSON line or Parquet row).
    where: where it was read, e.g. ``"line 3 of 'data.jsonl'"``.
    fields: the field names (default :class:`RecordFields`).
    schema: ``'alpaca'``, ``'chat'`` or ``'auto'`` (chat when the messages
      field is present and not null).
    require: other fields every record must have (non-null), e.g. the
      partition's client or label field.
  """
  fields = fields or RecordFields()
  if not isinstance(record, Mapping):
    raise ValueError(f'instructions: {where} is a {type(record).__name__}; each '
                     'record must be a JSON object.')
  if _kind(record, fields, schema) == 'chat':
    if record.get(fields.messages) is None:
      raise _no_field(where, 'messages', fields.messages, record)
    _check_messages(where, fields.messages, record[fields.messages])
  else:
    for key in ('instruction', 'output'):
      field = getattr(fields, key)
      if record.get(field) is None:
        raise _no_field(where, key, field, record)
      _check_string(where, key, field, record[field])
    if record.get(fields.input) is not None:
      _check_string(where, 'input', fields.input, record[fields.input])
  for field in require:
    if record.get(field) is None:
      raise _no_field(where, None, field, record)


def _check_path(where: str, path: Any) -> str:
  if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
    raise FileNotFoundError(f'{where}: path={path!r} is not a file; give the path '
                            'of an existing file.')
  return os.fspath(path)


def read_jsonl(path: str | os.PathLike, fields: RecordFields | Mapping[str, str] | None = None,
               schema: str = 'auto', require: Sequence[str] = ()) -> list[dict[str, Any]]:
  """The records of a JSONL file, one JSON object per line (blank lines skipped).

  Every record is checked by :func:`check_record`; a bad one is a ValueError
  naming the file, the line (from 1) and the missing field.
  """
  path = _check_path('read_jsonl', path)
  fields = _as_fields(fields, 'read_jsonl')
  schema = _check_schema(schema, 'read_jsonl')
  records = []
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'instructions: line {number} of {path!r} is not JSON '
                         f'({e.msg}).') from None
      check_record(obj, f'line {number} of {path!r}', fields, schema, require)
      records.append(obj)
  if not records:
    raise ValueError(f'read_jsonl: path={path!r} has no records; each line must be'
                     ' a JSON object.')
  return records


def read_parquet(path: str | os.PathLike, fields: RecordFields | Mapping[str, str] | None = None,
                 schema: str = 'auto', require: Sequence[str] = ()) -> list[dict[str, Any]]:
  """The records of a Parquet file, one per row (``pyarrow.parquet``).

  A chat ``messages`` column is a list of structs ``{role, content}``. Every
  record is checked by :func:`check_record`; a bad one is a ValueError naming
  the file, the row (from 0) and the missing field.
  """
  path = _check_path('read_parquet', path)
  fields = _as_fields(fields, 'read_parquet')
  schema = _check_schema(schema, 'read_parquet')
  try:
    import pyarrow.parquet as pq  # deferred: optional dependency pyarrow
  except ImportError:
    raise ImportError("read_parquet needs the 'pyarrow' package: pip install "
                      'pyarrow') from None
  records = pq.read_table(path).to_pylist()
  for row, record in enumerate(records):
    check_record(record, f'row {row} of {path!r}', fields, schema, require)
  if not records:
    raise ValueError(f'read_parquet: path={path!r} has no rows.')
  return records


def read_instructions(path: str | os.PathLike, format: str = 'jsonl',  # pylint: disable=redefined-builtin
                      fields: RecordFields | Mapping[str, str] | None = None,
                      schema: str = 'auto', require: Sequence[str] = ()
                      ) -> list[dict[str, Any]]:
  """The records of ``path`` in ``format`` (one of :data:`FORMATS`)."""
  if format not in FORMATS:
    raise ValueError(f'read_instructions: format={format!r} is not one of {FORMATS}.')
  reader = read_jsonl if format == 'jsonl' else read_parquet
  return reader(path, fields, schema, require)


# ------------------------------------------------------------------ templates


_FORMAT_FIELDS = {'system': ('content',), 'user': ('content',),
                  'user_with_input': ('content', 'input')}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat format of plain strings (no Jinja); see the module docstring.

  Attributes:
    name: the template's name.
    system: a system turn, ``system.format(content=...)``.
    default_system: the system text used when a record has no system turn
      (``''``: none).
    default_system_with_input: the same, for an Alpaca record with an input.
    user: a user turn, ``user.format(content=...)``.
    user_with_input: an Alpaca user turn with an input,
      ``user_with_input.format(content=instruction, input=input)``.
    assistant: the prompt text before a response.
    end_of_turn: appended to each response and trained on (before EOS).
    after_turn: prompt text after a response when more turns follow.
  """

  name: str
  system: str
  user: str
  user_with_input: str
  assistant: str
  end_of_turn: str = ''
  after_turn: str = ''
  default_system: str = ''
  default_system_with_input: str = ''

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if not isinstance(getattr(self, f.name), str):
        raise ValueError(f'ChatTemplate: {f.name}={getattr(self, f.name)!r}; it '
                         'must be a string.')
    for key, allowed in _FORMAT_FIELDS.items():
      value = getattr(self, key)
      try:
        names = {n for _, n, _, _ in string.Formatter().parse(value) if n is not None}
      except ValueError as e:
        raise ValueError(f'ChatTemplate: {key}={value!r} is not a format string '
                         f'({e}); write literal braces as {{{{ and }}}}.') from None
      if names - set(allowed):
        raise ValueError(f'ChatTemplate: {key}={value!r} uses fields '
                         f'{sorted(names - set(allowed))}; it may use only '
                         f'{list(allowed)}.')


_ALPACA_TASK = ('Below is an instruction that describes a task. Write a response '
                'that appropriately completes the request.')
_ALPACA_TASK_INPUT = ('Below is an instruction that describes a task, paired with an '
                      'input that provides further context. Write a response that '
                      'appropriately completes the request.')

ALPACA = ChatTemplate(
    name='alpaca', system='{content}\n\n', user='### Instruction:\n{content}\n\n',
    user_with_input='### Instruction:\n{content}\n\n### Input:\n{input}\n\n',
    assistant='### Response:\n', end_of_turn='', after_turn='\n\n',
    default_system=_ALPACA_TASK, default_system_with_input=_ALPACA_TASK_INPUT)

CHATML = ChatTemplate(
    name='chatml', system='<|im_start|>system\n{content}<|im_end|>\n',
    user='<|im_start|>user\n{content}<|im_end|>\n',
    user_with_input='<|im_start|>user\n{content}\n\n{input}<|im_end|>\n',
    assistant='<|im_start|>assistant\n', end_of_turn='<|im_end|>', after_turn='\n')

TEMPLATES = {'alpaca': ALPACA, 'chatml': CHATML}


def get_template(template: str | ChatTemplate) -> ChatTemplate:
  """A built-in template by name (:data:`TEMPLATES`) or ``template`` itself."""
  if isinstance(template, ChatTemplate):
    return template
  if template not in TEMPLATES:
    raise ValueError(f'get_template: template={template!r} is not one of '
                     f'{tuple(TEMPLATES)} or a ChatTemplate.')
  return TEMPLATES[template]


def _turns(record: Mapping[str, Any], fields: RecordFields, schema: str
           ) -> list[tuple[str, str, str | None]]:
  """The record as ``(role, content, input)`` turns."""
  if _kind(record, fields, schema) == 'chat':
    return [(m['role'], m['content'], None) for m in record[fields.messages]]
  extra = record.get(fields.input) or None
  return [('user', record[fields.instruction], extra),
          ('assistant', record[fields.output], None)]


def render(record: Mapping[str, Any], template: str | ChatTemplate = 'alpaca',
           fields: RecordFields | Mapping[str, str] | None = None,
           schema: str = 'auto') -> Segments:
  """The record as ``(text, is_response)`` segments (rule: module docstring).

  Prompt segments are joined where they meet; each response is its own
  segment (its EOS is added by :func:`encode_example`).
  """
  template = get_template(template)
  fields = _as_fields(fields, 'render')
  check_record(record, 'render: record', fields, _check_schema(schema, 'render'))
  turns = _turns(record, fields, schema)
  out: Segments = []

  def prompt(text: str) -> None:
    if not text:
      return
    if out and not out[-1][1]:
      out[-1] = (out[-1][0] + text, False)
    else:
      out.append((text, False))

  if all(role != 'system' for role, _, _ in turns):
    has_input = any(extra is not None for _, _, extra in turns)
    default = template.default_system_with_input if has_input else template.default_system
    if default:
      prompt(template.system.format(content=default))
  for k, (role, content, extra) in enumerate(turns):
    if role == 'system':
      prompt(template.system.format(content=content))
    elif role == 'user' and extra is None:
      prompt(template.user.format(content=content))
    elif role == 'user':
      prompt(template.user_with_input.format(content=content, input=extra))
    else:
      prompt(template.assistant)
      out.append((content + template.end_of_turn, True))
      if k + 1 < len(turns):
        prompt(template.after_turn)
  return out


# ------------------------------------------------------------------ encoding


def _check_seq_len(where: str, seq_len: Any) -> int:
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ValueError(f'{where}: seq_len={seq_len!r}; it must be an int >= 1.')
  return int(seq_len)


def _tokens(segments: Sequence[tuple[str, bool]], tokenizer: Tokenizer
            ) -> tuple[list[int], list[bool]]:
  """All tokens (EOS after each response) and which are response tokens."""
  ids: list[int] = []
  mask: list[bool] = []
  for j, segment in enumerate(segments):
    if (not isinstance(segment, (tuple, list)) or len(segment) != 2
        or not isinstance(segment[0], str)):
      raise ValueError(f'encode_example: segments[{j}]={segment!r:.60}; each '
                       'segment must be a (text: str, is_response: bool) pair.')
    text, is_response = segment[0], bool(segment[1])
    piece = [int(i) for i in tokenizer.encode(text)]
    if is_response:
      piece.append(int(tokenizer.eos_id))
    ids += piece
    mask += [is_response] * len(piece)
  return ids, mask


def encode_example(segments: Sequence[tuple[str, bool]], tokenizer: Tokenizer,
                   seq_len: int, pad_id: int | None = None, return_length: bool = False
                   ) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, int]:
  """One record's ``x [T]`` and ``y [T]`` (int32), targets on responses only.

  Args:
    segments: ``(text, is_response)`` pairs, e.g. from :func:`render`.
    tokenizer: a :class:`fedjx.datasets.documents.Tokenizer`; each segment is
      encoded on its own, so one that adds special tokens on every call (a
      ``HuggingFaceTokenizer`` with ``add_special_tokens=True``) adds them to
      every segment.
    seq_len: ``T``; tokens after the first ``T + 1`` are cut off.
    pad_id: the id of padding and masked targets (default the tokenizer's).
    return_length: also return ``L``, the number of tokens before truncation
      (the record was truncated when ``L > T + 1``).

  Returns:
    ``(x, y)``, or ``(x, y, L)`` with ``return_length``.
  """
  seq_len = _check_seq_len('encode_example', seq_len)
  pad = int(tokenizer.pad_id if pad_id is None else pad_id)
  ids, mask = _tokens(segments, tokenizer)
  length = len(ids)
  kept = np.asarray(ids[:seq_len + 1], dtype=np.int32)
  response = np.asarray(mask[:seq_len + 1], dtype=bool)
  x = np.full(seq_len, pad, dtype=np.int32)
  y = np.full(seq_len, pad, dtype=np.int32)
  inputs = min(kept.size, seq_len)
  x[:inputs] = kept[:inputs]
  if kept.size > 1:
    y[:kept.size - 1] = np.where(response[1:], kept[1:], pad)
  return (x, y, length) if return_length else (x, y)


def encode_records(records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                   seq_len: int, template: str | ChatTemplate = 'alpaca',
                   fields: RecordFields | Mapping[str, str] | None = None,
                   schema: str = 'auto') -> tuple[Examples, np.ndarray]:
  """``{'x': [n, T], 'y': [n, T]}`` of :func:`encode_example` over ``records``.

  Returns:
    The examples and ``int64 [n]``, each record's token count before
    truncation.
  """
  seq_len = _check_seq_len('encode_records', seq_len)
  xs = np.zeros((len(records), seq_len), np.int32)
  ys = np.zeros((len(records), seq_len), np.int32)
  lengths = np.zeros(len(records), np.int64)
  for i, record in enumerate(records):
    xs[i], ys[i], lengths[i] = encode_example(
        render(record, template, fields, schema), tokenizer, seq_len, return_length=True)
  return {'x': xs, 'y': ys}, lengths


# ------------------------------------------------------------------ clients


def _check_count(where: str, key: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f'{where}: {key}={value!r}; it must be an int >= {minimum}.')
  return int(value)


def _labels(values: list[Any]) -> np.ndarray:
  """Labels as NumPy makes them; other values (mixed, nested) as strings."""
  labels = np.asarray(values) if values else np.zeros(0)
  if labels.dtype == object or labels.ndim != 1:
    labels = np.asarray([str(v) for v in values])
  return labels


def _check_partition_args(partition: str, client_field: Any, label_field: Any,
                          num_clients: Any, alpha: Any, seed: Any, n: int | None) -> None:
  where = 'partition_records'
  if partition not in PARTITIONS:
    raise ValueError(f'{where}: partition={partition!r} is not one of {PARTITIONS}.')
  _check_count(where, 'seed', seed, 0)
  if partition == 'field':
    if not isinstance(client_field, str):
      raise ValueError(f"{where}: client_field={client_field!r}; partition='field' "
                       "needs the name of a record field, e.g. 'category'.")
    for key, value in (('label_field', label_field), ('num_clients', num_clients),
                       ('alpha', alpha)):
      if value is not None:
        raise ValueError(f"{where}: {key}={value!r} is not used by partition='field'"
                         ' (one client per client_field value); leave it None.')
    return
  _check_count(where, 'num_clients', num_clients, 1)
  if n is not None and num_clients > n:
    raise ValueError(f'{where}: num_clients={num_clients} is more than the {n} '
                     'records; every client needs at least one.')
  if partition == 'iid':
    for key, value in (('label_field', label_field), ('alpha', alpha)):
      if value is not None:
        raise ValueError(f"{where}: {key}={value!r} is not used by partition='iid';"
                         ' leave it None.')
    return
  if not isinstance(label_field, str):
    raise ValueError(f"{where}: label_field={label_field!r}; partition='dirichlet' "
                     "needs the name of a record field, e.g. 'category'.")
  if (isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer))
      or not math.isfinite(alpha) or alpha <= 0):
    raise ValueError(f"{where}: alpha={alpha!r}; partition='dirichlet' needs a finite "
                     'float > 0 (small: skewed labels; large: IID).')


def partition_records(records: Sequence[Mapping[str, Any]], partition: str = 'field',
                      client_field: str | None = 'category', label_field: str | None = None,
                      num_clients: int | None = None, alpha: float | None = None,
                      seed: int = 0) -> tuple[list[str] | None, list[np.ndarray]]:
  """Client names (None: the ids) and each client's record indices (ascending).

  ``client_field`` is read only by ``partition='field'``; ``label_field``,
  ``num_clients`` and ``alpha`` must be None where unused.
  """
  n = len(records)
  _check_partition_args(partition, client_field, label_field, num_clients, alpha, seed, n)
  field = client_field if partition == 'field' else label_field
  if partition != 'iid':
    for i, record in enumerate(records):
      if record.get(field) is None:
        raise _no_field(f'records[{i}]', 'client_field' if partition == 'field'
                        else 'label_field', field, record)
  if partition == 'field':
    names, groups = partition_lib.unique_groups(
        np.asarray([str(r[client_field]) for r in records]))
    return [str(v) for v in names], groups
  if partition == 'iid':
    return None, partition_lib.partition_iid(n, int(num_clients), int(seed))
  labels = _labels([r[label_field] for r in records])
  return None, partition_lib.partition_dirichlet(labels, int(num_clients), float(alpha),
                                                 int(seed))


class InstructionDataset(IndexedDataset):
  """Instruction records as federated clients of one example per record.

  Args:
    records: the records (dicts; e.g. from :func:`read_instructions`).
    tokenizer: a :class:`fedjx.datasets.documents.Tokenizer`.
    seq_len: ``T``, the length of ``x`` and ``y``.
    template: a :class:`ChatTemplate` or a name in :data:`TEMPLATES`.
    partition, client_field, label_field, num_clients, alpha, seed: who holds
      which record (:func:`partition_records`).
    fields: the records' field names (:class:`RecordFields`).
    schema: ``'auto'``, ``'alpaca'`` or ``'chat'``.

  Attributes:
    records, tokenizer, template, seq_len, vocab_size, eos_id, pad_id.
  """

  def __init__(self, records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
               seq_len: int, template: str | ChatTemplate = 'alpaca',
               partition: str = 'field', client_field: str | None = 'category',
               label_field: str | None = None, num_clients: int | None = None,
               alpha: float | None = None, seed: int = 0,
               fields: RecordFields | Mapping[str, str] | None = None,
               schema: str = 'auto'):
    where = 'InstructionDataset'
    if not isinstance(tokenizer, Tokenizer):
      raise ValueError(f'{where}: tokenizer={tokenizer!r}; it must be a Tokenizer '
                       '(fedjx.datasets.documents.make_tokenizer builds one).')
    self.seq_len = _check_seq_len(where, seq_len)
    self.template = get_template(template)
    self.fields = _as_fields(fields, where)
    self.schema = _check_schema(schema, where)
    self.records = list(records)
    if not self.records:
      raise ValueError(f'{where}: records is empty; a dataset needs at least one.')
    for i, record in enumerate(self.records):
      check_record(record, f'records[{i}]', self.fields, self.schema)
    self.tokenizer = tokenizer
    self.vocab_size = tokenizer.vocab_size
    self.eos_id, self.pad_id = tokenizer.eos_id, tokenizer.pad_id
    names, groups = partition_records(self.records, partition, client_field, label_field,
                                      num_clients, alpha, seed)
    super().__init__(self._encode, groups, names)

  def _encode(self, indices: np.ndarray) -> Examples:
    return encode_records([self.records[i] for i in indices], self.tokenizer,
                          self.seq_len, self.template, self.fields, self.schema)[0]

  def client_records(self, cid: int) -> list[Mapping[str, Any]]:
    """Client ``cid``'s records, in file order."""
    return [self.records[i] for i in self.client_indices(cid)]

  def truncated_per_client(self) -> np.ndarray:
    """``int64 [num_clients]``: records longer than ``seq_len + 1`` tokens.

    Encodes every record (the dataset itself tokenizes only when read).
    """
    out = np.zeros(self.num_clients, np.int64)
    for c in range(self.num_clients):
      _, lengths = encode_records(self.client_records(c), self.tokenizer, self.seq_len,
                                  self.template, self.fields, self.schema)
      out[c] = int(np.sum(lengths > self.seq_len + 1))
    return out


def segment_tokenizer(spec: Any) -> Tokenizer:
  """``make_tokenizer`` for records encoded segment by segment: Hugging Face
  special tokens are off unless asked.

  Segments are encoded one by one, so a post-processor's BOS would otherwise
  start every segment.
  """
  if isinstance(spec, Mapping) and spec.get('kind') == 'huggingface':
    spec = {'add_special_tokens': False, **spec}
  return make_tokenizer(spec)


def instruction_dataset(path: str | os.PathLike, format: str = 'jsonl',  # pylint: disable=redefined-builtin
                        template: str | ChatTemplate = 'alpaca',
                        tokenizer: str | Mapping[str, Any] | Tokenizer = 'bytes',
                        seq_len: int = 256, partition: str = 'field',
                        client_field: str | None = 'category',
                        label_field: str | None = None, num_clients: int | None = None,
                        alpha: float | None = None, seed: int = 0,
                        fields: RecordFields | Mapping[str, str] | None = None,
                        schema: str = 'auto') -> InstructionDataset:
  """A federated instruction-tuning dataset of the records at ``path``.

  Args:
    path: a JSONL or Parquet file.
    format: one of :data:`FORMATS`.
    template: ``'alpaca'``, ``'chatml'`` or a :class:`ChatTemplate`.
    tokenizer: as :func:`fedjx.datasets.documents.make_tokenizer` takes it;
      a ``dict(kind='huggingface', ...)`` without ``add_special_tokens``
      gets ``add_special_tokens=False`` (segments are encoded one by one).
    seq_len: ``T``, tokens per example input.
    partition: ``'field'`` (one client per ``client_field`` value),
      ``'dirichlet'`` (label skew over ``label_field`` with ``num_clients``,
      ``alpha``, ``seed``) or ``'iid'`` (``num_clients``, ``seed``).
    client_field: the natural client key (``partition='field'`` only).
    label_field: the label of the Dirichlet partition.
    num_clients: clients of ``'dirichlet'`` and ``'iid'``.
    alpha: the Dirichlet concentration, ``> 0``.
    seed: the seed of ``'dirichlet'`` and ``'iid'``, an int ``>= 0``.
    fields: the records' field names (:class:`RecordFields` or a dict).
    schema: ``'auto'``, ``'alpaca'`` or ``'chat'``.

  Returns:
    An :class:`InstructionDataset`.
  """
  where = 'instruction_dataset'
  if format not in FORMATS:
    raise ValueError(f'{where}: format={format!r} is not one of {FORMATS}.')
  if not isinstance(template, ChatTemplate) and template not in TEMPLATES:
    raise ValueError(f'{where}: template={template!r} is not one of '
                     f'{tuple(TEMPLATES)} or a ChatTemplate.')
  _check_seq_len(where, seq_len)
  _check_schema(schema, where)
  fields = _as_fields(fields, where)
  _check_partition_args(partition, client_field, label_field, num_clients, alpha, seed,
                        n=None)
  try:
    tok = segment_tokenizer(tokenizer)
  except ValueError as e:
    raise ValueError(f'{where}: {e}') from None
  key = client_field if partition == 'field' else label_field
  records = read_instructions(path, format, fields, schema, () if key is None else (key,))
  return InstructionDataset(records, tok, seq_len, template, partition, client_field,
                            label_field, num_clients, alpha, seed, fields, schema)


# ------------------------------------------------------------------ toy data


def _toy_word(gen: np.random.Generator) -> str:
  letters = gen.integers(0, 26, size=int(gen.integers(3, 7)))
  return ''.join(chr(ord('a') + int(k)) for k in letters)


def _toy_record(category: str, gen: np.random.Generator) -> dict[str, str]:
  """One task of ``category``: its instruction, input and output."""
  if category == 'add':
    a, b = (int(v) for v in gen.integers(0, 50, size=2))
    return {'instruction': f'Add: {a} + {b}', 'input': '', 'output': str(a + b)}
  word = _toy_word(gen)
  if category == 'reverse':
    return {'instruction': f'Reverse the word: {word}', 'input': '', 'output': word[::-1]}
  if category == 'uppercase':
    return {'instruction': f'Uppercase: {word}', 'input': '', 'output': word.upper()}
  if category == 'sort':
    return {'instruction': f'Sort the letters: {word}', 'input': '',
            'output': ''.join(sorted(word))}
  times = int(gen.integers(2, 4))
  return {'instruction': f'Repeat the word {times} times.', 'input': word,
          'output': ' '.join([word] * times)}


def toy_instructions(num_records: int = 200, seed: int = 0) -> list[dict[str, Any]]:
  """The synthetic, learnable instruction records of :func:`write_toy_instructions`.

  Record ``i`` has fields ``id`` (``i``), ``category`` (drawn uniformly from
  :data:`TOY_CATEGORIES`), ``instruction``, ``input`` and ``output``:
  ``reverse`` ("Reverse the word: abc" -> "cba"), ``uppercase``
  ("Uppercase: abc" -> "ABC"), ``add`` ("Add: 3 + 4" -> "7", operands in
  ``[0, 50)``), ``sort`` ("Sort the letters: cab" -> "abc") and ``repeat``
  (instruction "Repeat the word 2 times.", input "ab" -> "ab ab"). Words are
  3 to 6 random lowercase letters. The records are a function of
  ``(num_records, seed)``.
  """
  where = 'toy_instructions'
  num_records = _check_count(where, 'num_records', num_records, 1)
  seed = _check_count(where, 'seed', seed, 0)
  gen = _seeding.rng(TOY, seed)
  records = []
  for i in range(num_records):
    category = TOY_CATEGORIES[int(gen.integers(len(TOY_CATEGORIES)))]
    records.append({'id': i, 'category': category, **_toy_record(category, gen)})
  return records


def write_toy_instructions(path: str | os.PathLike, num_records: int = 200,
                           seed: int = 0) -> str:
  """Writes :func:`toy_instructions` as JSONL (one record per line); returns the path."""
  where = 'write_toy_instructions'
  if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(
      os.path.dirname(os.path.abspath(path))):
    raise ValueError(f'{where}: path={path!r}; give a file path in an existing '
                     'folder.')
  records = toy_instructions(num_records, seed)
  with open(path, 'w', encoding='utf-8') as f:
    for record in records:
      f.write(json.dumps(record) + '\n')
  return str(path)
