"""HypCluster: hypothesis-based clustering, one model per cluster of clients.

Mansour, Mohri, Ro, Suresh, "Three Approaches for Personalization with
Applications to Federated Learning", 2020 (arXiv:2002.10619), Algorithm 2
(FedJAX's ``fedjax/algorithms/hyp_cluster_lib.py``). The server keeps ``K``
models ``h_1 .. h_K``; a round on a cohort:

    broadcast h_1 .. h_K
    client i:  k_i = argmin_k  L_i(h_k)      (mean loss on its cohort data)
               y_i = ClientOpt^T(h_{k_i}; D_i),   Delta_i = h_{k_i} - y_i
    server:    for each k chosen by some client:
                 Delta_k = sum_{i: k_i = k} w_i Delta_i / sum_{i: k_i = k} w_i
                 h_k <- h_k + ServerOpt_k(-Delta_k)
               (a cluster no client chose keeps its model and optimizer state)

Each cluster has its own server optimizer state. The choice ``k_i`` is
recomputed every round from the client's data (ties go to the lowest
``k``), so clients keep no state. A client sends ``Delta_i`` in the row
``k_i`` of a ``[K, ...]`` update, zeros elsewhere, plus the one-hot of
``k_i``: one weighted mean of both gives every cluster's sum and weight.

:func:`kmeans_init` is FedJAX's k-means++-like start: train every client of
a cohort from one model, take a first client's model as a center, then
repeatedly the model of the client whose best loss over the centers so far
is the largest (the same client may be taken twice, as in FedJAX).

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): the server keeps ``K`` models and steps
each along its own clients' updates, where the template's server steps one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators

# What a round releases beside the aggregate (``Traits.unprivatized``).
UNPRIVATIZED = ('each cluster\'s update is divided by the exact weight of the '
                'clients that chose it, and which cluster each client chose is '
                'released, neither of which the noise covers')

def stack(models: Any) -> kit.Params:
  """``K`` models (a list or tuple of pytrees) as one pytree of ``[K, ...]`` leaves."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *models)


def cluster(cluster_params: kit.Params, k: jax.Array) -> kit.Params:
  """Model ``k`` of stacked cluster models."""
  return jax.tree.map(lambda x: x[k], cluster_params)


def cluster_losses(loss_fn: kit.LossFn, cluster_params: kit.Params,
                   batches: Any, mask: jax.Array) -> jax.Array:
  """One client's mean loss under each cluster model, float32 ``[K]``.

  Over the client's real examples (mask True); 0 for a client with none.
  """
  def one(params):
    sums = client_update.evaluate(loss_fn, None, params, batches, mask)
    return sums['loss'] / jnp.maximum(sums['count'], 1.0)
  return jax.vmap(one)(cluster_params)


def select(loss_fn: kit.LossFn, cluster_params: kit.Params, batches: Any,
           mask: jax.Array) -> jax.Array:
  """``argmin_k`` of :func:`cluster_losses` (int32; ties to the lowest ``k``)."""
  return jnp.argmin(cluster_losses(loss_fn, cluster_params, batches, mask)
                    ).astype(jnp.int32)


def personalize_fn(loss_fn: kit.LossFn) -> Callable[[Any, Any, Any], kit.Params]:
  """``personalize(server_state, client_state, train) -> params``.

  The cluster model with the lowest mean loss on the client's training
  split ``train = {'batches': {k: [S, B, ...]}, 'mask': [S, B]}``
  (:func:`select`); ``client_state`` is None (HypCluster keeps none).
  """
  def personalize(server_state, client_state, train):
    del client_state
    hs = server_state.extras
    k = select(loss_fn, hs, train['batches'], jnp.asarray(train['mask']))
    return cluster(hs, k)
  return personalize


