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

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms.transforms import core as transforms

# What a round releases beside the aggregate (``Traits.unprivatized``).
UNPRIVATIZED = ('its h and each client\'s g_k are built from the exact updates, '
                'a release beside the aggregate that the noise does not cover')

TRAITS = kit.Traits(options=kit.options_but('client_transform'),
                    population='num_clients', unprivatized=UNPRIVATIZED)
"""What FedDyn declares: FedAvg's options but the client transform (its
regularizer); the population size ``m`` (``num_clients``); what its round
releases beside the aggregate (:class:`~fedjx.algorithms.traits.Traits`)."""


def linear_term(gradient: kit.Params) -> optax.GradientTransformation:
  """The gradient of ``- <g_k, theta>``: ``g -> g - g_k`` (no state)."""
  return optax.stateless(lambda updates, params: jax.tree.map(
      jnp.subtract, updates, gradient))


def _zeros(params: kit.Params) -> kit.Params:
  return jax.tree.map(jnp.zeros_like, params)


@kit.declare(TRAITS)
def feddyn(loss_fn: kit.LossFn, num_clients: int, *, alpha: float = 0.01,
           **options: Any) -> kit.Algorithm:
  """FedDyn over a population of ``num_clients`` clients (``m``).

  The template's round (:func:`fedjx.algorithms.kit.algorithm`) with
  FedDyn's client (the linear and quadratic terms, ``g_k`` in its row) and
  server (``h`` in ``state.extras``, the pseudo-gradient ``mean_k Delta_k +
  h / alpha``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_clients: the population size ``m`` that ``h`` divides by.
    alpha: the regularization ``alpha > 0`` (``state.hparams['alpha']``,
      traced; the paper tunes it in {0.1, 0.01, 0.001}).
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``client_transform``:
      ``client_optimizer`` is the local solver (default SGD 0.1), on the
      gradient with FedDyn's linear and quadratic terms;
      ``server_optimizer`` steps on ``mean_k Delta_k + h / alpha`` (default
      SGD 1.0: the paper's step); ``aggregator`` takes the mean of the
      ``Delta_k`` (non-private aggregators only); a skipped client's ``g_k``
      is unchanged and its update is out of ``h``.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` is ``h``, with
    ``client_state_init``: rows are the clients' ``g_k``.
  """
  name = 'feddyn'
  kit.check_positive_int(name, 'num_clients', num_clients)
  kit.check_number(name, 'alpha', alpha, strict=True)  # h / alpha.
  o = kit.Options.of(name, options, TRAITS.options)
  kit.check_private_uploads(name, o.aggregator, UNPRIVATIZED)
  m = num_clients

  def client(c):  # c.x = theta^{t-1}, c.state = g_k
    a = c.hparams['alpha']
    trained = c.train(linear_term(c.state), transforms.proximal(a))
    delta = optax.tree.sub(c.x, trained.params)        # theta^{t-1} - theta_k
    g_new = jax.tree.map(lambda g, d: g + a * d, c.state, delta)
    return kit.Upload(delta, trained, extra=delta, state=g_new)

  def server(s):  # h <- h - (a/m) sum_k (theta_k - theta); then the step.
    a = s.state.hparams['alpha']
    h = jax.tree.map(lambda h, d: h + a * d / m, s.state.extras,
                     fedjx.reduce_sum(s.clients.extra))
    return kit.Step(jax.tree.map(lambda d, h: d + h / a, s.aggregate, h),
                    extras=h, metrics={'h_norm': optax.tree.norm(h)})

  return kit.algorithm(name, loss_fn, o, client=client, server=server,
                       hparams={'alpha': alpha}, extras=_zeros,
                       client_state=kit.ClientState(_zeros), traits=TRAITS)


__all__ = ['feddyn', 'linear_term']
