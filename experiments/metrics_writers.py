"""Writing per-round metrics: CSV or JSONL files, and TensorBoard event files.

Every writer receives ``write(round, metrics)`` calls with a flat dict of
scalars (training metrics, and ``eval_*`` metrics on evaluation rounds).
Rows carry the round number in the ``round`` column. On resumption from a
checkpoint at round ``r``, :meth:`MetricsWriter.truncate` drops the rows
written after ``r`` by the interrupted run, so the files read as if the run
had never stopped; TensorBoard is told to purge its events after ``r`` too.

Every rewrite of a file goes to a temporary file in the same directory that
then replaces it (``os.replace``, atomic on POSIX): a process killed at any
moment leaves either the old file or the new one, never a partial one.
:func:`write_atomically` is that rewrite for every result file fedjx writes
whole (``config.json``, ``sweep.json``, ``privacy.json``, the checkpoint
manifests); its files get the permissions ``open`` gives (``0666`` less the
umask: ``0644`` under umask 022), like the rows appended afterwards.

An ``OSError`` while a result file is written (a full disk: ``ENOSPC``) is
raised with that file's path (:func:`writing`), so the command line can say
in one line which file could not be written.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fedjx.experiments import config

FORMATS = config.METRICS_FORMATS


def _scalar(value: Any) -> float | int | str:
  if isinstance(value, str):
    return value
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f'metric value of shape {arr.shape} is not a scalar.')
  item = arr.reshape(()).item()
  return item if isinstance(item, (int, float)) else float(item)


def _json_value(value: Any) -> Any:
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no NaN/inf; keep them readable.
  return value


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
  """Inside, an ``OSError`` without a file name (what ``write`` and ``fsync``
  raise: ``[Errno 28] No space left on device``) is raised again with
  ``path`` as its file name (same errno, same ``OSError`` subclass)."""
  try:
    yield
  except OSError as e:
    if e.filename is not None or e.errno is None:
      raise
    raise OSError(e.errno, e.strerror or os.strerror(e.errno), path) from e


def _new_file(directory: str, prefix: str, suffix: str) -> tuple[int, str]:
  """A new file in ``directory``, open for writing, and its path.

  Created as ``open`` creates files (mode ``0666`` less the umask), not as
  ``tempfile.mkstemp`` does (``0600`` whatever the umask), so a file renamed
  into place has the permissions of every other file the user writes.
  """
  while True:
    path = os.path.join(directory, f'{prefix}{uuid.uuid4().hex[:12]}{suffix}')
    try:
      return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
    except FileExistsError:
      continue


def write_atomically(path: str, text: str) -> None:
  """Replaces ``path`` with ``text`` in one step (temporary file + ``os.replace``).

  The file's mode is ``0666`` less the umask, as for ``open(path, 'w')``.
  An ``OSError`` (a full disk) names ``path``.
  """
  directory = os.path.dirname(os.path.abspath(path))
  with writing(path):
    fd, tmp = _new_file(directory, f'.{os.path.basename(path)}.', '.tmp')
    try:
      with os.fdopen(fd, 'w', encoding='utf-8', newline='') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise


class MetricsWriter:
  """Base class: a sink for one row of scalar metrics per call."""

  def write(self, round_: int, metrics: Mapping[str, Any]) -> None:
    raise NotImplementedError

  def truncate(self, last_round: int) -> None:
    """Forgets rows with round > ``last_round`` (resumption)."""

  def flush(self) -> None:
    """Pushes buffered rows to disk."""

  def close(self) -> None:
    self.flush()


class JsonlWriter(MetricsWriter):
  """One JSON object per line: ``{"round": r, "loss": ..., ...}``."""

  def __init__(self, path: str):
    self.path = path
    self._file = open(path, 'a', encoding='utf-8', buffering=1)

  def write(self, round_: int, metrics: Mapping[str, Any]) -> None:
    row = {'round': int(round_)}
    row.update({k: _json_value(_scalar(v)) for k, v in metrics.items()})
    with writing(self.path):
      self._file.write(json.dumps(row) + '\n')

  def truncate(self, last_round: int) -> None:
    with writing(self.path):
      self._file.close()
    rows = read_jsonl(self.path)
    write_atomically(self.path, ''.join(
        json.dumps(row) + '\n' for row in rows if row['round'] <= last_round))
    self._file = open(self.path, 'a', encoding='utf-8', buffering=1)

  def flush(self) -> None:
    with writing(self.path):
      self._file.flush()

  def close(self) -> None:
    with writing(self.path):
      self._file.close()


class CsvWriter(MetricsWriter):
  """A CSV table with a ``round`` column and one column per metric.

  A row lacks the metrics not computed that round (e.g. ``eval_*`` between
  evaluations): those cells are empty. When a new metric appears, the file is
  rewritten with the wider header.
  """

  def __init__(self, path: str):
    self.path = path
    self._rows = read_csv(path) if os.path.exists(path) else []
    self._columns = _columns(self._rows)
    self._file = None
    self._rewrite()

  def _rewrite(self) -> None:
    if self._file is not None:
      with writing(self.path):
        self._file.close()
    text = io.StringIO()
    table = csv.DictWriter(text, fieldnames=self._columns)
    table.writeheader()
    table.writerows(self._rows)
    write_atomically(self.path, text.getvalue())
    self._file = open(self.path, 'a', encoding='utf-8', newline='', buffering=1)
    self._writer = csv.DictWriter(self._file, fieldnames=self._columns)

  def write(self, round_: int, metrics: Mapping[str, Any]) -> None:
    row = {'round': int(round_)}
    row.update({k: _scalar(v) for k, v in metrics.items()})
    self._rows.append(row)
    if any(k not in self._columns for k in row):
      self._columns = _columns(self._rows)
      self._rewrite()
    else:
      with writing(self.path):
        self._writer.writerow(row)

  def truncate(self, last_round: int) -> None:
    self._rows = [r for r in self._rows if r['round'] <= last_round]
    self._rewrite()

  def flush(self) -> None:
    with writing(self.path):
      self._file.flush()

  def close(self) -> None:
    with writing(self.path):
      self._file.close()


class TensorBoardWriter(MetricsWriter):
  """Scalars to a TensorBoard event file under ``logdir`` (tensorboardX).

  Events are written synchronously (tensorboardX's ``EventsWriter``, not the
  ``SummaryWriter`` whose background queue ``flush()`` does not drain), so
  after :meth:`flush` every row written so far is on disk, as in the metrics
  file. ``purge_round`` writes a ``SessionLog.START`` at that step, which
  makes TensorBoard hide the events of earlier attempts from that step on
  (what ``SummaryWriter(purge_step=...)`` does).
  """

  def __init__(self, logdir: str, purge_round: int | None = None):
    from tensorboardX import summary  # deferred: before JAX (quick start-up)
    from tensorboardX.event_file_writer import EventsWriter  # deferred: before JAX (quick start-up)
    from tensorboardX.proto import event_pb2  # deferred: before JAX (quick start-up)
    self._summary, self._pb = summary, event_pb2
    self.logdir = logdir
    os.makedirs(logdir, exist_ok=True)
    # The pid keeps two attempts started in the same second apart.
    with writing(logdir):
      self._events = EventsWriter(os.path.join(logdir, 'events'), f'.{os.getpid()}')
      if purge_round is not None:
        self._events.write_event(event_pb2.Event(
            step=purge_round, wall_time=time.time(),
            session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
      self._events.flush()

  def write(self, round_: int, metrics: Mapping[str, Any]) -> None:
    now = time.time()
    with writing(self.logdir):
      for name, value in metrics.items():
        value = _scalar(value)
        if not isinstance(value, str):
          self._events.write_event(self._pb.Event(
              step=int(round_), wall_time=now,
              summary=self._summary.scalar(name, value)))

  def flush(self) -> None:
    with writing(self.logdir):
      self._events.flush()

  def close(self) -> None:
    with writing(self.logdir):
      self._events.close()


class MultiWriter(MetricsWriter):
  """Forwards every call to several writers."""

  def __init__(self, writers: Sequence[MetricsWriter]):
    self.writers = list(writers)

  def write(self, round_: int, metrics: Mapping[str, Any]) -> None:
    for w in self.writers:
      w.write(round_, metrics)

  def truncate(self, last_round: int) -> None:
    for w in self.writers:
      w.truncate(last_round)

  def flush(self) -> None:
    for w in self.writers:
      w.flush()

  def close(self) -> None:
    for w in self.writers:
      w.close()


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
  columns = ['round']
  for row in rows:
    columns.extend(k for k in row if k not in columns)
  return columns


def _parse(value: str) -> Any:
  if value == '':
    return None
  for cast in (int, float):
    try:
      return cast(value)
    except ValueError:
      pass
  return value


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The rows of a JSONL metrics file (a torn last line is skipped)."""
  rows = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue  # A line cut short by a killed process.
      rows.append({k: (float(v) if v in ('nan', 'inf', '-inf') else v)
                   for k, v in row.items()})
  return rows


