"""libtpu's environment on a machine without a TPU, set before libtpu loads.

With ``jax[tpu]`` installed, JAX loads libtpu when it starts its backends
(and :mod:`fedjx.experiments.topology_plan` loads it to compile for a TPU
topology). On a machine without TPU chips libtpu then prints warnings that
it could not find ``TPU_ACCELERATOR_TYPE`` and ``TPU_WORKER_HOSTNAMES``, and
takes a lock file that stops a second process from loading it.
:func:`quiet` sets those variables first (unless they are set), which
silences the warnings, and ``ALLOW_MULTIPLE_LIBTPU_LOAD`` (compiling needs
no exclusive hold on a chip); on a TPU host it changes nothing, so libtpu
reads the host's own settings. It imports nothing heavy.
"""

from __future__ import annotations

import glob
import os

QUIET = {'TPU_ACCELERATOR_TYPE': 'v5litepod-1', 'TPU_WORKER_HOSTNAMES': 'localhost',
         'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}
"""What :func:`quiet` sets where unset: a one-chip host named ``localhost``."""


def on_a_tpu_host() -> bool:
  """Whether this machine has TPU chips (``/dev/accel*`` or ``/dev/vfio/N``)."""
  return bool(glob.glob('/dev/accel[0-9]*') or glob.glob('/dev/vfio/[0-9]*'))


def quiet() -> None:
  """Sets :data:`QUIET`'s variables that are unset, unless this is a TPU host."""
  if on_a_tpu_host():
    return
  for name, value in QUIET.items():
    os.environ.setdefault(name, value)


__all__ = ['QUIET', 'on_a_tpu_host', 'quiet']
