"""Tokens per second and memory of federated LoRA rounds (FedIT) on one device.

A FlowerTune-shaped round: ``--clients`` clients (the cohort), each taking
``--steps`` AdamW steps of ``--batch`` sequences of ``--seq_len`` tokens on
LoRA adapters (rank ``--rank``, alpha ``2 r``, on ``--targets``) over a
frozen Llama base (``--shape``: ``tinyllama-1.1b``, ``llama2-7b`` or a
preset such as ``500k``; weights drawn at random, stored in ``--base_dtype``,
computed in ``--dtype``), then the adapters averaged
(``fedjx.algorithms.fedavg`` on the :class:`fedjx.models.lora.LoraModel`).
The round is compiled once and timed over ``--rounds`` rounds; one JSON line:
``tokens_per_s`` (trained tokens over the timed rounds' wall seconds),
``round_s``, ``compile_s``, the adapters' bytes per client, and the device's
peak memory in use (``memory_stats``, where the backend reports it).

  python scripts/benchmark_lora.py --shape=tinyllama-1.1b --dtype=bfloat16 \\
      --base_dtype=bfloat16 --seq_len=512 --out=runs/lora.jsonl
  python scripts/benchmark_lora.py --shape=500k --clients=2 --steps=2 --batch=2 --seq_len=32
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjx.algorithms as algos
from fedjx.datasets import Cohort
from fedjx.experiments import lora_plan
from fedjx.models import adapters
from fedjx.models import llama
from fedjx.models import llama_config
from fedjx.models import lora
from fedjx.models.lora_config import LoraConfig


def parse(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shape', default='tinyllama-1.1b',
                 help=f'one of {", ".join([*lora_plan.SHAPES, *llama_config.PRESETS])}')
  p.add_argument('--rank', type=int, default=32)
  p.add_argument('--targets', default='q_proj,v_proj')
  p.add_argument('--clients', type=int, default=2, help='the cohort [2]')
  p.add_argument('--steps', type=int, default=10, help='local steps per client [10]')
  p.add_argument('--batch', type=int, default=4, help='sequences per local step [4]')
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--dtype', default='float32', choices=list(llama_config.DTYPES))
  p.add_argument('--base_dtype', default='float32', choices=['float32', 'bfloat16', 'int8'])
  p.add_argument('--remat', default='full', choices=list(llama_config.REMAT_POLICIES))
  p.add_argument('--rounds', type=int, default=2, help='timed rounds [2]')
  p.add_argument('--out', default=None, help='also append the JSON line here')
  args = p.parse_args(argv)
  shapes = {**lora_plan.SHAPES, **{n: None for n in llama_config.PRESETS}}
  if args.shape not in shapes:
    p.error(f'--shape={args.shape!r}; allowed: {", ".join(shapes)}')
  for name in ('rank', 'clients', 'steps', 'batch', 'seq_len', 'rounds'):
    if getattr(args, name) < 1:
      p.error(f'--{name}={getattr(args, name)} must be >= 1')
  return args


def shape_of(args: argparse.Namespace) -> llama_config.LlamaConfig:
  base = (lora_plan.SHAPES[args.shape] if args.shape in lora_plan.SHAPES
          else llama_config.preset(args.shape))
  return base.replace(dtype=args.dtype, remat=args.remat, seq_len=args.seq_len)


def cohort(args: argparse.Namespace, vocab: int, seed: int) -> Cohort:
  """``clients x steps x batch`` random token sequences (every example real)."""
  rng = np.random.default_rng(seed)
  shape = (args.clients, args.steps, args.batch, args.seq_len + 1)
  x = rng.integers(1, vocab, size=shape, dtype=np.int32)
  n = args.steps * args.batch
  return Cohort({'x': jnp.asarray(x)}, jnp.ones(shape[:3], bool),
                jnp.full((args.clients,), float(n)), jnp.arange(args.clients, dtype=jnp.int32))


def peak_memory_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('peak_bytes_in_use')


def main(argv=None) -> dict:
  args = parse(argv)
  shape = shape_of(args)
  model = llama.llama_lm(shape)
  config = LoraConfig(rank=args.rank, alpha=2.0 * args.rank,
                      targets=tuple(t for t in args.targets.split(',') if t),
                      base_dtype=args.base_dtype)
  one = {'x': jnp.ones((1, args.seq_len + 1), jnp.int32)}
  lm = lora.lora_model(model, config, jax.random.key(0), one)
  algorithm = algos.fedavg(lm.loss_fn, client_optimizer=optax.adamw(1e-4),
                           client_evaluation=False)
  state = algorithm.init(lm.init(jax.random.key(1), one))
  cohorts = [cohort(args, shape.vocab_size, seed) for seed in range(args.rounds + 1)]
  start = time.perf_counter()
  state, metrics = algorithm.round(state, cohorts[0], jax.random.key(2))
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  for r in range(args.rounds):
    state, metrics = algorithm.round(state, cohorts[r + 1], jax.random.key(3 + r))
  jax.block_until_ready((state, metrics))
  seconds = time.perf_counter() - start
  tokens = args.rounds * args.clients * args.steps * args.batch * args.seq_len
  row = {
      'benchmark': 'lora_fedit', 'shape': args.shape,
      'params': llama_config.num_params(shape), 'rank': args.rank,
      'targets': args.targets, 'clients': args.clients, 'steps': args.steps,
      'batch': args.batch, 'seq_len': args.seq_len, 'dtype': args.dtype,
      'base_dtype': args.base_dtype, 'remat': args.remat,
      'backend': jax.default_backend(), 'device': jax.devices()[0].device_kind,
      'compile_s': compile_s, 'round_s': seconds / args.rounds,
      'tokens_per_s': tokens / seconds,
      'adapter_bytes_per_client': adapters.adapter_bytes(state.params),
      'train_loss': float(metrics['train_loss_during']) if 'train_loss_during' in metrics
                    else None,
      'peak_memory_bytes': peak_memory_bytes(),
  }
  line = json.dumps(row)
  print(line, flush=True)
  if args.out:
    with open(args.out, 'a') as f:
      f.write(line + '\n')
  return row


if __name__ == '__main__':
  main()
