"""Memory and bytes on the wire of federated LoRA fine-tuning, planned before launch.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv 2106.09685) trains, for each adapted projection ``W [n_in, n_out]`` of
each of the ``L`` layers, ``a [n_in, r]`` and ``b [r, n_out]``; the base stays
frozen (:mod:`fedjx.models.lora`). :func:`plan_lora` gives the bytes one
device holds while ``C`` clients (``clients_per_device``) each take one AdamW
step on their adapters over a shared frozen base, and the bytes of one round
of a cohort of ``m`` clients:

* **adapters**, counted exactly: ``A = L sum_targets r (n_in + n_out)`` with
  ``(n_in, n_out)`` = ``(d, H h)`` for ``q_proj``, ``(d, K h)`` for ``k_proj``
  and ``v_proj``, ``(H h, d)`` for ``o_proj``, ``(d, f)`` for ``gate_proj`` and
  ``up_proj``, ``(f, d)`` for ``down_proj``. Trained: ``A`` (FFA-LoRA, Sun et
  al. 2024, arXiv 2403.12313, ``train_a=False``: only the ``L sum r n_out`` of
  the ``b``; the ``a`` join the frozen base). Stored in float32: ``4 C A``.
* **frozen base** (once per device, shared by its clients), by
  ``base_dtype``, ``N`` the model's parameters
  (:func:`fedjx.models.llama_config.num_params`) and ``W`` the weights of the
  adapted kernels: ``'float32'`` ``4 N``; ``'bfloat16'`` ``2 N`` (the whole
  base is cast, as :func:`fedjx.models.lora.lora_model` stores it);
  ``'int8'`` ``4 (N - W) + W + 4 L sum_targets n_out`` (qwix's channelwise
  int8 of the adapted kernels, one float32 scale per output channel per
  layer; the rest stays float32; QLoRA-style, Dettmers et al. 2023, arXiv
  2305.14314).
* **optimizer state**: AdamW's two moments of the trained adapters,
  ``2 x 4 C A_trained``; **gradients** ``4 C A_trained``.
* **activations**: from XLA. One client step ``loss -> grad -> AdamW`` is
  vmapped over the ``C`` clients (the base broadcast), lowered and compiled
  with ``jax.jit(...).lower(...).compile()`` on ``jax.ShapeDtypeStruct``
  inputs (nothing is allocated, so a 7B plan runs on a laptop CPU) and its
  ``memory_analysis()`` read, as :mod:`fedjx.experiments.lm_cost` does. The
  activations are XLA's temporaries less the gradients counted above. The
  plan's total is ``base + adapters + optimizer + gradients + activations +
  tokens``, which is XLA's peak ``arguments + outputs - aliased +
  temporaries`` up to the loss; both are reported. Compiling the full depth
  takes seconds on a CPU (the layers are one ``nn.scan``); with
  ``extrapolate_layers=True`` the step is compiled at ``L = 1`` and ``L = 2``
  instead and the temporaries taken as ``t(1) + (t(2) - t(1)) (L - 1)``, which
  the plan's text then says; a cautious
  figure, since the 1- and 2-layer programs keep buffers that the scanned
  loop at full depth reuses (for Llama-2-7B, int8, ``remat='full'``, one
  4,096-token sequence: 37.7 GB extrapolated against 12.2 GB compiled).
* **bytes per round**, 4 bytes per trained adapter weight ``P = 4
  A_trained``: upload ``m P``; download ``m P`` for FedIT (Zhang et al.
  2024, arXiv 2310.06624) and FlexLoRA (Bai et al. 2024, arXiv 2402.11505),
  the server sending each client the aggregate; FLoRA's stacked download
  (Wang et al. 2024, arXiv 2409.05976) ``m x m r (n_in + n_out)`` weights per
  adapted matrix, each client receiving the stacked adapters of all ``m``.

Two shapes beside the presets: :data:`TINYLLAMA_1_1B` (TinyLlama-1.1B,
1,100,048,384 parameters) and :data:`LLAMA2_7B` (Llama-2-7B, 6,738,415,616
parameters); ``fedjx-plan --preset=tinyllama-1.1b --lora_rank=8
--lora_targets=q_proj,v_proj --lora_base_dtype=bfloat16 --cohort=100
--device=h100`` prints the table (:func:`render`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix

from fedjx.experiments import lm_cost
from fedjx.experiments import plan_report
from fedjx.models import adapters
from fedjx.models import llama
from fedjx.models import llama_config
from fedjx.models import lora as lora_lib
from fedjx.models.lora_config import LoraConfig

TINYLLAMA_1_1B = llama_config.LlamaConfig(
    vocab_size=32000, width=2048, num_layers=22, num_heads=32, num_kv_heads=4,
    mlp_width=5632, seq_len=2048, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-5)
"""TinyLlama-1.1B (Zhang et al. 2024, arXiv 2401.02385): 1,100,048,384 parameters."""

LLAMA2_7B = llama_config.LlamaConfig(
    vocab_size=32000, width=4096, num_layers=32, num_heads=32, num_kv_heads=32,
    mlp_width=11008, seq_len=4096, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-5)
"""Llama-2-7B (Touvron et al. 2023, arXiv 2307.09288): 6,738,415,616 parameters."""

SHAPES: dict[str, llama_config.LlamaConfig] = {
    'tinyllama-1.1b': TINYLLAMA_1_1B,
    'llama2-7b': LLAMA2_7B,
}
"""The fine-tuning shapes by the names ``fedjx-plan --preset`` accepts with ``--lora_rank``."""

# The frozen tree exactly as LoraModel.frozen stores it (its canonical dicts, its dtypes).
_canonical = lora_lib._canonical  # pylint: disable=protected-access
_store = lora_lib._store  # pylint: disable=protected-access

ADAPTER_BYTES = 4
"""Bytes per adapter weight (float32), stored, optimized and sent."""


@dataclasses.dataclass(frozen=True)
class LoraPlan:
  """The figures of one planned LoRA client step (bytes per device) and round."""

  name: str
  config: llama_config.LlamaConfig
  lora: LoraConfig
  batch: int
  seq_len: int
  remat: str
  clients_per_device: int
  cohort: int
  params: int
  adapter_params: int
  trained_params: int
  base_bytes: int
  adapter_bytes: int
  optimizer_bytes: int
  gradient_bytes: int
  activation_bytes: int
  token_bytes: int
  xla_argument_bytes: int
  xla_output_bytes: int
  xla_alias_bytes: int
  xla_temp_bytes: int
  extrapolated: bool
  compile_seconds: float
  upload_bytes: int
  download_bytes: int
  flora_download_bytes: int

  @property
  def total_bytes(self) -> int:
    """``base + adapters + optimizer + gradients + activations + tokens`` on one device."""
    return (self.base_bytes + self.adapter_bytes + self.optimizer_bytes + self.gradient_bytes
            + self.activation_bytes + self.token_bytes)

  @property
  def xla_peak_bytes(self) -> int:
    """XLA's ``arguments + outputs - aliased + temporaries`` (extrapolated temporaries)."""
    return (self.xla_argument_bytes + self.xla_output_bytes - self.xla_alias_bytes
            + self.xla_temp_bytes)

  def fits(self, device: str) -> bool:
    """Whether :attr:`total_bytes` fits ``device`` (``lm_cost.DEVICE_MEMORY``)."""
    return self.total_bytes <= lm_cost.device_memory(device)

  def to_json(self) -> dict[str, Any]:
    """The plan as one flat JSON object (what ``fedjx-plan --json`` prints)."""
    out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ('config', 'lora')}
    return {'kind': 'lora', **out, 'rank': self.lora.rank, 'targets': list(self.lora.targets),
            'base_dtype': self.lora.base_dtype, 'total_bytes': self.total_bytes,
            'xla_peak_bytes': self.xla_peak_bytes}


