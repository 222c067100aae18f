"""AFL: agnostic federated learning, a minimax over domain mixtures.

Mohri, Sivek, Suresh, "Agnostic Federated Learning", ICML 2019; the
federated-averaging form of Ro, Chen, Mathews, Mohri, Suresh,
"Communication-Efficient Agnostic Federated Averaging", Interspeech 2021
(FedJAX's ``fedjax/algorithms/agnostic_fed_avg.py``). Every example belongs
to one of ``D`` domains; with ``L_d(w)`` the mean loss over domain ``d``'s
examples, AFL solves

    min_w  max_{lambda in simplex}  L_lambda(w) = sum_d lambda_d L_d(w).

For fixed ``lambda`` the objective is a sum over examples with weights
``alpha_{d(j)} = lambda_{d(j)} / N_{d(j)}`` (``N_d`` the examples of domain
``d``), i.e. over clients, with ``beta_k = sum_d alpha_d N^k_d`` (``N^k_d``
client ``k``'s examples of domain ``d``):

    L_lambda(w) = sum_k beta_k  [ sum_{j in D_k} alpha_{d(j)} l_j(w) / beta_k ].

A round (Ro et al. 2021, Algorithm 1; FedJAX's ``apply``):

    alpha = lambda / mean of the last W rounds' domain counts  (estimates N_d)
    broadcast w, alpha to the cohort
    client k:  N^k_d, and L^k_d = sum of l_j(w) over its domain-d examples
               beta_k = sum_d alpha_d N^k_d
               y_k = ClientOpt^T(w) on the loss  s_{d(j)} l_j,
                     s_d = alpha_d n_k / beta_k
               (the mean over a batch of s l is an unbiased estimate of the
               client's alpha-weighted mean loss)
    server:    Delta = sum_k beta_k (w - y_k) / sum_k beta_k
               w <- w + ServerOpt(Delta)
               L_d = sum_k L^k_d / sum_k N^k_d     (domain losses at w^t)
               lambda <- lambda exp(eta_lambda L) / Z            ('eg')
                      or Proj_simplex(lambda + eta_lambda L)     ('pgd',
                         the projected gradient ascent of Mohri et al. 2019,
                         Stochastic-AFL; Euclidean projection of Duchi et al.
                         2008)
               window <- last W - 1 entries + [sum_k N^k_d]

How domains reach the round: each example's domain id is a feature of the
batch, ``batch[domain_key]`` (an int in ``[0, D)``; ids outside it count in
no domain and get weight 0). A client holding a single domain is the special
case of a feature constant over its examples. With ``domain_key='y'`` the
domains are the classes, as in Mohri et al.'s Fashion-MNIST experiment
(each of three classes a domain): ``configs/afl_digits.py`` does that on the
ten digits.

FedJAX steps each client on a batch's *sum* ``sum_{j in b} alpha l_j /
beta_k``; here a step uses the batch *mean* of ``s l``, so that the local
learning rate means what it means in FedAvg (the two differ by the factor
``|b| / n_k`` in the step size). A differentially private aggregator is
refused: the domain losses and counts each client sends are not privatised,
and its unit weights would replace ``beta_k``.

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): its client weights ``beta_k`` read each
client's domain counts before the client map, and its server state moves
``lambda`` from the clients' per-domain losses beside the aggregate.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators

# What a round releases beside the aggregate (``Traits.unprivatized``).
UNPRIVATIZED = ('its clients also send their exact per-domain losses and '
                'counts, which the noise does not cover')

DOMAIN_ALGORITHMS = ('eg', 'pgd', 'none')



# ------------------------------------------------------------- the pieces

def project_simplex(v: jax.Array) -> jax.Array:
  """The Euclidean projection of ``v`` onto the probability simplex.

  ``argmin_{p >= 0, sum p = 1} ||p - v||``: ``p = max(v - theta, 0)`` with
  ``theta`` from the sorted entries (Duchi et al., "Efficient Projections
  onto the l1-Ball for Learning in High Dimensions", ICML 2008, Figure 1).
  """
  v = jnp.asarray(v, jnp.float32)
  u = jnp.sort(v)[::-1]
  css = jnp.cumsum(u)
  k = jnp.arange(1, v.shape[0] + 1, dtype=jnp.float32)
  rho = jnp.sum((u - (css - 1.0) / k) > 0)
  theta = (css[rho - 1] - 1.0) / rho.astype(jnp.float32)
  return jnp.maximum(v - theta, 0.0)


def update_domain_weights(domain_weights: jax.Array, domain_loss: jax.Array,
                          learning_rate: float | jax.Array,
                          algorithm: str = 'eg') -> jax.Array:
  """``lambda`` after one ascent step on the domain losses ``L``.

  ``'eg'``: ``lambda exp(eta L) / sum(lambda exp(eta L))`` (exponentiated
  gradient, FedJAX's ``update_domain_weights``); ``'pgd'``:
  ``Proj_simplex(lambda + eta L)`` (Mohri et al. 2019); ``'none'``: kept.
  """
  lam = jnp.asarray(domain_weights, jnp.float32)
  loss = jnp.asarray(domain_loss, jnp.float32)
  eta = jnp.asarray(learning_rate, jnp.float32)
  if algorithm == 'eg':
    # exp(eta (L - max L)): the same ratios, no overflow.
    new = lam * jnp.exp(eta * (loss - jnp.max(loss)))
    return new / jnp.sum(new)
  if algorithm == 'pgd':
    return project_simplex(lam + eta * loss)
  return lam


def domain_sums(loss_fn: kit.LossFn, params: kit.Params, batches: Any,
                mask: jax.Array, domains: jax.Array,
                num_domains: int) -> tuple[jax.Array, jax.Array]:
  """One client's ``(L^k, N^k)``: per-domain sums of ``loss(params)`` and
  example counts over its real examples, float32 ``[D]`` each."""
  def step(sums, xs):
    batch, m, d = xs
    losses = jnp.where(m, loss_fn(params, batch), 0.0).astype(jnp.float32)
    loss_sum = jax.ops.segment_sum(losses, d, num_domains)
    count = jax.ops.segment_sum(m.astype(jnp.float32), d, num_domains)
    return (sums[0] + loss_sum, sums[1] + count), None

  zeros = client_update.tie_to((jnp.zeros(num_domains, jnp.float32),) * 2, mask)
  sums, _ = jax.lax.scan(step, zeros, (batches, mask, domains))
  return sums


def domain_counts(mask: jax.Array, domains: jax.Array, num_domains: int) -> jax.Array:
  """One client's ``N^k``: its real examples of each domain, float32 ``[D]``."""
  return jax.ops.segment_sum(mask.reshape(-1).astype(jnp.float32),
                             domains.reshape(-1), num_domains)


def _safe_div(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.where(b > 0, a / jnp.where(b > 0, b, 1.0), 0.0)


def _check_domains(fn: str, o: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
  """``(lambda_0, window_0 [W, D])`` from the domain options ``o``, checked."""
  num, init = o['num_domains'], o['init_domain_weights']
  if num is None and init is None:
    raise ValueError(f'{fn}: give num_domains (uniform initial weights) or '
                     'init_domain_weights (one per domain, summing to 1).')
  if num is not None:
    kit.check_positive_int(fn, 'num_domains', num)
  if init is None:
    lam = np.full(num, 1.0 / num)
  else:
    lam = np.asarray(init, np.float64)
    if lam.ndim != 1 or lam.size == 0 or not np.all(np.isfinite(lam)) \
        or np.any(lam < 0) or abs(lam.sum() - 1.0) > 1e-6:
      raise ValueError(f'{fn}: init_domain_weights={init!r} must be '
                       'non-negative numbers summing to 1 (one per domain).')
    if num is not None and lam.size != num:
      raise ValueError(f'{fn}: init_domain_weights has {lam.size} entries but '
                       f'num_domains={num}.')
  kit.check_number(fn, 'domain_learning_rate', o['domain_learning_rate'])
  kit.check_choice(fn, 'domain_algorithm', o['domain_algorithm'],
                   DOMAIN_ALGORITHMS)
  kit.check_positive_int(fn, 'domain_window_size', o['domain_window_size'])
  if not isinstance(o['domain_key'], str):
    raise ValueError(f'{fn}: domain_key={o["domain_key"]!r} must be the name '
                     'of the batch feature holding each example\'s domain id.')
  window = (np.ones(lam.size) if o['init_domain_window'] is None
            else np.asarray(o['init_domain_window'], np.float64))
  if window.shape != lam.shape or not np.all(np.isfinite(window)) \
      or np.any(window <= 0):
    raise ValueError(f'{fn}: init_domain_window={o["init_domain_window"]!r} '
                     f'must be {lam.size} positive counts (one per domain).')
  return lam, np.tile(window, (o['domain_window_size'], 1))


def _check_domain_feature(fn: str, cohort: Any, key: str) -> None:
  """Trace-time check: the batches hold integer domain ids ``[C, S, B]``."""
  batches = cohort.batches
  if not hasattr(batches, 'keys') or key not in batches:
    have = sorted(batches) if hasattr(batches, 'keys') else type(batches).__name__
    raise ValueError(f'{fn}: domain_key={key!r} is not a feature of the '
                     f'cohort\'s batches ({have}); each example needs its '
                     'domain id there.')
  d = batches[key]
  if jnp.shape(d) != tuple(cohort.mask.shape) or not jnp.issubdtype(
      jnp.result_type(d), jnp.integer):
    raise ValueError(f'{fn}: batches[{key!r}] must hold one integer domain id '
                     f'per example, shape {tuple(cohort.mask.shape)}; got '
                     f'{jnp.result_type(d)} {jnp.shape(d)}.')


def _check_aggregator(fn: str, aggregator: Any) -> aggregators.Aggregator:
  agg = aggregators.check(fn, aggregator)
  kit.check_private_uploads(fn, agg, UNPRIVATIZED)
  if agg.weights is not None:
    raise ValueError(
        f'{fn}: aggregator={aggregator!r} sets its own client weights, but '
        'AFL weights each update by beta_k; use the mean or a quantized mean.')
  return agg


# ------------------------------------------------------------- the builder

TRAITS = kit.Traits(options=kit.options_but('weighting', 'client_transform'),
                    unprivatized=UNPRIVATIZED)
"""What AFL declares: FedAvg's options but the weighting (its weights are
``beta_k``) and the client transform; what its round releases beside the
aggregate (:class:`~fedjx.algorithms.traits.Traits`)."""


@kit.declare(TRAITS)
def afl(loss_fn: kit.LossFn, *, num_domains: int | None = None,
        init_domain_weights: Any = None, domain_learning_rate: float = 0.1,
        domain_algorithm: str = 'eg', domain_window_size: int = 1,
        init_domain_window: Any = None, domain_key: str = 'domain',
        **options: Any) -> kit.Algorithm:
  """Agnostic federated averaging (Mohri et al. 2019; Ro et al. 2021).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    num_domains: ``D`` (uniform ``lambda_0 = 1/D``); or
    init_domain_weights: ``lambda_0``, ``D`` non-negative numbers summing to 1.
    domain_learning_rate: ``eta_lambda`` (``state.hparams``) [0.1].
    domain_algorithm: ``'eg'`` (exponentiated gradient, FedJAX's), ``'pgd'``
      (projected gradient ascent, Mohri et al.'s) or ``'none'`` (fixed
      ``lambda``).
    domain_window_size: ``W``, rounds of domain counts averaged to estimate
      ``N_d`` [1].
    init_domain_window: the counts the window starts with (default ones).
    domain_key: the batch feature holding each example's domain id
      [``'domain'``].
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``weighting`` (the
      weights are ``beta_k``) and ``client_transform``; ``aggregator`` None
      (the weighted mean) or one without its own weights (e.g.
      ``quantized_mean``); DP aggregators are refused.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`; its state is a
    :class:`~fedjx.algorithms.ServerState` whose ``extras`` are
    ``{'domain_weights': lambda, float32 [D] on the simplex,
    'domain_window': float32 [W, D], the domain example counts of the last
    W rounds (the oldest first)}``. Metrics add ``domain_loss_<d>`` (``L_d`` at the
    round's starting model), ``domain_weight_<d>`` (``lambda`` used) and
    ``worst_domain_loss`` (the largest ``L_d`` of the domains seen).
  """
  name = 'afl'
  lam0, window0 = _check_domains(name, dict(
      num_domains=num_domains, init_domain_weights=init_domain_weights,
      domain_learning_rate=domain_learning_rate,
      domain_algorithm=domain_algorithm, domain_window_size=domain_window_size,
      init_domain_window=init_domain_window, domain_key=domain_key))
  num_domains = lam0.size
  aggregator = _check_aggregator(name, options.get('aggregator'))
  o = kit.Options.of(name, options, TRAITS.options)
  client_optimizer, server_optimizer = o.client_optimizer, o.server_optimizer
  schedule, metrics_fn, key = o.schedule, o.metrics_fn, domain_key

  def init(params):
    hparams = base.combine_hparams(
        name,
        algorithm={'client_optimizer': base.optimizer_hparams(client_optimizer, params),
                   'server_optimizer': base.optimizer_hparams(server_optimizer, params),
                   'domain_learning_rate': jnp.float32(domain_learning_rate)},
        aggregator=aggregators.init_hparams(aggregator))
    return kit.ServerState(
        params=params, opt_state=server_optimizer.init(params),
        hparams=hparams, round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(params),
        extras={'domain_weights': jnp.asarray(lam0, jnp.float32),
                'domain_window': jnp.asarray(window0, jnp.float32)})

  def client_fn(w, alpha, hparams, batches, mask):
    domains = batches[key]
    loss_sum, count = domain_sums(loss_fn, w, batches, mask, domains, num_domains)
    beta = jnp.sum(alpha * count)
    n = jnp.sum(count)
    scale = _safe_div(alpha * n, beta)  # s_d = alpha_d n_k / beta_k

    def scaled_loss(params, batch):
      d = batch[key]
      inside = jnp.logical_and(d >= 0, d < num_domains)
      s = jnp.where(inside, scale[jnp.clip(d, 0, num_domains - 1)], 0.0)
      return loss_fn(params, batch) * s.astype(jnp.float32)

    opt_state = kit.with_hparams(client_optimizer.init(w),
                                 hparams['client_optimizer'])
    y, opt_state, num_steps, during = client_update.train(
        scaled_loss, client_optimizer, w, opt_state, batches, mask, schedule)
    if schedule.evaluate:
      before = client_update.evaluate(loss_fn, metrics_fn, w, batches, mask)
      after = client_update.evaluate(loss_fn, metrics_fn, y, batches, mask)
      stats = {'count': before.pop('count')}
      after.pop('count')
      stats.update({f'{k}_before': v for k, v in before.items()})
      stats.update({f'{k}_after': v for k, v in after.items()})
    else:  # The domain pass is the loss before training, at no extra cost.
      stats = {'loss_before': jnp.sum(loss_sum), 'count': n}
    out = kit.ClientUpdate(y, opt_state, num_steps, stats)
    delta = base.tree_sub(w, y)
    extra = {'domain_loss': loss_sum, 'domain_count': count}
    if o.client_metrics:
      extra.update(base.client_metrics(delta, out), client_beta=beta)
    return nonfinite.ClientOutput(delta, stats, extra=extra, checked=y)

  def round_fn(state, cohort, rng):
    _check_domain_feature(name, cohort, key)
    lam, window = state.extras['domain_weights'], state.extras['domain_window']
    alpha = _safe_div(lam, jnp.mean(window, axis=0))
    counts = fedjx.map_fn(lambda m, d: domain_counts(m, d, num_domains),
                          (cohort.mask, cohort.batches[key]))
    beta = fedjx.map_fn(lambda a, n: jnp.sum(a * n),
                        (fedjx.broadcast(alpha), counts))
    client_hparams = {'client_optimizer': state.hparams['client_optimizer']}
    clients = nonfinite.map_clients(
        client_fn, (fedjx.broadcast(state.params), fedjx.broadcast(alpha),
                    fedjx.broadcast(client_hparams), cohort.batches, cohort.mask),
        beta, cohort.num_examples, o.skip_nonfinite,
        encode=aggregator.encode,
        encode_hparams=aggregators.encode_hparams(aggregator, state.hparams,
                                          state.aggregator_state),
        check_encoded=aggregator.traits.checks_update)
    extra = dict(clients.extra)
    sums = fedjx.reduce_sum({'loss': extra.pop('domain_loss'),
                             'count': extra.pop('domain_count')})
    pseudo_grad, params, opt_state, agg_state, agg_metrics = aggregators.step(
        aggregator, server_optimizer, state, state.hparams['server_optimizer'],
        clients, rng)
    domain_loss = _safe_div(sums['loss'], sums['count'])
    domain_weights = update_domain_weights(
        lam, domain_loss, state.hparams['domain_learning_rate'],
        domain_algorithm)
    window = jnp.concatenate([window[1:], sums['count'][None]], 0)
    seen = sums['count'] > 0
    per_domain = {}
    for d in range(num_domains):
      per_domain[f'domain_loss_{d}'] = domain_loss[d]
      per_domain[f'domain_weight_{d}'] = lam[d]
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(pseudo_grad),
        worst_domain_loss=jnp.max(jnp.where(seen, domain_loss, 0.0)),
        **per_domain, **agg_metrics)
    metrics.update(extra)
    return state._replace(params=params, opt_state=opt_state,
                          extras={'domain_weights': domain_weights,
                                  'domain_window': window},
                          round_index=state.round_index + 1,
                          aggregator_state=agg_state), metrics

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn, traits=TRAITS)


__all__ = ['afl', 'domain_sums', 'project_simplex',
           'update_domain_weights']
