"""DP-FTRL: tree-aggregated noisy prefix sums of clipped client updates.

Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep)
Learning without Sampling or Shuffling", ICML 2021 (arXiv 2103.00039),
Algorithm 1 (DP-FTRL) with the binary-tree mechanism of Dwork, Naor, Pitassi,
Rothblum 2010 and Chan, Shi, Song 2011. No sampling is assumed: clients may
be chosen by any rule, with a bound on how often one takes part.

Round ``t`` (1-based within a tree) clips and sums the cohort's updates,

    g_t = sum_i Delta_i min(1, C / ||Delta_i||),

and releases the noisy prefix sum ``s_t = sum_{r <= t} g_r + B_t``. The tree
has a node for every dyadic interval ``[j 2^l + 1, (j + 1) 2^l]`` of rounds
(level ``l``, index ``j``), each with its own noise ``N(0, (z C)^2 I)``;
``B_t`` is the sum of the noises of the ``popcount(t)`` nodes that tile
``[1, t]``, one per set bit ``l`` of ``t`` (node ``(l, (t >> l) - 1)``). So
each release carries noise of variance ``popcount(t) (z C)^2`` per
coordinate, at most ``ceil(log2(t + 1)) (z C)^2``, while every ``g_r``
enters at most ``ceil(log2(T)) + 1`` nodes of a tree over ``T`` rounds (the
sensitivity the paper's tree-aggregation analysis uses).

The aggregate of round ``t`` is the difference of consecutive releases over
``D`` (the server optimizer then applies to it, as to any aggregate):

    Delta_t = (s_t - s_{t-1}) / D = (g_t + B_t - B_{t-1}) / D.

With the server optimizer SGD of learning rate ``eta`` this is DP-FTRL
exactly: ``x_t = x_0 - eta s_t / D``, the minimiser of ``<s_t, x> +
(D / (2 eta)) ||x - x_0||^2``. With heavy-ball momentum ``beta``
(``optax.sgd(eta, momentum=beta)``), ``v_t = beta v_{t-1} + Delta_t`` and
``x_t = x_{t-1} - eta v_t`` sum to ``x_t = x_0 - eta V_t / D`` with
``V_t = beta V_{t-1} + s_t``: the paper's DP-FTRLM. Any other server
optimizer is post-processing of the releases.

Restarts: every ``restart_every`` rounds the tree starts over (the paper
restarts at epoch boundaries): the next round is step 1 of a new tree with
fresh node noises, and the noise of the old tree's last release stays in
the model (``B_0 = 0`` for the new tree). The server optimizer's state (its
momentum) carries over.

``efficient=True`` releases Honaker's lower-variance estimates of the same
prefix sums (:func:`efficient_tree_noise`).

Node noises are drawn from keys derived from the tree's key (the round key
of its first round), the level and the index, so nothing per round is
stored: the state holds the step, the tree's key and ``B_t`` (one copy of
the model).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.traits import Privacy
from fedjx.algorithms.traits import Traits


class TreeState(NamedTuple):
  """The tree aggregator's state.

  Attributes:
    step: releases made by the current tree (0 before the first round).
    tree_key: the current tree's key data (its first round's key).
    noise: ``B_t``, the tree noise of the last release (zeros at first).
    nodes: with ``efficient=True``, the latest completed node's estimated
      noise at each level (leaves ``[L, ...]``); else ``()``.
  """

  step: jax.Array
  tree_key: jax.Array
  noise: base.PyTree
  nodes: base.PyTree = ()


def _key_data(key: jax.Array) -> jax.Array:
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key)
  return key


def node_noise(tree_key: jax.Array, level: jax.Array, index: jax.Array,
               like: base.PyTree, std: jax.Array) -> base.PyTree:
  """The noise ``N(0, std^2 I)`` of node ``(level, index)``, shaped as ``like``.

  Drawn from ``fold_in(fold_in(tree_key, level), index)``: the same node
  gets the same noise in every release that uses it.
  """
  key = jax.random.fold_in(jax.random.fold_in(
      jax.random.wrap_key_data(tree_key), level), index)
  zeros = jax.tree.map(jnp.zeros_like, like)
  return aggregators.add_gaussian_noise(zeros, jnp.asarray(std, jnp.float32), key)


def tree_noise(tree_key: jax.Array, step: jax.Array, like: base.PyTree,
               std: jax.Array, num_levels: int) -> base.PyTree:
  """``B_t``: the sum of the noises of the nodes that tile ``[1, step]``.

  For each set bit ``l < num_levels`` of ``step``, from ``l = 0`` up, the
  noise of node ``(l, (step >> l) - 1)``.
  """
  step = jnp.asarray(step, jnp.int32)

  def add_level(level, total):
    def add(total):
      node = node_noise(tree_key, level, (step >> level) - 1, like, std)
      return jax.tree.map(jnp.add, total, node)
    return jax.lax.cond((step >> level) & 1 == 1, add, lambda t: t, total)

  zeros = jax.tree.map(jnp.zeros_like, like)
  return jax.lax.fori_loop(0, num_levels, add_level, zeros)


def efficient_weights(num_levels: int) -> np.ndarray:
  """Honaker's weights ``a_l``: also each level's variance over ``(z C)^2``.

  A node of level ``l`` has its own noisy sum (variance ``s^2 = (z C)^2``)
  and its children's estimates (variance ``2 v_{l-1}``); their
  inverse-variance mean ``a_l own + (1 - a_l) (left + right)``, with
  ``a_l = 2 v_{l-1} / (s^2 + 2 v_{l-1})``, has variance ``v_l = a_l s^2``
  (``v_0 = s^2``, ``a_0 = 1``).
  """
  a = [1.0]
  for _ in range(1, num_levels):
    a.append(2 * a[-1] / (1 + 2 * a[-1]))
  return np.asarray(a)


def efficient_tree_noise(tree_key: jax.Array, step: jax.Array,
                         nodes: base.PyTree, like: base.PyTree, std: jax.Array,
                         num_levels: int) -> tuple[base.PyTree, base.PyTree]:
  """Honaker's estimate of ``B_t``, and the nodes updated.

  Step ``t`` completes node ``(k, t / 2^k - 1)``, ``k`` the trailing zeros
  of ``t``; its estimate is built up from the leaf ``t``: at each level
  ``l <= k``, ``a_l own_l + (1 - a_l) (left_{l-1} + estimate_{l-1})``, the
  left child being the stored node of level ``l - 1``. ``B_t`` is the sum
  of the stored estimates of the set bits of ``t``.
  """
  step = jnp.asarray(step, jnp.int32)
  k = jax.lax.population_count((step & -step) - 1)  # Trailing zeros.
  a = jnp.asarray(efficient_weights(num_levels), jnp.float32)

  def up(level, estimate):
    def combine(estimate):
      own = node_noise(tree_key, level, (step >> level) - 1, like, std)
      return jax.tree.map(
          lambda o, n, e: a[level] * o + (1 - a[level]) * (n[level - 1] + e),
          own, nodes, estimate)
    return jax.lax.cond(level <= k, combine, lambda e: e, estimate)

  leaf = node_noise(tree_key, 0, step - 1, like, std)
  estimate = jax.lax.fori_loop(1, num_levels, up, leaf)
  nodes = jax.tree.map(lambda n, e: n.at[k].set(e), nodes, estimate)
  bits = ((step >> jnp.arange(num_levels)) & 1).astype(jnp.float32)
  noise = jax.tree.map(lambda n: jnp.tensordot(bits.astype(n.dtype), n, axes=1),
                       nodes)
  return noise, nodes


TREE_GAUSSIAN = Privacy('tree_gaussian', 'central DP', mechanism='tree',
                        canaries=True)
""":func:`tree_gaussian`'s mechanism, as its builder declares it."""


