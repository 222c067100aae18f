"""A Flower federation on this machine: a SuperLink and N SuperNodes as processes.

:class:`LocalFederation` starts ``flower-superlink`` and ``flower-supernode``
processes on 127.0.0.1 (ports found by binding port 0), node ``i`` with
``--node-config "partition-id=i num-partitions=N"``, and submits a Flower
App to them with ``flwr run`` (the SuperLink connection is written to a
private ``FLWR_HOME``). The nodes start once the SuperLink itself listens
on its port: a port that another program took between the pick and the
SuperLink's bind is a :class:`FederationError` of one line, as is a
SuperLink that exits (the reason from its log), at once, before any node
starts. Each process runs in a session of its own, so
stopping it (SIGTERM, then SIGKILL after ``grace`` seconds) also stops the
ServerApp and ClientApp processes it started; :meth:`LocalFederation.stop`
runs on leaving the ``with`` block, on an error as well as on Ctrl-C.

This module imports neither JAX nor Flower: it runs Flower's commands.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from fedjx import _install

__all__ = ['CONNECTION', 'FederationError', 'LocalFederation', 'descendants',
           'free_port', 'listening_sockets']

CONNECTION = 'fedjx-local'


class FederationError(RuntimeError):
  """The local federation could not start (one line: what, and the log to read)."""


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _command(name: str) -> str:
  """Flower's command ``name``, from this Python's environment first."""
  here = os.path.dirname(sys.executable)
  found = shutil.which(name, path=os.pathsep.join([here, os.environ.get('PATH', '')]))
  if found is None:
    raise FileNotFoundError(
        f'fedjx.deploy.local: {name!r} is not installed; install the flower '
        f"extra: {_install.command('flower')}.")
  return found


def _stat(pid: int | str) -> tuple[int, int, int] | None:
  """``(parent, session, start time)`` of a process, from ``/proc``."""
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8', errors='replace') as f:
      stat = f.read()
  except OSError:
    return None
  # The fields after the parenthesised command (which may hold spaces):
  # state, ppid, pgrp, session, ..., starttime (the 20th of them).
  fields = stat.rsplit(')', 1)[1].split()
  return int(fields[1]), int(fields[3]), int(fields[19])


def descendants(pid: int) -> list[tuple[int, int, int]]:
  """``(pid, session, start time)`` of the processes below ``pid`` (its
  children, theirs, ...), from ``/proc`` (empty where there is none)."""
  try:
    entries = [e for e in os.listdir('/proc') if e.isdigit()]
  except OSError:
    return []
  children: dict[int, list[tuple[int, int, int]]] = {}
  for entry in entries:
    info = _stat(entry)
    if info is not None:
      children.setdefault(info[0], []).append((int(entry), info[1], info[2]))
  found, todo = [], [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      found.append(child)
      todo.append(child[0])
  return found


_LISTEN = '0A'  # The state of a listening socket in /proc/net/tcp.
# The addresses (as /proc/net/tcp and tcp6 write them) whose listeners hold
# 127.0.0.1's port: 127.0.0.1 itself, every IPv4 address, every address of
# a dual-stack IPv6 socket, and 127.0.0.1 mapped into IPv6.
_LOOPBACK_HOLDERS = {'0100007F', '00000000', '0' * 32, '0000000000000000FFFF00000100007F'}


def listening_sockets(port: int) -> set[int] | None:
  """The inodes of the TCP sockets listening on 127.0.0.1:``port`` (or on
  every address), from ``/proc/net/tcp`` and ``tcp6``; None where those
  cannot be read."""
  found, read = set(), False
  for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    try:
      with open(table, encoding='ascii') as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    read = True
    for row in rows:
      # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
      fields = row.split()
      if len(fields) <= 9 or fields[3] != _LISTEN:
        continue
      address, _, at = fields[1].rpartition(':')
      if int(at, 16) == port and address.upper() in _LOOPBACK_HOLDERS:
        found.add(int(fields[9]))
  return found if read else None


def _sockets_of(pid: int) -> set[int]:
  """The inodes of the sockets process ``pid`` holds open."""
  held = set()
  try:
    fds = os.listdir(f'/proc/{pid}/fd')
  except OSError:
    return held
  for fd in fds:
    try:
      target = os.readlink(f'/proc/{pid}/fd/{fd}')
    except OSError:
      continue
    if target.startswith('socket:['):
      held.add(int(target[len('socket:['):-1]))
  return held


_ANSI = re.compile(r'\x1b\[[0-9;]*m')


def _reason(log: str) -> str | None:
  """The last error a process wrote to ``log`` (an OS error first), one line."""
  try:
    with open(log, encoding='utf-8', errors='replace') as f:
      lines = [_ANSI.sub('', line).strip() for line in f]
  except OSError:
    return None
  for pattern in (r'\[Errno \d+\]', r'\bERROR\b|Error\b'):
    found = [line for line in lines if re.search(pattern, line)]
    if found:  # Without its time stamp and level: from the error itself.
      line = found[-1]
      start = re.search(r'\[Errno \d+\]|\w*Error\b', line)
      return line[start.start():] if start else line
  return None


def _toml_value(value: Any) -> str:
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (int, float)):
    return repr(value)
  return '"' + str(value).replace('\\', '\\\\').replace('"', '\\"') + '"'


class LocalFederation:
  """A SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1.

  Args:
    num_nodes: SuperNodes to start; node ``i`` holds partition ``i`` of
      ``num_nodes`` (``num_partitions`` to say otherwise).
    home: a directory for Flower's state and the processes' logs
      (``superlink.log``, ``node-<i>.log``, ``run.log``).
    num_partitions: the ``num-partitions`` of every node (default ``num_nodes``).
    env: extra environment variables for every process.
    grace: seconds between SIGTERM and SIGKILL when stopping.
    simulation: start the SuperLink with Flower's simulation runtime and no
      SuperNodes: ``flwr run`` then runs ``num_nodes`` virtual SuperNodes
      in one process (Flower's simulation engine, which needs Ray:
      ``pip install 'flwr[simulation]'``), each given its ``partition-id``
      and ``num-partitions`` by Flower.
  """

  def __init__(self, num_nodes: int, home: str, *, num_partitions: int | None = None,
               env: Mapping[str, str] | None = None, grace: float = 5.0,
               simulation: bool = False):
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
      raise ValueError(f'num_nodes={num_nodes!r}; it must be an int >= 1.')
    self.num_nodes = num_nodes
    self.num_partitions = num_nodes if num_partitions is None else num_partitions
    self.home = os.path.abspath(home)
    self.grace = grace
    self.simulation = simulation
    self.env = dict(os.environ)
    # Flower's processes start its other commands by name (the SuperLink its
    # SuperExec, a node its ClientApps): from this Python's environment too,
    # where it is not on PATH (a virtual environment that is not activated).
    here = os.path.dirname(sys.executable)
    self.env['PATH'] = os.pathsep.join(
        [here] + [p for p in self.env.get('PATH', '').split(os.pathsep) if p and p != here])
    # Several JAX processes share one accelerator: none takes most of its memory.
    self.env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
    self.env.update(env or {})
    self.port: int | None = None
    self.superlink: subprocess.Popen | None = None
    self.nodes: list[subprocess.Popen | None] = []
    self._logs: list[Any] = []

  # -- processes

  def _start(self, args: list[str], name: str, home: str) -> subprocess.Popen:
    os.makedirs(home, exist_ok=True)
    log = open(os.path.join(self.home, f'{name}.log'), 'ab')  # pylint: disable=consider-using-with
    self._logs.append(log)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(self.env, FLWR_HOME=home), cwd=self.home)

  def _wait_listening(self, port: int, process: subprocess.Popen, name: str,
                      timeout: float) -> None:
    """Returns once ``process`` (or a process it started) listens on ``port``.

    Raises :class:`FederationError` at once when the process exits (with the
    error its log ends on) or when another program listens on the port
    (taken between the pick and the bind: the SuperLink's own bind fails).
    Where ``/proc`` cannot tell who listens, a connection to the port is
    taken as the process listening.
    """
    deadline = time.monotonic() + timeout
    where = f'127.0.0.1:{port}'
    while time.monotonic() < deadline:
      if process.poll() is not None:
        reason = _reason(self.log_path(name))
        raise FederationError(
            f'fedjx.deploy.local: {name} exited with status {process.returncode}'
            + (f' ({reason})' if reason else '') + f'; see {self.log_path(name)}.')
      held = listening_sockets(port)
      if held is None:  # No /proc: whoever answers is taken to be it.
        with socket.socket() as s:
          s.settimeout(0.5)
          if s.connect_ex(('127.0.0.1', port)) == 0:
            return
      elif held:
        ours = _sockets_of(process.pid).union(
            *(_sockets_of(pid) for pid, _, _ in descendants(process.pid)))
        if held & ours:
          return
        raise FederationError(
            f'fedjx.deploy.local: another program listens on {where}, which was '
            f'free when it was picked for the {name}; the {name} cannot bind it. '
            'Run the command again (it picks another port).')
      time.sleep(0.1)
    raise FederationError(f'fedjx.deploy.local: {name} did not listen on {where} '
                          f'within {timeout:g} s; see {self.log_path(name)}.')

  def log_path(self, name: str) -> str:
    return os.path.join(self.home, f'{name}.log')

  def start(self, timeout: float = 60.0) -> 'LocalFederation':
    """Starts the SuperLink, waits until it listens, then starts the nodes."""
    os.makedirs(self.home, exist_ok=True)
    self.port = free_port()
    self.superlink = self._start(
        [_command('flower-superlink'), '--insecure', '--host', '127.0.0.1',
         '--port', str(self.port), '--database', ':flwr-in-memory:']
        + (['--simulation'] if self.simulation else []),
        'superlink', os.path.join(self.home, 'flwr-superlink'))
    self._wait_listening(self.port, self.superlink, 'superlink', timeout)
    for i in range(0 if self.simulation else self.num_nodes):
      self.nodes.append(self._start(
          [_command('flower-supernode'), '--insecure',
           '--superlink', f'127.0.0.1:{self.port}', '--port', str(free_port()),
           '--node-config', f'partition-id={i} num-partitions={self.num_partitions}'],
          f'node-{i}', os.path.join(self.home, f'flwr-node-{i}')))
    self._write_connection()
    return self

  def _write_connection(self) -> None:
    home = os.path.join(self.home, 'flwr-cli')
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, 'config.toml'), 'w', encoding='utf-8') as f:
      f.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n'
              f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\n'
              'insecure = true\n'
              + (f'options.num-supernodes = {self.num_nodes}\n'
                 if self.simulation else ''))

  def submit(self, app_dir: str, run_config: Mapping[str, Any] | None = None
             ) -> subprocess.Popen:
    """Starts ``flwr run app_dir`` on this federation, its log streamed to
    ``run.log``; returns its process (it ends with the run)."""
    args = [_command('flwr'), 'run', os.path.abspath(app_dir), CONNECTION, '--stream']
    if run_config:
      args += ['--run-config',
               ' '.join(f'{k}={_toml_value(v)}' for k, v in run_config.items())]
    return self._start(args, 'run', os.path.join(self.home, 'flwr-cli'))

  def run(self, app_dir: str, run_config: Mapping[str, Any] | None = None, *,
          timeout: float | None = None) -> int:
    """``flwr run app_dir`` on this federation, logs streamed to ``run.log``;
    returns its exit status (124 when ``timeout`` seconds pass first)."""
    process = self.submit(app_dir, run_config)
    try:
      return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.stop_process(process)
      return 124
    finally:
      self.stop_process(process)

  def kill_node(self, i: int) -> None:
    """SIGKILL to node ``i`` and the ClientApp it runs (a node that fails)."""
    process = self.nodes[i]
    if process is not None and process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()

  def stop_process(self, process: subprocess.Popen | None) -> None:
    """SIGTERM to the process's session, SIGKILL after ``grace`` seconds;
    then SIGKILL to what it started that outlived it (Flower starts its
    SuperExec in a session of its own, which starts the apps)."""
    if process is None:
      return
    below = descendants(process.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
      try:
        os.killpg(process.pid, sig)  # The session this process leads.
      except ProcessLookupError:
        break
      try:
        process.wait(timeout=self.grace)
        break
      except subprocess.TimeoutExpired:
        continue
    for pid, session, start in below:
      info = _stat(pid)
      if info is None or info[2] != start:
        continue  # Gone (its id may name another process by now).
      try:
        if session == pid:  # It leads a session: end what it started too.
          os.killpg(pid, signal.SIGKILL)
        else:
          os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass

  def stop(self) -> None:
    """Stops the SuperLink (and the ServerApp it runs), then the nodes.

    In this order a ServerApp still running sees its link end, not its
    clients vanish one by one: it cannot record a round as done without
    them. (``fedjx-deploy`` first asks the ServerApp to stop and save the
    last complete round; see :mod:`fedjx.deploy.cli`.)
    """
    self.stop_process(self.superlink)
    for process in self.nodes:
      self.stop_process(process)
    for log in self._logs:
      log.close()
    self._logs = []

  def __enter__(self) -> 'LocalFederation':
    try:
      return self.start()
    except BaseException:
      self.stop()
      raise

  def __exit__(self, *exc: Any) -> None:
    self.stop()

  def describe(self) -> str:
    if self.simulation:
      nodes = f'{self.num_nodes} simulated SuperNodes'
    else:
      nodes = (f'{self.num_nodes} SuperNodes (pids '
               f'{", ".join(str(p.pid) for p in self.nodes if p is not None)})')
    return (f'SuperLink on 127.0.0.1:{self.port} (pid {self.superlink.pid}), '
            f'{nodes}; logs in {shlex.quote(self.home)}')
