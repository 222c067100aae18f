"""The processes and devices of a run: its mesh and its coordinator.

:func:`make_mesh` builds ``config.mesh`` over every process's devices;
:func:`check_coordinator_port` and :func:`check_devices_per_process` refuse,
in one line, the set-ups that JAX would otherwise report with a crash or a
long time-out (a coordinator port in use, processes with unequal devices).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from fedjx import distributed
from fedjx.experiments import config as config_lib
from fedjx.experiments import registry


# A sweep spreads its trials over the CPU devices of split_cpu when each
# device trains at least this many clients a round (its trials times
# config.cohort_size): a round over several devices costs a few milliseconds
# more to start and to keep in step, which a small group does not win back.
# The digits quickstart on 2 cores, ms a round over rounds 50-300, over two
# devices against one: 6 trials (30 clients a device) 17.2-19.2 against
# 13.8-15.4; 8 trials (40) 21.3 against 17.7; 12 trials (60) 19.7-19.8
# against 23.9-26.6 (benchmarks/results/HISTORY.md).
SWEEP_MIN_CLIENTS_PER_DEVICE = 48


def split_cpu(config: ml_collections.ConfigDict,
              sizes: Sequence[int] | None = None) -> int:
  """Makes ``config.cpu_devices`` CPU devices before JAX starts; returns how many.

  :func:`fedjx.distributed.split_cpu` (``'auto'``: one per core), the count
  the largest that divides ``config.cohort_size``. Given ``sizes`` (a
  sweep's settings and seeds, :mod:`fedjx.experiments.sweeps`, whose
  trials are their product), the largest count that divides one of them
  and leaves each device at least :data:`SWEEP_MIN_CLIENTS_PER_DEVICE`
  clients a round (trials times ``config.cohort_size``); 1 where no count
  does.
  Only a run with ``config.mesh='auto'`` on one process that starts JAX
  itself, whose CPU device count the user has not set
  (``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``,
  ``jax_num_cpu_devices``), splits the CPU; otherwise this returns 1 and
  changes nothing.
  """
  if (config.mesh != 'auto' or config.num_processes not in (None, 1) or
      config.coordinator_address or not distributed.may_split_cpu()):
    return 1
  devices = config.cpu_devices
  if isinstance(devices, str) and devices.isdigit():  # From the command line.
    devices = int(devices)
  if sizes is None:
    return distributed.split_cpu(devices, divides=config.cohort_size)
  if devices == 'auto':
    devices = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
               else os.cpu_count() or 1)
  if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
    clients = int(np.prod(sizes)) * config.cohort_size  # A round of every trial.
    devices = max(k for k in range(1, devices + 1)
                  if k == 1 or (any(size % k == 0 for size in sizes) and
                                clients >= SWEEP_MIN_CLIENTS_PER_DEVICE * k))
  return distributed.split_cpu(devices)


# config.mesh='auto' splits cohorts of at least
# fedjx.distributed.AUTO_MIN_CLIENTS_PER_DEVICE clients per CPU device, of
# models of at most fedjx.distributed.AUTO_MAX_MODEL_BYTES (the rule of a
# round with no mesh set, fedjx.distributed.cpu_blocks) ...
# ... and of larger ones whose loss uses each parameter about once per
# example (at most this many flops per example and parameter, forward: a
# dense layer takes 2; a convolution reuses its kernel at every position, an
# LSTM or a transformer at every token, far more). Their steps stream the
# weights: with the SGD step added by blocks (fedjx.fused_updates), each
# core passing over its own copy beats two threads sharing one pass (a 20 MB
# logistic regression: docs/benchmarks.md), while a compute-bound model (a
# 6.5 MB CNN) gains nothing from the split.
AUTO_MAX_FLOPS_PER_PARAMETER = 4.0


def flops_per_parameter(loss_fn: Any, params: Any, batch: Any) -> float | None:
  """Forward flops of ``loss_fn`` per example of ``batch`` (``[B, ...]``
  leaves; XLA's cost analysis of the lowered loss, over ``B``), per
  parameter; None where the backend reports no flops."""
  cost = jax.jit(loss_fn).lower(params, batch).cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  flops = (cost or {}).get('flops')
  examples = max(int(np.shape(jax.tree.leaves(batch)[0])[0]), 1)
  count = sum(int(np.size(x)) for x in jax.tree.leaves(params))
  return float(flops) / examples / count if flops and count else None


def splits_model(params: Any, loss_fn: Any = None, batch: Any = None) -> bool:
  """Whether ``config.mesh='auto'`` may split a cohort of this model over CPU
  devices: at most :data:`fedjx.distributed.AUTO_MAX_MODEL_BYTES` of
  parameters, or (given the loss and a batch) at most
  :data:`AUTO_MAX_FLOPS_PER_PARAMETER` forward flops per example and
  parameter."""
  size = sum(int(np.size(x)) * np.dtype(getattr(x, 'dtype', np.float32)).itemsize
             for x in jax.tree.leaves(params))
  if size <= distributed.AUTO_MAX_MODEL_BYTES:
    return True
  if loss_fn is None or batch is None:
    return False
  ratio = flops_per_parameter(loss_fn, params, batch)
  return ratio is not None and ratio <= AUTO_MAX_FLOPS_PER_PARAMETER


def auto_mesh(config: ml_collections.ConfigDict, split: int, params: Any,
              loss_fn: Any = None, batch: Any = None) -> str:
  """What ``config.mesh='auto'`` means for this run: ``'clients=-1'`` (the
  cohort over the CPU devices :func:`split_cpu` made) on a CPU backend with
  uniform sampling (cohorts of exactly ``cohort_size``), at least
  :data:`fedjx.distributed.AUTO_MIN_CLIENTS_PER_DEVICE` clients per device
  and a model (``params``; not a LoRA run, whose frozen base is not in them) that
  :func:`splits_model` admits (``loss_fn`` and ``batch``, the training
  loss and a batch, measure a large model's flops), else ``''``."""
  sampling = dict(config.sampling or {}).get('name', 'uniform')
  if dict(config.lora or {}).get('rank', 0):  # A frozen base model: large.
    return ''
  if (split < 2 or jax.default_backend() != 'cpu' or sampling != 'uniform' or
      config.cohort_size < distributed.AUTO_MIN_CLIENTS_PER_DEVICE * split or
      not splits_model(params, loss_fn, batch)):
    return ''
  return 'clients=-1'


def make_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh | None:
  """The device mesh of ``config.mesh``, e.g. ``'clients=-1'`` or ``'clients=2,fsdp=2,tensor=2'``.

  Axis names and sizes over all devices (-1: the devices left over), read
  by :func:`fedjx.experiments.config.mesh_axes` (a run checks them first,
  :func:`fedjx.experiments.config.check_mesh`). With a
  ``clients`` axis, cohorts are sharded over it (each device trains its slice
  of the clients); ``cohort_size`` must be a multiple of its size. ``fsdp``
  and ``tensor`` are the axes of each replica's model: the runner lays the
  server state on :func:`fedjx.sharding.replica_specs` over them (FSDP, and
  Megatron-style tensor parallelism of a ``llama_lm`` model).
  """
  if not config.mesh:
    return None
  if config.mesh == 'auto':
    raise ValueError("make_mesh: resolve config.mesh='auto' first (auto_mesh).")
  axes = config_lib.mesh_axes(config.mesh)
  check_devices_per_process(config.mesh)
  return distributed.make_mesh(axes)


def check_coordinator_port(config: ml_collections.ConfigDict) -> None:
  """Process 0 of a multi-process run serves the coordinator: refuses a port
  on this machine that another program holds, before JAX tries to bind it."""
  address = config.coordinator_address or os.environ.get(distributed.ENV_COORDINATOR, '')
  pid = config.process_id
  if pid is None:
    pid = os.environ.get(distributed.ENV_PROCESS_ID, '0')
  host, _, port = address.rpartition(':')
  if str(pid) != '0' or not port.isdigit() or host not in (
      'localhost', '127.0.0.1', '0.0.0.0', '[::]', socket.gethostname()):
    return
  with socket.socket() as s:
    try:
      s.bind(('' if host in ('0.0.0.0', '[::]') else host, int(port)))
    except OSError as e:
      raise registry.ConfigError(
          f'the coordinator address {address!r} (config.coordinator_address or '
          f'{distributed.ENV_COORDINATOR}) cannot be served by process 0: port '
          f'{port} is in use on this machine ({e.strerror}); choose a free '
          'port.') from None


def check_devices_per_process(mesh: str) -> None:
  """A mesh spans every process's devices alike: refuses processes whose
  device counts differ, naming each process's count."""
  counts: dict[int, int] = {}
  for device in jax.devices():
    counts[device.process_index] = counts.get(device.process_index, 0) + 1
  if len(set(counts.values())) > 1:
    each = ', '.join(f'process {p} has {n}' for p, n in sorted(counts.items()))
    raise registry.ConfigError(
        f'config.mesh={mesh!r} spans {sum(counts.values())} devices of '
        f'{len(counts)} processes whose device counts differ ({each}); start '
        'every process with the same number of devices (e.g. the same '
        '--xla_force_host_platform_device_count, or as many GPUs each).')
