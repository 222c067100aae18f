"""A hand-written Llama training step in plain JAX: the yardstick for fedjx's.

The same network as ``fedjx.models.llama`` (RMSNorm, RoPE in the rotate-half
arrangement, grouped-query causal attention, SwiGLU MLP, tied or untied
embeddings; Touvron et al. 2023), written here from its equations with
``jax.numpy`` alone: parameters are a dict of stacked ``[L, ...]`` arrays,
the layers one ``lax.scan``, each layer under ``jax.checkpoint`` with the
chosen policy, attention through ``jax.nn.dot_product_attention`` (``xla``)
or the Pallas TPU kernels shipped with JAX (``splash``, ``flash``), the loss
the mean token cross entropy over all ``B T`` float32 logits, and AdamW
(``b2 = 0.99``, weight decay 0.1) from optax. Nothing of fedjx's model code
is used: only the shapes of its presets (``llama_config.PRESETS``) and its
FLOP count, so both are measured against the same model FLOPs.

  python benchmarks/handwritten_lm.py --preset=35m --batch=8 --attention=splash
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjx.models import llama_config

POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def init_params(shape: llama_config.LlamaConfig, key: jax.Array) -> dict:
  """``N(0, 0.02^2)`` weights, unit norm scales, stacked over the ``L`` layers."""
  d, f, L = shape.width, shape.mlp_width, shape.num_layers
  hq, hkv = shape.num_heads * shape.head_width, shape.num_kv_heads * shape.head_width
  sizes = {'wq': (L, d, hq), 'wk': (L, d, hkv), 'wv': (L, d, hkv), 'wo': (L, hq, d),
           'w_gate': (L, d, f), 'w_up': (L, d, f), 'w_down': (L, f, d),
           'embed': (shape.vocab_size, d)}
  if not shape.tie_embeddings:
    sizes['head'] = (d, shape.vocab_size)
  keys = jax.random.split(key, len(sizes))
  params = {name: 0.02 * jax.random.normal(k, size, jnp.float32)
            for k, (name, size) in zip(keys, sorted(sizes.items()))}
  params.update(norm1=jnp.ones((L, d)), norm2=jnp.ones((L, d)), norm=jnp.ones((d,)))
  return params


def rms(x, g, eps):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g


def rotate(x, pos, theta):
  h = x.shape[-1]
  angle = pos[:, None].astype(jnp.float32) * theta ** (-jnp.arange(0, h, 2) / h)
  cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
  a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)


def splash_attention(q, k, v):
  """Causal GQA with the splash kernel: one multi-query kernel per key/value head."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=import-outside-toplevel
  b, t, heads, h = q.shape
  groups = k.shape[2]
  block = min(512, t)
  mask = splash.MultiHeadMask([splash.CausalMask((t, t))] * (heads // groups))
  sizes = splash.BlockSizes(block, block, block, block, block, block, block, block)
  kernel = splash.make_splash_mqa_single_device(mask=mask, block_sizes=sizes)
  qg = (q * h ** -0.5).astype(q.dtype).reshape(b, t, groups, heads // groups, h)
  out = jax.vmap(jax.vmap(kernel))(qg.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3),
                                   v.transpose(0, 2, 1, 3))
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, heads, h)


def flash_attention(q, k, v):
  """Causal attention with the flash kernel, key/value heads repeated to ``H``."""
  from jax.experimental.pallas.ops.tpu import flash_attention as flash  # pylint: disable=import-outside-toplevel
  heads, h = q.shape[2], q.shape[3]
  r = heads // k.shape[2]
  qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  kh, vh = jnp.repeat(kh, r, 1), jnp.repeat(vh, r, 1)
  block = min(512, q.shape[1])
  sizes = flash.BlockSizes(block, block, block, 1, block, block, block, block, block,
                           block, block)
  out = flash.flash_attention(qh, kh, vh, causal=True, sm_scale=h ** -0.5, block_sizes=sizes)
  return out.transpose(0, 2, 1, 3)


def xla_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


ATTENTION = {'xla': xla_attention, 'splash': splash_attention, 'flash': flash_attention}


def loss_fn(params, tokens, shape, attention, policy, dtype):
  """Mean next-token cross entropy of ``tokens [B, T + 1]``."""
  x_tok, y = tokens[:, :-1], tokens[:, 1:]
  b, t = x_tok.shape
  heads, groups, h = shape.num_heads, shape.num_kv_heads, shape.head_width
  pos = jnp.arange(t)
  cast = lambda w: w.astype(dtype)
  x = cast(params['embed'])[x_tok]

  def layer(x, w):
    a = cast(rms(x, w['norm1'], shape.norm_eps))
    q = (a @ cast(w['wq'])).reshape(b, t, heads, h)
    k = (a @ cast(w['wk'])).reshape(b, t, groups, h)
    v = (a @ cast(w['wv'])).reshape(b, t, groups, h)
    q, k = rotate(q, pos, shape.rope_theta), rotate(k, pos, shape.rope_theta)
    o = attention(q, k, v).reshape(b, t, heads * h)
    x = x + o @ cast(w['wo'])
    m = cast(rms(x, w['norm2'], shape.norm_eps))
    x = x + (jax.nn.silu(m @ cast(w['w_gate'])) * (m @ cast(w['w_up']))) @ cast(w['w_down'])
    return x, None

  if policy != 'none':
    layer = jax.checkpoint(layer, policy=POLICIES[policy])
  stacked = {k: params[k] for k in ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down',
                                    'norm1', 'norm2')}
  x, _ = jax.lax.scan(layer, x, stacked)
  x = cast(rms(x, params['norm'], shape.norm_eps))
  head = cast(params['embed']).T if shape.tie_embeddings else cast(params['head'])
  logits = (x @ head).astype(jnp.float32)
  picked = jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def make_step(shape, attention='splash', policy='none', dtype=jnp.bfloat16):
  """The jitted AdamW step ``(params, opt_state, tokens) -> (params, opt_state, loss)``."""
  opt = optax.adamw(1e-3, b2=0.99, weight_decay=0.1)
  loss = functools.partial(loss_fn, shape=shape, attention=ATTENTION[attention],
                           policy=policy, dtype=dtype)

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1)), opt


