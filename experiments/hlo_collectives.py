"""The collectives of a compiled program: the mesh axes they span, and bytes per device.

:func:`collectives` reads the HLO text of a compiled SPMD program. Within a
slice, each collective's device groups (``replica_groups`` in any of XLA's
forms, or ``source_target_pairs``; partition ids are positions in the
slice's part of the mesh, row-major) span the mesh axes along which their
coordinates differ (:func:`fedjx.experiments.lm_cost.collective_axes` reads
them the same way). Between the slices of a multi-slice TPU program, libtpu
sends each chip's buffer to its runtime for the data-centre network (a
``send`` whose ``_xla_megascale_transfer_type`` names the collective):
those cross slices, along the mesh axes the slices lie on.

The bytes each device sends, for a group of ``n``: an all-reduce (a ring:
reduce-scatter, then all-gather) ``2 (n - 1) / n`` times its buffer; an
all-gather and an all-to-all ``(n - 1) / n`` of the gathered buffer; a
reduce-scatter ``n - 1`` times the scattered shard; a collective permute
its buffer. A collective the compiler splits over several fused
computations under one channel is counted once per channel and shape; one
inside a loop once per loop body (the caller multiplies by trips).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from fedjx.experiments import lm_cost

_ELEMENT_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2,
                  'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8,
                  'f64': 8, 'c64': 8, 'c128': 16}
_OPS = '|'.join(re.escape(c) for c in lm_cost.COLLECTIVES)
_INSTRUCTION = re.compile(rf'=\s*(.*?)\s({_OPS})(-start)?\(')


def _array_bytes(types: str) -> list[float]:
  """The bytes of each array in an HLO type (an array or a tuple of them)."""
  out = []
  for dtype, dims in re.findall(r'\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]', types):
    size = _ELEMENT_BYTES.get(dtype, 1 if dtype.startswith('f8') else None)
    if size is not None:
      out.append(size * float(np.prod([int(d) for d in dims.split(',') if d] or [1])))
  return out


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program (bytes per chip)."""

  op: str
  axes: tuple[str, ...]
  across_slices: bool
  group_size: int
  buffer_bytes: float
  wire_bytes: float


def _wire(op: str, start: bool, arrays: list[float], n: int) -> tuple[float, float]:
  """``(buffer, bytes sent per chip)`` of one collective over groups of ``n``."""
  if not arrays or n <= 1:
    return (sum(arrays), 0.0)
  if op == 'all-reduce':
    buffer = sum(arrays)
    return buffer, 2 * (n - 1) / n * buffer
  if op == 'collective-permute':
    buffer = arrays[0] if start else sum(arrays)
    return buffer, buffer
  if op == 'reduce-scatter':
    buffer = sum(arrays)
    return buffer, (n - 1) * buffer
  buffer = max(arrays) if start else sum(arrays)  # all-gather, all-to-all
  return buffer, (n - 1) / n * buffer


_MEGASCALE_OPS = {'ALL_REDUCE': 'all-reduce', 'ALL_GATHER': 'all-gather',
                  'REDUCE_SCATTER': 'reduce-scatter', 'ALL_TO_ALL': 'all-to-all',
                  'ONE_TO_ONE': 'collective-permute'}
"""libtpu's transfers between slices, as the collective each is."""
_MEGASCALE = re.compile(r'=\s*(.*?)\ssend\(.*_xla_megascale_transfer_type="(\w+)"')


def collectives(hlo: str, mesh: jax.sharding.Mesh) -> list[Collective]:
  """The collectives of compiled HLO text on ``mesh``, each channel and shape once.

  Within a slice, a collective's device groups are partition ids of the
  slice's program (positions in the slice's part of ``mesh``, row-major; the
  whole mesh for one slice); ``axes`` are the mesh axes they span (as
  :func:`fedjx.experiments.lm_cost.collective_axes` reads them). Across
  slices, libtpu's program sends the buffer to its peers in the other slices
  (a ``send`` to ``xla_megascale_runtime``, whose transfer type is the
  collective): ``across_slices`` is True and ``axes`` are the mesh axes the
  slices lie along. The bytes are per chip (module docstring).
  """
  slices = np.vectorize(lambda d: getattr(d, 'slice_index', 0) or 0)(mesh.devices)
  num_slices = len(np.unique(slices))
  between = tuple(mesh.axis_names[a] for a in range(slices.ndim)
                  if np.any(np.diff(slices, axis=a)))
  shape = tuple(mesh.devices.shape)
  if num_slices > 1:  # One slice's part: the first 1/S of the axes that cross slices.
    shape = tuple(n // num_slices if name in between[:1] else n
                  for name, n in zip(mesh.axis_names, shape))
  seen, out = set(), []
  for line in hlo.splitlines():
    dcn = _MEGASCALE.search(line)
    if dcn is not None:
      types, op = dcn.group(1), _MEGASCALE_OPS.get(dcn.group(2), dcn.group(2).lower())
      rendezvous = re.search(r'_xla_host_transfer_rendezvous="([^"]+)"', line)
      key = (rendezvous.group(1) if rendezvous else line, 'dcn')
      if key not in seen:
        seen.add(key)
        arrays = _array_bytes(types)[:1]  # (buffer, u32[], token[])
        buffer, wire = _wire(op, False, arrays, num_slices)
        out.append(Collective(op, between, True, num_slices, buffer, wire))
      continue
    match = _INSTRUCTION.search(line)
    if match is None:
      continue
    types, op, start = match.group(1), match.group(2), bool(match.group(3))
    channel = re.search(r'channel_id=(\d+)', line)
    key = (channel.group(1) if channel else line, op,
           re.sub(r'\{[^}]*\}', '', types))  # The shapes, without layouts.
    if key in seen:
      continue
    seen.add(key)
    groups = lm_cost._groups(line, int(np.prod(shape)))  # pylint: disable=protected-access
    axes, n = set(), 1
    for group in groups:
      coords = np.array([np.unravel_index(i, shape) for i in group])
      axes |= {mesh.axis_names[a] for a in range(len(shape))
               if len(set(coords[:, a].tolist())) > 1}
      n = max(n, len(group))
    buffer, wire = _wire(op, start, _array_bytes(types), n)
    out.append(Collective(op, tuple(a for a in mesh.axis_names if a in axes), False, n,
                          buffer, wire))
  return out


def axes_key(c: Collective) -> str:
  """``'fsdp'``, ``'fsdp+tensor'``, ``'dcn:clients'`` (across slices): where ``c`` travels."""
  return ('dcn:' if c.across_slices else '') + ('+'.join(c.axes) or 'none')


def ops_by_axes(found: list[Collective] | tuple[Collective, ...]) -> dict[str, dict[str, int]]:
  """How many of each collective travel each :func:`axes_key` (instructions, not executions)."""
  out: dict[str, dict[str, int]] = {}
  for c in found:
    ops = out.setdefault(axes_key(c), {})
    ops[c.op] = ops.get(c.op, 0) + 1
  return out


def wire_bytes_by_axes(found: list[Collective]) -> dict[str, float]:
  """Bytes per chip by ``'axis+axis'`` (``'dcn:'`` prefixed where slices are crossed)."""
  out: dict[str, float] = {}
  for c in found:
    if c.wire_bytes:
      out[axes_key(c)] = out.get(axes_key(c), 0.0) + c.wire_bytes
  return out


__all__ = ['Collective', 'axes_key', 'collectives', 'ops_by_axes', 'wire_bytes_by_axes']
