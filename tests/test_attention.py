"""Attention kernels and the chunked output head against XLA and float64 NumPy.

The Pallas splash kernel runs here in Pallas' interpret mode (the CPU), the
same kernel a TPU compiles; its results are compared with XLA's attention
and with causal grouped-query attention written in float64 NumPy. Float32
sums of ``T`` terms of size ``O(1)`` differ by ``O(T eps32)``: with ``T =
256`` and ``eps32 = 1.2e-7`` that is about 3e-5, hence tolerances of 1e-4
on outputs and gradients (sums of ``T`` such terms again: 1e-3 relative).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjx.models import attention
from fedjx.models import llama
from fedjx.models import llama_config

B, T, H, K, D = 2, 256, 4, 2, 32


def _qkv(seed=0, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (B, T, H, D), dtype)
  k = jax.random.normal(keys[1], (B, T, K, D), dtype)
  v = jax.random.normal(keys[2], (B, T, K, D), dtype)
  return q, k, v


def _reference(q, k, v):
  """Causal GQA in float64: query head j reads key/value head floor(j K / H)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  heads, groups = q.shape[2], k.shape[2]
  out = np.zeros_like(q)
  mask = np.tril(np.ones((q.shape[1], q.shape[1]), bool))
  for j in range(heads):
    g = j * groups // heads
    s = np.einsum('bsd,btd->bst', q[:, :, j], k[:, :, g]) / np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[:, :, j] = np.einsum('bst,btd->bsd', p, v[:, :, g])
  return out


@pytest.mark.parametrize('implementation', ['xla', 'splash'])
def test_attention_equals_float64_reference(implementation):
  q, k, v = _qkv()
  out = attention.causal_attention(q, k, v, implementation, block=128)
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v), atol=1e-4, rtol=1e-4)


def test_splash_gradients_equal_xla_gradients():
  q, k, v = _qkv(1)
  w = jax.random.normal(jax.random.key(2), (B, T, H, D))

  def grads(implementation):
    f = lambda q, k, v: jnp.sum(w * attention.causal_attention(q, k, v, implementation,
                                                                block=128))
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  for got, want in zip(grads('splash'), grads('xla')):
    scale = float(np.max(np.abs(np.asarray(want))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3 * scale)


def test_auto_resolves_from_the_backend():
  assert attention.resolve('auto', 2048, jnp.bfloat16, 'tpu') == 'splash'
  assert attention.resolve('auto', 100, jnp.bfloat16, 'tpu') == 'xla'
  assert attention.resolve('auto', 2048, jnp.bfloat16, 'gpu') == 'cudnn'
  assert attention.resolve('auto', 2048, jnp.float32, 'gpu') == 'xla'
  assert attention.resolve('auto', 2048, jnp.bfloat16, 'cpu') == 'xla'
  assert attention.resolve('flash', 2048, jnp.bfloat16, 'cpu') == 'flash'


def test_bad_arguments_are_refused():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"attention='fast' is not one of 'auto', 'xla'"):
    attention.causal_attention(q, k, v, 'fast')
  with pytest.raises(ValueError, match=r'block=192 must be a multiple of 128'):
    attention.causal_attention(q, k, v, 'splash', block=192)
  with pytest.raises(ValueError, match=r'multiple of 128; got 100'):
    attention.causal_attention(q[:, :100], k[:, :100], v[:, :100], 'splash')
  with pytest.raises(ValueError, match=r'K dividing H'):
    attention.causal_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match=r'loss_chunk=-1'):
    llama_config.preset('500k', loss_chunk=-1)
  with pytest.raises(ValueError, match=r'attention_block=100'):
    llama_config.preset('500k', attention_block=100)


def _softmax_ce_numpy(x, head, targets):
  logits = np.asarray(x, np.float64) @ np.asarray(head, np.float64)
  z = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - z).sum(-1)) + z[..., 0]
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return lse - picked, (logits.argmax(-1) == targets).astype(np.float64)


