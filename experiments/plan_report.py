"""How ``fedjx-plan`` shows a plan: the device it is held against, and its table.

:func:`target` resolves the device a plan's memory is compared with: the one
named (``--device``, a key of
:data:`fedjx.experiments.lm_cost.DEVICE_MEMORY`), else the accelerator JAX
sees (its allocator's limit, its kind's bfloat16 peak), else the host CPU and
its memory, said to be assumed. :func:`table` lays rows of ``(label, value,
note)`` out in aligned columns under a title line; every plan of
``fedjx-plan`` prints one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from fedjx import execution
from fedjx.experiments import hlo_collectives
from fedjx.experiments import lm_cost
from fedjx.experiments import lm_metrics
from fedjx.models import llama_config


@dataclasses.dataclass(frozen=True)
class Target:
  """The device a plan is held against.

  Attributes:
    name: a key of ``lm_cost.DEVICE_MEMORY`` (``'tpu-v5e'``, ``'h100'``, ...),
      the device's kind where it has none, or ``'host CPU'``.
    memory_bytes: what one device can hold (None: unknown).
    peak_flops: its dense bfloat16 peak (None: unknown).
    source: ``'named'`` (``--device``), ``'detected'`` (the accelerator JAX
      sees) or ``'assumed'`` (no accelerator: the host CPU).
  """

  name: str
  memory_bytes: float | None
  peak_flops: float | None
  source: str

  @property
  def note(self) -> str:
    """``'17.18 GB; named'``; the assumed host says how to name another device."""
    memory = 'memory unknown' if self.memory_bytes is None else gb(self.memory_bytes)
    if self.source == 'assumed':
      return (f'{memory}; assumed: no accelerator is visible (--device NAME or --tpu '
              'TOPOLOGY plans for one)')
    return f'{memory}; {self.source}'

  def fits(self, peak_bytes: float) -> bool | None:
    """Whether ``peak_bytes`` fits (None where the memory is unknown)."""
    return None if self.memory_bytes is None else peak_bytes <= self.memory_bytes


def target(device: str | None = None) -> Target:
  """The device named, else the accelerator JAX sees, else the host CPU (assumed)."""
  if device is not None:
    return Target(device, lm_cost.device_memory(device),
                  lm_cost.PEAK_BF16_FLOPS.get(device), 'named')
  first = jax.devices()[0]
  memory = execution.device_memory_bytes(first)
  if first.platform == 'cpu':
    return Target('host CPU', memory, None, 'assumed')
  key = lm_metrics.device_key(first.device_kind)
  if memory is None and key is not None:
    memory = lm_cost.DEVICE_MEMORY.get(key)
  return Target(key or first.device_kind, memory,
                lm_cost.PEAK_BF16_FLOPS.get(key) if key else None, 'detected')


def gb(n: float) -> str:
  """Bytes in GB (MB below 1 GB, kB below 1 MB, B below 1 kB)."""
  if n >= 1e9:
    return f'{n / 1e9:,.2f} GB'
  if n >= 1e6:
    return f'{n / 1e6:,.2f} MB'
  if n >= 1e3:
    return f'{n / 1e3:,.2f} kB'
  return f'{n:,.0f} B'


def seconds(s: float) -> str:
  """Seconds as s, ms or us."""
  if s >= 1:
    return f'{s:,.3g} s'
  if s >= 1e-3:
    return f'{s * 1e3:.3g} ms'
  return f'{s * 1e6:.3g} us'


def table(title: str, rows: Sequence[tuple[str, str, str]]) -> str:
  """``title`` then one line per ``(label, value, note)``, columns aligned.

  A row whose label starts with ``'  '`` is indented under the one before
  it; a row with an empty value and note is a section heading.
  """
  width = max((len(label) for label, _, _ in rows), default=0)
  value_width = max((len(value) for _, value, _ in rows), default=0)
  lines = [title]
  for label, value, note in rows:
    if not value and not note:
      lines.append(f'  {label}')
      continue
    line = f'  {label:<{width}}  {value:>{value_width}}'
    lines.append(f'{line}  {note}' if note else line)
  return '\n'.join(lines) + '\n'


def _yes(fits: bool | None) -> str:
  return {True: 'yes', False: 'NO', None: 'unknown'}[fits]


def render_round(plan, device: Target, spec: str, prog: str = 'fedjx-plan') -> str:
  """The table of a :class:`fedjx.experiments.round_plan.RoundPlan` held against ``device``."""
  where = (f'{plan.devices} {plan.platform} device{"" if plan.devices == 1 else "s"}'
           + (f" (mesh '{plan.mesh}')" if plan.mesh else ' (no mesh)'))
  title = (f'{prog}: {spec}: {plan.algorithm} of {plan.model} on {plan.dataset}, '
           f'{plan.clients} clients x {plan.steps} steps x {plan.batch} examples a round, '
           f"on {where}; the {plan.platform} compiler's plan, compiled in "
           f'{plan.compile_seconds:.1f} s')
  streams = plan.streams(device.memory_bytes)
  if plan.execution == 'auto':
    limit = ('' if device.memory_bytes is None else
             f' against 80 % of {gb(device.memory_bytes)}')
    how = (f"execution='auto': arguments + outputs + temporaries {gb(plan.auto_bytes)}"
           f'{limit}')
  else:
    how = f'execution={plan.execution!r}'
  upload = ('counted as the round runs (upload_bits): its aggregator encodes'
            if plan.upload_bytes is None else
            f'{plan.clients} x {gb(plan.upload_bytes / max(plan.clients, 1))}, the '
            "aggregator's message")
  rows = [
      ('parameters', f'{plan.params:,}', ''),
      ('memory per device', '', ''),
      ('  parameters', gb(plan.param_bytes), 'the server model'),
      ('  optimizer and state', gb(plan.state_bytes),
       'the rest of the server state (optimizer moments, replicas\' states, ...)'),
      ('  client data', gb(plan.data_bytes),
       "the cohort as placed (with the population's table where it is on the device)"),
      ('  outputs', gb(plan.new_output_bytes), 'not reusing a donated argument'),
      ('  activations', gb(plan.temp_bytes), "XLA's temporaries"),
      ('  total', gb(plan.peak_bytes),
       f'XLA peak: arguments {gb(plan.argument_bytes)} + outputs - aliased + temporaries'),
      (f'fits {device.name}', _yes(device.fits(plan.peak_bytes)), device.note),
      ('FLOPs per round', f'{plan.flops:.3g}', plan.flops_method),
      ('bytes on the wire', '', ''),
      ('  upload', '-' if plan.upload_bytes is None else gb(plan.upload_bytes), upload),
      ('  download', gb(plan.download_bytes),
       f'{plan.clients} x {gb(plan.download_bytes / max(plan.clients, 1))}, the server model'),
      ('round runs', f'streamed, {plan.chunk_size} clients a chunk' if streams else 'compiled',
       how),
  ]
  if device.peak_flops:
    rows.insert(-4, ('  at peak', seconds(plan.flops / device.peak_flops),
                     f"{device.name}'s bfloat16 peak; a lower bound"))
  return table(title, rows)


def _ops(ops: dict[str, int]) -> str:
  return ', '.join(f'{op} x{n}' for op, n in sorted(ops.items()))


def _where(key: str) -> str:
  axes = key.removeprefix('dcn:').replace('+', ' x ')
  return f"{axes} ({'across slices, DCN' if key.startswith('dcn:') else 'ICI'})"


def render_pod(plan, prog: str = 'fedjx-plan', spec: str | None = None,
               on_host=None) -> str:
  """The table of a :class:`fedjx.experiments.topology_plan.PodPlan`; ``on_host``,
  the same round planned with the replicas' states on the host, adds its
  peak and round time (where ``plan``, states on the chips, does not fit)."""
  c, top, chip = plan.config, plan.topology, plan.chip
  algorithm = {'diloco': 'DiLoCo', 'fedavg': 'FedAvg'}[plan.algorithm]
  title = (f'{prog}: {(spec + ": ") if spec else ""}{algorithm} of llama_lm {plan.preset} '
           f'on {top.name} ({top.chips} {chip.name} chips), {plan.replicas} replicas x FSDP '
           f'{plan.fsdp} x tensor {plan.tensor}'
           + (f' ({plan.replicas_per_slot} replicas trained one after another on each '
              f'group of {plan.fsdp * plan.tensor} chip'
              f'{"" if plan.fsdp * plan.tensor == 1 else "s"})'
              if plan.replicas_per_slot > 1 else '') +
           f', {plan.batch} x {plan.seq_len:,} tokens per '
           f'replica per inner step, H = {plan.inner_steps}, compute {c.dtype}, attention '
           f'{c.attention}, remat {c.remat}; compiled by libtpu in '
           f'{plan.inner.compile_seconds + plan.outer.compile_seconds:.1f} s')
  inner, outer = plan.inner, plan.outer
  t = plan.times(inner)
  ratio = inner.flops / plan.analytic_flops if plan.analytic_flops else float('nan')
  cal = plan.calibration
  calibrated = ('calibrated: ' if cal.measured else '') + cal.describe()
  binds = max(t, key=t.get)
  rows = [
      ('parameters', f'{plan.params:,}', ''),
      ('HBM per chip', '', ''),
      ('  parameters, optimizer', gb(inner.argument_bytes),
       "the inner step's arguments: the replica's shard of parameters and optimizer "
       'state, tokens'),
      ('  outputs', gb(inner.output_bytes - inner.alias_bytes),
       'not reusing a donated argument'),
      ('  activations', gb(inner.temp_bytes), "the inner step's temporaries"),
      ('  server state', gb(plan.server_state_bytes),
       'the global model (and outer momentum), laid out like a replica'),
  ]
  k = plan.replicas_per_slot
  host = plan.replica_states == 'store'
  if host:
    rows.append(('  replicas in flight', gb(plan.held_bytes - plan.server_state_bytes),
                 "the next replica's optimizer state arriving from the host and the "
                 "previous one's leaving, and the running sum of the replicas' models "
                 "with its compensation; the "
                 f"{plan.replicas} replicas' states live on the host"))
  elif k > 1:
    rows.append(('  other replicas', gb(plan.held_bytes - plan.server_state_bytes),
                 f'the optimizer states of the {k - 1} replicas waiting on the chip, and '
                 "the running sum of the replicas' models"))
  outer_note = (f'outer step {gb(outer.peak_bytes)}' if host else
                f'outer step {gb(outer.peak_bytes)} + inner optimizer state'
                + (f's of {k} replicas' if k > 1 else '')
                + f' {gb(k * plan.inner_state_bytes)}')
  rows += [
      ('  round peak', gb(plan.peak_bytes),
       f'inner step {gb(inner.peak_bytes)} + server state'
       + (' + replicas in flight' if host else ' + other replicas' if k > 1 else '')
       + f'; {outer_note}'),
      (f'fits {chip.name}', _yes(plan.fits), f'{gb(chip.hbm_bytes)} of HBM a chip'
       + (", the replicas' optimizer states on the host "
          "(config.client_state.placement='store')" if host else '')),
      ('per inner step, a chip', '', ''),
      ('  FLOPs', f'{inner.flops:.3g}',
       f'XLA; analytic 6 N_matmul + 12 L H h T per token {plan.analytic_flops:.3g} '
       f'(XLA / analytic {ratio:.3f})'),
      ('  HBM bytes', gb(inner.hbm_bytes), "XLA's bytes accessed"),
  ]
  for key, ops in sorted(hlo_collectives.ops_by_axes(inner.collectives).items()):
    rows.append((f'  {_where(key)}', gb(inner.wire.get(key, 0.0)), _ops(ops)))
  rows += [
      ('  time', seconds(plan.step_s),
       f'{binds} binds: compute {seconds(t["compute"])}, HBM {seconds(t["hbm"])}, ICI '
       f'{seconds(t["ici"])}, DCN {seconds(t["dcn"])}; {calibrated}'
       + ('' if inner.xla_seconds is None else
          f"; XLA's own estimate {seconds(inner.xla_seconds)}")),
      ('outer step, a chip', '', ''),
  ]
  for key, ops in sorted(hlo_collectives.ops_by_axes(outer.collectives).items()):
    rows.append((f'  {_where(key)}', gb(outer.wire.get(key, 0.0)), _ops(ops)))
  o = plan.times(outer)
  rows += [
      ('  time', seconds(plan.outer_s),
       f'compute and HBM {seconds(cal.on_chip_s(o["compute"], o["hbm"]))}, ICI '
       f'{seconds(o["ici"])}, DCN {seconds(o["dcn"])}, not overlapped'),
      ('round', seconds(plan.round_s),
       f'{k * plan.inner_steps} inner steps'
       + (f' ({k} replicas x {plan.inner_steps})' if k > 1 else '') + ' + the outer step'
       + (_host_note(plan) if host else '') + ': '
       f'{plan.tokens_per_round / plan.round_s:,.0f} tokens/s, MFU {100 * plan.mfu:.1f} %'),
  ]
  if on_host is not None:
    rows.append(("states on the host", _yes(on_host.fits),
                 f"config.client_state.placement='store': round peak "
                 f'{gb(on_host.peak_bytes)}, remat {on_host.config.remat}, round '
                 f'{seconds(on_host.round_s)}' + _host_note(on_host)))
  return table(title, rows)


def _host_note(plan) -> str:
  """The host transfers of a plan with the replicas' states on the host."""
  if not plan.host_s:
    return ' (copies of the states to the host not counted: no measured host bandwidth)'
  return (f' + {seconds(plan.host_s)} of copies to the host not hidden by the steps '
          f'({plan.replicas_per_slot} states at {plan.calibration.host_bytes_per_s / 1e9:.1f} '
          'GB/s, each while the next replica trains)')


