"""LSTM language models (the Shakespeare and Stack Overflow models of
Reddi et al. 2021).

``tokens -> embed(e) -> LSTM(h) x L -> [dense(p)] -> dense(V)``. Shakespeare
(character level): ``e=8``, two LSTMs of 256 units. Stack Overflow next word
prediction: ``e=96``, one LSTM of 670 units, a projection to 96, and a 10,004
token output (10,000 words plus pad, out-of-vocabulary, begin and end).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjx.models import losses


class LSTMLanguageModel(nn.Module):
  """Next-token logits ``[B, T, V]`` from stacked LSTMs.

  Attributes:
    vocab_size: tokens ``V``.
    embed_size: embedding width ``e``.
    hidden: units of each LSTM layer.
    projection: width of a dense layer before the output (None: none).
  """

  vocab_size: int
  embed_size: int = 8
  hidden: Sequence[int] = (256, 256)
  projection: int | None = None

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
    del train
    x = nn.Embed(self.vocab_size, self.embed_size, name='embed')(
        tokens.astype(jnp.int32))
    for i, units in enumerate(self.hidden):
      x = nn.RNN(nn.OptimizedLSTMCell(units), name=f'lstm{i}')(x)
    if self.projection:
      x = nn.Dense(self.projection, name='projection')(x)
    return nn.Dense(self.vocab_size, name='logits')(x)


def lstm_lm(vocab_size: int, embed_size: int = 8,
            hidden: Sequence[int] = (256, 256), projection: int | None = None,
            pad_id: int = 0) -> losses.Model:
  """A language-modelling :class:`~fedjx.models.losses.Model` (:class:`LSTMLanguageModel`)."""
  module = LSTMLanguageModel(vocab_size, embed_size, tuple(hidden), projection)
  return losses.Model('lstm_lm', module, task='language_modeling', pad_id=pad_id)