def read_csv(path: str) -> list[dict[str, Any]]:
  """The rows of a CSV metrics file; empty cells are left out of a row."""
  with open(path, encoding='utf-8', newline='') as f:
    rows = []
    for raw in csv.DictReader(f):
      row = {k: _parse(v) for k, v in raw.items() if v not in ('', None)}
      if isinstance(row.get('round'), int):
        rows.append(row)
    return rows


def metrics_path(workdir: str, fmt: str) -> str:
  """Where a run in ``workdir`` writes its metrics in format ``fmt``."""
  if fmt not in FORMATS:
    raise ValueError(f'metrics_format={fmt!r} is not one of {FORMATS}.')
  return os.path.join(workdir, f'metrics.{fmt}')


def read_metrics(workdir_or_file: str) -> list[dict[str, Any]]:
  """Rows from a run directory (``metrics.jsonl`` or ``metrics.csv``) or file."""
  path = workdir_or_file
  if os.path.isdir(path):
    for fmt in FORMATS:
      candidate = metrics_path(path, fmt)
      if os.path.exists(candidate):
        path = candidate
        break
    else:
      raise FileNotFoundError(f'{workdir_or_file} holds neither metrics.jsonl nor '
                              'metrics.csv; is it a fedjx-run workdir?')
  if path.endswith('.csv'):
    return read_csv(path)
  return read_jsonl(path)


