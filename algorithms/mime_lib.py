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

The round is the template's (:func:`fedjx.algorithms.kit.algorithm`): the
server prepares ``s`` (``state.extras``, with its traced hyperparameters)
and Mime's ``c``; the client hook trains with ``B`` frozen; the server hook
moves ``s``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base


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

  zeros = client_update.tie_to(jax.tree.map(jnp.zeros_like, params), mask)
  sums, _ = client_update.scan_steps(step, zeros, (batches, mask),
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


# What a Mime round releases beside the aggregate (``Traits.unprivatized``);
# MimeLite's one message per client is all it releases (None).
UNPRIVATIZED = ('it releases the cohort\'s exact full-batch gradients c at the '
                'server model before the updates, a second release the noise '
                'does not cover (mime_lite sends one message per client, which '
                'a DP aggregator privatizes)')

MIME_LITE = kit.Traits(options=kit.options_but(
    'client_optimizer', 'client_transform', 'client_metrics'))
"""What MimeLite declares: FedAvg's options but the client optimizer (the
base optimizer, frozen, is the clients'), the client transform and
per-client metrics (:class:`~fedjx.algorithms.traits.Traits`)."""
MIME = MIME_LITE._replace(unprivatized=UNPRIVATIZED)
"""What Mime declares: MimeLite's, and its control variate is a second
release."""


def _build(name: str, loss_fn: kit.LossFn, base_optimizer: Any,
           options: dict[str, Any], control_variate: bool) -> kit.Algorithm:
  traits = MIME if control_variate else MIME_LITE
  o = kit.Options.of(
      name, options, traits.options,
      client_optimizer=base_optimizer or kit.default_sgd(0.01, momentum=0.9),
      names=('base_optimizer', 'server_optimizer'))
  kit.check_private_uploads(name, o.aggregator, traits.unprivatized)
  base_optimizer = o.client_optimizer
  local = frozen(base_optimizer)

  def gradient_fn(x, batches, mask):
    return nonfinite.ClientOutput(full_gradient(loss_fn, x, batches, mask), {})

  def prepare(state, cohort):  # s, and Mime's c: the cohort's gradient at x.
    s = kit.with_hparams(state.extras, state.hparams['base_optimizer'])
    if not control_variate:
      return s, ()
    grads = nonfinite.map_clients(
        gradient_fn, (fedjx.broadcast(state.params), cohort.batches, cohort.mask),
        base.aggregation_weights(cohort.num_examples, o.weighting),
        cohort.num_examples, o.skip_nonfinite)
    return s, nonfinite.weighted_mean(grads)

  def client(c):
    s, cv = c.sent
    loss = svrg_loss(loss_fn, c.x, cv) if control_variate else None
    trained = c.train(optimizer=local, opt_state=s, loss_fn=loss)
    delta = optax.tree.sub(c.x, trained.params)
    if control_variate:
      return kit.Upload(delta, trained)
    grad = full_gradient(loss_fn, c.x, c.batches, c.mask)
    return kit.Upload((delta, grad), trained, checked=(trained.params, grad))

  def server(srv):
    s, cv = srv.sent
    pseudo_grad, grad = ((srv.aggregate, cv) if control_variate
                         else srv.aggregate)
    _, base_state = base_optimizer.update(grad, s, srv.state.params)  # V
    return kit.Step(pseudo_grad, extras=base_state,
                    metrics={'server_gradient_norm': optax.tree.norm(grad)})

  return kit.algorithm(
      name, loss_fn, o, client=client, server=server, prepare=prepare,
      extras=base_optimizer.init, traits=traits,
      upload=None if control_variate else (lambda params: (params, params)))


@kit.declare(MIME_LITE)
def mime_lite(loss_fn: kit.LossFn, *,
              base_optimizer: optax.GradientTransformation | None = None,
              **options: Any) -> kit.Algorithm:
  """MimeLite: clients step with the base optimizer's frozen server state.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    base_optimizer: ``B``, any optax optimizer, learning rate included
      (default: SGD, learning rate 0.01, momentum 0.9, injected); its state
      ``s`` (``state.extras``) is updated on the server with the cohort's
      full-batch gradient at ``x`` and applied, frozen, at every client step.
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``client_optimizer``,
      ``client_transform`` and ``client_metrics``: ``server_optimizer`` on
      the mean ``Delta_i`` (default SGD 1.0: ``x`` becomes the mean ``y_i``;
      SGD ``eta_g`` is FedJAX's ``server_learning_rate``); ``aggregator``
      combines the messages ``(Delta_i, grad f_i(x))`` (a DP aggregator
      clips and noises them together).

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` is ``s``.
    Metrics add ``server_gradient_norm`` (``||sum_i w_i grad f_i(x) / sum_i
    w_i||``).
  """
  return _build('mime_lite', loss_fn, base_optimizer, options,
                control_variate=False)


@kit.declare(MIME)
def mime(loss_fn: kit.LossFn, *,
         base_optimizer: optax.GradientTransformation | None = None,
         **options: Any) -> kit.Algorithm:
  """Mime: MimeLite plus the SVRG control variate at the server model.

  A round maps over the cohort twice: once for ``c``, the full-batch
  gradient at ``x``, then to train with ``grad f_i(y; b) - grad f_i(x; b) +
  c``. Arguments as :func:`mime_lite`, but ``aggregator`` combines the
  ``Delta_i`` only and may not be a DP mechanism (module docstring).
  """
  return _build('mime', loss_fn, base_optimizer, options, control_variate=True)


__all__ = ['frozen', 'full_gradient', 'mime', 'mime_lite', 'svrg_loss']
