"""The cost of one inner step of a Llama-family model, known before launch.

:func:`plan_inner_step` lowers and compiles one AdamW inner step of
:func:`fedjx.models.llama.llama_lm` for ``M`` replicas, each sharded FSDP-style
over ``F`` devices and, with ``tensor=T``, Megatron-style over ``T`` more, on a
``('clients', 'fsdp', 'tensor')`` mesh, from shapes alone
(``jax.ShapeDtypeStruct``: no data, no parameters allocated), and reads:

* **bytes per device** from XLA's memory analysis of the compiled program
  (arguments, outputs, the outputs aliased to donated arguments, temporaries);
  the peak is taken as ``arguments + outputs - aliased + temporaries``;
* **FLOPs** from XLA's cost analysis, next to the analytic count
  ``6 N_matmul + 12 L H h T`` per token
  (:func:`fedjx.models.llama_config.train_flops_per_token`). XLA counts the
  body of a loop once, not once per trip, so a scanned model's figure misses
  ``L - 1`` layers: the plan also compiles the same step unscanned at
  ``L = 1`` and ``L = 2`` (cheap), whose difference is one layer ``b`` and
  whose remainder ``a = C(1) - b`` is the rest, and reports ``a + b L``.
  Rematerialization adds the recomputed forward pass to XLA's count
  (about ``8 N`` rather than ``6 N`` per token with ``'full'``); the
  analytic figure is the model FLOPs, without recomputation.

The step: per replica, ``loss = mean_b loss_fn(params, tokens_b)``, its
gradient, then AdamW (``b2 = 0.99``, weight decay 0.1, as in Charles et al.
2025's inner optimizer), vmapped over replicas with
``spmd_axis_name='clients'``. Each replica's parameters and optimizer state
are sharded on ``'fsdp'`` along their largest axis that ``F`` divides
(:func:`fedjx.sharding.fsdp_spec`), and stacked over replicas on ``'clients'``; tokens are
split over both. With ``T > 1`` the layout is instead
:func:`fedjx.sharding.llama_param_specs`: tensor parallelism (Shoeybi et al.
2019, "Megatron-LM", arXiv 1909.08053) on ``'tensor'`` (attention heads, MLP
width and vocabulary split), FSDP on the matrices' other dimension; the
``T`` devices of a tensor group see the same tokens.

:func:`outer_step_program` is DiLoCo's outer step (Douillard et al. 2023,
arXiv 2311.08105, Algorithm 1) on the same layout: ``Delta = mean_k (theta -
theta_k)`` over the replicas and Nesterov SGD on ``theta``; its only
communication is the mean over ``'clients'``, which :func:`collective_axes`
reads back from the compiled program.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fedjx import sharding
from fedjx.models import llama
from fedjx.models import llama_config

GB = 1e9
GIB = 2 ** 30

DEVICE_MEMORY: dict[str, float] = {
    'h100': 80 * GB,
    'h200': 141 * GB,
    'a100-40gb': 40 * GB,
    'a100-80gb': 80 * GB,
    'tpu-v4': 32 * GIB,
    'tpu-v5e': 16 * GIB,
    'tpu-v5p': 95 * GIB,
    'tpu-v6e': 32 * GIB,
}
"""Accelerator memory in bytes, as the vendors state it (GPUs in GB, TPUs in GiB)."""


@dataclasses.dataclass(frozen=True)
class InnerStepPlan:
  """The figures of one planned inner step (bytes are per device)."""

  preset: str
  replicas: int
  fsdp: int
  batch: int
  seq_len: int
  remat: str
  dtype: str
  params: int
  analytic_state_bytes: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  xla_flops_scanned: float
  xla_flops: float
  analytic_flops: float
  compile_seconds: float
  tensor: int = 1

  @property
  def peak_bytes(self) -> int:
    """``arguments + outputs - aliased + temporaries`` on one device."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def fits(self, device: str) -> bool:
    """Whether :attr:`peak_bytes` fits ``device``'s memory (:data:`DEVICE_MEMORY`)."""
    return self.peak_bytes <= device_memory(device)


def device_memory(device: str) -> float:
  """Bytes of memory of ``device`` (a key of :data:`DEVICE_MEMORY`)."""
  if device not in DEVICE_MEMORY:
    raise ValueError(f'device={device!r} is not one of {", ".join(map(repr, DEVICE_MEMORY))}.')
  return DEVICE_MEMORY[device]


