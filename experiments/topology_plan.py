"""A TPU pod planned with the TPU compiler itself, on any machine.

:func:`plan_pod` compiles the programs of a language-model round, one inner
step of every replica and the outer step, for a named TPU topology (a slice
such as ``v5e:16x16``, or several slices joined by the data-centre network)
with libtpu's compiler (``jax.experimental.topologies``: compile-only
devices, so no TPU is needed; ``pip install -e '.[tpu]'`` brings libtpu),
and reads what the compiler knows:

* **HBM per chip** from the memory analysis of the compiled inner step
  (arguments + outputs - aliased + temporaries), plus what a chip holds
  through the round besides: the server model and outer momentum
  (:func:`fedjx.experiments.lm_cost.outer_step_program`'s ``theta`` and
  ``b``), laid out as the replicas are. The round's peak is the larger of
  the inner step's peak plus those, and the outer step's peak plus the inner
  optimizer states. It fits when that is at most the chip's HBM
  (:data:`CHIPS`).
* **FLOPs and HBM bytes per inner step** from the compiled cost analysis.
  XLA counts the body of a loop once, not once per trip, so the scanned
  layers' figures miss ``L - 1`` layers: as
  :func:`fedjx.experiments.lm_cost.plan_inner_step` does, the step is also
  compiled unscanned at ``L = 1`` and ``L = 2`` and every per-step figure
  ``c`` (FLOPs, bytes, wire bytes) is taken as ``a + b L`` with ``b = c(2) -
  c(1)`` and ``a = c(1) - b``. The analytic ``6 N_matmul + 12 L H h T`` per
  token (:func:`fedjx.models.llama_config.train_flops_per_token`) is
  reported beside it.
* **The collectives on each mesh axis**, read from the compiled HLO
  (:func:`fedjx.experiments.hlo_collectives.collectives`): which of ``('clients', 'fsdp', 'tensor')`` each
  collective's device groups span (:func:`fedjx.experiments.lm_cost.collective_axes`'s
  reading of the replica groups, within a slice), the ones that cross the
  data-centre network (libtpu's sends to its runtime between slices, each
  the collective its transfer type names), and the bytes each chip sends: ``2 (n - 1) / n`` times the buffer for an all-reduce of ``n``
  chips (a ring: reduce-scatter then all-gather), ``(n - 1) / n`` times the
  gathered buffer for an all-gather and an all-to-all, ``n - 1`` times the
  scattered shard for a reduce-scatter, the buffer for a collective permute.
  A collective the compiler splits over several fused computations under
  one channel is counted once per channel and shape.
* **A step time**: from the compiled step's times per chip, ``compute_s =
  FLOPs / peak`` (the FLOPs: XLA's, or the analytic count where that is
  larger, as for a custom kernel XLA's cost analysis does not see into),
  ``hbm_s = HBM bytes / HBM bandwidth``, and the wire bytes within a slice
  over the ICI bandwidth and across slices over the DCN bandwidth. The raw
  step is their roofline, the largest; the chip's calibration
  (:func:`calibration`, kept as data in ``tpu_calibration.json``) replaces
  the chip's own part by ``f max(compute_s, hbm_s)``, one factor ``f`` per
  chip fitted to several steps measured on one chip against the plans of
  the same programs for its 1-chip topology (:func:`fit_calibration`: least
  squares in relative error), the step then being the larger of that and
  its ICI and DCN times. A round of ``H`` inner steps takes ``H`` steps
  plus the outer step, whose communication is not overlapped with compute.

The mesh: ``M`` replicas on ``'clients'``, each over ``F x T`` chips on
``'fsdp'`` and ``'tensor'`` (:func:`pod_mesh`, ``jax.experimental.mesh_utils``'s
layout on the torus; with ``S`` slices the ``M`` replicas are ``M / S`` per
slice, so only ``'clients'`` crosses slices, as DiLoCo wants: Douillard et
al. 2023, arXiv 2311.08105). Where ``M`` exceeds the ``chips / (F T)``
slots of ``'clients'`` (``M = 4`` replicas on one chip, say), each slot
trains ``k = M / slots`` replicas one after another, as ``fedjx-run``
streams a cohort through a device: a chip then holds the ``k`` replicas'
optimizer states and the running sum of their models besides one
replica's working set, and a round takes ``k H`` inner steps.

Where those states do not fit, they can live on the host
(``replica_states='store'``, ``config.client_state.placement='store'``:
``fedjx-run`` keeps them in a ``fedjx.ClientStore`` and streams the
replicas through the chip, :mod:`fedjx.streaming`). A chip then holds the
server state, one replica's step, the next replica's optimizer state
arriving and the previous one's leaving while it trains, and the
compensated running sum of the models (two model shards); the outer step
holds no replica state. Each replica's new state goes to the host while
the next replica trains (``fedjx.streaming``): with ``c`` the state's bytes
over the chip's measured host bandwidth (the calibration's
``host_bytes_per_s``; not counted where none was measured) and ``t`` one
replica's steps, the round adds ``c + (k - 1) max(0, c - t)``: the last
replica's copy, and whatever of each other copy its successor's steps do
not hide.

The ``'auto'`` settings of the model (attention kernel, remat policy, loss
chunks: :func:`fedjx.models.llama.step_plan`) are resolved for the TPU
chip, not for the machine that plans: on one chip the chip's attention
kernel (XLA's on several: :func:`for_chip`), and a remat policy for the
HBM the round's state leaves a chip.

``algorithm='fedavg'`` plans FedAvg (McMahan et al. 2017, arXiv
1602.05629) on the same layout: plain SGD inner steps and an outer SGD step
of learning rate 1 without momentum.

libtpu reads its host's TPU settings from the environment when it loads; on
a machine without a TPU, :func:`compile_only_devices` first sets the ones it
would otherwise warn about (:func:`fedjx.experiments.tpu_env.quiet`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.experimental import topologies

from fedjx.experiments import lm_cost
from fedjx.experiments import tpu_env
from fedjx.experiments.hlo_collectives import Collective
from fedjx.experiments.hlo_collectives import collectives
from fedjx.experiments.hlo_collectives import ops_by_axes
from fedjx.experiments.hlo_collectives import wire_bytes_by_axes
from fedjx.models import llama
from fedjx.models import llama_config

GIB = 2 ** 30

AXES = ('clients', 'fsdp', 'tensor')


@dataclasses.dataclass(frozen=True)
class Chip:
  """What the plan needs to know of a TPU chip (per chip; bytes and seconds).

  Attributes:
    name: ``'v5e'`` or ``'v5p'``, as topology names spell it.
    device_kind: what ``jax.Device.device_kind`` says of it.
    hbm_bytes: the HBM a program may use.
    peak_flops: dense bfloat16 FLOP/s.
    hbm_bytes_per_s: HBM bandwidth.
    ici_bytes_per_s: inter-chip interconnect bandwidth a chip sends at.
    dcn_bytes_per_s: its share of the data-centre network between slices.
  """

  name: str
  device_kind: str
  hbm_bytes: float
  peak_flops: float
  hbm_bytes_per_s: float
  ici_bytes_per_s: float
  dcn_bytes_per_s: float


CHIPS: dict[str, Chip] = {
    # Cloud TPU's v5e page: 197 TFLOP/s bf16, 16 GB of HBM2 at 819 GB/s,
    # 1,600 Gbit/s ICI per chip, 6.4 Tbit/s of DCN per 256-chip pod; a
    # program gets 15.75 GiB of the HBM (the runtime's limit on a v5e).
    'v5e': Chip('v5e', 'TPU v5 lite', 15.75 * GIB, 197e12, 819e9, 1600e9 / 8,
                6.4e12 / 8 / 256),
    # Cloud TPU's v5p page: 459 TFLOP/s bf16, 95 GiB of HBM at 2,765 GB/s,
    # 4,800 Gbit/s ICI and 50 Gbit/s of DCN per chip.
    'v5p': Chip('v5p', 'TPU v5', 95 * GIB, 459e12, 2765e9, 4800e9 / 8, 50e9 / 8),
}
"""The chips a topology may name, with their vendor's figures."""

