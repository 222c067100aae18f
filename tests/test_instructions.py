"""Instruction-tuning data: templates, response-only targets, partitions, readers.

Every expectation is integer-exact (token ids and masks), so the references
below compare with equality; no floating-point tolerance is involved.
"""

import json

import numpy as np
import pytest

from fedjx.datasets import instructions as inst
from fedjx.datasets import partition
from fedjx.datasets.documents import ByteTokenizer

EOS, PAD = 256, 257

ALPACA_PRE = ('Below is an instruction that describes a task. Write a response that '
              'appropriately completes the request.\n\n')
ALPACA_PRE_INPUT = ('Below is an instruction that describes a task, paired with an input '
                    'that provides further context. Write a response that appropriately '
                    'completes the request.\n\n')


def _reference(pieces, seq_len):
  """x, y from (text, is_response) pieces, token by token in plain Python.

  A response piece is followed by EOS; a target is kept only when the token it
  predicts is a response token or that EOS.
  """
  tokens, resp = [], []
  for text, is_response in pieces:
    for b in text.encode('utf-8'):
      tokens.append(b)
      resp.append(is_response)
    if is_response:
      tokens.append(EOS)
      resp.append(True)
  length = len(tokens)
  tokens, resp = tokens[:seq_len + 1], resp[:seq_len + 1]
  x = [tokens[t] if t < len(tokens) else PAD for t in range(seq_len)]
  y = []
  for t in range(seq_len):
    if t + 1 < len(tokens) and resp[t + 1]:
      y.append(tokens[t + 1])
    else:
      y.append(PAD)
  return np.array(x, np.int32), np.array(y, np.int32), length


def test_encode_by_hand():
  x, y = inst.encode_example([('ab', False), ('cd', True)], ByteTokenizer(), 8)
  # tokens a b c d EOS: targets c, d and EOS; the prompt's b is masked.
  np.testing.assert_array_equal(x, [97, 98, 99, 100, EOS, PAD, PAD, PAD])
  np.testing.assert_array_equal(y, [PAD, 99, 100, EOS, PAD, PAD, PAD, PAD])
  assert x.dtype == np.int32 and y.dtype == np.int32


def test_encode_truncates_from_the_right():
  segments = [('ab', False), ('cdef', True)]  # 7 tokens: a b c d e f EOS
  x, y, length = inst.encode_example(segments, ByteTokenizer(), 4, return_length=True)
  assert length == 7
  np.testing.assert_array_equal(x, [97, 98, 99, 100])
  np.testing.assert_array_equal(y, [PAD, 99, 100, 101])
  # Exactly T + 1 tokens: nothing is lost, the last input is f, its target EOS.
  x, y, length = inst.encode_example(segments, ByteTokenizer(), 6, return_length=True)
  np.testing.assert_array_equal(x, [97, 98, 99, 100, 101, 102])
  np.testing.assert_array_equal(y, [PAD, 99, 100, 101, 102, EOS])
  x, y = inst.encode_example(segments, ByteTokenizer(), 6, pad_id=0)
  np.testing.assert_array_equal(y, [0, 99, 100, 101, 102, EOS])


@pytest.mark.parametrize('seq_len', [5, 40, 200, 300])
def test_alpaca_record_matches_hand_rendering(seq_len):
  record = {'instruction': 'Uppercase: abc', 'output': 'ABC', 'category': 'u'}
  prompt = ALPACA_PRE + '### Instruction:\nUppercase: abc\n\n### Response:\n'
  segments = inst.render(record, 'alpaca')
  assert segments == [(prompt, False), ('ABC', True)]
  x, y, length = inst.encode_example(segments, ByteTokenizer(), seq_len, return_length=True)
  rx, ry, rlength = _reference([(prompt, False), ('ABC', True)], seq_len)
  np.testing.assert_array_equal(x, rx)
  np.testing.assert_array_equal(y, ry)
  assert length == rlength == len(prompt) + 4
  if seq_len >= length:  # targets are exactly A, B, C and EOS, at the end
    assert [int(v) for v in y if v != PAD] == [65, 66, 67, EOS]


def test_alpaca_input_section_and_empty_input():
  with_input = inst.render({'instruction': 'Repeat the word 2 times.', 'input': 'ab',
                            'output': 'ab ab'})
  assert with_input == [(ALPACA_PRE_INPUT + '### Instruction:\nRepeat the word 2 times.'
                         '\n\n### Input:\nab\n\n### Response:\n', False), ('ab ab', True)]
  empty = inst.render({'instruction': 'Add: 1 + 2', 'input': '', 'output': '3'})
  none = inst.render({'instruction': 'Add: 1 + 2', 'input': None, 'output': '3'})
  assert empty == none == [(ALPACA_PRE + '### Instruction:\nAdd: 1 + 2\n\n### Response:\n',
                            False), ('3', True)]


