"""Compilation shown as progress: the runner's lines around the first round.

The first round of a run is where its program is traced and compiled, which
takes from a second (``configs/fedavg_digits.py``) to minutes (a transformer
on a loaded machine). The runner says what is compiling before that round and
how long the round took after it (:func:`compiling_message`,
:func:`compiled_message`).

XLA's own notice for a compile that passes two minutes ("Very slow
compile? If you want to file a bug, run with envvar XLA_FLAGS=... and attach
the results.", from ``xla/service/slow_operation_alarm.cc``) is an absl
``LOG(ERROR)`` line. XLA has no flag for that alarm, and its logger's only
threshold, ``TF_CPP_MIN_LOG_LEVEL``, is global: the level that hides it (3)
hides every real error of XLA too. :func:`slow_compile_notice_as_progress`
therefore passes everything written to file descriptor 2 through unchanged
during the first round, except that one block, which it replaces by one
progress line (``fedjx: still compiling ...``).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

ALARM_SOURCE = b'slow_operation_alarm.cc'
ALARM_TEXT = b'Very slow compile?'
SEPARATOR = b'*' * 32
# A partial line is passed on when nothing follows it for this long.
PARTIAL_LINE_WAIT_S = 0.1


def compiling_message(config: Any) -> str:
  """The line before the first round: what is compiling."""
  return (f'fedjx: compiling the round of {config.algorithm.name} (model '
          f'{config.model.name}, {config.cohort_size} clients)...')


def compiled_message(seconds: float) -> str:
  """The line after the first round."""
  return (f'fedjx: compiled the round; the first round took {seconds:.1f} s '
          '(compilation included).')


def _notice(seconds: float) -> bytes:
  return (f"fedjx: still compiling the round ({seconds:.0f} s so far; XLA's "
          "'Very slow compile?' notice, not an error).\n").encode()


class _Filter:
  """Copies ``read_fd`` to ``out_fd`` line by line, the alarm replaced."""

  def __init__(self, read_fd: int, out_fd: int, start: float):
    self.read_fd, self.out_fd, self.start = read_fd, out_fd, start
    self.held: list[bytes] = []  # lines of a possible alarm block
    self.seen_text = False
    self.partial = b''

  def _write(self, data: bytes) -> None:
    while data:
      data = data[os.write(self.out_fd, data):]

  def _line(self, line: bytes) -> None:
    if not self.held:
      if ALARM_SOURCE in line:
        self.held = [line]
        self.seen_text = ALARM_TEXT in line
      else:
        self._write(line)
      return
    self.held.append(line)
    body = line.strip()
    if ALARM_TEXT in line:
      self.seen_text = True
    elif body == SEPARATOR and self.seen_text:  # The block's end.
      self.held = []
      self._write(_notice(time.perf_counter() - self.start))
    elif body != SEPARATOR and not self.seen_text or len(self.held) > 8:
      self.flush_held()  # Not the alarm: passed on as it was.

  def flush_held(self) -> None:
    held, self.held = self.held, []
    self._write(b''.join(held))

  def run(self) -> None:
    while True:
      ready, _, _ = select.select([self.read_fd], [], [],
                                  PARTIAL_LINE_WAIT_S if self.partial else None)
      if not ready:  # A partial line (a progress bar's \r) goes out now.
        if not self.held:
          self._write(self.partial)
          self.partial = b''
        continue
      data = os.read(self.read_fd, 65536)
      if not data:
        break
      lines = (self.partial + data).split(b'\n')
      self.partial = lines.pop()
      for line in lines:
        self._line(line + b'\n')
    self.flush_held()
    self._write(self.partial)


@contextlib.contextmanager
def slow_compile_notice_as_progress() -> Iterator[None]:
  """Inside, XLA's slow-compile alarm on stderr becomes one progress line.

  Everything else written to file descriptor 2 (Python's and XLA's) is
  passed on unchanged; partial lines within ``PARTIAL_LINE_WAIT_S``. Where
  file descriptor 2 cannot be redirected, nothing changes.
  """
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError, AttributeError):
    yield
    return
  read_fd, write_fd = os.pipe()
  filt = _Filter(read_fd, saved, time.perf_counter())
  thread = threading.Thread(target=filt.run, name='fedjx-stderr', daemon=True)
  thread.start()
  os.dup2(write_fd, 2)
  os.close(write_fd)
  try:
    yield
  finally:
    try:
      sys.stderr.flush()
    except (OSError, ValueError):
      pass
    os.dup2(saved, 2)  # Closes the pipe's last write end: the thread ends.
    thread.join()
    os.close(read_fd)
    os.close(saved)