SLICES: dict[str, dict[int, str]] = {
    'v5e': {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8',
            128: '8x16', 256: '16x16'},
    'v5p': {8: '2x2x1', 16: '2x2x2', 64: '2x4x4', 128: '4x4x4', 256: '4x4x8',
            512: '4x8x8', 1024: '8x8x8', 2048: '8x8x16', 4096: '8x16x16',
            8192: '16x16x16', 12288: '16x16x24'},
}
"""Cloud TPU's slice shapes by accelerator type: ``v5e-N`` counts chips,
``v5p-N`` TensorCores (two a chip), as Cloud TPU names them."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """``num_slices`` slices of ``shape`` chips of ``chip``, e.g. ``v5e:16x16``."""

  chip: Chip
  shape: tuple[int, ...]
  num_slices: int = 1

  @property
  def slice_name(self) -> str:
    """``'v5e:16x16'``: the name libtpu takes."""
    return f'{self.chip.name}:{"x".join(map(str, self.shape))}'

  @property
  def name(self) -> str:
    """The slice's name, with ``' x S slices'`` for more than one."""
    return self.slice_name + (f' x {self.num_slices} slices' if self.num_slices > 1 else '')

  @property
  def chips_per_slice(self) -> int:
    return int(np.prod(self.shape))

  @property
  def chips(self) -> int:
    return self.chips_per_slice * self.num_slices


def topology(name: str, num_slices: int = 1) -> Topology:
  """The topology ``name``: ``'v5e:16x16'``, ``'v5p:4x4x4'``, ``'v5e-256'`` or ``'v5p-128'``.

  ``CHIP:AxB[xC]`` gives the slice's chips along its torus axes; ``CHIP-N``
  is Cloud TPU's accelerator type (:data:`SLICES`). ``num_slices`` slices of
  it are joined by the data-centre network. ValueError (one line, naming
  what is allowed) for anything else.
  """
  if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
    raise ValueError(f'num_slices={num_slices!r} must be a positive integer.')
  text = str(name).strip().lower()
  chip_name, sep, rest = text.partition(':')
  if not sep:
    chip_name, sep, rest = text.partition('-')
  chip = CHIPS.get(chip_name)
  if chip is None or not sep:
    raise ValueError(f'topology={name!r}: write CHIP:AxB (e.g. v5e:16x16, v5p:4x4x4) or '
                     f'CHIP-N (e.g. v5e-256, v5p-128), CHIP one of {", ".join(CHIPS)}.')
  if text[len(chip_name)] == '-':
    if not rest.isdigit() or int(rest) not in SLICES[chip.name]:
      raise ValueError(f'topology={name!r}: {chip.name}-N is one of '
                       f'{", ".join(f"{chip.name}-{n}" for n in SLICES[chip.name])}.')
    rest = SLICES[chip.name][int(rest)]
  dims = rest.split('x')
  want = 2 if chip.name == 'v5e' else 3
  if len(dims) != want or not all(d.isdigit() and int(d) >= 1 for d in dims):
    example = SLICES[chip.name][8 if want == 2 else 16]
    raise ValueError(f'topology={name!r}: a {chip.name} slice has {want} torus axes, '
                     f'e.g. {chip.name}:{example}.')
  return Topology(chip, tuple(int(d) for d in dims), num_slices)