def replica_specs(tree: Any, fsdp: int, tensor: int = 1) -> Any:
  """One replica's ``PartitionSpec`` per leaf: :func:`fedjx.sharding.fsdp_spec`
  (every leaf, however small) if ``tensor == 1``, else
  :func:`fedjx.sharding.llama_param_specs`."""
  if tensor == 1:
    return jax.tree.map(lambda s: sharding.fsdp_spec(s.shape, fsdp, min_size=1), tree)
  return sharding.llama_param_specs(tree, fsdp, tensor)


def _stacked(tree: Any, replicas: int, mesh, fsdp: int, tensor: int = 1) -> Any:
  """Abstract leaves ``[M, ...]``, sharded ``('clients', *replica_specs)``."""
  def one(s, spec):
    return jax.ShapeDtypeStruct((replicas,) + tuple(s.shape), s.dtype,
                                sharding=NamedSharding(mesh, P('clients', *spec)))
  return jax.tree.map(one, tree, replica_specs(tree, fsdp, tensor))


def check_tensor(fn: str, config: llama_config.LlamaConfig, tensor: int) -> None:
  """Refuses a ``tensor`` that does not split heads, MLP width and vocabulary evenly."""
  if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
    raise ValueError(f'{fn}: tensor={tensor!r} must be a positive integer.')
  sizes = {'num_heads': config.num_heads, 'num_kv_heads': config.num_kv_heads,
           'mlp_width': config.mlp_width, 'vocab_size': config.vocab_size}
  bad = [f'{k}={v}' for k, v in sizes.items() if v % tensor]
  if bad:
    raise ValueError(f'{fn}: tensor={tensor} must divide the heads, MLP width and '
                     f'vocabulary; it does not divide {", ".join(bad)}.')


def inner_optimizer() -> optax.GradientTransformation:
  """The inner step's AdamW (``b2 = 0.99``, weight decay 0.1; Charles et al. 2025)."""
  return optax.adamw(1e-3, b2=0.99, weight_decay=0.1)


def inner_step_program(config: llama_config.LlamaConfig, replicas: int, fsdp: int,
                       batch: int, seq_len: int, mesh, tensor: int = 1,
                       optimizer: optax.GradientTransformation | None = None):
  """The jitted inner step over ``replicas`` on ``mesh``, and its arguments' shapes.

  Returns ``(step, (params, opt_state, tokens))``: ``step(params, opt_state,
  tokens) -> (params, opt_state, loss)`` donates its first two arguments;
  the shapes are ``jax.ShapeDtypeStruct`` with their shardings, stacked over
  replicas, tokens ``[replicas, batch, seq_len + 1]``. With ``tensor > 1``
  ``mesh`` needs a ``'tensor'`` axis of that size. ``optimizer`` replaces
  :func:`inner_optimizer` (e.g. FedAvg's plain SGD).
  """
  check_tensor('inner_step_program', config, tensor)
  model = llama.llama_lm(config)
  opt = inner_optimizer() if optimizer is None else optimizer
  params = llama.param_shapes(config)
  opt_state = jax.eval_shape(opt.init, params)

  def inner_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(model.loss_fn(p, {'x': tokens})))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.vmap(inner_step, spmd_axis_name='clients')
  a_params = _stacked(params, replicas, mesh, fsdp, tensor)
  a_opt = _stacked(opt_state, replicas, mesh, fsdp, tensor)
  token_spec = P('clients', 'fsdp' if batch % fsdp == 0 else None, None)
  tokens = jax.ShapeDtypeStruct((replicas, batch, seq_len + 1), jnp.int32,
                                sharding=NamedSharding(mesh, token_spec))
  shardings = (jax.tree.map(lambda s: s.sharding, a_params),
               jax.tree.map(lambda s: s.sharding, a_opt),
               NamedSharding(mesh, P('clients')))
  jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=shardings)
  return jitted, (a_params, a_opt, tokens)


