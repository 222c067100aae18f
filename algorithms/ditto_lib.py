"""Ditto: FedAvg for the global model, a personal model pulled toward it.

Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1. Each client ``k`` keeps a personal
model ``v_k`` between rounds (outside the server state,
``Algorithm.client_state_init``: ``v_k = w^0``, the initial model, until the
client first takes part). A round on a cohort ``S`` with the global model
``w``:

    client k in S:  w_k <- w;  tau times:  w_k <- w_k - eta grad F_k(w_k)
                    s times:   v_k <- v_k - eta_v (grad F_k(v_k) + lambda (v_k - w))
                    keep v_k, send Delta_k = w - w_k
    server:         w <- w + ServerOpt(sum_k w_k Delta_k / sum_k w_k)

The global update is FedAvg's (its client optimizer, local schedule,
aggregator and server optimizer; ``ServerOpt = SGD(1)`` with
``weighting='uniform'`` is the paper's average). The personal steps are on ``h_k(v; w) = F_k(v) + (lambda / 2)
||v - w||^2``: the personal optimizer (SGD ``eta_v = 0.1`` by default)
chained after :func:`fedjx.algorithms.transforms.proximal` anchored
at ``w``, the model the client received. ``lambda = 0`` trains ``v_k`` on
the client's data alone; large ``lambda`` keeps it at ``w``.

Only ``Delta_k`` leaves the client, so an aggregator (a DP one included)
sees exactly FedAvg's messages; ``v_k`` is never sent. Reported train
losses are the global update's (as FedAvg's). Evaluating the personal
models: :func:`personalize_fn`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit

# fedavg's options but the client transform (the personal objective is
# Ditto's own), and the personal model's.
OPTIONS: dict[str, Any] = {
    **kit.without('client_transform'),
    'personal_optimizer': None,
    'personal_epochs': 1,
    'personal_steps': None,
}


def _copy(tree):  # A new client's v_k: a copy of the initial model.
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@kit.with_options(OPTIONS)
def ditto(loss_fn: kit.LossFn, *, lam: float = 0.1,
          **options: Any) -> kit.Algorithm:
  """Ditto with regularization ``lambda = lam`` (``state.hparams['lam']``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    lam: ``lambda >= 0``, the pull of each personal model toward the
      global one (traced).
    personal_optimizer: the personal steps' optimizer (default SGD 0.1,
      injected; ``state.hparams['personal_optimizer']``).
    personal_epochs: passes of the personal steps over the client's data
      (``s``), or
    personal_steps: exactly this many personal steps.
    client_optimizer, server_optimizer, local_epochs, local_steps,
    aggregator, metrics_fn, weighting, client_evaluation, skip_nonfinite,
    client_metrics: the global update's, as :func:`~fedjx.algorithms.fedavg`;
      a skipped client keeps its personal model.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm` (its state a
    :class:`~fedjx.algorithms.ServerState`), with ``client_state_init``:
    rows are the personal models ``v_k`` (the params' structure).
  """
  name = 'ditto'
  o = kit.take_options(name, options, OPTIONS)
  kit.check_number(name, 'lam', lam)
  client_optimizer, server_optimizer, aggregator, schedule = kit.check_parts(
      name, dict(o, client_transform=None))
  personal_optimizer = o['personal_optimizer'] or kit.default_sgd(0.1)
  kit.check_optimizer(name, 'personal_optimizer', personal_optimizer)
  try:
    personal = kit.check_schedule(name, o['personal_epochs'],
                                  o['personal_steps'], False)
  except ValueError as e:  # Named as the options are.
    raise ValueError(str(e).replace('local_', 'personal_')) from None
  client_metrics = o['client_metrics']
  train = kit.client_training(loss_fn, o['metrics_fn'], client_optimizer, None,
                              schedule)

  def init(params):
    return kit.ServerState(
        params=params, opt_state=server_optimizer.init(params),
        hparams=kit.combine_hparams(
            name,
            algorithm={
                'client_optimizer': kit.optimizer_hparams(client_optimizer, params),
                'server_optimizer': kit.optimizer_hparams(server_optimizer, params),
                'personal_optimizer': kit.optimizer_hparams(personal_optimizer, params),
                'lam': jnp.asarray(lam, jnp.float32)},
            aggregator=kit.aggregator_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def client_fn(w, v, lam_, hparams, personal_hparams, batches, mask):
    out = train(w, hparams, batches, mask)       # The global update w_k.
    delta = kit.tree_sub(w, out.params)
    # v_k: steps on F_k(v) + lambda/2 ||v - w||^2, the anchor w as received.
    optimizer = optax.chain(kit.proximal(lam_), personal_optimizer)
    state = (kit.ProximalState(anchor=w),
             kit.with_hparams(personal_optimizer.init(v), personal_hparams))
    v_new, _, _, _ = kit.train(loss_fn, optimizer, v, state,
                               batches, mask, personal)
    extra = kit.client_metrics(delta, out) if client_metrics else ()
    return kit.ClientOutput(delta, out.stats, extra=extra, state=v_new,
                            previous_state=v, checked=(out.params, v_new))

  def round_fn(state, cohort, key):
    h = state.hparams
    clients = kit.map_clients(
        aggregator, h, client_fn,
        (fedjx.broadcast(state.params), cohort.client_states,
         fedjx.broadcast(h['lam']),
         fedjx.broadcast({'client_optimizer': h['client_optimizer']}),
         fedjx.broadcast(h['personal_optimizer']), cohort.batches, cohort.mask),
        cohort.num_examples, o['weighting'], o['skip_nonfinite'],
        aggregator_state=state.aggregator_state, client_ids=cohort.client_ids)
    pseudo_grad, params, opt_state, agg_state, agg_metrics = kit.server_step(
        aggregator, server_optimizer, state, h['server_optimizer'], clients, key)
    metrics = kit.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad), **agg_metrics)
    metrics.update(clients.extra)  # Per-client [C] metrics, if asked.
    state = state._replace(params=params, opt_state=opt_state,
                           round_index=state.round_index + 1,
                           aggregator_state=agg_state)
    return state, metrics, clients.state

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o,
                            client_state_init=_copy)


def personalize_fn() -> Callable[[Any, Any, Mapping[str, Any]], kit.Params]:
  """``personalize(server_state, client_state, train) -> params`` for Ditto.

  The client's personal model ``v_k`` (its row) as it is: Ditto evaluates
  ``v_k`` on the client's held-out data (Li et al. 2021, Section 5). A
  client that never trained has ``v_k = w^0``.
  """
  def personalize(server_state, client_state, train):
    del server_state, train
    return client_state

  return personalize


__all__ = ['ditto', 'personalize_fn']