def test_chatml_messages_only_assistant_turns_are_targets():
  record = {'messages': [
      {'role': 'system', 'content': 'Be brief.'},
      {'role': 'user', 'content': 'Hi'},
      {'role': 'assistant', 'content': 'Hello'},
      {'role': 'user', 'content': 'Bye'},
      {'role': 'assistant', 'content': 'Ok'}], 'user': 7}
  p1 = ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n'
        '<|im_start|>assistant\n')
  p2 = '\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n'
  expected = [(p1, False), ('Hello<|im_end|>', True), (p2, False), ('Ok<|im_end|>', True)]
  segments = inst.render(record, 'chatml')
  assert segments == expected
  seq_len = 200
  x, y = inst.encode_example(segments, ByteTokenizer(), seq_len)
  rx, ry, _ = _reference(expected, seq_len)
  np.testing.assert_array_equal(x, rx)
  np.testing.assert_array_equal(y, ry)
  targets = bytes(int(v) for v in y if v not in (PAD, EOS)).decode()
  assert targets == 'Hello<|im_end|>Ok<|im_end|>'
  assert int(np.sum(y == EOS)) == 2  # one EOS after each response
  # An EOS target sits right after each response's last token.
  eos_at = np.flatnonzero(y == EOS)
  np.testing.assert_array_equal(x[eos_at], [ord('>'), ord('>')])


def test_alpaca_template_on_messages_uses_system_turn():
  record = {'messages': [{'role': 'system', 'content': 'S'},
                         {'role': 'user', 'content': 'U'},
                         {'role': 'assistant', 'content': 'A'}]}
  assert inst.render(record, 'alpaca') == [
      ('S\n\n### Instruction:\nU\n\n### Response:\n', False), ('A', True)]


def test_custom_template_and_fields():
  template = inst.ChatTemplate(name='plain', system='', user='Q: {content}\n',
                               user_with_input='Q: {content} [{input}]\n',
                               assistant='A: ', end_of_turn='.')
  record = {'question': 'x?', 'context': 'c', 'answer': 'y'}
  fields = {'instruction': 'question', 'input': 'context', 'output': 'answer'}
  assert inst.render(record, template, fields) == [('Q: x? [c]\nA: ', False), ('y.', True)]
  with pytest.raises(ValueError, match=r"ChatTemplate: user='\{who\}' uses fields \['who'\]"):
    inst.ChatTemplate(name='bad', system='', user='{who}', user_with_input='',
                      assistant='')


def _toy(tmp_path, num_records=60, seed=3):
  path = inst.write_toy_instructions(tmp_path / 'toy.jsonl', num_records, seed)
  return path, [json.loads(line) for line in open(path, encoding='utf-8')]


def test_toy_tasks_are_correct_and_deterministic(tmp_path):
  path, records = _toy(tmp_path)
  again = inst.write_toy_instructions(tmp_path / 'again.jsonl', 60, 3)
  other = inst.write_toy_instructions(tmp_path / 'other.jsonl', 60, 4)
  assert open(path).read() == open(again).read() != open(other).read()
  assert [r['id'] for r in records] == list(range(60))
  assert {r['category'] for r in records} == set(inst.TOY_CATEGORIES)
  for r in records:
    arg = r['instruction'].split(': ')[-1]
    if r['category'] == 'reverse':
      assert r['output'] == arg[::-1]
    elif r['category'] == 'uppercase':
      assert r['output'] == arg.upper()
    elif r['category'] == 'sort':
      assert r['output'] == ''.join(sorted(arg))
    elif r['category'] == 'add':
      a, b = arg.split(' + ')
      assert r['output'] == str(int(a) + int(b))
    else:
      times = int(r['instruction'].split()[3])
      assert r['output'] == ' '.join([r['input']] * times)


