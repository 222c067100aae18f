"""The 1-chip TPU plan against the same program measured on the chip: JSON lines.

Run on a TPU host (one chip is enough). For each case of ``--cases``,
``PRESET:BATCH[:REMAT[:VOCAB]]`` (REMAT empty or ``auto``: resolved for the
chip; VOCAB: the vocabulary's size, the preset's where not given, e.g.
``35m:8::256`` for the byte vocabulary), in a process of its own, the
inner step of ``fedjx.experiments.lm_cost.inner_step_program`` is

* planned for the 1-chip topology of the chip (``v5e:1x1``) with the TPU
  compiler from shapes alone (``fedjx.experiments.topology_plan.plan_pod``,
  what ``fedjx-plan --tpu`` prints): its peak HBM, its compute time
  ``FLOPs / peak`` and HBM time ``HBM bytes / bandwidth``, and
* measured on the chip, the program the plan resolved (attention kernel,
  remat, loss chunks; ``fedjx.experiments.lm_cost.measure_inner_step``):
  the median step time, and its peak memory bracketed against the plan
  (``lm_cost.peak_bracket``): with a ballast array leaving only 1.1 times
  the planned peak free the step must run (peak <= 1.1 x plan), with 0.9
  times it must fail out of memory (peak >= 0.9 x plan).

The calibration ``step = f max(compute, HBM)``, the roofline times one
factor per chip (``topology_plan.fit_calibration``, least squares in
relative error), is fitted on the calibrating cases and checks the others:
``--calibrate=N`` fits the first N cases and checks the rest with that
factor; ``--calibrate=loo`` (the default) checks each case with the factor
fitted on all the others (leave-one-out) and keeps the fit on all of them.
``--judge=FILE`` measures nothing and refits the case rows of an earlier
run's JSON lines. Per case:
``step_ratio`` is planned (calibrated) over measured step time,
``peak_within_10pct`` the bracket, ``within_10pct`` both. One JSON line
per case, then the summary with the chip's entry for
``experiments/tpu_calibration.json``::

  python scripts/check_plan.py --cases=35m:8,35m:8::256,180m:4::256,180m:4 \\
      --seq_len=2048 --dtype=bfloat16 --out=runs/check_plan.jsonl
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CASE_FORMAT = 'PRESET:BATCH[:REMAT[:VOCAB]]'


def parse_case(item: str, remat: str | None = None, vocab_size: int | None = None):
  """``(preset, batch, remat, vocab_size)`` of ``PRESET:BATCH[:REMAT[:VOCAB]]``.

  An empty or absent REMAT is ``remat``, an absent VOCAB ``vocab_size``
  (None: the preset's). ValueError naming the format otherwise.
  """
  parts = item.split(':')
  preset, batch = parts[0], parts[1] if len(parts) > 1 else ''
  rest = parts[2:] + [''] * (4 - len(parts))
  case_remat, vocab = rest[0], rest[1]
  if (len(parts) > 4 or not preset or not batch.isdigit() or int(batch) < 1
      or (vocab and (not vocab.isdigit() or int(vocab) < 2))):
    raise ValueError(f'{item!r}: write {CASE_FORMAT}, e.g. 35m:8, 550m:4:full or 35m:8::256.')
  return preset, int(batch), case_remat or remat, int(vocab) if vocab else vocab_size


def case_name(preset: str, batch: int, remat: str | None, vocab: int | None) -> str:
  """The ``--cases`` item of a case (:func:`parse_case`'s inverse)."""
  name = f'{preset}:{batch}'
  if remat or vocab:
    name += f':{remat or ""}'
  if vocab:
    name += f':{vocab}'
  return name


def parse(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='35m:8,35m:8::256,180m:4::256,180m:4',
                 help=f'comma-separated {CASE_FORMAT} [35m:8,35m:8::256,180m:4::256,180m:4]')
  p.add_argument('--calibrate', default='loo',
                 help='N: fit on the first N cases, check the rest; loo: check each case '
                 'with the fit on the others, keep the fit on all [loo]')
  p.add_argument('--seq_len', type=int, default=None, help="tokens per sequence [the preset's]")
  p.add_argument('--dtype', default='bfloat16', help='compute dtype [bfloat16]')
  p.add_argument('--remat', default=None,
                 help="remat policy of the cases that name none [the preset's]")
  p.add_argument('--vocab_size', type=int, default=None,
                 help="vocabulary of the cases that name none [the preset's]")
  p.add_argument('--steps', type=int, default=5, help='steps per timed repeat [5]')
  p.add_argument('--repeats', type=int, default=3, help='timed repeats [3]')
  p.add_argument('--no_bracket', action='store_true',
                 help="skip the peak memory's bracket (time only)")
  p.add_argument('--chip', default=None,
                 help="the chip to plan for [this host's]; another than the host's only "
                 'exercises the script (its ratios compare different chips)')
  p.add_argument('--out', default=None, help='also append the JSON lines here')
  p.add_argument('--judge', default=None, metavar='JSONL',
                 help="measure nothing: fit and check the case rows of this file (this "
                 "script's earlier output; --cases is ignored)")
  p.add_argument('--one', default=None, help=argparse.SUPPRESS)  # A case, in a child.
  args = p.parse_args(argv)
  from fedjx.experiments import topology_plan  # pylint: disable=import-outside-toplevel
  if args.chip is not None and args.chip not in topology_plan.CHIPS:
    p.error(f'--chip={args.chip!r} is not one of {", ".join(topology_plan.CHIPS)}.')
  cases = []
  for item in (s for s in args.cases.split(',') if s):
    try:
      cases.append(parse_case(item, args.remat, args.vocab_size))
    except ValueError as e:
      p.error(f'--cases holds {e}')
  if not cases:
    p.error(f'--cases is empty; give {CASE_FORMAT}, e.g. 35m:8.')
  args.cases, args.rows = cases, None
  if args.judge is not None:
    args.rows = cases = read_rows(args.judge)
    if not cases:
      p.error(f'--judge={args.judge!r} holds no case rows of this script.')
  if args.one is None:
    if args.calibrate == 'loo':
      if len(cases) < 2:
        p.error('--calibrate=loo needs at least two cases (each is checked with the fit '
                'on the others).')
    elif not args.calibrate.isdigit() or not 1 <= int(args.calibrate) <= len(cases):
      p.error(f'--calibrate={args.calibrate!r}: give loo, or N from 1 to the {len(cases)} '
              'cases (the first N are fitted).')
  return args


def read_rows(path: str) -> list[dict]:
  """The case rows (measured and planned) of a file of this script's JSON lines;
  a case measured more than once counts with its last row."""
  rows = {}
  with open(path, encoding='utf-8') as f:
    for line in f:
      line = line.strip()
      if not line.startswith('{'):
        continue
      row = json.loads(line)
      if 'measured_step_s' in row and 'plan_compute_s' in row:
        rows[row['case']] = row
  return list(rows.values())


def case_config(preset: str, remat: str | None, vocab: int | None, dtype: str | None):
  """The model of a case: the preset with its remat, vocabulary and dtype replaced."""
  from fedjx.models import llama_config  # pylint: disable=import-outside-toplevel
  changes = {k: v for k, v in dict(remat=remat, vocab_size=vocab, dtype=dtype).items()
             if v is not None}
  return llama_config.preset(preset).replace(**changes)


def one_case(preset: str, batch: int, remat: str | None, vocab: int | None,
             args: argparse.Namespace) -> dict:
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
  config = case_config(preset, remat, vocab, args.dtype)
  plan = topology_plan.plan_pod(config, one_chip, replicas=1, fsdp=1, batch=batch,
                                seq_len=args.seq_len, name=preset)
  times = plan.times(plan.inner)
  measured = lm_cost.measure_inner_step(
      plan.config, batch=batch, seq_len=plan.seq_len, steps=args.steps, repeats=args.repeats,
      peak_flops=chip.peak_flops,
      bracket_peak_bytes=None if args.no_bracket else plan.inner.peak_bytes)
  bracket = measured.get('peak_bracket')
  c = plan.config
  return {
      'chip': chip.name, 'device': device.device_kind, 'case': case_name(preset, batch, remat,
                                                                          vocab),
      'preset': preset, 'batch': batch, 'seq_len': plan.seq_len,
      'vocab_size': c.vocab_size, 'dtype': c.dtype, 'param_dtype': c.param_dtype,
      'remat': c.remat, 'attention': c.attention, 'loss_chunk': c.loss_chunk,
      'plan_peak_bytes': plan.inner.peak_bytes,
      'device_compiled_peak_bytes': measured['planned_peak_bytes'],
      'device_peak_bytes_in_use': measured['device_peak_bytes'],
      'peak_bracket': bracket,
      'peak_within_10pct': bracket['peak_within_10pct'] if bracket else None,
      'plan_raw_step_s': plan.raw_step_s, 'plan_compute_s': times['compute'],
      'plan_hbm_s': times['hbm'], 'plan_xla_seconds': plan.inner.xla_seconds,
      'plan_flops': plan.inner.flops, 'plan_analytic_flops': plan.analytic_flops,
      'plan_hbm_bytes': plan.inner.hbm_bytes,
      'measured_step_s': measured['step_s'],
      'measured_step_s_repeats': measured['step_s_repeats'], 'mfu': measured['mfu'],
      'jax': jax.__version__, 'libtpu': _libtpu_version(),
      'date': datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
  }


def _libtpu_version() -> str | None:
  try:
    from importlib import metadata  # pylint: disable=import-outside-toplevel
    return metadata.version('libtpu')
  except Exception:  # pylint: disable=broad-except
    return None


def to_case(row: dict):
  """The :class:`~fedjx.experiments.topology_plan.CalibrationCase` of a case's row."""
  from fedjx.experiments import topology_plan  # pylint: disable=import-outside-toplevel
  program = (f"inner step of llama_lm {row['preset']}, {row['batch']} x {row['seq_len']} "
             f"tokens, vocabulary {row['vocab_size']}, {row['dtype']}, attention "
             f"{row['attention']}, remat {row['remat']}, loss chunk {row['loss_chunk']}, "
             'AdamW, one chip')
  info = {k: row.get(k) for k in ('case', 'preset', 'batch', 'seq_len', 'vocab_size', 'dtype',
                                  'param_dtype', 'remat', 'attention', 'loss_chunk')}
  info.update(planned_flops=row['plan_flops'], planned_analytic_flops=row.get(
      'plan_analytic_flops'), planned_hbm_bytes=row['plan_hbm_bytes'],
              planned_peak_bytes=row['plan_peak_bytes'],
              peak_within_10pct=row.get('peak_within_10pct'),
              source=(f"measured {row.get('date')} on one {row['device']}, jax "
                      f"{row.get('jax')}, libtpu {row.get('libtpu')} (scripts/check_plan.py)"))
  return topology_plan.CalibrationCase(program, row['measured_step_s'], row['plan_compute_s'],
                                       row['plan_hbm_s'], info)


def judge(rows: list[dict], calibrate: str) -> dict:
  """Fits the calibration on ``rows`` as ``calibrate`` says and checks each row (in place).

  Each row gains ``role`` (``'calibration'`` or ``'check'``; with ``'loo'``
  every row is both, checked by the fit on the others),
  ``calibration_factor`` (the factor it was checked with), ``plan_step_s``
  (the factor times the plan's roofline), ``step_ratio``
  (planned over measured) and ``within_10pct`` (the step within 10 % and
  the peak's bracket). Returns the chip's fitted entry for
  ``tpu_calibration.json`` (:meth:`Calibration.to_json`).
  """
  from fedjx.experiments import topology_plan  # pylint: disable=import-outside-toplevel
  cases = [to_case(r) for r in rows]
  n = len(rows) if calibrate == 'loo' else int(calibrate)
  fit = topology_plan.fit_calibration(cases[:n])
  for i, (row, case) in enumerate(zip(rows, cases)):
    if calibrate == 'loo':
      factor = topology_plan.fit_calibration(cases[:i] + cases[i + 1:])
      row['role'] = 'calibration, checked leaving itself out'
    else:
      factor = fit
      row['role'] = 'calibration' if i < n else 'check'
    row['calibration_factor'] = factor
    row['plan_step_s'] = factor * case.roofline_s
    row['step_ratio'] = row['plan_step_s'] / row['measured_step_s']
    row['within_10pct'] = (abs(row['step_ratio'] - 1) <= 0.10
                           and row.get('peak_within_10pct') is True)
  chip = rows[0]['chip']
  source = (f"{rows[0].get('date')}, {rows[0]['device']}, jax {rows[0].get('jax')}, libtpu "
            f"{rows[0].get('libtpu')}, scripts/check_plan.py")
  cal = topology_plan.Calibration(chip, fit, tuple(cases[:n]), source)
  return {chip: cal.to_json()}


def main(argv=None) -> list[dict]:
  from fedjx.experiments import tpu_env  # pylint: disable=import-outside-toplevel
  tpu_env.quiet()  # Before JAX starts (nothing changes on a TPU host).
  args = parse(argv)
  if args.one is not None:
    (preset, batch, remat, vocab), = args.cases
    print(json.dumps(one_case(preset, batch, remat, vocab, args)), flush=True)
    return []
  if args.rows is not None:
    rows = args.rows
  else:
    rows = measure(args)
  n = len(rows) if args.calibrate == 'loo' else int(args.calibrate)
  if len(rows) < max(n, 2 if args.calibrate == 'loo' else 1):
    raise SystemExit(f'check_plan: {len(rows)} case(s) measured; --calibrate='
                     f'{args.calibrate} needs more.')
  entry = judge(rows, args.calibrate)
  for row in rows:
    _emit({'case': row['case'], 'role': row['role'],
           'calibration_factor': row['calibration_factor'], 'plan_step_s': row['plan_step_s'],
           'measured_step_s': row['measured_step_s'], 'step_ratio': row['step_ratio'],
           'peak_within_10pct': row['peak_within_10pct'],
           'within_10pct': row['within_10pct']}, args.out)
  chip = next(iter(entry))
  summary = {'summary': True, 'cases': len(rows), 'calibrate': args.calibrate,
             'factor': entry[chip]['factor'],
             'all_within_10pct': all(r['within_10pct'] for r in rows),
             'tpu_calibration.json': entry}
  _emit(summary, args.out)
  return rows


def measure(args: argparse.Namespace) -> list[dict]:
  """Each case planned and measured in a child process; a case that fails is
  reported (``{'case', 'error'}``) and left out."""
  rows = []
  for preset, batch, remat, vocab in args.cases:
    case = case_name(preset, batch, remat, vocab)
    child = [sys.executable, os.path.join(HERE, 'check_plan.py'), '--one=1',
             f'--cases={case}', f'--dtype={args.dtype}', f'--steps={args.steps}',
             f'--repeats={args.repeats}']
    child += [f'--seq_len={args.seq_len}'] if args.seq_len else []
    child += [f'--chip={args.chip}'] if args.chip else []
    child += ['--no_bracket'] if args.no_bracket else []
    done = subprocess.run(child, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      print(done.stderr[-3000:], file=sys.stderr, flush=True)
      _emit({'case': case, 'error': f'exit {done.returncode}: '
             + ' '.join(done.stderr.strip().splitlines()[-1:])[:500]}, args.out)
      continue
    row = json.loads(done.stdout.strip().splitlines()[-1])
    rows.append(row)
    _emit(row, args.out)  # Each case as it comes: a later one may not finish.
  return rows


def _emit(row: dict, out: str | None) -> None:
  line = json.dumps(row)
  print(line, flush=True)
  if out:
    with open(out, 'a', encoding='utf-8') as f:
      f.write(line + '\n')


if __name__ == '__main__':
  main(sys.argv[1:])