def projection_shapes(config: llama_config.LlamaConfig) -> dict[str, tuple[int, int]]:
  """``{projection: (n_in, n_out)}`` of one decoder layer's kernels."""
  d, f, h = config.width, config.mlp_width, config.head_width
  q, kv = config.num_heads * h, config.num_kv_heads * h
  return {'q_proj': (d, q), 'k_proj': (d, kv), 'v_proj': (d, kv), 'o_proj': (q, d),
          'gate_proj': (d, f), 'up_proj': (d, f), 'down_proj': (f, d)}


def adapter_count(config: llama_config.LlamaConfig, lora_config: LoraConfig) -> int:
  """``A = L sum_targets r (n_in + n_out)``: every ``a`` and ``b`` weight."""
  shapes = projection_shapes(config)
  per_layer = sum(lora_config.rank * sum(shapes[t]) for t in lora_config.targets)
  return config.num_layers * per_layer


def trained_count(config: llama_config.LlamaConfig, lora_config: LoraConfig) -> int:
  """The trained adapter weights: ``A``, or ``L sum r n_out`` (only ``b``) under FFA-LoRA."""
  if lora_config.train_a:
    return adapter_count(config, lora_config)
  shapes = projection_shapes(config)
  return config.num_layers * sum(lora_config.rank * shapes[t][1] for t in lora_config.targets)


