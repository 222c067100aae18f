"""Language-model corpora from local text, JSONL and Parquet documents."""

import json

import numpy as np
import pytest

from fedjx.datasets import documents
from fedjx.experiments import registry


def _reference(docs, seq_len, eos, pad, tail):
  """Packing written out token by token."""
  stream, owner = [], []
  for k, doc in enumerate(d for d in docs if d):
    stream += list(doc) + [eos]
    owner += [k] * (len(doc) + 1)
  xs, ys, start = [], [], 0
  while start + 1 < len(stream):
    x, y = [], []
    for p in range(start, start + seq_len):
      if p + 1 < len(stream):
        x.append(stream[p])
        y.append(stream[p + 1] if owner[p + 1] == owner[p] else pad)
      else:
        x.append(stream[p] if p < len(stream) else pad)
        y.append(pad)
    full = start + seq_len < len(stream)
    if full or tail == 'pad':
      xs.append(x)
      ys.append(y)
    start += seq_len
  return (np.array(xs, np.int32).reshape(-1, seq_len),
          np.array(ys, np.int32).reshape(-1, seq_len))


@pytest.mark.parametrize('tail', ['pad', 'drop'])
@pytest.mark.parametrize('seq_len', [1, 3, 4, 7])
def test_pack_matches_reference(seq_len, tail):
  docs = [[5, 6, 7], [], [8], [9, 10, 11, 12, 13], [14, 15]]
  out = documents.pack(docs, seq_len, eos_id=99, pad_id=100, tail=tail)
  x, y = _reference(docs, seq_len, 99, 100, tail)
  assert out['x'].dtype == np.int32 and out['y'].dtype == np.int32
  np.testing.assert_array_equal(out['x'], x)
  np.testing.assert_array_equal(out['y'], y)


def test_pack_boundary_rule_by_hand():
  out = documents.pack([[1, 2], [3]], 3, eos_id=9, pad_id=0)
  # Stream 1 2 9 3 9: EOS is a target of 2; 3 (after EOS 9) is masked.
  np.testing.assert_array_equal(out['x'], [[1, 2, 9], [3, 9, 0]])
  np.testing.assert_array_equal(out['y'], [[2, 9, 0], [9, 0, 0]])
  dropped = documents.pack([[1, 2], [3]], 3, eos_id=9, pad_id=0, tail='drop')
  np.testing.assert_array_equal(dropped['x'], [[1, 2, 9]])


def test_byte_tokenizer_round_trip():
  tok = documents.ByteTokenizer()
  assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
  text = 'héllo, wörld ✓'
  ids = tok.encode(text)
  assert ids == list(text.encode('utf-8'))
  assert tok.decode(ids + [256, 257]) == text


def _write_jsonl(path, rows):
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows) + '\n')
  return path


ROWS = [{'text': 'alpha beta', 'user': 'b'}, {'text': 'gamma', 'user': 'a'},
        {'text': 'delta epsilon zeta', 'user': 'b'}, {'text': 'eta', 'user': 'a'}]


def test_jsonl_clients_documents_and_examples(tmp_path):
  path = _write_jsonl(tmp_path / 'docs.jsonl', ROWS)
  corpus = documents.documents_corpus(path, 'jsonl', 'bytes', seq_len=4,
                                      client_field='user')
  assert [corpus.client_name(c) for c in range(2)] == ['a', 'b']
  assert corpus.client_documents(0) == ['gamma', 'eta']
  assert corpus.client_documents(1) == ['alpha beta', 'delta epsilon zeta']
  tok = documents.ByteTokenizer()
  for c in range(2):
    x, y = _reference([tok.encode(d) for d in corpus.client_documents(c)],
                      4, 256, 257, 'pad')
    data = corpus.client_data(c)
    np.testing.assert_array_equal(data['x'], x)
    np.testing.assert_array_equal(data['y'], y)
    assert corpus.num_examples(c) == len(x)
  one = documents.documents_corpus(path, 'jsonl', seq_len=4)
  assert one.num_clients == 1 and one.client_name(0) == 'docs'


def test_parquet_clients(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  path = tmp_path / 'docs.parquet'
  pq.write_table(pa.table({'body': [r['text'] for r in ROWS],
                           'user': [r['user'] for r in ROWS]}), path)
  corpus = documents.documents_corpus(path, 'parquet', seq_len=4,
                                      text_field='body', client_field='user')
  assert [corpus.client_name(c) for c in range(2)] == ['a', 'b']
  assert corpus.client_documents(1) == ['alpha beta', 'delta epsilon zeta']
  with pytest.raises(ValueError, match=r"text_field='text'.*\['body', 'user'\]"):
    documents.read_parquet(path, client_field='user')


def test_text_files_clients(tmp_path):
  (tmp_path / 'alice').mkdir()
  (tmp_path / 'alice' / '1.txt').write_text('first')
  (tmp_path / 'alice' / '2.txt').write_text('second')
  (tmp_path / 'bob.txt').write_text('only one')
  (tmp_path / 'skip.md').write_text('not read')
  corpus = documents.documents_corpus(tmp_path, 'text', seq_len=2)
  assert [corpus.client_name(c) for c in range(2)] == ['alice', 'bob']
  assert corpus.client_documents(0) == ['first', 'second']
  assert corpus.client_data(1)['x'].shape == (corpus.num_examples(1), 2)


def test_huggingface_tokenizer_same_ids(tmp_path):
  tokenizers = pytest.importorskip('tokenizers')
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token='[UNK]'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=['[UNK]', '[EOS]'])
  tok.train_from_iterator([r['text'] for r in ROWS], trainer)
  file = tmp_path / 'tokenizer.json'
  tok.save(str(file))
  ours = documents.make_tokenizer({'kind': 'huggingface', 'file': str(file),
                                   'eos_token': '[EOS]'})
  text = 'alpha gamma unseen eta'
  assert ours.encode(text) == tok.encode(text).ids
  n = tok.get_vocab_size(with_added_tokens=True)
  assert (ours.eos_id, ours.pad_id, ours.vocab_size) == (tok.token_to_id('[EOS]'), n, n + 1)
  with pytest.raises(ValueError, match=r"eos_token='<eos>' is not in the vocabulary"):
    documents.HuggingFaceTokenizer(file, eos_token='<eos>')


