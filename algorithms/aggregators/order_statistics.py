"""Robust aggregators that read every update at once: order statistics and Krum.

Defenses against Byzantine clients (clients that send arbitrary updates):

| aggregator | server combine, over the participating clients ``P`` (``m = |P|``) |
|---|---|
| :func:`coordinate_median` | ``Delta_j = median_{i in P} Delta_ij`` for each coordinate ``j`` |
| :func:`trimmed_mean` | per coordinate, the mean after dropping the ``k = floor(beta m)`` largest and smallest |
| :func:`krum` | ``Delta_{i*}``, ``i* = argmin_i sum_{j in N_i} ||Delta_i - Delta_j||^2`` |
| :func:`multi_krum` | the mean of the ``num_selected`` updates of lowest Krum score |
| :func:`bulyan` | Krum picked ``m - 2f`` times, then per coordinate the mean of the ``m - 4f`` values closest to their median |

Each needs all ``m`` updates at the same time (a sort over the cohort per
coordinate, or the ``m x m`` distances), so its ``combine`` stacks the
clients' messages on the server with :func:`fedjx.plan.gather_to_server`
(``Traits.needs_all_updates`` says why): it costs the memory of the
stacked updates (``C`` times the model; a copy XLA elides where the updates
are already stacked, as under ``vmap``), Beam runs it (a ``collect``), and
the streaming executor refuses it in one line.

Votes: padding clients (``num_examples == 0``) and clients the non-finite
guard skipped (their ``num_examples`` is zeroed) are never among ``P``. The
rules' papers weigh every participating client alike (their analyses assume
i.i.d. workers), so no rule here uses example counts: the algorithm's
``weighting`` does not change them. The bounds on ``f`` (Krum's
``n > 2f + 2``, Bulyan's ``n >= 4f + 3``) are checked against the cohort size
when the round is traced; when padding or skipped clients leave fewer
participants than the bound, the round still runs (Krum's neighbour count is
at least 1, as in Flower's ``aggregate_krum``) and the metric
``robust_bound_violated`` is 1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjx import plan as plan_lib
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import base
from fedjx.algorithms.traits import Traits

VIOLATED = 'robust_bound_violated'


# ------------------------------------------------------------ shared pieces

def stacked(name: str, why: str, clients: Any) -> tuple[Any, jax.Array]:
  """The messages ``[C, ...]`` and the participation flags ``[C]``, on the server.

  A client participates when its ``num_examples`` is positive (not padding,
  not skipped by the non-finite guard).
  """
  update, n = plan_lib.gather_to_server(
      (clients.update, clients.num_examples),
      f'the aggregator {name!r} needs every client update at once ({why})')
  return update, n > 0


def _expand(p: jax.Array, x: jax.Array) -> jax.Array:
  return p.reshape(p.shape + (1,) * (x.ndim - 1))


def _sorted(x: jax.Array, p: jax.Array) -> jax.Array:
  """Each coordinate's participating values in increasing order (then +inf)."""
  return jnp.sort(jnp.where(_expand(p, x), x, jnp.inf), axis=0)


def _take(s: jax.Array, index: jax.Array) -> jax.Array:
  return jax.lax.dynamic_index_in_dim(s, jnp.clip(index, 0, s.shape[0] - 1),
                                      axis=0, keepdims=False)


