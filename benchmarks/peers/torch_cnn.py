"""pfl-research's ``simple_cnn`` for 32x32x3 inputs in PyTorch (no dropout),
with Glorot-uniform weights as pfl-research initialises them."""

import torch
from torch import nn


def simple_cnn() -> nn.Module:
  model = nn.Sequential(
      nn.Conv2d(3, 32, kernel_size=3), nn.ReLU(),
      nn.Conv2d(32, 64, kernel_size=3), nn.ReLU(),
      nn.MaxPool2d(2), nn.Flatten(),
      nn.Linear(14 * 14 * 64, 128), nn.ReLU(),
      nn.Linear(128, 10))
  for m in model.modules():
    if isinstance(m, (nn.Conv2d, nn.Linear)):
      nn.init.xavier_uniform_(m.weight)
  return model


def to_nchw(x):
  """NHWC float32 NumPy images -> an NCHW tensor."""
  return torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()


def threads() -> dict:
  return {'torch_num_threads': torch.get_num_threads(),
          'torch_num_interop_threads': torch.get_num_interop_threads()}
