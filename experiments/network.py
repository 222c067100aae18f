"""The wire as a clock: simulated step time and compute utilization of a reduction.

A model of how long the replicas of a run wait for the network, for
data-parallel training, DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and
Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), in closed form.

**Links.** A :class:`Link` has a bandwidth ``B`` (bits/s) and a latency
``alpha`` (s); sending ``S`` bytes over it once takes ``alpha + 8 S / B``
(the alpha-beta model of Hockney 1994).

**Reductions** of ``S`` bytes across ``n`` replicas (:class:`Network`), after
Thakur, Rabenseifner and Gropp 2005 ("Optimization of collective
communication operations in MPICH") and Patarasuk and Yuan 2009
("Bandwidth optimal all-reduce algorithms for clusters of workstations"):

* ``'ring'``: a reduce-scatter then an all-gather, ``2 (n - 1)`` steps of
  ``S / n`` bytes each: ``2 (n - 1) / n * 8 S / B + 2 (n - 1) alpha``;
* ``'tree'``: a binomial-tree reduce then a broadcast, ``2 ceil(log2 n)``
  hops each carrying all ``S`` bytes: ``2 ceil(log2 n) (alpha + 8 S / B)``;
* ``'parameter_server'`` (Li et al. 2014, "Scaling distributed machine
  learning with the parameter server"): every replica pushes ``S`` bytes to
  one server, which then sends ``S`` bytes back to each; the server's link
  carries ``n S`` bytes each way, one after the other:
  ``2 (alpha + 8 n S / B)``;
* ``'hierarchical'`` (as in Jia et al. 2018, arXiv 1807.11205): inside
  each group of ``g`` replicas a reduce to one leader on the fast link
  (``fast_link``), a ring all-reduce of ``S`` across the ``n / g`` leaders
  on the slow link (``link``), then a broadcast back inside each group:
  ``ring(g, S, fast_link) + ring(n / g, S, link)``. The reduce and the
  broadcast together are charged one ring all-reduce, the bandwidth lower
  bound of any all-reduce (Patarasuk and Yuan 2009), which a reduce and a
  broadcast pipelined along the group (``8 S / B`` each) approach within a
  factor ``g / (g - 1)``; the cross-group ring carries the whole ``S`` (one
  member per group takes part), an upper bound on schemes that split it
  over the ``g`` members.

With ``n = 1`` there is nothing to reduce and every topology takes 0 s.

**Compute** (:class:`Compute`): an inner step of ``F`` FLOPs on one replica
whose devices have a combined peak of ``R`` FLOP/s at model FLOPs
utilization ``u`` takes ``T = F / (u R)``; a dense transformer of ``N``
parameters trained on ``D`` tokens per step per replica takes
``F = 6 N D`` (Kaplan et al. 2020, arXiv 2001.08361, Section 2.1).

**Schedules** (:class:`Schedule`), for a round of ``H`` inner steps
(``t(S)`` is the reduction time above, ``S`` the bytes of the gradient or
outer gradient of the whole model):

* data-parallel: ``H = 1``; the gradient's reduction may overlap a fraction
  ``o`` of the step's compute (``o = 2/3`` is the backward pass's share of
  ``6 N``): exposed ``max(0, t(S) - o T)`` per step;
* DiLoCo: one reduction of the outer gradient every ``H`` steps, which may
  overlap a fraction ``o`` of the round's last step (its backward pass, as
  in the simulation of Douillard et al. 2025): exposed ``max(0, t(S) - o T)``
  per round (``o = 0`` blocks; ``H = 1`` is data-parallel with the same
  ``o``);
* either, with ``L`` layers (``layers``): the overlapped part of the step is
  ``L`` equal pieces, after each of which that layer's ``S / L`` bytes are
  reduced, one layer's reduction after the other on the link, and the next
  step waits for the last: exposed
  ``max(t(S / L), L t(S / L) - o T (1 - 1 / L))`` (the last layer's
  reduction is never hidden; ``L = 1`` hides nothing, and without latency
  ``L -> inf`` is the formula above);
* Streaming DiLoCo: the model in ``P`` fragments, each reduced once per
  round, one every ``H / P`` steps, and each overlapping ``tau`` inner steps
  of compute. The part of a fragment's transfer ``t(S / P)`` that fits in
  ``tau T`` is hidden; the link also has to carry all ``P`` fragments within
  the round, so exposed per round is
  ``max(P max(0, t(S / P) - tau T), P t(S / P) - H T, 0)``, the steady
  state of a timeline in which one link carries the fragments one after
  the other (the first term binds when ``tau <= H / P``, the second when the
  link is the bottleneck).
* DiLoCo with a 1-outer-step overlap (the delayed and eager outer updates
  of Kale et al. 2025, :mod:`fedjx.algorithms.eager_diloco_lib`): the
  outer gradient's reduction runs during the next round's ``H`` steps,
  Streaming DiLoCo's schedule with ``P = 1`` and ``tau = H``: exposed
  ``max(0, t(S) - H T)`` per round.

**Compute utilization** is ``H T / (H T + exposed)``; the simulated
wall-clock of a round is ``H T + exposed`` and of an inner step that over
``H`` (:class:`Timing`). :func:`required_bandwidth` takes the smallest
bandwidth of a grid that reaches each utilization target, the method of
Charles et al. 2025 (arXiv 2503.09799, Table 6), which follows the
simulation of Douillard et al. 2025; docs/reproductions.md compares the two.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Iterable, Sequence

TOPOLOGIES = ('ring', 'tree', 'parameter_server', 'hierarchical')
"""The reductions :class:`Network` models."""

SCHEDULES = ('data_parallel', 'diloco', 'streaming_diloco')
"""The synchronization schedules :class:`Schedule` models."""

GBIT = 1e9
"""Bits in a gigabit (network rates are decimal)."""


def _positive(where: str, arg: str, value, allow_inf: bool = False) -> float:
  try:
    x = float(value)
  except (TypeError, ValueError):
    x = math.nan
  if isinstance(value, bool) or not x > 0 or (math.isinf(x) and not allow_inf):
    allowed = 'a positive number (math.inf allowed)' if allow_inf else 'a positive finite number'
    raise ValueError(f'{where}: {arg}={value!r} must be {allowed}.')
  return x


def _non_negative(where: str, arg: str, value) -> float:
  try:
    x = float(value)
  except (TypeError, ValueError):
    x = math.nan
  if isinstance(value, bool) or not 0 <= x < math.inf:
    raise ValueError(f'{where}: {arg}={value!r} must be a finite number >= 0.')
  return x


def _count(where: str, arg: str, value, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise ValueError(f'{where}: {arg}={value!r} must be an integer >= {low}.')
  return int(value)


@dataclasses.dataclass(frozen=True)
class Link:
  """One link: ``bandwidth_bps`` bits/s (``math.inf`` allowed), ``latency_s`` seconds per message."""

  bandwidth_bps: float
  latency_s: float = 0.0

  def __post_init__(self):
    _positive('Link', 'bandwidth_bps', self.bandwidth_bps, allow_inf=True)
    _non_negative('Link', 'latency_s', self.latency_s)

  @classmethod
  def gbps(cls, bandwidth_gbps: float, latency_s: float = 0.0) -> Link:
    """A link of ``bandwidth_gbps`` Gbit/s."""
    _positive('Link.gbps', 'bandwidth_gbps', bandwidth_gbps, allow_inf=True)
    return cls(float(bandwidth_gbps) * GBIT, latency_s)

  def send_seconds(self, nbytes: float) -> float:
    """``latency_s + 8 nbytes / bandwidth_bps``: one message of ``nbytes`` bytes."""
    return self.latency_s + 8.0 * nbytes / self.bandwidth_bps


def _ring(n: int, nbytes: float, link: Link) -> float:
  if n == 1:
    return 0.0
  return 2.0 * (n - 1) / n * 8.0 * nbytes / link.bandwidth_bps + 2.0 * (n - 1) * link.latency_s


@dataclasses.dataclass(frozen=True)
class Network:
  """The reduction across replicas (the module docstring has the formulas).

  Attributes:
    link: the link between replicas (for ``'hierarchical'``, between groups).
    topology: one of :data:`TOPOLOGIES`.
    fast_link: ``'hierarchical'`` only: the link inside a group.
    group_size: ``'hierarchical'`` only: ``g`` replicas per group.
  """

  link: Link
  topology: str = 'ring'
  fast_link: Link | None = None
  group_size: int | None = None

  def __post_init__(self):
    if not isinstance(self.link, Link):
      raise ValueError(f'Network: link={self.link!r} must be a Link.')
    if self.topology not in TOPOLOGIES:
      raise ValueError(f'Network: topology={self.topology!r} is not one of '
                       f'{", ".join(map(repr, TOPOLOGIES))}.')
    if self.topology == 'hierarchical':
      if not isinstance(self.fast_link, Link):
        raise ValueError(f"Network: fast_link={self.fast_link!r} must be a Link with "
                         f"topology='hierarchical'.")
      _count('Network', 'group_size', self.group_size)
    elif self.fast_link is not None or self.group_size is not None:
      raise ValueError(f'Network: fast_link={self.fast_link!r} and group_size='
                       f"{self.group_size!r} apply only to topology='hierarchical' "
                       f'(got {self.topology!r}); leave them None.')

  def allreduce_seconds(self, nbytes: float, replicas: int) -> float:
    """Seconds to all-reduce ``nbytes`` bytes across ``replicas`` replicas."""
    nbytes = _non_negative('Network.allreduce_seconds', 'nbytes', nbytes)
    n = _count('Network.allreduce_seconds', 'replicas', replicas)
    if n == 1:
      return 0.0
    if self.topology == 'ring':
      return _ring(n, nbytes, self.link)
    if self.topology == 'tree':
      return 2.0 * math.ceil(math.log2(n)) * self.link.send_seconds(nbytes)
    if self.topology == 'parameter_server':
      return 2.0 * self.link.send_seconds(n * nbytes)
    g = self.group_size
    if n % g:
      raise ValueError(f'Network.allreduce_seconds: replicas={n} is not a multiple of '
                       f'group_size={g}; allowed: a multiple of {g}.')
    return _ring(g, nbytes, self.fast_link) + _ring(n // g, nbytes, self.link)


@dataclasses.dataclass(frozen=True)
class Compute:
  """One inner step on one replica: ``flops_per_step`` FLOPs at ``mfu`` of ``peak_flops`` FLOP/s.

  ``peak_flops`` is the combined peak of the replica's devices.
  """

  flops_per_step: float
  peak_flops: float
  mfu: float = 1.0

  def __post_init__(self):
    _positive('Compute', 'flops_per_step', self.flops_per_step)
    _positive('Compute', 'peak_flops', self.peak_flops)
    if isinstance(self.mfu, bool) or not isinstance(self.mfu, (int, float)) or not 0 < self.mfu <= 1:
      raise ValueError(f'Compute: mfu={self.mfu!r} must be a number in (0, 1].')

  @classmethod
  def dense_transformer(cls, params: float, tokens_per_step: float, peak_flops: float,
                        mfu: float = 1.0) -> Compute:
    """``6 params tokens_per_step`` FLOPs per step (Kaplan et al. 2020)."""
    _positive('Compute.dense_transformer', 'params', params)
    _positive('Compute.dense_transformer', 'tokens_per_step', tokens_per_step)
    return cls(6.0 * float(params) * float(tokens_per_step), peak_flops, mfu)

  @classmethod
  def from_step_seconds(cls, step_seconds: float) -> Compute:
    """A step that takes ``step_seconds`` (``step_seconds`` FLOPs at 1 FLOP/s)."""
    return cls(_positive('Compute.from_step_seconds', 'step_seconds', step_seconds), 1.0)

  @property
  def step_seconds(self) -> float:
    """``flops_per_step / (mfu peak_flops)``."""
    return self.flops_per_step / (self.mfu * self.peak_flops)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When the replicas reduce (the module docstring has the exposure of each).

  Attributes:
    kind: one of :data:`SCHEDULES`.
    inner_steps: ``H``, inner steps per round (1 for ``'data_parallel'``).
    fragments: ``P``, fragments of the model (``'streaming_diloco'``; else 1).
    overlap_steps: ``tau``, inner steps a fragment's transfer overlaps
      (``'streaming_diloco'``; else 0).
    overlap_fraction: ``o``, the fraction of a step's compute the reduction
      of the gradient (``'data_parallel'``) or of the outer gradient
      (``'diloco'``, the round's last step) overlaps; 0 for
      ``'streaming_diloco'``.
    layers: ``L``, the layers whose reductions follow one another within the
      overlap (``'data_parallel'``, ``'diloco'``); None: infinitely many.
  """

  kind: str
  inner_steps: int = 1
  fragments: int = 1
  overlap_steps: float = 0
  overlap_fraction: float = 0.0
  layers: int | None = None

  def __post_init__(self):
    if self.kind not in SCHEDULES:
      raise ValueError(f'Schedule: kind={self.kind!r} is not one of '
                       f'{", ".join(map(repr, SCHEDULES))}.')
    h = _count('Schedule', 'inner_steps', self.inner_steps)
    p = _count('Schedule', 'fragments', self.fragments)
    tau = _non_negative('Schedule', 'overlap_steps', self.overlap_steps)
    o = _non_negative('Schedule', 'overlap_fraction', self.overlap_fraction)
    if self.kind == 'data_parallel' and h != 1:
      raise ValueError(f"Schedule: inner_steps={h} must be 1 for kind='data_parallel' "
                       f"(use kind='diloco' for H > 1).")
    if o > 1:
      raise ValueError(f'Schedule: overlap_fraction={o!r} must be in [0, 1].')
    if self.kind == 'streaming_diloco' and o:
      raise ValueError(f"Schedule: overlap_fraction={o!r} applies only to kind="
                       f"'data_parallel' or 'diloco' (got {self.kind!r}); leave it 0 "
                       f'(overlap_steps sets the overlap of a fragment).')
    if self.kind != 'streaming_diloco' and (p != 1 or tau):
      raise ValueError(f'Schedule: fragments={p} and overlap_steps={self.overlap_steps!r} '
                       f"apply only to kind='streaming_diloco' (got {self.kind!r}); "
                       f'leave them 1 and 0.')
    if self.layers is not None:
      _count('Schedule', 'layers', self.layers)
      if self.kind == 'streaming_diloco':
        raise ValueError(f"Schedule: layers={self.layers!r} applies only to kind="
                         f"'data_parallel' or 'diloco' (got {self.kind!r}); leave it None.")
    if p > h:
      raise ValueError(f'Schedule: fragments={p} must be <= inner_steps={h} '
                       f'(one fragment every H / P >= 1 steps).')
    # One fragment may overlap the whole next round (tau = H): the transfer
    # lands as the next one starts (the 1-outer-step overlap of eager
    # updates, Kale et al. 2025).
    if tau and not (tau < h or (p == 1 and tau == h)):
      raise ValueError(f'Schedule: overlap_steps={self.overlap_steps!r} must be < '
                       f'inner_steps={h} (or equal to it with fragments=1).')

  @classmethod
  def data_parallel(cls, overlap_fraction: float = 0.0, layers: int | None = None) -> Schedule:
    """A reduction of the gradient every step, overlapping ``overlap_fraction`` of it."""
    return cls('data_parallel', overlap_fraction=overlap_fraction, layers=layers)

  @classmethod
  def diloco(cls, inner_steps: int, overlap_fraction: float = 0.0,
             layers: int | None = None) -> Schedule:
    """A reduction of the outer gradient every ``inner_steps`` steps, overlapping
    ``overlap_fraction`` of the round's last step (0: blocking)."""
    return cls('diloco', inner_steps=inner_steps, overlap_fraction=overlap_fraction,
               layers=layers)

  @classmethod
  def streaming_diloco(cls, inner_steps: int, fragments: int, overlap_steps: float) -> Schedule:
    """``fragments`` fragments, each reduced every ``inner_steps`` steps, overlapping ``overlap_steps``."""
    return cls('streaming_diloco', inner_steps=inner_steps, fragments=fragments,
               overlap_steps=overlap_steps)