def outer_step_program(config: llama_config.LlamaConfig, replicas: int, fsdp: int,
                       mesh, tensor: int = 1, learning_rate: float = 0.7,
                       momentum: float = 0.9):
  """DiLoCo's outer step on ``mesh``, jitted, and its arguments' shapes.

  Douillard et al. 2023 ("DiLoCo: Distributed Low-Communication Training of
  Language Models", arXiv 2311.08105), Algorithm 1: ``Delta = (1/M) sum_k
  (theta - theta_k)``, then Nesterov SGD, ``b <- momentum b + Delta``,
  ``theta <- theta - learning_rate (Delta + momentum b)`` (``optax.sgd`` with
  ``nesterov=True``; the paper's 0.7 and 0.9).

  Returns ``(step, (theta, momentum_state, replicas_params))``:
  ``step(theta, b, theta_k) -> (theta, b)``; ``theta`` and ``b`` are one
  replica's layout (:func:`replica_specs`, replicated over ``'clients'``),
  ``theta_k`` stacked ``[M, ...]`` on ``'clients'``.
  """
  check_tensor('outer_step_program', config, tensor)
  opt = optax.sgd(learning_rate, momentum=momentum, nesterov=True)
  params = llama.param_shapes(config)
  specs = replica_specs(params, fsdp, tensor)
  a_theta = jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=NamedSharding(mesh, spec)), params, specs)
  a_state = jax.eval_shape(opt.init, params)
  state_specs = replica_specs(a_state, fsdp, tensor)
  a_state = jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=NamedSharding(mesh, spec)), a_state, state_specs)
  a_replicas = _stacked(params, replicas, mesh, fsdp, tensor)

  def outer_step(theta, state, theta_k):
    delta = jax.tree.map(lambda t, tk: t - jnp.mean(tk, axis=0), theta, theta_k)
    updates, state = opt.update(delta, state, theta)
    return optax.apply_updates(theta, updates), state

  shardings = (jax.tree.map(lambda s: s.sharding, a_theta),
               jax.tree.map(lambda s: s.sharding, a_state))
  jitted = jax.jit(outer_step, donate_argnums=(0, 1), out_shardings=shardings)
  return jitted, (a_theta, a_state, a_replicas)


COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
               'collective-permute')
"""The HLO collectives :func:`collective_axes` reads."""


def _iota_groups(dims: str, reshape: str, perm: str | None) -> np.ndarray:
  """``[G, S]<=[reshape]T(perm)``: ``iota(prod).reshape(reshape).transpose(perm).reshape(G, S)``."""
  shape = [int(n) for n in dims.split(',')]
  ids = np.arange(int(np.prod(shape))).reshape([int(n) for n in reshape.split(',')])
  if perm:
    ids = ids.transpose([int(n) for n in perm.split(',')])
  return ids.reshape(shape)


def _listed(text: str) -> list[list[int]]:
  """``{{0,1},{2,3}}`` -> ``[[0, 1], [2, 3]]``."""
  return [[int(n) for n in g.split(',')] for g in re.findall(r'\{([\d,]+)\}', text)]


def _mesh_groups(axes: str, devices: str | None, spanned: str) -> list[list[int]]:
  """``mesh['a'=2,'b'=4], device_ids=(...) {'b'}``: a group for each position
  on the axes not listed. The mesh holds the device ids in row-major order, or
  as ``device_ids`` gives them (a list, or the iota form ``[dims]T(perm)``)."""
  items = re.findall(r"'([^']+)'=(\d+)", axes)
  names = [n for n, _ in items]
  listed = re.findall(r"'([^']+)'", spanned)
  if not items or any(n not in names for n in listed):
    raise ValueError(f'collective_axes: cannot read replica_groups=mesh[{axes}] {{{spanned}}}.')
  sizes = [int(k) for _, k in items]
  ids = np.arange(int(np.prod(sizes)))
  iota = re.fullmatch(r'\[([\d,]+)\](?:T\(([\d,]+)\))?', devices or '')
  if iota:
    ids = ids.reshape([int(n) for n in iota.group(1).split(',')])
    if iota.group(2):
      ids = ids.transpose([int(n) for n in iota.group(2).split(',')])
  elif devices:
    ids = np.array([int(n) for n in devices.split(',')])
  ids = ids.reshape(sizes)
  inner = [names.index(n) for n in listed]
  outer = [i for i in range(len(names)) if i not in inner]
  size = int(np.prod([ids.shape[i] for i in inner]))
  return ids.transpose(outer + inner).reshape(-1, size).tolist()