def median_of(x: jax.Array, p: jax.Array) -> jax.Array:
  """The coordinate-wise median of ``x[i]`` over ``p[i]`` (0 if none).

  The middle value of ``m`` sorted values, or the mean of the two middle
  ones for even ``m``.
  """
  m = jnp.sum(p.astype(jnp.int32))
  s = _sorted(x, p)
  med = 0.5 * (_take(s, (m - 1) // 2) + _take(s, m // 2))
  return jnp.where(m > 0, med, jnp.zeros_like(med))


def _masked_mean(x: jax.Array, keep: jax.Array, count: jax.Array) -> jax.Array:
  total = jnp.sum(jnp.where(keep, x, jnp.zeros_like(x)), axis=0)
  return jnp.where(count > 0, total / jnp.maximum(count, 1).astype(x.dtype),
                   jnp.zeros_like(total))


def closest_mean(reference: Any, values: Any, beta: Any,
                 participants: jax.Array | None = None) -> Any:
  """Per coordinate, the mean of the ``beta`` values closest to ``reference``.

  ``values`` has leaves ``[C, ...]`` matching ``reference``'s; only the
  clients with ``participants`` (default all) count. Bulyan's last step
  (El Mhamdi et al. 2018, Algorithm 1: ``beta = theta - 2f`` values closest to
  the median); ``beta`` may be traced, and must be at least 1 and at most
  the number of participants.
  """
  c = jax.tree.leaves(values)[0].shape[0]
  p = jnp.ones((c,), bool) if participants is None else participants
  ranks = jnp.arange(c)

  def one(ref, x):
    gap = jnp.where(_expand(p, x), jnp.abs(x - ref[None]), jnp.inf)
    order = jnp.argsort(gap, axis=0)
    nearest = jnp.take_along_axis(x, order, axis=0)
    keep = _expand(ranks < beta, x)
    return _masked_mean(nearest, keep, beta)

  return jax.tree.map(one, reference, values)


def squared_distances(x: Any) -> jax.Array:
  """``D_ij = ||x_i - x_j||^2`` over all leaves (``[C, C]``, exactly symmetric).

  Computed one row at a time from the differences (``O(C d)`` memory, no
  cancellation as in ``||x_i||^2 + ||x_j||^2 - 2 x_i . x_j``).
  """
  leaves = [l.reshape(l.shape[0], -1) for l in jax.tree.leaves(x)]

  def row(i):
    return sum(jnp.sum(jnp.square(l - l[i]), axis=1) for l in leaves)

  return jax.lax.map(row, jnp.arange(leaves[0].shape[0]))


def krum_scores(d: jax.Array, candidates: jax.Array, f: int) -> jax.Array:
  """Krum's score of each candidate, ``+inf`` for the others.

  ``s(i) = sum_{j in N_i} D_ij`` with ``N_i`` the ``max(r - f - 2, 1)``
  candidates ``j != i`` closest to ``i`` (``r`` candidates; at most
  ``r - 1``) (Blanchard et al. 2017, section 4).
  """
  c = d.shape[0]
  r = jnp.sum(candidates.astype(jnp.int32))
  k = jnp.minimum(jnp.maximum(r - f - 2, 1), r - 1)
  others = candidates[None, :] & ~jnp.eye(c, dtype=bool)
  s = jnp.sort(jnp.where(others, d, jnp.inf), axis=1)
  near = jnp.arange(c)[None, :] < k
  score = jnp.sum(jnp.where(near, s, 0.0), axis=1)
  return jnp.where(candidates, score, jnp.inf)


def _selected_mean(x: Any, selected: jax.Array) -> Any:
  count = jnp.sum(selected.astype(jnp.float32))
  return jax.tree.map(lambda l: _masked_mean(l, _expand(selected, l), count), x)


def _check_f(fn: str, num_byzantine: Any) -> None:
  if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, int) or (
      num_byzantine < 0):
    raise ValueError(f'{fn}: num_byzantine={num_byzantine!r} must be an int >= 0.')


def _check_cohort(fn: str, num_byzantine: int, cohort: int, bound: int,
                  rule: str) -> None:
  if cohort < bound:
    raise ValueError(
        f'{fn}: num_byzantine={num_byzantine} needs a cohort of at least '
        f'{rule} = {bound} clients; this round\'s cohort has {cohort} (use a '
        'larger cohort_size or a smaller num_byzantine).')


def _stateless(params: base.Params) -> tuple[()]:
  del params
  return ()


def _uniform(num_examples: jax.Array) -> jax.Array:
  return base.aggregation_weights(num_examples, 'uniform')


def _aggregator(combine, why: str) -> aggregators.Aggregator:
  return aggregators.Aggregator(init=_stateless, combine=combine,
                                weights=_uniform,
                                traits=Traits(needs_all_updates=why))


# ---------------------------------------------------------------- the rules

_MEDIAN_WHY = 'a coordinate-wise order statistic over the cohort'


def coordinate_median() -> aggregators.Aggregator:
  """The coordinate-wise median of the participants' updates.

  Yin, Chen, Kannan, Bartlett, "Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates", ICML 2018, Option I:
  ``Delta_j = med{Delta_ij : i in P}`` (for even ``m``, the mean of the two
  middle values). Unweighted, as in the paper. Metrics: ``median_clients``
  (``m``, the participants voting). Memory: the stacked updates and one
  sorted copy.
  """
  name = 'median'

  def combine(state, hparams, clients, key):
    del hparams, key
    x, p = stacked(name, _MEDIAN_WHY, clients)
    out = jax.tree.map(lambda l: median_of(l, p), x)
    return out, state, {'median_clients': jnp.sum(p.astype(jnp.float32))}

  return _aggregator(combine, _MEDIAN_WHY)


def trimmed_mean(beta: float = 0.1) -> aggregators.Aggregator:
  """The coordinate-wise ``beta``-trimmed mean of the participants' updates.

  Yin et al. 2018, Option II: per coordinate, drop the ``k = floor(beta m)``
  largest and the ``k`` smallest of the ``m`` values and average the other
  ``m - 2k``. ``0 <= beta < 1/2`` (``beta = 0`` is the unweighted mean);
  unweighted, as in the paper. Metrics: ``trimmed_clients`` (``2k``, values
  dropped per coordinate).
  """
  fn = name = 'trimmed_mean'
  base.check_number(fn, 'beta', beta)
  if float(beta) >= 0.5:
    raise ValueError(f'{fn}: beta={beta!r} is not allowed; it must be a finite '
                     'number >= 0 and < 0.5 (a fraction trimmed from each end).')
  beta = float(beta)

  def combine(state, hparams, clients, key):
    del hparams, key
    x, p = stacked(name, _MEDIAN_WHY, clients)
    m = jnp.sum(p.astype(jnp.int32))
    k = jnp.floor(beta * m.astype(jnp.float32)).astype(jnp.int32)
    ranks = jnp.arange(p.shape[0])
    kept = (ranks >= k) & (ranks < m - k)

    def one(l):
      return _masked_mean(_sorted(l, p), _expand(kept, l), m - 2 * k)

    return jax.tree.map(one, x), state, {
        'trimmed_clients': (2 * k).astype(jnp.float32)}

  return _aggregator(combine, _MEDIAN_WHY)


_KRUM_WHY = 'the distances between all pairs of updates'


def _krum_combine(fn: str, f: int, num_selected: int | None):
  """Krum (``num_selected=None``) or Multi-Krum's combine."""

  def combine(state, hparams, clients, key):
    del hparams, key
    x, p = stacked(fn, _KRUM_WHY, clients)
    c = p.shape[0]
    _check_cohort(fn, f, c, 2 * f + 3, '2 * num_byzantine + 3')
    if num_selected is not None and num_selected > c:
      raise ValueError(f'{fn}: num_selected={num_selected} exceeds this '
                       f'round\'s cohort of {c} clients.')
    m = jnp.sum(p.astype(jnp.int32))
    scores = krum_scores(squared_distances(x), p, f)
    rank = jnp.argsort(jnp.argsort(scores))  # 0 for the lowest score
    keep = 1 if num_selected is None else num_selected
    selected = (rank < keep) & p
    metrics = {VIOLATED: (m < 2 * f + 3).astype(jnp.float32)}
    if num_selected is None:
      metrics['krum_selected'] = jnp.argmin(scores).astype(jnp.float32)
      metrics['krum_score'] = jnp.min(jnp.where(p, scores, jnp.inf))
    else:
      metrics['krum_selected_clients'] = jnp.sum(selected.astype(jnp.float32))
    return _selected_mean(x, selected), state, metrics

  return combine


def krum(num_byzantine: int = 1) -> aggregators.Aggregator:
  """The update of lowest Krum score.

  Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017, section
  4: with ``f = num_byzantine``, each participant's score is the sum of its
  squared distances to its ``m - f - 2`` nearest other participants, and the
  aggregate is the update of lowest score (unweighted). The paper needs
  ``n > 2f + 2``: checked against the cohort size when the round is traced.
  Metrics: ``krum_selected`` (the chosen client's position in the cohort),
  ``krum_score``, ``robust_bound_violated``. Memory: the stacked updates
  and the ``C x C`` distances (``O(C^2 d)`` work).
  """
  fn = 'krum'
  _check_f(fn, num_byzantine)
  return _aggregator(_krum_combine(fn, num_byzantine, None), _KRUM_WHY)


def multi_krum(num_byzantine: int = 1, num_selected: int = 1) -> aggregators.Aggregator:
  """The mean of the ``num_selected`` updates of lowest Krum score.

  Blanchard et al. 2017, section 5 (Multi-Krum): the scores of
  :func:`krum`; the aggregate is the unweighted mean of the
  ``num_selected`` participants with the lowest (fewer if fewer
  participate). ``num_selected=1`` is Krum; ``num_selected = n`` the mean.
  Metrics: ``krum_selected_clients``, ``robust_bound_violated``.
  """
  fn = 'multi_krum'
  _check_f(fn, num_byzantine)
  base.check_positive_int(fn, 'num_selected', num_selected)
  return _aggregator(_krum_combine(fn, num_byzantine, num_selected), _KRUM_WHY)


_BULYAN_WHY = 'repeated Krum selections and coordinate-wise order statistics'


def bulyan(num_byzantine: int = 1) -> aggregators.Aggregator:
  """Bulyan over Krum.

  El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed
  Learning in Byzantium", ICML 2018, Algorithm 1, with ``f = num_byzantine``
  and ``m`` participants:

      S = {}; repeat theta = m - 2f times: i = Krum(remaining); S += {i}
      beta = theta - 2f
      Delta_j = mean of the beta values Delta_ij (i in S) closest to
                median_{i in S} Delta_ij

  Each Krum runs on the remaining participants (``r - f - 2`` neighbours, at
  least 1, as Flower's ``aggregate_bulyan``). Unweighted. The paper needs
  ``n >= 4f + 3``: checked against the cohort size when the round is traced.
  Metrics: ``bulyan_selected_clients`` (``theta``), ``robust_bound_violated``.
  Memory: the stacked updates and the ``C x C`` distances; ``O(theta C^2 log C)``
  work for the selections.
  """
  fn = name = 'bulyan'
  _check_f(fn, num_byzantine)
  f = num_byzantine

  def combine(state, hparams, clients, key):
    del hparams, key
    x, p = stacked(name, _BULYAN_WHY, clients)
    c = p.shape[0]
    _check_cohort(fn, f, c, 4 * f + 3, '4 * num_byzantine + 3')
    m = jnp.sum(p.astype(jnp.int32))
    theta = jnp.maximum(m - 2 * f, 1)
    d = squared_distances(x)

    def pick(t, carry):
      remaining, chosen = carry
      i = jnp.argmin(krum_scores(d, remaining, f))
      take = jax.nn.one_hot(i, c, dtype=bool) & remaining & (t < theta)
      return remaining & ~take, chosen | take

    _, chosen = jax.lax.fori_loop(0, c, pick, (p, jnp.zeros((c,), bool)))
    beta = jnp.maximum(theta - 2 * f, 1)
    reference = jax.tree.map(lambda l: median_of(l, chosen), x)
    out = closest_mean(reference, x, beta, chosen)
    return out, state, {
        'bulyan_selected_clients': jnp.sum(chosen.astype(jnp.float32)),
        VIOLATED: (m < 4 * f + 3).astype(jnp.float32)}

  return _aggregator(combine, _BULYAN_WHY)


__all__ = ['bulyan', 'closest_mean', 'coordinate_median', 'krum', 'krum_scores',
           'median_of', 'multi_krum', 'squared_distances', 'stacked',
           'trimmed_mean']
