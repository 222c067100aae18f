"""The workdir of a run or a sweep: whether it can hold one, and starting over.

:func:`check` tells, before JAX is imported, whether ``--workdir`` can hold
a run: it lists the directory and creates (and removes) a file in it, or,
for a directory still to be made, in its nearest existing ancestor, so that
nothing stays written until the run's own checks have passed. A path that
is a file, sits under a file, cannot be created, read or written, or sits on
a full disk is a :class:`WorkdirError` of one line naming the path and what
to do.

:func:`start_over` is ``--fresh``: it removes what a run (:data:`RUN_OUTPUTS`)
or a sweep (:data:`SWEEP_OUTPUTS`) writes in its workdir, and nothing else
(files of your own stay, and so does ``.lock``), holding the workdir's lock
(:mod:`fedjx.experiments.workdir_lock`) so that a live run is never
disturbed. It names what it removes and asks on a terminal; ``--yes``
skips the question, which is required where stdin is not a terminal.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import shutil
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import TextIO

from fedjx.experiments import workdir_lock

# What fedjx-run writes in its workdir (config.client_state.directory, if set
# elsewhere, is not removed).
RUN_OUTPUTS = ('checkpoints', 'checkpoint_manifests', 'client_states',
               'config.json', 'learning_curve.png', 'metrics.csv',
               'metrics.jsonl', 'privacy.json', 'tensorboard')
# What fedjx-sweep writes in its workdir (sweep_<metric>.png: the plot of the
# main metric).
SWEEP_OUTPUTS = ('groups', 'summary.csv', 'summary.md', 'summary_trials.csv',
                 'sweep.json', 'sweep_*.png', 'trials')
# Temporary files of a write a killed process left (metrics_writers).
_TEMPORARY = '.*.tmp'


class WorkdirError(ValueError):
  """A workdir that cannot be used, or a ``--fresh`` not confirmed (one line)."""


def _reason(error: OSError) -> str:
  return error.strerror or os.strerror(error.errno or 0) or type(error).__name__


def _file_above(path: str) -> str | None:
  """The nearest ancestor of ``path`` that exists and is not a directory."""
  parent = os.path.dirname(path)
  while parent and parent != os.path.dirname(parent):
    if os.path.lexists(parent) and not os.path.isdir(parent):
      return parent
    parent = os.path.dirname(parent)
  return None


def _probe(directory: str) -> OSError | None:
  """Creates and removes a file in ``directory``; the error, if that fails."""
  probe = os.path.join(directory,
                       f'.fedjx-write-test.{os.getpid()}.{uuid.uuid4().hex[:8]}')
  try:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  except OSError as e:
    return e
  os.close(fd)
  os.remove(probe)
  return None


def check(workdir: str, flag: str = '--workdir') -> str:
  """``workdir`` as an absolute path, known to be usable; nothing is left
  written (a missing directory is created by the run, once its config and
  data have passed their checks).

  A directory is listed and a file created in it and removed; for a missing
  one, that file goes to its nearest existing ancestor.

  Raises:
    WorkdirError: (one line naming the path and the fix) the path is a file
      or lies under one, or the directory cannot be created, listed or
      written (permissions, a read-only file system, a full disk).
  """
  path = os.path.abspath(workdir)
  given = f'{flag}={workdir!r}'
  full_disk = (f'{given}: no space left on the device; free space or choose a '
               f'{flag} on another disk.')
  if os.path.lexists(path) and not os.path.isdir(path):
    raise WorkdirError(f'{given} is a file, not a directory; give a directory '
                       '(it is created if missing), or move the file away.')
  above = _file_above(path)
  if above is not None:
    raise WorkdirError(f'{given}: {above!r} is a file, so no directory can be '
                       f'made under it; choose another {flag}.')
  if not os.path.isdir(path):
    parent = os.path.dirname(path)
    while not os.path.isdir(parent):
      parent = os.path.dirname(parent)
    error = _probe(parent)
    if error is None:
      return path
    if error.errno == errno.ENOSPC:
      raise WorkdirError(full_disk)
    raise WorkdirError(f'{given} cannot be created in {parent!r} '
                       f'({_reason(error)}); choose a {flag} where you can '
                       'write, e.g. under your home directory.')
  try:
    os.listdir(path)
  except OSError as e:
    raise WorkdirError(f'{given} cannot be read ({_reason(e)}); give yourself '
                       f'access (chmod u+rwx {workdir}) or choose another '
                       f'{flag}.') from None
  error = _probe(path)
  if error is not None:
    if error.errno == errno.ENOSPC:
      raise WorkdirError(full_disk)
    raise WorkdirError(f'{given} is not writable ({_reason(error)}); give '
                       f'yourself access (chmod u+rwx {workdir}) or choose '
                       f'another {flag}.')
  return path


@contextlib.contextmanager
def made(workdir: str, ours: Sequence[str] = (workdir_lock.LOCK_NAME,),
         clean: bool = True) -> Iterator[str]:
  """Makes ``workdir`` (and its missing parents) for a run or a sweep, and
  yields its absolute path.

  Where the block raises (a refused run: a config error found once the data
  loads, a workdir of another experiment), what it added to the folder is
  removed again if that is only ``ours`` (the lock, what the refused run
  wrote first) and empty folders, and so are the folders made here: a
  refused run leaves nothing behind. Anything else written, and everything
  that was there before, stays; nothing is removed with ``clean=False`` (a
  run of several processes, which share the folder).
  """
  path = os.path.abspath(workdir)
  created = []
  parent = path
  while not os.path.exists(parent) and parent != os.path.dirname(parent):
    created.append(parent)
    parent = os.path.dirname(parent)
  os.makedirs(path, exist_ok=True)
  before = set(os.listdir(path))
  try:
    yield path
  except BaseException:
    if clean:
      _remove_added(path, before, ours)
      for folder in created:  # The workdir first, then its parents.
        try:
          os.rmdir(folder)
        except OSError:
          break  # Not empty (or gone): it and its parents stay.
    raise


def _remove_added(path: str, before: set[str], ours: Sequence[str]) -> None:
  """Removes from ``path`` what is not in ``before``, if that is only
  ``ours`` and empty folders."""
  try:
    added = set(os.listdir(path)) - before
  except OSError:
    return
  empty = {e for e in added if os.path.isdir(os.path.join(path, e))
           and not os.path.islink(os.path.join(path, e))
           and not os.listdir(os.path.join(path, e))}
  if any(e not in ours and e not in empty for e in added):
    return  # Something else was written: keep it all.
  for entry in added:
    try:
      if entry in empty:
        os.rmdir(os.path.join(path, entry))
      else:
        os.remove(os.path.join(path, entry))
    except OSError:
      pass


def outputs(workdir: str, names: Sequence[str]) -> list[str]:
  """The entries of ``workdir`` matching ``names`` (and leftover temporary
  files), sorted, directories with a trailing ``/``."""
  try:
    entries = sorted(os.listdir(workdir))
  except FileNotFoundError:
    return []
  found = []
  for entry in entries:
    if any(fnmatch.fnmatchcase(entry, n) for n in (*names, _TEMPORARY)):
      is_dir = os.path.isdir(os.path.join(workdir, entry)) and not os.path.islink(
          os.path.join(workdir, entry))
      found.append(entry + ('/' if is_dir else ''))
  return found


def start_over(workdir: str, names: Sequence[str], prog: str, yes: bool,
               stdin: TextIO | None = None, stderr: TextIO | None = None
               ) -> list[str]:
  """``--fresh``: removes ``names`` (e.g. :data:`RUN_OUTPUTS`) from ``workdir``.

  Holds the workdir's lock throughout, so a run that is using it is left
  alone (:class:`~fedjx.experiments.workdir_lock.WorkdirLocked`). Unless
  ``yes``, asks ``Remove them? [y/N]`` on ``stderr`` and reads the answer
  from ``stdin``, which must be a terminal.

  Returns:
    What was removed (empty: the workdir held nothing of a run).
  Raises:
    WorkdirError: stdin is not a terminal and ``yes`` is False, or the
      answer was not yes; nothing is removed then.
  """
  stdin = sys.stdin if stdin is None else stdin
  stderr = sys.stderr if stderr is None else stderr
  if not os.path.isdir(workdir):
    return []  # Nothing there yet: nothing to start over from.
  with workdir_lock.hold(workdir):
    present = outputs(workdir, names)
    if not present:
      return []
    shown = ', '.join(present)
    if not yes:
      if stdin is None or not stdin.isatty():
        raise WorkdirError(f'--fresh would remove {shown} from {workdir}, and '
                           'stdin is not a terminal to confirm it: add --yes '
                           'to remove them.')
      stderr.write(f'{prog}: --fresh removes {shown} from {workdir}. Remove '
                   'them? [y/N] ')
      stderr.flush()
      if stdin.readline().strip().lower() not in ('y', 'yes'):
        raise WorkdirError(f'--fresh was not confirmed; nothing was removed '
                           f'from {workdir}.')
    for entry in present:
      path = os.path.join(workdir, entry.rstrip('/'))
      if entry.endswith('/'):
        shutil.rmtree(path)
      else:
        os.remove(path)
  stderr.write(f'{prog}: --fresh removed {shown} from {workdir}.\n')
  stderr.flush()
  return present
