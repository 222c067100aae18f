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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import kit
from fedjx.algorithms.compression import quantization
from fedjx.algorithms.diloco_lib import OPTIONS as DILOCO_OPTIONS
from fedjx.algorithms.diloco_lib import check_options
from fedjx.algorithms.diloco_lib import stack_states

OUTER_UPDATES = ('eager', 'delayed')
"""The outer gradients a replica may step on while the average is in flight."""


class EagerDiLoCoState(NamedTuple):
  """Eager (or delayed) DiLoCo's state.

  Attributes:
    params: the mean of the replicas' outer models (the model evaluated).
    replica_params: each replica's outer model ``theta_m``, leaves ``[M, ...]``.
    opt_state: each replica's outer optimizer state, leaves ``[M, ...]``.
    inner_opt_states: each replica's inner optimizer state, leaves ``[M, ...]``.
    in_flight: ``Delta^(t)``, the average sent in the last round, which the
      replicas step on in the next (zero before the first round).
    own_share: ``c_m^(t)``, each replica's term of ``in_flight``, leaves
      ``[M, ...]`` (zero before the first round).
    hparams: ``inner_optimizer`` and ``outer_optimizer`` hyperparameters.
    round_index: outer steps taken.
  """

  params: kit.Params
  replica_params: kit.Params
  opt_state: optax.OptState
  inner_opt_states: Any
  in_flight: kit.Params
  own_share: kit.Params
  hparams: dict[str, Any]
  round_index: jax.Array


def check_outer_update(fn: str, outer_update: Any) -> None:
  """Raises unless ``outer_update`` is one of :data:`OUTER_UPDATES`."""
  if not isinstance(outer_update, str) or outer_update not in OUTER_UPDATES:
    raise ValueError(
        f'{fn}: outer_update={outer_update!r} is not allowed; it must be one '
        f"of {OUTER_UPDATES}: 'eager' steps on the delayed average with the "
        "replica's own term made fresh, 'delayed' on the delayed average.")


@kit.with_options(DILOCO_OPTIONS)
def eager_diloco(loss_fn: kit.LossFn, num_replicas: int, *,
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
    metrics_fn, weighting, client_evaluation, skip_nonfinite: as for
      :func:`fedavg`; a skipped replica is one not sampled: it sends nothing
      (weight 0) and keeps its outer model, outer and inner optimizer states
      and share from before the round.
  """
  name = 'eager_diloco'
  kit.check_positive_int(name, 'num_replicas', num_replicas)
  check_outer_update(name, outer_update)
  quantization.check_format(name, 'quantization_format', quantization_format)
  inner_optimizer, outer_optimizer, schedule, o = check_options(name, options)
  aggregator = aggregators.quantized_mean(quantization_format)
  metrics_fn = o['metrics_fn']
  eager = outer_update == 'eager'

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return EagerDiLoCoState(
        params=params,
        replica_params=stack_states(params, num_replicas),
        opt_state=stack_states(outer_optimizer.init(params), num_replicas),
        inner_opt_states=stack_states(inner_optimizer.init(params), num_replicas),
        in_flight=zeros,
        own_share=stack_states(zeros, num_replicas),
        hparams=kit.combine_hparams(
            name,
            algorithm={'inner_optimizer': kit.optimizer_hparams(inner_optimizer, params),
                       'outer_optimizer': kit.optimizer_hparams(outer_optimizer, params)}),
        round_index=jnp.zeros((), jnp.int32))

  def replica_fn(theta_m, hparams, inner_state, batches, mask):
    """The inner phase: ``Delta_m = theta_m - InnerOpt^H(theta_m)``."""
    inner_state = kit.with_hparams(inner_state, hparams)
    out = kit.local_update(loss_fn, metrics_fn, inner_optimizer,
                                     theta_m, inner_state, batches, mask,
                                     schedule)
    return kit.ClientOutput(kit.tree_sub(theta_m, out.params), out.stats,
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
    new_theta, new_opt = kit.server_update(outer_optimizer, opt_m, hparams,
                                            theta_m, g)
    if not eager:  # Round 1 of 'delayed': nothing has arrived, no step.
      keep = lambda new, old: jax.tree.map(
          lambda a, b: jnp.where(first, b, a), new, old)
      new_theta, new_opt = keep(new_theta, theta_m), keep(new_opt, opt_m)
    return new_theta, new_opt

  def round_fn(state, cohort, key):
    del key  # The mean aggregator draws nothing.
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    gather = lambda t: kit.gather_clients(t, ids)
    theta = gather(state.replica_params)
    clients = kit.map_clients(
        aggregator, state.hparams, replica_fn,
        (theta, fedjx.broadcast(state.hparams['inner_optimizer']),
         gather(state.inner_opt_states), cohort.batches, cohort.mask),
        cohort.num_examples, o['weighting'], o['skip_nonfinite'])
    # The all-reduce launched now: Delta^(t) = sum_m c_m^(t).
    total = kit.participants(clients)
    share = fedjx.map_fn(share_fn, (clients.update, clients.weights,
                                    fedjx.broadcast(total)))
    average = fedjx.reduce_sum(share)
    # The outer step on what each replica has at hand.
    new_theta, new_opt = fedjx.map_fn(
        outer_fn,
        (theta, gather(state.opt_state),
         fedjx.broadcast(state.hparams['outer_optimizer']),
         fedjx.broadcast(state.in_flight), gather(state.own_share), share,
         fedjx.broadcast(state.round_index == 0)))
    # A replica skipped as non-finite (n_i zeroed) is one not sampled: it
    # keeps its outer model and state, inner state and share.
    real = clients.num_examples > 0
    scatter = lambda store, new: kit.scatter_clients(store, ids, new, real)
    replica_params = scatter(state.replica_params, new_theta)
    metrics = kit.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(average))
    metrics['communicated_bytes'] = kit.upload_bytes(
        aggregator, state.params, metrics['clients'], {})
    return state._replace(
        params=jax.tree.map(lambda r: jnp.mean(r, axis=0), replica_params),
        replica_params=replica_params,
        opt_state=scatter(state.opt_state, new_opt),
        inner_opt_states=scatter(state.inner_opt_states, clients.state),
        in_flight=average,
        own_share=scatter(state.own_share, share),
        round_index=state.round_index + 1), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o,
                             indexed_batches=True)