def libtpu_missing() -> str | None:
  """Why TPU programs cannot be compiled here (libtpu is not installed), or None."""
  if os.environ.get('TPU_LIBRARY_PATH') or importlib.util.find_spec('libtpu') is not None:
    return None
  return ("libtpu is not installed: planning a TPU topology compiles with it; install "
          "fedjx's tpu extra (pip install -e '.[tpu]').")


def compile_only_devices(top: Topology) -> list[Any]:
  """libtpu's compile-only devices of ``top`` (no TPU needed), in its order."""
  missing = libtpu_missing()
  if missing:
    raise ValueError(f'topology={top.name!r}: {missing}')
  tpu_env.quiet()
  kwargs = {'num_slices': top.num_slices} if top.num_slices > 1 else {}
  if top.chips_per_slice == 1:
    kwargs['chips_per_host_bounds'] = (1, 1, 1)
  return list(topologies.get_topology_desc(top.slice_name, 'tpu', **kwargs).devices)


def pod_mesh(top: Topology, replicas: int, fsdp: int, tensor: int = 1) -> jax.sharding.Mesh:
  """The ``('clients', 'fsdp', 'tensor')`` mesh of ``replicas x fsdp x tensor`` chips of ``top``.

  Every chip of the topology is used. With ``S`` slices, each holds ``M / S``
  replicas whole, so only ``'clients'`` spans slices
  (``mesh_utils.create_hybrid_device_mesh``); within a slice the axes are laid
  on the torus by ``mesh_utils.create_device_mesh`` (splitting a torus axis
  where a mesh axis needs part of it).
  """
  for arg, value in (('replicas', replicas), ('fsdp', fsdp), ('tensor', tensor)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'{arg}={value!r} must be a positive integer.')
  if replicas * fsdp * tensor != top.chips:
    hint = (f' (e.g. fsdp={top.chips // (replicas * tensor)})'
            if top.chips % (replicas * tensor) == 0 else '')
    raise ValueError(f'replicas={replicas} x fsdp={fsdp} x tensor={tensor} is '
                     f'{replicas * fsdp * tensor} chips; {top.name} has {top.chips}: '
                     f'choose sizes whose product is {top.chips}{hint}.')
  if replicas % top.num_slices:
    raise ValueError(f'replicas={replicas} must be a multiple of the {top.num_slices} '
                     f'slices of {top.name} (each slice holds whole replicas).')
  devices = compile_only_devices(top)
  per_slice = (replicas // top.num_slices, fsdp, tensor)
  try:
    if top.num_slices > 1:
      grid = mesh_utils.create_hybrid_device_mesh(
          per_slice, (top.num_slices, 1, 1), devices, allow_split_physical_axes=True)
    else:
      grid = mesh_utils.create_device_mesh(per_slice, devices,
                                           allow_split_physical_axes=True)
  except (NotImplementedError, ValueError, AssertionError) as e:
    raise ValueError(f'replicas={replicas} x fsdp={fsdp} x tensor={tensor} cannot be laid '
                     f'on {top.name}: {" ".join(str(e).split())}') from None
  return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


# ------------------------------------------------------------- calibration

CALIBRATION_FILE = os.path.join(os.path.dirname(__file__), 'tpu_calibration.json')

CALIBRATION_MODEL = 'step_s = factor x max(compute_s, hbm_s)'
"""The calibrated step time of a program on one chip (:class:`Calibration`)."""


@dataclasses.dataclass(frozen=True)
class CalibrationCase:
  """One program measured on a chip and planned for its 1-chip topology.

  Attributes:
    program: what ran, in words (preset, batch, tokens, vocabulary, dtype, remat).
    measured_step_s: the step time measured on the chip (median of repeats).
    compute_s: the plan's ``FLOPs / peak`` of the same program.
    hbm_s: the plan's ``HBM bytes / bandwidth`` of the same program.
    info: the rest of the case as kept in the file (shapes, dates, versions).
  """

  program: str
  measured_step_s: float
  compute_s: float
  hbm_s: float
  info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

  @property
  def roofline_s(self) -> float:
    """The plan's roofline of the program on the chip: ``max(compute_s, hbm_s)``."""
    return max(self.compute_s, self.hbm_s)

  def to_json(self) -> dict[str, Any]:
    return {'program': self.program, 'measured_step_s': self.measured_step_s,
            'planned_compute_s': self.compute_s, 'planned_hbm_s': self.hbm_s,
            **{k: v for k, v in self.info.items()
               if k not in ('program', 'measured_step_s', 'planned_compute_s',
                            'planned_hbm_s')}}

  @classmethod
  def from_json(cls, entry: dict[str, Any], where: str = '') -> CalibrationCase:
    try:
      case = cls(str(entry.get('program', '')), float(entry['measured_step_s']),
                 float(entry['planned_compute_s']), float(entry['planned_hbm_s']),
                 dict(entry))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f'{where}a calibration case needs measured_step_s, planned_compute_s '
                       f'and planned_hbm_s (seconds); it has {sorted(entry)} ({e}).') from None
    if not (case.measured_step_s > 0 and case.compute_s >= 0 and case.hbm_s >= 0
            and case.compute_s + case.hbm_s > 0):
      raise ValueError(f'{where}{case.program or "a case"}: measured_step_s='
                       f'{case.measured_step_s!r} must be positive seconds, planned_compute_s='
                       f'{case.compute_s!r} and planned_hbm_s={case.hbm_s!r} non-negative '
                       'and not both 0.')
    return case