def kmeans_init(loss_fn: kit.LossFn, params: kit.Params, cohort: Any,
                num_clusters: int, *,
                client_optimizer: optax.GradientTransformation | None = None,
                local_epochs: int = 1, local_steps: int | None = None,
                first: int | None = None,
                key: jax.Array | None = None) -> list[kit.Params]:
  """``num_clusters`` initial cluster models chosen among trained clients.

  Every client of ``cohort`` (with data) trains from ``params`` with
  ``client_optimizer`` (default SGD 0.1) for ``local_epochs`` /
  ``local_steps``; the first center is client ``first``'s model (an index
  into the cohort) or, if None, a client drawn uniformly with ``key``; each
  next center is the model of the client whose lowest mean loss over the
  centers so far is the largest (FedJAX's ``kmeans_init``).

  Returns:
    A list of ``num_clusters`` models (:func:`stack` makes them one tree).
  """
  fn = 'hyp_cluster.kmeans_init'
  kit.check_positive_int(fn, 'num_clusters', num_clusters)
  c = base.check_cohort(fn, cohort)
  optimizer = client_optimizer or kit.default_sgd(0.1)
  kit.check_optimizer(fn, 'client_optimizer', optimizer)
  schedule = client_update.check_schedule(fn, local_epochs, local_steps, False)
  has_data = jnp.asarray(cohort.num_examples) > 0
  if not bool(jnp.any(has_data)):
    raise ValueError(f'{fn}: cohort has no client with data '
                     f'(num_examples={cohort.num_examples}).')
  if first is None:
    if key is None:
      raise ValueError(f'{fn}: give first (a client index) or key (to draw one).')
    p = has_data / jnp.sum(has_data)
    first = int(jax.random.choice(key, c, p=p))
  elif isinstance(first, bool) or not isinstance(first, int) or not (
      0 <= first < c) or not bool(has_data[first]):
    raise ValueError(f'{fn}: first={first!r} must be the index of a client '
                     f'with data in the cohort of {c}.')

  def train(batches, mask):
    y, _, _, _ = client_update.train(loss_fn, optimizer, params,
                           optimizer.init(params), batches, mask,
                           schedule)
    return y

  trained = jax.jit(jax.vmap(train))(cohort.batches, cohort.mask)
  loss_of = jax.jit(jax.vmap(
      lambda h, b, m: cluster_losses(loss_fn, stack([h]), b, m)[0],
      in_axes=(None, 0, 0)))
  centers = [cluster(trained, first)]
  best = jnp.full((c,), jnp.inf, jnp.float32)
  for _ in range(1, num_clusters):
    best = jnp.minimum(best, loss_of(centers[-1], cohort.batches, cohort.mask))
    worst = jnp.argmax(jnp.where(has_data, best, -jnp.inf))
    centers.append(cluster(trained, worst))
  return centers


def _check_aggregator(fn: str, aggregator: Any) -> None:
  if isinstance(aggregator, (Mapping, aggregators.Aggregator)):
    kit.check_private_uploads(fn, aggregators.check(fn, aggregator),
                              UNPRIVATIZED)
  if aggregator is not None and not (isinstance(aggregator, str) and aggregator == 'mean') \
      and not (isinstance(aggregator, dict) and aggregator.get('name') == 'mean'):
    raise ValueError(
        f'{fn}: aggregator={aggregator!r} is not supported; each cluster\'s '
        'update is divided by the weight of the clients that chose it, which '
        'a robust aggregator does not bound: use the weighted mean (None).')


TRAITS = kit.Traits(options=kit.options_but('client_transform'),
                    unprivatized=UNPRIVATIZED)
