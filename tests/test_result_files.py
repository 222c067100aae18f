"""The result files fedjx writes: their modes follow the umask; a write error names the file."""

import errno
import os
import stat

import pytest

from fedjx.experiments import checkpointing
from fedjx.experiments import metrics_writers
from fedjx.experiments.sweeps import summary


def _mode(path):
  return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize('umask, mode', [(0o022, 0o644), (0o027, 0o640)])
def test_result_files_follow_the_umask(tmp_path, umask, mode):
  previous = os.umask(umask)
  try:
    with open(tmp_path / 'reference', 'w', encoding='utf-8') as f:
      f.write('x')  # What the user's umask gives any file.
    metrics_writers.write_atomically(str(tmp_path / 'config.json'), '{}\n')
    for fmt in metrics_writers.FORMATS:
      writer = metrics_writers.make_writer(str(tmp_path), fmt, tensorboard=False)
      writer.write(1, {'loss': 0.5})
      writer.close()
    summary._write_csv(str(tmp_path / 'summary.csv'), [{'a': 1}])  # pylint: disable=protected-access
    ckpt = checkpointing.Checkpointer(str(tmp_path / 'checkpoints'))
    try:
      ckpt.save(1, {'w': [1.0, 2.0]}, {'step': 1})
      ckpt.wait()
    finally:
      ckpt.close()
  finally:
    os.umask(previous)
  assert _mode(tmp_path / 'reference') == mode
  for name in ('config.json', 'metrics.jsonl', 'metrics.csv', 'summary.csv',
               'checkpoint_manifests/1.json'):
    assert _mode(tmp_path / name) == mode, name


def test_a_write_error_names_the_file_it_was_writing(tmp_path, monkeypatch):
  path = str(tmp_path / 'config.json')

  def full(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, 'fsync', full)
  with pytest.raises(OSError) as e:
    metrics_writers.write_atomically(path, '{}')
  assert (e.value.errno, e.value.filename) == (errno.ENOSPC, path)
  assert os.listdir(tmp_path) == []  # Neither the file nor its temporary one.
