"""A small ResNet for CIFAR-sized images, with group normalisation.

Residual networks (He et al. 2016) with GroupNorm in place of BatchNorm, as
federated work does (Hsieh et al. 2020; Reddi et al. 2021 use ResNet-18 with
group norm on CIFAR), because batch statistics are neither functional
parameters nor meaningful across non-IID clients. The default is a ResNet-8
style network: a 3x3 stem and three stages of one basic block each
(16, 32, 64 channels); ``stage_sizes=(2, 2, 2, 2), widths=(64, 128, 256,
512)`` gives ResNet-18.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjx.models import cnn
from fedjx.models import conv as conv_lib
from fedjx.models import losses


def _groups(channels: int, groups: int) -> int:
  g = min(groups, channels)
  while channels % g:
    g -= 1
  return g


class BasicBlock(nn.Module):
  """``x + conv-gn-relu-conv-gn(x)`` (projected when the shape changes)."""

  channels: int
  stride: int = 1
  groups: int = 2
  conv: str = 'patches'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    g = _groups(self.channels, self.groups)
    conv = conv_lib.conv_function(self.conv, 'BasicBlock')
    y = nn.Conv(self.channels, (3, 3), (self.stride, self.stride),
                padding='SAME', use_bias=False, conv_general_dilated=conv,
                name='conv1')(x)
    y = nn.relu(nn.GroupNorm(num_groups=g, name='norm1')(y))
    y = nn.Conv(self.channels, (3, 3), padding='SAME', use_bias=False,
                conv_general_dilated=conv, name='conv2')(y)
    y = nn.GroupNorm(num_groups=g, name='norm2')(y)
    if x.shape[-1] != self.channels or self.stride != 1:
      x = nn.Conv(self.channels, (1, 1), (self.stride, self.stride),
                  use_bias=False, conv_general_dilated=conv, name='proj')(x)
      x = nn.GroupNorm(num_groups=g, name='proj_norm')(x)
    return nn.relu(x + y)


class ResNet(nn.Module):
  """Stem, stages of basic blocks (stride 2 at each new stage), pool, dense.

  Attributes:
    num_classes: outputs.
    stage_sizes: basic blocks per stage.
    widths: channels per stage (the stem has ``widths[0]``).
    groups: GroupNorm groups (reduced to a divisor of the channels).
    conv: ``'patches'`` or ``'xla'``, as for :class:`~fedjx.models.EmnistCNN`.
  """

  num_classes: int = 100
  stage_sizes: Sequence[int] = (1, 1, 1)
  widths: Sequence[int] = (16, 32, 64)
  groups: int = 2
  conv: str = 'patches'

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    del train  # No dropout; GroupNorm has no batch statistics.
    if len(self.stage_sizes) != len(self.widths):
      raise ValueError(
          f'ResNet: stage_sizes={tuple(self.stage_sizes)} and '
          f'widths={tuple(self.widths)} must have the same length.')
    x = cnn.as_images(x)
    x = nn.Conv(self.widths[0], (3, 3), padding='SAME', use_bias=False,
                conv_general_dilated=conv_lib.conv_function(self.conv, 'ResNet'),
                name='stem')(x)
    x = nn.relu(nn.GroupNorm(num_groups=_groups(self.widths[0], self.groups),
                             name='stem_norm')(x))
    for s, (blocks, width) in enumerate(zip(self.stage_sizes, self.widths)):
      for b in range(blocks):
        stride = 2 if (s > 0 and b == 0) else 1
        x = BasicBlock(width, stride, self.groups, self.conv,
                       name=f'stage{s}_block{b}')(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name='logits')(x)


def resnet(num_classes: int = 100, stage_sizes: Sequence[int] = (1, 1, 1),
           widths: Sequence[int] = (16, 32, 64), groups: int = 2,
           conv: str = 'patches') -> losses.Model:
  """A :class:`~fedjx.models.losses.Model` wrapping :class:`ResNet`."""
  conv_lib.conv_function(conv, 'resnet')  # Fails early on a bad name.
  return losses.Model('resnet', ResNet(num_classes, tuple(stage_sizes),
                                       tuple(widths), groups, conv))