def render_inner(plan, device: Target, platform: str, prog: str = 'fedjx-plan') -> str:
  """The table of an :class:`fedjx.experiments.lm_cost.InnerStepPlan` held against ``device``."""
  devices = plan.replicas * plan.fsdp * plan.tensor
  plural = lambda n: '' if n == 1 else 's'
  title = (f'{prog}: llama_lm preset {plan.preset}, {plan.replicas} replica'
           f'{plural(plan.replicas)} x FSDP {plan.fsdp}'
           + (f' x tensor {plan.tensor}' if plan.tensor > 1 else '') +
           f' on {devices} {platform} device{plural(devices)}, {plan.batch} x '
           f'{plan.seq_len:,} tokens per replica per inner step, remat {plan.remat}, compute '
           f"{plan.dtype}, AdamW; the {platform} compiler's plan, compiled in "
           f'{plan.compile_seconds:.1f} s')
  analytic = llama_config.num_params(plan.preset) if plan.preset != 'custom' else plan.params
  recompute = ', recomputation included' if plan.remat != 'none' else ''
  rows = [
      ('parameters', f'{plan.params:,}', f'analytic {analytic:,}'),
      ('memory per device', '', ''),
      ('  parameters, AdamW', gb(plan.argument_bytes),
       f'XLA arguments; analytic float32 parameters and moments '
       f'{gb(plan.analytic_state_bytes)}'),
      ('  outputs', gb(plan.output_bytes - plan.alias_bytes),
       f'not reusing a donated argument ({gb(plan.alias_bytes)} do)'),
      ('  activations', gb(plan.temp_bytes), "XLA's temporaries"),
      ('  total', gb(plan.peak_bytes), 'XLA peak: arguments + outputs - aliased + temporaries'),
      (f'fits {device.name}', _yes(device.fits(plan.peak_bytes)), device.note),
      ('FLOPs per inner step', '', ''),
      ('  a device', f'{plan.xla_flops:.4g}',
       f'XLA (its scanned layer body counted once: {plan.xla_flops_scanned:.4g}; one '
       f'layer from unscanned L = 1, 2 times L); analytic {plan.analytic_flops:.4g} '
       f'(XLA / analytic {plan.xla_flops / plan.analytic_flops:.3f}{recompute})'),
      (f'  all {devices}', f'{plan.xla_flops * devices:.4g}',
       f'analytic {plan.analytic_flops * devices:.4g}'),
  ]
  if device.peak_flops:
    rows.append(('  at peak', seconds(plan.analytic_flops / device.peak_flops),
                 f"analytic FLOPs at {device.name}'s bfloat16 peak"))
  return table(title, rows)


__all__ = ['Target', 'gb', 'render_inner', 'render_pod', 'render_round', 'seconds', 'table',
           'target']
