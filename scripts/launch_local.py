"""Runs a fedjx script as several cooperating processes on this machine.

Each process gets its own CPU devices and finds the others through the
environment that fedjx.distributed.initialize reads (FEDJX_COORDINATOR,
FEDJX_NUM_PROCESSES, FEDJX_PROCESS_ID); collectives use gloo.

  python scripts/launch_local.py --num_processes=2 --devices_per_process=4 -- \
      scripts/run.py --config configs/fedavg_digits.py --config.mesh=clients=-1 \
      --workdir runs/two_processes

The arguments and the coordinator port are checked before any process
starts. Each process's output is printed as it comes, prefixed with
``[process i]``. The launcher watches its processes: when one fails (a
non-zero exit status, or killed by a signal), it stops the others (SIGTERM,
then SIGKILL after ``--grace`` seconds: a process waiting for a dead peer in
a collective cannot finish its round) and says in one line which process
failed and how. SIGINT or SIGTERM to the launcher is passed on to every
process. Exit status: 0 when every process succeeded; else the failed
process's (128 + N for a process killed by signal N); 2 for a usage error.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

# The variables fedjx.distributed.initialize reads (not imported from there,
# so that the launcher starts without importing JAX).
ENV_COORDINATOR = 'FEDJX_COORDINATOR'
ENV_NUM_PROCESSES = 'FEDJX_NUM_PROCESSES'
ENV_PROCESS_ID = 'FEDJX_PROCESS_ID'
PROG = 'launch_local'
USAGE_STATUS = 2


class UsageError(ValueError):
  """A launcher argument that cannot work: one line, exit status 2."""


def _positive_int(name: str, text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value < 1:
    raise UsageError(f'--{name}={text}; it must be an int >= 1.')
  return value


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog='launch_local.py', description=__doc__.split('\n\n')[0],
      usage='%(prog)s [--num_processes=N] [--devices_per_process=D] [--port=P] '
            '[--timeout=S] [--grace=S] -- SCRIPT [ARGS ...]')
  parser.add_argument('--num_processes', default='2', help='processes to start (>= 1)')
  parser.add_argument('--devices_per_process', default='4',
                      help='CPU devices per process (>= 1)')
  parser.add_argument('--port', default=None,
                      help="the coordinator's port on localhost (default: a free one)")
  parser.add_argument('--timeout', type=float, default=None,
                      help='seconds before every process is stopped')
  parser.add_argument('--grace', type=float, default=5.0,
                      help='seconds between SIGTERM and SIGKILL when stopping')
  if '--' in argv:
    cut = argv.index('--')
    own, script = argv[:cut], argv[cut + 1:]
  else:
    own, script = argv, []
  args = parser.parse_args(own)
  if not script:
    raise UsageError('give the script and its arguments after --, e.g. -- '
                     'scripts/run.py --config configs/fedavg_digits.py.')
  args.num_processes = _positive_int('num_processes', args.num_processes)
  args.devices_per_process = _positive_int('devices_per_process',
                                           args.devices_per_process)
  if args.port is not None:
    args.port = _positive_int('port', args.port)
  for name in ('timeout', 'grace'):
    value = getattr(args, name)
    if value is not None and not value > 0:
      raise UsageError(f'--{name}={value}; it must be a number of seconds > 0.')
  args.script = script
  return args


def port_in_use(port: int, host: str = 'localhost') -> bool:
  """Whether ``host:port`` cannot be bound here (another program holds it)."""
  with socket.socket() as s:
    try:
      s.bind((host, port))
    except OSError:
      return True
  return False


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _script_option(script, name):
  """The value of ``--config.<name>=...`` among the script's arguments, if any."""
  value = None
  for arg in script:
    for prefix in (f'--config.{name}=', f'-config.{name}='):
      if arg.startswith(prefix):
        value = arg[len(prefix):]
  return value


def check_coordinator(args) -> str:
  """The coordinator address the processes will use, its port checked free."""
  given = _script_option(args.script, 'coordinator_address')
  processes = _script_option(args.script, 'num_processes')
  if processes is not None and processes.strip() != str(args.num_processes):
    raise UsageError(f'the script is given --config.num_processes={processes} but '
                     f'--num_processes={args.num_processes} processes are '
                     'started; give one of them.')
  if given:
    host, _, port = given.rpartition(':')
    if host in ('localhost', '127.0.0.1', socket.gethostname()) and port.isdigit() \
        and port_in_use(int(port), host):
      raise UsageError(f'--config.coordinator_address={given}: port {port} is '
                       'already in use on this machine; choose a free port or '
                       'leave the address to the launcher.')
    return given
  if args.port is None:
    return f'localhost:{free_port()}'
  if port_in_use(args.port):
    raise UsageError(f'--port={args.port} is already in use on this machine; '
                     'choose a free port, or leave --port out for a free one.')
  return f'localhost:{args.port}'


