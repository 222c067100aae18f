"""Tests of fedjx.models.lora: adapters on a frozen tiny Llama, against NumPy references.

The reference of an adapted kernel is ``W + s a b`` (``s = alpha / r``; Hu et
al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv
2106.09685) computed in float64 and substituted into the base model; int8
storage is checked against the float model whose kernels are quantized and
dequantized by channelwise absmax in NumPy (``q = clip(round(W / c), -128,
127)``, ``c = max_i |W_ij| / 127.5`` per output column ``j``, qwix's rule).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import test_util as jtu

from fedjx.models import adapters
from fedjx.models import llama
from fedjx.models import lora
from fedjx.models.lora_config import LoraConfig

import float_tolerance as ft

ATTN = ('q_proj', 'v_proj')
MLP = ('gate_proj', 'up_proj', 'down_proj')
# One layer of width 32 (MLP 64, vocabulary 256, 8 positions): the longest
# chain of float32 sums from the tokens to a logit is the three norms (3 x 32),
# q/k/v and the adapter path (32 + r + 32), scores (16) and softmax (8),
# values (8), o (32), the MLP (32 + 64 + 64 + r) and the head (32): < 500 terms.
# The softmax and norms are Lipschitz with constants O(1) at these scales, so
# twice the chain, n = 1000, bounds the error relative to the logits' scale.
CHAIN = 1000


def tiny(scan: bool = True):
  return llama.llama_lm('500k', num_layers=1, width=32, num_heads=2, num_kv_heads=2,
                        mlp_width=64, scan_layers=scan)


def tokens(n: int = 3, seed: int = 0) -> dict:
  rng = np.random.RandomState(seed)
  return {'x': jnp.asarray(rng.randint(1, 256, (n, 9)).astype(np.int32))}


BATCH = tokens()


def build(scan=True, **fields):
  return _build(scan, tuple(sorted(fields.items())))


@functools.lru_cache(maxsize=None)
def _build(scan, fields):
  config = LoraConfig(**{'rank': 4, 'alpha': 8.0, **dict(fields)})
  return lora.lora_model(tiny(scan), config, jax.random.key(0), BATCH)


def with_random_b(ad, seed=1, std=0.5):
  rng = np.random.RandomState(seed)
  def set_b(path, v):
    if path[-1].key.endswith('_lora_b'):
      return jnp.asarray(rng.normal(0, std, v.shape).astype(np.float32))
    return v
  return jax.tree_util.tree_map_with_path(set_b, ad)


def f64(x):
  return np.asarray(x, np.float64)


def set_kernels(frozen, kernels: dict) -> dict:
  """``frozen`` with the kernels ``{'a/b/kernel': array}`` replaced."""
  out = jax.tree.map(lambda v: v, frozen)
  for name, value in kernels.items():
    *modules, kernel = name.split('/')
    node = out
    for m in modules:
      node = node[m]
    node[kernel] = jnp.asarray(value, jnp.float32)
  return out


def x_of(batch):
  return batch['x'][:, :-1]


def assert_logits_close(got, want):
  got, want = f64(got), f64(want)
  scale = float(np.max(np.abs(want)))
  np.testing.assert_allclose(got, want, rtol=0, atol=ft.atol(CHAIN, scale))


@pytest.mark.parametrize('scan', [True, False])
@pytest.mark.parametrize('targets', [ATTN, MLP])
def test_adapted_logits_match_numpy_merge(scan, targets):
  lm = build(scan, targets=targets)
  ad = lm.init(jax.random.key(1), BATCH)
  # b = 0 at init: the adapted model is the base model, exactly.
  np.testing.assert_array_equal(lm.loss_fn(ad, BATCH), lm.base.loss_fn(lm.frozen, BATCH))
  ad = with_random_b(ad)
  s = 8.0 / 4
  merged = {}
  flat = dict(jax.tree_util.tree_flatten_with_path(lm.frozen)[0])
  frozen_by_name = {adapters.path_name(p): v for p, v in flat.items()}
  for name, pair in adapters.adapter_pairs(ad).items():
    w = f64(frozen_by_name[name])
    merged[name] = w + s * np.matmul(f64(pair['a']), f64(pair['b']))
    # The change is not negligible: the test would see a missing adapter.
    assert np.max(np.abs(merged[name] - w)) > 0.1 * np.max(np.abs(w))
  assert {n.split('/')[-2] for n in merged} == set(targets)
  want = jax.jit(lm.base.apply)(set_kernels(lm.frozen, merged), x_of(BATCH))
  assert_logits_close(jax.jit(lm.apply)(ad, x_of(BATCH)), want)


@pytest.mark.parametrize('scan', [True, False])
def test_trainable_tree_is_the_adapters(scan):
  targets = ('q_proj', 'down_proj')
  lm = build(scan, targets=targets, rank=3)
  ad = lm.init(jax.random.key(1), BATCH)
  shapes = {adapters.path_name(p): v.shape for p, v in jax.tree_util.tree_flatten_with_path(ad)[0]}
  lead = (1,) if scan else ()
  layer = 'layers' if scan else 'layers_0'
  assert shapes == {
      f'{layer}/self_attn/q_proj/kernel_lora_a': lead + (32, 3),
      f'{layer}/self_attn/q_proj/kernel_lora_b': lead + (3, 32),
      f'{layer}/mlp/down_proj/kernel_lora_a': lead + (64, 3),
      f'{layer}/mlp/down_proj/kernel_lora_b': lead + (3, 32)}
  for p, v in jax.tree_util.tree_flatten_with_path(ad)[0]:
    if adapters.path_name(p).endswith('_b'):
      np.testing.assert_array_equal(v, 0.0)
  # Nothing trainable is frozen, and nothing frozen is an adapter.
  frozen = [adapters.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(lm.frozen)[0]]
  assert not [n for n in frozen if '_lora_' in n]


def test_ffa_trains_only_b_and_freezes_a():
  lm = build(targets=ATTN, train_a=False)
  ad = lm.init(jax.random.key(1), BATCH)
  names = sorted(adapters.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(ad)[0])
  assert names == ['layers/self_attn/q_proj/kernel_lora_b',
                   'layers/self_attn/v_proj/kernel_lora_b']
  frozen = {adapters.path_name(p): v
            for p, v in jax.tree_util.tree_flatten_with_path(lm.frozen)[0]}
  a_names = sorted(n for n in frozen if n.endswith('_lora_a'))
  assert a_names == ['layers/self_attn/q_proj/kernel_lora_a',
                     'layers/self_attn/v_proj/kernel_lora_a']
  assert all(np.any(np.asarray(frozen[n]) != 0) for n in a_names)
  # The model's adapted kernel uses the frozen a: W + s a_frozen b.
  ad = with_random_b(ad)
  merged = {}
  for n in a_names:
    base = n[:-len('_lora_a')]
    b = dict(adapters.adapter_pairs(adapters.join(lm.frozen, ad)))[base]['b']
    merged[base] = f64(frozen[base]) + 2.0 * f64(frozen[n]) @ f64(b)
  base_frozen = adapters.partition(lm.frozen, adapters.is_adapter)[1]
  want = jax.jit(lm.base.apply)(set_kernels(base_frozen, merged), x_of(BATCH))
  assert_logits_close(jax.jit(lm.apply)(ad, x_of(BATCH)), want)


@pytest.mark.parametrize('train_a', [True, False])
def test_gradient_matches_finite_differences(train_a):
  lm = build(targets=ATTN, train_a=train_a)
  ad = with_random_b(lm.init(jax.random.key(1), BATCH), std=0.1)
  loss = jax.jit(lambda p: jnp.mean(lm.loss_fn(p, BATCH)))
  # jax's float32 tolerance for first-order finite differences (1e-2, eps 1e-4
  # after its own scaling) covers the O(eps) truncation and O(u / eps) rounding.
  jtu.check_grads(loss, (ad,), order=1, modes=['rev'], atol=2e-2, rtol=2e-2)


def _a_leaves(lm, key):
  ad = lm.init(key, BATCH)
  return {n: f64(p['a']) for n, p in adapters.adapter_pairs(ad).items()}


ALL = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


def test_kaiming_init_bounds_and_variance():
  lm = build(targets=ALL, rank=64, a_init='kaiming')
  leaves = _a_leaves(lm, jax.random.key(3))
  samples = []
  for name, a in leaves.items():
    n_in = a.shape[-2]
    assert np.max(np.abs(a)) <= 1 / math.sqrt(n_in)
    assert np.max(np.abs(a)) > 0.9 / math.sqrt(n_in)
    samples.append((a * math.sqrt(3 * n_in)).ravel())  # now U(-sqrt(3), sqrt(3)): variance 1.
  z = np.concatenate(samples)
  # For x ~ U(-c, c) with variance 1, Var(x^2) = 9/5 - 1 = 4/5; the mean of x^2
  # over N samples has std sqrt(0.8 / N): allow 5 of them.
  assert abs(np.mean(z ** 2) - 1.0) < 5 * math.sqrt(0.8 / z.size)
  assert abs(np.mean(z)) < 5 / math.sqrt(z.size)


def test_gaussian_init_variance():
  lm = build(targets=ALL, rank=64, a_init='gaussian')
  z = np.concatenate([a.ravel() for a in _a_leaves(lm, jax.random.key(4)).values()])
  z = z * math.sqrt(64)  # N(0, 1/r) -> N(0, 1); Var(x^2) = 2, so std of mean(x^2) = sqrt(2/N).
  assert abs(np.mean(z ** 2) - 1.0) < 5 * math.sqrt(2 / z.size)
  assert abs(np.mean(z)) < 5 / math.sqrt(z.size)


def test_bfloat16_base_is_stored_in_bfloat16():
  lm = build(targets=ATTN, base_dtype='bfloat16')
  dtypes = {str(v.dtype) for v in jax.tree.leaves(lm.frozen)}
  assert dtypes == {'bfloat16'}
  ad = lm.init(jax.random.key(1), BATCH)
  assert {str(v.dtype) for v in jax.tree.leaves(ad)} == {'float32'}
  assert np.all(np.isfinite(np.asarray(lm.loss_fn(ad, BATCH))))


def _absmax_dequantize(w):
  """Channelwise (per output column) absmax int8 round trip in NumPy float64.

  qwix's symmetric int8 rule: the absmax is mapped to 127.5 (so the top level
  is fully used), ``q = clip(round(w / c), -128, 127)``.
  """
  c = np.max(np.abs(w), axis=-2, keepdims=True) / 127.5
  return np.clip(np.round(w / c), -128, 127) * c, c


@pytest.mark.parametrize('scan', [True, False])
def test_int8_base_matches_numpy_dequantized_model(scan):
  float_lm = build(scan, targets=ATTN)
  lm = build(scan, targets=ATTN, base_dtype='int8')
  ad = with_random_b(lm.init(jax.random.key(1), BATCH))
  frozen = {adapters.path_name(p): v
            for p, v in jax.tree_util.tree_flatten_with_path(float_lm.frozen)[0]}
  kernels, s = {}, 2.0
  layer = 'layers' if scan else 'layers_0'
  for name, pair in adapters.adapter_pairs(ad).items():
    w = f64(frozen[name])
    deq, c = _absmax_dequantize(w)
    # Rounding to the nearest level moves each weight by at most half a step.
    assert np.all(np.abs(deq - w) <= c / 2 * (1 + 1e-6))
    stored = lm.frozen[layer]['self_attn'][name.split('/')[-2]]['kernel'].array
    assert not isinstance(stored, jax.Array) and stored.qvalue.dtype == jnp.int8
    q, scale = f64(stored.qvalue), f64(stored.scale).reshape(c.shape)
    # The stored levels and scales are the NumPy rule's, up to one level where
    # qwix's float32 arithmetic (w * (1 / c)) lands the other side of a tie; the
    # logits below use the stored levels, so they are held to the float chain.
    np.testing.assert_allclose(scale, c, rtol=ft.rtol(2))
    assert np.max(np.abs(q - np.round(w / c))) <= 1
    assert np.mean(q == np.clip(np.round(w / c), -128, 127)) > 0.95
    kernels[name] = q * scale + s * f64(pair['a']) @ f64(pair['b'])
  want = float_lm.base.apply(set_kernels(float_lm.frozen, kernels), x_of(BATCH))
  got = lm.apply(ad, x_of(BATCH))
  # The dequantized reference is the same arithmetic as the float model.
  assert_logits_close(got, want)
  # And it is not the unquantized model (the test sees the quantization).
  unq = float_lm.apply(ad, x_of(BATCH))
  assert np.max(np.abs(f64(unq) - f64(want))) > 2 * ft.atol(CHAIN, np.max(np.abs(f64(want))))


def test_dropout_changes_training_not_evaluation():
  drop = build(targets=ATTN, dropout=0.5)
  plain = build(targets=ATTN)
  ad = with_random_b(drop.init(jax.random.key(1), BATCH))
  train = np.asarray(jax.jit(drop.loss_fn)(ad, BATCH))
  np.testing.assert_array_equal(train, np.asarray(jax.jit(drop.loss_fn)(ad, BATCH)))
  ref = np.asarray(jax.jit(plain.eval_loss_fn)(ad, BATCH))
  # Same graph with dropout off: equal to a few roundings of the token mean (8 terms).
  for got in (jax.jit(drop.eval_loss_fn)(ad, BATCH), jax.jit(plain.loss_fn)(ad, BATCH)):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=ft.rtol(CHAIN))
  assert np.max(np.abs(train - ref)) > 10 * ft.rtol(CHAIN) * np.max(ref)
  np.testing.assert_allclose(drop.metrics_fn(ad, BATCH)['accuracy'],
                             plain.metrics_fn(ad, BATCH)['accuracy'])


def test_base_params_missing_or_misshaped_raise():
  m = tiny(False)
  config = LoraConfig(rank=4, alpha=8.0)
  good = jax.tree.map(np.asarray, m.init(jax.random.key(0), BATCH))
  missing = jax.tree.map(lambda v: v, good)
  del missing['layers_0']['self_attn']['k_proj']
  with pytest.raises(ValueError, match='layers_0/self_attn/k_proj/kernel'):
    lora.lora_model(m, config, jax.random.key(0), BATCH, base_params=missing)
  bad = jax.tree.map(lambda v: v, good)
  bad['embed_tokens']['embedding'] = np.zeros((255, 32), np.float32)
  with pytest.raises(ValueError, match='embed_tokens/embedding'):
    lora.lora_model(m, config, jax.random.key(0), BATCH, base_params=bad)
  # The given base is the one used.
  lm = lora.lora_model(m, config, jax.random.key(5), BATCH, base_params=good)
  np.testing.assert_array_equal(lm.frozen['norm']['scale'], good['norm']['scale'])


@pytest.mark.parametrize('field,value', [
    ('rank', 0), ('rank', 2.5), ('alpha', -1.0), ('alpha', float('inf')), ('dropout', 1.0),
    ('targets', ('qkv',)), ('targets', ()), ('a_init', 'xavier'), ('train_a', 'yes'),
    ('base_dtype', 'float16')])
def test_bad_config_fields_raise(field, value):
  with pytest.raises(ValueError, match=f'LoraConfig: {field}='):
    LoraConfig(**{field: value})


@pytest.mark.slow
@pytest.mark.parametrize('base_dtype', ['float32', 'int8'])
def test_bfloat16_compute_of_a_scanned_stack_trains_under_vmap(base_dtype):
  """Adapters on a bfloat16-computing scanned model: the client map's vmapped
  gradient traces (the products stay bfloat16 through the scan's carry) and
  gives float32 gradients that agree with the float32 model's.

  The bound: logits computed in bfloat16 (8 mantissa bits, relative 2^-8) over
  a chain of at most CHAIN terms move the loss by at most about 2^-8 of its
  size; the gradients of the two models then agree to a few percent of
  their norm (checked at 10 %, a loose multiple of 2^-8 * sqrt(depth)).
  """
  model32 = llama.llama_lm('500k', num_layers=2, width=32, num_heads=2, num_kv_heads=2,
                           mlp_width=64)
  model16 = llama.llama_lm(model32.module.config.replace(dtype='bfloat16'))
  config = LoraConfig(rank=4, alpha=8.0, base_dtype=base_dtype)
  lm32 = lora.lora_model(model32, config, jax.random.key(0), BATCH)
  lm16 = lora.lora_model(model16, config, jax.random.key(0), BATCH)
  assert lm16.compute_dtype == jnp.bfloat16 and lm32.compute_dtype is None
  ad = with_random_b(lm32.init(jax.random.key(1), BATCH))
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), ad)
  two = jnp.stack([BATCH['x'], BATCH['x']])

  def grads(lm):
    one = lambda p, x: jax.grad(lambda p: lm.loss_fn(p, {'x': x}).mean())(p)
    return jax.jit(jax.vmap(one))(stacked, two)

  g16, g32 = grads(lm16), grads(lm32)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))
  flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
  diff, norm = np.linalg.norm(flat(g16) - flat(g32)), np.linalg.norm(flat(g32))
  assert norm > 0 and diff <= 0.1 * norm
