"""Online hypergradient descent on learning rates, wrapping any algorithm.

Hypergradient descent (Baydin et al. 2018, "Online Learning Rate Adaptation
with Hypergradient Descent", ICLR) adapts a learning rate during training by
descending the derivative of the loss after a step with respect to the
learning rate used in that step. Federated versions differentiate through a
whole round: FedOpt with hypergradient descent on the server learning rate
in Rush et al. 2023 ("Federated Automatic Differentiation", arXiv
2301.07806, Section 5) and FedHyper (Wang et al. 2024, "FedHyper: A
Universal and Robust Learning Rate Scheduler for Federated Learning with
Hypergradient Descent", ICLR), which tunes server and client learning rates
from hypergradients of the round.

Each round ``t`` of :func:`hypergradient_tuner` runs the wrapped algorithm's
round ``x_{t+1} = A(x_t, eta; D_t)`` with the tuned hyperparameters
``eta = exp(u)`` (log-parameterised, so they stay positive and a step is
relative), and evaluates the objective after the round,

    L_t(u) = (1 / |D_t|) sum_{e in D_t} loss(x_{t+1}(u), e)

(the round's own clients' loss at the new server model, computed as a
federated evaluation; or a held-out objective). Forward-mode AD (one tangent
per tuned value) through the round, the server step and every client's
local training gives ``g_t = dL_t / du``; then

    u <- clip(u + HyperOpt(g_t), log eta_min, log eta_max)

with ``HyperOpt`` an optax optimizer (default: Adam with the
``hyper_learning_rate``, whose normalised steps change ``eta`` by about a
factor ``exp(hyper_learning_rate)`` per round while the hypergradient keeps
its sign, so a learning rate that is 100x off recovers in tens of rounds).

With ``horizon_decay = gamma = 0`` the state ``x_t`` is held fixed (the
one-round truncation of Baydin et al. and FedHyper). With ``gamma > 0`` the
tangent ``Z_t = d x_t / du`` is carried across rounds,
``Z_{t+1} = (dA/dx) gamma Z_t + dA/du``, and ``g_t = grad L_t . Z_{t+1}``:
the derivative with respect to a learning rate held over the recent past
(real-time forward hypergradients, Franceschi et al. 2017, ICML), which
counters the greedy step's preference for too-small learning rates
(short-horizon bias, Wu et al. 2018, ICLR).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import fedjx
import fedjx.indexed
from fedjx import constant_hoisting
from fedjx.algorithms import base
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.fedavg_lib import fedavg as fedavg_builder
from fedjx.algorithms import hypergradients

Objective = Callable[[base.Params, base.Cohort], jax.Array]


def _inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class TunerState(NamedTuple):
  """State of a hypergradient-tuned algorithm.

  Attributes:
    inner: the wrapped algorithm's state; its ``hparams`` hold the current
      (tuned) values.
    hyper_opt_state: the hyper-optimizer's state (over the log learning
      rates, keyed by path).
    tangents: ``Z_t = d x_t / d u`` (with decay), one ``[k, ...]`` array per
      floating leaf of ``inner`` for the ``k`` tuned values; ``()`` when
      ``horizon_decay`` is 0.

  ``params`` and ``hparams`` read through to ``inner``, so code that only
  reads ``state.params`` (evaluation, checkpoints) works unchanged.
  """

  inner: Any
  hyper_opt_state: optax.OptState
  tangents: Any = ()

  @property
  def params(self) -> base.Params:
    return self.inner.params

  @property
  def hparams(self) -> dict[str, Any]:
    return self.inner.hparams

  @property
  def round_index(self) -> jax.Array:
    return self.inner.round_index


def cohort_objective(loss_fn: base.LossFn) -> Objective:
  """``L(params, cohort)``: mean loss over the cohort's real examples.

  Written with the primitives, as a federated evaluation: the server model is
  broadcast, each client sums its per-example losses and counts its
  examples, and the server divides the two sums.
  """
  def client_sums(params, batches, mask):
    dtype = jnp.result_type(jax.tree.leaves(params)[0])

    def step(total, t):
      batch, m = fedjx.indexed.take((batches, mask), t)
      return total + jnp.sum(jnp.where(m, loss_fn(params, batch), 0.0)), None

    total, _ = jax.lax.scan(step, jnp.zeros((), dtype),
                            jnp.arange(jnp.shape(mask)[0]))
    return total, jnp.sum(mask).astype(dtype)

  def objective(params, cohort):
    c = cohort.mask.shape[0]

    @fedjx.program(clients=c)
    def run(params, batches, mask):
      total, count = fedjx.map_fn(client_sums, (fedjx.broadcast(params),
                                                batches, mask))
      total = fedjx.reduce_sum(total)
      return total / jnp.maximum(fedjx.reduce_sum(count), 1.0)

    return run(params, cohort.batches, cohort.mask)

  return objective


def held_out_objective(loss_fn: base.LossFn,
                       batch: Mapping[str, jax.Array]) -> Objective:
  """``L(params, cohort) = mean_e loss(params, e)`` over a fixed held-out batch."""
  batch = jax.tree.map(jnp.asarray, dict(batch))
  return lambda params, cohort: jnp.mean(loss_fn(params, batch))


def hypergradient_tuner(algo: base.Algorithm, loss_fn: base.LossFn, *,
                        tune: str | Sequence[str] = ('server_optimizer/learning_rate',),
                        hyper_learning_rate: float = 0.1,
                        hyper_optimizer: optax.GradientTransformation | None = None,
                        objective: str | Objective = 'cohort',
                        horizon_decay: float = 0.0,
                        min_value: float = 1e-6,
                        max_value: float = 1e3) -> base.Algorithm:
  """Wraps ``algo`` so that each round also takes a hypergradient step on ``tune``.

  Args:
    algo: any :class:`~fedjx.algorithms.Algorithm` whose ``state.hparams``
      holds the tuned hyperparameters.
    loss_fn: ``loss_fn(params, batch) -> [B]``, for the objective after the
      round.
    tune: paths into ``state.hparams`` of positive hyperparameters to tune
      (``'server_optimizer/learning_rate'``, ``'client_optimizer/learning_rate'``,
      ``'outer_optimizer/learning_rate'``, ...).
    hyper_learning_rate: the learning rate of the default hyper-optimizer.
    hyper_optimizer: optax optimizer on the log hyperparameters (default
      ``optax.adam(hyper_learning_rate)``).
    objective: ``'cohort'`` (:func:`cohort_objective`: the round's clients'
      mean loss at the new server model) or a function
      ``objective(params, cohort) -> scalar`` (e.g.
      :func:`held_out_objective`).
    horizon_decay: ``gamma`` in [0, 1]: 0 differentiates through this round
      only; above 0 the tangents ``d x_t / du`` are carried across rounds
      with this decay (memory: one copy of the state's floating leaves per
      tuned value).
    min_value, max_value: bounds on every tuned value.

  Returns:
    An :class:`~fedjx.algorithms.Algorithm` with the same interface; its
    state is a :class:`TunerState`; its metrics are the wrapped round's plus
    ``hparams/<path>`` (the value after this round's step), ``hypergrad/<path>``
    (``dL/d log eta``) and ``tuner_objective`` (``L_t``). It is ``algo``
    with its rounds replaced, so it keeps every trait of ``algo``
    (``Algorithm.traits``); an ``algo`` whose clients keep state outside the
    server state (``client_state_init``) is refused.
  """
  name = 'hypergradient_tuner'
  if not isinstance(algo, base.Algorithm):
    raise ValueError(f'{name}: algo={algo!r} must be a fedjx.algorithms.Algorithm.')
  if algo.client_state_init is not None:
    raise ValueError(
        f'{name}: algo.client_state_init is set (not None): its clients keep '
        'state outside the server state, whose rows the tuner\'s derivative '
        'through the round does not carry; tune an algorithm with '
        'client_state_init=None.')
  if not callable(loss_fn):
    raise ValueError(f'{name}: loss_fn={loss_fn!r} must be callable.')
  paths = [tune] if isinstance(tune, str) else list(tune)
  if not paths:
    raise ValueError(f'{name}: tune={tune!r} names no hyperparameter.')
  names = ['/'.join(hypergradients.parse_path(p)) for p in paths]
  base.check_number(name, 'hyper_learning_rate', hyper_learning_rate)
  base.check_number(name, 'horizon_decay', horizon_decay, high=1.0)
  base.check_number(name, 'min_value', min_value, strict=True)
  base.check_number(name, 'max_value', max_value, low=min_value, strict=True)
  hyper_optimizer = hyper_optimizer or optax.adam(hyper_learning_rate)
  base.check_optimizer(name, 'hyper_optimizer', hyper_optimizer)
  if objective == 'cohort':
    objective_fn = cohort_objective(loss_fn)
  elif callable(objective):
    objective_fn = objective
  else:
    raise ValueError(f"{name}: objective={objective!r} must be 'cohort' or a "
                     'function objective(params, cohort) -> scalar.')
  lo, hi = float(jnp.log(min_value)), float(jnp.log(max_value))

  def read_log(hparams):
    return {n: jnp.log(hypergradients.get_path(hparams, n)) for n in names}

  def write(hparams, log_values):
    for n in names:
      old = hypergradients.get_path(hparams, n)
      hparams = hypergradients.set_path(
          hparams, n, jnp.exp(log_values[n]).astype(jnp.result_type(old)))
    return hparams

  def float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if _inexact(x)]

  def init(params):
    inner = algo.init(params)
    for n in names:
      value = hypergradients.get_path(inner.hparams, n)
      base.check_number(name, f'tuned hyperparameter {n}', value, strict=True)
    tangents = () if horizon_decay == 0 else [
        jnp.zeros((len(names),) + x.shape, x.dtype) for x in float_leaves(inner)]
    return TunerState(inner, hyper_optimizer.init(read_log(inner.hparams)), tangents)

  def assemble(algo: base.Algorithm, donate: bool) -> base.Algorithm:
    """The tuner around ``algo`` (whose ``apply`` it differentiates)."""

    def apply(state, cohort, key):
      return tuned_round(algo, state, cohort, key)

    def run(state, cohorts, keys):
      return base.scan_rounds(apply, state, cohorts, keys)

    def compiler(map_options, donate):
      return assemble(algo.compiler(map_options, True), donate)

    apply.__name__ = f'{name}_round'
    run.__name__ = f'{name}_run_rounds'
    donated = (0,) if donate else ()
    # ``algo`` with its rounds replaced: its traits kept.
    return algo._replace(init=init, round=constant_hoisting.jit(apply, donate_argnums=donated),
                         run_rounds=constant_hoisting.jit(run, donate_argnums=donated),
                         apply=apply,
                         compiler=None if algo.compiler is None else compiler)

  def tuned_round(algo, state, cohort, key):
    inner = state.inner
    log_values = read_log(inner.hparams)
    flat, unravel = ravel_pytree(log_values)
    leaves, treedef = jax.tree.flatten(inner)

    def after_round(s, v):
      s = s._replace(hparams=write(inner.hparams, unravel(v)))
      new_inner, metrics = algo.apply(s, cohort, key)
      return new_inner, metrics, objective_fn(new_inner.params, cohort)

    def push(tangent_leaves, direction):
      it = iter(tangent_leaves)
      t = [horizon_decay * next(it) if _inexact(x)
           else np.zeros(jnp.shape(x), jax.dtypes.float0) for x in leaves]
      out, out_t = jax.jvp(after_round, (inner, flat),
                           (jax.tree.unflatten(treedef, t), direction))
      return out, (float_leaves(out_t[0]), out_t[2])

    basis = jnp.eye(flat.size, dtype=flat.dtype)
    if horizon_decay == 0:
      zeros = [jnp.zeros((flat.size,) + x.shape, x.dtype) for x in float_leaves(inner)]
    else:
      zeros = state.tangents
    (new_inner, metrics, value), (tangents, dvalue) = jax.vmap(
        push, in_axes=(0, 0), out_axes=(None, 0))(zeros, basis)
    grads = unravel(jnp.where(jnp.isfinite(dvalue), dvalue, 0.0))
    updates, hyper_state = hyper_optimizer.update(grads, state.hyper_opt_state,
                                                  log_values)
    new_log = jax.tree.map(lambda u, d: jnp.clip(u + d, lo, hi), log_values, updates)
    new_inner = new_inner._replace(hparams=write(new_inner.hparams, new_log))
    if horizon_decay == 0:
      tangents = ()
    else:
      tangents = [jnp.where(jnp.isfinite(z), z, 0.0) for z in tangents]
    metrics = dict(metrics)
    for n in names:
      metrics[f'hparams/{n}'] = jnp.exp(new_log[n]).astype(jnp.float32)
      metrics[f'hypergrad/{n}'] = grads[n].astype(jnp.float32)
    metrics['tuner_objective'] = jnp.asarray(value, jnp.float32)
    return TunerState(new_inner, hyper_state, tangents), metrics

  return assemble(algo, True)


@traits_lib.declare(traits_lib.Traits())
def fedavg_hypergradient_tuner(
    loss_fn: base.LossFn, *,
    client_optimizer: optax.GradientTransformation | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
    hyper_optimizer: optax.GradientTransformation | None = None,
    tune: str | Sequence[str] = ('server_optimizer/learning_rate',),
    hyper_learning_rate: float = 0.1, horizon_decay: float = 0.0,
    min_value: float = 1e-6,
    max_value: float = 1e3, metrics_fn: base.MetricsFn | None = None,
    local_epochs: int = 1, local_steps: int | None = None,
    weighting: str = 'num_examples',
    skip_nonfinite: bool = True) -> base.Algorithm:
  """FedAvg / FedOpt with hypergradient descent on its learning rates.

  :func:`~fedjx.algorithms.fedavg` (arguments as there) wrapped by
  :func:`hypergradient_tuner` with the cohort objective (Rush et al. 2023's
  FedOpt with hypergradient descent; FedHyper-G, Wang et al. 2024, when
  ``tune`` is the server learning rate). Optimizers need injected
  hyperparameters (``optax.inject_hyperparams``) for the tuned learning rates
  to exist in ``state.hparams``. How clients run is set with
  ``.compile(map_strategy=..., chunk_size=...)`` of the result.
  """
  algo = fedavg_builder(loss_fn, client_optimizer=client_optimizer,
                           server_optimizer=server_optimizer,
                           metrics_fn=metrics_fn, local_epochs=local_epochs,
                           local_steps=local_steps, weighting=weighting,
                           skip_nonfinite=skip_nonfinite)
  return hypergradient_tuner(algo, loss_fn, tune=tune,
                             hyper_learning_rate=hyper_learning_rate,
                             hyper_optimizer=hyper_optimizer,
                             horizon_decay=horizon_decay, min_value=min_value, max_value=max_value)


__all__ = ['TunerState', 'cohort_objective', 'fedavg_hypergradient_tuner',
           'held_out_objective', 'hypergradient_tuner']
