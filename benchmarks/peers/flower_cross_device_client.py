"""The PyTorch ``NumPyClient`` that ``flower_cross_device.py`` runs in Ray's
workers (a module of its own: Ray imports a ``client_fn`` by module name,
see ``flower_client.py``). The model and its weight layout are
``torch_cross_device.py``'s, so the local epoch is the PyTorch loop's."""

import functools

from flwr.client import NumPyClient
import numpy as np
import torch

import cross_device as cd
import torch_cross_device


@functools.lru_cache(maxsize=None)
def _data(setup):
  return [{k: torch.from_numpy(v) for k, v in d.items()}
          for d in cd.client_data(setup)]  # Seeded: the same in every worker.


def model(setup):
  """The setup's PyTorch model at :func:`cross_device.init`'s weights."""
  layers = cd.init(setup)
  net = (torch_cross_device.TwoNN(layers) if cd.kind(setup) == '2nn'
         else torch_cross_device.LogReg(layers, setup == 'logreg-sparse'))
  torch_cross_device.load_init(net, layers, setup)
  return net


class Client(NumPyClient):
  """One client: one epoch of SGD (``cd.LOCAL_LR``, batch ``cd.BATCH``)
  from the server's weights, in the PyTorch loop's order for the round."""

  def __init__(self, setup, uid, shuffle):
    torch.set_num_threads(1)
    self.data, self.uid, self.shuffle = _data(setup)[uid], uid, shuffle
    self.model = model(setup)

  def fit(self, parameters, config):
    state = self.model.state_dict()
    self.model.load_state_dict({k: torch.from_numpy(np.asarray(v))
                                for k, v in zip(state, parameters)})
    opt = torch.optim.SGD(self.model.parameters(), lr=cd.LOCAL_LR)
    n = len(self.data['y'])
    order = torch.from_numpy(cd.order(int(config.get('round', 1)) - 1, self.uid, n,
                                      shuffle=self.shuffle))
    for s in range(0, n, cd.BATCH):
      idx = order[s:s + cd.BATCH]
      opt.zero_grad()
      self.model({k: v[idx] for k, v in self.data.items()}).backward()
      opt.step()
    return [v.detach().numpy() for v in self.model.state_dict().values()], n, {}


def client_fn(setup, shuffle, context):
  """The ``ClientApp``'s ``client_fn`` (bind ``setup`` and ``shuffle``)."""
  return Client(setup, int(context.node_config['partition-id']), shuffle).to_client()
