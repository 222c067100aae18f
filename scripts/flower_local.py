"""Runs a fedjx config on a local Flower federation: one command, real processes.

Starts a Flower SuperLink and N SuperNodes on 127.0.0.1 (node i holds
client i: --node-config "partition-id=i num-partitions=N"), submits the
fedjx Flower App (fedjx.deploy.flower) with ``flwr run``, streams its log,
and stops every process it started when the run ends, fails, or on Ctrl-C.

  python scripts/flower_local.py --config configs/fedavg_digits.py --nodes 3 \
      --overrides "rounds=3 cohort_size=3 dataset.num_clients=3" \
      --workdir runs/flower_local

The dataset must have N training clients (one per node). Metrics and
checkpoints go to --workdir as fedjx-run writes them, plus deploy.jsonl
(who replied each round, bytes on the wire). --simulation runs the same App
on Flower's simulation engine instead (a SuperLink with --simulation and N
virtual SuperNodes; needs pip install 'flwr[simulation]', which brings Ray).
Exit status: that of ``flwr run`` (0 on success), 2 for a usage error.
"""

import argparse
import importlib.util
import os
import signal
import sys
import tempfile

from fedjx.deploy import flower_app
from fedjx.deploy import local


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', required=True, help='fedjx config file (path[:arg])')
  parser.add_argument('--overrides', default='',
                      help='"path=value ..." set on the config (Python literals)')
  parser.add_argument('--nodes', type=int, default=3, help='SuperNodes to start')
  parser.add_argument('--workdir', default='', help='metrics and checkpoints')
  parser.add_argument('--timeout', type=float, default=120.0,
                      help='seconds a round waits for its clients')
  parser.add_argument('--home', default='',
                      help="Flower's state and the processes' logs (default: a new "
                           'temporary directory)')
  parser.add_argument('--simulation', action='store_true',
                      help="Flower's simulation engine instead of processes (Ray)")
  args = parser.parse_args(argv)
  if args.nodes < 1:
    parser.error(f'--nodes={args.nodes}; it must be >= 1.')
  return args


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  home = os.path.abspath(args.home or tempfile.mkdtemp(prefix='fedjx-flower-'))
  config = os.path.abspath(args.config.partition(':')[0]) + (
      ':' + args.config.partition(':')[2] if ':' in args.config else '')
  run_config = dict(config=config, overrides=args.overrides,
                    workdir=os.path.abspath(args.workdir) if args.workdir else '',
                    timeout=args.timeout)
  app = flower_app.write_app(os.path.join(home, 'app'), **run_config)
  if args.simulation and importlib.util.find_spec('ray') is None:
    print("flower_local: --simulation needs Flower's simulation engine, which "
          "runs on Ray: pip install 'flwr[simulation]'.", file=sys.stderr)
    return 2
  print(f'flower_local: logs in {home}', flush=True)
  # Ctrl-C and SIGTERM leave the `with` block, which stops every process;
  # set here because a shell may start this script with SIGINT ignored.
  signal.signal(signal.SIGINT, _interrupt)
  signal.signal(signal.SIGTERM, _interrupt)
  try:
    with local.LocalFederation(args.nodes, home,
                               simulation=args.simulation) as federation:
      print(f'flower_local: {federation.describe()}', flush=True)
      status = federation.run(app)
      with open(federation.log_path('run'), encoding='utf-8', errors='replace') as f:
        sys.stdout.write(f.read())
  except KeyboardInterrupt:
    print('flower_local: interrupted; every process stopped.', flush=True)
    return 130
  print(f'flower_local: flwr run exited with status {status}; every process '
        'stopped.', flush=True)
  return status


def _interrupt(signum, frame):
  raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == '__main__':
  sys.exit(main())
