"""What a completely written checkpoint's files were: its manifest.

Once a checkpoint of step ``s`` is completely written, the size and SHA-256
of each of its data files go to ``checkpoint_manifests/<s>.json`` beside
the checkpoint directory (:class:`fedjx.experiments.checkpointing.Checkpointer`);
before the checkpoint is read again its files are compared with it, so a
truncated, deleted or altered file is found before Orbax reads it. Plain
files and ``hashlib``: nothing here imports JAX or Orbax, so the command line
can check a workdir before it starts them (:mod:`fedjx.experiments.preflight`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

# The items of a checkpoint that Orbax does not change after writing them.
HASHED = ('state', 'meta')


def files(step_dir: str) -> dict[str, list[Any]]:
  """``{relative path: [size, sha256]}`` of the data files under ``step_dir``
  (a checkpoint's ``<step>`` folder)."""
  out = {}
  for item in HASHED:
    for d, _, names in os.walk(os.path.join(step_dir, item)):
      for name in names:
        path = os.path.join(d, name)
        digest = hashlib.sha256()
        with open(path, 'rb') as f:
          for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
        out[os.path.relpath(path, step_dir)] = [os.path.getsize(path),
                                                digest.hexdigest()]
  return out


def problem(directory: str, manifests: str, step: int) -> str | None:
  """What is wrong with step ``step``'s files in ``directory`` (the
  checkpoints) according to its manifest in ``manifests``; None when they
  match or there is no manifest."""
  path = os.path.join(manifests, f'{step}.json')
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    written = json.load(f)
  found = files(os.path.join(directory, str(step)))
  for name, (size, digest) in sorted(written.items()):
    if name not in found:
      return f'its file {name} is missing'
    if found[name][0] != size:
      return f'its file {name} has {found[name][0]} bytes, {size} were written'
    if found[name][1] != digest:
      return f'its file {name} differs from what was written (SHA-256)'
  return None