def base_bytes(config: llama_config.LlamaConfig, lora_config: LoraConfig) -> int:
  """Bytes of the frozen base by ``base_dtype`` (and the frozen ``a`` under FFA-LoRA)."""
  n = llama_config.num_params(config)
  shapes = projection_shapes(config)
  if lora_config.base_dtype == 'float32':
    out = 4 * n
  elif lora_config.base_dtype == 'bfloat16':
    out = 2 * n
  else:
    weights = config.num_layers * sum(int(np.prod(shapes[t])) for t in lora_config.targets)
    scales = config.num_layers * sum(shapes[t][1] for t in lora_config.targets)
    out = 4 * (n - weights) + weights + 4 * scales
  frozen_a = adapter_count(config, lora_config) - trained_count(config, lora_config)
  return out + ADAPTER_BYTES * frozen_a


def round_bytes(config: llama_config.LlamaConfig, lora_config: LoraConfig,
                cohort: int) -> dict[str, int]:
  """``{'upload', 'download', 'flora_download'}``: bytes of one round of ``cohort`` clients."""
  _positive('round_bytes', 'cohort', cohort)
  message = ADAPTER_BYTES * trained_count(config, lora_config)
  return {'upload': cohort * message, 'download': cohort * message,
          'flora_download': cohort * cohort * ADAPTER_BYTES * adapter_count(config, lora_config)}


def _positive(fn: str, arg: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f'{fn}: {arg}={value!r} must be a positive integer.')


def _check(config, lora_config, batch, seq_len, remat, clients_per_device, cohort) -> None:
  if not isinstance(config, llama_config.LlamaConfig):
    raise ValueError(f'plan_lora: config={config!r} must be a LlamaConfig.')
  if not isinstance(lora_config, LoraConfig):
    raise ValueError(f'plan_lora: lora={lora_config!r} must be a LoraConfig.')
  for arg, value in (('batch', batch), ('seq_len', seq_len),
                     ('clients_per_device', clients_per_device), ('cohort', cohort)):
    _positive('plan_lora', arg, value)
  if remat not in llama_config.REMAT_POLICIES:
    raise ValueError(f'plan_lora: remat={remat!r} is not one of '
                     f'{", ".join(map(repr, llama_config.REMAT_POLICIES))}.')
  shapes = projection_shapes(config)
  for target in lora_config.targets:
    if lora_config.rank > min(shapes[target]):
      raise ValueError(f'plan_lora: lora.rank={lora_config.rank} exceeds min(n_in, n_out)='
                       f'{min(shapes[target])} of {target} {shapes[target]}.')


def _abstract_trees(model, lora_config: LoraConfig, tokens: jax.ShapeDtypeStruct):
  """``(lora_model, adapters, frozen)``: the module and abstract trees, nothing allocated."""
  eval_module = qwix.apply_lora_to_model(model.module, lora_lib.provider(lora_config, train=False))
  train_module = qwix.apply_lora_to_model(model.module, lora_lib.provider(lora_config, train=True))
  float_config = dataclasses.replace(lora_config, base_dtype='float32', dropout=0.0)
  init_module = qwix.apply_lora_to_model(model.module, lora_lib.provider(float_config, train=False))
  key = jax.random.key(0)
  shapes = jax.eval_shape(init_module.init, key, tokens, train=False)['params']
  every, base = adapters.partition(_canonical(shapes), adapters.is_adapter)
  trained, frozen_a = adapters.split(every, lora_config.train_a)
  abstract = None
  if lora_config.base_dtype == 'int8':
    quantized = jax.eval_shape(eval_module.init, key, tokens, train=False)['params']
    abstract = adapters.partition(_canonical(quantized), adapters.is_adapter)[1]
  frozen = jax.eval_shape(lambda b: _store(b, lora_config, abstract, lora_lib.compute_dtype(model)), base)
  frozen = adapters.join(frozen, frozen_a)
  lora_model = lora_lib.LoraModel(
      name=f'{model.name}+lora', module=eval_module, task=model.task,
      dropout=lora_config.dropout > 0, pad_id=model.pad_id, frozen=None,
      train_module=train_module, init_module=init_module, base=model, config=lora_config,
      compute_dtype=lora_lib.compute_dtype(model))
  return lora_model, trained, frozen


