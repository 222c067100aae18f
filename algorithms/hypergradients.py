"""Hypergradients: derivatives of an objective after ``R`` rounds of training.

Federated training is a differentiable function of its hyperparameters. With
``x_0`` the initial server state, ``h`` the hyperparameters (learning rates,
momentum, FedProx's ``mu``, DiLoCo's outer learning rate, ...: the leaves of
``state.hparams``), ``D_r`` the cohort of round ``r`` and ``A`` one round of
an algorithm,

    x_{r+1} = A(x_r, h; D_r),   r = 0 .. R-1,      J(h) = V(x_R),

with ``V`` a validation objective (e.g. held-out loss). The hypergradient
``dJ/dh`` differentiates through every round, and inside each round through
every client's local training: the chain rule runs through the federated
broadcast / map / reduce, which is what the primitives' JVP and transpose
rules provide (Rush et al. 2023, "Federated Automatic Differentiation",
arXiv 2301.07806).

Two modes:

* forward (``jax.jvp``): one tangent per hyperparameter, pushed through the
  rounds alongside the state; no residuals are stored, so memory does not
  grow with ``R``, and the cost is ``k`` forward passes for ``k``
  hyperparameters (good for a few learning rates);
* reverse (``jax.vjp``): one backward pass for any number of
  hyperparameters (e.g. one weight per client), but a naive backward pass
  keeps every round's residuals: memory ``O(R)`` rounds. With
  ``checkpoint_every=k`` the rounds run as a ``lax.scan`` over ``R/k``
  segments of ``k`` rounds; each segment and each round in it is wrapped in
  ``jax.checkpoint``, so the backward pass stores the ``R/k`` segment-entry
  states, recomputes one segment at a time keeping its ``k`` round-entry
  states, and recomputes one round's residuals at a time. Memory is
  ``O((R/k + k) |state| + |one round's residuals|)``, ``O(sqrt R)`` for
  ``k = sqrt R`` (``checkpoint_every='sqrt'``), at the price of about two
  more forward passes (Griewank & Walther's two-level checkpointing).

Client aggregation weights are hyperparameters too: FedAvg weights client
``i`` by ``w_i = n_i`` (its example count), a differentiable function of
``cohort.num_examples``. :func:`reweight_cohort` scales ``n_i`` by
``exp(theta_{id_i})``, a learned log-multiplier per client of the
population, so ``dJ/dtheta`` comes from the same machinery and
:func:`learn_client_weights` fits them by gradient descent (the client
weighting experiment of Rush et al. 2023). This needs
``weighting='num_examples'``: uniform weights do not depend on ``n_i``.

Hyperparameters are named by paths into the hyperparameter tree, which is
``state.hparams`` plus, when client weights are learned, the key
``'client_log_weights'``: ``'server_optimizer/learning_rate'``,
``('client_optimizer', 'learning_rate')``, ``'mu'``,
``'outer_optimizer/learning_rate'``, ``'client_log_weights'``; or by a
function that returns a pytree of leaves of that tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from fedjx.algorithms import base

CLIENT_LOG_WEIGHTS = 'client_log_weights'
MODES = ('reverse', 'forward')

Path = str | tuple[str, ...]
Selector = Path | Sequence[Path] | Callable[[Mapping[str, Any]], Any]
ValFn = Callable[[base.Params], jax.Array]


class Hypergradient(NamedTuple):
  """The objective ``J(h)`` after the rounds and its derivative ``dJ/dh``.

  Attributes:
    value: ``J(h)``, a scalar.
    grads: ``dJ/dh`` for the selected hyperparameters: a dict keyed by the
      paths joined with ``'/'`` when they were given as paths, else a pytree
      shaped like the selector's output.
  """

  value: jax.Array
  grads: Any


# ------------------------------------------------------------------- paths

def parse_path(path: Path) -> tuple[str, ...]:
  """``'a/b'`` or ``('a', 'b')`` -> ``('a', 'b')``."""
  if isinstance(path, str):
    parts = tuple(p for p in path.split('/') if p)
  elif isinstance(path, tuple) and all(isinstance(p, str) for p in path):
    parts = path
  else:
    parts = ()
  if not parts:
    raise ValueError(f'hyperparameter path {path!r} must be a non-empty '
                     "string like 'server_optimizer/learning_rate' or a tuple "
                     'of keys.')
  return parts


def get_path(tree: Mapping[str, Any], path: Path) -> Any:
  """The leaf of the hyperparameter tree at ``path``; names what exists if not."""
  node = tree
  parts = parse_path(path)
  for i, key in enumerate(parts):
    if not isinstance(node, Mapping) or key not in node:
      where = '/'.join(parts[:i]) or '<root>'
      have = sorted(node) if isinstance(node, Mapping) else type(node).__name__
      raise ValueError(f'hyperparameter path {"/".join(parts)!r}: no key {key!r} '
                       f'under {where}; there are {have}.')
    node = node[key]
  return node


def set_path(tree: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
  """A copy of the (nested dict) tree with the leaf at ``path`` replaced."""
  parts = parse_path(path)
  get_path(tree, parts)  # Raises a clear error for a missing key.
  out = dict(tree)
  if len(parts) == 1:
    out[parts[0]] = value
  else:
    out[parts[0]] = set_path(tree[parts[0]], parts[1:], value)
  return out


def selector(hparams: Selector) -> tuple[Callable[[Mapping[str, Any]], Any], bool]:
  """A function picking hyperparameters from the tree, and whether it is by path.

  Paths become ``lambda tree: {'a/b': tree['a']['b'], ...}``.
  """
  if callable(hparams):
    return hparams, False
  paths = [hparams] if isinstance(hparams, (str, tuple)) else list(hparams)
  if not paths:
    raise ValueError('hparams=[] selects no hyperparameter; give a path, a list '
                     'of paths or a function of the hyperparameter tree.')
  parsed = [parse_path(p) for p in paths]
  names = ['/'.join(p) for p in parsed]
  return (lambda tree: {n: get_path(tree, p) for n, p in zip(names, parsed)}), True


def embed(select: Callable[[Any], Any], tree: Any, values: Any) -> Any:
  """``tree`` with the leaves that ``select`` picks moved to ``values``.

  ``select`` is linear (it picks leaves), so its transpose ``S^T`` puts a
  pytree of its output's shape back into the tree's shape (zeros elsewhere),
  and ``tree + S^T (values - select(tree))`` is the substituted tree. Its
  derivative with respect to ``values`` is exactly ``S^T``, which is what
  differentiating with respect to the selected leaves means.
  """
  floats = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  current = select(tree)
  _, vjp = jax.vjp(select, tree)
  delta = jax.tree.map(lambda v, c: jnp.asarray(v, jnp.result_type(c)) - c,
                       values, current)
  (moved,) = vjp(delta)
  return jax.tree.map(lambda x, d: x + d if floats(x) else x, tree, moved)


# ------------------------------------------------------------- client weights

def reweight_cohort(cohort: base.Cohort, client_log_weights: jax.Array) -> base.Cohort:
  """The cohort with client ``i``'s aggregation weight ``n_i`` times ``exp(theta_{id_i})``.

  ``client_log_weights`` is ``theta``, one entry per client of the population
  (indexed by ``cohort.client_ids``). With ``weighting='num_examples'`` the
  server averages with ``w_i = n_i exp(theta_{id_i})``; ``theta = 0`` is the
  algorithm's own weighting. The weights are normalised by their sum, so
  adding a constant to ``theta`` changes nothing.
  """
  theta = jnp.asarray(client_log_weights)
  if theta.ndim != 1:
    raise ValueError('client_log_weights must have shape [num_clients] (one '
                     f'per client of the population); got shape {theta.shape}.')
  m = jnp.exp(theta)[cohort.client_ids]
  return cohort._replace(num_examples=cohort.num_examples * m)


# ------------------------------------------------------------------ unrolling

def check_checkpoint_every(checkpoint_every: int | str | None, num_rounds: int) -> int | None:
  """The segment length ``k`` (None: no checkpointing)."""
  if checkpoint_every is None:
    return None
  if checkpoint_every == 'sqrt':
    return max(1, round(math.sqrt(num_rounds)))
  if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) \
      or checkpoint_every < 1:
    raise ValueError(f'checkpoint_every={checkpoint_every!r} must be None (no '
                     "checkpointing), 'sqrt' or a positive int.")
  return min(checkpoint_every, num_rounds)


def run_rounds_checkpointed(apply: Callable[..., tuple[Any, base.Metrics]],
                            state: Any, cohorts: base.Cohort, keys: jax.Array,
                            checkpoint_every: int | str | None = 'sqrt') -> Any:
  """Runs ``R`` rounds (``lax.scan``), returning the final state.

  Args:
    apply: a plain round ``apply(state, cohort, key) -> (state, metrics)``.
    state: the state before round 0.
    cohorts: leaves stacked ``[R, C, ...]``.
    keys: ``[R]`` keys.
    checkpoint_every: None for a plain scan (reverse mode stores every
      round's residuals); ``k`` (or ``'sqrt'``: ``k = round(sqrt R)``) for
      two-level checkpointing: an outer scan over ``R // k`` segments whose
      body, a scan over ``k`` rounds, is rematerialised, and each round in it
      rematerialised too; the ``R mod k`` last rounds run as a scan of
      rematerialised rounds.

  Metrics are dropped: only the final state is kept.
  """
  num_rounds = jax.tree.leaves(keys)[0].shape[0]
  k = check_checkpoint_every(checkpoint_every, num_rounds)

  def one_round(s, xs):
    return apply(s, *xs)[0], None

  xs = (cohorts, keys)
  if k is None:
    return jax.lax.scan(one_round, state, xs)[0]
  remat_round = jax.checkpoint(one_round)

  def segment(s, seg_xs):
    return jax.lax.scan(remat_round, s, seg_xs)[0], None

  n_seg = num_rounds // k
  head = jax.tree.map(lambda x: x[:n_seg * k].reshape((n_seg, k) + x.shape[1:]), xs)
  tail = jax.tree.map(lambda x: x[n_seg * k:], xs)
  if n_seg:
    state = jax.lax.scan(jax.checkpoint(segment), state, head)[0]
  if num_rounds - n_seg * k:
    state = jax.lax.scan(remat_round, state, tail)[0]
  return state


def unrolled_objective(algo: base.Algorithm, objective_fn: ValFn,
                       cohorts: base.Cohort | None = None,
                       keys: jax.Array | None = None, *,
                       checkpoint_every: int | str | None = 'sqrt'
                       ) -> Callable[..., jax.Array]:
  """``J(state, client_log_weights=None) = objective_fn(x_R.params)`` after ``R`` rounds.

  The rounds are ``algo.apply`` on ``cohorts[r]`` with ``keys[r]``, starting
  from ``state`` (whose ``hparams`` are the hyperparameters ``h``), run by
  :func:`run_rounds_checkpointed`. With ``client_log_weights`` every cohort
  is first reweighted by :func:`reweight_cohort`. ``J`` is a plain function:
  differentiate it with ``jax.grad`` / ``jax.jvp`` with respect to
  ``state.hparams`` (or the weights), or ``jax.jit`` it. The cohorts and keys
  given here are defaults; ``J(state, cohorts=..., keys=...)`` passes them as
  arguments instead (under ``jit`` they are then inputs, not constants).
  """
  if not callable(objective_fn):
    raise ValueError(f'objective_fn={objective_fn!r} must be callable: '
                     'objective_fn(params) -> scalar.')
  if keys is not None:
    check_checkpoint_every(checkpoint_every, jax.tree.leaves(keys)[0].shape[0])
  default_cohorts, default_keys = cohorts, keys

  def objective(state: Any, client_log_weights: jax.Array | None = None, *,
                cohorts: base.Cohort | None = None,
                keys: jax.Array | None = None) -> jax.Array:
    data = default_cohorts if cohorts is None else cohorts
    keys = default_keys if keys is None else keys
    if data is None or keys is None:
      raise ValueError('unrolled_objective: no cohorts / keys were given, '
                       'neither when it was built nor in this call.')
    if client_log_weights is not None:
      data = reweight_cohort(data, client_log_weights)
    final = run_rounds_checkpointed(algo.apply, state, data, keys, checkpoint_every)
    value = jnp.asarray(objective_fn(final.params))
    if value.shape != ():
      raise ValueError(f'objective_fn must return a scalar; got shape {value.shape}.')
    return value

  return objective


def hyperparameter_tree(state: Any, client_log_weights: jax.Array | None = None
                        ) -> dict[str, Any]:
  """``state.hparams``, plus ``'client_log_weights'`` when given."""
  tree = dict(state.hparams)
  if client_log_weights is not None:
    if CLIENT_LOG_WEIGHTS in tree:
      raise ValueError(f'state.hparams already has a key {CLIENT_LOG_WEIGHTS!r}.')
    tree[CLIENT_LOG_WEIGHTS] = jnp.asarray(client_log_weights)
  return tree


def hypergradient(algo: base.Algorithm, state: Any, hparams: Selector,
                  cohorts: base.Cohort, keys: jax.Array, val_fn: ValFn, *,
                  mode: str = 'reverse',
                  checkpoint_every: int | str | None = 'sqrt',
                  client_log_weights: jax.Array | None = None) -> Hypergradient:
  """``J(h)`` and ``dJ/dh`` through ``R`` rounds of ``algo`` (Rush et al. 2023).

  ``J(h) = val_fn(x_R.params)`` with ``x_{r+1} = algo.apply(x_r, cohorts[r],
  keys[r])`` and ``x_0 = state`` whose hyperparameters are replaced by ``h``.

  Args:
    algo: any :class:`~fedjx.algorithms.Algorithm`.
    state: the state before the first round (not donated).
    hparams: which hyperparameters: a path (``'server_optimizer/learning_rate'``),
      a list of paths, or a function of the hyperparameter tree
      (``state.hparams`` plus ``'client_log_weights'``) returning some of its
      leaves.
    cohorts: ``R`` cohorts stacked ``[R, C, ...]``.
    keys: ``[R]`` round keys.
    val_fn: ``val_fn(params) -> scalar``, the objective after the last round.
    mode: ``'reverse'`` (``jax.vjp``: one backward pass for all selected
      hyperparameters; memory set by ``checkpoint_every``) or ``'forward'``
      (``jax.jvp`` of each selected scalar, vectorised with ``jax.vmap``; no
      stored residuals).
    checkpoint_every: rounds per rematerialised segment (see
      :func:`run_rounds_checkpointed`); used by reverse mode.
    client_log_weights: optional ``[num_clients]`` log-multipliers of the
      aggregation weights (:func:`reweight_cohort`); then the path
      ``'client_log_weights'`` selects them.

  Returns:
    :class:`Hypergradient` ``(value, grads)``.
  """
  base.check_choice('hypergradient', 'mode', mode, MODES)
  select, _ = selector(hparams)
  tree = hyperparameter_tree(state, client_log_weights)
  select(tree)  # Raises for paths that do not exist.
  objective = unrolled_objective(
      algo, val_fn,
      checkpoint_every=checkpoint_every if mode == 'reverse' else None)
  value, grads = _hypergradient(objective, select, mode, state, tree,
                                cohorts, keys)
  return Hypergradient(value, grads)


def _hypergradient(objective, select, mode, state, tree, cohorts, keys):
  has_weights = CLIENT_LOG_WEIGHTS in tree

  @jax.jit
  def run(state, tree, cohorts, keys):
    def fn(h):
      t = embed(select, tree, h)
      hp = {k: v for k, v in t.items() if k != CLIENT_LOG_WEIGHTS}
      return objective(state._replace(hparams=hp),
                       t[CLIENT_LOG_WEIGHTS] if has_weights else None,
                       cohorts=cohorts, keys=keys)

    h0 = select(tree)
    if mode == 'reverse':
      return jax.value_and_grad(fn)(h0)
    flat, unravel = ravel_pytree(h0)
    push = lambda t: jax.jvp(lambda v: fn(unravel(v)), (flat,), (t,))
    values, tangents = jax.vmap(push)(jnp.eye(flat.size, dtype=flat.dtype))
    return values[0], unravel(tangents)

  return run(state, tree, cohorts, keys)


# ---------------------------------------------------- learning client weights

class ClientWeightFit(NamedTuple):
  """Result of :func:`learn_client_weights`.

  Attributes:
    client_log_weights: the learned ``theta`` (``[num_clients]``, mean 0).
    objective: ``J`` before each step, ``[steps]``.
  """

  client_log_weights: jax.Array
  objective: jax.Array


def learn_client_weights(algo: base.Algorithm, state: Any, cohorts: base.Cohort,
                         keys: jax.Array, val_fn: ValFn, num_clients: int, *,
                         steps: int = 20,
                         optimizer: optax.GradientTransformation | None = None,
                         checkpoint_every: int | str | None = 'sqrt',
                         init: jax.Array | None = None) -> ClientWeightFit:
  """Fits per-client aggregation log-weights by hypergradient descent.

  Minimises ``J(theta) = val_fn(x_R(theta).params)``, the objective after
  ``R`` rounds whose server averages use ``w_i = n_i exp(theta_{id_i})``
  (:func:`reweight_cohort`), with ``steps`` steps of ``optimizer`` (default
  Adam, learning rate 0.1) on ``dJ/dtheta`` from reverse-mode
  differentiation through the rounds. As in Rush et al. 2023 (Section 5,
  learning client weights), clients whose updates hurt the validation
  objective (e.g. with corrupted labels) are down-weighted. ``theta`` is kept
  at mean zero (the weights are scale-invariant).
  """
  base.check_positive_int('learn_client_weights', 'num_clients', num_clients)
  base.check_positive_int('learn_client_weights', 'steps', steps)
  optimizer = optimizer or optax.adam(0.1)
  dtype = jnp.result_type(jax.tree.leaves(state.params)[0])
  theta = jnp.zeros((num_clients,), dtype) if init is None else jnp.asarray(init, dtype)
  objective = unrolled_objective(algo, val_fn, checkpoint_every=checkpoint_every)

  @jax.jit
  def fit(theta, state, cohorts, keys):
    def step(carry, _):
      theta, opt_state = carry
      value, g = jax.value_and_grad(
          lambda t: objective(state, t, cohorts=cohorts, keys=keys))(theta)
      updates, opt_state = optimizer.update(g, opt_state, theta)
      theta = optax.apply_updates(theta, updates)
      return (theta - jnp.mean(theta), opt_state), value

    (theta, _), values = jax.lax.scan(step, (theta, optimizer.init(theta)),
                                      None, length=steps)
    return theta, values

  theta, values = fit(theta, state, cohorts, keys)
  return ClientWeightFit(theta, values)


__all__ = [
    'CLIENT_LOG_WEIGHTS',
    'ClientWeightFit',
    'Hypergradient',
    'embed',
    'get_path',
    'hypergradient',
    'hyperparameter_tree',
    'learn_client_weights',
    'parse_path',
    'reweight_cohort',
    'run_rounds_checkpointed',
    'selector',
    'set_path',
    'unrolled_objective',
]