def _groups(line: str, num_devices: int) -> list[list[int]]:
  """The device groups of one collective instruction of HLO text.

  Reads ``source_target_pairs={{s,t},...}`` (each pair a group),
  ``replica_groups={{...},...}``, the iota form ``[G,S]<=[dims]T(perm)``, the
  mesh form ``mesh['axis_0'=2,...], device_ids=(...) {'axis_1',...}`` (the
  ``device_ids`` optional) and ``{}`` (all devices).
  """
  pairs = re.search(r'source_target_pairs=\{((?:\{[\d,]*\},?)*)\}', line)
  if pairs:
    return _listed(pairs.group(1))
  iota = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', line)
  if iota:
    return _iota_groups(*iota.groups()).tolist()
  mesh = re.search(r'replica_groups=mesh\[([^\]]*)\]'
                   r'(?:, device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))? \{([^}]*)\}', line)
  if mesh:
    return _mesh_groups(*mesh.groups())
  listed = re.search(r'replica_groups=\{((?:\{[\d,]*\},?)*)\}', line)
  if listed and listed.group(1):
    return _listed(listed.group(1))
  if listed or 'replica_groups=' not in line:
    return [list(range(num_devices))]  # replica_groups={}: all devices together.
  raise ValueError(f'collective_axes: cannot read the replica groups of {line.strip()[:200]!r}.')


def collective_axes(hlo: str, mesh) -> list[tuple[str, tuple[str, ...]]]:
  """``(collective, mesh axes its groups span)`` for each collective of compiled HLO text.

  A group's devices (partition ids, the positions of ``mesh.devices`` in
  row-major order) span the axes along which their mesh coordinates differ;
  a collective spans the union over its groups. A collective whose groups are
  single devices spans ``()``.
  """
  shape = tuple(mesh.devices.shape)
  out = []
  for line in hlo.splitlines():
    op = next((c for c in COLLECTIVES if f' {c}(' in line or f' {c}-start(' in line), None)
    if op is None:
      continue
    axes = set()
    for group in _groups(line, int(np.prod(shape))):
      coords = np.array([np.unravel_index(i, shape) for i in group])
      axes |= {mesh.axis_names[a] for a in range(len(shape))
               if len(set(coords[:, a].tolist())) > 1}
    out.append((op, tuple(n for n in mesh.axis_names if n in axes)))
  return out


def _compile(config, replicas, fsdp, batch, seq_len, mesh, tensor=1):
  jitted, args = inner_step_program(config, replicas, fsdp, batch, seq_len, mesh, tensor)
  return jitted.lower(*args).compile()


def plan_mesh(replicas: int, fsdp: int, tensor: int = 1, fn: str = 'plan_inner_step'):
  """The ``('clients', 'fsdp', 'tensor')`` mesh of Auto axes over the first devices."""
  need = replicas * fsdp * tensor
  if len(jax.devices()) < need:
    shape = f'replicas={replicas} x fsdp={fsdp}' + (f' x tensor={tensor}' if tensor > 1 else '')
    raise ValueError(f'{fn}: {shape} needs {need} '
                     f'devices; {len(jax.devices())} are visible (on a CPU set XLA_FLAGS='
                     f'--xla_force_host_platform_device_count={need} before jax starts).')
  # Automatic axes: XLA propagates the shardings given to the arguments.
  return jax.make_mesh((replicas, fsdp, tensor), ('clients', 'fsdp', 'tensor'),
                       devices=jax.devices()[:need],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost.get('flops', 0.0))


def _resolve(preset, seq_len, remat, dtype):
  """``(name, config, seq_len)``: the preset with ``remat``/``dtype`` replaced where given."""
  name = preset if isinstance(preset, str) else 'custom'
  config = llama_config.preset(preset) if isinstance(preset, str) else preset
  changes = {k: v for k, v in dict(remat=remat, dtype=dtype).items() if v is not None}
  config = config.replace(**changes) if changes else config
  return name, config, config.seq_len if seq_len is None else seq_len


