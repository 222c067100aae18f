"""Mime and MimeLite: the server optimizer's statistics, frozen, at the clients.

Karimireddy, Jaggi, Kale, Mohri, Reddi, Stich, Suresh, "Breaking the
centralized barrier for cross-device federated learning", NeurIPS 2021
(arXiv 2008.03606, "Mime: Mimicking Centralized Stochastic Algorithms in
Federated Learning"), Algorithm 1. A base optimizer ``B = (U, V)`` with
state ``s`` (momentum, Adam's moments): ``U(g, s)`` is the step it takes
from a gradient, ``V(g, s)`` its new state. Here ``B`` is any optax
optimizer, ``U(g, s) = B.update(g, s, y)[0]`` and ``V(g, s) = B.update(g,
s, x)[1]``, its learning rate included. A round on a cohort with weights
``w_i`` (``n_i``, or 1):

    server:    broadcast x and s
               (Mime) c = sum_i w_i grad f_i(x) / sum_i w_i       (a first map)
    client i:  y_i <- x;  K times, on a batch b of its data:
                 g = grad f_i(y_i; b)                              (MimeLite)
                 g = grad f_i(y_i; b) - grad f_i(x; b) + c         (Mime)
                 y_i <- y_i + U(g, s)                              (s frozen)
               send Delta_i = x - y_i  (MimeLite: and grad f_i(x), full batch)
    server:    x <- x + ServerOpt(sum_i w_i Delta_i / sum_i w_i)
               s <- V(sum_i w_i grad f_i(x) / sum_i w_i, s)

``grad f_i(x)`` is the full-batch gradient of client ``i``'s data of the
round (all real examples of its cohort batches) at the server model. With
``ServerOpt = SGD(1)`` (the default) ``x`` becomes the clients' weighted mean
``y_i``, the paper's; SGD with learning rate ``eta_g`` is FedJAX's
``server_learning_rate`` (``fedjax/algorithms/mime_lib.py``, ``mime_lite.py``).
Mime's correction is SVRG's: its mean over the client's batches is ``c``'s
direction, so client drift is removed along with the statistics' staleness.

The correction reaches the client optimizer as a loss with the same value
and the corrected gradient (:func:`svrg_loss`), so the clients' training is
the shared loop, :func:`fedjx.algorithms.client_update.local_update`, with
the frozen optimizer :func:`frozen` (an optax transformation whose state
does not move).

Aggregators. MimeLite sends ``(Delta_i, grad f_i(x))`` as one message, so a
DP aggregator clips and noises both together: one Gaussian mechanism a
round on the joint vector, which the accounting covers. Mime releases the
gradients before the updates (``c`` is needed to train), two releases a
round of which an aggregator sees one: it takes non-private aggregators
only (for its ``Delta_i``; ``c`` is the exact mean) and refuses DP ones.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit


class MimeState(NamedTuple):
  """Mime's and MimeLite's server state.

  Attributes:
    params: the server model ``x``.
    base_state: the base optimizer's state ``s`` (the clients apply it frozen).
    opt_state: the server optimizer's state.
    hparams: ``base_optimizer`` and ``server_optimizer`` hyperparameters (and
      the aggregator's).
    round_index: rounds run so far.
    aggregator_state: the aggregator's state (``()`` when it has none).
  """

  params: kit.Params
  base_state: optax.OptState
  opt_state: optax.OptState
  hparams: dict[str, Any]
  round_index: jax.Array
  aggregator_state: Any = ()


def frozen(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """``U(g, s)``: ``optimizer``'s update whose state ``s`` never changes."""

  def update(updates, state, params=None):
    step, _ = optimizer.update(updates, state, params)
    return step, state

  return optax.GradientTransformation(optimizer.init, update)


def full_gradient(loss_fn: kit.LossFn, params: kit.Params,
                  batches: Any, mask: jax.Array) -> kit.PyTree:
  """``grad f_i(x) = (1/n_i) sum_e grad loss(x, e)`` over a client's real examples.

  One client's (inside ``map_fn``): a scan over its ``S`` batches as a tree
  (:func:`fedjx.algorithms.client_update.scan_steps`), where batches that
  are padding for every client run together are skipped; zero for a client
  with no data.
  """
  def total(p, batch, m):
    return jnp.sum(jnp.where(m, loss_fn(p, batch), 0.0))

  def add(acc, batch, m):
    return jax.tree.map(jnp.add, acc, jax.grad(total)(params, batch, m))

  def step(acc, x, is_real):
    # Entered only when a client run with this one has a real batch here
    # (scan_steps); a client's padding batch adds a zero gradient (m False).
    del is_real
    return add(acc, *x), None

  zeros = kit.tie_to(jax.tree.map(jnp.zeros_like, params), mask)
  sums, _ = kit.scan_steps(step, zeros, (batches, mask),
                           jnp.any(mask, axis=-1))
  n = jnp.maximum(jnp.sum(mask), 1)
  return jax.tree.map(lambda s: s / n.astype(s.dtype), sums)


def svrg_loss(loss_fn: kit.LossFn, anchor: kit.Params,
              control: kit.PyTree) -> kit.LossFn:
  """``loss_fn`` with Mime's gradient: ``grad l_e(y) - grad l_e(x) + c``.

  Per example ``e``, ``l_e(y) + (t_e(y) - stop_gradient(t_e(y)))`` with
  ``t_e(y) = <c, y> - <grad l_e(x), y>``: the value is ``l_e(y)`` (so the
  training loss reported is the loss), the gradient the corrected one.
  ``<grad l_e(x), y>`` for every example at once is the JVP of the
  per-example losses at ``x = anchor`` in the direction ``y``; its gradient
  in ``y`` is a VJP at ``x``, the cost of one more gradient.
  """
  def loss(y, batch):
    _, at_x = jax.jvp(lambda p: loss_fn(p, batch), (anchor,), (y,))
    dot_c = sum(jnp.vdot(c, p) for c, p in zip(jax.tree.leaves(control),
                                               jax.tree.leaves(y)))
    t = dot_c - at_x
    return loss_fn(y, batch) + (t - jax.lax.stop_gradient(t))

  return loss


OPTIONS: dict[str, Any] = {
    'base_optimizer': None,
    'server_optimizer': None,
    'local_epochs': 1,
    'local_steps': None,
    'aggregator': None,
    **kit.COMMON_OPTIONS,
}


# What a Mime round releases beside the aggregate (``Algorithm.unprivatized``);
# MimeLite's one message per client is all it releases (None).
UNPRIVATIZED = ('it releases the cohort\'s exact full-batch gradients c at the '
                'server model before the updates, a second release the noise '
                'does not cover (mime_lite sends one message per client, which '
                'a DP aggregator privatizes)')


def _build(name: str, loss_fn: kit.LossFn, options: dict[str, Any],
           control_variate: bool) -> kit.Algorithm:
  o = kit.take_options(name, options, OPTIONS)
  base_optimizer = o['base_optimizer'] or kit.default_sgd(0.01, momentum=0.9)
  server_optimizer = o['server_optimizer'] or kit.default_sgd(1.0)
  kit.check_optimizer(name, 'base_optimizer', base_optimizer)
  kit.check_optimizer(name, 'server_optimizer', server_optimizer)
  kit.check_choice(name, 'weighting', o['weighting'], kit.WEIGHTINGS)
  aggregator = kit.check_aggregator(name, o['aggregator'])
  unprivatized = UNPRIVATIZED if control_variate else None
  kit.check_private_uploads(name, aggregator, unprivatized)
  kit.check_skip_nonfinite(name, o['skip_nonfinite'])
  schedule = kit.check_schedule(name, o['local_epochs'],
                                o['local_steps'], o['client_evaluation'])
  metrics_fn, weighting, guard = o['metrics_fn'], o['weighting'], o['skip_nonfinite']
  local = frozen(base_optimizer)

  def init(params):
    # MimeLite's message is (Delta_i, grad f_i(x)); Mime's Delta_i.
    message = params if control_variate else (params, params)
    return MimeState(
        params=params, base_state=base_optimizer.init(params),
        opt_state=server_optimizer.init(params),
        hparams=kit.combine_hparams(
            name,
            algorithm={'base_optimizer': kit.optimizer_hparams(base_optimizer, params),
                       'server_optimizer': kit.optimizer_hparams(server_optimizer, params)},
            aggregator=kit.aggregator_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(message))

  def gradient_fn(x, batches, mask):
    return kit.ClientOutput(full_gradient(loss_fn, x, batches, mask), {})

  def client_fn(x, s, c, batches, mask):
    loss = svrg_loss(loss_fn, x, c) if control_variate else loss_fn
    out = kit.local_update(loss, metrics_fn, local, x, s, batches,
                           mask, schedule)
    delta = kit.tree_sub(x, out.params)
    if control_variate:
      return kit.ClientOutput(delta, out.stats, checked=out.params)
    grad = full_gradient(loss_fn, x, batches, mask)
    return kit.ClientOutput((delta, grad), out.stats,
                            checked=(out.params, grad))

  def round_fn(state, cohort, key):
    x = state.params
    s = kit.with_hparams(state.base_state, state.hparams['base_optimizer'])
    if control_variate:  # c: the cohort's full-batch gradient at x.
      grads = kit.map_guarded(
          gradient_fn, (fedjx.broadcast(x), cohort.batches, cohort.mask),
          kit.aggregation_weights(cohort.num_examples, weighting),
          cohort.num_examples, guard)
      c = kit.weighted_mean(grads)
    else:
      c = ()
    clients = kit.map_clients(
        aggregator, state.hparams, client_fn,
        (fedjx.broadcast(x), fedjx.broadcast(s), fedjx.broadcast(c),
         cohort.batches, cohort.mask),
        cohort.num_examples, weighting, guard,
        aggregator_state=state.aggregator_state, client_ids=cohort.client_ids)
    combined, agg_state, agg_metrics = kit.aggregate(
        aggregator, state.aggregator_state, state.hparams, clients, key)
    pseudo_grad, grad = (combined, c) if control_variate else combined
    params, opt_state = kit.server_update(
        server_optimizer, state.opt_state, state.hparams['server_optimizer'],
        x, pseudo_grad)
    _, base_state = base_optimizer.update(grad, s, x)     # s <- V(grad f(x), s)
    metrics = kit.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad),
        server_gradient_norm=optax.tree.norm(grad), **agg_metrics)
    return state._replace(params=params, base_state=base_state,
                          opt_state=opt_state, round_index=state.round_index + 1,
                          aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o,
                            unprivatized=unprivatized)


