"""DiLoCo: distributed low-communication training.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023 (arXiv 2311.08105), Algorithm 1. ``K`` replicas each own a data
shard and an inner optimizer whose state persists across rounds (it is never
communicated). One outer step:

    for each replica k (in parallel):
        theta_k <- theta
        H times:  theta_k <- InnerOpt(theta_k, grad L(theta_k; x ~ D_k))
        Delta_k = theta - theta_k                         (outer gradient)
    Delta = sum_k w_k Q(Delta_k) / sum_k w_k               (all-reduce)
    theta <- OuterOpt(theta, Delta)

InnerOpt defaults to AdamW (learning rate 4e-4, weight decay 0.1, as in the
paper), OuterOpt to SGD with Nesterov momentum (learning rate 0.7, momentum
0.9). ``H`` is ``inner_steps``, or the cohort's ``S`` steps if None.
``Q`` is an optional lossy format for the outer gradients
(:mod:`fedjx.algorithms.compression.quantization`; full precision by default). With an
outer SGD of learning rate 1 and no momentum, and a fresh inner state every
round, DiLoCo is FedAvg.

Replica ``k`` is the client with ``cohort.client_ids == k``. Where its inner
optimizer state lives (``client_state``, docs/client_state.md):

* ``'dense'`` (the default): in the server state (``state.client_states``,
  leaves ``[K, ...]``), updated in place as the replicas train one after
  another; the whole state stays on the device.
* ``'store'``: outside the server state, one row per replica in a
  ``fedjx.ClientStore`` on the host. The round reads the replicas' rows
  from ``cohort.client_states`` and returns their new values as a third
  output; streamed (``fedjx.streaming``), the device holds the outer state
  and one replica's work, whatever ``K``: the placement for replicas whose
  ``K`` inner states do not fit beside the round (docs/scaling.md).

The round is the template's (:func:`fedjx.algorithms.kit.algorithm`), with
the inner optimizer as the clients' (``state.hparams['inner_optimizer']``),
the outer one as the server's (``['outer_optimizer']``), ``H`` as the local
steps and each replica's inner state as its row: DiLoCo has no hook of its
own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import base
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms.compression import quantization

OPTIONS = ('metrics_fn', 'weighting', 'client_evaluation', 'skip_nonfinite')
"""The options of :class:`~fedjx.algorithms.kit.Options` the builders of the
DiLoCo family take in ``**options``; the inner and outer optimizers and
``inner_steps`` (:data:`OWN`) are their own parameters."""

OWN = ('inner_optimizer', 'outer_optimizer', 'outer_learning_rate',
       'outer_momentum', 'inner_steps')
"""The parameters every builder of the DiLoCo family takes itself."""

CLIENT_STATES = ('dense', 'store')
"""Where the replicas' inner optimizer states live (module docstring)."""

TRAITS = kit.Traits(options=OPTIONS, population='num_replicas',
                    client_state='client_state',
                    updates_reach_params=True, indexed_batches=True,
                    aggregates_whole_model=True, replicas_restart=True)
"""What DiLoCo declares: replicas by id, their states placed by
``config.client_state.placement``, every outer gradient reaches the
model in its round, the whole model aggregated once a round, every replica
starting each round from the global model
(:class:`~fedjx.algorithms.traits.Traits`)."""


def default_inner_optimizer() -> optax.GradientTransformation:
  """AdamW with learning rate 4e-4 and weight decay 0.1 (injected)."""
  return optax.inject_hyperparams(optax.adamw)(learning_rate=4e-4,
                                               weight_decay=0.1)


def outer_nesterov(learning_rate: float = 0.7,
                   momentum: float = 0.9) -> optax.GradientTransformation:
  """SGD with Nesterov momentum (injected): DiLoCo's outer optimizer."""
  return kit.default_sgd(learning_rate, momentum=momentum, nesterov=True)


