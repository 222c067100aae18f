"""Meshes, multi-process start-up and a local multi-process launcher.

JAX's multi-controller runtime is the engine: every process runs the same
program on its own devices, and arrays sharded over the global mesh span all
of them. This module adds what a federated experiment needs on top:

* :func:`initialize`: ``jax.distributed.initialize`` from explicit arguments
  or the environment (``FEDJX_COORDINATOR``, ``FEDJX_NUM_PROCESSES``,
  ``FEDJX_PROCESS_ID``, set by :func:`launch_local`; on Cloud TPU, SLURM and
  other clusters JAX detects everything itself), whose processes other
  than 0 first wait, for a bounded time, for the coordinator to answer
  (:func:`wait_for_coordinator`: a port held by another program is one
  line at once, not JAX's wait of minutes and abort);
* :func:`make_mesh`: a mesh from axis names and sizes (``{'clients': -1,
  'fsdp': 4}``: -1 takes the devices left over); how a replica's state lies
  on its ``fsdp`` and ``tensor`` axes is :func:`fedjx.sharding.replica_specs`;
* :func:`split_cpu`: one CPU device per core, so a cohort on a ``clients``
  axis trains one client per core at a time; :func:`cpu_blocks`: where a
  round with no mesh set runs its cohort over them by itself;
* :func:`put_global`: global arrays on a mesh from host values;
* :func:`launch_local`: N processes of D CPU devices each on this machine,
  talking over gloo; what the tests use.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import xla_bridge
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

ENV_COORDINATOR = 'FEDJX_COORDINATOR'
ENV_NUM_PROCESSES = 'FEDJX_NUM_PROCESSES'
ENV_PROCESS_ID = 'FEDJX_PROCESS_ID'


# How long a process other than 0 waits for the coordinator by default (the
# initialization_timeout of jax.distributed.initialize).
COORDINATOR_TIMEOUT_S = 300.0
# How long a program that accepts connections on the coordinator's port has to
# answer as a gRPC (HTTP/2) server does, at once, before it is taken for a
# program that is not the coordinator.
ANSWER_S = 5.0
_HTTP2_PREFACE = b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n'
_HTTP2_SETTINGS = b'\x00\x00\x00\x04\x00\x00\x00\x00\x00'  # An empty SETTINGS frame.


class CoordinatorError(ValueError):
  """The coordinator cannot be reached: the message says why, in one line."""


def wait_for_coordinator(coordinator_address: str,
                         timeout_s: float = COORDINATOR_TIMEOUT_S,
                         answer_s: float = ANSWER_S) -> None:
  """Waits until ``coordinator_address`` serves JAX's coordination service.

  The coordinator (process 0) is a gRPC server: it answers the HTTP/2
  connection preface with a SETTINGS frame as soon as it accepts a
  connection. Connections refused mean process 0 has not started it yet,
  retried for up to ``timeout_s``. A program that accepts the connection but
  does not answer within ``answer_s`` (or answers otherwise, or hangs up) is
  holding the port in its place: JAX would wait out its whole
  ``initialization_timeout`` and abort, so this raises
  :class:`CoordinatorError` at once instead.
  """
  answer_s = min(answer_s, timeout_s)
  host, _, port = coordinator_address.rpartition(':')
  host = host.strip('[]')
  if not host or not port.isdigit():
    raise CoordinatorError(
        f'the coordinator address {coordinator_address!r} is not host:port '
        "(e.g. 'localhost:1234').")
  taken = (f'port {port} of {host} is taken by a program that is not '
           "process 0's coordinator ({}); choose another port in "
           '--config.coordinator_address (or FEDJX_COORDINATOR) for every '
           'process, or stop the program holding it.')
  deadline = time.monotonic() + timeout_s
  while True:
    left = deadline - time.monotonic()
    try:
      conn = socket.create_connection((host, int(port)), timeout=max(0.1, min(left, answer_s)))
    except OSError as e:
      if time.monotonic() + 0.5 >= deadline:
        raise CoordinatorError(
            f'the coordinator at {coordinator_address!r} did not come up within '
            f'{timeout_s:g} s ({e.strerror or e}); start process 0 with the same '
            '--config.coordinator_address, or raise '
            '--config.coordinator_timeout_s.') from None
      time.sleep(0.5)
      continue
    with conn:
      try:
        conn.sendall(_HTTP2_PREFACE + _HTTP2_SETTINGS)
        conn.settimeout(answer_s)
        head = b''
        while len(head) < 9:
          chunk = conn.recv(9 - len(head))
          if not chunk:
            break
          head += chunk
      except socket.timeout:
        raise CoordinatorError(taken.format(
            f'it accepts connections but did not answer within {answer_s:g} s'
        )) from None
      except OSError as e:
        raise CoordinatorError(taken.format(
            f'the connection failed: {e.strerror or e}')) from None
    if len(head) == 9 and head[3] == 0x04:  # A SETTINGS frame: gRPC.
      return
    raise CoordinatorError(taken.format(
        'it hung up' if not head else 'it answered, but not as a gRPC server'))


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None, *,
               cpu_collectives: str = 'gloo',
               timeout_s: float | None = None) -> bool:
  """Starts JAX's multi-process runtime if this is a multi-process run.

  Arguments default to the ``FEDJX_*`` environment variables. With neither,
  nothing happens (a single-process run) unless ``num_processes`` is given.
  ``timeout_s`` (default :data:`COORDINATOR_TIMEOUT_S`) bounds the wait for
  the coordinator: a process other than 0 first checks that the
  coordinator's address answers as one (:func:`wait_for_coordinator`;
  :class:`CoordinatorError`, in one line, when the port is held by another
  program or nothing comes up in time), and JAX's
  ``initialization_timeout`` is set to it.

  Returns:
    Whether ``jax.distributed`` was initialized.
  """
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
  if num_processes is None and ENV_NUM_PROCESSES in os.environ:
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and ENV_PROCESS_ID in os.environ:
    process_id = int(os.environ[ENV_PROCESS_ID])
  if coordinator_address is None and num_processes is None:
    return False
  if num_processes is not None and num_processes < 1:
    raise ValueError(f'fedjx.distributed.initialize: num_processes={num_processes}; '
                     'it must be at least 1.')
  if num_processes is not None and process_id is not None and not (
      0 <= process_id < num_processes):
    raise ValueError(f'fedjx.distributed.initialize: process_id={process_id} is not '
                     f'in [0, {num_processes}).')
  timeout_s = COORDINATOR_TIMEOUT_S if timeout_s is None else timeout_s
  if not timeout_s > 0:
    raise ValueError(f'fedjx.distributed.initialize: timeout_s={timeout_s!r}; it '
                     'must be a positive number of seconds.')
  if jax.distributed.is_initialized():
    return True
  if coordinator_address and process_id not in (None, 0):
    wait_for_coordinator(coordinator_address, timeout_s)
  # Only CPU devices use this setting; it must be made before the backend starts.
  jax.config.update('jax_cpu_collectives_implementation', cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=max(1, int(math.ceil(timeout_s))))
  return True


# A cohort runs over the CPU devices of split_cpu when each gets at least this
# many clients: a round over several devices costs a few milliseconds more
# (the digits quickstart's 10 clients of a tiny model: 11.5 s against 7.8 s
# for 300 rounds), which many clients per device amortize
# (docs/benchmarks.md) ...
AUTO_MIN_CLIENTS_PER_DEVICE = 16
# ... of models up to this size: a core per client wins for small models,
# whose operations are too small to share between threads (the 2NN's 0.8 MB:
# 2.2x less wall clock), and each device holds its own copy.
AUTO_MAX_MODEL_BYTES = 2 << 20


def may_split_cpu() -> bool:
  """Whether this process may make its CPU devices (:func:`split_cpu`) by
  itself: JAX has not started, the run is on one process (no coordinator
  in the environment) and neither ``--xla_force_host_platform_device_count``
  in ``XLA_FLAGS`` nor ``jax_num_cpu_devices`` set the count."""
  return not (xla_bridge.backends_are_initialized() or
              os.environ.get(ENV_COORDINATOR) or
              'xla_force_host_platform_device_count' in os.environ.get('XLA_FLAGS', '') or
              jax.config.jax_num_cpu_devices >= 0)


def _split_on_purpose() -> bool:
  """Whether the CPU devices were made by ``jax_num_cpu_devices`` (by
  :func:`split_cpu` or the user), not forced through ``XLA_FLAGS``."""
  return jax.config.jax_num_cpu_devices > 1


def cpu_blocks(placement: str, n: int, model_bytes: int) -> tuple[Any, int] | None:
  """``(mesh, d)`` when a fused map of ``n`` members with no mesh set runs
  one block of ``n / d`` members per CPU device (:func:`fedjx.mapping.
  device_blocks`), on a mesh of ``d`` CPU devices with one axis named
  ``placement``; None to run on one device.

  That is on a CPU backend of one process whose CPU was split on purpose
  (``jax_num_cpu_devices`` above 1: :func:`split_cpu`, which
  ``fedjx.datasets.on_device`` and ``fedjx-run`` call before JAX starts;
  devices forced through ``XLA_FLAGS`` are left to the meshes that name
  them), for ``d`` the most devices that divide ``n`` with at least
  :data:`AUTO_MIN_CLIENTS_PER_DEVICE` members each (at least 2), and
  members that train at most :data:`AUTO_MAX_MODEL_BYTES` of values shared
  by all (``model_bytes``: the broadcast model and what the members close
  over). The same rule as ``fedjx-run``'s ``config.mesh='auto'`` for small
  models, so the loop a user writes gets the round ``fedjx-run`` runs.
  """
  if (jax.default_backend() != 'cpu' or jax.process_count() > 1 or
      not _split_on_purpose() or model_bytes > AUTO_MAX_MODEL_BYTES):
    return None
  cpus = jax.devices('cpu')
  d = max((k for k in range(1, len(cpus) + 1)
           if n % k == 0 and n >= AUTO_MIN_CLIENTS_PER_DEVICE * k), default=1)
  if d < 2:
    return None
  mesh = jax.make_mesh((d,), (placement,), axis_types=(AxisType.Auto,),
                       devices=cpus[:d])
  return mesh, d


def split_cpu(devices: int | str = 'auto', divides: int | None = None) -> int:
  """Makes JAX's CPU backend ``devices`` devices; call before JAX starts.

  XLA runs each CPU device's program on one thread of a pool shared by all
  of them. On one device, a small client's many small operations are
  spread over the pool's threads, which mostly wait on each other; a
  cohort split over one device per core on a ``clients`` mesh axis
  (``jax.set_mesh(make_mesh({'clients': -1}))``) runs one client per core
  at a time, each device its own loop (:func:`fedjx.mapping.device_blocks`).

  Args:
    devices: how many; ``'auto'``: one per core this process may run on.
    divides: if given, the count is the largest one up to ``devices`` that
      divides it (a cohort size), so the cohort splits evenly.

  Returns:
    The number of CPU devices made; 1 (nothing changed) when JAX's backends
    have started already.
  """
  if devices == 'auto':
    devices = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
               else os.cpu_count() or 1)
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ValueError(f"fedjx.distributed.split_cpu: devices={devices!r}; it must "
                     "be a positive int or 'auto' (one per core).")
  if divides is not None:
    devices = max(k for k in range(1, devices + 1) if divides % k == 0)
  if xla_bridge.backends_are_initialized():
    return 1
  jax.config.update('jax_num_cpu_devices', devices)
  return devices


def make_mesh(axes: Mapping[str, int] | None = None,
              axis_types: str = 'auto',
              devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """A mesh over all (global) devices from axis names and sizes.

  Args:
    axes: axis name to size, in order; one size may be -1 for "the rest".
      Default ``{'clients': -1}``.
    axis_types: ``'auto'`` or ``'explicit'`` sharding for every axis.
    devices: the devices (default: ``jax.devices()``, all processes).
  """
  axes = dict(axes or {'clients': -1})
  devices = list(devices) if devices is not None else jax.devices()
  if axis_types not in ('auto', 'explicit'):
    raise ValueError(f"fedjx.distributed.make_mesh: axis_types={axis_types!r} is "
                     "not one of ('auto', 'explicit').")
  sizes = list(axes.values())
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f'fedjx.distributed.make_mesh: axes={axes}: at most one size '
                     'may be -1.')
  known = int(np.prod([s for s in sizes if s != -1]))
  for name, s in axes.items():
    if s != -1 and (not isinstance(s, int) or s < 1):
      raise ValueError(f'fedjx.distributed.make_mesh: axis {name!r} has size {s!r}; '
                       'sizes are positive ints or -1.')
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f'fedjx.distributed.make_mesh: {len(devices)} devices cannot '
                       f'be split into axes {axes}.')
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f'fedjx.distributed.make_mesh: axes {dict(zip(axes, sizes))} '
                     f'need {int(np.prod(sizes))} devices; there are {len(devices)}.')
  kind = AxisType.Explicit if axis_types == 'explicit' else AxisType.Auto
  return jax.make_mesh(tuple(sizes), tuple(axes), axis_types=(kind,) * len(sizes),
                       devices=devices)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def launch_local(argv: Sequence[str], num_processes: int, devices_per_process: int,
                 env: Mapping[str, str] | None = None, timeout: float | None = None,
                 cwd: str | None = None) -> list[subprocess.CompletedProcess]:
  """Runs ``python argv...`` as ``num_processes`` cooperating processes here.

  Each process sees ``devices_per_process`` CPU devices
  (``--xla_force_host_platform_device_count``) and finds the others through
  the ``FEDJX_*`` variables that :func:`initialize` reads; collectives go over
  gloo on localhost.

  Returns:
    The completed processes (stdout and stderr captured), in process order.
  """
  port = free_port()
  procs = []
  for pid in range(num_processes):
    penv = dict(os.environ)
    penv.update(env or {})
    flags = [f for f in penv.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    flags.append(f'--xla_force_host_platform_device_count={devices_per_process}')
    penv.update({'XLA_FLAGS': ' '.join(flags), 'JAX_PLATFORMS': 'cpu',
                 ENV_COORDINATOR: f'localhost:{port}',
                 ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(pid)})
    procs.append(subprocess.Popen([sys.executable, *argv], env=penv, cwd=cwd,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
  results = []
  for pid, proc in enumerate(procs):
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
    results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
  return results


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(tree: Any) -> Any:
  """NumPy copies of (possibly multi-process, replicated) arrays.

  A replicated global array is not fully addressable in a multi-process
  run; its local shard holds the whole value.
  """
  def one(x):
    if _is_key(x):
      x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if not x.sharding.is_fully_replicated:
        raise ValueError('fedjx.distributed.to_host: the array is sharded over '
                         'processes; gather it first.')
      return np.asarray(x.addressable_data(0))
    return np.asarray(x)
  return jax.tree.map(one, tree)


def put_global(tree: Any, mesh: jax.sharding.Mesh, specs: Any = None) -> Any:
  """Global arrays on ``mesh`` from host values that every process holds alike.

  Args:
    tree: the values (the same on every process, e.g. an initial state).
    mesh: the global mesh.
    specs: a ``PartitionSpec`` per leaf (a pytree prefix), default replicated.
  """
  specs = jax.tree.map(lambda _: P(), tree) if specs is None else specs

  def one(x, spec):
    if _is_key(x):
      data = one(jax.random.key_data(x), spec)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    arr = to_host(x)
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])

  return jax.tree.map(one, tree, specs)