def test_sentencepiece_tokenizer_same_ids(tmp_path):
  spm = pytest.importorskip('sentencepiece')
  model = tmp_path / 'sp.model'
  corpus = ['the quick brown fox jumps over the lazy dog'] * 20 + [
      'a b c d e f g h i j k l m n o p q r s t u v w x y z'] * 5
  with open(model, 'wb') as f:
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=f,
                                   vocab_size=30, model_type='unigram',
                                   minloglevel=2, num_threads=1)
  ours = documents.make_tokenizer({'kind': 'sentencepiece', 'model_file': str(model)})
  sp = spm.SentencePieceProcessor(model_file=str(model))
  text = 'the lazy fox'
  assert ours.encode(text) == sp.EncodeAsIds(text)
  assert ours.eos_id == sp.eos_id() and ours.pad_id == sp.get_piece_size()
  assert ours.vocab_size == sp.get_piece_size() + 1
  assert ours.decode(ours.encode(text) + [ours.eos_id]) == text


def test_errors(tmp_path):
  path = _write_jsonl(tmp_path / 'docs.jsonl', ROWS)
  with pytest.raises(ValueError, match=r"line 1 .* client_field='writer'.*\['text', 'user'\]"):
    documents.read_jsonl(path, client_field='writer')
  with pytest.raises(ValueError, match=r"format='csv' is not one of \('text', 'jsonl', 'parquet'\)"):
    documents.read_documents(path, 'csv')
  with pytest.raises(FileNotFoundError, match=r"path='.*missing.jsonl' is not a file"):
    documents.read_jsonl(tmp_path / 'missing.jsonl')
  with pytest.raises(ValueError, match=r"kind='wordpiece' is not one of"):
    documents.make_tokenizer({'kind': 'wordpiece'})
  with pytest.raises(FileNotFoundError, match=r"model_file='nope.model' is not a file"):
    documents.make_tokenizer({'kind': 'sentencepiece', 'model_file': 'nope.model'})
  with pytest.raises(ValueError, match=r"tail='keep' is not one of \('pad', 'drop'\)"):
    documents.documents_corpus(path, 'jsonl', tail='keep')
  with pytest.raises(ValueError, match='no client has 100 example'):
    documents.documents_corpus(path, 'jsonl', 'bytes', seq_len=1,
                               text_field='user', min_examples=100)


def test_config_builds_dataset_and_errors(tmp_path):
  path = _write_jsonl(tmp_path / 'docs.jsonl', ROWS * 3)
  data = registry.build_dataset(dict(name='documents', path=str(path),
                                     format='jsonl', client_field='user',
                                     tokenizer='bytes', seq_len=4), seed=0)
  assert data.info == {'vocab_size': 258, 'max_len': 4, 'pad_id': 257}
  assert data.train.num_clients == 2
  assert data.train.client_data(0)['x'].shape[1] == 4
  with pytest.raises(registry.ConfigError, match=r"config.dataset.format='csv'"):
    registry.build_dataset(dict(name='documents', path=str(path), format='csv'), 0)
  with pytest.raises(registry.ConfigError, match=r"config.dataset.tokenizer=.*wordpiece"):
    registry.build_dataset(dict(name='documents', path=str(path), format='jsonl',
                                tokenizer=dict(kind='wordpiece')), 0)
  with pytest.raises(registry.ConfigError, match=r"config.dataset.path='/no/such'"):
    registry.build_dataset(dict(name='documents', path='/no/such'), 0)


def test_shards_deal_documents_round_robin(tmp_path):
  path = _write_jsonl(tmp_path / 'docs.jsonl', ROWS)
  corpus = documents.documents_corpus(path, 'jsonl', seq_len=2,
                                      client_field='user', num_shards=3)
  # Reading order: client a (gamma, eta), then b (alpha beta, delta ...).
  assert [corpus.client_name(c) for c in range(3)] == ['shard0', 'shard1', 'shard2']
  assert corpus.client_documents(0) == ['gamma', 'delta epsilon zeta']
  assert corpus.client_documents(1) == ['eta']
  assert corpus.client_documents(2) == ['alpha beta']
  with pytest.raises(ValueError, match=r'num_shards=0; it must be an int >= 1'):
    documents.documents_corpus(path, 'jsonl', num_shards=0)
  with pytest.raises(registry.ConfigError, match=r'config.dataset.num_shards=0'):
    registry.build_dataset(dict(name='documents', path=str(path), format='jsonl',
                                num_shards=0), 0)