def fit_calibration(cases: list[CalibrationCase]) -> float:
  """The factor ``f`` of ``step_s = f max(compute_s, hbm_s)`` fitted to measured cases.

  With ``m_i`` the measured step of case ``i`` and ``r_i = max(c_i, h_i)``
  the plan's roofline of the same program (``c_i``, ``h_i``: its compute
  and HBM times), ``f`` minimizes the squared relative error

      sum_i (f r_i / m_i - 1)^2,   so   f = sum_i (r_i / m_i) / sum_i (r_i / m_i)^2,

  the least squares of the column ``r_i / m_i`` against 1 (positive, as
  every ``r_i / m_i`` is).

  One factor, not a coefficient per resource (``a c_i + b h_i``): the
  steps measured are HBM-bound (``h_i > c_i`` in every case), so a
  separate compute coefficient is not identifiable from them, and fitted
  anyway it predicted the cases left out of its fit worse than the one
  factor did (the 550M step, left out, 1.22 times its measured time
  against 1.02). ValueError without a case.
  """
  if not cases:
    raise ValueError('fit_calibration: no measured case to fit.')
  x = np.array([c.roofline_s / c.measured_step_s for c in cases], dtype=np.float64)
  return float(np.sum(x) / np.sum(x * x))


def leave_one_out(cases: list[CalibrationCase]) -> list[float]:
  """Each case's predicted over measured step when the factor is fitted on
  the others (:func:`fit_calibration`); needs at least two cases."""
  if len(cases) < 2:
    raise ValueError('leave_one_out: needs at least two cases.')
  return [fit_calibration(cases[:i] + cases[i + 1:]) * case.roofline_s / case.measured_step_s
          for i, case in enumerate(cases)]


@dataclasses.dataclass(frozen=True)
class Calibration:
  """A chip's step time from the plan's roofline, one factor fitted to measured steps.

  Calibrated (:attr:`measured`), a program's time on the chip is
  ``factor x max(compute_s, hbm_s)`` (:data:`CALIBRATION_MODEL`,
  :func:`fit_calibration`), from its ``FLOPs / peak`` and ``HBM bytes /
  bandwidth``; uncalibrated (``factor`` None), the roofline
  ``max(compute_s, hbm_s)`` itself. ``cases`` are the measured programs
  the factor was fitted on.
  """

  chip: str
  factor: float | None = None
  cases: tuple[CalibrationCase, ...] = ()
  source: str = ''
  host_bytes_per_s: float | None = None

  @property
  def measured(self) -> bool:
    return self.factor is not None

  def on_chip_s(self, compute_s: float, hbm_s: float) -> float:
    """Seconds of a program's own work on the chip: the roofline, times the factor
    where calibrated."""
    roofline = max(compute_s, hbm_s)
    return roofline if self.factor is None else self.factor * roofline

  def describe(self) -> str:
    """The calibration in words (what ``fedjx-plan`` prints beside a step time)."""
    if not self.measured:
      return f'uncalibrated: no {self.chip} measurement in tpu_calibration.json'
    n = len(self.cases)
    return (f'x {self.factor:.4g} the roofline'
            + (f', fitted to {n} step{"s" if n != 1 else ""} measured on one {self.chip}'
               if n else '') + (f' ({self.source})' if self.source else ''))

  def to_json(self) -> dict[str, Any]:
    """The chip's entry of ``tpu_calibration.json`` (host bandwidth not included)."""
    return {'model': CALIBRATION_MODEL, 'factor': self.factor,
            'fit': ('least squares of predicted / measured - 1 over the cases '
                    '(experiments/topology_plan.py, fit_calibration)'),
            'source': self.source, 'cases': [c.to_json() for c in self.cases]}


def fitted(chip: str, cases: list[CalibrationCase], source: str = '',
           host_bytes_per_s: float | None = None) -> Calibration:
  """The :class:`Calibration` of ``chip`` fitted to ``cases`` (:func:`fit_calibration`)."""
  return Calibration(chip, fit_calibration(cases), tuple(cases), source, host_bytes_per_s)