def client_step_program(config: llama_config.LlamaConfig, lora_config: LoraConfig, batch: int,
                        seq_len: int, clients: int):
  """The jitted LoRA client step over ``clients`` and its arguments' abstract shapes.

  Returns ``(step, (adapters, opt_state, frozen, tokens))``: ``step`` maps the
  stacked adapters ``[clients, ...]``, their AdamW state and tokens ``[clients,
  batch, seq_len + 1]`` over a shared frozen base to ``(adapters, opt_state,
  loss)``, donating its first two arguments.
  """
  model = llama.llama_lm(config)
  one = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  lora_model, trained, frozen = _abstract_trees(model, lora_config, one)
  opt = lm_cost.inner_optimizer()
  opt_state = jax.eval_shape(opt.init, trained)

  def client_step(params, opt_state, frozen, tokens):
    bound = dataclasses.replace(lora_model, frozen=frozen)
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(bound.loss_fn(p, {'x': tokens})))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  stack = lambda t: jax.tree.map(
      lambda s: jax.ShapeDtypeStruct((clients,) + tuple(s.shape), s.dtype), t)
  step = jax.jit(jax.vmap(client_step, in_axes=(0, 0, None, 0)), donate_argnums=(0, 1))
  tokens = jax.ShapeDtypeStruct((clients, batch, seq_len + 1), jnp.int32)
  return step, (stack(trained), stack(opt_state), frozen, tokens)


def _memory(config, lora_config, batch, seq_len, clients):
  step, args = client_step_program(config, lora_config, batch, seq_len, clients)
  return step.lower(*args).compile().memory_analysis()


def _xla_bytes(config, lora_config, batch, seq_len, clients, extrapolate):
  """``(arguments, outputs, aliased, temporaries)`` of the compiled step (temporaries by depth)."""
  if not extrapolate or config.num_layers <= 2:
    m = _memory(config, lora_config, batch, seq_len, clients)
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
            m.temp_size_in_bytes)
  one, two = (_memory(config.replace(num_layers=l), lora_config, batch, seq_len, clients)
              for l in (1, 2))
  depth = config.num_layers - 1
  grow = lambda f: int(f(one) + (f(two) - f(one)) * depth)
  return (grow(lambda m: m.argument_size_in_bytes), grow(lambda m: m.output_size_in_bytes),
          grow(lambda m: m.alias_size_in_bytes), grow(lambda m: m.temp_size_in_bytes))


