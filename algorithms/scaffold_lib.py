"""SCAFFOLD: stochastic controlled averaging.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1 with option II. The server keeps the model
``x`` and a control variate ``c``; each of the ``N`` clients of the population
keeps its own ``c_i`` (all zero at first). A round on a cohort ``S``:

    client i in S:  y_i <- x
                    K times:  y_i <- y_i - eta_l (g_i(y_i) - c_i + c)
                    c_i+ = c_i - c + (x - y_i) / (K eta_l)          (option II)
                    send  Delta y_i = y_i - x,  Delta c_i = c_i+ - c_i
    server:         x <- x + eta_g sum_i w_i Delta y_i / sum_i w_i
                    c <- c + (1 / N) sum_{i in S} Delta c_i

The paper averages ``Delta y_i`` uniformly; here the weights ``w_i`` follow
``weighting`` like every algorithm of this package (``'uniform'`` is the
paper's). ``K`` is the number of real local steps client ``i`` took, so
padding never changes ``c_i``. ``eta_g`` is the server optimizer (SGD with
learning rate ``eta_g``, 1 by default); ``c`` stays the mean of all ``c_i``.

Where the ``c_i`` live (``client_state``, docs/client_state.md):

* ``'dense'`` (the default): in the server state (``state.client_states``),
  one ``[N, ...]`` array per parameter indexed by ``cohort.client_ids``
  (distinct within a cohort, in ``[0, N)``): ``N`` copies of the model, fine
  for small populations.
* ``'store'``: outside the server state, in a
  :class:`fedjx.client_store.ClientStore` on the host. The algorithm's
  ``client_state_init`` is ``zeros_like(params)`` (the ``c_i`` of a client
  that never participated); the round reads the cohort's ``c_i`` from
  ``cohort.client_states`` and returns the ``c_i+`` as its third output
  (a padding or skipped client's ``c_i`` unchanged), for the caller to write
  back. The server's ``c`` update is the same, so both placements give the
  same rounds.
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
UNPRIVATIZED = ("each client's control variate change Delta c_i = c_i+ - c_i, "
                'built from its exact update and summed exactly beside the '
                'aggregate, which the noise does not cover')

TRAITS = kit.Traits(options=kit.options_but('client_transform'),
                    population='num_clients', client_state='client_state',
                    updates_reach_params=True, indexed_batches=True,
                    unprivatized=UNPRIVATIZED)
"""What SCAFFOLD declares: FedAvg's options but the client transform (its
correction); the population size ``N``; the option placing the ``c_i``;
what its round releases beside the aggregate
(:class:`~fedjx.algorithms.traits.Traits`)."""


def _check_learning_rate(fn: str, client_learning_rate: float | None,
                         client_optimizer) -> float:
  """``eta_l``: given, or the optimizer's; a mismatch is refused.

  Option II's ``c_i+`` divides by ``K eta_l``: with an optimizer stepping at
  another rate the controls would be silently wrong.
  """
  lr = None
  if client_optimizer is not None:
    try:
      lr = transforms.learning_rate_of(client_optimizer,
                                       jnp.zeros((1,), jnp.float32))
    except Exception:  # pylint: disable=broad-except
      lr = None  # An optimizer that cannot be probed: eta_l as given.
  if client_learning_rate is None:
    return 0.1 if lr is None else float(lr)
  if lr is not None and not bool(jnp.isclose(lr, client_learning_rate,
                                             rtol=2.0 ** -23, atol=0.0)):
    raise ValueError(
        f'{fn}: client_learning_rate={client_learning_rate!r} differs from '
        f'the client optimizer\'s learning_rate={float(lr)!r}; option II '
        'divides by K eta_l, so they must agree (or omit client_learning_rate).')
  return client_learning_rate


CLIENT_STATES = ('dense', 'store')


@kit.declare(TRAITS)
def scaffold(loss_fn: kit.LossFn, num_clients: int, *,
             client_learning_rate: float | None = None,
             client_state: str = 'dense',
             **options: Any) -> kit.Algorithm:
  """SCAFFOLD (option II) over a population of ``num_clients`` clients.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_clients: population size ``N`` (client ids lie in ``[0, N)``).
    client_learning_rate: local step size ``eta_l`` (traced, in
      ``state.hparams['client_learning_rate']``); None (the default) takes
      the client optimizer's injected ``learning_rate``, or 0.1.
    client_state: where the ``c_i`` live: ``'dense'`` (``[N, ...]`` arrays
      in ``state.client_states``) or ``'store'`` (outside the state: the
      round reads them from ``cohort.client_states`` and returns
      ``(state, metrics, client_states)``, the cohort's ``c_i+``).
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``client_transform``:
      ``client_optimizer`` by default SGD with ``eta_l``, as in the paper;
      another optimizer receives the corrected gradient ``g - c_i + c``
      (chained after :func:`fedjx.algorithms.transforms.control_variate`),
      and option II still divides by ``K eta_l``, so an optimizer whose
      injected ``learning_rate`` differs from ``client_learning_rate`` is
      refused; ``server_optimizer`` on the pseudo-gradient ``-sum w_i Delta
      y_i / sum w_i`` (default SGD with ``eta_g = 1``); ``aggregator``
      combines the ``Delta y_i`` (the ``Delta c_i`` are always summed
      exactly); a skipped client's ``c_i`` is left unchanged and its
      ``Delta c_i`` is 0.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` is ``c``.
  """
  name = 'scaffold'
  kit.check_positive_int(name, 'num_clients', num_clients)
  kit.check_choice(name, 'client_state', client_state, CLIENT_STATES)
  given = options.get('client_optimizer')
  if given is not None:  # Its learning rate is probed below.
    kit.Options.of(name, {'client_optimizer': given})
  client_learning_rate = _check_learning_rate(name, client_learning_rate, given)
  # Option II divides by K eta_l: eta_l = 0 would make every c_i 0 / 0.
  kit.check_number(name, 'client_learning_rate', client_learning_rate,
                   strict=True)
  # Without a client optimizer of its own, SGD at the traced eta_l.
  o = kit.Options.of(name, options, TRAITS.options, client_optimizer=given)
  kit.check_private_uploads(name, o.aggregator, UNPRIVATIZED)
  n_pop = num_clients

  def client(c):  # c.sent = c (the server's control), c.state = c_i.
    eta_l = c.hparams['client_learning_rate']
    c_i = jax.tree.map(lambda p, r: jnp.asarray(r, jnp.result_type(p)),
                       c.x, c.state)
    trained = c.train(  # Steps on g_i(y) - c_i + c.
        transforms.control_variate(c.sent, c_i),
        optimizer=optax.sgd(eta_l) if given is None else None)
    k = trained.num_steps
    denom = jnp.where(k > 0, k * eta_l, 1.0)

    def option_ii(ci, c, x, y):  # c_i+ = c_i - c + (x - y_i) / (K eta_l)
      return jnp.where(k > 0, ci - c + (x - y) / denom, ci) - ci

    delta_c = jax.tree.map(option_ii, c_i, c.sent, c.x, trained.params)
    return kit.Upload(optax.tree.sub(c.x, trained.params), trained,
                      extra=delta_c, state=jax.tree.map(jnp.add, c_i, delta_c))

  def server(s):  # c <- c + (1 / N) sum_i Delta c_i
    control = jax.tree.map(lambda c, d: c + d / n_pop, s.state.extras,
                           fedjx.reduce_sum(s.clients.extra))
    return kit.Step(s.aggregate, extras=control,
                    metrics={'control_norm': optax.tree.norm(control)})

  return kit.algorithm(
      name, loss_fn, o, client=client, server=server,
      prepare=lambda state, cohort: state.extras,
      hparams={'client_learning_rate': client_learning_rate},
      extras=zeros_like, traits=TRAITS,
      client_state=kit.ClientState(
          zeros_like, num_clients if client_state == 'dense' else None))


def zeros_like(params: kit.Params) -> kit.Params:
  """One client's ``c_i`` before it participates: zeros shaped like ``params``."""
  return jax.tree.map(jnp.zeros_like, params)