def calibration(chip: str, path: str = CALIBRATION_FILE) -> Calibration:
  """The calibration of ``chip`` kept in ``path`` (JSON), or an uncalibrated one.

  The file maps a chip name to ``{"factor", "cases", "source"}``: the
  factor of :data:`CALIBRATION_MODEL` and the measured cases it was
  fitted on (:func:`fit_calibration`), each a program's step time
  measured on one chip with the plan's compute and HBM times of the same
  program on the 1-chip topology (``scripts/check_plan.py`` measures,
  fits and prints the entry). An optional ``"host_bytes_per_s"`` is the
  chip's measured copy rate to host memory (replicas' states kept on the
  host, :attr:`PodPlan.host_s`).
  """
  try:
    with open(path, encoding='utf-8') as f:
      entries = json.load(f)
  except FileNotFoundError:
    entries = {}
  entry = entries.get(chip) or {}
  host = entry.get('host_bytes_per_s')
  if host is not None and not host > 0:
    raise ValueError(f'{path}: {chip}: host_bytes_per_s={host!r} must be a positive '
                     'number of bytes per second.')
  host = None if host is None else float(host)
  if 'measured_step_s' in entry and 'cases' not in entry:
    raise ValueError(f'{path}: {chip}: one measured step (measured_step_s, '
                     'planned_step_s) no longer calibrates; keep "factor" and the "cases" it '
                     'was fitted on, several steps measured on the chip (python '
                     'scripts/check_plan.py on a TPU host measures them and prints the entry).')
  if 'factor' not in entry and ('compute' in entry or 'hbm' in entry):
    raise ValueError(f'{path}: {chip}: the coefficients "compute" and "hbm" (step = a x '
                     'compute + b x HBM) no longer calibrate; replace them by "factor" of '
                     f'{CALIBRATION_MODEL!r} fitted to the entry\'s "cases" '
                     '(topology_plan.fit_calibration, or python scripts/check_plan.py '
                     '--judge=FILE on the rows they were measured in prints the entry).')
  cases = tuple(CalibrationCase.from_json(c, f'{path}: {chip}: ')
                for c in entry.get('cases') or ())
  factor = entry.get('factor')
  if factor is None:
    return Calibration(chip, cases=cases, source=entry.get('source', ''),
                       host_bytes_per_s=host)
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
    raise ValueError(f'{path}: {chip}: factor={factor!r} must be a positive number.')
  return Calibration(chip, float(factor), cases, entry.get('source', ''), host)


# ------------------------------------------------------------- programs

@dataclasses.dataclass(frozen=True)
class ProgramCost:
  """One compiled program's figures, per chip.

  The memory is the full program's; ``flops``, ``hbm_bytes``, ``xla_seconds``
  and ``wire`` are per execution, loops counted at their trip count where the
  plan corrects them (the inner step's layers).
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  flops: float
  hbm_bytes: float
  xla_seconds: float | None
  wire: dict[str, float]
  collectives: tuple[Collective, ...]
  compile_seconds: float

  @property
  def peak_bytes(self) -> int:
    """``arguments + outputs - aliased + temporaries``."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def ici_bytes(self) -> float:
    return sum(v for k, v in self.wire.items() if not k.startswith('dcn:'))

  @property
  def dcn_bytes(self) -> float:
    return sum(v for k, v in self.wire.items() if k.startswith('dcn:'))