def test_field_partition_is_group_by_and_response_only(tmp_path):
  path, records = _toy(tmp_path)
  seq_len = 190
  ds = inst.instruction_dataset(path, seq_len=seq_len, client_field='category')
  groups = {}
  for i, r in enumerate(records):
    groups.setdefault(r['category'], []).append(i)
  names = sorted(groups)
  assert [ds.client_name(c) for c in range(ds.num_clients)] == names
  np.testing.assert_array_equal(ds.examples_per_client(), [len(groups[n]) for n in names])
  truncated = []
  for c, name in enumerate(names):
    np.testing.assert_array_equal(ds.client_indices(c), groups[name])
    data = ds.client_data(c)
    assert data['x'].shape == data['y'].shape == (len(groups[name]), seq_len)
    count = 0
    for k, i in enumerate(groups[name]):
      r = records[i]
      pre = ALPACA_PRE_INPUT if r['input'] else ALPACA_PRE
      section = f'### Input:\n{r["input"]}\n\n' if r['input'] else ''
      prompt = (f'{pre}### Instruction:\n{r["instruction"]}\n\n{section}'
                '### Response:\n')
      rx, ry, length = _reference([(prompt, False), (r['output'], True)], seq_len)
      np.testing.assert_array_equal(data['x'][k], rx)
      np.testing.assert_array_equal(data['y'][k], ry)
      count += length > seq_len + 1
      # Response-only: every kept target is a byte of the output or the EOS.
      kept = [int(v) for v in data['y'][k] if v != PAD]
      assert bytes(v for v in kept if v != EOS).decode() in r['output']
      if length <= seq_len + 1:
        assert kept == list(r['output'].encode()) + [EOS]
    truncated.append(count)
  np.testing.assert_array_equal(ds.truncated_per_client(), truncated)
  assert sum(truncated) > 0  # seq_len 190 cuts the longer 'repeat' prompts


def test_dirichlet_partition_matches_partition_dirichlet(tmp_path):
  path, records = _toy(tmp_path, num_records=80)
  kwargs = dict(seq_len=16, partition='dirichlet', label_field='category', num_clients=6,
                alpha=0.3, seed=5)
  ds = inst.instruction_dataset(path, **kwargs)
  again = inst.instruction_dataset(path, **kwargs)
  labels = np.asarray([r['category'] for r in records])
  expected = partition.partition_dirichlet(labels, 6, 0.3, seed=5)
  assert ds.num_clients == 6
  for c in range(6):
    np.testing.assert_array_equal(ds.client_indices(c), expected[c])
    np.testing.assert_array_equal(again.client_indices(c), expected[c])
    np.testing.assert_array_equal(ds.client_data(c)['y'], again.client_data(c)['y'])
  other = inst.instruction_dataset(path, **{**kwargs, 'seed': 6})
  assert any(not np.array_equal(other.client_indices(c), expected[c]) for c in range(6))


def test_iid_partition_matches_partition_iid(tmp_path):
  path, _ = _toy(tmp_path, num_records=30)
  ds = inst.instruction_dataset(path, seq_len=16, partition='iid', num_clients=4, seed=2)
  expected = partition.partition_iid(30, 4, seed=2)
  np.testing.assert_array_equal(ds.examples_per_client(), [8, 8, 7, 7])
  for c in range(4):
    np.testing.assert_array_equal(ds.client_indices(c), expected[c])


