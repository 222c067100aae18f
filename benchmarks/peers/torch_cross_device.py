"""A plain PyTorch FedAvg loop on the cross-device setups: for each client,
load the global weights, one epoch of SGD (0.1, batch 10) over its shuffled
examples, add its example-weighted model; the new global model is the
weighted mean. ``--threads=1`` (one intra-op thread) or ``0`` (PyTorch's
default). ``logreg-sparse`` uses ``nn.EmbeddingBag(mode='sum')`` on the
token ids (the same logits as the dense model); with ``--sparse_grad``
(``sparse=True``) its gradient is sparse and SGD updates only the gathered
rows.

  python torch_cross_device.py --setup=2nn-1000 --threads=1 --rounds=3
"""

import common  # first: starts the clock

import numpy as np
import torch
from torch import nn

import cross_device as cd


class TwoNN(nn.Module):

  def __init__(self, layers):
    super().__init__()
    self.linears = nn.ModuleList(nn.Linear(w.shape[0], w.shape[1]) for w, _ in layers)

  def forward(self, batch):
    h = batch['x']
    for i, layer in enumerate(self.linears):
      h = layer(h)
      if i < len(self.linears) - 1:
        h = torch.relu(h)
    return nn.functional.cross_entropy(h, batch['y'])


class LogReg(nn.Module):

  def __init__(self, layers, sparse, sparse_grad=False):
    super().__init__()
    (w, _), = layers
    self.sparse = sparse
    if sparse:
      self.embed = nn.EmbeddingBag(w.shape[0], w.shape[1], mode='sum',
                                   sparse=sparse_grad)
      self.bias = nn.Parameter(torch.zeros(w.shape[1]))
    else:
      self.linear = nn.Linear(w.shape[0], w.shape[1])

  def forward(self, batch):
    logits = (self.embed(batch['tokens']) + self.bias if self.sparse
              else self.linear(batch['x']))
    return nn.functional.binary_cross_entropy_with_logits(
        logits, batch['y'], reduction='sum') / len(batch['y'])


def load_init(model, layers, setup):
  with torch.no_grad():
    if cd.kind(setup) == '2nn':
      for lin, (w, b) in zip(model.linears, layers):
        lin.weight.copy_(torch.from_numpy(w.T.copy()))
        lin.bias.copy_(torch.from_numpy(b))
    elif model.sparse:
      (w, b), = layers
      model.embed.weight.copy_(torch.from_numpy(w))
      model.bias.copy_(torch.from_numpy(b))
    else:
      (w, b), = layers
      model.linear.weight.copy_(torch.from_numpy(w.T.copy()))
      model.linear.bias.copy_(torch.from_numpy(b))


def export(model, setup):
  if cd.kind(setup) == '2nn':
    return [(l.weight.detach().numpy().T, l.bias.detach().numpy()) for l in model.linears]
  if model.sparse:
    return [(model.embed.weight.detach().numpy(), model.bias.detach().numpy())]
  return [(model.linear.weight.detach().numpy().T, model.linear.bias.detach().numpy())]


def main():
  def flags(p):
    p.add_argument('--threads', type=int, default=1, help='intra-op threads (0: default)')
    p.add_argument('--sparse_grad', action='store_true',
                   help="logreg-sparse: nn.EmbeddingBag(sparse=True)")
  args = cd.parse_args(__doc__.split('\n')[0], flags)
  if args.threads:
    torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  data = [{k: torch.from_numpy(v) for k, v in d.items()}
          for d in cd.client_data(args.setup)]
  layers = cd.init(args.setup)
  model = (TwoNN(layers) if cd.kind(args.setup) == '2nn'
           else LogReg(layers, args.setup == 'logreg-sparse', args.sparse_grad))
  load_init(model, layers, args.setup)
  assert sum(p.numel() for p in model.parameters()) == cd.num_params(args.setup)
  global_state = {k: v.clone() for k, v in model.state_dict().items()}
  total = sum(len(d['y']) for d in data)
  rounds = 1 if args.check else args.rounds
  clock = common.Clock()
  for r in range(rounds):
    acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
    for i, d in enumerate(data):
      model.load_state_dict(global_state)
      opt = torch.optim.SGD(model.parameters(), lr=cd.LOCAL_LR)
      n = len(d['y'])
      order = torch.from_numpy(cd.order(r, i, n, shuffle=not args.check))
      for s in range(0, n, cd.BATCH):
        idx = order[s:s + cd.BATCH]
        opt.zero_grad()
        model({k: v[idx] for k, v in d.items()}).backward()
        opt.step()
      with torch.no_grad():
        for k, v in model.state_dict().items():
          acc[k] += v * (n / total)
    global_state = acc
    clock.tick()
  if args.check:
    model.load_state_dict(global_state)
    cd.save(args.check, export(model, args.setup))
  name = ('torch_loop' + ('' if args.threads == 1 else '_default_threads') +
          ('_sparse_grad' if args.sparse_grad else ''))
  cd.report(name, torch.__version__, args.setup, clock,
            {'torch_num_threads': torch.get_num_threads(),
             'torch_num_interop_threads': torch.get_num_interop_threads()})


if __name__ == '__main__':
  main()
