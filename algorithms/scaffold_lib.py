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

* ``'dense'`` (the default): in the server state, one ``[N, ...]`` array per
  parameter indexed by ``cohort.client_ids`` (distinct within a cohort, in
  ``[0, N)``): ``N`` copies of the model, fine for small populations.
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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit

# What a round releases beside the aggregate (``Algorithm.unprivatized``).
UNPRIVATIZED = ("each client's control variate change Delta c_i = c_i+ - c_i, "
                'built from its exact update and summed exactly beside the '
                'aggregate, which the noise does not cover')


class ScaffoldState(NamedTuple):
  """SCAFFOLD's server state.

  Attributes:
    params: the server model ``x``.
    opt_state: the server optimizer's state.
    control: the server control variate ``c``.
    client_controls: every client's ``c_i``, leaves ``[N, ...]``
      (``client_state='dense'``); ``()`` with ``client_state='store'``.
    hparams: ``client_learning_rate`` (``eta_l``) and the optimizers'.
    round_index: rounds run so far.
    aggregator_state: the aggregator's state (``()`` when it has none).
  """

  params: kit.Params
  opt_state: optax.OptState
  control: kit.Params
  client_controls: kit.Params
  hparams: dict[str, Any]
  round_index: jax.Array
  aggregator_state: Any = ()


