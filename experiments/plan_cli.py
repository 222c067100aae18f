"""``fedjx-plan``: what a run costs before it runs, from shapes alone.

``fedjx-plan --config FILE[:ARG] [--config.PATH=VALUE ...]`` plans exactly
the run ``fedjx-run`` would run with the same arguments
(:mod:`fedjx.experiments.plan_config_cli`); the flags below plan a language
model's inner step, or LoRA fine-tuning, from a preset without a config.
Every plan prints a table (``--json``: one JSON line instead), held against
``--device`` (default: the accelerator JAX sees, else the host CPU, said to
be assumed); ``--tpu TOPOLOGY`` plans for a TPU topology with the TPU compiler
(:mod:`fedjx.experiments.topology_plan`).

::

  fedjx-plan --preset=1.3b --replicas=4 --fsdp=2 --batch=4 --seq_len=1024 \\
      --remat=full --dtype=bfloat16 --device=h100

compiles one AdamW inner step of the preset for ``replicas x fsdp`` devices
(host CPU devices unless accelerators are visible) and prints the parameter
count, bytes per device from XLA's memory analysis beside the analytic
parameter and optimizer-state bytes, FLOPs per inner step from XLA's cost
analysis (its scanned layer body counted once, and corrected for the trip
count) beside ``6 N_matmul + 12 L H h T`` per token, and whether the peak
fits the device (:mod:`fedjx.experiments.lm_cost` has the method).

With ``--tensor=T`` each replica is also split Megatron-style over ``T``
devices on a mesh axis ``tensor`` (heads, MLP width and vocabulary;
:func:`fedjx.sharding.llama_param_specs`), on ``replicas x fsdp x tensor``
devices::

  fedjx-plan --preset=1.3b --replicas=2 --fsdp=2 --tensor=2 --batch=4 --seq_len=1024

With ``--tpu`` the round (``--inner_steps`` inner steps of every
replica and the outer step of ``--algorithm``) is compiled for a TPU
topology by libtpu, on any machine; ``replicas x fsdp x tensor`` is every
chip of it::

  fedjx-plan --preset=35m --replicas=4 --fsdp=16 --tensor=4 --batch=16 \\
      --seq_len=2048 --dtype=bfloat16 --inner_steps=100 --tpu=v5e:16x16

With ``--schedule`` it also prints the simulated step time and compute
utilization of that schedule over a link of ``--bandwidth_gbps``
(:mod:`fedjx.experiments.network` has the model)::

  fedjx-plan --preset=1.3b --replicas=4 --schedule=diloco --inner_steps=100 \\
      --overlap_fraction=0.667 --bandwidth_gbps=10 --latency_ms=50

The compute time of an inner step is the analytic FLOPs per device over
``--mfu`` times the device's bfloat16 peak, or ``--step_seconds``; the
payload is the parameter count times ``--wire_bytes``, all-reduced between
the ``--replicas`` replicas.

With ``--lora_rank`` it plans LoRA fine-tuning instead
(:mod:`fedjx.experiments.lora_plan` has the method): one AdamW client step on
the adapters over a frozen base, on one device, and the bytes of a round::

  fedjx-plan --preset=tinyllama-1.1b --lora_rank=8 --lora_targets=q_proj,v_proj \\
      --lora_base_dtype=bfloat16 --cohort=100 --batch=4 --remat=full --device=h100

prints the frozen base, adapters, optimizer state, gradients, activations
(XLA's temporaries) and their total per device, whether it fits the device,
and the upload and download of a round (FedIT/FlexLoRA, and FLoRA's stacked
download). The fine-tuning shapes ``tinyllama-1.1b`` and ``llama2-7b``
(:data:`fedjx.experiments.lora_plan.SHAPES`) are accepted by ``--preset``
only with ``--lora_rank``; ``--replicas``, ``--fsdp`` and ``--schedule`` are
not, there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fedjx.experiments import network
from fedjx.experiments import tpu_env

PROG = 'fedjx-plan'


def _parser() -> argparse.ArgumentParser:
  from fedjx.models import llama_config  # deferred: before JAX (host device count)
  summary = __doc__.split('\n\n')[0].split(': ', 1)[1]
  p = argparse.ArgumentParser(
      prog=PROG, description=summary[0].upper() + summary[1:] + ' These flags plan a '
      'language model from a preset; a config plans as fedjx-run would run it: '
      'fedjx-plan --config FILE[:ARG] [--config.PATH=VALUE ...] [--device NAME | --tpu '
      'TOPOLOGY] [--json] (fedjx-plan --config FILE --help).')
  from fedjx.experiments import lora_plan  # deferred: before JAX (host device count)
  p.add_argument('--preset', default='1m', choices=list(llama_config.PRESETS) +
                 list(lora_plan.SHAPES),
                 help='model shape (fedjx.models.llama_config.PRESETS; tinyllama-1.1b and '
                 'llama2-7b, fedjx.experiments.lora_plan.SHAPES, only with --lora_rank) [1m]')
  p.add_argument('--replicas', type=int, default=1, help="M, mesh axis 'clients' [1]")
  p.add_argument('--fsdp', type=int, default=1, help="F devices per replica, mesh axis 'fsdp' [1]")
  p.add_argument('--tensor', type=int, default=1,
                 help="T more devices per replica, Megatron-style, mesh axis 'tensor' [1]")
  p.add_argument('--batch', type=int, default=4, help='sequences per replica per inner step [4]')
  p.add_argument('--seq_len', type=int, default=None, help="tokens per sequence [the preset's]")
  p.add_argument('--remat', default=None, choices=list(llama_config.REMAT_POLICIES),
                 help="per-layer rematerialization [the preset's: none]")
  p.add_argument('--dtype', default=None, choices=list(llama_config.DTYPES),
                 help="compute dtype; parameters stay float32 [the preset's: float32]")
  from fedjx.experiments import lm_cost  # deferred: before JAX (host device count)
  p.add_argument('--device', default=None, choices=list(lm_cost.DEVICE_MEMORY),
                 help='the accelerator whose memory the peak is compared with [the one '
                 'JAX sees, else the host CPU]')
  p.add_argument('--json', action='store_true', help='one JSON line instead of the table')
  g = p.add_argument_group('a TPU topology (fedjx.experiments.topology_plan)')
  g.add_argument('--tpu', default=None, metavar='TOPOLOGY',
                 help="compile the round for this TPU topology with libtpu's compiler: "
                 'v5e:16x16, v5e-256, v5p:4x4x4, v5p-128 (pip install -e \'.[tpu]\')')
  g.add_argument('--num_slices', type=int, default=1,
                 help='slices of --tpu, over the data-centre network [1]')
  g.add_argument('--algorithm', default='diloco', choices=['diloco', 'fedavg'],
                 help='the round --tpu plans: DiLoCo (AdamW inner steps, Nesterov '
                 'outer step) or FedAvg (SGD, the mean) [diloco]')
  g = p.add_argument_group('communication (fedjx.experiments.network)')
  g.add_argument('--schedule', default=None, choices=list(network.SCHEDULES),
                 help='when the replicas reduce; without it nothing is simulated')
  g.add_argument('--bandwidth_gbps', type=float, default=None,
                 help='bandwidth of the link between replicas, Gbit/s (with --schedule)')
  g.add_argument('--latency_ms', type=float, default=0.0, help='latency per message, ms [0]')
  g.add_argument('--topology', default='ring', choices=[t for t in network.TOPOLOGIES
                                                        if t != 'hierarchical'],
                 help='the all-reduce [ring]')
  g.add_argument('--inner_steps', type=int, default=1, help='H, inner steps per round [1]')
  g.add_argument('--fragments', type=int, default=1, help='P, streaming_diloco only [1]')
  g.add_argument('--overlap_steps', type=float, default=0.0,
                 help='tau, steps a fragment overlaps, streaming_diloco only [0]')
  g.add_argument('--overlap_fraction', type=float, default=0.0,
                 help="o, fraction of a step the reduction overlaps, data_parallel and diloco [0]")
  g.add_argument('--layers', type=int, default=None,
                 help='L, reduce layer by layer, data_parallel and diloco [no]')
  g.add_argument('--wire_bytes', type=float, default=4.0,
                 help='bytes sent per parameter [4: float32]')
  g.add_argument('--mfu', type=float, default=0.4,
                 help="model FLOPs utilization of the device's bfloat16 peak [0.4]")
  g.add_argument('--step_seconds', type=float, default=None,
                 help='compute time of an inner step, s [from the FLOPs, --mfu and --device]')
  _lora_options(p)
  return p


def _lora_options(p: argparse.ArgumentParser) -> None:
  from fedjx.models import lora_config  # deferred: before JAX (host device count)
  g = p.add_argument_group('LoRA fine-tuning (fedjx.experiments.lora_plan)')
  g.add_argument('--lora_rank', type=int, default=None,
                 help='r; plans a LoRA client step instead of a full inner step [no]')
  g.add_argument('--lora_targets', default='q_proj,v_proj',
                 help=f'adapted projections, comma-separated, of {",".join(lora_config.TARGETS)} '
                 '[q_proj,v_proj]')
  g.add_argument('--lora_base_dtype', default='float32', choices=list(lora_config.BASE_DTYPES),
                 help='storage of the frozen base [float32]')
  g.add_argument('--lora_frozen_a', action='store_true',
                 help='freeze a, train and send only b (FFA-LoRA) [no]')
  g.add_argument('--cohort', type=int, default=1, help='m, clients per round [1]')
  g.add_argument('--clients_per_device', type=int, default=1,
                 help='C, clients stepping side by side on one device over one base [1]')
  g.add_argument('--lora_extrapolate_layers', action='store_true',
                 help='compile at L = 1, 2 and extrapolate in L, not the full depth [no]')


def lora_setup(args: argparse.Namespace):
  """``(name, config, LoraConfig)`` of the ``--lora_*`` flags, or None without ``--lora_rank``.

  ValueError (naming the option) if bad.
  """
  from fedjx.experiments import lora_plan  # deferred: before JAX (host device count)
  from fedjx.models import llama_config  # deferred: before JAX (host device count)
  from fedjx.models import lora_config  # deferred: before JAX (host device count)
  if args.lora_rank is None:
    if args.preset in lora_plan.SHAPES:
      raise ValueError(f'--preset={args.preset} is a fine-tuning shape; it needs --lora_rank.')
    return None
  if args.lora_rank < 1:
    raise ValueError(f'--lora_rank={args.lora_rank} must be an integer >= 1.')
  targets = tuple(t.strip() for t in args.lora_targets.split(',') if t.strip())
  unknown = [t for t in targets if t not in lora_config.TARGETS]
  if not targets or unknown or len(set(targets)) != len(targets):
    raise ValueError(f'--lora_targets={args.lora_targets!r} must be distinct, comma-separated '
                     f'names of {",".join(lora_config.TARGETS)}.')
  for flag, value in (('--cohort', args.cohort), ('--clients_per_device',
                                                  args.clients_per_device)):
    if value < 1:
      raise ValueError(f'{flag}={value} must be a positive integer.')
  if args.replicas != 1 or args.fsdp != 1 or args.tensor != 1 or args.schedule is not None:
    raise ValueError(f'--lora_rank={args.lora_rank} plans one device: --replicas, --fsdp and '
                     '--tensor must be 1 and --schedule absent.')
  config = lora_plan.SHAPES.get(args.preset) or llama_config.PRESETS[args.preset]
  lora = lora_config.LoraConfig(rank=args.lora_rank, targets=targets,
                                base_dtype=args.lora_base_dtype,
                                train_a=not args.lora_frozen_a)
  shapes = lora_plan.projection_shapes(config)
  small = [t for t in targets if args.lora_rank > min(shapes[t])]
  if small:
    raise ValueError(f'--lora_rank={args.lora_rank} exceeds min(n_in, n_out) of '
                     f'{", ".join(f"{t} {shapes[t]}" for t in small)}.')
  return args.preset, config, lora


def plan_lora(args: argparse.Namespace):
  """The plan of ``--lora_rank`` (:func:`fedjx.experiments.lora_plan.plan_lora`)."""
  from fedjx.experiments import lora_plan  # deferred: before JAX (host device count)
  name, config, lora = lora_setup(args)
  return lora_plan.plan_lora(
      config, lora, batch=args.batch,
      seq_len=config.seq_len if args.seq_len is None else args.seq_len,
      remat=config.remat if args.remat is None else args.remat,
      clients_per_device=args.clients_per_device, cohort=args.cohort, dtype=args.dtype,
      name=name, extrapolate_layers=args.lora_extrapolate_layers)


def step_seconds(args: argparse.Namespace, flops_per_device: float,
                 peak_flops: float | None = None) -> float:
  """``--step_seconds``, or ``flops_per_device / (mfu peak)`` of ``--device``
  (``peak_flops``: the device's peak where none is named)."""
  if args.step_seconds is not None:
    return args.step_seconds
  from fedjx.experiments import lm_cost  # deferred: before JAX (host device count)
  peak = lm_cost.PEAK_BF16_FLOPS.get(args.device) if args.device else peak_flops
  if not peak:
    raise ValueError(f'device={args.device!r} has no peak FLOP/s here; give --step_seconds '
                     'or --device.')
  return flops_per_device / (args.mfu * peak)


def render_network(args: argparse.Namespace, params: int, seconds: float) -> str:
  """The lines of ``--schedule``: the simulated round of a step of ``seconds``."""
  schedule, net = network.from_flags(args)
  payload = params * args.wire_bytes
  timing = network.simulate(schedule, network.Compute.from_step_seconds(seconds), net,
                            payload, args.replicas)
  knobs = [f'H={schedule.inner_steps}']
  if schedule.kind == 'streaming_diloco':
    knobs += [f'P={schedule.fragments}', f'tau={schedule.overlap_steps:g}']
  else:
    knobs.append(f'overlap {schedule.overlap_fraction:g}')
    if schedule.layers is not None:
      knobs.append(f'{schedule.layers} layers')
  return (
      f'communication: {schedule.kind} ({", ".join(knobs)}), {net.topology} all-reduce of '
      f'{_gb(payload)} between {args.replicas} replica{"" if args.replicas == 1 else "s"} over '
      f'{args.bandwidth_gbps:g} Gbit/s, latency {args.latency_ms:g} ms\n'
      f'simulated inner step: compute {seconds:.4g} s, communication {timing.communication_seconds:.4g} s '
      f'per round of {timing.inner_steps} (exposed {timing.exposed_seconds:.4g} s), '
      f'{timing.step_seconds:.4g} s per inner step, compute utilization '
      f'{100 * timing.utilization:.1f}%\n')


def _gb(n: float) -> str:
  """Bytes in GB (MB below 1 GB)."""
  return f'{n / 1e9:,.2f} GB' if n >= 1e9 else f'{n / 1e6:,.2f} MB'


def plan_tpu(args: argparse.Namespace):
  """The plan of ``--tpu`` (:func:`fedjx.experiments.topology_plan.plan_pod`)."""
  from fedjx.experiments import topology_plan  # deferred: before JAX (host device count)
  if args.schedule is not None or args.device is not None:
    raise ValueError(f'--tpu={args.tpu} plans the round with the TPU compiler; leave out '
                     '--device and --schedule.')
  return topology_plan.plan_pod(
      args.preset, topology_plan.topology(args.tpu, args.num_slices), replicas=args.replicas,
      fsdp=args.fsdp, tensor=args.tensor, batch=args.batch, seq_len=args.seq_len,
      remat=args.remat, dtype=args.dtype, inner_steps=args.inner_steps,
      algorithm=args.algorithm)


def _ask_for_host_devices(argv: list[str]) -> None:
  """Sets XLA's host device count to ``replicas x fsdp x tensor`` before jax starts
  (not for ``--tpu``, which compiles for the topology's devices)."""
  if 'jax' in sys.modules:
    return  # Too late; plan_inner_step says so if there are too few.
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument('--replicas', type=int, default=1)
  pre.add_argument('--fsdp', type=int, default=1)
  pre.add_argument('--tensor', type=int, default=1)
  pre.add_argument('--tpu', default=None)
  try:
    known, _ = pre.parse_known_args(argv)
  except SystemExit:
    return  # The full parser reports the error.
  if known.tpu is not None:
    return  # The TPU compiler's devices, not the host's.
  flags = os.environ.get('XLA_FLAGS', '')
  if '--xla_force_host_platform_device_count' not in flags:
    need = max(1, known.replicas * known.fsdp * known.tensor)
    os.environ['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count={need}'.strip()


def _config_mode(argv: list[str]) -> bool:
  """Whether the command line plans a config (``--config``, ``--config=...``)."""
  return any(a in ('--config', '-config') or a.startswith(('--config=', '-config=', '--config.'))
             for a in argv)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  tpu_env.quiet()  # Before JAX loads libtpu, if installed.
  if _config_mode(argv):
    from fedjx.experiments import plan_config_cli  # deferred: its absl flags, --config only
    plan_config_cli.main(argv)  # Exits.
  _ask_for_host_devices(argv)
  args = _parser().parse_args(argv)
  import jax  # deferred: before JAX (host device count)
  from fedjx.experiments import lm_cost  # deferred: before JAX (host device count)
  from fedjx.experiments import lora_plan  # deferred: before JAX (host device count)
  from fedjx.experiments import plan_report  # deferred: before JAX (host device count)
  try:
    if args.num_slices != 1 and args.tpu is None:
      raise ValueError(f'--num_slices={args.num_slices} needs --tpu.')
    if lora_setup(args) is not None:
      if args.tpu is not None:
        raise ValueError(f'--tpu={args.tpu} plans a full round; plan --lora_rank without it.')
      plan = plan_lora(args)
      device = plan_report.target(args.device)
      row = dict(plan.to_json(), device=device.name, fits=device.fits(plan.total_bytes))
      out = lora_plan.render(plan, device, PROG)
    elif args.tpu is not None:
      plan = plan_tpu(args)
      row, out = plan.to_json(), plan_report.render_pod(plan, PROG)
    else:
      network.from_flags(args)  # Bad communication flags fail before the compile.
      device = plan_report.target(args.device)
      plan = lm_cost.plan_inner_step(args.preset, replicas=args.replicas, fsdp=args.fsdp,
                                     batch=args.batch, seq_len=args.seq_len,
                                     remat=args.remat, dtype=args.dtype, tensor=args.tensor)
      platform = jax.devices()[0].platform
      row = dict(kind='inner_step', **{k: v for k, v in vars(plan).items()},
                 peak_bytes=plan.peak_bytes, platform=platform, device=device.name,
                 fits=device.fits(plan.peak_bytes))
      out = plan_report.render_inner(plan, device, platform, PROG)
      if args.schedule is not None:
        out += render_network(args, plan.params,
                              step_seconds(args, plan.analytic_flops, device.peak_flops))
  except ValueError as e:
    print(f'{PROG}: {e}', file=sys.stderr)
    return 2
  sys.stdout.write(json.dumps(row) + '\n' if args.json else out)
  return 0


if __name__ == '__main__':
  sys.exit(main())
