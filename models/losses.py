"""Per-example losses and metrics, and the :class:`Model` bundle.

Algorithms consume ``loss_fn(params, batch) -> [B]`` and
``metrics_fn(params, batch) -> {'accuracy': [B], ...}`` (docs/interfaces.md):
per-example values, which the algorithm averages with the cohort's mask. A
:class:`Model` pairs a flax module with these two functions, so the rest of
the framework never touches flax directly.

Batches are dicts. Classifiers read ``batch['x']`` (inputs) and
``batch['y']`` (integer labels). Language models read ``batch['x']`` (tokens
``[B, T]``) and either ``batch['y']`` (next tokens ``[B, T]``) or, when absent,
predict ``x[:, 1:]`` from ``x[:, :-1]``; token id ``pad_id`` (0 by default) is
ignored in the loss and in the accuracy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjx import sharding

Batch = Mapping[str, jax.Array]
Params = Any


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """``-log softmax(logits)[label]`` for each example (integer labels).

  Args:
    logits: ``[..., K]`` unnormalised log-probabilities.
    labels: ``[...]`` integer class ids in ``[0, K)``.

  Returns:
    The per-example cross entropy, shape ``labels.shape``, float32.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32),
                               axis=-1)[..., 0]
  return log_z - picked


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """1.0 where ``argmax(logits) == label``, else 0.0 (per example)."""
  return (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


def masked_sequence_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of ``values [B, T]`` over the True entries of ``mask`` per row.

  A row with no True entry gives 0 (never NaN).
  """
  mask = mask.astype(values.dtype)
  return jnp.sum(values * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def batch_rng(batch: Batch, salt: int = 0) -> jax.Array:
  """A PRNG key that is a pure function of the batch's contents.

  ``loss_fn(params, batch)`` takes no key, yet dropout needs one. We derive it
  from the batch: the bits of every leaf are mixed by a multiplicative hash
  (``sum_j bits_j * (2 j + 1) * 0x9E3779B1 mod 2^32``) and folded into a fixed
  key. Different batches get different masks; the same batch always gets the
  same mask, so training stays deterministic and resumable.
  """
  acc = jnp.uint32(salt)
  for leaf in jax.tree.leaves(batch):
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
      leaf = leaf.astype(jnp.uint8)
    if jnp.dtype(leaf.dtype).itemsize != 4:
      leaf = leaf.astype(jnp.float32 if jnp.issubdtype(leaf.dtype, jnp.floating)
                         else jnp.int32)
    bits = jax.lax.bitcast_convert_type(leaf, jnp.uint32).reshape(-1)
    weights = (jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2) +
               jnp.uint32(1)) * jnp.uint32(0x9E3779B1)
    acc = acc * jnp.uint32(0x85EBCA6B) + jnp.sum(bits * weights, dtype=jnp.uint32)
  return jax.random.fold_in(jax.random.key(0x5EED), acc)


@dataclasses.dataclass(frozen=True)
class Model:
  """A flax module with its per-example loss and metrics.

  Attributes:
    name: the registry name (for messages).
    module: the ``flax.linen`` module. Its ``__call__(x, train=False)`` returns
      logits; modules with dropout take ``train=True`` and a ``'dropout'`` rng.
    task: ``'classification'`` (``x`` -> ``y``) or ``'language_modeling'``.
    dropout: whether training applies the module's dropout (with a key drawn
      by :func:`batch_rng`); evaluation never does.
    pad_id: the padding token of language models (ignored in loss/accuracy).
    layout: how the parameters lie on a mesh's ``fsdp`` and ``tensor`` axes
      (:data:`fedjx.sharding.LAYOUTS`): ``'fsdp'`` (every array on ``fsdp``
      along its largest divisible dimension) or ``'llama'`` (Megatron-style,
      :func:`fedjx.sharding.llama_param_specs`). Under a mesh with those axes
      :meth:`apply` constrains the parameters to it and splits the batch on
      ``fsdp`` (:func:`fedjx.sharding.constrain_replica`); without one it does
      nothing.
  """

  name: str
  module: nn.Module
  task: str = 'classification'
  dropout: bool = False
  pad_id: int = 0
  layout: str = 'fsdp'
  head_loss: bool = False

  def init(self, key: jax.Array, batch: Batch) -> Params:
    """Initial parameters for inputs shaped like ``batch['x']`` (``[B, ...]``)."""
    x = self._inputs_and_targets(batch)[0]
    return self.module.init(key, x, train=False)['params']

  def apply(self, params: Params, x: jax.Array, train: bool = False,
            rng: jax.Array | None = None, **kwargs) -> jax.Array:
    """Logits for inputs ``x`` (``kwargs`` go to the module)."""
    rngs = {'dropout': rng} if (train and rng is not None) else None
    params = sharding.constrain_replica(params, self.layout)
    x = sharding.constrain_batch(x)
    return self.module.apply({'params': params}, x, train=train, rngs=rngs, **kwargs)

  def _inputs_and_targets(self, batch: Batch) -> tuple[jax.Array, jax.Array]:
    if self.task == 'language_modeling' and 'y' not in batch:
      tokens = batch['x']
      return tokens[:, :-1], tokens[:, 1:]
    return batch['x'], batch['y']

  def _logits(self, params: Params, batch: Batch, train: bool):
    x, y = self._inputs_and_targets(batch)
    use_dropout = train and self.dropout
    logits = self.apply(params, x, train=use_dropout,
                        rng=batch_rng(batch) if use_dropout else None)
    return logits, y

  def _head_losses(self, params: Params, batch: Batch, train: bool):
    """Per-token ``(loss, hit, targets)`` from the module's own output head."""
    x, y = self._inputs_and_targets(batch)
    use_dropout = train and self.dropout
    loss, hit = self.apply(params, x, train=use_dropout,
                           rng=batch_rng(batch) if use_dropout else None,
                           targets=y, differentiated=train)
    return loss, hit, y

  def _loss(self, params: Params, batch: Batch, train: bool) -> jax.Array:
    if self.head_loss:
      losses, _, y = self._head_losses(params, batch, train)
    else:
      logits, y = self._logits(params, batch, train)
      losses = softmax_cross_entropy(logits, y)
    if self.task == 'language_modeling':
      return masked_sequence_mean(losses, y != self.pad_id)
    return losses

  def loss_fn(self, params: Params, batch: Batch) -> jax.Array:
    """Per-example training loss ``[B]`` (mean token loss for language models)."""
    return self._loss(params, batch, train=True)

  def eval_loss_fn(self, params: Params, batch: Batch) -> jax.Array:
    """Per-example loss ``[B]`` with dropout off."""
    return self._loss(params, batch, train=False)

  def metrics_fn(self, params: Params, batch: Batch) -> dict[str, jax.Array]:
    """Per-example metrics ``{'accuracy': [B]}`` with dropout off.

    For language models, accuracy is the fraction of non-pad tokens whose
    next token is predicted exactly.
    """
    if self.head_loss:
      _, acc, y = self._head_losses(params, batch, train=False)
    else:
      logits, y = self._logits(params, batch, train=False)
      acc = accuracy(logits, y)
    if self.task == 'language_modeling':
      acc = masked_sequence_mean(acc, y != self.pad_id)
    return {'accuracy': acc}

  def num_params(self, params: Params) -> int:
    """Total number of scalar parameters."""
    return int(sum(np.prod(np.shape(p)) for p in jax.tree.leaves(params)))


def as_features(x: jax.Array) -> jax.Array:
  """Flattens ``[B, ...]`` inputs to float ``[B, D]`` features."""
  return jnp.reshape(x, (x.shape[0], -1)).astype(jnp.float32)


ModelBuilder = Callable[..., Model]