def _check_learning_rate(fn: str, client_learning_rate: float | None,
                         client_optimizer) -> float:
  """``eta_l``: given, or the optimizer's; a mismatch is refused.

  Option II's ``c_i+`` divides by ``K eta_l``: with an optimizer stepping at
  another rate the controls would be silently wrong.
  """
  lr = None
  if client_optimizer is not None:
    try:
      lr = kit.learning_rate_of(client_optimizer,
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


# fedavg's options but the one SCAFFOLD sets itself (its client correction).
OPTIONS = kit.without('client_transform')
CLIENT_STATES = ('dense', 'store')


@kit.with_options(OPTIONS)
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
    client_optimizer: by default SGD with ``eta_l``, as in the paper. Another
      optimizer receives the corrected gradient ``g - c_i + c`` (chained
      after :func:`fedjx.algorithms.transforms.control_variate`);
      option II still divides by ``K eta_l``, so an optimizer whose injected
      ``learning_rate`` differs from ``client_learning_rate`` is refused.
    client_state: where the ``c_i`` live: ``'dense'`` (``[N, ...]`` arrays
      in ``state.client_controls``) or ``'store'`` (outside the state: the
      round reads them from ``cohort.client_states`` and returns
      ``(state, metrics, client_states)``, the cohort's ``c_i+``).
    server_optimizer: on the pseudo-gradient ``-sum w_i Delta y_i / sum w_i``
      (default SGD with ``eta_g = 1``).
    aggregator: how the ``Delta y_i`` are combined (default the weighted
      mean); the ``Delta c_i`` are always summed exactly.
    client_metrics: also return per-client ``[C]`` metrics
      (:func:`fedjx.algorithms.base.client_metrics` of ``Delta y_i``); False
      adds nothing to the round.
    metrics_fn, local_epochs, local_steps, weighting, client_evaluation,
    skip_nonfinite: as for :func:`fedavg`; a
      skipped client's ``c_i`` is left unchanged and its ``Delta c_i`` is 0.
  """
  name = 'scaffold'
  o = kit.take_options(name, options, OPTIONS)
  client_optimizer, metrics_fn = o['client_optimizer'], o['metrics_fn']
  kit.check_positive_int(name, 'num_clients', num_clients)
  kit.check_choice(name, 'client_state', client_state, CLIENT_STATES)
  dense = client_state == 'dense'
  if client_optimizer is not None:
    kit.check_optimizer(name, 'client_optimizer', client_optimizer)
  client_learning_rate = _check_learning_rate(name, client_learning_rate,
                                              client_optimizer)
  # Option II divides by K eta_l: eta_l = 0 would make every c_i 0 / 0.
  kit.check_number(name, 'client_learning_rate', client_learning_rate,
                   strict=True)
  server_optimizer = o['server_optimizer'] or kit.default_sgd(1.0)
  kit.check_optimizer(name, 'server_optimizer', server_optimizer)
  kit.check_choice(name, 'weighting', o['weighting'], kit.WEIGHTINGS)
  aggregator = kit.check_aggregator(name, o['aggregator'])
  kit.check_private_uploads(name, aggregator, UNPRIVATIZED)
  kit.check_skip_nonfinite(name, o['skip_nonfinite'])
  client_metrics = o['client_metrics']
  kit.check_choice(name, 'client_metrics', client_metrics, (False, True))
  schedule = kit.check_schedule(name, o['local_epochs'],
                                o['local_steps'], o['client_evaluation'])
  n_pop = num_clients

  def local_optimizer(eta_l):
    return optax.sgd(eta_l) if client_optimizer is None else client_optimizer

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return ScaffoldState(
        params=params, opt_state=server_optimizer.init(params), control=zeros,
        client_controls=jax.tree.map(
            lambda p: jnp.zeros((n_pop,) + jnp.shape(p), jnp.result_type(p)),
            params) if dense else (),
        hparams=kit.combine_hparams(
            'scaffold',
            algorithm={'client_learning_rate': jnp.asarray(client_learning_rate, jnp.float32),
                       'client_optimizer': ({} if client_optimizer is None else
                           kit.optimizer_hparams(client_optimizer, params)),
                       'server_optimizer': kit.optimizer_hparams(server_optimizer, params)},
            aggregator=kit.aggregator_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def client_fn(x, c, c_i, eta_l, hparams, batches, mask):
    opt = local_optimizer(eta_l)
    opt_state = kit.with_hparams(opt.init(x), hparams)
    out = kit.local_update(  # Steps on g_i(y) - c_i + c.
        loss_fn, metrics_fn,
        optax.chain(kit.control_variate(c, c_i), opt), x,
        (optax.EmptyState(), opt_state), batches, mask, schedule)
    k = out.num_steps
    denom = jnp.where(k > 0, k * eta_l, 1.0)

    def option_ii(ci, c, x, y):  # c_i+ = c_i - c + (x - y_i) / (K eta_l)
      return jnp.where(k > 0, ci - c + (x - y) / denom, ci) - ci

    delta_c = jax.tree.map(option_ii, c_i, c, x, out.params)
    delta_y = kit.tree_sub(x, out.params)
    # Per-client metrics ride along with Delta c_i only when asked.
    extra = (delta_c, kit.client_metrics(delta_y, out)) if client_metrics else delta_c
    return kit.ClientOutput(delta_y, out.stats, extra=extra,
                            checked=out.params)

  def round_fn(state, cohort, key):
    real = cohort.num_examples > 0
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    if dense:
      c_i = kit.gather_clients(state.client_controls, ids)
    else:
      c_i = jax.tree.map(lambda p, r: jnp.asarray(r, jnp.result_type(p)),
                         state.params, cohort.client_states)
    clients = kit.map_clients(
        aggregator, state.hparams, client_fn,
        (fedjx.broadcast(state.params), fedjx.broadcast(state.control), c_i,
         fedjx.broadcast(state.hparams['client_learning_rate']),
         fedjx.broadcast(state.hparams['client_optimizer']),
         cohort.batches, cohort.mask),
        cohort.num_examples, o['weighting'], o['skip_nonfinite'],
        aggregator_state=state.aggregator_state, client_ids=ids)
    delta_c, per_client = clients.extra if client_metrics else (clients.extra, {})
    pseudo_grad, params, opt_state, agg_state, agg_metrics = kit.server_step(
        aggregator, server_optimizer, state, state.hparams['server_optimizer'],
        clients, key)  # pseudo_grad = -Delta x
    control = jax.tree.map(lambda c, s: c + s / n_pop, state.control,
                           fedjx.reduce_sum(delta_c))
    c_plus = jax.tree.map(jnp.add, c_i, delta_c)  # Delta c_i = 0 if skipped.
    if dense:
      client_controls = kit.scatter_clients(  # c_i <- c_i+ (not for padding).
          state.client_controls, ids, c_plus, real)
    else:
      client_controls = ()
      c_plus = jax.tree.map(  # A padding client's row comes back unchanged.
          lambda new, old: jnp.where(
              jnp.reshape(real, real.shape + (1,) * (new.ndim - 1)), new, old),
          c_plus, c_i)
    metrics = kit.round_metrics(clients,
                                pseudo_grad_norm=optax.tree.norm(pseudo_grad),
                                control_norm=optax.tree.norm(control),
                                **agg_metrics)
    metrics.update(per_client)  # Per-client [C] metrics, if asked.
    state = state._replace(params=params, opt_state=opt_state, control=control,
                           client_controls=client_controls,
                           round_index=state.round_index + 1,
                           aggregator_state=agg_state)
    return (state, metrics) if dense else (state, metrics, c_plus)

  return kit.make_algorithm(
      name, init, round_fn, loss_fn=loss_fn, options=o,
      client_state_init=None if dense else zeros_like, indexed_batches=True,
      unprivatized=UNPRIVATIZED)


def zeros_like(params: kit.Params) -> kit.Params:
  """One client's ``c_i`` before it participates: zeros shaped like ``params``."""
  return jax.tree.map(jnp.zeros_like, params)
