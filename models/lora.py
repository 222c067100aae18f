"""LoRA adapters on a frozen model, through qwix's LoRA provider.

Low-rank adaptation (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models", arXiv 2106.09685) freezes a pretrained weight ``W [n_in,
n_out]`` (Flax layout, ``y = x W``) and trains a rank-``r`` correction::

  y = x (W + s a b),   a [n_in, r],   b [r, n_out],   s = alpha / r,

``a`` drawn at random and ``b = 0``, so training starts from the pretrained
model. The adapters are added by qwix (``qwix.LoraProvider``), which
intercepts the ``dot_general`` of every ``nn.Dense`` whose module path
matches the targets and keeps ``a`` and ``b`` next to the kernel, as
``kernel_lora_a [L?, n_in, r]`` and ``kernel_lora_b [L?, r, n_out]`` (with the
leading layer axis ``L`` of a scanned stack). We chose qwix over
``flax.nnx.LoRA`` because the Llama presets (:mod:`fedjx.models.llama`) are
linen modules: qwix wraps them unchanged, under ``nn.scan`` and ``nn.remat``
alike; its adapters inherit the kernel's sharding; and the same provider
stores the frozen kernels in int8 (QLoRA-style, Dettmers et al. 2023,
"QLoRA: Efficient Finetuning of Quantized LLMs", arXiv 2305.14314: channelwise
absmax int8 here, not NF4) with no other change.

A :class:`LoraModel` is a :class:`~fedjx.models.losses.Model` whose parameters
are the *trainable* adapters only: the frozen base (and, for FFA-LoRA, the
frozen ``a``) is held by the model and joined to them inside ``apply``. So
every algorithm, aggregator (DP clipping and noise, compression, secure
sums), byte count and checkpoint of the framework sees only what is trained
and travels: the adapters.

:class:`LoraConfig` fields are the config's ``lora`` fields
(docs/fine_tuning.md):

* ``rank``, ``alpha``: ``r`` and ``alpha`` (``s = alpha / r``);
* ``dropout``: dropout on the adapters' input ``x`` during training;
* ``targets``: projection names (``q_proj k_proj v_proj o_proj gate_proj
  up_proj down_proj``);
* ``a_init``: ``'kaiming'`` (PEFT's: ``a ~ U(-1/sqrt(n_in), 1/sqrt(n_in))``),
  ``'he_uniform'`` (qwix's: ``U(-sqrt(6/n_in), sqrt(6/n_in))``) or
  ``'gaussian'`` (``N(0, 1/r)``);
* ``train_a``: False freezes ``a`` at its initialization (FFA-LoRA, Sun et
  al. 2024, arXiv 2403.12313): only ``b`` is trained and sent;
* ``base_dtype``: ``'float32'``, ``'bfloat16'`` (the frozen weights stored in
  bfloat16) or ``'int8'`` (the adapted kernels stored quantized by qwix).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from fedjx.models import adapters
from fedjx.models import losses
from fedjx.models.lora_config import LoraConfig


Params = Any


def _a_initializer(name: str, rank: int):
  if name == 'kaiming':
    # U(-1/sqrt(fan_in), 1/sqrt(fan_in)): PyTorch's kaiming_uniform_(a=sqrt(5)), as PEFT.
    return jax.nn.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform', in_axis=-2,
                                                out_axis=-1)
  if name == 'he_uniform':
    return jax.nn.initializers.he_uniform(in_axis=-2, out_axis=-1)
  return jax.nn.initializers.normal(1 / math.sqrt(rank))


class _Provider(qwix.LoraProvider):
  """qwix's LoRA provider, whose adapted products keep the layer's compute dtype.

  In a bfloat16 model the int8 kernel's product (its float32 scales) or the
  adapters' would otherwise come out float32 and change the residual
  stream's dtype (which a scanned layer stack refuses): the products are
  asked for, and the sum cast to, the dtype of ``x``.
  """

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, out_sharding=None):
    dtype = preferred_element_type or lhs.dtype
    out = super().dot_general(lhs, rhs, dimension_numbers, precision, dtype,
                              out_sharding=out_sharding)
    return out.astype(dtype)


def provider(config: LoraConfig, *, train: bool = True) -> qwix.LoraProvider:
  """The qwix provider of ``config`` (no dropout when ``train`` is False)."""
  return _Provider(
      module_path=config.module_path, rank=config.rank, alpha=float(config.alpha),
      dropout=float(config.dropout) if train else 0.0,
      lora_a_initializer=_a_initializer(config.a_init, config.rank),
      weight_qtype='int8' if config.base_dtype == 'int8' else None)


def _store(base: Params, config: LoraConfig, abstract: Params, scale_dtype: Any = None
           ) -> Params:
  """The frozen base in ``config.base_dtype`` (int8: quantized by qwix).

  ``scale_dtype`` (a model's bfloat16 compute dtype) is the dtype of the int8
  kernels' scales, so that their products stay in the compute dtype.
  """
  if config.base_dtype == 'bfloat16':
    return jax.tree.map(lambda w: w.astype(jnp.bfloat16), base)
  if config.base_dtype == 'int8':
    quantized = _quantize(base, abstract)
    if scale_dtype is None:
      return quantized
    def cast(x):
      if isinstance(x, qwix.QArray):
        return dataclasses.replace(x, scale=x.scale.astype(scale_dtype))
      return x
    return jax.tree.map(cast, quantized, is_leaf=lambda x: isinstance(x, qwix.QArray))
  return base


def _quantize(base: Params, abstract: Params) -> dict:
  """qwix's int8 weights of ``base`` by the quantized module's ``abstract`` tree.

  qwix decides how to quantize a kernel (its channel axes) inside the layer,
  where a scanned stack's kernel has no layer axis; the stacked ``layers``
  are therefore quantized layer by layer (``jax.vmap`` over that axis).
  """
  out = {}
  for key, value in base.items():
    if key == 'layers' and isinstance(value, Mapping):
      one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), abstract[key])
      out[key] = jax.vmap(lambda p, one=one: qwix.quantize_params(p, one))(value)
    else:
      out[key] = qwix.quantize_params({key: value}, {key: abstract[key]})[key]
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class LoraModel(losses.Model):
  """A :class:`~fedjx.models.losses.Model` whose parameters are the trainable adapters.

  ``frozen`` is the rest of the parameter tree (the pretrained base, and
  ``a`` under FFA-LoRA), joined to the adapters in :meth:`apply`.
  ``train_module`` is the qwix-wrapped module with adapter dropout, ``module``
  the same without (evaluation), ``init_module`` the same with a float base
  (draws adapters); ``base`` the original :class:`Model`. ``compute_dtype``
  (the base module's ``config.dtype`` when it is not float32, e.g.
  bfloat16): the float32 adapters are cast to it for the forward pass, as a
  linen ``Dense`` casts its float32 kernel, and their gradients arrive in
  float32.
  """

  frozen: Any = None
  train_module: Any = None
  init_module: Any = None
  base: Any = None
  config: LoraConfig = LoraConfig()
  compute_dtype: Any = None

  def init(self, key: jax.Array, batch: losses.Batch) -> Params:
    """Fresh trainable adapters: ``a`` drawn from ``key`` and ``b = 0`` (only ``b`` under FFA)."""
    x = self._inputs_and_targets(batch)[0]
    return _fresh_adapters(self.init_module, self.config, key, x)

  def apply(self, params: Params, x: jax.Array, train: bool = False,
            rng: jax.Array | None = None) -> jax.Array:
    if self.compute_dtype is not None:  # Mixed precision: float32 masters, products in dtype.
      params = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
    full = {'params': self.full_params(params)}
    if train and self.config.dropout > 0:
      if rng is None:
        rng = losses.batch_rng({'x': x}, salt=1)
      return self.train_module.apply(full, x, train=train, rngs={'dropout': rng})
    return self.module.apply(full, x, train=train)

  def full_params(self, params: Params) -> dict:
    """The frozen tree and the adapters ``params`` joined (what qwix's module reads).

    Merged deltas ``M`` among ``params`` (leaves ``kernel_lora_merged``, FLoRA's)
    are added to their kernels: ``W + M``.
    """
    params, merged = adapters.split_merged(params)
    full = adapters.join(self.frozen, params)
    for name, delta in adapters.merged_pairs(merged).items():
      *modules, kernel = name.split('/')
      node = full
      for m in modules[:-1]:
        node[m] = dict(node[m])
        node = node[m]
      node[modules[-1]] = leaf = dict(node[modules[-1]])
      w = leaf[kernel]
      if not hasattr(w, 'dtype') or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f'LoraModel: cannot add a merged delta to the {w!r} kernel {name}.')
      leaf[kernel] = w.astype(jnp.float32) + delta.astype(jnp.float32)
    return full


def compute_dtype(model: losses.Model) -> Any:
  """The module's ``config.dtype`` when it computes in less than float32, else None."""
  dtype = getattr(getattr(model.module, 'config', None), 'dtype', None)
  return None if dtype is None or jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)


def _canonical(params: Params) -> dict:
  """Nested plain dicts (flax may hand back FrozenDicts)."""
  if isinstance(params, Mapping):
    return {k: _canonical(v) for k, v in params.items()}
  return params


def _draw(init_module, key: jax.Array, x: jax.Array) -> dict:
  """Every adapter of a fresh draw (the base's initialization is compiled away)."""
  def draw(key, x):
    params = init_module.init(key, x, train=False)['params']
    return adapters.partition(params, adapters.is_adapter)[0]
  return _canonical(jax.jit(draw)(key, x))


def _fresh_adapters(init_module, config: LoraConfig, key: jax.Array, x: jax.Array) -> dict:
  """The trainable adapters of a fresh draw (only the ``b`` under FFA-LoRA)."""
  return adapters.split(_draw(init_module, key, x), config.train_a)[0]


def lora_model(model: losses.Model, config: LoraConfig, key: jax.Array,
               batch: losses.Batch, base_params: Params | None = None) -> LoraModel:
  """``model`` with adapters by ``config`` on its frozen weights.

  Args:
    model: the base :class:`~fedjx.models.losses.Model` (a linen module).
    config: the :class:`LoraConfig`.
    key: draws the base when ``base_params`` is None, and the frozen ``a``
      of FFA-LoRA (``train_a=False``); the trainable adapters come from
      :meth:`LoraModel.init`.
    batch: an example batch (its shapes initialize the module).
    base_params: the pretrained parameters (e.g. from
      :func:`fedjx.models.hf_checkpoint.load_pretrained`); None initializes
      the base at random (tests, CPU-scale studies).
  """
  if not isinstance(model, losses.Model):
    raise ValueError(f'lora_model: model={model!r} must be a fedjx.models.Model.')
  if not isinstance(config, LoraConfig):
    raise ValueError(f'lora_model: config={config!r} must be a LoraConfig.')
  x = model._inputs_and_targets(batch)[0]  # pylint: disable=protected-access
  train_module = qwix.apply_lora_to_model(model.module, provider(config, train=True))
  eval_module = qwix.apply_lora_to_model(model.module, provider(config, train=False))
  float_config = dataclasses.replace(config, base_dtype='float32', dropout=0.0)
  init_module = qwix.apply_lora_to_model(model.module, provider(float_config, train=False))
  k_base, k_lora = jax.random.split(key)
  shapes = _canonical(jax.eval_shape(init_module.init, k_lora, x, train=False)['params'])
  if base_params is None:
    base_params = jax.jit(lambda k, x: model.module.init(k, x, train=False)['params'])(k_base, x)
  base_params = _canonical(base_params)
  check_base(base_params, adapters.partition(shapes, adapters.is_adapter)[1])
  abstract = None
  if config.base_dtype == 'int8':
    abstract = _canonical(jax.eval_shape(eval_module.init, k_lora, x, train=False)['params'])
    abstract = adapters.partition(abstract, adapters.is_adapter)[1]
  frozen = _store(base_params, config, abstract, compute_dtype(model))
  if not config.train_a:
    frozen_a = adapters.split(_draw(init_module, k_lora, x), train_a=False)[1]
    frozen = adapters.join(frozen, frozen_a)
  return LoraModel(name=f'{model.name}+lora', module=eval_module, task=model.task,
                   dropout=config.dropout > 0, pad_id=model.pad_id, frozen=frozen,
                   train_module=train_module, init_module=init_module, base=model,
                   config=config, compute_dtype=compute_dtype(model))


def check_base(given: Params, expected: Params) -> None:
  """Refuses ``given`` base parameters whose tree or shapes differ from the module's."""
  flat = lambda t: {adapters.path_name(p): np.shape(v)
                    for p, v in jax.tree_util.tree_flatten_with_path(t)[0]}
  g, e = flat(given), flat(expected)
  missing = sorted(set(e) - set(g))
  unexpected = sorted(set(g) - set(e))
  if missing or unexpected:
    raise ValueError(f'lora_model: base_params lack {missing or "nothing"} and have '
                     f'unexpected {unexpected or "nothing"}.')
  wrong = [f'{n} {g[n]} (expected {e[n]})' for n in sorted(e) if g[n] != e[n]]
  if wrong:
    raise ValueError(f'lora_model: base_params shapes differ: {"; ".join(wrong)}.')
