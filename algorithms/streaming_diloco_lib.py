"""Streaming DiLoCo: DiLoCo that synchronises one fragment at a time.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", 2025 (arXiv 2501.18512), Algorithm 1. The parameters
are split into ``P`` fragments ``theta = (theta^1, ..., theta^P)``. Replicas
never reset to the global model as a whole: each keeps training its own
``theta_k``, and fragment ``p`` is synchronised on its own staggered
schedule:

    every round (S inner steps on each replica, inner state kept):
        theta_k <- InnerOpt^S(theta_k)
    then for the one fragment p = round mod P:
        Delta^p = sum_k w_k Q(theta^p - theta_k^p) / sum_k w_k   (quantized)
        theta^p <- OuterOpt^p(theta^p, Delta^p)
        theta_k^p <- alpha theta_k^p + (1 - alpha) theta^p       (merge)

So each fragment is synchronised every ``H = P S`` inner steps, fragment
``p`` offset by ``p S`` steps from fragment 0, and each round sends one
fragment, a ``1/P`` share of the bytes DiLoCo sends every ``H`` steps. Outer
gradients are quantized (``Q``: bfloat16, int8, int4 or e3m0, see
:mod:`fedjx.algorithms.compression.quantization`) before the reduction, which runs in
float32; ``communicated_bytes`` reports what replicas send per round.
Each fragment has its own outer optimizer state (Nesterov SGD, learning rate
0.7, momentum 0.9 by default). ``alpha`` (``mixing_factor``) is 0 by default:
replicas take the new global fragment.

Fragments are groups of parameter leaves: ``'strided'`` puts leaf ``i`` (in
``jax.tree.leaves`` order) in fragment ``i mod P`` (the paper's strided
pattern over layers), ``'sequential'`` makes ``P`` consecutive groups of about
equal size.

Overlapping communication with computation (the paper's ``tau``,
``overlap_steps``, ``0 <= tau <= S``): fragment ``p``'s outer gradient is
sent at the end of round ``r`` (inner step ``t``), the server's outer step
on it is taken then, and the replicas keep training while it is in flight;
the new global fragment reaches them ``tau`` inner steps later, at step
``t + tau``, and is merged into each replica's *current* fragment:

    round r + 1 (S inner steps, q = r mod P the fragment sent in round r):
        theta_k <- InnerOpt^tau(theta_k)
        theta_k^q <- alpha theta_k^q(t + tau) + (1 - alpha) theta^q   (merge)
        theta_k <- InnerOpt^(S - tau)(theta_k)
    then the outer step on fragment p = (r + 1) mod P as above, without its
    merge, which waits tau steps into round r + 2.

``tau = 0`` merges at once, at the end of the round (the schedule above,
and exactly the computation without the option). With ``tau = S`` the merge
falls after the next round's ``S`` steps, just before that round's outer
gradient is taken. Nothing extra is stored: the fragment in flight is the one
sent in the previous round (``(round_index - 1) mod P``, none in round 0)
and its global value is ``params``' (no other outer step touches it in the
meantime, as ``tau <= S``). After the last round, ``params`` holds every
outer step, the last round's fragment included (the server applied it);
only the replicas' merge of that fragment is pending, so the replicas'
models (``state.extras``) do not include it (the next round would merge it).

With ``P = 1``, ``alpha = 0``, ``tau = 0`` and float32, Streaming DiLoCo is
DiLoCo.

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): each round synchronises one fragment of
the model, from replicas that keep their own models between rounds, where
the template's server steps the whole model that every client starts from.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
import fedjx.indexed
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.diloco_lib import OPTIONS as DILOCO_OPTIONS
from fedjx.algorithms.diloco_lib import check_aggregator
from fedjx.algorithms.diloco_lib import check_options
from fedjx.algorithms.compression import quantization

FRAGMENT_PATTERNS = ('strided', 'sequential')


def fragment_leaves(params: kit.Params, num_fragments: int,
                    pattern: str) -> tuple[tuple[int, ...], ...]:
  """Leaf indices (``jax.tree.leaves`` order) of each of the ``P`` fragments."""
  sizes = [max(1, int(jnp.size(x))) for x in jax.tree.leaves(params)]
  n = len(sizes)
  if num_fragments > n:
    raise ValueError(f'streaming_diloco: num_fragments={num_fragments} exceeds '
                     f'the {n} parameter arrays of params; every fragment needs '
                     'at least one.')
  if pattern == 'strided':
    return tuple(tuple(range(p, n, num_fragments)) for p in range(num_fragments))
  total, groups, start, acc = sum(sizes), [], 0, 0
  for i, size in enumerate(sizes):
    acc += size
    left_leaves, left_groups = n - i - 1, num_fragments - len(groups) - 1
    if left_groups > 0 and (acc * num_fragments >= total * (len(groups) + 1)
                            or left_leaves == left_groups):
      groups.append(tuple(range(start, i + 1)))
      start = i + 1
  groups.append(tuple(range(start, n)))
  return tuple(groups)


def check_overlap_steps(overlap_steps: Any, inner_steps: int | None,
                        cohort_steps: int | None = None) -> None:
  """Raises unless ``overlap_steps`` is an int with ``0 <= tau <= S``.

  ``S`` is ``inner_steps`` when set, else the cohort's ``cohort_steps``
  (known only once a cohort is seen; unchecked before).
  """
  s = inner_steps if inner_steps is not None else cohort_steps
  what = (f'inner_steps={inner_steps}' if inner_steps is not None else
          'the cohort\'s steps per round, inner_steps being None' +
          (f': {cohort_steps}' if cohort_steps is not None else ''))
  if (isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int)
      or overlap_steps < 0 or (s is not None and overlap_steps > s)):
    raise ValueError(
        f'streaming_diloco: overlap_steps={overlap_steps!r} is not allowed; '
        'it must be an int tau with 0 <= tau <= S, the inner steps per round '
        f'(S is {what}): 0 merges a synchronised fragment at the end of its '
        'round, tau > 0 that many inner steps into the next round.')


def _take_steps(batches: Any, mask: jax.Array, steps: Any) -> tuple[Any, jax.Array]:
  """The batches and mask of ``steps`` (indices or a slice of the ``S`` axis)."""
  def pick(x):
    if fedjx.indexed.is_indexed(x):  # Only the index moves, not the table.
      return fedjx.indexed.IndexedBatches(x.table, jnp.asarray(x.index)[steps])
    return jnp.asarray(x)[steps]
  return (jax.tree.map(pick, batches, is_leaf=fedjx.indexed.is_indexed),
          jnp.asarray(mask)[steps])


def _split_steps(batches: Any, mask: jax.Array, schedule: client_update.LocalSchedule,
                 tau: int) -> tuple[tuple[Any, jax.Array], tuple[Any, jax.Array], int]:
  """The round's inner steps as two runs of plain steps: ``[0, tau)`` and
  ``[tau, S)`` (the batches each step of ``schedule`` reads), and ``S``."""
  if schedule.steps is None:
    s = int(jnp.shape(mask)[0])
    return (_take_steps(batches, mask, slice(0, tau)),
            _take_steps(batches, mask, slice(tau, s)), s)
  index, _ = client_update.step_schedule(mask, schedule)
  return (_take_steps(batches, mask, index[:tau]),
          _take_steps(batches, mask, index[tau:]), schedule.steps)


TRAITS = kit.Traits(options=DILOCO_OPTIONS, population='num_replicas',
                    indexed_batches=True)
"""What Streaming DiLoCo declares: DiLoCo's options, replicas by id
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def streaming_diloco(loss_fn: kit.LossFn, num_replicas: int, *,
                     inner_optimizer: optax.GradientTransformation | None = None,
                     outer_optimizer: optax.GradientTransformation | None = None,
                     outer_learning_rate: float | None = None,
                     outer_momentum: float | None = None,
                     inner_steps: int | None = None,
                     num_fragments: int = 2, fragment_pattern: str = 'strided',
                     quantization_format: str | None = None,
                     aggregator: aggregators.Aggregator | None = None,
                     mixing_factor: float = 0.0, overlap_steps: int = 0,
                     **options: Any) -> kit.Algorithm:
  """Streaming DiLoCo with ``num_replicas`` replicas and ``P`` fragments.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_replicas: ``K``; replica ids (``cohort.client_ids``) lie in ``[0, K)``;
      every replica is expected in every cohort.
    num_fragments: ``P``, at most the number of parameter arrays.
    fragment_pattern: ``'strided'`` or ``'sequential'``.
    quantization_format: format of the outer gradients
      (``quantization.FORMATS``; default the paper's 4-bit ``'e3m0'``): the
      aggregator ``aggregators.quantized_mean(quantization_format)``.
    aggregator: how each fragment's outer gradients are combined (instead
      of ``quantization_format``).
    mixing_factor: ``alpha`` in ``[0, 1]``, the weight of the replica's own
      fragment when merging.
    overlap_steps: ``tau``, the inner steps a synchronised fragment spends in
      flight: an int with ``0 <= tau <= S``, ``S`` the inner steps per round
      (``inner_steps``, or the cohort's steps when None). 0 merges the new
      global fragment into the replicas at the end of its round; ``tau > 0``
      merges it ``tau`` inner steps into the next round, into the replicas'
      fragment as trained by then (see the module docstring; after the last
      round ``params`` include the last outer step, the replicas' models not
      yet its merge).
    inner_optimizer, outer_optimizer, outer_learning_rate, outer_momentum,
    inner_steps: as for :func:`diloco`.
    **options: ``metrics_fn``, ``weighting``, ``client_evaluation``,
      ``skip_nonfinite``, as for :func:`fedavg`; the check is on the
      replica's whole trained model ``theta_k``, and a skipped replica keeps
      its model and inner state from before the round and is not merged
      (with ``overlap_steps``, it misses the merge of the fragment in flight
      too).

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``params`` are the global
    model ``theta`` (fragment ``p`` as last synchronised), ``opt_state`` a
    tuple of ``P`` outer optimizer states (state ``p`` over the tuple of
    fragment ``p``'s leaves), ``extras`` each replica's own model
    ``theta_k`` (leaves ``[K, ...]``) and ``client_states`` each replica's
    inner optimizer state; ``round_index mod P`` is the fragment the next
    round synchronises.
  """
  name = 'streaming_diloco'
  kit.check_positive_int(name, 'num_replicas', num_replicas)
  kit.check_positive_int(name, 'num_fragments', num_fragments)
  kit.check_choice(name, 'fragment_pattern', fragment_pattern, FRAGMENT_PATTERNS)
  if quantization_format is None and aggregator is None:
    quantization_format = 'e3m0'
  quantization.check_format(name, 'quantization_format',
                            quantization_format or 'float32')
  aggregator = check_aggregator(name, aggregator,
                                quantization_format or 'float32')
  kit.check_number(name, 'mixing_factor', mixing_factor, high=1.0)
  o = check_options(
      name, options, inner_optimizer=inner_optimizer,
      outer_optimizer=outer_optimizer, outer_learning_rate=outer_learning_rate,
      outer_momentum=outer_momentum, inner_steps=inner_steps)
  inner_optimizer, outer_optimizer = o.client_optimizer, o.server_optimizer
  schedule, metrics_fn = o.schedule, o.metrics_fn
  check_overlap_steps(overlap_steps, schedule.steps)
  tau = overlap_steps
  stack = lambda t: jax.tree.map(
      lambda x: jnp.broadcast_to(x, (num_replicas,) + jnp.shape(x)), t)

  def init(params):
    leaves = jax.tree.leaves(params)
    frags = fragment_leaves(params, num_fragments, fragment_pattern)
    return kit.ServerState(
        params=params,
        opt_state=tuple(outer_optimizer.init(tuple(leaves[i] for i in f))
                        for f in frags),
        hparams=base.combine_hparams(
            'streaming_diloco',
            algorithm={'inner_optimizer': base.optimizer_hparams(inner_optimizer, params),
                       'outer_optimizer': base.optimizer_hparams(
                           outer_optimizer, tuple(leaves[i] for i in frags[0])),
                       'mixing_factor': jnp.asarray(mixing_factor, jnp.float32)},
            aggregator=aggregators.init_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params), extras=stack(params),
        client_states=stack(inner_optimizer.init(params)))

  def replica_fn(theta_k, hparams, inner_state, batches, mask, *in_flight):
    inner_state = kit.with_hparams(inner_state, hparams)
    if tau == 0:
      out = client_update.local_update(loss_fn, metrics_fn, inner_optimizer,
                             theta_k, inner_state, batches, mask,
                             schedule)
    else:
      out = overlapped_update(theta_k, inner_state, batches, mask, *in_flight)
    return nonfinite.ClientOutput(out.params, out.stats,
                            state=(out.params, out.opt_state),
                            previous_state=(theta_k, inner_state))

  def overlapped_update(theta_k, inner_state, batches, mask, theta, merging,
                        alpha):
    """``tau`` inner steps, the merge of the fragment in flight (the leaves
    where ``merging``), the round's other ``S - tau`` steps."""
    first, rest, s = _split_steps(batches, mask, schedule, tau)
    plain = client_update.LocalSchedule(epochs=1, steps=None)
    before = (client_update.evaluate(loss_fn, metrics_fn, theta_k, batches, mask)
              if schedule.evaluate else None)
    y, state, n, sums = client_update.train(
        loss_fn, inner_optimizer, theta_k, inner_state, *first, plain)
    leaves, treedef = jax.tree.flatten(y)
    leaves = [jnp.where(m, (alpha * r + (1 - alpha) * g).astype(r.dtype), r)
              for r, g, m in zip(leaves, jax.tree.leaves(theta), merging)]
    y = jax.tree.unflatten(treedef, leaves)
    if s > tau:
      y, state, n_rest, sums_rest = client_update.train(
          loss_fn, inner_optimizer, y, state, *rest, plain)
      n = n + n_rest
      sums = jax.tree.map(jnp.add, sums, sums_rest)
    if before is None:
      stats = {'loss_during': sums['loss'], 'count': sums['count']}
    else:  # As client_update.local_update reports them.
      after = client_update.evaluate(loss_fn, metrics_fn, y, batches, mask)
      stats = {'count': before.pop('count')}
      after.pop('count')
      stats.update({f'{k}_before': v for k, v in before.items()})
      stats.update({f'{k}_after': v for k, v in after.items()})
    return kit.ClientUpdate(y, state, n, stats)

  def sync_fragment(p, frag, hparams, clients, num_clients, key, operands):
    """Outer step on fragment ``p`` (leaves ``frag``); updates the operands."""
    leaves, replica_leaves, opt_states, agg_state = operands
    theta = tuple(leaves[i] for i in frag)
    theta_k = tuple(replica_leaves[i] for i in frag)
    fragment_clients = aggregators.encode_map(  # messages Q(theta^p - theta_k^p)
        aggregator, hparams, clients, base.tree_sub,
        (fedjx.broadcast(theta), theta_k), aggregator_state=agg_state)
    outer_grad, agg_state, agg_metrics = aggregators.aggregate(
        aggregator, agg_state, hparams, fragment_clients, key)
    theta, opt_state = base.server_update(
        outer_optimizer, opt_states[p], hparams['outer_optimizer'], theta, outer_grad)
    merge = lambda r, g, a: jax.tree.map(lambda r, g: a * r + (1 - a) * g, r, g)
    if tau > 0:  # In flight: merged tau inner steps into the next round.
      merged = theta_k
    elif clients.skipped is None:  # theta_k^p <- alpha theta_k^p + (1 - alpha) theta^p
      merged = fedjx.map_fn(merge, (theta_k, fedjx.broadcast(theta),
                                    fedjx.broadcast(hparams['mixing_factor'])))
    else:  # A skipped replica keeps its fragment (alpha = 1).
      merged = fedjx.map_fn(
          lambda r, g, a, s: merge(r, g, jnp.where(s > 0, 1.0, a)),
          (theta_k, fedjx.broadcast(theta),
           fedjx.broadcast(hparams['mixing_factor']), clients.skipped))
    leaves, replica_leaves = list(leaves), list(replica_leaves)
    for j, i in enumerate(frag):
      leaves[i], replica_leaves[i] = theta[j], merged[j]
    opt_states = opt_states[:p] + (opt_state,) + opt_states[p + 1:]
    sent = aggregators.upload_bytes(aggregator, theta, num_clients, agg_metrics)
    return (tuple(leaves), tuple(replica_leaves), opt_states, agg_state,
            optax.tree.norm(outer_grad), sent, agg_metrics)

  def in_flight(state, cohort):
    """The merge's operands: the global model, per leaf whether it is in the
    fragment sent last round (none in round 0), and ``alpha``."""
    if tau == 0:
      return ()
    check_overlap_steps(tau, schedule.steps, int(jnp.shape(cohort.mask)[1]))
    frags = fragment_leaves(state.params, num_fragments, fragment_pattern)
    last = (state.round_index - 1) % num_fragments
    merging = [None] * len(jax.tree.leaves(state.params))
    for j, f in enumerate(frags):
      for i in f:
        merging[i] = jnp.logical_and(state.round_index > 0, last == j)
    return tuple(fedjx.broadcast(x) for x in (
        state.params, tuple(merging), state.hparams['mixing_factor']))

  def round_fn(state, cohort, key):
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    gather = lambda t: base.gather_clients(t, ids)
    clients = nonfinite.map_clients(
        replica_fn,
        (gather(state.extras),
         fedjx.broadcast(state.hparams['inner_optimizer']),
         gather(state.client_states), cohort.batches, cohort.mask)
        + in_flight(state, cohort),
        aggregators.client_weights(aggregator, cohort.num_examples, o.weighting),
        cohort.num_examples, o.skip_nonfinite)
    theta_k, inner = clients.state
    # Synchronise fragment p = round mod P (one branch per fragment).
    leaves, treedef = jax.tree.flatten(state.params)
    frags = fragment_leaves(state.params, num_fragments, fragment_pattern)
    if clients.totals is None:
      count = fedjx.reduce_sum((cohort.num_examples > 0).astype(jnp.float32))
    else:
      count = clients.totals['clients']
    p = state.round_index % num_fragments
    branches = [
        (lambda ops, j=j, f=f: sync_fragment(
            j, f, state.hparams, clients, count, key, ops))
        for j, f in enumerate(frags)]
    (leaves, replica_leaves, opt_states, agg_state, norm, sent,
     agg_metrics) = jax.lax.switch(
         p, branches, (tuple(leaves), tuple(jax.tree.leaves(theta_k)),
                       state.opt_state, state.aggregator_state))
    scatter = lambda store, new: base.scatter_clients(
        store, ids, new, cohort.num_examples > 0)
    metrics = nonfinite.round_metrics(clients, pseudo_grad_norm=norm,
                                communicated_bytes=sent, synced_fragment=p,
                                **agg_metrics)
    return state._replace(
        params=jax.tree.unflatten(treedef, leaves),
        extras=scatter(state.extras,
                       jax.tree.unflatten(treedef, replica_leaves)),
        opt_state=opt_states,
        client_states=scatter(state.client_states, inner),
        round_index=state.round_index + 1, aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)
