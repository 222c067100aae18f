"""DP-FedAvg: FedAvg with user-level differential privacy.

McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018, Algorithm 1 (the Gaussian mechanism on clipped client updates).
With the cohort sampled from the ``N`` clients with probability ``q``:

    client k:  Delta_k = x - y_k                       (y_k: local training)
               Delta_k <- Delta_k min(1, C / ||Delta_k||)       (clip to C)
    server:    g = (sum_k Delta_k + N(0, (z C)^2 I)) / D
               x <- x + ServerOpt(g)

Every client has weight 1, so one client changes the sum by at most ``C``
(its L2 sensitivity) and the noise of standard deviation ``z C`` makes the
round a Gaussian mechanism with noise multiplier ``z``. ``D`` is the expected
cohort size ``qN`` (``expected_clients_per_round``, McMahan et al.'s
fixed-denominator estimator) or, if None, the number of participating
clients (which the privacy analysis treats as public).

:func:`dp_epsilon` composes ``R`` such rounds with Poisson sampling rate
``q`` through the ``dp_accounting`` package (RDP or PLD accountant) and
returns epsilon at the given delta.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import base
from fedjx.algorithms import client_update
from fedjx.algorithms import nonfinite

ACCOUNTANTS = ('rdp', 'pld')


def safe_global_norm(tree: base.PyTree) -> jax.Array:
  """``||tree||_2``, with a zero (not NaN) derivative at zero."""
  sq = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def clip_update(update: base.PyTree, clip_norm: jax.Array) -> tuple[base.PyTree, jax.Array]:
  """``update min(1, C / ||update||)``: the update scaled into the C-ball.

  Returns the clipped update and the norm before clipping.
  """
  norm = safe_global_norm(update)
  factor = jnp.minimum(1.0, clip_norm / jnp.where(norm > 0, norm, 1.0))
  return jax.tree.map(lambda u: u * factor.astype(u.dtype), update), norm


def dp_fedavg(loss_fn: base.LossFn, *, clip_norm: float = 1.0,
              noise_multiplier: float = 1.0,
              expected_clients_per_round: float | None = None,
              client_optimizer: optax.GradientTransformation | None = None,
              server_optimizer: optax.GradientTransformation | None = None,
              metrics_fn: base.MetricsFn | None = None,
              local_epochs: int = 1, local_steps: int | None = None,
              map_strategy: str = 'auto',
              chunk_size: int | None = None,
              client_evaluation: bool = True,
              skip_nonfinite: bool = True) -> base.Algorithm:
  """DP-FedAvg with clipping norm ``C`` and noise multiplier ``z``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    clip_norm: ``C`` > 0 (traced: ``state.hparams['clip_norm']``).
    noise_multiplier: ``z`` >= 0 (``state.hparams['noise_multiplier']``).
    expected_clients_per_round: ``qN``, the fixed denominator; None divides
      by the number of participating clients.
    client_optimizer, server_optimizer, metrics_fn, local_epochs,
    local_steps, map_strategy, chunk_size, client_evaluation, skip_nonfinite:
      as for :func:`fedavg`. A skipped client counts as absent: it is not in
      the sum, nor (with ``expected_clients_per_round=None``) in ``D``.
  """
  name = 'dp_fedavg'
  base.check_number(name, 'clip_norm', clip_norm, strict=True)
  base.check_number(name, 'noise_multiplier', noise_multiplier)
  if expected_clients_per_round is not None:
    base.check_number(name, 'expected_clients_per_round',
                      expected_clients_per_round, strict=True)
  client_optimizer = client_optimizer or base.default_sgd(0.1)
  server_optimizer = server_optimizer or base.default_sgd(1.0)
  base.check_optimizer(name, 'client_optimizer', client_optimizer)
  base.check_optimizer(name, 'server_optimizer', server_optimizer)
  nonfinite.check_flag(name, skip_nonfinite)
  schedule = client_update.check_schedule(name, local_epochs, local_steps,
                                          client_evaluation)

  def init(params):
    return base.ServerState(
        params=params, opt_state=server_optimizer.init(params),
        hparams={'client_optimizer': base.optimizer_hparams(client_optimizer, params),
                 'server_optimizer': base.optimizer_hparams(server_optimizer, params),
                 'clip_norm': jnp.asarray(clip_norm, jnp.float32),
                 'noise_multiplier': jnp.asarray(noise_multiplier, jnp.float32)},
        round_index=jnp.zeros((), jnp.int32))

  def client_fn(x, hparams, clip, real, batches, mask):
    opt_state = base.with_hparams(client_optimizer.init(x), hparams)
    out = client_update.local_update(loss_fn, metrics_fn, client_optimizer, x,
                                     opt_state, batches, mask, schedule)
    clipped, norm = clip_update(base.tree_sub(x, out.params), clip)
    clipped = jax.tree.map(lambda u: u * real.astype(u.dtype), clipped)
    return nonfinite.ClientOutput(clipped, out.stats, extra=norm,
                                  checked=out.params)

  def round_fn(state, cohort, key):
    clip, z = state.hparams['clip_norm'], state.hparams['noise_multiplier']
    real = (cohort.num_examples > 0).astype(jnp.float32)
    clients = nonfinite.map_clients(client_fn, (
        fedjx.broadcast(state.params),
        fedjx.broadcast(state.hparams['client_optimizer']),
        fedjx.broadcast(clip), real, cohort.batches, cohort.mask),
        real, cohort.num_examples, skip_nonfinite)
    clipped, norms, real = clients.update, clients.extra, clients.weights
    total = fedjx.reduce_sum(clipped)
    leaves, treedef = jax.tree.flatten(total)
    keys = jax.random.split(key, len(leaves))
    noisy = jax.tree.unflatten(treedef, [
        t + (z * clip).astype(t.dtype) * jax.random.normal(k, t.shape, t.dtype)
        for t, k in zip(leaves, keys)])
    count = (fedjx.reduce_sum(real) if clients.totals is None
             else clients.totals['weights'])
    denom = (jnp.float32(expected_clients_per_round)
             if expected_clients_per_round is not None
             else jnp.maximum(count, 1.0))
    pseudo_grad = jax.tree.map(lambda t: t / denom.astype(t.dtype), noisy)
    params, opt_state = base.server_update(
        server_optimizer, state.opt_state, state.hparams['server_optimizer'],
        state.params, pseudo_grad)
    clipped_count = fedjx.reduce_sum(real * (norms > clip).astype(jnp.float32))
    metrics = nonfinite.round_metrics(
        clients,
        pseudo_grad_norm=optax.tree.norm(pseudo_grad),
        clipped_fraction=clipped_count / jnp.maximum(count, 1.0),
        mean_update_norm=fedjx.reduce_sum(real * norms) / jnp.maximum(count, 1.0),
        noise_std=z * clip)
    return state._replace(params=params, opt_state=opt_state,
                          round_index=state.round_index + 1), metrics

  return base.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                             metrics_fn=metrics_fn, map_strategy=map_strategy,
                             chunk_size=chunk_size)


def dp_epsilon(noise_multiplier: float, sampling_rate: float, num_rounds: int,
               delta: float, accountant: str = 'rdp') -> float:
  """Epsilon of ``num_rounds`` DP-FedAvg rounds at ``delta`` (user level).

  Each round is a Gaussian mechanism with noise multiplier ``z`` on a cohort
  Poisson-sampled with probability ``q``; ``R`` rounds compose. Computed with
  ``dp_accounting``'s RDP accountant (``'rdp'``) or privacy-loss-distribution
  accountant (``'pld'``).

  Args:
    noise_multiplier: ``z`` > 0.
    sampling_rate: ``q`` in ``(0, 1]``.
    num_rounds: ``R`` >= 0.
    delta: target delta in ``(0, 1)``.
    accountant: ``'rdp'`` or ``'pld'``.
  """
  fn = 'dp_epsilon'
  base.check_number(fn, 'noise_multiplier', noise_multiplier, strict=True)
  base.check_number(fn, 'sampling_rate', sampling_rate, strict=True, high=1.0)
  if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 0:
    raise ValueError(f'{fn}: num_rounds={num_rounds!r} must be an int >= 0.')
  base.check_number(fn, 'delta', delta, strict=True, high=1.0)
  base.check_choice(fn, 'accountant', accountant, ACCOUNTANTS)
  import dp_accounting  # pylint: disable=g-import-not-at-top
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)),
      num_rounds)
  acc = (dp_accounting.rdp.RdpAccountant() if accountant == 'rdp'
         else dp_accounting.pld.PLDAccountant())
  acc.compose(event)
  return float(acc.get_epsilon(delta))