def plan_lora(config: llama_config.LlamaConfig, lora: LoraConfig, *, batch: int, seq_len: int,
              remat: str, clients_per_device: int = 1, cohort: int = 1,
              dtype: str | None = None, name: str | None = None,
              extrapolate_layers: bool = False) -> LoraPlan:
  """Plans one LoRA client step per device and one round of ``cohort`` clients.

  Args:
    config: the base model's shape (a preset's, :data:`TINYLLAMA_1_1B`, ...).
    lora: the adapters (rank, targets, ``train_a``, ``base_dtype``).
    batch: sequences per client per step.
    seq_len: tokens per sequence.
    remat: per-layer rematerialization (:data:`~fedjx.models.llama_config.REMAT_POLICIES`).
    clients_per_device: ``C`` clients stepping side by side (vmapped) on one
      device over one shared base.
    cohort: ``m`` clients per round (for the bytes on the wire).
    dtype: the compute dtype (``None``: the config's).
    name: the shape's name in the plan's text (``None``: ``'custom'``).
    extrapolate_layers: compile at ``L = 1, 2`` and extrapolate linearly in
      ``L`` rather than compiling the full depth.
  """
  _check(config, lora, batch, seq_len, remat, clients_per_device, cohort)
  changes = {'remat': remat, **({'dtype': dtype} if dtype is not None else {})}
  config = config.replace(**changes)
  start = time.perf_counter()
  args, outs, alias, temp = _xla_bytes(config, lora, batch, seq_len, clients_per_device,
                                       bool(extrapolate_layers))
  seconds = time.perf_counter() - start
  c = clients_per_device
  trained = trained_count(config, lora)
  gradients = c * ADAPTER_BYTES * trained
  wire = round_bytes(config, lora, cohort)
  return LoraPlan(
      name=name or 'custom', config=config, lora=lora, batch=batch, seq_len=seq_len,
      remat=remat, clients_per_device=c, cohort=cohort,
      params=llama_config.num_params(config), adapter_params=adapter_count(config, lora),
      trained_params=trained, base_bytes=base_bytes(config, lora),
      adapter_bytes=c * ADAPTER_BYTES * trained, optimizer_bytes=2 * gradients,
      gradient_bytes=gradients, activation_bytes=max(int(temp) - gradients, 0),
      token_bytes=c * batch * (seq_len + 1) * 4, xla_argument_bytes=int(args),
      xla_output_bytes=int(outs), xla_alias_bytes=int(alias), xla_temp_bytes=int(temp),
      extrapolated=bool(extrapolate_layers) and config.num_layers > 2,
      compile_seconds=seconds, upload_bytes=wire['upload'], download_bytes=wire['download'],
      flora_download_bytes=wire['flora_download'])


def render(plan: LoraPlan, device: Any, prog: str = 'fedjx-plan') -> str:
  """The table ``fedjx-plan --lora_rank`` prints: bytes per device, fit on ``device``, per round.

  ``device`` is a :class:`fedjx.experiments.plan_report.Target`, or a key of
  ``lm_cost.DEVICE_MEMORY``.
  """
  if isinstance(device, str):
    device = plan_report.target(device)
  gb = plan_report.gb
  c, lc = plan.config, plan.lora
  plural = lambda n: '' if n == 1 else 's'
  how = (f'temporaries extrapolated linearly from L = 1 and L = 2 to L = {c.num_layers}'
         if plan.extrapolated else f'compiled at the full depth L = {c.num_layers}')
  title = (f'{prog}: LoRA on llama_lm {plan.name} ({plan.params:,} parameters), rank '
           f'{lc.rank}, targets {",".join(lc.targets)}, base {lc.base_dtype}, '
           f'{plan.clients_per_device} client{plural(plan.clients_per_device)} per device, '
           f'{plan.batch} x {plan.seq_len:,} tokens per client step, remat {plan.remat}, '
           f'compute {c.dtype}, AdamW; compiled in {plan.compile_seconds:.1f} s')
  fits = device.fits(plan.total_bytes)
  rows = [
      ('parameters', f'{plan.params:,}', f'{plan.trained_params:,} trained'),
      ('memory per device', '', ''),
      ('  frozen base', gb(plan.base_bytes), f'{plan.params:,} parameters, {lc.base_dtype}'),
      ('  adapters', gb(plan.adapter_bytes),
       f'{plan.trained_params:,} trained of {plan.adapter_params:,} (rank {lc.rank} on '
       f'{",".join(lc.targets)}), float32'),
      ('  optimizer', gb(plan.optimizer_bytes), 'AdamW moments of the trained adapters, float32'),
      ('  gradients', gb(plan.gradient_bytes), 'of the trained adapters, float32'),
      ('  activations', gb(plan.activation_bytes), f'XLA temporaries less the gradients; {how}'),
      ('  tokens', gb(plan.token_bytes), 'int32'),
      ('  total', gb(plan.total_bytes), f'XLA peak {gb(plan.xla_peak_bytes)}'),
      (f'fits {device.name}', {True: 'yes', False: 'NO', None: 'unknown'}[fits], device.note),
      (f'bytes a round, cohort {plan.cohort}', '', ''),
      ('  upload', gb(plan.upload_bytes),
       f'{plan.cohort} x {gb(plan.upload_bytes // plan.cohort)}'),
      ('  download', gb(plan.download_bytes), 'FedIT, FlexLoRA: the aggregate to each client'),
      ('  download FLoRA', gb(plan.flora_download_bytes), 'the stacked adapters to each client'),
  ]
  return plan_report.table(title, rows)
