"""``fedjx-deploy``: a fedjx config's rounds on a local Flower federation.

::

  fedjx-deploy --config configs/fedavg_digits.py --nodes 3 \\
      --overrides "rounds=3 cohort_size=3 dataset.num_clients=3" \\
      --workdir runs/flower_local

Checks everything first (the arguments, the config file and its overrides,
that the algorithm can be deployed, one training client per node, the
workdir): a mistake is one line on stderr naming the argument, its value and
what is allowed, exit status 2, and no process has been started. Then it
starts a Flower SuperLink and ``--nodes`` SuperNodes on 127.0.0.1
(:class:`fedjx.deploy.local.LocalFederation`), submits the fedjx Flower App
(:mod:`fedjx.experiments.deploy.apps`) with ``flwr run``, and shows the
rounds as ``fedjx-run`` does: a progress bar with the training loss and the
evaluation accuracy, the ServerApp's warnings (a lost node, a failed client)
above it, and the last round's evaluation at the end.

SIGTERM or Ctrl-C asks the ServerApp to stop (``workdir/deploy.stop``): it
drops the round in flight and saves a checkpoint of the last complete one;
then the SuperLink is stopped, then the nodes. Running the same command
again resumes from that checkpoint. Exit status: 0 done; 1 the federation
did not start (one line: e.g. its port was taken by another program) or its
run ended before its last round (see the run's log); 2 a usage or config
error; 130/143 stopped by Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from fedjx import _install
from fedjx.deploy import local
from fedjx.experiments import metrics_writers
from fedjx.experiments import workdir as workdir_lib
from fedjx.experiments.deploy import app_dir

__all__ = ['main', 'parse_args', 'validate']

PROG = 'fedjx-deploy'
USAGE_STATUS = 2
FAILED_STATUS = 1
STOP_FILE = 'deploy.stop'  # fedjx.deploy.flower.STOP_FILE (no Flower import here).
# Flower's upper bounds on packages that other extras install newer
# (flwr 1.42.0's metadata): installing it downgrades them.
FLOWER_MISSING = ('Flower is not installed: {install} (Flower caps packaging<26, '
                  'rich<15 and cryptography<51, so pip downgrades newer ones; '
                  'fedjx and its tests run with either).')
# Seconds the ServerApp has to save its checkpoint after a stop request.
STOP_GRACE_S = 60.0
_CONFIG_OVERRIDE = re.compile(r'^--config\.([A-Za-z0-9_.]+)=(.*)$')
# The ServerApp's own lines worth showing above the bar (lost nodes, failures).
_SHOWN = re.compile(r'fedjx(?: round \d+)?: (?!resuming).*(lost|back|no client|'
                    r'stopped|did not|SIG)')


class UsageError(ValueError):
  """A command-line mistake: one line, exit status 2."""


class _Stop(Exception):
  """SIGTERM or SIGINT reached the launcher."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The command line; ``--config.PATH=VALUE`` words (``fedjx-run``'s
  spelling) join ``--overrides``."""
  words, rest = [], []
  for arg in argv:
    match = _CONFIG_OVERRIDE.match(arg)
    if match:
      words.append(f'{match.group(1)}={match.group(2)}')
    else:
      rest.append(arg)
  parser = _Parser(prog=PROG, description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', required=True,
                      help='fedjx config file (path[:arg]), as fedjx-run takes it')
  parser.add_argument('--overrides', default='',
                      help='"path=value ..." set on the config (Python literals); '
                      '--config.PATH=VALUE works too')
  parser.add_argument('--nodes', type=int, default=3,
                      help='SuperNodes to start (one per training client)')
  parser.add_argument('--workdir', default='',
                      help='metrics, checkpoints and deploy.jsonl (default '
                      'runs/<config file name>_deploy); the same one again resumes')
  parser.add_argument('--timeout', type=float, default=120.0,
                      help='seconds a round waits for its clients')
  parser.add_argument('--wait', type=float, default=120.0,
                      help='seconds the first round waits for the nodes to connect')
  parser.add_argument('--home', default='',
                      help="Flower's state and the processes' logs (default: a new "
                           'temporary directory)')
  parser.add_argument('--simulation', action='store_true',
                      help="Flower's simulation engine instead of processes (Ray)")
  args = parser.parse_args(rest)
  args.overrides = ' '.join([args.overrides] + words).strip()
  return args


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line and :class:`UsageError`."""

  def error(self, message: str):
    raise UsageError(message)


def _positive(name: str, value: float) -> None:
  if not value > 0:
    raise UsageError(f'{name}={value:g}; it must be a number of seconds > 0.')


