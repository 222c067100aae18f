"""The persistent compilation cache of a run (``config.compilation_cache``).

XLA's compiled programs are kept on disk by JAX's persistent compilation
cache (``jax_compilation_cache_dir``), keyed by the program, the backend and
the JAX version, so a second run of the same config (a resumed run, a rerun
with another seed, a sweep's next trial of the same shapes) loads its round
instead of compiling it again. ``config.compilation_cache`` says where:

* ``'user'`` (the default): ``$XDG_CACHE_HOME/fedjx/xla`` (``~/.cache`` when
  unset), shared by every run of this user;
* ``'workdir'``: ``<workdir>/xla_cache``, kept with the run;
* ``'off'``: nothing is cached;
* any other value: that folder.

A cache directory set through JAX itself (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config``) is left as it is. Every compiled program is kept, however
quick to compile (JAX's default keeps only those over a second).
"""

from __future__ import annotations

import os

import jax

SETTINGS = ('user', 'workdir', 'off')


def directory(setting: str, workdir: str) -> str | None:
  """The cache folder of ``setting`` for a run in ``workdir`` (None: off)."""
  if not isinstance(setting, str) or not setting:
    raise ValueError(f'config.compilation_cache={setting!r}; it must be one of '
                     f"{SETTINGS} or a folder's path.")
  if setting == 'off':
    return None
  if setting == 'workdir':
    return os.path.join(workdir, 'xla_cache')
  if setting == 'user':
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(
        os.path.expanduser('~'), '.cache')
    return os.path.join(base, 'fedjx', 'xla')
  return os.path.abspath(os.path.expanduser(setting))


def enable(setting: str, workdir: str) -> str | None:
  """Turns the cache on for this process as ``setting`` says; returns the
  folder in use (JAX's own setting if one was made), or None."""
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = directory(setting, workdir)
  if path is None:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f'config.compilation_cache={setting!r}: cannot create the '
                     f'folder {path} ({e.strerror}); give a writable folder or '
                     "'off'.") from None
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  return path
