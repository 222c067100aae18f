"""The 1-chip TPU plan against the same program measured on the chip: JSON lines.

Run on a TPU host (one chip is enough). For each case ``PRESET:BATCH`` (or
``PRESET:BATCH:REMAT``) of ``--cases``, in a process of its own (the device's peak memory is a
process-wide high-water mark), the inner step of
``fedjx.experiments.lm_cost.inner_step_program`` is

* planned for the 1-chip topology of the chip (``v5e:1x1``) with the TPU
  compiler from shapes alone (``fedjx.experiments.topology_plan.plan_pod``,
  what ``fedjx-plan --tpu`` prints): its peak HBM and its raw step time
  (the roofline of its FLOPs and HBM bytes), and
* measured on the chip (``fedjx.experiments.lm_cost.measure_inner_step``):
  the device's peak bytes in use, and the median step time.

The first case calibrates: ``factor = measured / raw`` step time, the
number ``experiments/tpu_calibration.json`` keeps for the chip (the last
line prints the entry to store there). Every other case is checked with it:
``step_ratio`` is measured over calibrated planned step time, ``peak_ratio``
measured over planned peak memory; ``within_10pct`` says whether both are
within 10 %. One JSON line per case, then the summary::

  python scripts/check_plan.py --cases=35m:8,180m:4:full,550m:4:full --seq_len=2048 \\
      --dtype=bfloat16 --out=runs/check_plan.jsonl
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='35m:8',
                 help='comma-separated PRESET:BATCH[:REMAT]; the first calibrates [35m:8]')
  p.add_argument('--seq_len', type=int, default=None, help="tokens per sequence [the preset's]")
  p.add_argument('--dtype', default='bfloat16', help='compute dtype [bfloat16]')
  p.add_argument('--remat', default=None,
                 help="remat policy of the cases that name none [the preset's]")
  p.add_argument('--steps', type=int, default=5, help='steps per timed repeat [5]')
  p.add_argument('--repeats', type=int, default=3, help='timed repeats [3]')
  p.add_argument('--chip', default=None,
                 help="the chip to plan for [this host's]; another than the host's only "
                 'exercises the script (its ratios compare different chips)')
  p.add_argument('--out', default=None, help='also append the JSON lines here')
  p.add_argument('--one', default=None, help=argparse.SUPPRESS)  # A case, in a child.
  args = p.parse_args(argv)
  from fedjx.experiments import topology_plan  # pylint: disable=import-outside-toplevel
  if args.chip is not None and args.chip not in topology_plan.CHIPS:
    p.error(f'--chip={args.chip!r} is not one of {", ".join(topology_plan.CHIPS)}.')
  cases = []
  for item in (s for s in args.cases.split(',') if s):
    preset, batch, remat = (item.split(':') + [None, None])[:3]
    if not (batch or '').isdigit() or int(batch) < 1 or item.count(':') > 2:
      p.error(f'--cases holds {item!r}; write PRESET:BATCH[:REMAT], e.g. 35m:8 or 550m:4:full.')
    cases.append((preset, int(batch), remat or args.remat))
  if not cases:
    p.error('--cases is empty; give PRESET:BATCH, e.g. 35m:8.')
  args.cases = cases
  return args


def one_case(preset: str, batch: int, remat: str | None, args: argparse.Namespace) -> dict:
  """Plans the 1-chip topology of this host's chip and measures the same step."""
  import jax  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import lm_cost  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import topology_plan  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  chip = (topology_plan.CHIPS.get(args.chip) if args.chip else
          next((c for c in topology_plan.CHIPS.values()
                if c.device_kind == device.device_kind), None))
  if chip is None:
    raise SystemExit(f'check_plan: the device is {device.device_kind!r}; this check runs on '
                     f'a TPU of {", ".join(c.device_kind for c in topology_plan.CHIPS.values())} '
                     '(or give --chip).')
  one_chip = f'{chip.name}:1x1' if chip.name == 'v5e' else f'{chip.name}:1x1x1'
  plan = topology_plan.plan_pod(preset, one_chip, replicas=1, fsdp=1, batch=batch,
                                seq_len=args.seq_len, remat=remat, dtype=args.dtype)
  measured = lm_cost.measure_inner_step(preset, batch=batch, seq_len=args.seq_len,
                                        steps=args.steps, repeats=args.repeats,
                                        remat=remat, dtype=args.dtype,
                                        peak_flops=chip.peak_flops)
  return {
      'chip': chip.name, 'device': device.device_kind, 'preset': preset, 'batch': batch,
      'seq_len': plan.seq_len, 'dtype': plan.config.dtype, 'remat': plan.config.remat,
      'plan_peak_bytes': plan.inner.peak_bytes,
      'measured_peak_bytes': measured['device_peak_bytes'],
      'device_compiled_peak_bytes': measured['planned_peak_bytes'],
      'plan_raw_step_s': plan.raw_step_s, 'plan_xla_seconds': plan.inner.xla_seconds,
      'plan_flops': plan.inner.flops, 'plan_hbm_bytes': plan.inner.hbm_bytes,
      'measured_step_s': measured['step_s'], 'measured_step_s_repeats':
          measured['step_s_repeats'], 'mfu': measured['mfu'],
      'jax': jax.__version__,
  }


