"""Federated LoRA: clients train low-rank adapters, the server aggregates them by a rule.

Each client ``k`` of the cohort receives the global adapters ``(a, b)`` of
every adapted matrix (:mod:`fedjx.models.lora`; ``W + s a b``, rank
``r_max``), cut to its own rank ``r_k`` (the first ``r_k`` columns of ``a``
and rows of ``b``; zero beyond, and zero stays zero under training, since
the gradient of a zero column of ``a`` is ``s x^T g b_j = 0`` when row ``j``
of ``b`` is zero too), trains them on its data with the client optimizer
(the frozen base and, for FLoRA, the merged deltas ``M`` fixed), and sends
its adapters. The server aggregates by a rule of
:mod:`fedjx.algorithms.aggregators.lora`::

  w_k        = rule.client_weight(client adapters, n_k)
  (S_k, A_k) = rule.client_message(client adapters, global adapters, k, C)
  S = sum_k S_k,   A = sum_k w_k A_k / sum_k w_k            (fedjx reductions)
  (a, b), dM = rule.server_update(global adapters, S, A)
  M <- M + dM                                              (FLoRA merges here)

FedIT, FFA-LoRA, FlexLoRA, FLoRA and HetLoRA are rules; FedIT and FFA-LoRA
are also plain FedAvg/FedOpt on the adapter tree (a
:class:`~fedjx.models.lora.LoraModel` with ``train_a`` True or False), which
is how configs run them, with every aggregator (DP, compression, secure
sums) applying to the adapters. This algorithm runs the rules that are not
a weighted mean of the adapters (FlexLoRA's SVD of the mean product, FLoRA's
stacking, HetLoRA's norm weights); their messages are not adapter deltas, so
it takes no aggregator: a DP or compressed variant of them is not defined
by their papers, and is refused (``aggregator=``).

Heterogeneous ranks (``client_ranks``): client ``i`` of the population has
rank ``client_ranks[i mod len(client_ranks)]`` (FLoRA and HetLoRA's
setting; FlexLoRA's "client resources"). The new global adapters replace the
old ones (no server optimizer: the rules define the new model, not a step).

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): each rule combines the clients'
adapter pairs itself (a product, a stack, a truncation by rank), where the
template's server steps along an aggregator's combination of the updates.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import lora as lora_aggregation
from fedjx.models import adapters as trees
from fedjx.models.lora_config import LoraConfig


TRAITS = kit.Traits(options=kit.options_but(
    'server_optimizer', 'aggregator', 'weighting', 'client_transform'))
"""What federated LoRA declares: FedAvg's options but those its rules
replace (the server optimizer, the aggregator, the weighting: each rule
has its own) and the client transform
(:class:`~fedjx.algorithms.traits.Traits`)."""


def _ranks(fn: str, client_ranks: Any, r_max: int) -> tuple[int, ...]:
  if client_ranks is None:
    return (r_max,)
  if (not isinstance(client_ranks, Sequence) or not client_ranks or
      any(isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= r_max
          for r in client_ranks)):
    raise ValueError(f'{fn}: client_ranks={client_ranks!r} must be a non-empty sequence of '
                     f'integers in [1, {r_max}] (the adapters\' rank).')
  return tuple(client_ranks)


RULES = {'flexlora': lora_aggregation.flexlora, 'flora': lora_aggregation.flora,
         'hetlora': lora_aggregation.hetlora, 'fedit': lora_aggregation.fedit}


@kit.declare(TRAITS)
def fedlora(loss_fn: kit.LossFn, *, lora_config: LoraConfig | None = None,
            rule: str | lora_aggregation.LoraAggregation = 'flexlora',
            client_ranks: Sequence[int] | None = None, aggregator: Any = None,
            self_prune: float | None = None, prune_strength: float = 0.0,
            **options: Any) -> kit.Algorithm:
  """Federated LoRA with the aggregation ``rule``.

  Args:
    loss_fn: a :class:`~fedjx.models.lora.LoraModel`'s ``loss_fn``; the
      algorithm's params are its adapters (and FLoRA's merged deltas).
    lora_config: the model's :class:`~fedjx.models.lora_config.LoraConfig`
      (``train_a=True``: the rules read both factors); the runner passes it.
    rule: ``'flexlora'``, ``'flora'``, ``'hetlora'``, ``'fedit'`` or a
      :class:`~fedjx.algorithms.aggregators.lora.LoraAggregation`.
    client_ranks: the ranks ``r_k`` by population index (cycled); None:
      every client has the adapters' rank.
    aggregator: must be None (see the module docstring).
    self_prune: HetLoRA's rank self-pruning with decay ``gamma`` in (0, 1)
      (:func:`fedjx.algorithms.aggregators.lora.self_prune`, our reading of
      the paper): each client keeps its rank between rounds (client state,
      ``0`` until it first takes part: then its ``client_ranks`` rank), and
      after local training prunes it to ``max(1, floor(gamma r))`` when the
      tail score of its trained adapters is below that of those it
      received; it sends its adapters cut to the new rank. None: ranks stay.
    prune_strength: ``lambda >= 0``, the weight of the tail score added to
      the local loss while pruning is on (``loss + lambda T(a, b)``).
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``server_optimizer``,
      ``aggregator``, ``weighting`` and ``client_transform``:
      ``client_optimizer`` is the local optimizer of the adapters (default
      SGD 0.1).

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``params`` are the global
    adapters (the :class:`~fedjx.models.lora.LoraModel`'s trainable tree)
    and, under FLoRA, the merged deltas ``M`` (leaves ``kernel_lora_merged``
    beside the kernels, zero at first); no server optimizer state.
  """
  name = 'fedlora'
  if not isinstance(lora_config, LoraConfig):
    raise ValueError(f'{name}: lora_config={lora_config!r} must be the model\'s '
                     'fedjx.models.lora_config.LoraConfig (the runner passes config.lora\'s).')
  if not lora_config.train_a:
    raise ValueError(f'{name}: lora_config.train_a=False; FFA-LoRA is FedAvg on b '
                     '(fedjx.algorithms.fedavg on the LoraModel).')
  if isinstance(rule, str):
    if rule not in RULES:
      raise ValueError(f'{name}: rule={rule!r} is not one of {", ".join(RULES)} '
                       '(FFA-LoRA is fedavg with lora.train_a=False).')
    rule = RULES[rule]()
  if not isinstance(rule, lora_aggregation.LoraAggregation):
    raise ValueError(f'{name}: rule={rule!r} must be a name or a LoraAggregation '
                     '(fedjx.algorithms.aggregators.lora).')
  if aggregator is not None:
    raise ValueError(f'{name}: aggregator={aggregator!r}: the {rule.name} rule combines '
                     'adapters itself; DP, compression and secure sums apply to FedIT and '
                     'FFA-LoRA (fedavg on the LoraModel).')
  o = kit.Options.of(name, options, TRAITS.options)
  client_optimizer, schedule = o.client_optimizer, o.schedule
  r_max, scale = lora_config.rank, lora_config.scale
  ranks = jnp.asarray(_ranks(name, client_ranks, r_max), jnp.int32)
  merges = rule.name == 'flora'
  if merges and lora_config.base_dtype == 'int8':
    raise ValueError(f'{name}: the {rule.name} rule merges into the base, which is int8 '
                     '(lora.base_dtype); use float32 or bfloat16.')
  metrics_fn = o.metrics_fn
  if self_prune is not None:
    if isinstance(self_prune, bool) or not isinstance(self_prune, (int, float)) or not (
        0 < self_prune < 1):
      raise ValueError(f'{name}: self_prune={self_prune!r} must be None or a decay in (0, 1).')
  kit.check_number(name, 'prune_strength', prune_strength)
  if prune_strength and self_prune is None:
    raise ValueError(f'{name}: prune_strength={prune_strength!r} needs self_prune (a decay).')
  pruning = self_prune is not None

  def init(adapters):
    params = adapters
    if merges:
      params = trees.join(adapters, trees.merged_tree(
          {n: jnp.zeros(p['a'].shape[:-1] + p['b'].shape[-1:], p['a'].dtype)
           for n, p in trees.adapter_pairs(adapters).items()}))
    return kit.ServerState(
        params=params, opt_state=(),
        hparams={'client_optimizer': base.optimizer_hparams(client_optimizer, adapters)},
        round_index=jnp.zeros((), jnp.int32))

  def client_fn(num_clients, adapters, merged, hparams, index, client_id, n_k, stored,
                batches, mask):
    rank = ranks[client_id % ranks.shape[0]]
    if pruning:  # 0 until the client first takes part.
      rank = jnp.where(stored > 0, stored, rank)
    global_pairs = trees.adapter_pairs(adapters)
    received = lora_aggregation.truncate(global_pairs, rank)
    start = trees.from_pairs(received)

    def local_loss(p, batch):
      loss = loss_fn(trees.join(p, merged), batch)
      if pruning and prune_strength:
        tail = lora_aggregation.tail_norm(trees.adapter_pairs(p), rank, decay=self_prune)
        loss = loss + prune_strength * tail
      return loss

    local_metrics = None if metrics_fn is None else (
        lambda p, batch: metrics_fn(trees.join(p, merged), batch))
    opt_state = kit.with_hparams(client_optimizer.init(start), hparams)
    out = client_update.local_update(local_loss, local_metrics, client_optimizer, start,
                           opt_state, batches, mask, schedule)
    trained = trees.adapter_pairs(out.params)
    new_rank = rank
    if pruning:
      threshold = lora_aggregation.tail_norm(received, rank, decay=self_prune)
      new_rank = lora_aggregation.self_prune(trained, rank, decay=self_prune,
                                             threshold=threshold)
      trained = lora_aggregation.truncate(trained, new_rank)
    w = rule.client_weight(trained, n_k, scale)
    summed, averaged = rule.client_message(trained, global_pairs, index, num_clients, scale)
    weighted = jax.tree.map(lambda v: w * v, averaged)
    delta = base.tree_sub(start, out.params)
    extra = (summed, weighted, w, new_rank.astype(jnp.float32))
    if o.client_metrics:
      extra = extra + (base.client_metrics(delta, out),)
    return nonfinite.ClientOutput(delta, out.stats, extra=extra, checked=out.params,
                            state=new_rank if pruning else (),
                            previous_state=stored if pruning else ())

  def round_fn(state, cohort, key):
    num_clients = int(cohort.mask.shape[0])
    adapters, merged = trees.split_merged(state.params)
    stored = cohort.client_states if pruning else jnp.zeros((num_clients,), jnp.int32)
    clients = nonfinite.map_clients(
        functools.partial(client_fn, num_clients),
        (fedjx.broadcast(adapters), fedjx.broadcast(merged),
         fedjx.broadcast(state.hparams['client_optimizer']),
         jnp.arange(num_clients, dtype=jnp.int32), cohort.client_ids,
         cohort.num_examples, stored, cohort.batches, cohort.mask),
        jnp.ones_like(cohort.num_examples, jnp.float32), cohort.num_examples,
        o.skip_nonfinite)
    summed, weighted, w, client_rank = clients.extra[:4]
    summed, weighted, total = fedjx.reduce_sum((summed, weighted, w))
    averaged = jax.tree.map(lambda v: v / jnp.maximum(total, 1e-30), weighted)
    result = rule.server_update(trees.adapter_pairs(adapters), summed, averaged, r_max,
                                scale, key)
    new = trees.from_pairs(result.adapters)
    if merges:
      old = trees.merged_pairs(merged)
      new = trees.join(new, trees.merged_tree(
          {n: old[n] + result.merged[n].astype(old[n].dtype) for n in old}))
    has_data = (cohort.num_examples > 0).astype(jnp.float32)
    mean_rank = fedjx.reduce_sum(client_rank * has_data) / jnp.maximum(
        fedjx.reduce_sum(has_data), 1.0)
    metrics = nonfinite.round_metrics(
        clients, adapter_norm=optax.tree.norm(trees.from_pairs(result.adapters)),
        adapter_bytes_per_client=jnp.float32(trees.adapter_bytes(adapters)),
        mean_client_rank=mean_rank)
    if o.client_metrics:
      metrics.update(clients.extra[4])
    state = state._replace(params=new, round_index=state.round_index + 1)
    if pruning:
      return state, metrics, clients.state
    return state, metrics

  return kit.make_algorithm(
      name, init, round_fn, loss_fn=loss_fn, metrics_fn=metrics_fn,
      client_state_init=(lambda params: jnp.zeros((), jnp.int32)) if pruning else None,
      traits=TRAITS)


__all__ = ['fedlora']
