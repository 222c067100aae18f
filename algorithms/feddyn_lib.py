"""FedDyn: federated learning with dynamic regularization.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based
on Dynamic Regularization", ICLR 2021, Algorithm 1. The server keeps the
model ``theta`` and ``h`` (zero at first); each of the ``m`` clients of the
population keeps ``g_k = grad L_k(theta_k)``, the gradient of its loss at
its last local model (zero until it first takes part; outside the server
state, ``Algorithm.client_state_init``). A round on a cohort ``P``:

    client k in P:  theta_k ~ argmin_theta  L_k(theta) - <g_k, theta>
                                            + (alpha / 2) ||theta - theta^{t-1}||^2
                    g_k <- g_k - alpha (theta_k - theta^{t-1})
                    send Delta_k = theta^{t-1} - theta_k
    server:         h <- h - alpha (1 / m) sum_{k in P} (theta_k - theta^{t-1})
                    theta^t = (1 / |P|) sum_{k in P} theta_k - h / alpha

The argmin is approximated by the client optimizer's local steps (SGD 0.1
by default, the paper's local solver) on the gradient ``grad L_k(theta) -
g_k + alpha (theta - theta^{t-1})``: the optimizer chained after the linear
term and :func:`fedjx.algorithms.transforms.proximal` (anchored at
``theta^{t-1}``). The server step is ``theta <- theta - ServerOpt(mean_k
Delta_k + h / alpha)``; ``ServerOpt = SGD(1)`` (the default) is the paper's
``theta^t``. ``h`` divides by the population size ``m`` (``num_clients``),
not the cohort's: it stays ``(1/m) sum_k g_k`` over all clients. The mean
of the ``theta_k`` follows ``weighting`` like every algorithm of this
package (``'uniform'`` is the paper's); ``h`` sums the ``Delta_k`` exactly.

DP aggregators are refused: ``h`` and each ``g_k`` are built from the
clients' exact updates, a release beside the aggregate that a DP
aggregator does not cover. FedDyn is not personalized: evaluation uses
``theta``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit

# What a round releases beside the aggregate (``Algorithm.unprivatized``).
UNPRIVATIZED = ('its h and each client\'s g_k are built from the exact updates, '
                'a release beside the aggregate that the noise does not cover')


class FedDynState(NamedTuple):
  """FedDyn's server state.

  Attributes:
    params: the server model ``theta``.
    opt_state: the server optimizer's state.
    h: the server's ``h``, the params' structure.
    hparams: ``alpha`` and the optimizers' (and the aggregator's).
    round_index: rounds run so far.
    aggregator_state: the aggregator's state (``()`` when it has none).
  """

  params: kit.Params
  opt_state: optax.OptState
  h: kit.Params
  hparams: dict[str, Any]
  round_index: jax.Array
  aggregator_state: Any = ()


def linear_term(gradient: kit.Params) -> optax.GradientTransformation:
  """The gradient of ``- <g_k, theta>``: ``g -> g - g_k`` (no state)."""
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    return jax.tree.map(jnp.subtract, updates, gradient), state

  return optax.GradientTransformation(init, update)


# fedavg's options but the client transform (FedDyn's regularizer).
OPTIONS = kit.without('client_transform')


@kit.with_options(OPTIONS)
def feddyn(loss_fn: kit.LossFn, num_clients: int, *, alpha: float = 0.01,
           **options: Any) -> kit.Algorithm:
  """FedDyn over a population of ``num_clients`` clients (``m``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_clients: the population size ``m`` that ``h`` divides by.
    alpha: the regularization ``alpha > 0`` (``state.hparams['alpha']``,
      traced; the paper tunes it in {0.1, 0.01, 0.001}).
    client_optimizer: the local solver (default SGD 0.1), on the gradient
      with FedDyn's linear and quadratic terms.
    server_optimizer: on ``mean_k Delta_k + h / alpha`` (default SGD 1.0:
      the paper's step).
    aggregator: the mean of the ``Delta_k`` (non-private aggregators only).
    metrics_fn, local_epochs, local_steps, weighting, client_evaluation,
    skip_nonfinite, client_metrics: as :func:`~fedjx.algorithms.fedavg`; a
      skipped client's ``g_k`` is unchanged and its update is out of ``h``.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm` (state :class:`FedDynState`),
    with ``client_state_init``: rows are the clients' ``g_k``.
  """
  name = 'feddyn'
  o = kit.take_options(name, options, OPTIONS)
  kit.check_positive_int(name, 'num_clients', num_clients)
  kit.check_number(name, 'alpha', alpha, strict=True)  # h / alpha.
  client_optimizer, server_optimizer, aggregator, schedule = kit.check_parts(
      name, dict(o, client_transform=None))
  kit.check_private_uploads(name, aggregator, UNPRIVATIZED)
  metrics_fn, client_metrics = o['metrics_fn'], o['client_metrics']
  m = num_clients

  def init(params):
    return FedDynState(
        params=params, opt_state=server_optimizer.init(params),
        h=jax.tree.map(jnp.zeros_like, params),
        hparams=kit.combine_hparams(
            name,
            algorithm={'alpha': jnp.asarray(alpha, jnp.float32),
                       'client_optimizer': kit.optimizer_hparams(client_optimizer, params),
                       'server_optimizer': kit.optimizer_hparams(server_optimizer, params)},
            aggregator=kit.aggregator_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def client_state_init(params):  # g_k = 0 before the first round.
    return jax.tree.map(jnp.zeros_like, params)

  def client_fn(x, g_k, alpha_, hparams, batches, mask):
    optimizer = optax.chain(linear_term(g_k), kit.proximal(alpha_),
                            client_optimizer)
    state = (optax.EmptyState(), kit.ProximalState(anchor=x),
             kit.with_hparams(client_optimizer.init(x), hparams))
    out = kit.local_update(loss_fn, metrics_fn, optimizer, x, state,
                           batches, mask, schedule)
    delta = kit.tree_sub(x, out.params)                 # theta^{t-1} - theta_k
    g_new = jax.tree.map(lambda g, d: g + alpha_ * d, g_k, delta)
    extra = (delta, kit.client_metrics(delta, out)) if client_metrics else delta
    return kit.ClientOutput(delta, out.stats, extra=extra, state=g_new,
                            previous_state=g_k, checked=out.params)

  def round_fn(state, cohort, key):
    a = state.hparams['alpha']
    clients = kit.map_clients(
        aggregator, state.hparams, client_fn,
        (fedjx.broadcast(state.params), cohort.client_states,
         fedjx.broadcast(a), fedjx.broadcast(state.hparams['client_optimizer']),
         cohort.batches, cohort.mask),
        cohort.num_examples, o['weighting'], o['skip_nonfinite'],
        aggregator_state=state.aggregator_state, client_ids=cohort.client_ids)
    deltas, per_client = clients.extra if client_metrics else (clients.extra, {})
    mean_delta, agg_state, agg_metrics = kit.aggregate(
        aggregator, state.aggregator_state, state.hparams, clients, key)
    h = jax.tree.map(lambda h, s: h + a * s / m, state.h,  # -(a/m) sum (theta_k - theta)
                     fedjx.reduce_sum(deltas))
    pseudo_grad = jax.tree.map(lambda d, h: d + h / a, mean_delta, h)
    params, opt_state = kit.server_update(
        server_optimizer, state.opt_state, state.hparams['server_optimizer'],
        state.params, pseudo_grad)
    metrics = kit.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad),
        h_norm=optax.tree.norm(h), **agg_metrics)
    metrics.update(per_client)  # Per-client [C] metrics, if asked.
    state = state._replace(params=params, opt_state=opt_state, h=h,
                           round_index=state.round_index + 1,
                           aggregator_state=agg_state)
    return state, metrics, clients.state

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o,
                            client_state_init=client_state_init,
                            unprivatized=UNPRIVATIZED)


__all__ = ['FedDynState', 'feddyn', 'linear_term']