@dataclasses.dataclass(frozen=True)
class Timing:
  """The simulated clock of one round of ``inner_steps`` steps (seconds).

  Attributes:
    inner_steps: ``H``.
    compute_seconds: ``H T``.
    communication_seconds: all transfer time in the round, hidden or not.
    exposed_seconds: the part of it that compute does not hide.
  """

  inner_steps: int
  compute_seconds: float
  communication_seconds: float
  exposed_seconds: float

  @property
  def round_seconds(self) -> float:
    """Wall-clock of a round: ``compute + exposed``."""
    return self.compute_seconds + self.exposed_seconds

  @property
  def step_seconds(self) -> float:
    """Wall-clock per inner step, averaged over the round."""
    return self.round_seconds / self.inner_steps

  @property
  def utilization(self) -> float:
    """``compute / (compute + exposed)``."""
    return self.compute_seconds / self.round_seconds


def simulate(schedule: Schedule, compute: Compute, network: Network, payload_bytes: float,
             replicas: int) -> Timing:
  """The clock of one round of ``schedule``.

  Args:
    schedule: when the replicas reduce.
    compute: one inner step on one replica.
    network: the reduction.
    payload_bytes: bytes of the gradient (or outer gradient) of the whole model.
    replicas: ``n``, the replicas taking part in the reduction.
  """
  for arg, value, kind in (('schedule', schedule, Schedule), ('compute', compute, Compute),
                           ('network', network, Network)):
    if not isinstance(value, kind):
      raise ValueError(f'simulate: {arg}={value!r} must be a {kind.__name__}.')
  payload_bytes = _non_negative('simulate', 'payload_bytes', payload_bytes)
  replicas = _count('simulate', 'replicas', replicas)
  step = compute.step_seconds
  h = schedule.inner_steps
  if schedule.kind == 'streaming_diloco':
    p, tau = schedule.fragments, float(schedule.overlap_steps)
    fragment = network.allreduce_seconds(payload_bytes / p, replicas)
    exposed = max(p * max(0.0, fragment - tau * step), p * fragment - h * step, 0.0)
    return Timing(h, h * step, p * fragment, exposed)
  hidden = float(schedule.overlap_fraction) * step
  if schedule.layers is None:
    full = network.allreduce_seconds(payload_bytes, replicas)
    return Timing(h, h * step, full, max(0.0, full - hidden))
  layers = schedule.layers
  layer = network.allreduce_seconds(payload_bytes / layers, replicas)
  exposed = max(layer, layers * layer - hidden * (1.0 - 1.0 / layers))
  return Timing(h, h * step, layers * layer, exposed)


