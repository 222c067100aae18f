"""Client-side variants as optax transformations, chained with any optimizer.

A client-side variant of FedAvg changes the gradient that the client's
optimizer sees at every local step. Written as an
``optax.GradientTransformation``, it chains in front of any client optimizer,
``optax.chain(variant, client_optimizer)``, instead of being a copy of
FedAvg's round:

* :func:`proximal` (FedProx, Li et al., MLSys 2020, Algorithm 2): the
  gradient of ``h_i(y; x) = F_i(y) + (mu / 2) ||y - x||^2``,

      g  ->  g + mu (y - x),

  anchored at ``x``, the model the client received. The client's optimizer
  is initialised from ``x`` at the start of every round, so ``init(x)``
  records the anchor.
* :func:`control_variate` (SCAFFOLD, Karimireddy et al., ICML 2020,
  Algorithm 1): the drift correction with the server's control variate ``c``
  and the client's own ``c_i``,

      g  ->  g - c_i + c.

Both are per client: they run inside ``fedjx.map_fn``, where ``x``, ``c``
and ``c_i`` are that client's values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjx.algorithms.base import Params


class ProximalState(NamedTuple):
  """:func:`proximal`'s state: the anchor ``x`` (the model the client received)."""

  anchor: Params


def proximal(mu: float | jax.Array) -> optax.GradientTransformation:
  """Adds the gradient of ``(mu / 2) ||y - x||^2``: ``g -> g + mu (y - x)``.

  ``x`` is the parameters ``init`` was called with (the model the client
  received this round) and ``y`` the parameters passed to ``update``.
  ``update`` needs ``params``. ``mu`` may be traced, e.g. through
  ``optax.inject_hyperparams(proximal)(mu=0.01)``.

  Example (FedProx's client optimizer)::

    optax.chain(proximal(0.01), optax.sgd(0.1))
  """
  def init(params):
    return ProximalState(anchor=params)

  def update(updates, state, params=None):
    if params is None:
      raise ValueError('proximal: update needs params (the current model y); '
                       'got params=None.')
    new = jax.tree.map(lambda g, y, x: g + mu * (y - x), updates, params,
                       state.anchor)
    return new, state

  return optax.GradientTransformation(init, update)


def control_variate(server_control: Params,
                    client_control: Params) -> optax.GradientTransformation:
  """SCAFFOLD's correction ``g -> g - c_i + c`` (``c``: server, ``c_i``: client).

  The controls are fixed for the round, so the transformation has no state;
  build it per client with that client's ``c_i``.
  """
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    new = jax.tree.map(lambda g, ci, c: g - ci + c, updates, client_control,
                       server_control)
    return new, state

  return optax.GradientTransformation(init, update)


def learning_rate_of(optimizer: optax.GradientTransformation,
                     params: Params) -> jax.Array | None:
  """The injected ``learning_rate`` of an optimizer (or of a chain's last one).

  None when the optimizer does not expose one (no
  ``optax.inject_hyperparams``); a schedule's current value is not read.
  """
  state = optimizer.init(params)
  states = (state,) if hasattr(state, 'hyperparams') or not isinstance(
      state, tuple) else state
  for s in reversed(states):
    hp = getattr(s, 'hyperparams', None)
    if hp is not None and 'learning_rate' in hp:
      return jnp.asarray(hp['learning_rate'])
  return None


__all__ = ['ProximalState', 'control_variate', 'learning_rate_of', 'proximal']
