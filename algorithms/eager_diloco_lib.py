"""DiLoCo whose outer step overlaps a whole inner phase: eager updates.

Kale, Douillard and Donchev, "Eager Updates For Overlapped Communication and
Computation in DiLoCo", 2025 (arXiv 2502.12996). In DiLoCo
(:mod:`fedjx.algorithms.diloco_lib`) every replica waits, after its ``H``
inner steps, for the all-reduce of the outer gradients before it can take
the outer step and start the next inner phase. Here the all-reduce of round
``t``'s outer gradients runs while the replicas train round ``t + 1``: its
average arrives one outer step late (the paper's *1-outer-step overlap*,
the whole inner phase hiding the communication). Each replica ``m`` keeps
its own outer parameters ``theta_m`` and outer optimizer state. With ``M``
replicas, outer step ``t``:

    for each replica m (in parallel):
        theta_m' <- InnerOpt^H(theta_m^(t-1))
        Delta_m^(t) = theta_m^(t-1) - theta_m'             (outer gradient)
        send Delta_m^(t); the mean Delta^(t) arrives in round t + 1
        theta_m^(t) <- OuterOpt_m(theta_m^(t-1), g_m^(t))

with the outer gradient ``g_m^(t)`` the replica has at hand
(``outer_update``):

* ``'delayed'`` (the paper's naive delayed outer gradients, its
  Algorithm 2): the average that just arrived, one round stale,
  ``g_m^(t) = Delta^(t-1)``. Every replica applies the same one, so the
  replicas' outer models stay equal.
* ``'eager'`` (the paper's eager updates, its Algorithm 3): the stale
  average with the replica's own stale term replaced by its fresh one,

      g_m^(t) = Delta^(t-1) + (1/M) (Delta_m^(t) - Delta_m^(t-1))
              = (1/M) (Delta_m^(t) + sum_{k != m} Delta_k^(t-1)),

  the replica's own outer gradient standing in for the part of the
  not-yet-received average that it already knows. The replicas' outer
  models now differ (each by its own latest term).

The formula is the paper's eager update; a survey of the paper states it in
both forms above (the correction form and the "own fresh plus others'
delayed" form), and summaries of the paper describe the eager step as the
mix of the current local outer gradient with the other replicas' delayed
ones. What the sources leave open, decided here:

* Round 1 (``t = 1``): no average has arrived yet. ``Delta^(0)`` and
  ``Delta_m^(0)`` are zero, so ``'eager'`` steps on ``(1/M) Delta_m^(1)``
  (its own share of the average it is sending), and ``'delayed'`` takes no
  outer step at all (parameters and outer optimizer state unchanged, not a
  step on a zero gradient: an outer optimizer with a step count, e.g. Adam,
  would otherwise count it).
* Weights. ``1/M`` is the replica's share of the average. fedjx averages
  with weights ``w_m`` (``weighting``; the number of examples by default),
  so the share is ``w_m / sum_k w_k`` and the round's average is the sum of
  the shares, ``Delta^(t) = sum_m c_m^(t)`` with
  ``c_m^(t) = (w_m / sum_k w_k) Q(Delta_m^(t))``; the eager step is
  ``g_m^(t) = Delta^(t-1) - c_m^(t-1) + c_m^(t)``, the paper's formula when
  the weights are equal.
* Quantization (``quantization_format``, ``Q``): the average is of the
  quantized messages, and the replica's own terms enter the eager step as
  it sends them (``Q(Delta_m)``), so that the stale term it removes is
  exactly the one the average holds.
* The last round's average is still in flight when training stops; it is
  never applied (``in_flight`` holds it).
* ``params``, the model evaluated, is the mean of the replicas' outer
  models (their common model with ``'delayed'``).

With ``M = 1`` the eager step is ``Delta_1^(t)``, and eager updates are
DiLoCo (with equal weights, bit for bit). Only the mean of the (quantized)
outer gradients is supported as the aggregator: the eager correction needs
each replica's own term of the aggregate. ``communicated_bytes`` is DiLoCo's
(every replica sends its outer gradient once a round); the network clock
(:mod:`fedjx.experiments.network_clock`) charges the all-reduce against the
next round's ``H`` inner steps (``Schedule.streaming_diloco(H, 1, H)``:
exposed ``max(0, t(S) - H T)``).

The paper also applies the overlap to Streaming DiLoCo (its Table 3) and
overlaps two outer steps (its Table 2); neither is implemented here.

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): each replica keeps and steps its own
outer model on an average that arrives a round late, where the template's
server steps one model on this round's aggregate.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.compression import quantization
from fedjx.algorithms.diloco_lib import OPTIONS as DILOCO_OPTIONS
from fedjx.algorithms.diloco_lib import check_options
from fedjx.algorithms.diloco_lib import stack_states

OUTER_UPDATES = ('eager', 'delayed')
"""The outer gradients a replica may step on while the average is in flight."""


def check_outer_update(fn: str, outer_update: Any) -> None:
  """Raises unless ``outer_update`` is one of :data:`OUTER_UPDATES`."""
  if not isinstance(outer_update, str) or outer_update not in OUTER_UPDATES:
    raise ValueError(
        f'{fn}: outer_update={outer_update!r} is not allowed; it must be one '
        f"of {OUTER_UPDATES}: 'eager' steps on the delayed average with the "
        "replica's own term made fresh, 'delayed' on the delayed average.")


TRAITS = kit.Traits(options=DILOCO_OPTIONS, population='num_replicas',
                    indexed_batches=True)
"""What eager DiLoCo declares: DiLoCo's options, replicas by id
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def eager_diloco(loss_fn: kit.LossFn, num_replicas: int, *,
                 inner_optimizer: optax.GradientTransformation | None = None,
                 outer_optimizer: optax.GradientTransformation | None = None,
                 outer_learning_rate: float | None = None,
                 outer_momentum: float | None = None,
                 inner_steps: int | None = None,
                 outer_update: str = 'eager',
                 quantization_format: str = 'float32',
                 **options: Any) -> kit.Algorithm:
  """DiLoCo with a 1-outer-step overlap and ``num_replicas`` replicas.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_replicas: ``M``; replica ids (``cohort.client_ids``) lie in
      ``[0, M)``; every replica is expected in every cohort.
    outer_update: ``'eager'`` (Kale et al. 2025's eager updates) or
      ``'delayed'`` (the naive delayed outer gradients they improve on);
      see the module docstring.
    quantization_format: format of the outer gradients sent
      (``quantization.FORMATS``; full precision by default).
    inner_optimizer, outer_optimizer, outer_learning_rate, outer_momentum,
    inner_steps: as for :func:`diloco` (each replica's outer optimizer is a
      copy of ``outer_optimizer``, with the shared hyperparameters).
    **options: ``metrics_fn``, ``weighting``, ``client_evaluation``,
      ``skip_nonfinite``, as for :func:`fedavg`; a skipped replica is one not
      sampled: it sends nothing (weight 0) and keeps its outer model, outer
      and inner optimizer states and share from before the round.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``params`` are the mean of
    the replicas' outer models (the model evaluated), ``opt_state`` each
    replica's outer optimizer state (leaves ``[M, ...]``),
    ``client_states`` each replica's inner optimizer state, and ``extras``
    ``{'replica_params': each replica's outer model theta_m, leaves [M,
    ...]; 'in_flight': Delta^(t), the average sent in the last round, which
    the replicas step on in the next (zero before the first round);
    'own_share': c_m^(t), each replica's term of in_flight, leaves [M, ...]
    (zero before the first round)}``.
  """
  name = 'eager_diloco'
  kit.check_positive_int(name, 'num_replicas', num_replicas)
  check_outer_update(name, outer_update)
  quantization.check_format(name, 'quantization_format', quantization_format)
  o = check_options(
      name, options, inner_optimizer=inner_optimizer,
      outer_optimizer=outer_optimizer, outer_learning_rate=outer_learning_rate,
      outer_momentum=outer_momentum, inner_steps=inner_steps)
  inner_optimizer, outer_optimizer = o.client_optimizer, o.server_optimizer
  schedule, metrics_fn = o.schedule, o.metrics_fn
  aggregator = aggregators.quantized_mean(quantization_format)
  eager = outer_update == 'eager'

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return kit.ServerState(
        params=params,
        opt_state=stack_states(outer_optimizer.init(params), num_replicas),
        hparams=base.combine_hparams(
            name,
            algorithm={'inner_optimizer': base.optimizer_hparams(inner_optimizer, params),
                       'outer_optimizer': base.optimizer_hparams(outer_optimizer, params)}),
        round_index=jnp.zeros((), jnp.int32),
        extras={'replica_params': stack_states(params, num_replicas),
                'in_flight': zeros,
                'own_share': stack_states(zeros, num_replicas)},
        client_states=stack_states(inner_optimizer.init(params), num_replicas))

  def replica_fn(theta_m, hparams, inner_state, batches, mask):
    """The inner phase: ``Delta_m = theta_m - InnerOpt^H(theta_m)``."""
    inner_state = kit.with_hparams(inner_state, hparams)
    out = client_update.local_update(loss_fn, metrics_fn, inner_optimizer,
                                     theta_m, inner_state, batches, mask,
                                     schedule)
    return nonfinite.ClientOutput(base.tree_sub(theta_m, out.params), out.stats,
                                  state=out.opt_state, previous_state=inner_state,
                                  checked=out.params)

  def share_fn(message, w, total):
    """``c_m = (w_m / sum_k w_k) Q(Delta_m)`` (zero when no replica has weight)."""
    frac = w / jnp.where(total > 0, total, 1.0)
    return jax.tree.map(lambda u: (frac * u).astype(u.dtype), message)

  def outer_fn(theta_m, opt_m, hparams, stale, old_share, new_share, first):
    """``theta_m <- OuterOpt_m(theta_m, g_m)``, ``g_m`` per ``outer_update``."""
    if eager:  # Delta^(t-1) - c_m^(t-1) + c_m^(t)
      g = jax.tree.map(lambda d, o, n: (d - o) + n, stale, old_share, new_share)
    else:
      g = stale
    new_theta, new_opt = base.server_update(outer_optimizer, opt_m, hparams,
                                            theta_m, g)
    if not eager:  # Round 1 of 'delayed': nothing has arrived, no step.
      keep = lambda new, old: jax.tree.map(
          lambda a, b: jnp.where(first, b, a), new, old)
      new_theta, new_opt = keep(new_theta, theta_m), keep(new_opt, opt_m)
    return new_theta, new_opt

  def round_fn(state, cohort, key):
    del key  # The mean aggregator draws nothing.
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    gather = lambda t: base.gather_clients(t, ids)
    extras = state.extras
    theta = gather(extras['replica_params'])
    clients = aggregators.map_clients(
        aggregator, state.hparams, replica_fn,
        (theta, fedjx.broadcast(state.hparams['inner_optimizer']),
         gather(state.client_states), cohort.batches, cohort.mask),
        cohort.num_examples, o.weighting, o.skip_nonfinite)
    # The all-reduce launched now: Delta^(t) = sum_m c_m^(t).
    total = nonfinite.participants(clients)
    share = fedjx.map_fn(share_fn, (clients.update, clients.weights,
                                    fedjx.broadcast(total)))
    average = fedjx.reduce_sum(share)
    # The outer step on what each replica has at hand.
    new_theta, new_opt = fedjx.map_fn(
        outer_fn,
        (theta, gather(state.opt_state),
         fedjx.broadcast(state.hparams['outer_optimizer']),
         fedjx.broadcast(extras['in_flight']), gather(extras['own_share']), share,
         fedjx.broadcast(state.round_index == 0)))
    # A replica skipped as non-finite (n_i zeroed) is one not sampled: it
    # keeps its outer model and state, inner state and share.
    real = clients.num_examples > 0
    scatter = lambda store, new: base.scatter_clients(store, ids, new, real)
    replica_params = scatter(extras['replica_params'], new_theta)
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(average))
    metrics['communicated_bytes'] = aggregators.upload_bytes(
        aggregator, state.params, metrics['clients'], {})
    return state._replace(
        params=jax.tree.map(lambda r: jnp.mean(r, axis=0), replica_params),
        opt_state=scatter(state.opt_state, new_opt),
        extras={'replica_params': replica_params, 'in_flight': average,
                'own_share': scatter(extras['own_share'], share)},
        client_states=scatter(state.client_states, clients.state),
        round_index=state.round_index + 1), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)