def main(argv=None) -> list[dict]:
  from fedjx.experiments import tpu_env  # pylint: disable=import-outside-toplevel
  tpu_env.quiet()  # Before JAX starts (nothing changes on a TPU host).
  args = parse(argv)
  if args.one is not None:
    (preset, batch, remat), = args.cases
    print(json.dumps(one_case(preset, batch, remat, args)), flush=True)
    return []
  rows, factor = [], None
  for preset, batch, remat in args.cases:
    case = f'{preset}:{batch}' + (f':{remat}' if remat else '')
    child = [sys.executable, os.path.join(HERE, 'check_plan.py'), '--one=1',
             f'--cases={case}', f'--dtype={args.dtype}', f'--steps={args.steps}',
             f'--repeats={args.repeats}']
    child += [f'--seq_len={args.seq_len}'] if args.seq_len else []
    child += [f'--chip={args.chip}'] if args.chip else []
    done = subprocess.run(child, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      raise SystemExit(f'check_plan: case {case} failed:\n{done.stderr[-3000:]}')
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if factor is None:
      factor = row['measured_step_s'] / row['plan_raw_step_s']
      row['role'] = 'calibration'
    else:
      row['role'] = 'check'
    row['calibration_factor'] = factor
    row['plan_step_s'] = row['plan_raw_step_s'] * factor
    row['step_ratio'] = row['measured_step_s'] / row['plan_step_s']
    row['peak_ratio'] = (row['measured_peak_bytes'] / row['plan_peak_bytes']
                         if row['measured_peak_bytes'] else None)
    row['within_10pct'] = (abs(row['step_ratio'] - 1) <= 0.10 and row['peak_ratio'] is not None
                           and abs(row['peak_ratio'] - 1) <= 0.10)
    rows.append(row)
    _emit(row, args.out)
  first = rows[0]
  today = datetime.date.today().isoformat()
  entry = {first['chip']: {
      'measured_step_s': first['measured_step_s'], 'planned_step_s': first['plan_raw_step_s'],
      'program': (f"inner step of llama_lm {first['preset']}, {first['batch']} x "
                  f"{first['seq_len']} tokens, {first['dtype']}, remat {first['remat']}, "
                  'AdamW, one chip'),
      'source': f"measured {today} on one {first['device']}, jax {first['jax']} "
                '(scripts/check_plan.py)'}}
  summary = {'summary': True, 'cases': len(rows),
             'all_within_10pct': all(r['within_10pct'] for r in rows),
             'tpu_calibration.json': entry}
  _emit(summary, args.out)
  return rows


def _emit(row: dict, out: str | None) -> None:
  line = json.dumps(row)
  print(line, flush=True)
  if out:
    with open(out, 'a', encoding='utf-8') as f:
      f.write(line + '\n')


if __name__ == '__main__':
  main(sys.argv[1:])
