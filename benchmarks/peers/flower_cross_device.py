"""Flower's simulation engine (``flwr.simulation.run_simulation``, Ray
backend) on the cross-device setups: one virtual supernode per client, all
sampled each round, ``flwr.server.strategy.FedAvg`` (the example-weighted
mean: server SGD 1.0), each client the PyTorch loop's local epoch
(``flower_cross_device_client.py``, one intra-op thread). CPU seconds are
those of the whole process tree (Ray's workers included).

  python flower_cross_device.py --setup=2nn-100 --rounds=3
"""

import common  # first: starts the clock

import functools
import os
from importlib import metadata

import numpy as np
import torch

from flwr.client import ClientApp
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation

import cross_device as cd
import flower_cross_device_client as fcc
import torch_cross_device


class _TimedFedAvg(FedAvg):
  """FedAvg that ticks the clock after each round and keeps the weights."""

  def __init__(self, clock, **kwargs):
    super().__init__(**kwargs)
    self.clock, self.weights = clock, None

  def aggregate_fit(self, server_round, results, failures):
    out = super().aggregate_fit(server_round, results, failures)
    if failures:
      raise RuntimeError(f'flower round {server_round}: {len(failures)} '
                         f'clients failed: {failures[0]!r}')
    self.weights = parameters_to_ndarrays(out[0])
    self.clock.tick()
    return out


def main():
  args = cd.parse_args(__doc__.split('\n')[0])
  # Ray's workers import this folder's modules by name.
  here = os.path.dirname(os.path.abspath(__file__))
  os.environ['PYTHONPATH'] = os.pathsep.join(
      p for p in (here, os.environ.get('PYTHONPATH')) if p)
  clients = len(cd.sizes(args.setup))
  net = fcc.model(args.setup)
  assert sum(p.numel() for p in net.parameters()) == cd.num_params(args.setup)
  init = [v.detach().numpy() for v in net.state_dict().values()]
  rounds = 1 if args.check else args.rounds
  clock = common.Clock()
  strategy = _TimedFedAvg(
      clock, fraction_fit=1.0, fraction_evaluate=0.0,
      min_fit_clients=clients, min_available_clients=clients,
      initial_parameters=ndarrays_to_parameters(init),
      on_fit_config_fn=lambda r: {'round': r})
  server = ServerApp(server_fn=lambda context: ServerAppComponents(
      strategy=strategy, config=ServerConfig(num_rounds=rounds)))
  client = ClientApp(client_fn=functools.partial(
      fcc.client_fn, args.setup, not args.check))
  run_simulation(server_app=server, client_app=client, num_supernodes=clients,
                 backend_config={'client_resources': {'num_cpus': 1, 'num_gpus': 0.0},
                                 'init_args': {'num_cpus': os.cpu_count()}})
  if len(clock.marks) < rounds + 1:
    raise RuntimeError(f'flower: {len(clock.marks) - 1} of {rounds} rounds finished')
  if args.check:
    net.load_state_dict({k: torch.from_numpy(np.asarray(v))
                         for k, v in zip(net.state_dict(), strategy.weights)})
    cd.save(args.check, torch_cross_device.export(net, args.setup))
  cd.report('flower', f"flwr {metadata.version('flwr')} (ray {metadata.version('ray')}, "
            f'torch {torch.__version__})', args.setup, clock,
            {'torch_num_threads_per_client': 1, 'ray_num_cpus': os.cpu_count(),
             'client_num_cpus': 1})


if __name__ == '__main__':
  main()