def _describe(status: int) -> str:
  if status < 0:
    try:
      return f'was killed by {signal.Signals(-status).name}'
    except ValueError:
      return f'was killed by signal {-status}'
  return f'exited with status {status}'


def _exit_status(status: int) -> int:
  return 128 - status if status < 0 else status


class Launcher:
  """Starts the processes, prints their output, and stops the rest when one fails."""

  def __init__(self, args, coordinator: str):
    self.args = args
    self.coordinator = coordinator
    self.procs: list[subprocess.Popen] = []
    self.readers: list[threading.Thread] = []
    self.print_lock = threading.Lock()

  def _env(self, pid: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    flags.append(f'--xla_force_host_platform_device_count={self.args.devices_per_process}')
    env.update({'XLA_FLAGS': ' '.join(flags), 'JAX_PLATFORMS': 'cpu',
                ENV_COORDINATOR: self.coordinator,
                ENV_NUM_PROCESSES: str(self.args.num_processes),
                ENV_PROCESS_ID: str(pid)})
    return env

  def _pipe(self, pid: int, stream, out) -> None:
    for line in iter(stream.readline, ''):
      if line.startswith('[Gloo]'):
        continue
      with self.print_lock:
        print(f'[process {pid}] {line.rstrip()}', file=out, flush=True)
    stream.close()

  def start(self) -> None:
    for pid in range(self.args.num_processes):
      proc = subprocess.Popen([sys.executable, *self.args.script], env=self._env(pid),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, bufsize=1)
      self.procs.append(proc)
      for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
        reader = threading.Thread(target=self._pipe, args=(pid, stream, out),
                                  daemon=True)
        reader.start()
        self.readers.append(reader)

  def signal_all(self, signum: int) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        try:
          proc.send_signal(signum)
        except ProcessLookupError:
          pass

  def stop_rest(self) -> list[int]:
    """SIGTERM to the processes still running, SIGKILL after the grace period."""
    running = [i for i, p in enumerate(self.procs) if p.poll() is None]
    self.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + self.args.grace
    while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
      time.sleep(0.05)
    self.signal_all(signal.SIGKILL)
    for proc in self.procs:
      proc.wait()
    return running

  def watch(self) -> int:
    """Waits for every process; the first failure stops the others."""
    deadline = (None if self.args.timeout is None
                else time.monotonic() + self.args.timeout)
    failed = None
    while failed is None:
      statuses = [p.poll() for p in self.procs]
      failed = next((i for i, s in enumerate(statuses) if s not in (None, 0)), None)
      if failed is None and all(s == 0 for s in statuses):
        break
      if failed is None and deadline is not None and time.monotonic() > deadline:
        stopped = self.stop_rest()
        self._finish()
        self._say(f'the processes ran past --timeout={self.args.timeout:g} s; '
                  f'stopped {_names(stopped)}.')
        return 124
      time.sleep(0.05)
    if failed is None:
      self._finish()
      return 0
    status = self.procs[failed].returncode
    stopped = self.stop_rest()
    self._finish()
    others = f'; stopped {_names(stopped)}' if stopped else ''
    self._say(f'process {failed} {_describe(status)}{others}.')
    return _exit_status(status)

  def _finish(self) -> None:
    for reader in self.readers:
      reader.join(timeout=5)

  def _say(self, text: str) -> None:
    with self.print_lock:
      print(f'{PROG}: {text}', file=sys.stderr, flush=True)


def _names(pids) -> str:
  if not pids:
    return 'no other process'
  return ('process ' if len(pids) == 1 else 'processes ') + ', '.join(map(str, pids))


def main(argv) -> int:
  try:
    args = parse_args(argv)
    coordinator = check_coordinator(args)
  except UsageError as e:
    print(f'{PROG}: {e}', file=sys.stderr)
    return USAGE_STATUS
  launcher = Launcher(args, coordinator)
  forwarded = []

  def forward(signum, frame):
    del frame
    forwarded.append(signum)
    launcher.signal_all(signum)

  for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, forward)
  launcher.start()
  status = launcher.watch()
  if forwarded and status != 0:
    return 128 + forwarded[0]
  return status


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