def measure(preset: str | llama_config.LlamaConfig, batch: int, seq_len: int = 2048,
            attention: str = 'splash', policy: str = 'none', steps: int = 5, repeats: int = 3,
            peak_flops: float | None = None, seed: int = 0, dtype: str = 'bfloat16',
            name: str | None = None) -> dict:
  """Seconds per step (median of ``repeats`` x ``steps`` after a warm-up), tokens/s, MFU.

  ``preset`` is a preset's name or a shape (its ``vocab_size`` and
  ``param_dtype`` are used; its compute settings are not).
  """
  shape = llama_config.preset(preset) if isinstance(preset, str) else preset
  name = name or (preset if isinstance(preset, str) else 'custom')
  step, opt = make_step(shape, attention, policy, jnp.dtype(dtype))
  k_init, k_tok = jax.random.split(jax.random.key(seed))
  params = jax.tree.map(lambda x: x.astype(shape.param_dtype), init_params(shape, k_init))
  opt_state = opt.init(params)
  tokens = jax.random.randint(k_tok, (batch, seq_len + 1), 1, shape.vocab_size, jnp.int32)
  start = time.perf_counter()
  compiled = step.lower(params, opt_state, tokens).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  params, opt_state, loss = compiled(params, opt_state, tokens)
  first = float(loss)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps):
      params, opt_state, loss = compiled(params, opt_state, tokens)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - start) / steps)
  step_s = statistics.median(times)
  flops = llama_config.train_flops_per_token(shape, seq_len) * batch * seq_len
  return {
      'framework': 'handwritten', 'preset': name, 'batch': batch, 'seq_len': seq_len,
      'vocab_size': shape.vocab_size, 'param_dtype': shape.param_dtype,
      'attention': attention, 'remat': policy, 'compile_s': round(compile_s, 3),
      'step_s': step_s, 'step_s_repeats': times, 'tokens_per_s': batch * seq_len / step_s,
      'mfu': flops / step_s / peak_flops if peak_flops else None,
      'planned_temp_bytes': int(memory.temp_size_in_bytes),
      'first_loss': first, 'last_loss': float(loss),
      'device': jax.devices()[0].device_kind,
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--preset', default='35m', choices=list(llama_config.PRESETS))
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--seq_len', type=int, default=2048)
  p.add_argument('--attention', default='splash', choices=list(ATTENTION))
  p.add_argument('--remat', default='none', choices=list(POLICIES))
  p.add_argument('--steps', type=int, default=5)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--peak_tflops', type=float, default=None)
  args = p.parse_args(argv)
  row = measure(args.preset, args.batch, args.seq_len, args.attention, args.remat,
                args.steps, args.repeats,
                args.peak_tflops * 1e12 if args.peak_tflops else None)
  print(json.dumps(row), flush=True)
  return row


if __name__ == '__main__':
  main(sys.argv[1:])
