"""``fedjx-plan``: the memory and FLOPs of one LM inner step, without data or accelerators.

::

  fedjx-plan --preset=1.3b --replicas=4 --fsdp=2 --batch=4 --seq_len=1024 \\
      --remat=full --dtype=bfloat16 --device=h100

compiles one AdamW inner step of the preset for ``replicas x fsdp`` devices
(host CPU devices unless accelerators are visible) and prints the parameter
count, bytes per device from XLA's memory analysis beside the analytic
parameter and optimizer-state bytes, FLOPs per inner step from XLA's cost
analysis (its scanned layer body counted once, and corrected for the trip
count) beside ``6 N_matmul + 12 L H h T`` per token, and whether the peak
fits the named device (:mod:`fedjx.experiments.lm_cost` has the method).
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = 'fedjx-plan'


def _parser() -> argparse.ArgumentParser:
  from fedjx.models import llama_config  # pylint: disable=import-outside-toplevel
  summary = __doc__.split('\n\n')[0].split(': ', 1)[1]
  p = argparse.ArgumentParser(prog=PROG, description=summary[0].upper() + summary[1:])
  p.add_argument('--preset', default='1m', choices=list(llama_config.PRESETS),
                 help='model shape (fedjx.models.llama_config.PRESETS) [1m]')
  p.add_argument('--replicas', type=int, default=1, help="M, mesh axis 'clients' [1]")
  p.add_argument('--fsdp', type=int, default=1, help="F devices per replica, mesh axis 'fsdp' [1]")
  p.add_argument('--batch', type=int, default=4, help='sequences per replica per inner step [4]')
  p.add_argument('--seq_len', type=int, default=None, help="tokens per sequence [the preset's]")
  p.add_argument('--remat', default=None, choices=list(llama_config.REMAT_POLICIES),
                 help="per-layer rematerialization [the preset's: none]")
  p.add_argument('--dtype', default=None, choices=list(llama_config.DTYPES),
                 help="compute dtype; parameters stay float32 [the preset's: float32]")
  from fedjx.experiments import lm_cost  # pylint: disable=import-outside-toplevel
  p.add_argument('--device', default='h100', choices=list(lm_cost.DEVICE_MEMORY),
                 help='the accelerator whose memory the peak is compared with [h100]')
  return p


def _gb(n: float) -> str:
  """Bytes in GB (MB below 1 GB)."""
  return f'{n / 1e9:,.2f} GB' if n >= 1e9 else f'{n / 1e6:,.2f} MB'


def render(plan, device: str, platform: str) -> str:
  """The lines ``fedjx-plan`` prints for an :class:`~fedjx.experiments.lm_cost.InnerStepPlan`."""
  from fedjx.experiments import lm_cost  # pylint: disable=import-outside-toplevel
  from fedjx.models import llama_config  # pylint: disable=import-outside-toplevel
  devices = plan.replicas * plan.fsdp
  analytic_params = llama_config.num_params(plan.preset)
  plural = lambda n: '' if n == 1 else 's'
  lines = [
      f'{PROG}: llama_lm preset {plan.preset}, {plan.replicas} replica{plural(plan.replicas)} '
      f'x FSDP {plan.fsdp} on {devices} {platform} device{plural(devices)}, '
      f'{plan.batch} x {plan.seq_len:,} tokens per replica per inner step, '
      f'remat {plan.remat}, compute {plan.dtype}, AdamW',
      f'parameters: {plan.params:,} (analytic {analytic_params:,})',
      f'bytes per device (XLA memory analysis): arguments {_gb(plan.argument_bytes)} '
      f'(analytic float32 parameters + AdamW moments {_gb(plan.analytic_state_bytes)}), '
      f'outputs {_gb(plan.output_bytes)}, aliased to donated arguments '
      f'{_gb(plan.alias_bytes)}, temporaries {_gb(plan.temp_bytes)}; peak '
      f'{_gb(plan.peak_bytes)}',
      f'FLOPs per inner step per device: XLA {plan.xla_flops:.4g} (its scanned layer body '
      f'counted once: {plan.xla_flops_scanned:.4g}; one layer from unscanned L=1, 2 times '
      f'L), analytic 6 N_matmul + 12 L H h T per token {plan.analytic_flops:.4g} '
      f'(XLA / analytic {plan.xla_flops / plan.analytic_flops:.3f}'
      + (', recomputation included' if plan.remat != 'none' else '') + ')',
      f'FLOPs per inner step, all {devices} device{plural(devices)}: XLA '
      f'{plan.xla_flops * devices:.4g}, '
      f'analytic {plan.analytic_flops * devices:.4g}',
      f'fits {device} ({_gb(lm_cost.device_memory(device))}): '
      f'{"yes" if plan.fits(device) else "no"} (peak {_gb(plan.peak_bytes)} per device)',
      f'compiled in {plan.compile_seconds:.1f} s',
  ]
  return '\n'.join(lines) + '\n'


def _ask_for_host_devices(argv: list[str]) -> None:
  """Sets XLA's host device count to ``replicas x fsdp`` before jax starts."""
  if 'jax' in sys.modules:
    return  # Too late; plan_inner_step says so if there are too few.
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument('--replicas', type=int, default=1)
  pre.add_argument('--fsdp', type=int, default=1)
  try:
    known, _ = pre.parse_known_args(argv)
  except SystemExit:
    return  # The full parser reports the error.
  flags = os.environ.get('XLA_FLAGS', '')
  if '--xla_force_host_platform_device_count' not in flags:
    need = max(1, known.replicas * known.fsdp)
    os.environ['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count={need}'.strip()


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  _ask_for_host_devices(argv)
  args = _parser().parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import lm_cost  # pylint: disable=import-outside-toplevel
  try:
    plan = lm_cost.plan_inner_step(args.preset, replicas=args.replicas, fsdp=args.fsdp,
                                   batch=args.batch, seq_len=args.seq_len,
                                   remat=args.remat, dtype=args.dtype)
  except ValueError as e:
    print(f'{PROG}: {e}', file=sys.stderr)
    return 2
  sys.stdout.write(render(plan, args.device, jax.devices()[0].platform))
  return 0


if __name__ == '__main__':
  sys.exit(main())
