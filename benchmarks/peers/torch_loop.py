"""A plain PyTorch FedAvg round: for each user, load the global weights, run
one epoch of SGD (0.1, batch 10) over its shuffled images, add its
example-weighted model; the new global model is the weighted mean (server
SGD with learning rate 1.0).

  python torch_loop.py --setup=equal --rounds=3
"""

import common  # first: starts the clock

import numpy as np
import torch
from torch import nn

import torch_cnn


def main():
  args = common.parse_args(__doc__.split('\n')[0])
  torch.manual_seed(0)
  data = [(torch_cnn.to_nchw(x), torch.from_numpy(y)) for x, y in
          common.client_data(args.setup)]
  model = torch_cnn.simple_cnn()
  assert sum(p.numel() for p in model.parameters()) == common.NUM_PARAMS
  global_state = {k: v.clone() for k, v in model.state_dict().items()}
  loss_fn = nn.CrossEntropyLoss()
  clock = common.Clock()
  for r in range(args.rounds):
    total = sum(len(y) for _, y in data)
    acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
    for i, (x, y) in enumerate(data):
      model.load_state_dict(global_state)
      opt = torch.optim.SGD(model.parameters(), lr=common.LOCAL_LR)
      order = torch.from_numpy(np.random.default_rng((r, i)).permutation(len(y)))
      for s in range(0, len(y), common.BATCH):
        idx = order[s:s + common.BATCH]
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
      with torch.no_grad():
        for k, v in model.state_dict().items():
          acc[k] += v * (len(y) / total)
    # Server SGD 1.0 on the pseudo-gradient global - mean is the mean itself.
    global_state = acc
    clock.tick()
  common.report('torch_loop', torch.__version__, args.setup, clock,
                torch_cnn.threads())


if __name__ == '__main__':
  main()