@traits_lib.declare(Traits(checks_update=True, privacy=TREE_GAUSSIAN))
def tree_gaussian(clip_norm: float = 1.0, noise_multiplier: float = 1.0,
                  restart_every: int | None = None,
                  expected_clients_per_round: float | None = None,
                  efficient: bool = False,
                  canaries=None) -> aggregators.Aggregator:
  """DP-FTRL's aggregator: clipped sums released through a noise tree.

  Kairouz et al., "Practical and Private (Deep) Learning without Sampling or
  Shuffling", ICML 2021 (module docstring): the aggregate of round ``t`` is
  ``(s_t - s_{t-1}) / D``, the difference of the tree's noisy prefix sums;
  with ``fedavg``'s server SGD (with heavy-ball momentum) the model is
  DP-FTRL's (DP-FTRLM's).

  Args:
    clip_norm: ``C`` > 0 (``state.hparams['clip_norm']``).
    noise_multiplier: ``z`` >= 0: each tree node's noise is ``N(0, (z C)^2
      I)`` (``state.hparams['noise_multiplier']``).
    restart_every: start a new tree every this many rounds; None never does.
    expected_clients_per_round: ``D``, the fixed denominator; None divides
      by the number of participating clients (DP-FTRL then equals the
      server SGD only up to that per-round scale).
    efficient: release Honaker's estimates of the prefix sums (Honaker,
      "Efficient Use of Differentially Private Binary Trees", 2015, in its
      online, bottom-up form: only completed subtrees are used): each
      node's noise is replaced by the inverse-variance mean of its own and
      its children's
      (:func:`efficient_weights`), a post-processing of the same tree, so
      the privacy is the same and the variance of ``B_t`` is ``(z C)^2
      sum_{set bits l} a_l`` instead of ``(z C)^2 popcount(t)``. The state
      then keeps one model per level, ``restart_every.bit_length()``; it
      needs ``restart_every``.
    canaries: the canary clients of a privacy audit
      (:mod:`fedjx.algorithms.privacy.audit`): their clipped updates join
      the round's sum ``g_t``, so each enters the tree's leaf of its round.
      None: no audit.

  Returns:
    The :class:`~fedjx.algorithms.aggregators.Aggregator`; its state is a
    :class:`TreeState`. Every client has weight 1. Metrics: ``tree_step``
    (``t``), ``noise_std`` (``z C sqrt(popcount(t))``, or the efficient
    estimate's, the std of the release's noise on the sum),
    ``clipped_fraction`` and
    ``mean_update_norm`` (before clipping; not private).
  """
  fn = 'tree_gaussian'
  aggregators.check_dp_options(fn, noise_multiplier, expected_clients_per_round,
                               clip_norm=clip_norm)
  base.check_positive_int(fn, 'restart_every', restart_every, allow_none=True)
  if not isinstance(efficient, bool):
    raise ValueError(f'{fn}: efficient={efficient!r} must be True or False.')
  if efficient and restart_every is None:
    raise ValueError(f'{fn}: efficient=True needs restart_every (a positive '
                     'int; the state keeps one model per tree level); got '
                     'restart_every=None.')
  # Levels that a step can set: steps are <= restart_every, or int32.
  num_levels = 31 if restart_every is None else restart_every.bit_length()
  variances = jnp.asarray(efficient_weights(num_levels) if efficient
                          else np.ones(num_levels), jnp.float32)

  def init(params):
    key = _key_data(jax.random.key(0))
    nodes = () if not efficient else jax.tree.map(
        lambda p: jnp.zeros((num_levels,) + jnp.shape(p), jnp.result_type(p)),
        params)
    return TreeState(step=jnp.zeros((), jnp.int32),
                     tree_key=jnp.zeros_like(key),
                     noise=jax.tree.map(jnp.zeros_like, params), nodes=nodes)

  def weights(num_examples):
    return base.aggregation_weights(num_examples, 'uniform')

  def encode(hparams, update, w):
    clipped, norm = aggregators.clip_update(update, hparams['clip_norm'])
    return jax.tree.map(lambda u: u * w.astype(u.dtype), clipped), norm

  def combine(state, hparams, clients, key):
    clip, z = hparams['clip_norm'], hparams['noise_multiplier']
    new_tree = state.step == 0
    if restart_every is not None:
      new_tree = jnp.logical_or(new_tree, state.step >= restart_every)
    step = jnp.where(new_tree, 1, state.step + 1)
    tree_key = jnp.where(new_tree, _key_data(key), state.tree_key)
    previous = jax.tree.map(lambda b: jnp.where(new_tree, jnp.zeros_like(b), b),
                            state.noise)
    total = fedjx.reduce_sum(clients.update)
    if efficient:
      noise, nodes = efficient_tree_noise(tree_key, step, state.nodes, total,
                                          z * clip, num_levels)
    else:
      noise, nodes = tree_noise(tree_key, step, total, z * clip, num_levels), ()
    count = aggregators.participants(clients)
    denom = aggregators.denominator(expected_clients_per_round, count)
    aggregate = jax.tree.map(lambda g, b, p: (g + (b - p)) / denom.astype(g.dtype),
                             total, noise, previous)
    real, norms = clients.weights, clients.encoded
    clipped = fedjx.reduce_sum(real * (norms > clip).astype(jnp.float32))
    metrics = {
        'tree_step': step.astype(jnp.float32),
        'noise_std': z * clip * jnp.sqrt(jnp.sum(
            variances * ((step >> jnp.arange(num_levels)) & 1))),
        'clipped_fraction': clipped / jnp.maximum(count, 1.0),
        'mean_update_norm': fedjx.reduce_sum(real * norms) / jnp.maximum(count, 1.0)}
    return aggregate, TreeState(step, tree_key, noise, nodes), metrics

  return aggregators.audited(aggregators.Aggregator(
      init=init, combine=combine, encode=encode,
      hparams={'clip_norm': clip_norm, 'noise_multiplier': noise_multiplier},
      weights=weights,
      traits=tree_gaussian.traits._replace(privacy=TREE_GAUSSIAN._replace(
          noise_multiplier=noise_multiplier,
          expected_clients_per_round=expected_clients_per_round,
          restart_every=restart_every))),
      canaries, lambda state, hparams: hparams['clip_norm'],
      expected_clients_per_round)


__all__ = ['TreeState', 'efficient_tree_noise', 'efficient_weights', 'node_noise',
           'tree_gaussian', 'tree_noise']