@kit.with_options(OPTIONS)
def mime_lite(loss_fn: kit.LossFn, **options: Any) -> kit.Algorithm:
  """MimeLite: clients step with the base optimizer's frozen server state.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    base_optimizer: ``B``, any optax optimizer, learning rate included
      (default: SGD, learning rate 0.01, momentum 0.9, injected); its state
      ``s`` is updated on the server with the cohort's full-batch gradient
      at ``x`` and applied, frozen, at every client step.
    server_optimizer: on the mean ``Delta_i`` (default SGD 1.0: ``x`` becomes
      the mean ``y_i``; SGD ``eta_g`` is FedJAX's ``server_learning_rate``).
    aggregator: combines the messages ``(Delta_i, grad f_i(x))`` (a DP
      aggregator clips and noises them together).
    local_epochs, local_steps, metrics_fn, weighting, client_evaluation,
    skip_nonfinite: as :func:`~fedjx.algorithms.fedavg`.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`MimeState`. Metrics add ``server_gradient_norm``
    (``||sum_i w_i grad f_i(x) / sum_i w_i||``).
  """
  return _build('mime_lite', loss_fn, options, control_variate=False)


@kit.with_options(OPTIONS)
def mime(loss_fn: kit.LossFn, **options: Any) -> kit.Algorithm:
  """Mime: MimeLite plus the SVRG control variate at the server model.

  A round maps over the cohort twice: once for ``c``, the full-batch
  gradient at ``x``, then to train with ``grad f_i(y; b) - grad f_i(x; b) +
  c``. Arguments as :func:`mime_lite`, but ``aggregator`` combines the
  ``Delta_i`` only and may not be a DP mechanism (module docstring).
  """
  return _build('mime', loss_fn, options, control_variate=True)


__all__ = ['MimeState', 'frozen', 'full_gradient', 'mime', 'mime_lite',
           'svrg_loss']
