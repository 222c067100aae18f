"""Flower's simulation engine (``flwr.simulation.run_simulation``, Ray
backend) running FedAvg (``flwr.server.strategy.FedAvg``, example-weighted
mean: server SGD 1.0) with a PyTorch ``NumPyClient`` per user: 50 virtual
supernodes, all sampled each round, one epoch of SGD 0.1 of batch 10, no
evaluation. CPU seconds are those of the whole process tree (Ray's workers
included).

  python flower_round.py --setup=equal --rounds=3
"""

import common  # first: starts the clock

import functools
import os
from importlib import metadata

import torch

from flwr.client import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation

import flower_client
import torch_cnn

_ARGS = common.parse_args(__doc__.split('\n')[0])


class _TimedFedAvg(FedAvg):

  def __init__(self, clock, **kwargs):
    super().__init__(**kwargs)
    self.clock = clock

  def aggregate_fit(self, server_round, results, failures):
    out = super().aggregate_fit(server_round, results, failures)
    if failures:
      raise RuntimeError(f'flower round {server_round}: {len(failures)} clients failed: {failures[0]!r}')
    self.clock.tick()
    return out


def main():
  # Ray's workers import this folder's modules (common, torch_cnn).
  here = os.path.dirname(os.path.abspath(__file__))
  os.environ['PYTHONPATH'] = os.pathsep.join(
      p for p in (here, os.environ.get('PYTHONPATH')) if p)
  torch.manual_seed(0)
  init = [v.detach().numpy() for v in torch_cnn.simple_cnn().state_dict().values()]
  assert sum(v.size for v in init) == common.NUM_PARAMS
  clock = common.Clock()
  strategy = _TimedFedAvg(
      clock, fraction_fit=1.0, fraction_evaluate=0.0,
      min_fit_clients=common.COHORT, min_available_clients=common.COHORT,
      initial_parameters=ndarrays_to_parameters(init),
      on_fit_config_fn=lambda r: {'round': r})
  server = ServerApp(server_fn=lambda context: ServerAppComponents(
      strategy=strategy, config=ServerConfig(num_rounds=_ARGS.rounds)))
  # A module's function, which Ray's workers import by name (flower_client).
  client = ClientApp(client_fn=functools.partial(flower_client.client_fn,
                                                 _ARGS.setup))
  run_simulation(server_app=server, client_app=client,
                 num_supernodes=common.COHORT,
                 backend_config={'client_resources': {'num_cpus': 1, 'num_gpus': 0.0},
                                 'init_args': {'num_cpus': os.cpu_count()}})
  if len(clock.marks) < 2:
    raise RuntimeError('flower: no round finished')
  common.report('flower', f"flwr {metadata.version('flwr')} (ray "
                f"{metadata.version('ray')}, torch {torch.__version__})",
                _ARGS.setup, clock,
                dict(torch_cnn.threads(), torch_num_threads_per_client=1,
                     ray_num_cpus=os.cpu_count(), client_num_cpus=1))


if __name__ == '__main__':
  main()
