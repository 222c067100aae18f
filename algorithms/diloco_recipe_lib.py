"""DiLoCo with the inner optimizer of the DiLoCo scaling-law study.

Charles et al. 2025, "Communication-Efficient Language Model Training Scales
Reliably and Robustly: Scaling Laws for DiLoCo" (arXiv 2503.09799) train
every replica with AdamW whose learning rate warms up linearly and then
decays along a cosine, on clipped gradients. :func:`diloco_recipe` is
:func:`fedjx.algorithms.diloco_lib.diloco` with that inner optimizer, built
from numbers (so a config can name it):

    g_t   = grad L(theta_k; x_t)                     (replica k, inner step t)
    g_t  <- g_t min(1, c / ||g_t||)                   (global-norm clipping, c)
    lr_t  = optax.warmup_cosine_decay_schedule(0, eta, W, T, f eta)(t)
    theta_k <- AdamW(b1, b2, lambda; lr_t)(theta_k, g_t)

``t`` is the replica's own inner step count, which persists across rounds
with its AdamW state (DiLoCo never resets it), so the schedule runs over the
whole training run, not over one round. The schedule rises linearly from 0
to ``eta`` over ``W`` steps, then follows a cosine from ``eta`` to
``f eta`` at step ``T`` and stays there.

Every round also reports ``inner_grad_norm``, the mean over the round's
inner steps and replicas of ``||g_t||`` before clipping: an optax stage in
front of the clipping sums the norms it sees into the inner state, and the
round reads the sums' change.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx import constant_hoisting
from fedjx.algorithms import kit
from fedjx.algorithms import base
from fedjx.algorithms import diloco_lib

INNER_GRAD_NORM = 'inner_grad_norm'


class GradNormSum(NamedTuple):
  """The running sum of the global norms of the gradients seen, and their count."""

  total: jax.Array
  count: jax.Array


def sum_grad_norms() -> optax.GradientTransformation:
  """An identity optax stage whose state sums ``||g||`` (global norm) and counts steps."""

  def init(params):
    del params
    return GradNormSum(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))

  def update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates).astype(jnp.float32)
    return updates, GradNormSum(state.total + norm, state.count + 1)

  return optax.GradientTransformation(init, update)


def inner_optimizer(peak_learning_rate: float, warmup_steps: int, total_steps: int,
                    final_lr_fraction: float = 0.05, b1: float = 0.9, b2: float = 0.99,
                    weight_decay: float = 0.1,
                    clip_norm: float | None = 1.0) -> optax.GradientTransformation:
  """``sum_grad_norms``, then global-norm clipping at ``clip_norm`` (None: none),
  then AdamW on the warmup-cosine schedule of the inner step (module docstring)."""
  fn = 'diloco_recipe'
  kit.check_number(fn, 'peak_learning_rate', peak_learning_rate)
  kit.check_number(fn, 'final_lr_fraction', final_lr_fraction, high=1.0)
  for name, value in (('warmup_steps', warmup_steps), ('total_steps', total_steps)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f'{fn}: {name}={value!r} must be an integer >= 0.')
  if total_steps <= warmup_steps:
    raise ValueError(f'{fn}: total_steps={total_steps} must exceed '
                     f'warmup_steps={warmup_steps}.')
  if clip_norm is not None:
    kit.check_number(fn, 'clip_norm', clip_norm)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak_learning_rate, warmup_steps=warmup_steps,
      decay_steps=total_steps, end_value=final_lr_fraction * peak_learning_rate)
  stages = [sum_grad_norms()]
  if clip_norm is not None:
    stages.append(optax.clip_by_global_norm(clip_norm))
  stages.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*stages)


def _sums(inner_opt_states: Any) -> GradNormSum:
  """The ``[K]`` norm sums of the replicas' chained inner states."""
  return inner_opt_states[0]


def round_inner_grad_norm(before: Any, after: Any, clients: bool = False) -> jax.Array:
  """Mean ``||g_t||`` over the inner steps taken between two inner states:
  the server's ``[K]`` rows, or with ``clients`` the cohort's rows (client
  values, summed with ``fedjx.reduce_sum``, so a streamed round adds them
  chunk by chunk)."""
  a, b = _sums(before), _sums(after)
  total = fedjx.reduce_sum if clients else jnp.sum
  steps = total(b.count - a.count)
  return total(b.total - a.total) / jnp.maximum(steps, 1).astype(jnp.float32)


