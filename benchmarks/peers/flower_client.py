"""The PyTorch ``NumPyClient`` that ``flower_round.py`` runs in Ray's workers.

It lives in a module of its own because Ray ships the ``ClientApp``'s
``client_fn`` to its workers by pickling: a function of the script's
``__main__`` is looked up there by name, and a worker's ``__main__`` is
Ray's, not the script (``AttributeError: Can't get attribute ... on <module
'__main__'>``). A module on the workers' ``PYTHONPATH`` is imported there.
"""

import functools

from flwr.client import NumPyClient
import numpy as np
import torch
from torch import nn

import common
import torch_cnn


@functools.lru_cache(maxsize=None)
def _data(setup):
  return common.client_data(setup)  # Seeded: the same in every worker.


class Client(NumPyClient):
  """One user: one epoch of SGD (``common.LOCAL_LR``, batch ``common.BATCH``)
  from the server's parameters, in a per-round, per-user shuffled order."""

  def __init__(self, setup, uid):
    torch.set_num_threads(1)
    x, y = _data(setup)[uid]
    self.x, self.y, self.uid = torch_cnn.to_nchw(x), torch.from_numpy(y), uid
    self.model = torch_cnn.simple_cnn()

  def fit(self, parameters, config):
    state = self.model.state_dict()
    self.model.load_state_dict({k: torch.from_numpy(np.asarray(v))
                                for k, v in zip(state, parameters)})
    opt = torch.optim.SGD(self.model.parameters(), lr=common.LOCAL_LR)
    order = torch.from_numpy(np.random.default_rng(
        (config.get('round', 0), self.uid)).permutation(len(self.y)))
    for s in range(0, len(self.y), common.BATCH):
      idx = order[s:s + common.BATCH]
      opt.zero_grad()
      nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx]).backward()
      opt.step()
    return ([v.detach().numpy() for v in self.model.state_dict().values()],
            len(self.y), {})


def client_fn(setup, context):
  """The ``ClientApp``'s ``client_fn`` (bind ``setup`` with ``functools.partial``)."""
  return Client(setup, int(context.node_config['partition-id'])).to_client()