def from_flags(flags: Any) -> tuple[Schedule, Network] | None:
  """``(schedule, network)`` of ``fedjx-plan``'s communication flags, or None without a schedule.

  ``flags`` has ``schedule`` (None: nothing to simulate), ``bandwidth_gbps``,
  ``latency_ms``, ``topology`` (the all-reduce), ``inner_steps``,
  ``fragments``, ``overlap_steps``, ``overlap_fraction`` and ``layers``
  (``config.network`` gives the same, :mod:`fedjx.experiments.network_clock`).
  ValueError (one line) if they are bad.
  """
  if flags.schedule is None:
    return None
  if flags.bandwidth_gbps is None:
    raise ValueError('--schedule needs --bandwidth_gbps (Gbit/s of the link between replicas).')
  schedule = Schedule(flags.schedule, inner_steps=flags.inner_steps, fragments=flags.fragments,
                      overlap_steps=flags.overlap_steps,
                      overlap_fraction=flags.overlap_fraction, layers=flags.layers)
  link = Link.gbps(flags.bandwidth_gbps, flags.latency_ms / 1e3)
  return schedule, Network(link, flags.topology)


def required_bandwidth(
    schedule: Schedule, compute: Compute, payload_bytes: float,
    bandwidths_gbps: Sequence[float], targets: Iterable[float] = (0.5, 0.8, 0.9, 0.95, 0.99),
    *, replicas: int = 2, topology: str = 'ring',
    latency_s: float = 0.0) -> dict[float, float | None]:
  """The smallest bandwidth of a grid at which ``schedule`` reaches each utilization.

  The round is :func:`simulate`'s, its payload reduced over ``topology``
  between ``replicas`` replicas by links of each bandwidth of the grid and
  ``latency_s``. As in Charles et al. 2025, Table 6, the answer for a target
  is a point of the grid: the smallest whose utilization is at least the
  target (utilization does not decrease with bandwidth, so every larger
  point reaches it too).

  Args:
    schedule: when the replicas reduce.
    compute: one inner step on one replica (e.g.
      :meth:`Compute.dense_transformer`, :meth:`Compute.from_step_seconds`).
    payload_bytes: bytes of the gradient (or outer gradient) of the whole
      model, e.g. parameters times 2 for bfloat16.
    bandwidths_gbps: the grid (Gbit/s), in any order.
    targets: utilizations in (0, 1].
    replicas, topology, latency_s: as named (``'hierarchical'`` needs more
      than one link: use :func:`simulate`).

  Returns:
    ``{target: Gbit/s}``, ``None`` for a target no bandwidth of the grid reaches.
  """
  grid = sorted(_positive('required_bandwidth', 'bandwidths_gbps', b, allow_inf=True)
                for b in bandwidths_gbps)
  if not grid:
    raise ValueError('required_bandwidth: bandwidths_gbps=[] must hold at least one bandwidth.')
  targets = list(targets)
  for t in targets:
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 < t <= 1:
      raise ValueError(f'required_bandwidth: targets holds {t!r}; each must be in (0, 1].')
  if topology == 'hierarchical':
    raise ValueError("required_bandwidth: topology='hierarchical' needs a fast link and a "
                     "group size; allowed here: 'ring', 'tree', 'parameter_server'.")
  utilization = [simulate(schedule, compute, Network(Link.gbps(b, latency_s), topology),
                          payload_bytes, replicas).utilization for b in grid]
  return {t: next((b for b, u in zip(grid, utilization) if u >= t), None) for t in targets}
