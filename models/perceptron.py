"""Multi-layer perceptron classifier."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from fedjx.models import losses


class MLP(nn.Module):
  """``Dense(h_1) -> relu -> ... -> Dense(h_L) -> relu -> Dense(K)``.

  Attributes:
    num_classes: number of output classes ``K``.
    hidden: widths of the hidden layers.
    dropout_rate: dropout after each hidden activation (training only).
  """

  num_classes: int
  hidden: Sequence[int] = (200, 200)
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    h = losses.as_features(x)
    for i, width in enumerate(self.hidden):
      h = nn.relu(nn.Dense(width, name=f'hidden_{i}')(h))
      if self.dropout_rate > 0:
        h = nn.Dropout(self.dropout_rate, deterministic=not train)(h)
    return nn.Dense(self.num_classes, name='logits')(h)


def mlp(num_classes: int = 10, hidden: Sequence[int] = (200, 200),
        dropout_rate: float = 0.0) -> losses.Model:
  """A :class:`~fedjx.models.losses.Model` wrapping :class:`MLP`."""
  return losses.Model('mlp', MLP(num_classes, tuple(hidden), dropout_rate),
                      dropout=dropout_rate > 0)
