"""Multinomial logistic regression: ``logits = W x + b``."""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjx.models import losses


class LogisticRegression(nn.Module):
  """Softmax regression on flattened inputs.

  Attributes:
    num_classes: number of output classes ``K``; ``W`` is ``[D, K]``.
  """

  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    del train  # No dropout.
    return nn.Dense(self.num_classes, name='linear')(losses.as_features(x))


def logistic_regression(num_classes: int = 10) -> losses.Model:
  """A :class:`~fedjx.models.losses.Model` for softmax regression."""
  return losses.Model('logistic_regression', LogisticRegression(num_classes))
