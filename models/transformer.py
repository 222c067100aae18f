"""A small decoder-only transformer language model (GPT-style, pre-norm).

``tokens -> embed + learned positions -> L x [x + attn(ln(x)); x + mlp(ln(x))]
-> ln -> logits``, with causal self-attention
``softmax(q k^T / sqrt(d_head) + causal_mask) v`` (Vaswani et al. 2017;
the pre-norm arrangement of Radford et al. 2019). It is the model DiLoCo
(Douillard et al. 2023) trains, at toy scale.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjx.models import losses


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention where position ``t`` sees positions ``<= t``."""

  num_heads: int
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    batch, length, width = x.shape
    if width % self.num_heads:
      raise ValueError(f'CausalSelfAttention: width {width} is not divisible '
                       f'by num_heads={self.num_heads}.')
    head = width // self.num_heads
    qkv = nn.Dense(3 * width, name='qkv')(x)
    qkv = qkv.reshape(batch, length, 3, self.num_heads, head)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(head).astype(x.dtype)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    if self.dropout_rate > 0:
      weights = nn.Dropout(self.dropout_rate, deterministic=not train)(weights)
    out = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(batch, length, width)
    return nn.Dense(width, name='out')(out)


class DecoderBlock(nn.Module):
  """``x + attn(ln(x))`` then ``x + mlp(ln(x))`` with a GELU MLP."""

  num_heads: int
  mlp_ratio: int = 4
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    width = x.shape[-1]
    h = CausalSelfAttention(self.num_heads, self.dropout_rate, name='attn')(
        nn.LayerNorm(name='ln1')(x), train)
    if self.dropout_rate > 0:
      h = nn.Dropout(self.dropout_rate, deterministic=not train)(h)
    x = x + h
    h = nn.LayerNorm(name='ln2')(x)
    h = nn.Dense(width * self.mlp_ratio, name='mlp_in')(h)
    h = nn.Dense(width, name='mlp_out')(nn.gelu(h))
    if self.dropout_rate > 0:
      h = nn.Dropout(self.dropout_rate, deterministic=not train)(h)
    return x + h


class TransformerLM(nn.Module):
  """Decoder-only transformer returning next-token logits ``[B, T, V]``.

  Attributes:
    vocab_size: tokens ``V``.
    max_len: the longest sequence (size of the position table).
    width: model width ``d``.
    num_layers: decoder blocks.
    num_heads: attention heads (``d`` must be divisible by it).
    mlp_ratio: hidden width of the MLP as a multiple of ``d``.
    dropout_rate: dropout on attention weights and residual branches.
  """

  vocab_size: int
  max_len: int = 128
  width: int = 128
  num_layers: int = 2
  num_heads: int = 4
  mlp_ratio: int = 4
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
    length = tokens.shape[-1]
    if length > self.max_len:
      raise ValueError(f'TransformerLM: sequence length {length} exceeds '
                       f'max_len={self.max_len}.')
    init = nn.initializers.normal(0.02)
    x = nn.Embed(self.vocab_size, self.width, embedding_init=init,
                 name='embed')(tokens.astype(jnp.int32))
    pos = self.param('positions', init, (self.max_len, self.width))
    x = x + pos[:length]
    for i in range(self.num_layers):
      x = DecoderBlock(self.num_heads, self.mlp_ratio, self.dropout_rate,
                       name=f'block{i}')(x, train)
    x = nn.LayerNorm(name='ln_final')(x)
    return nn.Dense(self.vocab_size, name='logits')(x)


def transformer_lm(vocab_size: int, max_len: int = 128, width: int = 128,
                   num_layers: int = 2, num_heads: int = 4, mlp_ratio: int = 4,
                   dropout_rate: float = 0.0, pad_id: int = 0) -> losses.Model:
  """A language-modelling :class:`~fedjx.models.losses.Model` (:class:`TransformerLM`)."""
  module = TransformerLM(vocab_size, max_len, width, num_layers, num_heads,
                         mlp_ratio, dropout_rate)
  return losses.Model('transformer_lm', module, task='language_modeling',
                      dropout=dropout_rate > 0, pad_id=pad_id)
