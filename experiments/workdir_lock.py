"""One writer per workdir: an advisory lock that dies with its holder.

A run takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``workdir/.lock`` and writes
its pid, host and start time into the file. A second run on the same workdir
finds the lock taken and stops with one line naming the holder. The operating
system releases the lock when the holder's process ends, however it ends
(SIGKILL included), so a lock file left behind by a dead run never blocks.

``flock`` locks are reliable on local file systems; on network file systems
(NFS) they depend on the server's lock support.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from collections.abc import Iterator

LOCK_NAME = '.lock'


class WorkdirLocked(RuntimeError):
  """Another live process holds the workdir."""


def _holder(path: str) -> str:
  try:
    with open(path, encoding='utf-8') as f:
      info = json.loads(f.read() or '{}')
  except (OSError, ValueError):
    info = {}
  if not info:
    return 'another process (its details are still being written)'
  return (f'pid {info.get("pid")} on host {info.get("host")!r}, running since '
          f'{info.get("started")}')


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[str]:
  """Holds ``workdir``'s lock for the ``with`` block; yields the lock path.

  Raises:
    WorkdirLocked: a live process holds it (the message names that process).
  """
  path = os.path.join(workdir, LOCK_NAME)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise WorkdirLocked(
          f'{workdir} is in use by {_holder(path)}; wait for that run to end '
          'or choose another --workdir.') from None
    info = {'pid': os.getpid(), 'host': socket.gethostname(),
            'started': datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec='seconds')}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    yield path
  finally:
    os.close(fd)  # Closing the descriptor releases the lock.


def check_free(workdir: str) -> None:
  """Raises :class:`WorkdirLocked` when a live process holds ``workdir``'s
  lock; creates nothing (a workdir without a lock file is free).

  Raises:
    WorkdirLocked: a live process holds it (the message names that process).
  """
  path = os.path.join(workdir, LOCK_NAME)
  try:
    fd = os.open(path, os.O_RDWR)
  except OSError:
    return  # No lock file (or none we may open): the run's own lock decides.
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    raise WorkdirLocked(
        f'{workdir} is in use by {_holder(path)}; wait for that run to end '
        'or choose another --workdir.') from None
  finally:
    os.close(fd)  # Closing the descriptor releases the lock.
