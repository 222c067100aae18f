"""APFL: adaptive personalized federated learning.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", 2020
(arXiv:2003.13461), Algorithm 1, with the adaptive mixing weight of their
Section 3 (FedJAX's ``fedjax/algorithms/apfl_lib.py``). The server keeps the
global model ``w``; each client ``i`` keeps a personal model ``v_i`` and a
mixing weight ``alpha_i`` in ``[0, 1]``, and is served the mixture

    vbar_i = alpha_i v_i + (1 - alpha_i) w.

A round on a cohort (every step ``t`` on a batch ``b_t`` of the client's
data, from the values of step ``t - 1``):

    client i:  w_i <- w,  v_i, alpha_i from its row (v_i <- w if it never ran)
               T times:  vbar = alpha_i v_i + (1 - alpha_i) w_i
                         g_w = grad f_i(w_i; b_t),  g = grad f_i(vbar; b_t)
                         w_i <- ClientOpt(w_i; g_w)
                         v_i <- ClientOpt(v_i; alpha_i g)     (grad_v f(vbar))
                         alpha_i <- clip(alpha_i - eta_a <v_i - w_i, g>, 0, 1)
               send Delta_i = w - w_i;  keep v_i, alpha_i
    server:    w <- w + ServerOpt(-sum_i w_i Delta_i / sum_i w_i)

``<v - w, g>`` is ``d f(vbar) / d alpha``, summed over every parameter (one
``alpha_i`` per client, as in the paper). ``personal_gradient='chain'`` (the
default) steps ``v_i`` on ``grad_v f(vbar) = alpha_i grad f(vbar)``, the
paper's ``nabla_v``; ``'mixed'`` steps it on ``grad f(vbar)`` itself, as
FedJAX does (and FedJAX keeps one ``alpha`` per parameter leaf, the same for
a model of one leaf). ``w_i`` and ``v_i`` each have their own optimizer
state, fresh every round; ``alpha_i`` takes plain gradient steps of
``alpha_learning_rate`` (``state.hparams``; 0 keeps it fixed).

The global model's local steps never read ``v_i`` or ``alpha_i``, so what
the server sees is FedAvg's update: any aggregator, the DP ones included,
applies to it as it does to FedAvg's, and the personal state never leaves
the client.

Per-client state (``Algorithm.client_state_init``, ``docs/client_state.md``):
a row ``{'params': v_i, 'alpha': alpha_i, 'rounds': r_i}``, ``r_i`` the
rounds the client trained in. A client that never trained (``r_i = 0``)
starts ``v_i`` from the current ``w`` (FedJAX's default state), so the
initial row is only a placeholder of the right shapes. A padding client, one
with no data and one skipped as non-finite keep their row unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import client_update

PERSONAL_GRADIENTS = ('chain', 'mixed')

TRAITS = kit.Traits(options=kit.options_but('client_transform'))
"""What APFL declares: FedAvg's options but the client transform
(:class:`~fedjx.algorithms.traits.Traits`)."""


def mix(alpha: jax.Array, personal: kit.Params,
        server: kit.Params) -> kit.Params:
  """``alpha v + (1 - alpha) w``, leaf by leaf, in each leaf's dtype."""
  def one(v, w):
    a = jnp.asarray(alpha, jnp.result_type(w))
    return a * v + (1 - a) * w
  return jax.tree.map(one, personal, server)


def alpha_gradient(personal: kit.Params, server: kit.Params,
                   grads: kit.Params) -> jax.Array:
  """``<v - w, g>`` over every parameter: ``d f(alpha v + (1-alpha) w) / d alpha``."""
  parts = jax.tree.map(
      lambda v, w, g: jnp.sum((v - w).astype(jnp.float32) * g.astype(jnp.float32)),
      personal, server, grads)
  return sum(jax.tree.leaves(parts), jnp.zeros((), jnp.float32))


def initial_row(params: kit.Params, init_alpha: float = 0.5) -> dict[str, Any]:
  """One client's row before it ever trains: ``v`` (a copy of ``params``,
  replaced by the current ``w`` at its first round), ``alpha`` and 0 rounds."""
  return {'params': jax.tree.map(lambda p: jnp.array(p, copy=True), params),
          'alpha': jnp.asarray(init_alpha, jnp.float32),
          'rounds': jnp.zeros((), jnp.int32)}