def validate(args: argparse.Namespace) -> Any:
  """Checks the whole command before any process starts; returns the config.

  Raises:
    UsageError: (one line) naming the argument, its value and what is allowed.
  """
  if args.nodes < 1:
    raise UsageError(f'--nodes={args.nodes}; it must be an int >= 1.')
  _positive('--timeout', args.timeout)
  _positive('--wait', args.wait)
  path = args.config.partition(':')[0]
  if not os.path.isfile(path):
    raise UsageError(f'--config={args.config}: no such file (give a config file, '
                     'e.g. configs/fedavg_digits.py).')
  try:
    workdir_lib.check(args.workdir)
  except workdir_lib.WorkdirError as e:
    raise UsageError(_one_line(e)) from None
  # Before the config, which imports JAX (seconds): a missing Flower is
  # told at once.
  if importlib.util.find_spec('flwr') is None:
    raise UsageError(FLOWER_MISSING.format(install=_install.command('flower')))
  if args.simulation and importlib.util.find_spec('ray') is None:
    raise UsageError("--simulation needs Flower's simulation engine, which runs "
                     "on Ray: pip install 'flwr[simulation]'.")
  from fedjx.experiments.deploy import config_rounds  # deferred: before JAX (usage errors, config checks)
  try:
    config = config_rounds.load_config(args.config, args.overrides)
  except Exception as e:  # pylint: disable=broad-except
    where = f'--overrides={args.overrides!r}' if args.overrides else f'--config={args.config}'
    raise UsageError(f'{where}: {_one_line(e)}') from None
  quiet = config.copy_and_resolve_references()
  quiet.progress = False  # Validation shows no bars of its own.
  try:
    server = config_rounds.ExperimentRounds(quiet)
    server.pieces(server.initial_state(), server.cohort(0)[1])
  except ValueError as e:
    raise UsageError(f'--config={args.config}: {_one_line(e)}') from None
  if not args.simulation and server.num_clients != args.nodes:
    raise UsageError(
        f'--nodes={args.nodes}, but config.dataset has {server.num_clients} '
        f'training clients; one node holds one client: give --nodes '
        f'{server.num_clients} or --overrides "dataset.num_clients={args.nodes}".')
  return config


def _one_line(e: BaseException) -> str:
  text = ' '.join(str(e).split()) or type(e).__name__
  for prefix in ('fedjx.deploy: ', 'fedjx.deploy.flower: ', 'fedjx.deploy.local: '):
    text = text.removeprefix(prefix)
  return text


def _absolute_config(spec: str) -> str:
  path, sep, arg = spec.partition(':')
  return os.path.abspath(path) + (sep + arg if sep else '')


def _default_workdir(spec: str) -> str:
  name = os.path.splitext(os.path.basename(spec.partition(':')[0]))[0]
  return os.path.join('runs', f'{name}_deploy')


# ------------------------------------------------------------------ progress

class Progress:
  """``fedjx-run``'s progress bar and lines, read from the deployed run's
  workdir (its metrics) and log (the ServerApp's warnings)."""

  def __init__(self, config: Any, workdir: str, run_log: str):
    from fedjx.experiments import loop  # deferred: before JAX (usage errors, config checks)
    self.config, self.workdir, self.run_log = config, workdir, run_log
    self.rows: dict[int, dict[str, Any]] = {}
    self._log_at = 0
    self._last: dict[str, Any] = {}
    self.bar = loop.progress_bar(config.rounds, _checkpointed(workdir),
                                 bool(config.progress))
    self.log = loop.above(self.bar, lambda m: print(m, file=sys.stderr, flush=True))

  def poll(self) -> None:
    """Shows the rounds written since the last call."""
    self._lines()
    try:
      rows = {int(r['round']): r for r in metrics_writers.read_metrics(self.workdir)}
    except (OSError, ValueError):
      return
    for step in sorted(s for s in rows if s > self.bar.n):
      self._after(step, rows[step])
    self.rows.update(rows)

  def _after(self, step: int, row: dict[str, Any]) -> None:
    from fedjx.experiments import run_trainer  # deferred: before JAX (usage errors, config checks)
    self._last.update(row)  # As fedjx-run: the newest value of each metric.
    last = self._last
    postfix = {'loss': run_trainer._train_loss(last)}  # pylint: disable=protected-access
    if 'eval_accuracy' in last:
      postfix['eval_acc'] = last['eval_accuracy']
    self.bar.set_postfix({k: f'{float(v):.4f}' for k, v in postfix.items()
                          if v is not None}, refresh=False)
    self.bar.update(step - self.bar.n)

  def _lines(self) -> None:
    """The ServerApp's warnings written to the run's log since the last look."""
    try:
      with open(self.run_log, encoding='utf-8', errors='replace') as f:
        f.seek(self._log_at)
        text = f.read()
    except OSError:
      return
    complete = text[:text.rfind('\n') + 1]
    self._log_at += len(complete.encode('utf-8', errors='replace'))
    for line in complete.splitlines():
      if _SHOWN.search(line):
        self.log(line[line.index('fedjx'):].strip())

  def close(self) -> None:
    self.poll()
    self.bar.close()

  def summary(self) -> str:
    """``fedjx-run``'s closing line: the last round's evaluation."""
    if not self.rows:
      return ''
    last = self.rows[max(self.rows)]
    shown = {'round': max(self.rows), **{k: v for k, v in last.items()
                                        if k.startswith('eval_') or k == 'elapsed_s'}}
    return ' '.join(f'{k}={v:.4f}' if isinstance(v, float) else f'{k}={v}'
                    for k, v in shown.items())