def test_parquet_and_jsonl_give_the_same_dataset(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  path, records = _toy(tmp_path, num_records=40)
  pq.write_table(pa.Table.from_pylist(records), tmp_path / 'toy.parquet')
  a = inst.instruction_dataset(path, seq_len=64, template='chatml')
  b = inst.instruction_dataset(tmp_path / 'toy.parquet', format='parquet', seq_len=64,
                               template='chatml')
  assert [a.client_name(c) for c in range(a.num_clients)] == \
      [b.client_name(c) for c in range(b.num_clients)]
  for c in range(a.num_clients):
    for key in ('x', 'y'):
      np.testing.assert_array_equal(a.client_data(c)[key], b.client_data(c)[key])


def test_chat_parquet_reads_messages(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  rows = [{'user': 'u1', 'messages': [{'role': 'user', 'content': 'a'},
                                      {'role': 'assistant', 'content': 'b'}]},
          {'user': 'u0', 'messages': [{'role': 'user', 'content': 'c'},
                                      {'role': 'assistant', 'content': 'd'}]}]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'chat.parquet')
  ds = inst.instruction_dataset(tmp_path / 'chat.parquet', format='parquet',
                                template='chatml', seq_len=80, client_field='user')
  assert [ds.client_name(c) for c in range(2)] == ['u0', 'u1']
  y = ds.client_data(0)['y'][0]
  assert [int(v) for v in y if v != PAD] == list(b'd<|im_end|>') + [EOS]


def test_record_errors_name_file_line_and_field(tmp_path):
  path = tmp_path / 'bad.jsonl'
  lines = [{'instruction': 'a', 'output': 'b', 'category': 'x'},
           {'instruction': 'a', 'output': 'b', 'category': 'x'},
           {'instruction': 'a', 'category': 'x'}]
  path.write_text('\n'.join(json.dumps(r) for r in lines) + '\n')
  with pytest.raises(ValueError, match=r"line 3 of '.*bad\.jsonl' has no field "
                     r"output='output'"):
    inst.instruction_dataset(path)
  path.write_text(json.dumps({'instruction': 'a', 'output': 'b'}) + '\n')
  with pytest.raises(ValueError, match=r"line 1 of .* has no field 'category'"):
    inst.instruction_dataset(path)
  path.write_text(json.dumps({'messages': [{'role': 'bot', 'content': 'x'}]}) + '\n')
  with pytest.raises(ValueError, match=r"line 1 of .*messages\[0\] has role='bot'"):
    inst.read_jsonl(path)
  path.write_text(json.dumps({'messages': [{'role': 'user', 'content': 'x'}]}) + '\n')
  with pytest.raises(ValueError, match='has no assistant turn'):
    inst.read_jsonl(path)
  path.write_text('{"instruction": \n')
  with pytest.raises(ValueError, match='line 1 of .* is not JSON'):
    inst.read_jsonl(path)


def test_parquet_error_names_row(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  rows = [{'instruction': 'a', 'output': 'b'}, {'instruction': 'c', 'output': None}]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'bad.parquet')
  with pytest.raises(ValueError, match=r"row 1 of '.*bad\.parquet' has no field "
                     r"output='output'"):
    inst.read_parquet(tmp_path / 'bad.parquet')


@pytest.mark.parametrize('kwargs, message', [
    (dict(format='csv'), r"instruction_dataset: format='csv' is not one of"),
    (dict(template='llama'), r"instruction_dataset: template='llama' is not one of"),
    (dict(seq_len=0), r'instruction_dataset: seq_len=0; it must be an int >= 1'),
    (dict(schema='x'), r"instruction_dataset: schema='x' is not one of"),
    (dict(partition='random'), r"partition='random' is not one of"),
    (dict(partition='iid'), r'num_clients=None; it must be an int >= 1'),
    (dict(partition='iid', num_clients=2, seed=-1), r'seed=-1; it must be an int >= 0'),
    (dict(partition='dirichlet', num_clients=2, label_field='category'),
     r'alpha=None; .* finite float > 0'),
    (dict(partition='dirichlet', num_clients=2, alpha=1.0),
     r'label_field=None; .* needs the name'),
    (dict(num_clients=3), r"num_clients=3 is not used by partition='field'"),
    (dict(partition='iid', num_clients=999), r'num_clients=999 is more than the 20'),
    (dict(fields={'prompt': 'q'}), r"fields=\{'prompt': 'q'\}"),
    (dict(tokenizer='words'), r"instruction_dataset: tokenizer kind='words' is not one"),
])
def test_builder_checks_arguments(tmp_path, kwargs, message):
  path, _ = _toy(tmp_path, num_records=20)
  with pytest.raises(ValueError, match=message):
    inst.instruction_dataset(path, **kwargs)


def test_encode_checks_segments():
  with pytest.raises(ValueError, match=r'encode_example: segments\[0\]'):
    inst.encode_example(['ab'], ByteTokenizer(), 4)
  with pytest.raises(ValueError, match='encode_example: seq_len=-1'):
    inst.encode_example([('a', True)], ByteTokenizer(), -1)


def test_huggingface_tokenizer_adds_no_special_tokens_by_default(tmp_path):
  tokenizers = pytest.importorskip('tokenizers')
  vocab = {'[UNK]': 0, '<s>': 1, '</s>': 2, 'Q': 3, 'A': 4, 'hi': 5, 'yo': 6, '[PAD]': 7}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', 1)])
  tok.save(str(tmp_path / 'tokenizer.json'))
  path = tmp_path / 'one.jsonl'
  path.write_text(json.dumps({'instruction': 'hi', 'output': 'yo', 'category': 'c'}) + '\n')
  template = inst.ChatTemplate(name='qa', system='', user='Q {content} ',
                               user_with_input='', assistant='A ')
  spec = dict(kind='huggingface', file=str(tmp_path / 'tokenizer.json'), eos_token='</s>',
              pad_token='[PAD]')
  ds = inst.instruction_dataset(path, template=template, tokenizer=spec, seq_len=6)
  data = ds.client_data(0)
  # Segments 'Q hi A ' (prompt) and 'yo' (response) then EOS: Q hi A yo </s>.
  np.testing.assert_array_equal(data['x'][0], [3, 5, 4, 6, 2, 7])
  np.testing.assert_array_equal(data['y'][0], [7, 7, 6, 2, 7, 7])
  with_bos = inst.instruction_dataset(path, template=template, seq_len=6,
                                      tokenizer={**spec, 'add_special_tokens': True})
  # Asked for, the post-processor's BOS starts every segment.
  np.testing.assert_array_equal(with_bos.client_data(0)['x'][0], [1, 3, 5, 4, 1, 6])
