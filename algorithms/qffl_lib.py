"""q-FFL: fair resource allocation by the q-FedAvg update.

Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated
Learning", ICLR 2020. q-FFL minimises

    f_q(w) = sum_k p_k F_k(w)^{q+1} / (q + 1),

which for ``q > 0`` puts more weight on the clients with larger loss ``F_k``
(``q = 0`` is FedAvg's objective; ``q -> inf`` approaches the worst client's
loss). q-FedAvg (the paper's Algorithm 2) takes one step per round, with
the Lipschitz estimate ``L = 1 / eta`` of the local step size ``eta``:

    broadcast w^t to the cohort
    client k:  F_k = F_k(w^t)                       (loss before training)
               wbar_k = ClientOpt^T(w^t; D_k)       (E epochs of local SGD)
               Dw_k  = L (w^t - wbar_k)
               Delta_k = F_k^q Dw_k
               h_k   = q F_k^{q-1} ||Dw_k||^2 + L F_k^q
    server:    w^{t+1} = w^t - sum_k v_k Delta_k / sum_k v_k h_k

The paper samples clients with probability ``p_k`` and sums uniformly
(``v_k = 1``: ``weighting='uniform'``); with uniform sampling the default
``weighting='num_examples'`` (``v_k = n_k``) targets the same objective with
``p_k = n_k / n``, and at ``q = 0`` the step is FedAvg's weighted average
(``h_k = L``). ``F_k`` is offset by ``1e-10`` (as Flower's ``QFedAvg``,
``flwr/serverapp/strategy/qfedavg.py``, ``compute_delta_and_h``) so that
``F_k^{q-1}`` stays finite for a client with zero loss.

Both sums are one reduction: each client sends ``(Delta_k, h_k)`` with its
weight ``v_k`` (a skipped non-finite client sends zeros), and the server
divides. A differentially private aggregator is refused: ``h_k`` depends on
the client's loss and update norm, so the step is a ratio of two sums that
a Gaussian mechanism on the updates alone would not privatise.

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): its server step divides two weighted
sums over the cohort, ``sum_k v_k Delta_k / sum_k v_k h_k``, where the
template steps along an aggregator's combination of the updates.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import template
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators

# What a round releases beside the aggregate (``Traits.unprivatized``).
UNPRIVATIZED = ('its step sum_k Delta_k / sum_k h_k divides by h_k, a function '
                'of each client\'s exact loss and update norm, which the noise '
                'on the updates does not cover')

# Flower's offset of the loss (flwr QFedAvg): F_k^{q-1} finite at F_k = 0.
LOSS_OFFSET = 1e-10

def qffl_terms(server: kit.Params, trained: kit.Params, loss: jax.Array,
               q: jax.Array, lipschitz: jax.Array) -> tuple[kit.PyTree, jax.Array]:
  """One client's ``(Delta_k, h_k)`` of q-FedAvg (Li et al. 2020, Algorithm 2).

  ``Dw_k = L (w - wbar_k)``, ``Delta_k = F_k^q Dw_k`` and ``h_k = q
  F_k^{q-1} ||Dw_k||^2 + L F_k^q``, with ``F_k = loss + 1e-10``.
  """
  f = jnp.asarray(loss, jnp.float32) + LOSS_OFFSET
  dw = jax.tree.map(lambda a, b: lipschitz.astype(a.dtype) * (a - b), server, trained)
  fq = jnp.power(f, q)
  sq_norm = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(dw))
  h = q * jnp.power(f, q - 1.0) * sq_norm + lipschitz * fq
  return jax.tree.map(lambda d: fq.astype(d.dtype) * d, dw), h


def _plain_mean(fn: str, aggregator: Any) -> bool:
  """Whether ``aggregator`` is None or the plain weighted mean."""
  if aggregator is None:
    return True
  agg = aggregators.check(fn, aggregator)
  plain = aggregators.mean()
  return agg.combine is plain.combine and agg.encode is None and agg.weights is None


def _lipschitz(fn: str, lipschitz: Any, client_hparams: dict[str, Any]) -> None:
  if lipschitz is None and 'learning_rate' not in client_hparams:
    raise ValueError(
        f'{fn}: lipschitz=None reads L = 1 / learning_rate from the client '
        'optimizer, but it has no injected learning_rate; pass lipschitz=L '
        'or build the client optimizer with optax.inject_hyperparams.')


TRAITS = kit.Traits(options=kit.options_but('server_optimizer', 'client_transform'),
                    updates_reach_params=True, unprivatized=UNPRIVATIZED)
"""What q-FFL declares: FedAvg's options but the server optimizer (its step
is its own) and the client transform
(:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def qffl(loss_fn: kit.LossFn, *, q: float = 1.0, lipschitz: float | None = None,
         **options: Any) -> kit.Algorithm:
  """q-FedAvg (Li et al. 2020): FedAvg's clients, the q-FFL server step.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    q: the fairness exponent ``q >= 0`` (``state.hparams['q']``); 0 is FedAvg.
    lipschitz: ``L`` (``state.hparams['lipschitz']``); None (the default)
      is the paper's ``L = 1 / eta``, read each round from the client
      optimizer's injected ``learning_rate``.
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``server_optimizer``
      and ``client_transform``; ``aggregator`` None or
      :func:`~fedjx.algorithms.aggregators.mean` only (see the module
      docstring for why DP aggregators are refused); ``F_k`` is computed
      before training whether or not ``client_evaluation`` is on.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` (no server optimizer state).
  """
  name = 'qffl'
  kit.check_number(name, 'q', q)
  if lipschitz is not None:
    kit.check_number(name, 'lipschitz', lipschitz, strict=True)
  given = options.get('aggregator')
  if given is not None:
    kit.check_private_uploads(name, aggregators.check(name, given),
                              UNPRIVATIZED)
  if not _plain_mean(name, given):
    raise ValueError(
        f'{name}: aggregator={given!r} is not taken: the q-FFL step '
        'sum_k Delta_k / sum_k h_k divides by terms of each client\'s loss and '
        'update norm, which a compressing or robust aggregator of the updates '
        'alone would not cover; use aggregator=None.')
  o = kit.Options.of(name, options, TRAITS.options)
  client_optimizer, schedule = o.client_optimizer, o.schedule
  metrics_fn = o.metrics_fn

  def init(params):
    client_hparams = base.optimizer_hparams(client_optimizer, params)
    _lipschitz(name, lipschitz, client_hparams)
    hparams = {'client_optimizer': client_hparams, 'q': jnp.float32(q)}
    if lipschitz is not None:
      hparams['lipschitz'] = jnp.float32(lipschitz)
    return kit.ServerState(params=params, opt_state=(), hparams=hparams,
                           round_index=jnp.zeros((), jnp.int32))

  def lipschitz_of(hparams):
    if 'lipschitz' in hparams:
      return hparams['lipschitz']
    return 1.0 / jnp.asarray(hparams['client_optimizer']['learning_rate'],
                             jnp.float32)

  def client_fn(w, hparams, q, big_l, batches, mask):
    out = template.trainer(loss_fn, o, w, hparams, batches, mask)()
    if schedule.evaluate:
      loss_sum, count = out.stats['loss_before'], out.stats['count']
    else:
      before = client_update.evaluate(loss_fn, None, w, batches, mask)
      loss_sum, count = before['loss'], before['count']
    loss = loss_sum / jnp.maximum(count, 1.0)  # F_k(w^t)
    delta, h = qffl_terms(w, out.params, loss, q, big_l)
    extra = ({**base.client_metrics(base.tree_sub(w, out.params), out),
              'client_h': h} if o.client_metrics else ())
    return nonfinite.ClientOutput((delta, h), out.stats, extra=extra)

  def round_fn(state, cohort, key):
    del key
    hp = state.hparams
    big_l = lipschitz_of(hp)
    weights = base.aggregation_weights(cohort.num_examples, o.weighting)
    clients = nonfinite.map_clients(
        client_fn,
        (fedjx.broadcast(state.params),
         fedjx.broadcast({'client_optimizer': hp['client_optimizer']}),
         fedjx.broadcast(hp['q']), fedjx.broadcast(big_l),
         cohort.batches, cohort.mask),
        weights, cohort.num_examples, o.skip_nonfinite)
    weighted = (clients.weighted_update if clients.weighted_update is not None
                else fedjx.map_fn(lambda v, u: jax.tree.map(lambda x: v * x, u),
                                  (clients.weights, clients.update)))
    sum_delta, sum_h = fedjx.reduce_sum(weighted)
    safe = jnp.where(sum_h > 0, sum_h, 1.0)
    step = jax.tree.map(lambda d: jnp.where(sum_h > 0, d / safe.astype(d.dtype),
                                            jnp.zeros_like(d)), sum_delta)
    params = jax.tree.map(jnp.subtract, state.params, step)
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(step), h_sum=sum_h,
        lipschitz=big_l)
    metrics.update(clients.extra)
    return state._replace(params=params, round_index=state.round_index + 1), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)


__all__ = ['qffl', 'qffl_terms']
