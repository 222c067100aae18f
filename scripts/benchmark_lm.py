"""Tokens per second, MFU and memory of a Llama-family inner step on one device.

For each preset, one AdamW inner step of ``fedjx.models.llama_lm`` (the step
``fedjx-plan`` compiles, here run with data: see
``fedjx.experiments.lm_cost.measure_inner_step``) is compiled and timed; one
JSON line per preset. MFU needs the device's peak: ``--peak_tflops``, or
``--device`` naming one of ``lm_cost.PEAK_BF16_FLOPS`` (bfloat16 dense peak), or
``--device=auto`` to take it from the device's kind (``lm_metrics.device_key``).

  python scripts/benchmark_lm.py --presets=35m,180m --batch=8 --seq_len=2048 \
      --dtype=bfloat16 --device=h200 --out=runs/lm.jsonl
  python scripts/benchmark_lm.py --presets=500k --batch=2 --seq_len=64
"""

import argparse
import json
import sys

from fedjx.experiments import lm_cost
from fedjx.experiments import lm_metrics
from fedjx.models import llama_config


def parse(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--presets', default='35m',
                 help=f'comma-separated, of {", ".join(llama_config.PRESETS)}')
  p.add_argument('--batch', type=int, default=8, help='sequences per step')
  p.add_argument('--seq_len', type=int, default=None, help="tokens per sequence (the preset's)")
  p.add_argument('--steps', type=int, default=5, help='steps per timed repeat')
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--dtype', default=None, help="compute dtype (the preset's)")
  p.add_argument('--remat', default=None, choices=[None, *llama_config.REMAT_POLICIES])
  p.add_argument('--attention', default=None, choices=[None, *llama_config.ATTENTIONS],
                 help="attention kernel (the preset's: 'auto')")
  p.add_argument('--vocab_size', type=int, default=None,
                 help="vocabulary (the preset's; e.g. 256 for a byte-level corpus)")
  p.add_argument('--param_dtype', default=None, choices=[None, *llama_config.DTYPES],
                 help="parameter and optimizer-state dtype (the preset's: float32)")
  p.add_argument('--handwritten', action='store_true',
                 help='also time benchmarks/handwritten_lm.py on the same shapes, interleaved')
  p.add_argument('--device', default=None, choices=['auto', *lm_cost.PEAK_BF16_FLOPS],
                 help='takes the peak FLOP/s for MFU from lm_cost.PEAK_BF16_FLOPS '
                      "('auto': from the first device's kind)")
  p.add_argument('--peak_tflops', type=float, default=None, help='peak TFLOP/s for MFU')
  p.add_argument('--out', default=None, help='also append the JSON lines here')
  args = p.parse_args(argv)
  presets = [s for s in args.presets.split(',') if s]
  for name in presets:
    if name not in llama_config.PRESETS:
      p.error(f'--presets holds {name!r}; allowed: {", ".join(llama_config.PRESETS)}')
  args.presets = presets
  return args


def main(argv=None) -> list[dict]:
  args = parse(argv)
  device = args.device
  if device == 'auto':
    import jax  # pylint: disable=import-outside-toplevel
    kind = jax.devices()[0].device_kind
    device = lm_metrics.device_key(kind)
    if device is None and not args.peak_tflops:
      print(f'benchmark_lm: --device=auto found {kind!r}, which has no stated peak; '
            'MFU is left out (give --peak_tflops).', file=sys.stderr)
  peak = (args.peak_tflops * 1e12 if args.peak_tflops else
          lm_cost.PEAK_BF16_FLOPS[device] if device else None)
  rows = []
  changes = {k: v for k, v in dict(attention=args.attention, vocab_size=args.vocab_size,
                                   param_dtype=args.param_dtype).items() if v is not None}
  for name in args.presets:
    config = llama_config.preset(name, **changes)
    row = lm_cost.measure_inner_step(config, batch=args.batch, seq_len=args.seq_len,
                                     steps=args.steps, repeats=args.repeats,
                                     remat=args.remat, dtype=args.dtype, peak_flops=peak)
    row = {'framework': 'fedjx', **row, 'preset': name}
    if args.handwritten:
      hand = _handwritten(config, name, args, row, peak)
      row['handwritten_tokens_per_s'] = hand['tokens_per_s']
      row['fedjx_over_handwritten'] = row['tokens_per_s'] / hand['tokens_per_s']
      rows.append(_emit(hand, args.out))
    rows.append(_emit(row, args.out))
  return rows


def _emit(row: dict, out: str | None) -> dict:
  line = json.dumps(row)
  print(line, flush=True)
  if out:
    with open(out, 'a') as f:
      f.write(line + '\n')
  return row


def _handwritten(config, name, args, row, peak) -> dict:
  """benchmarks/handwritten_lm.py on ``row``'s shapes, attention and remat policy."""
  import os  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                  'benchmarks'))
  import handwritten_lm  # pylint: disable=import-outside-toplevel
  policy = {'none': 'none', 'full': 'full', 'nothing_saveable': 'full'}.get(row['remat'], 'dots')
  attention = row['attention'] if row['attention'] in handwritten_lm.ATTENTION else 'xla'
  return handwritten_lm.measure(config, args.batch, row['seq_len'], attention, policy,
                                args.steps, args.repeats, peak, dtype=row['dtype'],
                                name=name)


if __name__ == '__main__':
  main(sys.argv[1:])