@pytest.mark.parametrize('chunk', [0, 64, 128])
def test_chunked_head_losses_equal_whole_logits(chunk):
  """Chunks of the flattened tokens give the unchunked per-token losses, hits and gradients."""
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], (2, 64, 16))
  head = jax.random.normal(keys[1], (16, 40)) / 4
  targets = jax.random.randint(keys[2], (2, 64), 0, 40)
  loss, hit = llama.head_losses(x, head, targets, chunk, checkpoint=True)
  want_loss, want_hit = _softmax_ce_numpy(x, head, np.asarray(targets))
  np.testing.assert_allclose(np.asarray(loss), want_loss, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(hit), want_hit)
  g = jax.grad(lambda x, h: jnp.sum(llama.head_losses(x, h, targets, chunk, True)[0]),
               argnums=(0, 1))(x, head)
  g0 = jax.grad(lambda x, h: jnp.sum(llama.head_losses(x, h, targets, 0, False)[0]),
                argnums=(0, 1))(x, head)
  for a, b in zip(g, g0):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match='chunk=100 does not divide the 128 tokens'):
    llama.head_losses(x, head, targets, 100, checkpoint=False)


def _model_numbers(**changes):
  model = llama.llama_lm('500k', **changes)
  tokens = jax.random.randint(jax.random.key(4), (2, 129), 1, 256)
  batch = {'x': tokens}
  params = model.init(jax.random.key(5), batch)
  loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.loss_fn(p, batch)))(params)
  return loss, grads, model.metrics_fn(params, batch)['accuracy'], model, params, batch


@pytest.mark.slow
def test_llama_splash_and_chunked_loss_equal_the_xla_logits_path():
  """The model's loss, gradients and accuracy do not depend on the kernel or the chunks."""
  loss, grads, acc, model, params, batch = _model_numbers(attention='xla', loss_chunk=0)
  # The same numbers from the logits (the path that returns [B, T, V]).
  x, y = batch['x'][:, :-1], batch['x'][:, 1:]
  logits = model.apply(params, x).astype(jnp.float32)
  per_token = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), float(jnp.mean(per_token)), rtol=1e-6)
  for changes in ({'attention': 'splash', 'loss_chunk': 0},
                  {'attention': 'xla', 'loss_chunk': 32},
                  {'attention': 'splash', 'loss_chunk': 64, 'remat': 'full'}):
    l2, g2, a2, *_ = _model_numbers(**changes)
    np.testing.assert_allclose(float(l2), float(loss), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(a2), np.asarray(acc))
    for got, want in zip(jax.tree.leaves(g2), jax.tree.leaves(grads)):
      scale = float(np.max(np.abs(np.asarray(want)))) or 1.0
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * scale)


def test_auto_remat_and_chunks_follow_the_memory():
  """'auto' keeps every activation when they fit, then saves the projections, then recomputes."""
  c = llama_config.preset('550m', dtype='bfloat16')
  gib = 2 ** 30
  assert llama.step_plan(c, 4, 2048, memory_bytes=80 * gib, backend='tpu') == {
      'attention': 'splash', 'remat': 'none', 'loss_chunk': 0}
  mid = llama.step_plan(c, 4, 2048, memory_bytes=16 * gib, backend='tpu')
  assert mid['remat'] == 'dots_with_no_batch_dims_saveable'
  small = llama.step_plan(c, 4, 2048, memory_bytes=10 * gib, backend='tpu')
  assert small['remat'] == 'full' and small['loss_chunk'] > 0
  assert (4 * 2048) % small['loss_chunk'] == 0
  # Each plan's estimate is what its arithmetic says (llama_config.training_bytes).
  n = llama_config.num_params(c)
  est = llama_config.training_bytes(c, 4, 2048, 'full', 'splash', 1024)
  d, L, V = c.width, c.num_layers, c.vocab_size
  every = llama_config.layer_activation_bytes(c, 'none', 'splash', 2048)
  assert est == 16 * n + L * 8192 * 2 * d + 8192 * every + 6 * V * 1024
  # Evaluation chunks whenever the float32 logits pass EVAL_LOGITS_BYTES.
  assert llama.step_plan(c, 256, 2048, differentiated=False, memory_bytes=16 * gib,
                         backend='tpu')['loss_chunk'] > 0
  assert llama.step_plan(llama_config.preset('500k'), 2, 128, differentiated=False,
                         memory_bytes=16 * gib, backend='cpu')['loss_chunk'] == 0