def plan_inner_step(preset: str | llama_config.LlamaConfig, replicas: int = 1,
                    fsdp: int = 1, batch: int = 4, seq_len: int | None = None,
                    remat: str | None = None, dtype: str | None = None,
                    tensor: int = 1) -> InnerStepPlan:
  """Compiles one inner step for ``replicas x fsdp x tensor`` devices and reads its cost.

  Args:
    preset: a name in :data:`~fedjx.models.llama_config.PRESETS` or a config.
    replicas: ``M``, on the mesh axis ``'clients'``.
    fsdp: ``F`` devices per replica, on the mesh axis ``'fsdp'``.
    batch: sequences per replica per inner step.
    seq_len: tokens per sequence (``None``: the preset's ``seq_len``).
    remat, dtype: replace the preset's.
    tensor: ``T`` more devices per replica, on the mesh axis ``'tensor'``
      (Megatron-style tensor parallelism, :func:`fedjx.sharding.llama_param_specs`).

  Needs ``replicas * fsdp * tensor`` devices (host devices through
  ``--xla_force_host_platform_device_count`` on a CPU).
  """
  name, config, seq_len = _resolve(preset, seq_len, remat, dtype)
  for arg, value in (('replicas', replicas), ('fsdp', fsdp), ('batch', batch),
                     ('seq_len', seq_len), ('tensor', tensor)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f'plan_inner_step: {arg}={value!r} must be a positive integer.')
  check_tensor('plan_inner_step', config, tensor)
  mesh = plan_mesh(replicas, fsdp, tensor)
  start = time.perf_counter()
  compiled = _compile(config, replicas, fsdp, batch, seq_len, mesh, tensor)
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  scanned_flops = _flops(compiled)
  if config.scan_layers or config.num_layers > 2:
    one, two = (_flops(_compile(config.replace(num_layers=l, scan_layers=False), replicas,
                                fsdp, batch, seq_len, mesh, tensor)) for l in (1, 2))
    layer = two - one
    xla_flops = one - layer + layer * config.num_layers
  else:
    xla_flops = scanned_flops
  n = llama_config.num_params(config)
  # float32 parameters and AdamW's two moments, one replica's over F T devices
  # (the norms, replicated over T, are left out: 2 L d + d of N).
  state = 3 * n * np.dtype(config.param_dtype).itemsize / (fsdp * tensor)
  analytic = (llama_config.train_flops_per_token(config, seq_len) * batch * seq_len /
              (fsdp * tensor))
  return InnerStepPlan(
      preset=name, replicas=replicas, fsdp=fsdp, batch=batch, seq_len=seq_len,
      remat=llama.step_plan(config, batch, seq_len)['remat'], dtype=config.dtype,
      params=n, analytic_state_bytes=state,
      argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes),
      alias_bytes=int(memory.alias_size_in_bytes),
      temp_bytes=int(memory.temp_size_in_bytes),
      xla_flops_scanned=scanned_flops, xla_flops=xla_flops, analytic_flops=analytic,
      compile_seconds=seconds, tensor=tensor)


PEAK_BF16_FLOPS: dict[str, float] = {
    'h100': 989.4e12,
    'h200': 989.4e12,
    'a100-40gb': 312e12,
    'a100-80gb': 312e12,
    'tpu-v4': 275e12,
    'tpu-v5e': 197e12,
    'tpu-v5p': 459e12,
    'tpu-v6e': 918e12,
}
"""Dense bfloat16 peak FLOP/s per chip, as the vendors state it (no sparsity)."""


