"""Robust aggregators: defenses against Byzantine clients.

Each defense is an :class:`fedjx.algorithms.aggregators.Aggregator`, so any
algorithm takes it (``aggregator=krum(num_byzantine=2)``, or in a config
``config.algorithm.aggregator = dict(name='krum', num_byzantine=2)``):

| aggregator (config name) | rule | reads |
|---|---|---|
| :func:`coordinate_median` (``median``) | coordinate-wise median | every update at once |
| :func:`trimmed_mean` (``trimmed_mean``) | coordinate-wise trimmed mean | every update at once |
| :func:`krum`, :func:`multi_krum` | lowest sum of distances to the nearest | every update at once |
| :func:`bulyan` | Krum selections, then a trimmed mean around the median | every update at once |
| :func:`geometric_median` | smoothed Weiszfeld (RFA) | iterated weighted means |
| :func:`norm_bounding` | clip each update's norm, then the mean | one weighted mean |
| :func:`centered_clipping` | clip each update around the last aggregate | iterated means |

The first five are in :mod:`fedjx.algorithms.aggregators.order_statistics` (stacked on
the server; the streaming executor refuses them). The last three are
written with the fedjx reductions: they fuse in chunked maps and run on
Beam; :func:`norm_bounding` and one-iteration :func:`centered_clipping`
make one pass over the clients and stream, while further Weiszfeld or
clipping iterations read each update again after a reduction, which a
streamed round cannot (its executor refuses them).

Votes: padding clients and clients skipped by the non-finite guard have
weight 0 and ``num_examples`` 0, so they count nowhere. :func:`dp_defense`
composes a defense with user-level DP noise (see its docstring for the
guarantee).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms import nonfinite
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.traits import Privacy
from fedjx.algorithms.traits import Traits
from fedjx.algorithms.aggregators.order_statistics import bulyan
from fedjx.algorithms.aggregators.order_statistics import coordinate_median
from fedjx.algorithms.aggregators.order_statistics import krum
from fedjx.algorithms.aggregators.order_statistics import multi_krum
from fedjx.algorithms.aggregators.order_statistics import trimmed_mean


def _stateless(params: base.Params) -> tuple[()]:
  del params
  return ()


def _divide(tree: Any, total: jax.Array) -> Any:
  safe = jnp.where(total > 0, total, 1.0)
  return jax.tree.map(lambda s: jnp.where(total > 0, s / safe.astype(s.dtype),
                                          jnp.zeros_like(s)), tree)


def _participants(clients: nonfinite.Clients) -> jax.Array:
  """The placed flags ``[C]``: 1.0 for a client with data that was not skipped."""
  return (jnp.asarray(clients.num_examples) > 0).astype(jnp.float32)


def _norm(tree: Any) -> jax.Array:
  return aggregators.safe_global_norm(tree)


# ------------------------------------------------------- geometric median

def geometric_median(nu: float = 1e-6, iterations: int = 3) -> aggregators.Aggregator:
  """The geometric median of the updates by the smoothed Weiszfeld algorithm.

  Pillutla, Kakade, Harchaoui, "Robust Aggregation for Federated Learning"
  (RFA), IEEE Trans. Signal Processing 2022, Algorithm 2: with weights
  ``alpha_i`` (the algorithm's: example counts by default, as in RFA), start
  at the weighted mean ``v_0`` and repeat ``iterations`` times

      beta_i  = alpha_i / max(nu, ||v - Delta_i||)
      v      <- sum_i beta_i Delta_i / sum_i beta_i

  which decreases the smoothed objective ``g_nu(v) = sum_i alpha_i
  ||v - Delta_i||_nu`` (RFA found a few iterations enough; the default is
  3). Each iteration is one ``map_fn`` (the distances) and two
  ``reduce_sum`` s. Metrics: ``weiszfeld_iterations`` and
  ``geometric_median_objective``, ``sum_i alpha_i ||v - Delta_i|| / sum_i
  alpha_i`` at the result.
  """
  fn = 'geometric_median'
  base.check_number(fn, 'nu', nu, strict=True)
  base.check_positive_int(fn, 'iterations', iterations)
  nu = float(nu)

  def step(x, alpha, v):
    beta = alpha / jnp.maximum(nu, _norm(base.tree_sub(v, x)))
    return jax.tree.map(lambda l: beta.astype(l.dtype) * l, x), beta

  def distance(x, alpha, v):
    return alpha * _norm(base.tree_sub(v, x))

  def combine(state, hparams, clients, key):
    del hparams, key
    x, alpha = clients.update, clients.weights
    v = nonfinite.weighted_mean(clients)
    for _ in range(iterations):
      weighted, beta = fedjx.map_fn(step, (x, alpha, fedjx.broadcast(v)))
      total, beta_sum = fedjx.reduce_sum((weighted, beta))
      v = _divide(total, beta_sum)
    spread = fedjx.reduce_sum(fedjx.map_fn(distance, (x, alpha, fedjx.broadcast(v))))
    alpha_sum = fedjx.reduce_sum(alpha)
    objective = jnp.where(alpha_sum > 0, spread / jnp.where(alpha_sum > 0, alpha_sum, 1.0),
                          0.0)
    return v, state, {'weiszfeld_iterations': jnp.float32(iterations),
                      'geometric_median_objective': objective}

  return aggregators.Aggregator(init=_stateless, combine=combine)


# --------------------------------------------------------- norm bounding

def norm_bounding(max_norm: float = 1.0) -> aggregators.Aggregator:
  """The weighted mean of the updates clipped to norm ``max_norm``.

  Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor Federated
  Learning?", 2019, section 3: each update is scaled into the ``M``-ball,
  ``m_i = Delta_i / max(1, ||Delta_i|| / M)``, and the server takes the
  FedAvg mean ``sum_i w_i m_i / sum_i w_i`` (``w_i`` the algorithm's weights,
  example counts by default, as in the paper's FedAvg). ``M`` is traced
  (``state.hparams['max_norm']``). One pass: it streams. Metrics:
  ``clipped_clients`` (participants with ``||Delta_i|| > M``) and
  ``mean_update_norm`` (before clipping, over participants). With Gaussian
  noise on the sum this is :func:`fedjx.algorithms.aggregators.gaussian`
  (Sun et al.'s "weak DP").
  """
  fn = 'norm_bounding'
  base.check_number(fn, 'max_norm', max_norm, strict=True)

  def encode(hparams, update, w):
    del w
    return aggregators.clip_update(update, hparams['max_norm'])

  def combine(state, hparams, clients, key):
    del key
    p, norms = _participants(clients), clients.encoded
    count = jnp.maximum(fedjx.reduce_sum(p), 1.0)
    clipped = fedjx.reduce_sum(p * (norms > hparams['max_norm']).astype(jnp.float32))
    return nonfinite.weighted_mean(clients), state, {
        'clipped_clients': clipped,
        'mean_update_norm': fedjx.reduce_sum(p * norms) / count}

  return aggregators.Aggregator(init=_stateless, combine=combine, encode=encode,
                                hparams={'max_norm': max_norm},
                                traits=Traits(checks_update=True))


# ------------------------------------------------------ centered clipping

def centered_clipping(radius: float = 1.0, iterations: int = 1) -> aggregators.Aggregator:
  """Centered clipping around the previous round's aggregate.

  Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
  Optimization", ICML 2021, eq. (CC): from the center ``v_0``, the last
  round's aggregate (kept in the aggregator's state, zero before the first
  round), repeat ``iterations`` (``L``) times

      v_{l+1} = v_l + (1/m) sum_{i in P} clip_tau(Delta_i - v_l),
      clip_tau(z) = z min(1, tau / ||z||)

  with the ``m`` participants weighted alike (as in the paper). The paper
  finds ``L = 1`` enough from such a center; then each client sends
  ``clip_tau(Delta_i - v_0)`` (the center is broadcast with the model) and
  the round is one pass: it streams. With ``L > 1`` clients send
  ``Delta_i`` and each iteration is a ``map_fn`` and a ``reduce_sum``.
  ``tau`` is traced (``state.hparams['clipping_radius']``). Metrics:
  ``clipped_clients`` (participants with ``||Delta_i - v_0|| > tau``) and
  ``mean_distance_to_center`` (``||Delta_i - v_0||`` over participants).
  """
  fn = 'centered_clipping'
  base.check_number(fn, 'radius', radius, strict=True)
  base.check_positive_int(fn, 'iterations', iterations)

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def broadcast(state):
    return {'center': state}

  def encode(hparams, update, w):
    del w
    clipped, distance = aggregators.clip_update(
        base.tree_sub(update, hparams['center']), hparams['clipping_radius'])
    return (clipped if iterations == 1 else update), distance

  def step(x, w, v, tau):
    clipped, _ = aggregators.clip_update(base.tree_sub(x, v), tau)
    return jax.tree.map(lambda l: w.astype(l.dtype) * l, clipped)

  def combine(state, hparams, clients, key):
    del key
    tau, p = hparams['clipping_radius'], _participants(clients)
    count = fedjx.reduce_sum(p)
    if iterations == 1:
      v = jax.tree.map(jnp.add, state, nonfinite.weighted_mean(clients))
    else:
      v, w = state, clients.weights
      for _ in range(iterations):
        shift = fedjx.reduce_sum(fedjx.map_fn(
            step, (clients.update, w, fedjx.broadcast(v), fedjx.broadcast(tau))))
        v = jax.tree.map(jnp.add, v, _divide(shift, fedjx.reduce_sum(w)))
    distances = clients.encoded
    metrics = {
        'clipped_clients': fedjx.reduce_sum(p * (distances > tau).astype(jnp.float32)),
        'mean_distance_to_center': fedjx.reduce_sum(p * distances) / jnp.maximum(count, 1.0)}
    return v, v, metrics

  return aggregators.Aggregator(
      init=init, combine=combine, encode=encode,
      hparams={'clipping_radius': radius}, broadcast=broadcast,
      weights=lambda n: base.aggregation_weights(n, 'uniform'),
      traits=Traits(checks_update=True))


# ----------------------------------------------------------- DP composition

def _state_kept(aggregator: aggregators.Aggregator) -> str | None:
  """What of ``aggregator``'s state outlives a round, in words, or None.

  Its state (``init``'s leaves, which ``combine`` carries to the next round),
  the part of it each client's ``encode`` reads (``broadcast``), and the
  per-client values ``encode`` reads besides (``client_inputs``).
  """
  state = jax.eval_shape(aggregator.init, {'x': jax.ShapeDtypeStruct((1,), jnp.float32)})
  kept = []
  leaves = len(jax.tree.leaves(state))
  if leaves:
    kept.append(f'keeps state between rounds ({type(state).__name__}, '
                f'{leaves} array{"s" if leaves > 1 else ""})')
  if aggregator.broadcast is not None:
    sent = sorted(jax.eval_shape(aggregator.broadcast, state))
    kept.append(f'sends {", ".join(map(repr, sent))} of it to the clients '
                'each round')
  if aggregator.client_inputs is not None:
    kept.append('gives each client inputs of its own')
  return ', '.join(kept) or None


DP_DEFENSE = Privacy('dp_defense', 'central DP')
""":func:`dp_defense`'s mechanism: one the runner's accountant does not
account for (no ``mechanism``; a run with it reports no epsilon)."""


@traits_lib.declare(Traits(checks_update=True, privacy=DP_DEFENSE))
def dp_defense(defense: Any, clip_norm: float = 1.0,
               noise_multiplier: float = 1.0) -> aggregators.Aggregator:
  """A defense on clipped updates, its output clipped and noised (user-level DP).

      client i:  m_i = Delta_i min(1, C / ||Delta_i||)        (then the defense's encode)
      server:    A = defense(m_1, ..., m_n);  Delta = A min(1, C / ||A||) + N(0, (2 z C)^2 I)

  Whatever the defense and the cohort, ``||Delta - N||`` is at most ``C``,
  so any two cohorts' outputs differ by at most ``2C`` before the noise:
  each round is a Gaussian mechanism with L2 sensitivity ``2C`` and noise
  multiplier ``z``, under every neighbouring relation (add/remove,
  replace-one, zero-out), and, the noise being added to a function of the
  sampled cohort, Poisson or uniform subsampling amplifies it as it does the
  sampled Gaussian mechanism (the Renyi divergence of the mixtures is at most
  that of the worst pair of cohorts). That is the guarantee: it does not
  improve with the cohort size, as the noisy mean of
  :func:`fedjx.algorithms.aggregators.gaussian` does (noise ``zC / D``),
  because a robust rule has no sensitivity ``C / D`` in general (one client
  moves a coordinate-wise median by a whole gap between order statistics;
  Krum's choice by ``2C``). For the mean of clipped updates (norm bounding)
  use ``gaussian``, which the accountant knows.

  ``fedjx.experiments`` accounts only for its DP aggregators
  (``experiments/privacy.py``): a run with ``dp_defense`` reports no
  epsilon, and a ``config.privacy.target_epsilon`` is refused. Stateful
  defenses are refused, the error naming what of theirs outlives a round
  (state, what of it the clients receive, per-client inputs):
  ``centered_clipping``'s center, for one, is the aggregate before the
  noise. So are aggregators with a ``clip_norm`` or ``noise_multiplier`` of
  their own (the DP aggregators: ``dp_defense`` adds both).

  Args:
    defense: the :class:`Aggregator` it clips and noises (a config's spec
      ``{'name': ..., **options}`` is built by the experiments layer).
    clip_norm: ``C`` (traced: ``state.hparams['clip_norm']``).
    noise_multiplier: ``z`` (traced: ``state.hparams['noise_multiplier']``).
  """
  fn = 'dp_defense'
  aggregators.check_dp_options(fn, noise_multiplier, None, clip_norm=clip_norm)
  inner = aggregators.check(fn, defense)
  cause = _state_kept(inner)
  if cause is not None:
    raise ValueError(f'{fn}: the defense {cause}; the guarantee of '
                     f'{fn} covers only the output it clips and noises, not '
                     'state kept between rounds; use a stateless defense '
                     '(median, trimmed_mean, krum, multi_krum, bulyan, '
                     'geometric_median, norm_bounding).')
  own = ('clip_norm', 'noise_multiplier')
  for name in own:
    if name in inner.hparams:
      raise ValueError(
          f'{fn}: the defense has a hyperparameter {name!r} of its own '
          f"(it clips or noises by itself), which dp_defense's {name} would "
          'replace; use a defense without DP of its own (dp_defense adds the '
          'clipping and the noise).')

  def encode(hparams, update, w):
    clipped, norm = aggregators.clip_update(update, hparams['clip_norm'])
    if inner.encode is None:
      return clipped, (norm, ())
    message, encoded = inner.encode(
        {k: v for k, v in hparams.items() if k not in own}, clipped, w)
    return message, (norm, encoded)

  def combine(state, hparams, clients, key):
    clip, z = hparams['clip_norm'], hparams['noise_multiplier']
    norms, encoded = clients.encoded
    inner_hp = {k: v for k, v in hparams.items() if k not in own}
    defense_key, noise_key = jax.random.split(key)
    out, state, metrics = inner.combine(state, inner_hp,
                                        clients._replace(encoded=encoded), defense_key)
    out, _ = aggregators.clip_update(out, clip)
    p = _participants(clients)
    count = jnp.maximum(fedjx.reduce_sum(p), 1.0)
    metrics = dict(metrics,
                   clipped_fraction=fedjx.reduce_sum(
                       p * (norms > clip).astype(jnp.float32)) / count,
                   noise_std=2.0 * z * clip)
    return aggregators.add_gaussian_noise(out, 2.0 * z * clip, noise_key), state, metrics

  return inner._replace(
      encode=encode, combine=combine,
      hparams={**inner.hparams, 'clip_norm': clip_norm,
               'noise_multiplier': noise_multiplier},
      traits=inner.traits._replace(
          checks_update=True,
          privacy=DP_DEFENSE._replace(noise_multiplier=noise_multiplier)))


median = coordinate_median  # The config name (``dict(name='median')``).

__all__ = ['bulyan', 'centered_clipping', 'coordinate_median', 'dp_defense',
           'geometric_median', 'krum', 'median', 'multi_krum',
           'norm_bounding', 'trimmed_mean']