def personalize_fn() -> Callable[[Any, Any, Any], kit.Params]:
  """``personalize(server_state, client_state, train) -> params``: the mixture.

  ``alpha_i v_i + (1 - alpha_i) w`` with ``w = server_state.params``; a client
  without a row (``client_state`` None) or that never trained is served
  ``w``. ``train`` is not read: APFL's personal model is trained in the
  rounds.
  """
  def personalize(server_state, client_state, train):
    del train
    w = server_state.params
    if client_state is None:
      return w
    trained = jnp.asarray(client_state['rounds']) > 0
    mixed = mix(client_state['alpha'], client_state['params'], w)
    return jax.tree.map(lambda m, x: jnp.where(trained, m, x), mixed, w)
  return personalize


@kit.declare(TRAITS)
def apfl(loss_fn: kit.LossFn, *, init_alpha: float = 0.5,
         alpha_learning_rate: float = 0.1, personal_gradient: str = 'chain',
         **options: Any) -> kit.Algorithm:
  """APFL (Deng et al. 2020), Algorithm 1 with adaptive ``alpha``.

  The template's round (:func:`fedjx.algorithms.kit.algorithm`) with APFL's
  client: the coupled local steps of ``w_i``, ``v_i`` and ``alpha_i``, the
  last two in its row.

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    init_alpha: every client's first ``alpha_i``, in ``[0, 1]`` [0.5].
    alpha_learning_rate: ``eta_a``, the step of ``alpha_i``
      (``state.hparams['alpha_learning_rate']``; 0 keeps ``alpha`` fixed)
      [0.1].
    personal_gradient: ``'chain'`` (``v`` steps on ``alpha grad f(vbar)``,
      the paper's) or ``'mixed'`` (on ``grad f(vbar)``, FedJAX's).
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``client_transform``:
      ``client_optimizer`` is the local optimizer of ``w_i`` and of ``v_i``
      (each its own state) [SGD 0.1]. A client whose trained model or new
      row is NaN or Inf is skipped and keeps its row.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm`, with ``client_state_init``
    (rows ``{'params', 'alpha', 'rounds'}``): ``round(state, cohort, key) ->
    (state, metrics, client_states)``, reading ``cohort.client_states``; the
    state is a :class:`~fedjx.algorithms.ServerState`. With
    ``client_evaluation``, metrics add ``train_personal_loss_before`` /
    ``_after`` (the mixture before and after the local steps, on the
    clients' data); always ``alpha_mean``, the mean new ``alpha_i`` of the
    clients that trained.
  """
  name = 'apfl'
  kit.check_number(name, 'init_alpha', init_alpha, high=1.0)
  kit.check_number(name, 'alpha_learning_rate', alpha_learning_rate)
  kit.check_choice(name, 'personal_gradient', personal_gradient,
                   PERSONAL_GRADIENTS)
  o = kit.Options.of(name, options, TRAITS.options)
  client_optimizer, schedule = o.client_optimizer, o.schedule
  metrics_fn, chain = o.metrics_fn, personal_gradient == 'chain'

  def local_steps(x, v, alpha, eta_a, hparams, batches, mask):
    """The coupled local steps of ``w_i``, ``v_i`` and ``alpha_i``."""
    value_grad = jax.value_and_grad(client_update.masked_mean_loss, argnums=1)
    grad = jax.grad(client_update.masked_mean_loss, argnums=1)
    sw = kit.with_hparams(client_optimizer.init(x), hparams)
    sv = kit.with_hparams(client_optimizer.init(v), hparams)

    def real_step(carry, batch, m, is_real):
      w, v, a, sw, sv, total, count = carry
      loss, gw = value_grad(loss_fn, w, batch, m)
      g = grad(loss_fn, mix(a, v, w), batch, m)
      ga = alpha_gradient(v, w, g)
      gv = jax.tree.map(lambda t: (a * t).astype(t.dtype), g) if chain else g
      uw, sw2 = client_optimizer.update(gw, sw, w)
      uv, sv2 = client_optimizer.update(gv, sv, v)
      new = (optax.apply_updates(w, uw), optax.apply_updates(v, uv),
             jnp.clip(a - eta_a * ga, 0.0, 1.0), sw2, sv2)
      keep = lambda n, old: jnp.where(is_real, n, old).astype(jnp.result_type(old))
      n = jnp.sum(m).astype(jnp.float32)
      kept = jax.tree.map(keep, new, (w, v, a, sw, sv))
      return kept + (total + jnp.where(is_real, loss * n, 0.0).astype(jnp.float32),
                     count + jnp.where(is_real, n, 0.0))

    def step(carry, i, is_real):
      # Entered only when a client run with this one has a real step here
      # (scan_steps); real_step keeps the state of a client whose is not.
      batch, m = jax.tree.map(lambda z: z[i], (batches, mask))
      return real_step(carry, batch, m, is_real), None

    index, active = client_update.step_schedule(mask, schedule)
    zero = jnp.zeros((), jnp.float32)
    carry = client_update.tie_to(
        (x, v, jnp.asarray(alpha, jnp.float32), sw, sv, zero, zero), mask)
    carry, _ = client_update.scan_steps(step, carry, index, active)
    w, v, a, sw, _, total, count = carry
    return w, v, a, sw, jnp.sum(active, dtype=jnp.int32), total, count

  def client(c):
    x, row, batches, mask = c.x, c.state, c.batches, c.mask
    fresh = row['rounds'] == 0
    v0 = jax.tree.map(lambda w, v: jnp.where(fresh, w, v), x, row['params'])
    a0 = row['alpha']
    y, v, a, opt_state, num_steps, total, count = local_steps(
        x, v0, a0, c.hparams['alpha_learning_rate'],
        c.hparams['client_optimizer'], batches, mask)
    if schedule.evaluate:
      before = client_update.evaluate(loss_fn, metrics_fn, x, batches, mask)
      after = client_update.evaluate(loss_fn, metrics_fn, y, batches, mask)
      stats = {'count': before.pop('count')}
      after.pop('count')
      stats.update({f'{k}_before': s for k, s in before.items()})
      stats.update({f'{k}_after': s for k, s in after.items()})
      for when, model in (('before', mix(a0, v0, x)), ('after', mix(a, v, y))):
        stats[f'personal_loss_{when}'] = client_update.evaluate(
            loss_fn, None, model, batches, mask)['loss']
    else:
      stats = {'loss_during': total, 'count': count}
    has_data = jnp.any(mask)
    new_row = {'params': v, 'alpha': a, 'rounds': row['rounds'] + 1}
    new_row = jax.tree.map(lambda n, old: jnp.where(has_data, n, old),
                           new_row, row)
    extra = {'alpha_sum': jnp.where(has_data, a, 0.0),
             'alpha_count': has_data.astype(jnp.float32), 'client_alpha': a}
    return kit.Upload(optax.tree.sub(x, y),
                      kit.ClientUpdate(y, opt_state, num_steps, stats),
                      extra=extra, state=new_row, checked=(y, new_row))

  def server(s):  # The mean new alpha_i of the clients that trained.
    extra = s.clients.extra
    sums = fedjx.reduce_sum({'alpha_sum': extra['alpha_sum'],
                             'alpha_count': extra['alpha_count']})
    metrics = {'alpha_mean': sums['alpha_sum'] / jnp.maximum(
        sums['alpha_count'], 1.0)}
    if o.client_metrics:  # Per-client [C].
      metrics['client_alpha'] = extra['client_alpha']
    return kit.Step(s.aggregate, metrics=metrics)

  return kit.algorithm(
      name, loss_fn, o, client=client, server=server,
      hparams={'alpha_learning_rate': alpha_learning_rate}, traits=TRAITS,
      client_state=kit.ClientState(lambda params: initial_row(params, init_alpha)))


__all__ = ['PERSONAL_GRADIENTS', 'alpha_gradient', 'apfl', 'initial_row',
           'mix', 'personalize_fn']