def stack_states(opt_state: optax.OptState, k: int) -> optax.OptState:
  """``k`` copies of an optimizer state on a new leading axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (k,) + jnp.shape(x)), opt_state)


def check_outer(fn: str, outer_optimizer, outer_learning_rate, outer_momentum):
  """The outer optimizer from either an optax optimizer or (lr, momentum)."""
  if outer_optimizer is not None:
    if outer_learning_rate is not None or outer_momentum is not None:
      raise ValueError(f'{fn}: pass outer_optimizer or outer_learning_rate/'
                       'outer_momentum, not both.')
    kit.check_optimizer(fn, 'outer_optimizer', outer_optimizer)
    return outer_optimizer
  lr = 0.7 if outer_learning_rate is None else outer_learning_rate
  momentum = 0.9 if outer_momentum is None else outer_momentum
  kit.check_number(fn, 'outer_learning_rate', lr)
  kit.check_number(fn, 'outer_momentum', momentum, high=1.0)
  return outer_nesterov(lr, momentum)


def check_aggregator(fn: str, aggregator, quantization_format: str):
  """The aggregator from either ``aggregator`` or ``quantization_format``."""
  if aggregator is not None and quantization_format != 'float32':
    raise ValueError(f'{fn}: pass aggregator={aggregator!r} or '
                     f'quantization_format={quantization_format!r}, not both '
                     '(aggregators.quantized_mean(fmt) is the latter).')
  if aggregator is None:
    return aggregators.quantized_mean(quantization_format)
  return aggregators.check(fn, aggregator)


def check_options(fn: str, options: dict[str, Any], *,
                  inner_optimizer: Any = None, outer_optimizer: Any = None,
                  outer_learning_rate: float | None = None,
                  outer_momentum: float | None = None,
                  inner_steps: int | None = None,
                  taken: tuple[str, ...] = OPTIONS, own: tuple[str, ...] = (),
                  **fixed: Any) -> kit.Options:
  """The DiLoCo family's :class:`~fedjx.algorithms.kit.Options`: the inner
  optimizer (default :func:`default_inner_optimizer`) as the clients', the
  outer one (:func:`check_outer`) as the server's, ``H = inner_steps`` as the
  local steps, named ``inner_optimizer`` and ``outer_optimizer`` in
  ``state.hparams``; ``options`` the builder's ``**options`` (``taken``),
  ``own`` its parameters beyond :data:`OWN` (for errors), ``fixed`` what it
  sets itself."""
  inner = inner_optimizer or default_inner_optimizer()
  kit.check_optimizer(fn, 'inner_optimizer', inner)
  outer = check_outer(fn, outer_optimizer, outer_learning_rate, outer_momentum)
  return kit.Options.of(fn, options, taken, own=OWN + own,
                        client_optimizer=inner, server_optimizer=outer,
                        local_steps=inner_steps,
                        names=('inner_optimizer', 'outer_optimizer'), **fixed)


def replica_states(state: Any, ids: jax.Array, reset_inner_state: bool) -> Any:
  """The replicas' inner optimizer states for a client map written by hand:
  each replica's own (``state.client_states[ids]``), or a placeholder when
  every replica starts afresh."""
  if reset_inner_state:
    return fedjx.broadcast(jnp.zeros(()))
  return base.gather_clients(state.client_states, ids)


def outer_step(aggregator: Any, outer_optimizer: Any,
               state: Any, clients: nonfinite.Clients, key: jax.Array,
               ids: jax.Array, num_examples: jax.Array, reset_inner_state: bool,
               **extra_metrics: jax.Array) -> tuple[dict[str, Any], base.Metrics]:
  """The server's half of a DiLoCo round written by hand (asynchronous
  DiLoCo's): the template's, with the round's extra metrics.

  Combines the replicas' outer gradients, takes the outer step
  ``theta <- OuterOpt(theta, Delta)``, writes each replica's inner optimizer
  state back (replicas with data only). Returns the state's new fields
  (``params``, ``opt_state``, ``client_states``, ``aggregator_state``)
  and the round's metrics, with ``communicated_bytes``.
  """
  outer_grad, agg_state, agg_metrics = aggregators.aggregate(
      aggregator, state.aggregator_state, state.hparams, clients, key)
  params, opt_state = base.server_update(
      outer_optimizer, state.opt_state, state.hparams['outer_optimizer'],
      state.params, outer_grad)
  inner_states = state.client_states
  if not reset_inner_state:
    inner_states = base.scatter_clients(inner_states, ids, clients.state,
                                        num_examples > 0)
  metrics = nonfinite.round_metrics(
      clients, pseudo_grad_norm=optax.tree.norm(outer_grad), **agg_metrics,
      **extra_metrics)
  metrics['communicated_bytes'] = aggregators.upload_bytes(
      aggregator, state.params, metrics['clients'], agg_metrics)
  return dict(params=params, opt_state=opt_state, client_states=inner_states,
              aggregator_state=agg_state), metrics


@kit.declare(TRAITS)
def diloco(loss_fn: kit.LossFn, num_replicas: int, *,
           inner_optimizer: optax.GradientTransformation | None = None,
           outer_optimizer: optax.GradientTransformation | None = None,
           outer_learning_rate: float | None = None,
           outer_momentum: float | None = None,
           inner_steps: int | None = None,
           reset_inner_state: bool = False,
           client_state: str = 'dense',
           quantization_format: str = 'float32',
           aggregator: Any = None,
           client_metrics: bool = False,
           **options: Any) -> kit.Algorithm:
  """DiLoCo with ``num_replicas`` replicas.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_replicas: ``K``; replica ids (``cohort.client_ids``) lie in ``[0, K)``.
    inner_optimizer: default :func:`default_inner_optimizer` (AdamW).
    outer_optimizer: any optax optimizer; or give ``outer_learning_rate``
      (default 0.7) and ``outer_momentum`` (default 0.9) for Nesterov SGD.
    outer_learning_rate: see ``outer_optimizer``.
    outer_momentum: see ``outer_optimizer``.
    inner_steps: ``H``, inner steps per round cycling through the replica's
      real steps; None runs the cohort's ``S`` steps once.
    reset_inner_state: start every round from a fresh inner state instead of
      the replica's own (the paper keeps it).
    client_state: where the replicas' inner states live: ``'dense'``
      (``[K, ...]`` arrays in ``state.client_states``) or ``'store'``
      (outside the state: the round reads them from ``cohort.client_states``
      and returns ``(state, metrics, client_states)``, the cohort's new
      rows; module docstring).
    quantization_format: format of the outer gradients sent
      (``quantization.FORMATS``): the aggregator
      ``aggregators.quantized_mean(quantization_format)``.
    aggregator: how outer gradients are combined (instead of
      ``quantization_format``), e.g. ``aggregators.gaussian(...)``: DP
      DiLoCo, clip and noise on the outer gradient.
    client_metrics: also return per-replica ``[C]`` metrics
      (:func:`fedjx.algorithms.base.client_metrics` of the outer gradient
      ``Delta_k``, before the aggregator's encoding); False adds nothing to
      the round.
    **options: ``metrics_fn``, ``weighting``, ``client_evaluation``,
      ``skip_nonfinite``, as for :func:`~fedjx.algorithms.fedavg`; a skipped
      replica keeps its inner optimizer state from before the round.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``client_states`` are the
    replicas' inner optimizer states (``()`` with ``reset_inner_state`` or
    ``client_state='store'``).
  """
  name = 'diloco'
  kit.check_positive_int(name, 'num_replicas', num_replicas)
  kit.check_choice(name, 'reset_inner_state', reset_inner_state, (False, True))
  kit.check_choice(name, 'client_state', client_state, CLIENT_STATES)
  quantization.check_format(name, 'quantization_format', quantization_format)
  o = check_options(
      name, options, inner_optimizer=inner_optimizer,
      outer_optimizer=outer_optimizer, outer_learning_rate=outer_learning_rate,
      outer_momentum=outer_momentum, inner_steps=inner_steps,
      aggregator=check_aggregator(name, aggregator, quantization_format),
      client_metrics=client_metrics)
  rows = None if reset_inner_state else kit.ClientState(
      o.client_optimizer.init, num_replicas if client_state == 'dense' else None)

  def replica(c):  # H inner steps from theta, from its own inner state.
    trained = c.train(opt_state=None if reset_inner_state else c.state)
    return kit.Upload(optax.tree.sub(c.x, trained.params), trained,
                      state=() if reset_inner_state else trained.opt_state)

  return kit.algorithm(name, loss_fn, o, client=replica, client_state=rows,
                       traits=TRAITS)
