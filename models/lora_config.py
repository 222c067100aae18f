"""The configuration of LoRA adapters: which projections, what rank, how they start.

A :class:`LoraConfig` is the config's ``lora`` section (docs/fine_tuning.md)
and what :func:`fedjx.models.lora.lora_model` builds adapters by. With ``r``
the rank and ``alpha`` the scale numerator, an adapted weight is ``W + s a
b`` with ``s = alpha / r`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", arXiv 2106.09685, section 4.1).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
A_INITS = ('kaiming', 'he_uniform', 'gaussian')
BASE_DTYPES = ('float32', 'bfloat16', 'int8')


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Where the adapters go and how they start (see the module docstring)."""

  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = ('q_proj', 'v_proj')
  a_init: str = 'kaiming'
  train_a: bool = True
  base_dtype: str = 'float32'

  def __post_init__(self):
    object.__setattr__(self, 'targets', tuple(self.targets))
    if not isinstance(self.rank, (int, np.integer)) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(f'LoraConfig: rank={self.rank!r} must be an integer >= 1.')
    if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
      raise ValueError(f'LoraConfig: alpha={self.alpha!r} must be a finite number > 0.')
    if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
      raise ValueError(f'LoraConfig: dropout={self.dropout!r} must lie in [0, 1).')
    unknown = [t for t in self.targets if t not in TARGETS]
    if not self.targets or unknown:
      raise ValueError(f'LoraConfig: targets={self.targets!r} must be a non-empty subset of '
                       f'{", ".join(TARGETS)}.')
    if self.a_init not in A_INITS:
      raise ValueError(f'LoraConfig: a_init={self.a_init!r} is not one of {", ".join(A_INITS)}.')
    if self.train_a not in (True, False):
      raise ValueError(f'LoraConfig: train_a={self.train_a!r} must be True or False.')
    if self.base_dtype not in BASE_DTYPES:
      raise ValueError(f'LoraConfig: base_dtype={self.base_dtype!r} is not one of '
                       f'{", ".join(BASE_DTYPES)}.')

  @property
  def scale(self) -> float:
    """``s = alpha / r``."""
    return self.alpha / self.rank

  @property
  def module_path(self) -> str:
    """The regular expression of the adapted modules' paths."""
    return '.*/(' + '|'.join(self.targets) + ')$'


