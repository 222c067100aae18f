"""A Llama-family decoder-only transformer language model (Flax linen).

For tokens ``t_1 .. t_T`` and a :class:`~fedjx.models.llama_config.LlamaConfig`
(width ``d``, ``L`` layers, ``H`` query heads and ``K`` key/value heads of
width ``h``, MLP width ``f``)::

  x_0 = E[t]                                          embed_tokens, [T, d]
  for each layer l:
    a   = x + Attn(RMSNorm(x))                        input_layernorm, self_attn
    x   = a + MLP(RMSNorm(a))                         post_attention_layernorm, mlp
  logits = RMSNorm(x_L) W_out                         norm, lm_head (or E^T if tied)

as in Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation
Language Models"; "Llama 2", 2023), with:

* **RMSNorm** (Zhang & Sennrich 2019, "Root Mean Square Layer
  Normalization"): ``RMSNorm(x) = g * x / sqrt(mean_i x_i^2 + eps)``, a learned
  scale ``g`` and no centring or bias, computed in float32.
* **Grouped-query attention** (Ainslie et al. 2023, "GQA: Training
  Generalized Multi-Query Transformer Models from Multi-Head Checkpoints"):
  ``q = x W_q`` has ``H`` heads, ``k = x W_k`` and ``v = x W_v`` have ``K``;
  query head ``j`` attends with key/value head ``floor(j K / H)``::

    Attn(x) = concat_j softmax(q_j k_g^T / sqrt(h) + M) v_g  W_o,
    M_{st} = 0 if s >= t else -inf                          (causal)

  computed by ``jax.nn.dot_product_attention(..., is_causal=True)``, which
  takes the ``K`` heads as they are (no copy) and lets a GPU run its fused
  kernel (cuDNN flash attention) in bfloat16.
* **Rotary position embeddings** (Su et al. 2021, "RoFormer: Enhanced
  Transformer with Rotary Position Embedding") on ``q`` and ``k``: for
  position ``p`` and ``i < h/2``, the pair ``(x_i, x_{i+h/2})`` is rotated by
  the angle ``p * theta^(-2i/h)``::

    (x_i, x_{i+h/2}) -> (x_i cos - x_{i+h/2} sin, x_{i+h/2} cos + x_i sin)

  (the "rotate half" arrangement of Hugging Face's Llama, so its checkpoints
  load without permuting ``W_q, W_k``), so ``q_s . k_t`` depends on the
  positions only through ``s - t``.
* **SwiGLU MLP** (Shazeer 2020, "GLU Variants Improve Transformer"):
  ``MLP(x) = (silu(x W_gate) * (x W_up)) W_down`` with ``silu(z) = z
  sigmoid(z)``.
* No biases anywhere; weights initialised ``N(0, 0.02^2)``, norm scales 1.

**Compute and storage.** Parameters are stored in ``param_dtype`` (float32)
and the matrix products, attention and residual stream run in ``dtype``
(bfloat16 for mixed precision); RMSNorm, RoPE and the softmax run in float32.
Gradients arrive in ``param_dtype``, so the optimizer state is float32 too.

**Depth.** With ``scan_layers`` the ``L`` layers are one ``nn.scan``: their
parameters are stacked on a leading axis (``layers/.../kernel`` is
``[L, in, out]``) and XLA compiles one layer body, so compile time does not
grow with depth. Without it they are ``layers_0`` ... ``layers_{L-1}``;
:func:`stack_layers` and :func:`unstack_layers` convert between the two.
``remat`` wraps each layer in ``nn.remat`` (``jax.checkpoint``) with the named
policy (:data:`~fedjx.models.llama_config.REMAT_POLICIES`).

**Parameter layout** (Hugging Face ``LlamaForCausalLM`` name -> path here;
``[i]`` is the leading layer axis when scanned, ``layers_{i}`` otherwise; a
Hugging Face ``weight`` of a linear layer is ``[out, in]``, a Flax ``kernel``
``[in, out]``, hence the transposes)::

  model.embed_tokens.weight [V, d]                    embed_tokens/embedding
  model.layers.{i}.self_attn.q_proj.weight [H h, d]   layers/self_attn/q_proj/kernel[i]  (.T)
  model.layers.{i}.self_attn.k_proj.weight [K h, d]   layers/self_attn/k_proj/kernel[i]  (.T)
  model.layers.{i}.self_attn.v_proj.weight [K h, d]   layers/self_attn/v_proj/kernel[i]  (.T)
  model.layers.{i}.self_attn.o_proj.weight [d, H h]   layers/self_attn/o_proj/kernel[i]  (.T)
  model.layers.{i}.mlp.gate_proj.weight [f, d]        layers/mlp/gate_proj/kernel[i]     (.T)
  model.layers.{i}.mlp.up_proj.weight [f, d]          layers/mlp/up_proj/kernel[i]       (.T)
  model.layers.{i}.mlp.down_proj.weight [d, f]        layers/mlp/down_proj/kernel[i]     (.T)
  model.layers.{i}.input_layernorm.weight [d]         layers/input_layernorm/scale[i]
  model.layers.{i}.post_attention_layernorm.weight    layers/post_attention_layernorm/scale[i]
  model.norm.weight [d]                               norm/scale
  lm_head.weight [V, d]                               lm_head/kernel (.T; absent when tied)

Hugging Face's ``rms_norm_eps`` and ``rope_theta`` are ``norm_eps`` and
``rope_theta`` here; ``num_key_value_heads`` is ``num_kv_heads``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjx import execution
from fedjx.models import attention
from fedjx.models import losses
from fedjx.models import llama_config
from fedjx.models.llama_config import LlamaConfig

_INIT = nn.initializers.normal(0.02)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """``scale * x / sqrt(mean(x^2) + eps)`` over the last axis, in float32."""
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
  return y * scale.astype(jnp.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
  """Rotary embedding of ``x [B, T, N, h]`` at integer ``positions [B, T]``.

  The pair ``(x_i, x_{i+h/2})`` turns by ``positions * theta^(-2i/h)``
  (float32; the result has ``x``'s dtype).
  """
  h = x.shape[-1]
  if h % 2:
    raise ValueError(f'rope: the head width {h} must be even.')
  freq = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  angle = positions.astype(jnp.float32)[..., None] * freq  # [B, T, h/2]
  cos = jnp.cos(angle)[..., None, :]
  sin = jnp.sin(angle)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nn.Module):
  """Root-mean-square normalization with a learned scale (no bias)."""

  eps: float = 1e-5
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    return rms_norm(x, scale, self.eps).astype(self.dtype)


def _dense(config: LlamaConfig, features: int, name: str) -> nn.Dense:
  return nn.Dense(features, use_bias=False, kernel_init=_INIT, name=name,
                  dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))


def _norm(config: LlamaConfig, name: str) -> RMSNorm:
  return RMSNorm(config.norm_eps, jnp.dtype(config.dtype), jnp.dtype(config.param_dtype),
                 name=name)


class Attention(nn.Module):
  """Causal grouped-query self-attention with RoPE on queries and keys."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    c = self.config
    batch, length, _ = x.shape
    h = c.head_width
    q = _dense(c, c.num_heads * h, 'q_proj')(x).reshape(batch, length, c.num_heads, h)
    k = _dense(c, c.num_kv_heads * h, 'k_proj')(x).reshape(batch, length, c.num_kv_heads, h)
    v = _dense(c, c.num_kv_heads * h, 'v_proj')(x).reshape(batch, length, c.num_kv_heads, h)
    q = rope(q, positions, c.rope_theta)
    k = rope(k, positions, c.rope_theta)
    out = attention.causal_attention(q, k, v, c.attention, c.attention_block)
    return _dense(c, c.width, 'o_proj')(out.reshape(batch, length, c.num_heads * h))


class MLP(nn.Module):
  """The SwiGLU MLP ``(silu(x W_gate) * x W_up) W_down``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    gate = _dense(c, c.mlp_width, 'gate_proj')(x)
    up = _dense(c, c.mlp_width, 'up_proj')(x)
    return _dense(c, c.width, 'down_proj')(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  """``a = x + Attn(RMSNorm(x))``, then ``a + MLP(RMSNorm(a))``.

  Returns ``(output, None)`` so that it is a body ``nn.scan`` can run.
  """

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
    c = self.config
    x = x + Attention(c, name='self_attn')(_norm(c, 'input_layernorm')(x), positions)
    x = x + MLP(c, name='mlp')(_norm(c, 'post_attention_layernorm')(x))
    return x, None


def remat_policy(name: str):
  """The ``jax.checkpoint`` policy of :data:`~fedjx.models.llama_config.REMAT_POLICIES` ``name``.

  ``'full'`` is ``None`` (save nothing but the inputs); ``'none'`` has no policy
  (the layer is not rematerialized) and ``'auto'`` names none until
  :func:`~fedjx.models.llama_config.choose_remat` resolves it; both are
  refused here.
  """
  if name not in llama_config.REMAT_POLICIES or name in ('none', 'auto'):
    allowed = [p for p in llama_config.REMAT_POLICIES if p not in ('none', 'auto')]
    raise ValueError(f'remat_policy: {name!r} is not one of {", ".join(map(repr, allowed))}.')
  return None if name == 'full' else getattr(jax.checkpoint_policies, name)


class _Head(nn.Module):
  """The untied output head's ``kernel [d, V]`` (Hugging Face's ``lm_head``)."""

  features: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, width: int) -> jax.Array:
    return self.param('kernel', _INIT, (width, self.features), self.param_dtype)


def head_losses(x: jax.Array, head: jax.Array, targets: jax.Array, chunk: int,
                checkpoint: bool) -> tuple[jax.Array, jax.Array]:
  """Per-token cross entropy and hits of the logits ``x head``, ``chunk`` tokens at a time.

  For hidden states ``x [B, T, d]`` and the head ``[d, V]`` (both in the
  compute dtype), token ``n`` of the flattened ``B T`` has logits ``z_n = x_n
  head`` (in the compute dtype, as the logits of :class:`LlamaLM` are), and::

    loss_n = logsumexp(z_n) - z_n[target_n]      (float32)
    hit_n  = 1 if argmax z_n == target_n else 0

  ``chunk`` tokens at a time (a divisor of ``B T``; ``0`` or ``B T``: all at
  once), so only ``chunk x V`` float32 logits exist at once rather than
  ``B T V``. With ``checkpoint`` (under differentiation) each chunk's logits
  are recomputed in the backward pass instead of stored: ``2 chunk d V``
  more FLOPs per chunk for ``B T V`` fewer stored logits. Returns
  ``(loss [B, T] float32, hit [B, T] float32)``.
  """
  batch, length, width = x.shape
  tokens = batch * length
  chunk = tokens if chunk in (0, tokens) else chunk
  if tokens % chunk:
    raise ValueError(f'head_losses: chunk={chunk} does not divide the {tokens} tokens.')

  def one(xc, yc):
    logits = jnp.dot(xc, head).astype(jnp.float32)
    loss = losses.softmax_cross_entropy(logits, yc)
    return loss, losses.accuracy(logits, yc)

  if chunk == tokens:
    loss, hit = one(x, targets)
    return loss, hit
  body = jax.checkpoint(one) if checkpoint else one
  xs = x.reshape(tokens // chunk, chunk, width)
  ys = targets.reshape(tokens // chunk, chunk)
  loss, hit = jax.lax.map(lambda a: body(*a), (xs, ys))
  return loss.reshape(batch, length), hit.reshape(batch, length)


class LlamaLM(nn.Module):
  """Next-token logits ``[B, T, V]`` (in ``config.dtype``) for tokens ``[B, T]``.

  Given ``targets [B, T]``, instead the per-token ``(loss, hit)`` of
  :func:`head_losses` (float32 ``[B, T]`` each), the output head applied
  ``loss_chunk`` tokens at a time (:func:`~fedjx.models.llama_config.choose_loss_chunk`).
  ``config.remat='auto'`` is resolved here, from the batch's shape and the
  device's memory (:func:`~fedjx.models.llama_config.choose_remat`).
  """

  config: LlamaConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = False,
               positions: jax.Array | None = None, targets: jax.Array | None = None,
               differentiated: bool = False) -> Any:
    del train  # No dropout.
    c = self.config
    tokens = tokens.astype(jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    batch, length = tokens.shape[0], tokens.shape[-1]
    embed = nn.Embed(c.vocab_size, c.width, embedding_init=_INIT, name='embed_tokens',
                     dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
    x = embed(tokens)
    plan = step_plan(c, batch, length, differentiated)
    remat = plan['remat']
    layer = DecoderLayer
    if remat != 'none':
      # Under scan the loop keeps XLA from merging the recomputation away.
      layer = nn.remat(layer, policy=remat_policy(remat), prevent_cse=not c.scan_layers)
    if c.scan_layers:
      scanned = nn.scan(layer, variable_axes={'params': 0},
                        split_rngs={'params': True, 'dropout': True},
                        in_axes=nn.broadcast, length=c.num_layers)
      x, _ = scanned(c, name='layers')(x, positions)
    else:
      for i in range(c.num_layers):
        x, _ = layer(c, name=f'layers_{i}')(x, positions)
    x = _norm(c, 'norm')(x)
    dtype = jnp.dtype(c.dtype)
    if c.tie_embeddings:
      head = embed.embedding.T
    else:
      head = _Head(c.vocab_size, jnp.dtype(c.param_dtype), name='lm_head')(c.width)
    head = head.astype(dtype)
    if targets is None:
      return jnp.dot(x.astype(dtype), head)
    return head_losses(x.astype(dtype), head, targets, plan['loss_chunk'],
                       checkpoint=differentiated)


def step_plan(config: LlamaConfig, batch: int, seq_len: int, differentiated: bool = True,
              memory_bytes: int | None = None, backend: str | None = None) -> dict:
  """What ``config``'s ``'auto'`` settings stand for on a batch of ``batch x seq_len``.

  ``{'attention', 'remat', 'loss_chunk'}``: the attention kernel
  (:func:`fedjx.models.attention.resolve`), the remat policy
  (:func:`~fedjx.models.llama_config.choose_remat`) and the output head's
  chunk (:func:`~fedjx.models.llama_config.choose_loss_chunk`), for the
  device of ``memory_bytes`` on ``backend`` (default: ``config.step_memory``,
  else the memory of JAX's first device; JAX's backend).
  """
  memory = memory_bytes
  if memory is None:
    memory = config.step_memory or execution.device_memory_bytes()
  kernel = attention.resolve(config.attention, seq_len, config.dtype, backend)
  return {'attention': kernel,
          'remat': llama_config.choose_remat(config, batch, seq_len, memory, kernel),
          'loss_chunk': llama_config.choose_loss_chunk(config, batch, seq_len, differentiated,
                                                       memory, kernel)}


def stack_layers(params: Any, num_layers: int) -> Any:
  """Unscanned parameters (``layers_0`` ...) -> scanned (``layers``, stacked on axis 0)."""
  missing = [f'layers_{i}' for i in range(num_layers) if f'layers_{i}' not in params]
  if missing:
    raise ValueError(f'stack_layers: num_layers={num_layers} but the parameters lack '
                     f'{", ".join(missing)}.')
  out = {k: v for k, v in params.items() if not k.startswith('layers_')}
  out['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs),
                               *[params[f'layers_{i}'] for i in range(num_layers)])
  return out


def unstack_layers(params: Any) -> Any:
  """Scanned parameters (``layers``, stacked) -> unscanned (``layers_0`` ...)."""
  if 'layers' not in params:
    raise ValueError('unstack_layers: the parameters have no scanned "layers" entry.')
  out = {k: v for k, v in params.items() if k != 'layers'}
  num_layers = jax.tree.leaves(params['layers'])[0].shape[0]
  for i in range(num_layers):
    out[f'layers_{i}'] = jax.tree.map(lambda x, i=i: x[i], params['layers'])
  return out


def llama_lm(preset: str | LlamaConfig = '1m', vocab_size: int | None = None,
          dtype: str | None = None, remat: str | None = None,
          scan_layers: bool | None = None, pad_id: int = 0,
          **changes) -> losses.Model:
  """A language-modelling :class:`~fedjx.models.losses.Model` (:class:`LlamaLM`).

  Args:
    preset: a name in :data:`~fedjx.models.llama_config.PRESETS` (``'500k'``,
      ``'1m'``, ``'2m'``, ``'35m'``, ``'180m'``, ``'550m'``, ``'1.3b'``,
      ``'2.4b'``) or a :class:`~fedjx.models.llama_config.LlamaConfig`.
    vocab_size, dtype, remat, scan_layers: replace the preset's (``None``
      keeps it); ``dtype='bfloat16'`` computes in bfloat16 with float32
      parameters.
    pad_id: the padding token, ignored by the loss and the accuracy.
    **changes: other :class:`~fedjx.models.llama_config.LlamaConfig` fields.
  """
  given = dict(vocab_size=vocab_size, dtype=dtype, remat=remat, scan_layers=scan_layers)
  changes.update({k: v for k, v in given.items() if v is not None})
  if isinstance(preset, LlamaConfig):
    config = preset.replace(**changes) if changes else preset
  else:
    config = llama_config.preset(preset, **changes)
  return losses.Model('llama_lm', LlamaLM(config), task='language_modeling', pad_id=pad_id,
                      layout='llama', head_loss=True)


def with_step_memory(model: losses.Model, step_memory: int) -> losses.Model:
  """``model`` (of :func:`llama_lm`) whose ``'auto'`` settings plan for ``step_memory`` bytes."""
  config = model.module.config.replace(step_memory=int(step_memory))
  return dataclasses.replace(model, module=LlamaLM(config))


def param_shapes(config: LlamaConfig | str, batch: int = 1, length: int = 8) -> Any:
  """The parameters' ``jax.ShapeDtypeStruct`` tree, by ``jax.eval_shape`` (nothing allocated)."""
  config = llama_config.preset(config) if isinstance(config, str) else config
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  # The shapes do not depend on the attention kernel; XLA's takes any length.
  init = functools.partial(LlamaLM(config.replace(attention='xla')).init, train=False)
  return jax.eval_shape(init, jax.random.key(0), tokens)['params']
