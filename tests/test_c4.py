"""C4 through TFDS (datasets.tfds_source.c4_corpus, config name 'c4') and the
data position in a DiLoCo run's checkpoints.

TFDS's ``mock_data`` stands in for the prepared ``c4/en:3.1.0`` (random
records with C4's features, read through ``tfds.data_source`` as the real
ArrayRecord files are), so nothing is downloaded. The corpus is checked
against the records read straight from ``tfds.data_source``, dealt and
packed by a NumPy loop written here; the interrupted DiLoCo run against an
uninterrupted one (bit for bit: the same programs on the same inputs), and
its saved position against a NumPy replay of the sampler.
"""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest

from fedjx.datasets import documents
from fedjx.datasets import tfds_source
from fedjx.experiments import checkpointing
from fedjx.experiments import registry
from fedjx.experiments import runner
from fedjx.experiments.config_base import base_config, optimizer

tfds = pytest.importorskip('tensorflow_datasets')

NUM_RECORDS = 40
EOS, PAD = 256, 257


@pytest.fixture
def mock_c4(tmp_path):
  with tfds.testing.mock_data(num_examples=NUM_RECORDS, data_dir=os.fspath(tmp_path)):
    yield


def _reference_pack(texts, seq_len):
  """Bytes, EOS after each document, windows of seq_len + 1 with stride seq_len,
  targets whose document differs from their input's replaced by PAD."""
  stream, owner = [], []
  for d, text in enumerate(t for t in texts if t):
    ids = list(text.encode('utf-8')) + [EOS]
    stream += ids
    owner += [d] * len(ids)
  n = -(-(len(stream) - 1) // seq_len)
  stream += [PAD] * (n * seq_len + 1 - len(stream))
  owner += [-1] * (n * seq_len + 1 - len(owner))
  x = np.zeros((n, seq_len), np.int32)
  y = np.zeros((n, seq_len), np.int32)
  for i in range(n):
    for t in range(seq_len):
      j = i * seq_len + t
      x[i, t] = stream[j]
      y[i, t] = stream[j + 1] if owner[j + 1] == owner[j] else PAD
  return x, y


def test_c4_shards_are_the_records_dealt_and_packed(mock_c4):
  del mock_c4
  records = tfds.data_source('c4/en:3.1.0', split='train')
  texts = [records[j]['text'] for j in range(len(records))]
  texts = [t.decode() if isinstance(t, bytes) else t for t in texts]
  corpus = tfds_source.c4_corpus(split='train', seq_len=8, num_shards=3)
  assert corpus.num_clients == 3 and corpus.vocab_size == 258
  for k in range(3):
    assert corpus.client_name(k) == f'shard{k}'
    assert corpus.client_documents(k) == texts[k::3]
    x, y = _reference_pack(texts[k::3], 8)
    data = corpus.client_data(k)
    np.testing.assert_array_equal(data['x'], x)
    np.testing.assert_array_equal(data['y'], y)
    assert corpus.num_examples(k) == len(x)


def test_c4_config_builds_train_and_held_out(mock_c4):
  del mock_c4
  data = registry.build_dataset(dict(name='c4', split='train', num_shards=2,
                                     seq_len=16, test_split='validation[:6]'), 0)
  assert data.train.num_clients == 2 and data.test.num_clients == 1
  assert data.info == {'vocab_size': 258, 'max_len': 16, 'pad_id': PAD}
  with pytest.raises(ValueError, match='num_shards=0'):
    registry.build_dataset(dict(name='c4', num_shards=0), 0)
  with pytest.raises(ValueError, match=r"text_field='body' is not a feature"):
    tfds_source.tfds_documents(text_field='body')
  with pytest.raises(ValueError, match=f'has {NUM_RECORDS} records, fewer than '
                     f'num_shards={NUM_RECORDS + 1}'):
    tfds_source.tfds_documents(num_shards=NUM_RECORDS + 1)


def test_an_unprepared_c4_says_how_to_prepare_it(tmp_path):
  with pytest.raises(FileNotFoundError) as e:
    tfds_source.tfds_documents(data_dir=os.fspath(tmp_path))
  message = str(e.value)
  assert '\n' not in message
  assert "'c4/en:3.1.0' (split 'train') is not prepared" in message
  assert '`tfds build c4/en:3.1.0 --file_format=array_record --data_dir=DIR`' in message


# DiLoCo (Douillard et al. 2023, arXiv:2311.08105) on two C4 shards: every
# round both replicas take H = 3 inner AdamW steps of B = 2 sequences.
SEED, REPLICAS, H, B, ROUNDS, STOP = 2, 2, 3, 2, 5, 3


def _diloco(rounds=ROUNDS):
  config = base_config()
  config.seed = SEED
  config.rounds = rounds
  config.cohort_size = REPLICAS
  config.batch_size = B
  config.local_steps = H
  config.bucket_steps = False
  config.eval_every = 2
  config.eval_batch_size = 8
  config.checkpoint_every = 2
  config.progress = False
  config.plot = False
  config.tensorboard = False
  config.dataset = dict(name='c4', split='train', test_split='validation[:4]',
                        num_shards=REPLICAS, seq_len=16)
  config.model = dict(name='transformer_lm', width=16, num_layers=1, num_heads=2)
  config.algorithm = dict(
      name='diloco', inner_optimizer=optimizer('adamw', learning_rate=3e-3),
      outer_optimizer=optimizer('sgd', learning_rate=0.7, momentum=0.9, nesterov=True))
  return config


def _numpy_replay(sizes, rounds):
  """Clients drawn per round by NumPy (SeedSequence([1, seed, r]), a uniform
  choice without replacement), and the example slots each visited."""
  taken = np.zeros(len(sizes), np.int64)
  for r in range(rounds):
    gen = np.random.default_rng(np.random.SeedSequence([1, SEED, r]))
    taken[gen.choice(len(sizes), size=REPLICAS, replace=False)] += 1
  return taken, taken * H * B


def _strip(rows):
  return [{k: v for k, v in r.items() if k != 'elapsed_s'} for r in rows]


@pytest.mark.slow
def test_diloco_on_c4_resumed_mid_epoch_is_bit_identical(mock_c4, tmp_path):
  del mock_c4
  reference = runner.run(_diloco(), str(tmp_path / 'reference'), log=lambda m: None)
  workdir = str(tmp_path / 'run')

  def term(step, state, row):
    del state, row
    if step == STOP:
      os.kill(os.getpid(), signal.SIGTERM)

  stopped = runner.run(_diloco(), workdir, hooks=[term], log=lambda m: None)
  assert stopped.interrupted and stopped.step == STOP
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  try:
    position = ckpt.read_meta(STOP)['data_position']
  finally:
    ckpt.close()
  sizes = np.array(position['clients']['num_examples'])
  corpus = tfds_source.c4_corpus(split='train', seq_len=16, num_shards=REPLICAS)
  assert sizes.tolist() == corpus.examples_per_client().tolist()
  taken, seen = _numpy_replay(sizes, STOP)
  assert position['round'] == STOP
  assert position['clients']['rounds'] == taken.tolist()
  assert position['clients']['examples'] == seen.tolist()
  assert position['clients']['epoch'] == (seen // sizes).tolist()
  assert position['clients']['offset'] == (seen % sizes).tolist()
  assert all(o > 0 for o in position['clients']['offset'])  # Mid-epoch.

  resumed = runner.run(_diloco(), workdir, log=lambda m: None)
  assert not resumed.interrupted and resumed.step == ROUNDS
  assert checkpointing.checksum(resumed.state) == checkpointing.checksum(reference.state)
  for got, want in zip(jax.tree.leaves(resumed.state.params),
                       jax.tree.leaves(reference.state.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert _strip(resumed.history) == _strip(reference.history)


@pytest.mark.slow
def test_resuming_with_a_changed_corpus_is_refused(tmp_path):
  workdir = str(tmp_path / 'run')
  with tfds.testing.mock_data(num_examples=NUM_RECORDS, data_dir=str(tmp_path / 'a')):
    runner.run(_diloco(rounds=2), workdir, log=lambda m: None)
  with tfds.testing.mock_data(num_examples=NUM_RECORDS + 8, data_dir=str(tmp_path / 'b')):
    with pytest.raises(checkpointing.DataPositionMismatch) as e:
      runner.run(_diloco(rounds=4), workdir, log=lambda m: None)
  message = str(e.value)
  assert '\n' not in message
  assert 'checkpoint of step 2 written with other data: clients.num_examples[0] was ' in (
      message)
