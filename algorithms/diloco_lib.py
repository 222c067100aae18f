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

Replica ``k`` is the client with ``cohort.client_ids == k``; its inner
optimizer state is stored in the server state (leaves ``[K, ...]``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import kit
from fedjx.algorithms.compression import quantization


class DiLoCoState(NamedTuple):
  """DiLoCo's state.

  Attributes:
    params: the global model ``theta``.
    opt_state: the outer optimizer's state.
    inner_opt_states: each replica's inner optimizer state, leaves
      ``[K, ...]`` (``()`` when ``reset_inner_state``).
    hparams: ``inner_optimizer`` and ``outer_optimizer`` hyperparameters.
    round_index: outer steps taken.
    aggregator_state: the aggregator's state (``()`` when it has none).
  """

  params: kit.Params
  opt_state: optax.OptState
  inner_opt_states: Any
  hparams: dict[str, Any]
  round_index: jax.Array
  aggregator_state: Any = ()


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
  return kit.check_aggregator(fn, aggregator)


# The options DiLoCo and Streaming DiLoCo share, with their defaults.
OPTIONS: dict[str, Any] = {
    'inner_optimizer': None,
    'outer_optimizer': None,
    'outer_learning_rate': None,
    'outer_momentum': None,
    'inner_steps': None,
    **kit.COMMON_OPTIONS,
}


def check_options(fn: str, options: dict[str, Any]):
  """``(inner_optimizer, outer_optimizer, schedule, options)`` from the options."""
  o = kit.take_options(fn, options, OPTIONS)
  inner_optimizer = o['inner_optimizer'] or default_inner_optimizer()
  kit.check_optimizer(fn, 'inner_optimizer', inner_optimizer)
  outer_optimizer = check_outer(fn, o['outer_optimizer'],
                                o['outer_learning_rate'], o['outer_momentum'])
  kit.check_choice(fn, 'weighting', o['weighting'], kit.WEIGHTINGS)
  kit.check_skip_nonfinite(fn, o['skip_nonfinite'])
  schedule = kit.check_schedule(fn, 1, o['inner_steps'],
                                o['client_evaluation'])
  return inner_optimizer, outer_optimizer, schedule, o


def replica_states(state: Any, ids: jax.Array, reset_inner_state: bool) -> Any:
  """The replicas' inner optimizer states for the client map: each
  replica's own (``state.inner_opt_states[ids]``), or a placeholder when
  every replica starts afresh."""
  if reset_inner_state:
    return fedjx.broadcast(jnp.zeros(()))
  return kit.gather_clients(state.inner_opt_states, ids)


def outer_step(aggregator: kit.Aggregator, outer_optimizer: Any,
               state: Any, clients: kit.Clients, key: jax.Array,
               ids: jax.Array, num_examples: jax.Array, reset_inner_state: bool,
               **extra_metrics: jax.Array) -> tuple[dict[str, Any], kit.Metrics]:
  """The server's half of a DiLoCo round.

  Combines the replicas' outer gradients, takes the outer step
  ``theta <- OuterOpt(theta, Delta)``, writes each replica's inner optimizer
  state back (replicas with data only). Returns the state's new fields
  (``params``, ``opt_state``, ``inner_opt_states``, ``aggregator_state``)
  and the round's metrics, with ``communicated_bytes``.
  """
  outer_grad, params, opt_state, agg_state, agg_metrics = kit.server_step(
      aggregator, outer_optimizer, state, state.hparams['outer_optimizer'],
      clients, key)
  inner_states = state.inner_opt_states
  if not reset_inner_state:
    inner_states = kit.scatter_clients(inner_states, ids, clients.state,
                                       num_examples > 0)
  metrics = kit.round_metrics(
      clients, pseudo_grad_norm=optax.tree.norm(outer_grad), **agg_metrics,
      **extra_metrics)
  metrics['communicated_bytes'] = kit.upload_bytes(
      aggregator, state.params, metrics['clients'], agg_metrics)
  return dict(params=params, opt_state=opt_state, inner_opt_states=inner_states,
              aggregator_state=agg_state), metrics


@kit.with_options(OPTIONS)
def diloco(loss_fn: kit.LossFn, num_replicas: int, *,
           reset_inner_state: bool = False,
           quantization_format: str = 'float32',
           aggregator: kit.Aggregator | None = None,
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
    metrics_fn, weighting, client_evaluation, skip_nonfinite: as for
      :func:`fedavg` (in ``**options``, with the inner and
      outer optimizers' options above); a skipped replica keeps its inner
      optimizer state from before the round.
  """
  name = 'diloco'
  kit.check_positive_int(name, 'num_replicas', num_replicas)
  inner_optimizer, outer_optimizer, schedule, o = check_options(name, options)
  metrics_fn = o['metrics_fn']
  kit.check_choice(name, 'reset_inner_state', reset_inner_state, (False, True))
  quantization.check_format(name, 'quantization_format', quantization_format)
  aggregator = check_aggregator(name, aggregator, quantization_format)
  kit.check_choice(name, 'client_metrics', client_metrics, (False, True))

  def init(params):
    inner = () if reset_inner_state else stack_states(
        inner_optimizer.init(params), num_replicas)
    return DiLoCoState(
        params=params, opt_state=outer_optimizer.init(params),
        inner_opt_states=inner,
        hparams=kit.combine_hparams(
            'diloco',
            algorithm={'inner_optimizer': kit.optimizer_hparams(inner_optimizer, params),
                       'outer_optimizer': kit.optimizer_hparams(outer_optimizer, params)},
            aggregator=kit.aggregator_hparams(aggregator)),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params))

  def replica_fn(theta, hparams, inner_state, batches, mask):
    if reset_inner_state:
      inner_state = inner_optimizer.init(theta)
    inner_state = kit.with_hparams(inner_state, hparams)
    out = kit.local_update(loss_fn, metrics_fn, inner_optimizer, theta,
                           inner_state, batches, mask, schedule)
    delta = kit.tree_sub(theta, out.params)
    extra = kit.client_metrics(delta, out) if client_metrics else ()
    return kit.ClientOutput(delta, out.stats, extra=extra, state=out.opt_state,
                            previous_state=inner_state, checked=out.params)

  def round_fn(state, cohort, key):
    ids = jnp.asarray(cohort.client_ids, jnp.int32)
    clients = kit.map_clients(
        aggregator, state.hparams, replica_fn,
        (fedjx.broadcast(state.params),
         fedjx.broadcast(state.hparams['inner_optimizer']),
         replica_states(state, ids, reset_inner_state), cohort.batches,
         cohort.mask),
        cohort.num_examples, o['weighting'], o['skip_nonfinite'],
        aggregator_state=state.aggregator_state, client_ids=ids)
    updated, metrics = outer_step(aggregator, outer_optimizer, state, clients,
                                  key, ids, cohort.num_examples,
                                  reset_inner_state)
    metrics.update(clients.extra)  # Per-replica [C] metrics, if asked.
    return state._replace(round_index=state.round_index + 1,
                          **updated), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn, options=o,
                            indexed_batches=True)
