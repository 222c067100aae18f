"""Yogi and the adaptive server optimizers of Adaptive Federated Optimization.

Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2. With
``g_t`` the pseudo-gradient (server parameters minus the mean of client
parameters, i.e. ``-Delta_t`` in the paper), every rule keeps

    m_t = b1 m_{t-1} + (1 - b1) g_t
    x_{t+1} = x_t - lr m_t / (sqrt(v_t) + eps)

and differs only in the second moment ``v_t``:

    Adagrad  v_t = v_{t-1} + g_t^2
    Adam     v_t = b2 v_{t-1} + (1 - b2) g_t^2
    Yogi     v_t = v_{t-1} - (1 - b2) g_t^2 sign(v_{t-1} - g_t^2)
             (Zaheer et al., "Adaptive Methods for Nonconvex Optimization",
             NeurIPS 2018)

with ``m_{-1} = 0`` and ``v_{-1} = eps^2`` by default (the paper asks for
``v_{-1} >= eps^2``) and, as in the paper, no bias correction. ``eps`` is the
paper's adaptivity ``tau``, 1e-3 by default as it recommends.

Other frameworks' conventions are options: ``initial_accumulator_value``
sets ``v_{-1}`` (0 in Flower's FedAdam/FedYogi/FedAdagrad and TFF's Adam; 1e-6
in TFF's Yogi), ``bias_correction=True`` multiplies the step by
``sqrt(1 - b2^t) / (1 - b1^t)`` at step ``t = 1, 2, ...`` with ``eps``
outside the correction, as Flower and TFF do (Kingma & Ba 2015, Section 2's
"efficient" form; for Adagrad, ``b2 = 0`` and only ``1 / (1 - b1^t)``
remains), and ``eps = 0`` is allowed (then ``v`` must stay positive: give
``initial_accumulator_value > 0`` or expect NaN where ``g`` is exactly 0).

Each is an ``optax.GradientTransformation`` usable anywhere optax is, and
with ``optax.inject_hyperparams``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

_RULES = ('adagrad', 'adam', 'yogi')


class ScaleByAdaptiveState(NamedTuple):
  """First moment ``m`` and second moment ``v`` (pytrees like the params)."""

  m: optax.Updates
  v: optax.Updates


def scale_by_adaptive(rule: str, b1: float = 0.9, b2: float = 0.99,
                      eps: float = 1e-3,
                      initial_accumulator_value: float | None = None
                      ) -> optax.GradientTransformation:
  """Rescales updates to ``m_t / (sqrt(v_t) + eps)`` with ``rule``'s ``v_t``.

  Args:
    rule: ``'adagrad'``, ``'adam'`` or ``'yogi'`` (see the module docstring).
    b1: first-moment decay ``beta_1``.
    b2: second-moment decay ``beta_2`` (unused by ``'adagrad'``).
    eps: adaptivity ``tau``.
    initial_accumulator_value: ``v_{-1}``; ``eps**2`` when None.
  """
  if rule not in _RULES:
    raise ValueError(f'scale_by_adaptive: rule={rule!r} is not one of {_RULES}.')

  def init(params):
    v0 = (eps ** 2 if initial_accumulator_value is None
          else initial_accumulator_value)
    return ScaleByAdaptiveState(
        m=jax.tree.map(jnp.zeros_like, params),
        v=jax.tree.map(lambda p: jnp.full_like(p, v0), params))

  def second_moment(v, g):
    g2 = g * g
    if rule == 'adagrad':
      return v + g2
    if rule == 'adam':
      return b2 * v + (1 - b2) * g2
    return v - (1 - b2) * g2 * jnp.sign(v - g2)

  def update(updates, state, params=None):
    del params
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.m, updates)
    v = jax.tree.map(second_moment, state.v, updates)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), m, v)
    return out, ScaleByAdaptiveState(m=m, v=v)

  return optax.GradientTransformation(init, update)


def scale_by_yogi(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3,
                  initial_accumulator_value: float | None = None
                  ) -> optax.GradientTransformation:
  """Yogi's rescaling (Zaheer et al. 2018; Reddi et al. 2021, Algorithm 2)."""
  return scale_by_adaptive('yogi', b1, b2, eps, initial_accumulator_value)


class BiasCorrectionState(NamedTuple):
  """The number of steps taken, ``t``."""

  count: jax.Array


def scale_by_bias_correction(b1: float, b2: float) -> optax.GradientTransformation:
  """Multiplies updates by ``sqrt(1 - b2^t) / (1 - b1^t)`` at step ``t >= 1``."""
  def init(params):
    del params
    return BiasCorrectionState(count=jnp.zeros((), jnp.int32))

  def update(updates, state, params=None):
    del params
    t = state.count + 1
    factor = jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return (jax.tree.map(lambda u: u * factor.astype(u.dtype), updates),
            BiasCorrectionState(count=t))

  return optax.GradientTransformation(init, update)


def _with_lr(scale: optax.GradientTransformation,
             learning_rate: optax.ScalarOrSchedule, bias_correction: bool,
             b1: float, b2: float) -> optax.GradientTransformation:
  parts = [scale]
  if bias_correction:
    parts.append(scale_by_bias_correction(b1, b2))
  return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


def yogi(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9,
         b2: float = 0.99, eps: float = 1e-3,
         initial_accumulator_value: float | None = None,
         bias_correction: bool = False) -> optax.GradientTransformation:
  """The Yogi optimizer: ``x <- x - lr m_t / (sqrt(v_t) + eps)``, Yogi ``v_t``.

  The server optimizer of FedYogi (Reddi et al. 2021). See the module
  docstring for ``initial_accumulator_value`` and ``bias_correction``.
  """
  return _with_lr(scale_by_yogi(b1, b2, eps, initial_accumulator_value),
                  learning_rate, bias_correction, b1, b2)


def adaptive_adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9,
                  b2: float = 0.99, eps: float = 1e-3,
                  initial_accumulator_value: float | None = None,
                  bias_correction: bool = False) -> optax.GradientTransformation:
  """Adam as in Reddi et al. 2021, Algorithm 2 (no bias correction): FedAdam.

  ``initial_accumulator_value=0, bias_correction=True`` is Flower's and
  TFF's Adam (with their ``eps``).
  """
  return _with_lr(scale_by_adaptive('adam', b1, b2, eps,
                                    initial_accumulator_value), learning_rate,
                  bias_correction, b1, b2)


def adaptive_adagrad(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9,
                     eps: float = 1e-3,
                     initial_accumulator_value: float | None = None,
                     bias_correction: bool = False) -> optax.GradientTransformation:
  """Adagrad with momentum as in Reddi et al. 2021, Algorithm 2: FedAdagrad."""
  return _with_lr(scale_by_adaptive('adagrad', b1, 0.0, eps,
                                    initial_accumulator_value), learning_rate,
                  bias_correction, b1, 0.0)