"""What HypCluster declares: FedAvg's options but the client transform
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def hyp_cluster(loss_fn: kit.LossFn, num_clusters: int = 2, *,
                init_noise: float = 0.01, init_seed: int = 0,
                **options: Any) -> kit.Algorithm:
  """HypCluster (Mansour et al. 2020) with ``num_clusters`` cluster models.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses; it both
      chooses each client's cluster and trains it.
    num_clusters: ``K`` [2]. ``init`` takes a list or tuple of ``K`` models
      (e.g. from :func:`kmeans_init`), or one model: cluster 0 is that model
      and cluster ``k > 0`` that model plus Gaussian noise of standard
      deviation ``init_noise`` drawn from ``fold_in(key(init_seed), k)``
      (identical clusters would never separate: every tie goes to cluster 0).
    init_noise: that standard deviation, absolute [0.01]; 0 starts every
      cluster at the one model.
    init_seed: the noise's seed [0].
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``client_transform``;
      the server optimizer keeps a state per cluster (``state.opt_state``,
      leaves ``[K, ...]``); ``aggregator`` only the weighted mean (None).

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``params`` are the model
    of the cluster with the largest total weight in the last round (cluster
    0 before the first), what a central evaluation of one model reads, and
    whose ``extras`` are the ``K`` cluster models, every leaf ``[K, ...]``. Metrics add ``cluster_clients_<k>`` (clients
    that chose cluster ``k``) and, with ``client_metrics``, ``client_cluster``.
  """
  name = 'hyp_cluster'
  kit.check_positive_int(name, 'num_clusters', num_clusters)
  kit.check_number(name, 'init_noise', init_noise)
  if isinstance(init_seed, bool) or not isinstance(init_seed, int):
    raise ValueError(f'{name}: init_seed={init_seed!r} must be an int.')
  _check_aggregator(name, options.get('aggregator'))
  o = kit.Options.of(name, options, TRAITS.options)
  client_optimizer, server_optimizer = o.client_optimizer, o.server_optimizer
  schedule, metrics_fn, k_num = o.schedule, o.metrics_fn, num_clusters
  train = lambda x, hp, b, m: client_update.local_update(
      loss_fn, metrics_fn, client_optimizer, x,
      kit.with_hparams(client_optimizer.init(x), hp), b, m, schedule)

  def init(models):
    if isinstance(models, (list, tuple)):
      if len(models) != k_num:
        raise ValueError(f'{name}: init got {len(models)} models but '
                         f'num_clusters={k_num}.')
      stacked = stack(models)
    else:
      seed = jax.random.key(init_seed)
      leaves, treedef = jax.tree.flatten(models)
      def spread(i, x):  # Leaf i, cluster k: fold_in(fold_in(seed, i), k).
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
          return jnp.broadcast_to(x, (k_num,) + x.shape)
        noise = [jnp.zeros_like(x)] + [
            init_noise * jax.random.normal(
                jax.random.fold_in(jax.random.fold_in(seed, i), k), x.shape, x.dtype)
            for k in range(1, k_num)]
        return x + jnp.stack(noise)
      stacked = jax.tree.unflatten(
          treedef, [spread(i, x) for i, x in enumerate(leaves)])
    one = cluster(stacked, 0)
    return kit.ServerState(
        params=one, opt_state=jax.vmap(server_optimizer.init)(stacked),
        hparams=base.combine_hparams(name, algorithm={
            'client_optimizer': base.optimizer_hparams(client_optimizer, one),
            'server_optimizer': base.optimizer_hparams(server_optimizer, one)}),
        round_index=jnp.zeros((), jnp.int32), extras=stacked)

  def client_fn(hs, hparams, batches, mask):
    k = select(loss_fn, hs, batches, mask)
    x = cluster(hs, k)
    out = train(x, hparams, batches, mask)
    onehot = jax.nn.one_hot(k, k_num, dtype=jnp.float32)
    delta = base.tree_sub(x, out.params)
    rows = jax.tree.map(
        lambda d: onehot.reshape((k_num,) + (1,) * d.ndim).astype(d.dtype) * d,
        delta)
    has_data = jnp.any(mask).astype(jnp.float32)
    extra = {'cluster_clients': onehot * has_data}
    if o.client_metrics:
      extra.update(base.client_metrics(delta, out), client_cluster=k)
    return nonfinite.ClientOutput({'delta': rows, 'weight': onehot}, out.stats,
                            extra=extra, checked=out.params)

  def round_fn(state, cohort, key):
    del key
    clients = nonfinite.map_clients(
        client_fn, (fedjx.broadcast(state.extras),
                    fedjx.broadcast(state.hparams['client_optimizer']),
                    cohort.batches, cohort.mask),
        base.aggregation_weights(cohort.num_examples, o.weighting),
        cohort.num_examples, o.skip_nonfinite)
    mean = nonfinite.weighted_mean(clients)  # Both divided by sum_i w_i.
    weight = mean['weight']                  # [K]: sum_{k_i = k} w_i / sum_i w_i
    chosen = weight > 0
    safe = jnp.where(chosen, weight, 1.0)
    deltas = jax.tree.map(
        lambda s: s / safe.reshape((k_num,) + (1,) * (s.ndim - 1)).astype(s.dtype),
        mean['delta'])
    hp = state.hparams['server_optimizer']
    new_params, new_opt = jax.vmap(
        lambda s, p, g: base.server_update(server_optimizer, s, hp, p, g))(
            state.opt_state, state.extras, deltas)
    keep = lambda new, old: jnp.where(
        chosen.reshape((k_num,) + (1,) * (jnp.ndim(old) - 1)), new, old)
    cluster_params = jax.tree.map(keep, new_params, state.extras)
    opt_state = jax.tree.map(keep, new_opt, state.opt_state)
    top = jnp.argmax(weight)
    params = jax.tree.map(lambda new, old: jnp.where(jnp.any(chosen), new, old),
                          cluster(cluster_params, top), state.params)
    extra = dict(clients.extra)
    counts = fedjx.reduce_sum(extra.pop('cluster_clients'))
    per_cluster = {f'cluster_clients_{k}': counts[k] for k in range(k_num)}
    pseudo_grad_norm = optax.tree.norm(
        jax.tree.map(lambda d: d * weight.reshape(
            (k_num,) + (1,) * (d.ndim - 1)).astype(d.dtype), deltas))
    metrics = nonfinite.round_metrics(clients, pseudo_grad_norm=pseudo_grad_norm,
                                **per_cluster)
    metrics.update(extra)  # Per-client [C] metrics, if asked.
    return state._replace(params=params, extras=cluster_params,
                          opt_state=opt_state,
                          round_index=state.round_index + 1), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)


__all__ = ['cluster', 'cluster_losses', 'hyp_cluster',
           'kmeans_init', 'personalize_fn', 'select', 'stack']
