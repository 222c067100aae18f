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

The round is the template's (:func:`fedjx.algorithms.kit.algorithm`): the
client hook adds the personal steps to FedAvg's client, ``v_k`` in its row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjx.algorithms import kit
from fedjx.algorithms import client_update
from fedjx.algorithms.transforms import core as transforms

TRAITS = kit.Traits(options=kit.options_but('client_transform'))
"""What Ditto declares: FedAvg's options but the client transform (the
personal objective is Ditto's own) (:class:`~fedjx.algorithms.traits.Traits`)."""


def _copy(tree):  # A new client's v_k: a copy of the initial model.
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@kit.declare(TRAITS)
def ditto(loss_fn: kit.LossFn, *, lam: float = 0.1,
          personal_optimizer: optax.GradientTransformation | None = None,
          personal_epochs: int = 1, personal_steps: int | None = None,
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
    **options: the global update's, :func:`~fedjx.algorithms.fedavg`'s but
      ``client_transform``; a skipped client keeps its personal model.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm` (its state a
    :class:`~fedjx.algorithms.ServerState`), with ``client_state_init``:
    rows are the personal models ``v_k`` (the params' structure).
  """
  name = 'ditto'
  o = kit.Options.of(name, options, TRAITS.options)
  kit.check_number(name, 'lam', lam)
  personal_optimizer = personal_optimizer or kit.default_sgd(0.1)
  kit.check_optimizer(name, 'personal_optimizer', personal_optimizer)
  try:
    personal = client_update.check_schedule(name, personal_epochs, personal_steps, False)
  except ValueError as e:  # Named as the options are.
    raise ValueError(str(e).replace('local_', 'personal_')) from None

  def client(c):
    trained = c.train()                             # The global update w_k.
    # v_k: steps on F_k(v) + lambda/2 ||v - w||^2, the anchor w as received.
    v_new = c.train(transforms.proximal(c.hparams['lam']),
                    optimizer=personal_optimizer,
                    traced=c.hparams['personal_optimizer'], params=c.state,
                    schedule=personal).params
    return kit.Upload(optax.tree.sub(c.x, trained.params), trained,
                      state=v_new, checked=(trained.params, v_new))

  return kit.algorithm(
      name, loss_fn, o, client=client,
      hparams={'personal_optimizer': personal_optimizer, 'lam': lam},
      client_state=kit.ClientState(_copy), traits=TRAITS)


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