def _cost(compiled) -> tuple[float, float, float | None]:
  """``(flops, bytes accessed, XLA's own seconds or None)`` of a compiled program."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  seconds = cost.get('optimal_seconds')
  return (float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0)),
          float(seconds) if seconds is not None and seconds > 0 else None)


def _compiled(jitted, args, mesh):
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  return compiled, seconds, collectives(compiled.as_text(), mesh)


def _program(compiled, seconds, found, per_run=None) -> ProgramCost:
  memory = compiled.memory_analysis()
  if per_run is None:
    per_run = _cost(compiled) + (wire_bytes_by_axes(found),)
  flops, hbm, xla, wire = per_run
  return ProgramCost(
      argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes),
      alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
      flops=flops, hbm_bytes=hbm, xla_seconds=xla, wire=wire, collectives=tuple(found),
      compile_seconds=seconds)


def _by_depth(one, two, layers: int):
  """``a + b L`` of the figures of the unscanned ``L = 1`` and ``L = 2`` compiles."""
  grow = lambda c1, c2: c1 + (c2 - c1) * (layers - 1)
  (f1, h1, x1), w1 = _cost(one[0]), wire_bytes_by_axes(one[2])
  (f2, h2, x2), w2 = _cost(two[0]), wire_bytes_by_axes(two[2])
  xla = grow(x1, x2) if x1 is not None and x2 is not None else None
  wire = {k: grow(w1.get(k, 0.0), w2.get(k, 0.0)) for k in sorted(set(w1) | set(w2))}
  return grow(f1, f2), grow(h1, h2), xla, {k: v for k, v in wire.items() if v > 0}


def _shard_bytes(tree: Any) -> int:
  """Bytes one chip holds of a tree of sharded ``ShapeDtypeStruct`` (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
  return total


ALGORITHMS = ('diloco', 'fedavg')


def _optimizers(algorithm: str, outer_learning_rate, outer_momentum):
  """``(inner optimizer, outer learning rate, outer momentum)`` of ``algorithm``."""
  if algorithm == 'diloco':
    return lm_cost.inner_optimizer(), outer_learning_rate, outer_momentum
  if algorithm == 'fedavg':
    return optax.sgd(1e-2), 1.0, None
  raise ValueError(f'algorithm={algorithm!r} is not one of {", ".join(map(repr, ALGORITHMS))}.')


@dataclasses.dataclass(frozen=True)
class PodPlan:
  """A planned round on a TPU topology (bytes, FLOPs and seconds per chip)."""

  topology: Topology
  preset: str
  config: llama_config.LlamaConfig
  algorithm: str
  replicas: int
  fsdp: int
  tensor: int
  batch: int
  seq_len: int
  inner_steps: int
  params: int
  inner: ProgramCost
  outer: ProgramCost
  server_state_bytes: int
  inner_state_bytes: int
  analytic_flops: float
  calibration: Calibration
  replica_param_bytes: int = 0
  replica_states: str = 'device'

  @property
  def chip(self) -> Chip:
    return self.topology.chip

  @property
  def replicas_per_slot(self) -> int:
    """``k``: the replicas each slot of ``'clients'`` trains one after another."""
    return self.replicas // (self.topology.chips // (self.fsdp * self.tensor))

  @property
  def held_bytes(self) -> int:
    """What a chip holds through the inner steps besides one replica's step.

    The server state; with ``k > 1`` replicas per slot, the other ``k - 1``
    replicas' optimizer states and the running sum of the replicas' models
    (the size of the model's shard). With the states on the host
    (``replica_states='store'``), two other replicas' states (the next
    arriving, the previous leaving) and the running sum with its
    compensation.
    """
    return held_bytes(self.replica_states, self.replicas_per_slot,
                      self.server_state_bytes, self.inner_state_bytes,
                      self.replica_param_bytes)

  @property
  def peak_bytes(self) -> int:
    """HBM a chip needs through the round (module docstring)."""
    on_chip = self.replicas_per_slot if self.replica_states == 'device' else 0
    return max(self.inner.peak_bytes + self.held_bytes,
               self.outer.peak_bytes + on_chip * self.inner_state_bytes)

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.chip.hbm_bytes

  def times(self, program: ProgramCost) -> dict[str, float]:
    """Seconds per chip of ``program``: compute, HBM, ICI and DCN traffic.

    The inner step's compute is the larger of XLA's FLOPs and the analytic
    count: XLA's cost analysis does not see inside a custom kernel (a
    Pallas attention), whose FLOPs the analytic count still has.
    """
    flops = program.flops
    if program is self.inner:
      flops = max(flops, self.analytic_flops)
    return {'compute': flops / self.chip.peak_flops,
            'hbm': program.hbm_bytes / self.chip.hbm_bytes_per_s,
            'ici': program.ici_bytes / self.chip.ici_bytes_per_s,
            'dcn': program.dcn_bytes / self.chip.dcn_bytes_per_s}

  @property
  def raw_step_s(self) -> float:
    """The inner step's roofline: its slowest resource."""
    return max(self.times(self.inner).values())

  @property
  def step_s(self) -> float:
    """The inner step calibrated: the chip's own work (:meth:`Calibration.on_chip_s`:
    the roofline of its compute and HBM times, times the factor fitted to measured
    steps), or its ICI or DCN traffic where that is longer (overlapped, as in the
    roofline)."""
    t = self.times(self.inner)
    return max(self.calibration.on_chip_s(t['compute'], t['hbm']), t['ici'], t['dcn'])

  @property
  def outer_s(self) -> float:
    """The outer step: its compute and HBM (calibrated) plus its communication."""
    t = self.times(self.outer)
    return self.calibration.on_chip_s(t['compute'], t['hbm']) + t['ici'] + t['dcn']

  @property
  def host_s(self) -> float:
    """Seconds a round waits for the replicas' new states to reach the host
    (``replica_states='store'``; 0 without a measured host bandwidth): the
    last replica's copy ``c``, and ``max(0, c - t)`` for each other one,
    whose copy overlaps the next replica's steps ``t``."""
    rate = self.calibration.host_bytes_per_s
    if self.replica_states != 'store' or not rate:
      return 0.0
    copy = self.inner_state_bytes / rate
    steps = self.inner_steps * self.step_s
    return copy + (self.replicas_per_slot - 1) * max(0.0, copy - steps)

  @property
  def round_s(self) -> float:
    return (self.replicas_per_slot * self.inner_steps * self.step_s + self.outer_s
            + self.host_s)

  @property
  def tokens_per_round(self) -> int:
    return self.replicas * self.batch * self.seq_len * self.inner_steps

  @property
  def mfu(self) -> float:
    """Model FLOPs of the round over the round's time at every chip's peak."""
    return (self.analytic_flops * self.replicas_per_slot * self.inner_steps
            / (self.round_s * self.chip.peak_flops))

  def to_json(self) -> dict[str, Any]:
    """The plan as one flat JSON object (what ``fedjx-plan --json`` prints)."""
    inner, outer = self.times(self.inner), self.times(self.outer)
    return {
        'kind': 'pod', 'topology': self.topology.slice_name,
        'num_slices': self.topology.num_slices, 'chips': self.topology.chips,
        'chip': self.chip.name, 'preset': self.preset, 'algorithm': self.algorithm,
        'replicas': self.replicas, 'replicas_per_slot': self.replicas_per_slot,
        'replica_states': self.replica_states, 'host_s': self.host_s,
        'fsdp': self.fsdp, 'tensor': self.tensor,
        'batch': self.batch, 'seq_len': self.seq_len, 'inner_steps': self.inner_steps,
        'dtype': self.config.dtype, 'remat': self.config.remat,
        'attention': self.config.attention, 'loss_chunk': self.config.loss_chunk,
        'params': self.params, 'held_bytes': self.held_bytes,
        'hbm_per_chip_bytes': self.chip.hbm_bytes, 'peak_bytes': self.peak_bytes,
        'fits': self.fits, 'inner_argument_bytes': self.inner.argument_bytes,
        'inner_output_bytes': self.inner.output_bytes,
        'inner_alias_bytes': self.inner.alias_bytes, 'inner_temp_bytes': self.inner.temp_bytes,
        'inner_peak_bytes': self.inner.peak_bytes, 'outer_peak_bytes': self.outer.peak_bytes,
        'server_state_bytes': self.server_state_bytes,
        'inner_state_bytes': self.inner_state_bytes,
        'flops_per_step': self.inner.flops, 'analytic_flops_per_step': self.analytic_flops,
        'hbm_bytes_per_step': self.inner.hbm_bytes, 'xla_seconds_per_step': self.inner.xla_seconds,
        'wire_bytes_per_step': self.inner.wire, 'outer_wire_bytes': self.outer.wire,
        'collectives': ops_by_axes(self.inner.collectives),
        'outer_collectives': ops_by_axes(self.outer.collectives),
        'outer_flops': self.outer.flops, 'outer_hbm_bytes': self.outer.hbm_bytes,
        'step_compute_s': inner['compute'], 'step_hbm_s': inner['hbm'],
        'step_ici_s': inner['ici'], 'step_dcn_s': inner['dcn'],
        'raw_step_s': self.raw_step_s, 'calibration_factor': self.calibration.factor,
        'calibration': self.calibration.describe(),
        'calibrated': self.calibration.measured, 'step_s': self.step_s,
        'outer_s': self.outer_s, 'outer_ici_s': outer['ici'], 'outer_dcn_s': outer['dcn'],
        'round_s': self.round_s, 'tokens_per_s': self.tokens_per_round / self.round_s,
        'mfu': self.mfu,
        'compile_s': round(self.inner.compile_seconds + self.outer.compile_seconds, 3),
    }


REPLICA_STATES = ('device', 'store')
"""Where the replicas' optimizer states live through a round: on the chips,
or on the host (``config.client_state.placement``)."""


def held_bytes(replica_states: str, k: int, server_state: int, inner_state: int,
               replica_params: int) -> int:
  """What a chip holds besides one replica's step, ``k`` replicas per slot
  (:attr:`PodPlan.held_bytes`)."""
  if replica_states == 'store':
    return server_state + 2 * inner_state + 2 * replica_params
  return server_state + (k - 1) * inner_state + (replica_params if k > 1 else 0)


def _slots(top: Topology, replicas: int, fsdp: int, tensor: int) -> int:
  """The slots of ``'clients'`` on ``top``: ``chips / (fsdp tensor)``, dividing ``replicas``."""
  for arg, value in (('replicas', replicas), ('fsdp', fsdp), ('tensor', tensor)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'{arg}={value!r} must be a positive integer.')
  per_replica = fsdp * tensor
  slots = top.chips // per_replica
  if top.chips % per_replica or replicas < slots or replicas % slots:
    raise ValueError(
        f'replicas={replicas} x fsdp={fsdp} x tensor={tensor} is {replicas * per_replica} '
        f'chips; {top.name} has {top.chips}: choose sizes whose product is {top.chips}, or '
        f'a multiple of it (each group of fsdp x tensor chips then trains several '
        f'replicas one after another).')
  return slots


def for_chip(config: llama_config.LlamaConfig, batch: int, seq_len: int,
             memory_bytes: int, kernel: bool = True) -> llama_config.LlamaConfig:
  """``config`` with its ``'auto'`` settings resolved for a TPU chip of ``memory_bytes`` free.

  :func:`fedjx.models.llama.step_plan` on the TPU backend, whatever backend
  plans: its attention kernel, remat policy and loss chunk for ``batch x
  seq_len`` tokens a chip. ``kernel=False`` keeps XLA's attention where
  ``config.attention`` is ``'auto'``: the kernel's layout under a mesh of
  several chips is not planned (its per-shard map lets the compiler move
  activations between replicas), so a pod is planned with XLA's attention,
  whose temporaries bound the kernel's from above.
  """
  if not kernel and config.attention == 'auto':
    config = config.replace(attention='xla')
  plan = llama.step_plan(config, batch, seq_len, memory_bytes=max(int(memory_bytes), 1),
                         backend='tpu')
  return config.replace(**plan)


def plan_pod(preset: str | llama_config.LlamaConfig, top: Topology | str, *,
             replicas: int, fsdp: int, tensor: int = 1, batch: int = 8,
             seq_len: int | None = None, remat: str | None = None,
             dtype: str | None = None, inner_steps: int = 1, algorithm: str = 'diloco',
             outer_learning_rate: float = 0.7, outer_momentum: float | None = 0.9,
             calibration_file: str = CALIBRATION_FILE, name: str | None = None,
             replica_states: str = 'device') -> PodPlan:
  """Compiles a round's programs for the TPU topology ``top`` and reads their cost.

  Args:
    preset: a name in :data:`~fedjx.models.llama_config.PRESETS` or a config.
    top: a :class:`Topology` or its name (:func:`topology`).
    replicas: ``M`` replicas (clients) on ``'clients'``.
    fsdp, tensor: ``F`` and ``T`` chips per replica; ``M F T`` is every chip,
      or a multiple of it: then each of the ``chips / (F T)`` slots trains
      ``M F T / chips`` replicas one after another (module docstring).
    batch: sequences per replica per inner step.
    seq_len: tokens per sequence (``None``: the preset's).
    remat, dtype: replace the preset's; ``'auto'`` settings are resolved for
      the topology's chip and the HBM the round's state leaves it.
    inner_steps: ``H`` inner steps per round.
    algorithm: ``'diloco'`` (AdamW inner steps, Nesterov outer step of
      ``outer_learning_rate`` and ``outer_momentum``) or ``'fedavg'``.
    calibration_file: the chips' calibrations (:func:`calibration`).
    name: the model's name in the plan (``None``: the preset's, or ``'custom'``).
    replica_states: where the replicas' optimizer states live,
      :data:`REPLICA_STATES` (module docstring).

  Returns:
    A :class:`PodPlan`. Compiles the inner step three times (the full depth,
    and unscanned at ``L = 1, 2``) and the outer step once.
  """
  top = topology(top) if isinstance(top, str) else top
  resolved, config, seq_len = lm_cost._resolve(preset, seq_len, remat, dtype)  # pylint: disable=protected-access
  name = name or resolved
  for arg, value in (('batch', batch), ('seq_len', seq_len), ('inner_steps', inner_steps)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'plan_pod: {arg}={value!r} must be a positive integer.')
  if replica_states not in REPLICA_STATES:
    raise ValueError(f'plan_pod: replica_states={replica_states!r} is not one of '
                     f'{", ".join(map(repr, REPLICA_STATES))}.')
  opt, outer_lr, outer_mom = _optimizers(algorithm, outer_learning_rate, outer_momentum)
  lm_cost.check_tensor('plan_pod', config, tensor)
  slots = _slots(top, replicas, fsdp, tensor)
  mesh = pod_mesh(top, slots, fsdp, tensor)
  per_slot = replicas // slots
  _, (a_params, a_opt, _) = lm_cost.inner_step_program(config, slots, fsdp, batch, seq_len,
                                                       mesh, tensor, optimizer=opt)
  theta_shape, momentum_shape, _ = lm_cost.outer_step_program(
      config, slots, fsdp, mesh, tensor, learning_rate=outer_lr, momentum=outer_mom)[1]
  replica_bytes, opt_bytes = _shard_bytes(a_params), _shard_bytes(a_opt)
  server_bytes = _shard_bytes((theta_shape, momentum_shape))
  held = held_bytes(replica_states, per_slot, server_bytes, opt_bytes, replica_bytes)
  config = for_chip(config, max(1, batch // fsdp), seq_len, top.chip.hbm_bytes - held,
                    kernel=top.chips == 1)

  def inner(c):
    jitted, args = lm_cost.inner_step_program(c, slots, fsdp, batch, seq_len, mesh,
                                              tensor, optimizer=opt)
    return _compiled(jitted, args, mesh) + (args,)

  full = inner(config)
  per_run = None
  if config.scan_layers or config.num_layers > 2:
    one, two = (inner(config.replace(num_layers=l, scan_layers=False)) for l in (1, 2))
    per_run = _by_depth(one, two, config.num_layers)
  inner_cost = _program(*full[:3], per_run)
  outer_jit, outer_args = lm_cost.outer_step_program(
      config, slots, fsdp, mesh, tensor, learning_rate=outer_lr, momentum=outer_mom)
  outer_cost = _program(*_compiled(outer_jit, outer_args, mesh))
  _, opt_state, _ = full[3]
  theta, momentum, _ = outer_args
  analytic = (llama_config.train_flops_per_token(config, seq_len) * batch * seq_len
              / (fsdp * tensor))
  return PodPlan(
      topology=top, preset=name, config=config, algorithm=algorithm, replicas=replicas,
      fsdp=fsdp, tensor=tensor, batch=batch, seq_len=seq_len, inner_steps=inner_steps,
      params=llama_config.num_params(config), inner=inner_cost, outer=outer_cost,
      server_state_bytes=_shard_bytes((theta, momentum)),
      inner_state_bytes=_shard_bytes(opt_state), analytic_flops=analytic,
      calibration=calibration(top.chip.name, calibration_file),
      replica_param_bytes=replica_bytes, replica_states=replica_states)


__all__ = ['ALGORITHMS', 'AXES', 'CALIBRATION_FILE', 'CALIBRATION_MODEL', 'CHIPS',
           'REPLICA_STATES', 'SLICES', 'Calibration', 'CalibrationCase', 'Chip', 'PodPlan',
           'ProgramCost', 'Topology', 'calibration', 'compile_only_devices', 'fit_calibration',
           'fitted', 'for_chip', 'held_bytes', 'leave_one_out', 'libtpu_missing', 'plan_pod',
           'pod_mesh', 'topology']