def _checkpointed(workdir: str) -> int:
  """The step of the newest checkpoint in ``workdir`` (0 for none)."""
  directory = os.path.join(workdir, 'checkpoints')
  try:
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
  except OSError:
    return 0
  return max(steps, default=0)


# ------------------------------------------------------------------ run

def _raise_stop(signum, frame):
  del frame
  raise _Stop(signum)


def _follow(federation: local.LocalFederation, process: Any,
            progress: Progress) -> int:
  """Waits for ``flwr run`` to end, showing the rounds; its exit status."""
  while process.poll() is None:
    progress.poll()
    time.sleep(0.5)
  return process.returncode


def _stop_run(federation: local.LocalFederation, process: Any, workdir: str,
              progress: Progress) -> None:
  """Asks the ServerApp to stop and waits (up to :data:`STOP_GRACE_S`) for it
  to save its checkpoint and end, before any process is stopped."""
  with open(os.path.join(workdir, STOP_FILE), 'w', encoding='utf-8') as f:
    f.write('stop\n')
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # A second Ctrl-C: no half stop.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  deadline = time.monotonic() + STOP_GRACE_S
  while process.poll() is None and time.monotonic() < deadline:
    progress.poll()
    time.sleep(0.5)
  federation.stop_process(process)


def _deploy(args: argparse.Namespace, config: Any) -> int:
  home = os.path.abspath(args.home or tempfile.mkdtemp(prefix='fedjx-flower-'))
  workdir = os.path.abspath(args.workdir)
  os.makedirs(workdir, exist_ok=True)
  app = app_dir.write_app(
      os.path.join(home, 'app'), config=_absolute_config(args.config),
      overrides=args.overrides, workdir=workdir, timeout=args.timeout,
      wait_s=args.wait)
  print(f'{PROG}: logs in {home}', file=sys.stderr, flush=True)
  with local.LocalFederation(args.nodes, home, simulation=args.simulation) as federation:
    print(f'{PROG}: {federation.describe()}', file=sys.stderr, flush=True)
    process = federation.submit(app)
    progress = Progress(config, workdir, federation.log_path('run'))
    try:
      status = _follow(federation, process, progress)
    except _Stop as stop:
      _stop_run(federation, process, workdir, progress)
      progress.close()
      print(f'{PROG}: stopped by {stop}; {workdir} keeps the checkpoint after '
            f'round {_checkpointed(workdir)}: run the same command again to '
            'continue.', file=sys.stderr)
      return 128 + stop.signum
    progress.close()
  done = _checkpointed(workdir)
  if status != 0 or done < config.rounds:
    print(f'{PROG}: the run ended after round {done} of {config.rounds} (flwr run '
          f'exited with status {status}); see {federation.log_path("run")}.',
          file=sys.stderr)
    return FAILED_STATUS
  if progress.summary():
    print(progress.summary())
  print(f'{PROG}: done; metrics and checkpoints in {workdir}')
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Console-script entry point; returns the exit status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  # Set first: a shell may start this with SIGINT ignored; before the
  # federation starts, a signal ends the command at once.
  signal.signal(signal.SIGINT, _raise_stop)
  signal.signal(signal.SIGTERM, _raise_stop)
  try:
    args = parse_args(argv)
    args.workdir = args.workdir or _default_workdir(args.config)
    config = validate(args)
    return _deploy(args, config)
  except UsageError as e:
    print(f'{PROG}: {e}', file=sys.stderr)
    return USAGE_STATUS
  except local.FederationError as e:  # Before any node started.
    print(f'{PROG}: {_one_line(e)}', file=sys.stderr)
    return FAILED_STATUS
  except _Stop as stop:
    print(f'{PROG}: stopped by {stop} during start-up.', file=sys.stderr)
    return 128 + stop.signum


def console() -> None:
  """``fedjx-deploy``'s entry in ``setup.cfg``."""
  sys.exit(main())


if __name__ == '__main__':
  console()