def with_inner_grad_norm(algorithm: kit.Algorithm) -> kit.Algorithm:
  """``algorithm`` (DiLoCo with :func:`inner_optimizer`) whose rounds also
  report :data:`INNER_GRAD_NORM`; ``compile`` keeps the metric."""

  def wrap(inner: kit.Algorithm, donate: bool) -> kit.Algorithm:
    def apply(state, cohort, key):
      new, metrics, *rows = inner.apply(state, cohort, key)
      if rows:  # The replicas' states in a store: the cohort's rows.
        per_cohort = fedjx.program(clients=jnp.shape(cohort.num_examples)[0])(
            functools.partial(round_inner_grad_norm, clients=True))
        norm = per_cohort(cohort.client_states, rows[0])
      else:
        norm = round_inner_grad_norm(state.client_states, new.client_states)
      return (new, {**metrics, INNER_GRAD_NORM: norm}, *rows)

    def run(state, cohorts, keys):
      return base.scan_rounds(apply, state, cohorts, keys)

    donated = (0,) if donate else ()
    return inner._replace(
        round=constant_hoisting.jit(apply, donate_argnums=donated),
        run_rounds=constant_hoisting.jit(run, donate_argnums=donated), apply=apply,
        compiler=lambda m, d: wrap(inner.compiler(m, d), d))

  return wrap(algorithm, True)


TRAITS = kit.Traits(options=diloco_lib.OPTIONS, population='num_replicas',
                    client_state='client_state',
                    updates_reach_params=True, indexed_batches=True)
"""What the recipe declares: DiLoCo's options, replicas by id (their states
placed by ``config.client_state.placement``), every outer
gradient reaching the model in its round
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def diloco_recipe(loss_fn: kit.LossFn, num_replicas: int, *,
                  peak_learning_rate: float = 3e-3, warmup_steps: int = 100,
                  total_steps: int = 1000, final_lr_fraction: float = 0.05,
                  b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.1,
                  clip_norm: float = 1.0, outer_learning_rate: float = 0.7,
                  outer_momentum: float = 0.9, inner_steps: int | None = None,
                  client_state: str = 'dense', **options: Any) -> kit.Algorithm:
  """DiLoCo whose replicas run :func:`inner_optimizer`; outer Nesterov SGD.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_replicas: ``M``.
    peak_learning_rate, warmup_steps, total_steps, final_lr_fraction: the
      inner schedule ``eta``, ``W``, ``T``, ``f`` (module docstring).
    b1, b2, weight_decay: AdamW's.
    clip_norm: ``c``, the global norm the inner gradients are clipped to;
      0 turns clipping off.
    outer_learning_rate, outer_momentum: the outer Nesterov SGD's.
    inner_steps: ``H`` (None: the cohort's steps).
    client_state: where the replicas' inner states live, ``'dense'`` or
      ``'store'`` (:func:`fedjx.algorithms.diloco_lib.diloco`).
    **options: :func:`fedjx.algorithms.diloco_lib.diloco`'s ``metrics_fn``,
      ``weighting``, ``client_evaluation``, ``skip_nonfinite``.
  """
  inner = inner_optimizer(peak_learning_rate, warmup_steps, total_steps,
                          final_lr_fraction, b1, b2, weight_decay,
                          clip_norm if clip_norm else None)
  algorithm = diloco_lib.diloco(
      loss_fn, num_replicas, inner_optimizer=inner,
      outer_optimizer=diloco_lib.outer_nesterov(outer_learning_rate, outer_momentum),
      inner_steps=inner_steps, client_state=client_state, **options)
  return with_inner_grad_norm(algorithm)


__all__ = ['GradNormSum', 'INNER_GRAD_NORM', 'diloco_recipe', 'inner_optimizer',
           'round_inner_grad_norm', 'sum_grad_norms', 'with_inner_grad_norm']