def make_writer(workdir: str, fmt: str = 'jsonl', tensorboard: bool = True,
                resume_round: int | None = None) -> MetricsWriter:
  """The writers of a run: a ``metrics.<fmt>`` file and TensorBoard events.

  Args:
    workdir: the run directory.
    fmt: ``'jsonl'`` or ``'csv'``.
    tensorboard: also write event files under ``workdir/tensorboard``.
    resume_round: the round of the checkpoint being resumed from (rows after
      it are dropped), or None for a fresh run (any old rows are dropped).
  """
  path = metrics_path(workdir, fmt)
  for name in os.listdir(workdir):  # Left by a process killed mid-rewrite.
    if name.startswith(f'.{os.path.basename(path)}.') and name.endswith('.tmp'):
      os.remove(os.path.join(workdir, name))
  if resume_round is None and os.path.exists(path):
    os.remove(path)
  writers: list[MetricsWriter] = [
      CsvWriter(path) if fmt == 'csv' else JsonlWriter(path)]
  writers[0].truncate(-1 if resume_round is None else resume_round)
  if tensorboard:
    # Events of earlier attempts after the resumed round (all of them on a
    # fresh start) are purged, as the metrics file's rows are.
    writers.append(TensorBoardWriter(
        os.path.join(workdir, 'tensorboard'),
        purge_round=0 if resume_round is None else resume_round + 1))
  return MultiWriter(writers)
