"""The EMNIST CNN of Reddi et al. 2021 ("Adaptive Federated Optimization").

``conv3x3(32) -> relu -> conv3x3(64) -> relu -> maxpool2x2 -> dropout(0.25) ->
flatten -> dense(128) -> relu -> dropout(0.5) -> dense(62)``, with valid
padding. On 28x28x1 inputs it has 1,206,590 parameters
(320 + 18,496 + 1,179,776 + 7,998).

The convolutions run as patch matrix products by default
(:func:`fedjx.models.conv.patch_conv`), which is what makes a vmapped cohort
of per-client CNNs fast; ``conv='xla'`` uses XLA's convolution instead.
The pooling is a reshape and a max (:func:`fedjx.models.pool.max_pool`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjx.models import conv as conv_lib
from fedjx.models import losses
from fedjx.models import pool


def as_images(x: jax.Array) -> jax.Array:
  """``[B, H, W]`` or ``[B, H, W, C]`` inputs as float ``[B, H, W, C]``."""
  x = x.astype(jnp.float32)
  return x[..., None] if x.ndim == 3 else x


class EmnistCNN(nn.Module):
  """The two-convolution CNN used for EMNIST character recognition.

  Attributes:
    num_classes: outputs (62 for EMNIST: digits, upper and lower case).
    dropout: whether the two dropout layers are present (rates 0.25, 0.5).
    conv: ``'patches'`` (convolution as a matrix product of patches) or
      ``'xla'`` (``lax.conv_general_dilated``); the numbers are the same.
  """

  num_classes: int = 62
  dropout: bool = True
  conv: str = 'patches'

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    conv = conv_lib.conv_function(self.conv, 'EmnistCNN')
    x = as_images(x)
    x = nn.relu(nn.Conv(32, (3, 3), padding='VALID', conv_general_dilated=conv,
                        name='conv1')(x))
    x = nn.relu(nn.Conv(64, (3, 3), padding='VALID', conv_general_dilated=conv,
                        name='conv2')(x))
    x = pool.max_pool(x, (2, 2), strides=(2, 2))
    if self.dropout:
      x = nn.Dropout(0.25, deterministic=not train)(x)
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(128, name='dense1')(x))
    if self.dropout:
      x = nn.Dropout(0.5, deterministic=not train)(x)
    return nn.Dense(self.num_classes, name='logits')(x)


def emnist_cnn(num_classes: int = 62, dropout: bool = True,
               conv: str = 'patches') -> losses.Model:
  """A :class:`~fedjx.models.losses.Model` wrapping :class:`EmnistCNN`."""
  conv_lib.conv_function(conv, 'emnist_cnn')  # Fails early on a bad name.
  return losses.Model('emnist_cnn', EmnistCNN(num_classes, dropout, conv),
                      dropout=dropout)
