"""The round template: what FedAvg and its relatives share, around an algorithm's hooks.

FedAvg (McMahan et al. 2017, Algorithm 1) and FedOpt (Reddi et al. 2021,
Algorithm 1) share one round, and so do the algorithms that change one of
its steps. :func:`algorithm` owns that round::

    x = state.params;  s = prepare(state, cohort)             (hook, optional)
    for each client i (one fedjx.map_fn, with the non-finite guard):
        Upload_i = client(Client(x, hparams, s, row_i, D_i))  (hook)
        Delta_i, its encoding m_i = Aggregator.encode(Delta_i, w_i)
        a client whose trained model is NaN or Inf is left out (weight 0,
        its row kept)
    Delta = Aggregator.combine(m_1, ..., m_n)
    Step = server(Server(state, Delta, clients, s))           (hook, optional)
    x <- x + ServerOpt(Step.pseudo_grad)                       (or Step.params)
    metrics: the clients' pooled statistics, nonfinite_clients,
        pseudo_grad_norm, the aggregator's and the hook's, communicated_bytes,
        per-client [C] metrics (client_metrics=True)
    rows out: the cohort's new client states (rows kept in the server
        state are read and written inside the map: in place when clients
        run one at a time, fedjx.mapping.Rows)

An algorithm supplies only its hooks: what a client does (``client``, FedAvg's
local steps and ``Delta_i = x - y_i`` by default), what the server does with
the aggregate (``server``, the pseudo-gradient ``Delta`` by default), what the
server sends its clients beside the model (``prepare``), the hyperparameters
and the state it keeps beyond FedAvg's (``hparams``, ``extras`` in
``ServerState.extras``) and its clients' own state (``client_state``). Its
parts and options (optimizers, local schedule, client transform, aggregator,
weighting, guard) are one checked value, :class:`Options`.

Algorithms whose rounds are not this one (asynchronous ones, which take an
``AsyncCohort``; hierarchical or personalized ones whose server model is not
the model the clients train) write their round by hand with
:func:`fedjx.algorithms.base.make_algorithm` and say why in their docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import base
from fedjx.algorithms import client_update
from fedjx.algorithms import nonfinite
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.traits import Traits

Params = base.Params
PyTree = base.PyTree


# ------------------------------------------------------------------ options

@dataclasses.dataclass(frozen=True)
class Options:
  """FedAvg's parts and options, checked once, carried as one value.

  Builders take them as keyword options (``fedavg(loss_fn,
  client_optimizer=..., local_epochs=2)``) and check them where they enter,
  with :meth:`of`; the round reads them from this value.

  Attributes:
    client_optimizer: the clients' optax optimizer (the default of
      :meth:`of`: SGD, learning rate 0.1, injected); None: the client hook
      passes its own to :meth:`Client.train`.
    server_optimizer: applied to the pseudo-gradient, ``x <- x +
      ServerOpt(g)`` (the default of :meth:`of`: SGD, learning rate 1.0:
      plain averaging); None: no server optimizer, the server hook gives the
      new model (``Step.params``).
    local_epochs: passes over each client's ``S`` steps.
    local_steps: or exactly this many local steps (cycling through the
      client's real steps).
    client_transform: an optax transformation chained in front of the
      client optimizer (:mod:`fedjx.algorithms.transforms`; FedProx's
      ``proximal(mu)``), initialised from the model each client receives;
      its injected hyperparameters live at the top level of
      ``state.hparams``. None: none.
    aggregator: how the updates are combined
      (:class:`fedjx.algorithms.aggregators.Aggregator`); None: the
      weighted mean.
    client_metrics: also return per-client ``[C]`` metrics
      (:func:`fedjx.algorithms.base.client_metrics`).
    metrics_fn: ``metrics_fn(params, batch) -> {name: [B]}``, per-example
      metrics pooled like the loss, or None.
    weighting: the client weights ``w_i``: ``'num_examples'`` (``n_i``) or
      ``'uniform'`` (an aggregator's own weights take precedence).
    client_evaluation: evaluate each client's loss and metrics on all its
      data before and after local training (``train_loss_before`` /
      ``train_loss_after``); False reports ``train_loss_during`` only.
    skip_nonfinite: leave out every client whose update or weight is NaN or
      Inf (:mod:`fedjx.algorithms.nonfinite`).
    names: the names of the client and server optimizers in
      ``state.hparams`` and in errors (DiLoCo's ``inner_optimizer`` and
      ``outer_optimizer``); not an option.
    builder: the builder's name, for errors; not an option.
  """

  client_optimizer: optax.GradientTransformation | None = None
  server_optimizer: optax.GradientTransformation | None = None
  local_epochs: int = 1
  local_steps: int | None = None
  client_transform: optax.GradientTransformation | None = None
  aggregator: Any = None
  client_metrics: bool = False
  metrics_fn: Any = None
  weighting: str = 'num_examples'
  client_evaluation: bool = True
  skip_nonfinite: bool = True
  names: tuple[str, str] = ('client_optimizer', 'server_optimizer')
  builder: str = 'Options'

  def __post_init__(self):
    fn = self.builder
    for name, optimizer in zip(self.names, (self.client_optimizer,
                                            self.server_optimizer)):
      if optimizer is not None:
        base.check_optimizer(fn, name, optimizer)
    if self.client_transform is not None:
      base.check_optimizer(fn, 'client_transform', self.client_transform)
    base.check_choice(fn, 'weighting', self.weighting, base.WEIGHTINGS)
    object.__setattr__(self, 'aggregator',
                       aggregators.check(fn, self.aggregator))
    nonfinite.check_flag(fn, self.skip_nonfinite)
    base.check_choice(fn, 'client_metrics', self.client_metrics, (False, True))
    if self.metrics_fn is not None and not callable(self.metrics_fn):
      raise ValueError(f'{fn}: metrics_fn={self.metrics_fn!r} must be '
                       'callable or None.')
    client_update.check_schedule(fn, self.local_epochs, self.local_steps,
                                 self.client_evaluation)

  @property
  def schedule(self) -> client_update.LocalSchedule:
    """The clients' :class:`~fedjx.algorithms.client_update.LocalSchedule`."""
    return client_update.LocalSchedule(self.local_epochs, self.local_steps,
                                       self.client_evaluation)

  @classmethod
  def of(cls, builder: str, given: Mapping[str, Any],
         taken: Sequence[str] | None = None, *, own: Sequence[str] = (),
         **fixed: Any) -> 'Options':
    """The options a builder was ``given``, checked: one-line errors.

    ``taken`` are the options the builder takes (default: all of
    :data:`OPTIONS`); a key of ``given`` not among them is refused, the
    error listing them with ``own``, the builder's own options. ``fixed``
    are the values the builder sets itself (FedProx's client transform).
    An optimizer the builder takes and the caller leaves unset gets
    FedAvg's default (SGD 0.1 on the clients, SGD 1.0 on the server); one
    it neither takes nor fixes is None.
    """
    taken = OPTIONS if taken is None else tuple(taken)
    for key in given:
      if key not in taken:
        raise ValueError(f'{builder}: option {key}={given[key]!r} is not '
                         f'taken; {builder} takes {sorted({*taken, *own})}.')
    values = dict(given, **fixed)
    defaults = {'client_optimizer': lambda: base.default_sgd(0.1),
                'server_optimizer': lambda: base.default_sgd(1.0)}
    for key, default in defaults.items():
      if key in taken and key not in fixed and values.get(key) is None:
        values[key] = default()
    return cls(**values, builder=builder)


OPTIONS = tuple(f.name for f in dataclasses.fields(Options)
                if f.name not in ('names', 'builder'))
"""The names of the options of :class:`Options`, as configs give them."""


def options_but(*names: str) -> tuple[str, ...]:
  """:data:`OPTIONS` less ``names`` (those a builder sets itself)."""
  for name in names:
    if name not in OPTIONS:
      raise ValueError(f'options_but: {name!r} is not one of {OPTIONS}.')
  return tuple(n for n in OPTIONS if n not in names)


def option_parameters(names: Sequence[str]) -> dict[str, inspect.Parameter]:
  """The options ``names`` as keyword parameters, with their defaults and
  annotations (what configs and ``--list`` read)."""
  fields = {f.name: f for f in dataclasses.fields(Options)}
  return {n: inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY,
                               default=fields[n].default,
                               annotation=fields[n].type) for n in names}


# --------------------------------------------------------------- the hooks

class ClientState(NamedTuple):
  """The state each client keeps between rounds (its row).

  Attributes:
    init: ``init(params) -> row``, the row of a client that has never taken
      part.
    num_clients: with a population size ``N``, the rows live in the server
      state (``ServerState.client_states``, leaves ``[N, ...]``, indexed by
      ``cohort.client_ids``); None: outside it, in a store
      (``fedjx.ClientStore``): the round reads the cohort's rows from
      ``cohort.client_states`` and returns their new values as a third
      output (docs/client_state.md).
  """

  init: Callable[[Params], PyTree]
  num_clients: int | None = None


class Client(NamedTuple):
  """What the client hook receives, for one client (inside ``fedjx.map_fn``).

  Attributes:
    x: the server model the client received.
    hparams: ``state.hparams``, as the server holds them.
    sent: what the ``prepare`` hook sent the clients (``()`` without one).
    state: the client's row (its ``ClientState``; ``()`` without one).
    batches: its data, leaves ``[S, B, ...]``.
    mask: ``[S, B]``, True for real examples.
    train: ``train(*transforms, optimizer=None, traced=None,
      opt_state=None, params=None, loss_fn=None, schedule=None) ->
      ClientUpdate``: the local steps
      (:func:`fedjx.algorithms.client_update.local_update`) of the options'
      client optimizer, or ``optimizer``, chained after ``transforms`` (each
      initialised from ``x``) and the options' client transform; from
      ``params`` (default ``x``) and ``opt_state`` (default the optimizer's
      fresh state) with the traced hyperparameters ``traced`` written in
      (default: the client optimizer's in ``hparams``; none for another
      optimizer); on ``loss_fn`` (default the algorithm's) and ``schedule``
      (default the options').
  """

  x: Params
  hparams: Mapping[str, Any]
  sent: PyTree
  state: PyTree
  batches: PyTree
  mask: jax.Array
  train: Callable[..., client_update.ClientUpdate]


class Upload(NamedTuple):
  """What the client hook returns.

  Attributes:
    update: ``Delta_i``, what the aggregator encodes and combines (its
      structure that of ``upload(params)``, the params' by default).
    trained: the :class:`~fedjx.algorithms.client_update.ClientUpdate` of
      the local steps: its statistics pool into the round's metrics, its
      ``params`` are what the non-finite guard checks.
    extra: other per-client values for the server hook
      (``Server.clients.extra``), zero for a skipped client.
    state: the client's new row (kept as it was for a skipped client).
    checked: what the guard checks instead of ``trained.params`` (None:
      those).
  """

  update: PyTree
  trained: client_update.ClientUpdate
  extra: PyTree = ()
  state: PyTree = ()
  checked: PyTree | None = None


class Server(NamedTuple):
  """What the server hook receives.

  Attributes:
    state: the :class:`~fedjx.algorithms.base.ServerState` before the round
      (``state.hparams``, ``state.extras``, ...).
    aggregate: ``Delta``, the aggregator's combination of the updates.
    clients: the cohort's placed results after the guard
      (:class:`fedjx.algorithms.nonfinite.Clients`): ``extra``, the hooks'
      extras, ``weights`` the ``w_i`` (0 for a skipped client), ...
    sent: what ``prepare`` sent the clients (``()`` without it).
  """

  state: base.ServerState
  aggregate: PyTree
  clients: nonfinite.Clients
  sent: PyTree


class Step(NamedTuple):
  """What the server hook returns.

  Attributes:
    pseudo_grad: ``g``: the server optimizer steps ``x <- x +
      ServerOpt(g)``; its norm is the round's ``pseudo_grad_norm``.
    extras: the new ``ServerState.extras`` (None: unchanged).
    metrics: scalars added to the round's metrics.
    params: the new model, for an algorithm without a server optimizer
      (``Options.server_optimizer`` None); None otherwise.
  """

  pseudo_grad: PyTree
  extras: PyTree = None
  metrics: Mapping[str, jax.Array] = {}
  params: PyTree | None = None


# ----------------------------------------------------------- the template

def hparams_of(name: str, options: Options, own: Mapping[str, Any],
               params: Params) -> dict[str, Any]:
  """``state.hparams``: the optimizers', the algorithm's own (an optax
  optimizer's injected values, or a number as float32), the client
  transform's and the aggregator's, one name each."""
  client_name, server_name = options.names
  algorithm = {client_name: ({} if options.client_optimizer is None else
                             base.optimizer_hparams(options.client_optimizer,
                                                    params))}
  if options.server_optimizer is not None:
    algorithm[server_name] = base.optimizer_hparams(options.server_optimizer,
                                                    params)
  for key, value in own.items():
    if hasattr(value, 'init') and hasattr(value, 'update'):
      algorithm[key] = base.optimizer_hparams(value, params)
    else:
      algorithm[key] = jnp.asarray(value, jnp.float32)
  transform = options.client_transform
  return base.combine_hparams(
      name, algorithm=algorithm,
      client_transform=({} if transform is None else
                        base.optimizer_hparams(transform, params)),
      aggregator=aggregators.init_hparams(options.aggregator))


def trainer(algorithm_loss: base.LossFn, options: Options, x: Params,
            hparams: Mapping[str, Any], batches: PyTree,
            mask: jax.Array) -> Callable[..., client_update.ClientUpdate]:
  """:attr:`Client.train` for one client that received ``x`` and
  ``hparams`` (``state.hparams``), with data ``batches`` and ``mask``; a
  round written by hand takes its clients' training from here too."""
  client_name = options.names[0]

  def train(*transforms: optax.GradientTransformation,
            optimizer: optax.GradientTransformation | None = None,
            traced: Mapping[str, Any] | None = None,
            opt_state: Any = None, params: Params | None = None,
            loss_fn: base.LossFn | None = None,
            schedule: client_update.LocalSchedule | None = None,
            ) -> client_update.ClientUpdate:
    start = x if params is None else params
    if optimizer is None:
      optimizer = options.client_optimizer
      if optimizer is None:
        raise ValueError(f'{options.builder}: the client hook trains without '
                         'an optimizer (Options.client_optimizer is None); '
                         'pass train(optimizer=...).')
      if traced is None:
        traced = hparams[client_name]
    if opt_state is None:
      opt_state = optimizer.init(start)
    opt_state = base.with_hparams(opt_state, traced or {})
    states = [t.init(x) for t in transforms]
    chain = list(transforms)
    transform = options.client_transform
    if transform is not None:
      chain.append(transform)
      states.append(base.with_hparams(transform.init(x), {
          k: hparams[k] for k in base.hparam_names(transform, x)}))
    if chain:
      optimizer = optax.chain(*chain, optimizer)
      opt_state = (*states, opt_state)
    return client_update.local_update(
        algorithm_loss if loss_fn is None else loss_fn, options.metrics_fn,
        optimizer, start, opt_state, batches, mask,
        options.schedule if schedule is None else schedule)

  return train


def fedavg_client(c: Client) -> Upload:
  """FedAvg's client: the local steps from ``x``, ``Delta_i = x - y_i``."""
  trained = c.train()
  return Upload(optax.tree.sub(c.x, trained.params), trained)


def algorithm(name: str, loss_fn: base.LossFn, options: Options, *,
              client: Callable[[Client], Upload] = fedavg_client,
              server: Callable[[Server], Step] | None = None,
              prepare: Callable[[base.ServerState, Any], PyTree] | None = None,
              hparams: Mapping[str, Any] | None = None,
              extras: Callable[[Params], PyTree] | None = None,
              client_state: ClientState | None = None,
              upload: Callable[[Params], PyTree] | None = None,
              traits: Traits = traits_lib.NONE) -> base.Algorithm:
  """An :class:`~fedjx.algorithms.Algorithm` whose round is the template's.

  Args:
    name: the builder's name (errors, the round's function name).
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    options: the checked :class:`Options`.
    client: the client hook, ``client(Client) -> Upload`` (default FedAvg's,
      :func:`fedavg_client`).
    server: the server hook, ``server(Server) -> Step`` (default: the
      aggregate is the pseudo-gradient).
    prepare: ``prepare(state, cohort) -> sent``, what the server computes
      before the clients and sends them (``Client.sent``), or None.
    hparams: the algorithm's own traced hyperparameters, by name: numbers
      (float32 in ``state.hparams``) or optax optimizers (their injected
      values).
    extras: ``extras(params) -> PyTree``, the algorithm's own server state
      at first (``ServerState.extras``; the server hook's ``Step.extras``
      after each round), or None.
    client_state: the clients' own state (:class:`ClientState`), or None.
    upload: ``upload(params) -> PyTree`` shaped like one client's update,
      for the aggregator's state and the bytes on the wire (default: the
      params).
    traits: the builder's declared :class:`~fedjx.algorithms.traits.Traits`.
  """
  if not isinstance(options, Options):
    raise ValueError(f'{name}: options={options!r} is not an Options.')
  if options.server_optimizer is None and server is None:
    raise ValueError(f'{name}: without a server optimizer the server hook '
                     'gives the new model (Step.params); pass server=.')
  aggregator = options.aggregator
  own = dict(hparams or {})
  shaped = (lambda params: params) if upload is None else upload
  rows = client_state
  dense = rows is not None and rows.num_clients is not None

  def init(params):
    rows_init = ()
    if dense:
      rows_init = jax.tree.map(
          lambda x: jnp.broadcast_to(x, (rows.num_clients,) + jnp.shape(x)),
          rows.init(params))
    server_optimizer = options.server_optimizer
    return base.ServerState(
        params=params,
        opt_state=() if server_optimizer is None else server_optimizer.init(params),
        hparams=hparams_of(name, options, own, params),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(shaped(params)),
        extras=() if extras is None else extras(params),
        client_states=rows_init)

  def one_client(row, x, hp, *rest):  # row: () without client state.
    rest = list(rest)
    sent = rest.pop(0) if prepare is not None else ()
    batches, mask = rest
    up = client(Client(x, hp, sent, row, batches, mask,
                       trainer(loss_fn, options, x, hp, batches, mask)))
    per_client = (base.client_metrics(up.update, up.trained)
                  if options.client_metrics else {})
    return nonfinite.ClientOutput(
        up.update, up.trained.stats, extra=(up.extra, per_client),
        state=up.state, previous_state=row,
        checked=up.trained.params if up.checked is None else up.checked)

  def round_fn(state, cohort, key):
    hp = state.hparams
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    real = cohort.num_examples > 0
    args = [fedjx.broadcast(state.params), fedjx.broadcast(hp)]
    sent = ()
    if prepare is not None:
      sent = prepare(state, cohort)
      args.append(fedjx.broadcast(sent))
    client_fn, stored = one_client, None
    if dense:  # Each client's row read and written in the map (in place
      # when clients run one at a time), a padding client's never written.
      stored = fedjx.mapping.Rows(state.client_states, ids, real)
    elif rows is not None:
      args.insert(0, cohort.client_states)
    else:
      client_fn = functools.partial(one_client, ())
    clients = aggregators.map_clients(
        aggregator, hp, client_fn, (*args, cohort.batches, cohort.mask),
        cohort.num_examples, options.weighting, options.skip_nonfinite,
        aggregator_state=state.aggregator_state, client_ids=ids, rows=stored)
    extra, per_client = clients.extra
    clients = clients._replace(extra=extra)
    delta, agg_state, agg_metrics = aggregators.aggregate(
        aggregator, state.aggregator_state, hp, clients, key)
    step = (Step(delta) if server is None else
            server(Server(state, delta, clients, sent)))
    if step.params is None:
      params, opt_state = base.server_update(
          options.server_optimizer, state.opt_state, hp[options.names[1]],
          state.params, step.pseudo_grad)
    else:
      params, opt_state = step.params, state.opt_state
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(step.pseudo_grad),
        **step.metrics, **agg_metrics)
    metrics['communicated_bytes'] = aggregators.upload_bytes(
        aggregator, shaped(state.params), metrics['clients'], agg_metrics)
    metrics.update(per_client)  # Per-client [C] metrics, if asked.
    client_states = clients.state if dense else state.client_states
    new = state._replace(
        params=params, opt_state=opt_state, round_index=state.round_index + 1,
        aggregator_state=agg_state,
        extras=state.extras if step.extras is None else step.extras,
        client_states=client_states)
    if rows is None or dense:
      return new, metrics
    out = jax.tree.map(  # A padding client's row comes back unchanged.
        lambda n, o: jnp.where(
            jnp.reshape(real, real.shape + (1,) * (jnp.ndim(n) - 1)), n, o),
        clients.state, cohort.client_states)
    return new, metrics, out

  return base.make_algorithm(
      name, init, round_fn, loss_fn=loss_fn, metrics_fn=options.metrics_fn,
      client_state_init=None if rows is None or dense else rows.init,
      traits=traits)


__all__ = ['Client', 'ClientState', 'OPTIONS', 'Options', 'Server', 'Step',
           'Upload', 'algorithm', 'fedavg_client', 'hparams_of',
           'option_parameters', 'options_but', 'trainer']