def measure_inner_step(preset: str | llama_config.LlamaConfig, batch: int = 4,
                       seq_len: int | None = None, steps: int = 5, repeats: int = 3,
                       remat: str | None = None, dtype: str | None = None,
                       peak_flops: float | None = None, seed: int = 0,
                       bracket_peak_bytes: int | None = None) -> dict:
  """Times one replica's inner step (that of :func:`plan_inner_step`) on one device.

  Parameters are initialized from ``seed``, tokens drawn uniformly from
  ``1 .. V - 1``; after one warm-up step (the compile), ``repeats`` times
  ``steps`` steps are run back to back and waited on. Reported: seconds per
  step (median over repeats), ``tokens/s = batch seq_len / step``, the model
  FLOPs per step (``train_flops_per_token x batch x seq_len``) and, with
  ``peak_flops`` (FLOP/s of the device), the model FLOPs utilization
  ``MFU = flops per step / step / peak`` (Chowdhery et al. 2022, PaLM,
  Appendix B); the device's peak bytes in use where it reports them, and
  XLA's planned peak; the losses of the first and last steps.

  With ``bracket_peak_bytes`` (a planned peak), the step's peak memory is
  also measured against it (:func:`peak_bracket`): one step run with only
  1.1 times that left free, one with 0.9 times, as ``'peak_bracket'``. (The
  device's ``peak_bytes_in_use`` is no measure of a program's memory on
  every runtime: on a TPU it reads a fraction of the compiled program's.)
  """
  name, config, seq_len = _resolve(preset, seq_len, remat, dtype)
  for arg, value in (('batch', batch), ('seq_len', seq_len), ('steps', steps),
                     ('repeats', repeats)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'measure_inner_step: {arg}={value!r} must be a positive integer.')
  if peak_flops is not None and not peak_flops > 0:
    raise ValueError(f'measure_inner_step: peak_flops={peak_flops!r} must be positive FLOP/s.')
  device = jax.devices()[0]
  model = llama.llama_lm(config)
  opt = inner_optimizer()

  def inner_step(params, opt_state, tokens):  # One replica's step, as DiLoCo runs it.
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(model.loss_fn(p, {'x': tokens})))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(inner_step, donate_argnums=(0, 1))
  k_init, k_tokens = jax.random.split(jax.random.key(seed))
  one = jnp.zeros((batch, seq_len), jnp.int32)
  params = jax.jit(lambda k: model.module.init(k, one, train=False)['params'])(k_init)
  opt_state = opt.init(params)
  tokens = jax.random.randint(k_tokens, (batch, seq_len + 1), 1, config.vocab_size, jnp.int32)
  start = time.perf_counter()
  compiled = step.lower(params, opt_state, tokens).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  planned = (memory.argument_size_in_bytes + memory.output_size_in_bytes -
             memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  params, opt_state, loss = compiled(params, opt_state, tokens)
  first_loss = float(loss)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps):
      params, opt_state, loss = compiled(params, opt_state, tokens)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - start) / steps)
  step_s = statistics.median(times)
  flops = llama_config.train_flops_per_token(config, seq_len) * batch * seq_len
  stats = device.memory_stats() or {}
  bracket = None
  if bracket_peak_bytes is not None:
    live = {'args': (params, opt_state)}
    init = jax.jit(lambda k: model.module.init(k, one, train=False)['params'])

    def prepare():  # A failed step may have consumed its donated arguments.
      if any(x.is_deleted() for x in jax.tree.leaves(live['args'])):
        live['args'] = None
        fresh = init(k_init)
        live['args'] = (fresh, opt.init(fresh))
        jax.block_until_ready(live['args'])

    def run():
      out = compiled(*live['args'], tokens)
      jax.block_until_ready(out)
      live['args'] = out[:2]

    def allocate(nbytes):  # float32 words: a 1-D layout pads them least.
      return jax.block_until_ready(jnp.zeros((nbytes // 4,), jnp.float32, device=device))

    try:
      bracket = peak_bracket(run, bracket_peak_bytes, int(memory.argument_size_in_bytes),
                             device.memory_stats, allocate, prepare=prepare)
    except Exception as e:  # pylint: disable=broad-except
      # The step time stands without the bracket (a runtime whose memory_stats()
      # lacks bytes_limit, say): say why, and keep the measurement.
      bracket = {'error': f'{type(e).__name__}: {str(e).strip()[:500]}',
                 'peak_within_10pct': None}
  plan = llama.step_plan(config, batch, seq_len)
  return {
      'preset': name, 'params': llama_config.num_params(config), 'batch': batch,
      'seq_len': seq_len, 'dtype': config.dtype, 'param_dtype': config.param_dtype,
      'vocab_size': config.vocab_size,
      'remat': plan['remat'], 'attention': plan['attention'],
      'loss_chunk': plan['loss_chunk'],
      'estimated_bytes': llama_config.training_bytes(
          config, batch, seq_len, plan['remat'], plan['attention'], plan['loss_chunk']),
      'platform': device.platform, 'device': device.device_kind,
      'compile_s': round(compile_s, 3), 'step_s': step_s, 'step_s_repeats': times,
      'tokens_per_s': batch * seq_len / step_s, 'model_flops_per_step': flops,
      'mfu': flops / step_s / peak_flops if peak_flops else None,
      'peak_flops': peak_flops, 'device_peak_bytes': stats.get('peak_bytes_in_use'),
      'planned_peak_bytes': int(planned), 'first_loss': first_loss,
      'last_loss': float(loss), 'steps': 1 + repeats * steps,
      **({'peak_bracket': bracket} if bracket is not None else {}),
  }


PEAK_MARGIN = 0.10
"""The relative margin of :func:`peak_bracket`'s two tries."""


def is_out_of_memory(error: BaseException) -> bool:
  """Whether ``error`` is the runtime's out-of-memory (``RESOURCE_EXHAUSTED``)."""
  return 'RESOURCE_EXHAUSTED' in str(error) or 'resource exhausted' in str(error).lower()


def ballast_bytes(stats: dict, budget_bytes: float, resident_bytes: int) -> int:
  """Bytes to allocate so that a program whose arguments (``resident_bytes``)
  are already on the device has ``budget_bytes`` in all.

  From the device's ``memory_stats()``: ``bytes_limit - bytes_in_use`` are
  free, and the program's peak counts its arguments, which ``bytes_in_use``
  holds, so the ballast is ``bytes_limit - bytes_in_use + resident - budget``
  (negative: the device has less than ``budget`` for the program).
  """
  return int(stats['bytes_limit'] - stats['bytes_in_use'] + resident_bytes - budget_bytes)


def peak_bracket(run, planned_peak_bytes: int, resident_bytes: int, memory_stats, allocate,
                 margin: float = PEAK_MARGIN, prepare=None) -> dict:
  """The peak memory of a program measured against its plan: does it run in
  ``(1 + margin) x planned``, and fail in ``(1 - margin) x planned``?

  For each budget ``f x planned_peak_bytes``, ``f = 1 + margin`` then ``1 -
  margin``: ``prepare()`` (where given; e.g. re-creates arguments a failed
  try consumed), a ballast of :func:`ballast_bytes` allocated with
  ``allocate(nbytes)`` (its ``delete()`` frees it) so that only the budget is
  left to the program, then ``run()`` once; the runtime's out-of-memory
  error (:func:`is_out_of_memory`) is caught, any other raised. The ballast
  is freed after each try. The program's peak ``p`` is then bracketed:
  running in ``1.1 x`` says ``p <= 1.1 x planned``, failing in ``0.9 x``
  says ``p >= 0.9 x planned``; ``peak_within_10pct`` (for ``margin =
  0.1``) is both. A try whose ballast cannot be placed (the device has
  less than the budget free, or the ballast itself does not fit) proves
  nothing: its ``ran`` is None.

  Args:
    run: runs the program once and waits for it.
    planned_peak_bytes: the plan's peak of the program (arguments included).
    resident_bytes: the bytes of its arguments, already on the device.
    memory_stats: returns the device's ``{'bytes_limit', 'bytes_in_use'}``.
    allocate: ``allocate(nbytes)`` places a ballast array of ``nbytes``.

  Returns:
    ``{'planned_peak_bytes', 'margin', 'tries': [{'fraction', 'budget_bytes',
    'ballast_bytes', 'ran', 'error'}, ...], 'peak_at_most', 'peak_at_least',
    'peak_within_10pct'}``, the middle two True where the try proved it.
  """
  tries = []
  for fraction in (1 + margin, 1 - margin):
    if prepare is not None:
      prepare()
    budget = fraction * planned_peak_bytes
    size = ballast_bytes(memory_stats(), budget, resident_bytes)
    row = {'fraction': fraction, 'budget_bytes': int(budget), 'ballast_bytes': size,
           'ran': None, 'error': None}
    ballast = None
    try:
      if size < 0:
        row['error'] = 'the device has less than the budget free'
      else:
        try:
          ballast = allocate(size) if size > 0 else None
        except Exception as e:  # pylint: disable=broad-except
          if not is_out_of_memory(e):
            raise
          row['error'] = 'the ballast did not fit: ' + str(e).strip().splitlines()[0][:300]
        else:
          try:
            run()
            row['ran'] = True
          except Exception as e:  # pylint: disable=broad-except
            if not is_out_of_memory(e):
              raise
            row['ran'] = False
            row['error'] = str(e).strip().splitlines()[0][:300]
    finally:
      if ballast is not None:
        ballast.delete()
      del ballast
    tries.append(row)
  at_most = tries[0]['ran'] is True
  at_least = tries[1]['ran'] is False
  return {'planned_peak_bytes': int(planned_peak_bytes), 'margin': margin, 'tries': tries,
          'peak_at_most': at_most, 'peak_at_least': at_least,
          'peak_within_10pct': at_most and at_least}
