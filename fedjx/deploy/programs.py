"""Versioned program bytes: an exported computation as it travels to a node.

A node runs ``client_work`` from bytes alone (``jax.export``), so it needs
JAX but not fedjx's algorithms. The bytes carry a small header so that a
node and a server of different versions find out at once, in one line,
instead of failing somewhere inside XLA:

``MAGIC (8 bytes) | header length (4 bytes, big-endian) | header (JSON) | payload``

where the payload is ``jax.export.Exported.serialize()`` and the header is::

  {"format": 1, "fedjx": "0.1.0", "jax": "0.10.2", "piece": "client_work",
   "sha256": "<hex digest of the payload>"}

A node accepts bytes whose ``format`` equals :data:`FORMAT_VERSION` and
whose fedjx version has the node's major and minor version (the batching
and seeding of a node's data are fedjx's, so they must agree with the
server's); :func:`unpack` raises :class:`IncompatibleProgramError`
otherwise. JAX's own serialization version is checked by
``jax.export.deserialize``, whose failure becomes the same one-line error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Any

import jax

import fedjx

__all__ = ['FORMAT_VERSION', 'MAGIC', 'IncompatibleProgramError', 'Program',
           'compatible_versions', 'pack', 'read_header', 'unpack']

MAGIC = b'FEDJXPRG'
FORMAT_VERSION = 1
_LENGTH = struct.Struct('>I')


class IncompatibleProgramError(ValueError):
  """Program bytes this node cannot run (other format or fedjx version)."""


@dataclasses.dataclass(frozen=True)
class Program:
  """Unpacked program bytes: the callable ``exported`` and its ``header``."""

  exported: Any
  header: dict[str, Any]

  @property
  def digest(self) -> str:
    return self.header['sha256']


def _minor(version: str) -> tuple[str, ...]:
  return tuple(str(version).split('.')[:2])


def compatible_versions(theirs: str, ours: str = fedjx.__version__) -> bool:
  """Whether programs of fedjx ``theirs`` run on a node of fedjx ``ours``:
  the same major and minor version."""
  return _minor(theirs) == _minor(ours)


def pack(exported: Any, piece: str) -> bytes:
  """The versioned bytes of a ``jax.export.Exported`` named ``piece``."""
  payload = bytes(exported.serialize())
  header = {'format': FORMAT_VERSION, 'fedjx': fedjx.__version__,
            'jax': jax.__version__, 'piece': str(piece),
            'sha256': hashlib.sha256(payload).hexdigest()}
  text = json.dumps(header, sort_keys=True).encode()
  return MAGIC + _LENGTH.pack(len(text)) + text + payload


def read_header(data: bytes) -> tuple[dict[str, Any], bytes]:
  """``(header, payload)`` of program bytes, checking only their framing."""
  data = bytes(data)
  if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
    raise IncompatibleProgramError(
        f'fedjx.deploy: the {len(data)} bytes received are not a fedjx program '
        f'(they do not start with {MAGIC!r}); the server must send '
        'fedjx.deploy.programs.pack bytes.')
  (length,) = _LENGTH.unpack_from(data, len(MAGIC))
  start = len(MAGIC) + _LENGTH.size
  try:
    header = json.loads(data[start:start + length])
  except ValueError:
    header = None
  if not isinstance(header, dict):
    raise IncompatibleProgramError(
        'fedjx.deploy: the program header is not a JSON object; the bytes '
        'are damaged or not fedjx program bytes.')
  return header, data[start + length:]


def unpack(data: bytes, *, fedjx_version: str = fedjx.__version__) -> Program:
  """Checks the header of program bytes and deserializes their payload.

  Args:
    data: bytes from :func:`pack`.
    fedjx_version: the version of fedjx this node runs (for tests).

  Raises:
    IncompatibleProgramError: (one line) another format version, a fedjx
      version of another major.minor, a payload whose digest differs from
      the header's, or a payload ``jax.export`` of this node cannot read.
  """
  header, payload = read_header(data)
  fmt, theirs = header.get('format'), str(header.get('fedjx'))
  if fmt != FORMAT_VERSION:
    raise IncompatibleProgramError(
        f'fedjx.deploy: program format {fmt!r} from fedjx {theirs}; this node '
        f'(fedjx {fedjx_version}) reads format {FORMAT_VERSION} only: install '
        f'fedjx {theirs} on the node or run the server with fedjx {fedjx_version}.')
  if not compatible_versions(theirs, fedjx_version):
    raise IncompatibleProgramError(
        f'fedjx.deploy: program of fedjx {theirs}; this node runs fedjx '
        f'{fedjx_version} and accepts {".".join(_minor(fedjx_version))}.x only: '
        f'install fedjx {theirs} on the node or run the server with fedjx '
        f'{fedjx_version}.')
  digest = hashlib.sha256(payload).hexdigest()
  if digest != header.get('sha256'):
    raise IncompatibleProgramError(
        f'fedjx.deploy: program payload has sha256 {digest[:12]}..., its header '
        f'says {str(header.get("sha256"))[:12]}...; the bytes were damaged in '
        'transit.')
  try:
    exported = jax.export.deserialize(bytearray(payload))
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise IncompatibleProgramError(
        f'fedjx.deploy: jax {jax.__version__} on this node cannot read the '
        f'program exported with jax {header.get("jax")}: {first}') from None
  return Program(exported, header)
