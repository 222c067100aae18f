"""FedRep and FedPer: a shared body averaged, a personal head kept by each client.

The model's parameters are split into a body ``phi`` (the shared
representation) and a head ``h``; the server keeps ``phi`` and each client
``i`` keeps its own head ``h_i`` between rounds (outside the server state,
``Algorithm.client_state_init``: a client that never took part has the
initial model's head). A round on a cohort ``S``:

FedRep (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared
Representations for Personalized Federated Learning", ICML 2021,
Algorithm 1), head steps then body steps:

    client i in S:  tau_h times:    h_i   <- h_i   - eta grad_h   f_i(phi,   h_i)
                    tau_phi times:  phi_i <- phi_i - eta grad_phi f_i(phi_i, h_i)
                    (phi_i starts at phi), keep h_i, send Delta_i = phi - phi_i
    server:         phi <- phi + ServerOpt(sum_i w_i Delta_i / sum_i w_i)

FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with
Personalization Layers", arXiv 1912.00818, 2019), joint local steps:

    client i in S:  (phi_i, h_i) <- (phi, h_i);  tau times:
                      (phi_i, h_i) <- (phi_i, h_i) - eta grad f_i(phi_i, h_i)
                    keep h_i, send Delta_i = phi - phi_i
    server:         as FedRep.

``eta`` is the client optimizer (SGD 0.1 by default; a fresh state for each
phase), ``tau`` the local schedule (``local_epochs`` / ``local_steps``;
FedRep's head phase: ``head_epochs`` / ``head_steps``). Only the body is
sent, so an aggregator (a DP one included) sees the body update only; the
head never leaves the client. With ``ServerOpt = SGD(1)`` (the default) the
body is the weighted mean of the ``phi_i``; the papers' is the uniform mean
(``weighting='uniform'``).

Which parameters are the head, ``head``, labels the parameter tree the way
``optax.multi_transform``'s ``param_labels`` do:

* a pytree with the params' structure whose leaves are ``'head'`` or
  ``'body'`` (or True for head, False for body);
* a callable ``params -> such a pytree``;
* a name or a tuple of names (for configs): a parameter is in the head when
  one of the keys on its path is one of them, e.g. ``head='logits'`` for
  the last layer of :func:`fedjx.models.mlp`.

A client's row (its ``client_states`` entry) is a dict of its head's
arrays keyed by their paths in the params (``jax.tree_util.keystr``).
Evaluating the personalized models: :func:`personalize_fn`.

The round is written by hand, not the round template's
(:mod:`fedjx.algorithms.template`): the server's model and optimizer are
the body's alone, where the template's server steps the model the clients
train.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

import fedjx
from fedjx.algorithms import kit
from fedjx.algorithms import template
from fedjx.algorithms import nonfinite
from fedjx.algorithms import client_update
from fedjx.algorithms import base
from fedjx.algorithms.aggregators import core as aggregators

HeadLabels = Any  # A labels pytree, a callable params -> labels, or names.

LABELS = ('head', 'body')

TRAITS = kit.Traits(options=kit.options_but('client_transform'))
"""What FedRep and FedPer declare: FedAvg's options but the client transform
(the clients' steps are on the head or the body alone, not on the model a
transform is anchored to) (:class:`~fedjx.algorithms.traits.Traits`)."""


# ---------------------------------------------------------------- the split

def check_head(fn: str, head: HeadLabels) -> None:
  """The checks of ``head`` that need no params (names must be non-empty)."""
  if callable(head):
    return
  names = (head,) if isinstance(head, str) else head
  if isinstance(names, (tuple, list)) and all(isinstance(h, str) for h in names):
    if not names or not all(names):
      raise ValueError(f'{fn}: head={head!r} names no parameter; give the '
                       'key(s) of the head\'s parameters, e.g. head=\'logits\'.')
    return
  if not jax.tree.leaves(head):
    raise ValueError(f'{fn}: head={head!r} is not a labels pytree, a callable '
                     'params -> labels, or a name or tuple of names.')


def head_mask(fn: str, head: HeadLabels, params: kit.Params) -> list[bool]:
  """One bool per leaf of ``params`` (in ``jax.tree.leaves`` order): in the head?

  One-line errors for labels that do not fit the params, that are not
  ``'head'``/``'body'``/bools, or that leave the head or the body empty.
  """
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  if isinstance(head, str):
    head = (head,)
  if isinstance(head, (tuple, list)) and all(isinstance(h, str) for h in head):
    names = set(head)
    mask = [any(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', None)))
                in names for k in path) for path, _ in paths]
  else:
    labels = head(params) if callable(head) else head
    try:
      leaves = jax.tree.leaves(jax.tree.map(lambda _, l: l, params, labels))
    except ValueError:
      raise ValueError(
          f'{fn}: head labels of structure {jax.tree.structure(labels)} do not '
          f'match the params of structure {jax.tree.structure(params)}.') from None
    mask = []
    for (path, _), label in zip(paths, leaves):
      if isinstance(label, (bool, jnp.bool_)):
        mask.append(bool(label))
      elif label in LABELS:
        mask.append(label == 'head')
      else:
        raise ValueError(f'{fn}: head label {label!r} of params'
                         f'{jax.tree_util.keystr(path)} is not one of {LABELS} '
                         'or a bool.')
  if all(mask) or not any(mask):
    part = 'body' if all(mask) else 'head'
    raise ValueError(
        f'{fn}: head={head!r} leaves the {part} empty for params with keys '
        f'{[jax.tree_util.keystr(p) for p, _ in paths]}; both parts need a '
        'parameter.')
  return mask


class Split:
  """The params' tree split into body and head (dicts keyed by path)."""

  def __init__(self, fn: str, head: HeadLabels, params: kit.Params):
    flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.keys = [jax.tree_util.keystr(p) for p, _ in flat]
    self.mask = head_mask(fn, head, params)

  def _part(self, params, in_head):
    leaves = self.treedef.flatten_up_to(params)
    return {k: v for k, v, m in zip(self.keys, leaves, self.mask) if m == in_head}

  def body(self, params: kit.Params) -> dict[str, jax.Array]:
    return self._part(params, False)

  def head(self, params: kit.Params) -> dict[str, jax.Array]:
    return self._part(params, True)

  def merge(self, body: Mapping[str, Any], head: Mapping[str, Any]) -> kit.Params:
    return self.treedef.unflatten(
        [head[k] if m else body[k] for k, m in zip(self.keys, self.mask)])


def _copy(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


# ---------------------------------------------------------------- the round

def _stats(before, after):
  """``local_update``'s statistics from evaluations before and after."""
  before, after = dict(before), dict(after)
  stats = {'count': before.pop('count')}
  after.pop('count')
  stats.update({f'{k}_before': v for k, v in before.items()})
  stats.update({f'{k}_after': v for k, v in after.items()})
  return stats


def _build(name: str, loss_fn: kit.LossFn, head: HeadLabels,
           options: Mapping[str, Any],
           head_schedule: client_update.LocalSchedule | None) -> kit.Algorithm:
  o = kit.Options.of(name, options, TRAITS.options)
  check_head(name, head)
  client_optimizer, server_optimizer = o.client_optimizer, o.server_optimizer
  aggregator, schedule = o.aggregator, o.schedule
  metrics_fn, client_metrics = o.metrics_fn, o.client_metrics
  quiet = schedule._replace(evaluate=False)

  def steps(loss, params, hparams, batches, mask, sched):
    state = kit.with_hparams(client_optimizer.init(params), hparams)
    return client_update.train(loss, client_optimizer, params, state,
                     batches, mask, sched)

  def client_fn(x, h_i, hparams, batches, mask):
    split = Split(name, head, x)
    phi = split.body(x)
    start = split.merge(phi, h_i)
    if schedule.evaluate:
      before = client_update.evaluate(loss_fn, metrics_fn, start, batches, mask)
    if head_schedule is None:  # FedPer: joint steps on (phi_i, h_i).
      trained, _, k, sums = steps(loss_fn, start, hparams, batches, mask, quiet)
      phi_i, h_new = split.body(trained), split.head(trained)
    else:  # FedRep: the head with phi fixed, then the body with the new head.
      h_new, _, _, _ = steps(lambda h, b: loss_fn(split.merge(phi, h), b),
                             h_i, hparams, batches, mask, head_schedule)
      phi_i, _, k, sums = steps(lambda p, b: loss_fn(split.merge(p, h_new), b),
                                phi, hparams, batches, mask, quiet)
      trained = split.merge(phi_i, h_new)
    if schedule.evaluate:
      stats = _stats(before, client_update.evaluate(loss_fn, metrics_fn,
                                          trained, batches, mask))
    else:
      stats = {'loss_during': sums['loss'], 'count': sums['count']}
    delta = base.tree_sub(phi, phi_i)
    out = kit.ClientUpdate(trained, (), k, stats)
    extra = base.client_metrics(delta, out) if client_metrics else ()
    return nonfinite.ClientOutput(delta, stats, extra=extra, state=h_new,
                            previous_state=h_i, checked=(phi_i, h_new))

  def init(params):
    split = Split(name, head, params)
    body = split.body(params)
    return kit.ServerState(
        params=params, opt_state=server_optimizer.init(body),
        hparams=template.hparams_of(name, o, {}, params),
        round_index=jnp.zeros((), jnp.int32),
        aggregator_state=aggregator.init(body))

  def client_state_init(params):  # A new client's head: the initial model's.
    return _copy(Split(name, head, params).head(params))

  def round_fn(state, cohort, key):
    split = Split(name, head, state.params)
    clients = aggregators.map_clients(
        aggregator, state.hparams, client_fn,
        (fedjx.broadcast(state.params), cohort.client_states,
         fedjx.broadcast(state.hparams['client_optimizer']),
         cohort.batches, cohort.mask),
        cohort.num_examples, o.weighting, o.skip_nonfinite,
        aggregator_state=state.aggregator_state, client_ids=cohort.client_ids)
    delta, agg_state, agg_metrics = aggregators.aggregate(
        aggregator, state.aggregator_state, state.hparams, clients, key)
    body, opt_state = base.server_update(
        server_optimizer, state.opt_state, state.hparams['server_optimizer'],
        split.body(state.params), delta)
    metrics = nonfinite.round_metrics(
        clients, pseudo_grad_norm=optax.tree.norm(delta), **agg_metrics)
    metrics.update(clients.extra)  # Per-client [C] metrics, if asked.
    state = state._replace(params=split.merge(body, split.head(state.params)),
                           opt_state=opt_state, round_index=state.round_index + 1,
                           aggregator_state=agg_state)
    return state, metrics, clients.state

  return kit.make_algorithm(name, init, round_fn, loss_fn=loss_fn,
                            metrics_fn=metrics_fn,
                            client_state_init=client_state_init, traits=TRAITS)


@kit.declare(TRAITS)
def fedrep(loss_fn: kit.LossFn, head: HeadLabels = 'logits', *,
           head_epochs: int = 1,
           head_steps: int | None = None, **options: Any) -> kit.Algorithm:
  """FedRep: each client's head steps, then its body steps (module docstring).

  Args:
    loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
    head: which parameters are the head (module docstring): labels, a
      callable ``params -> labels``, or key name(s); the default,
      ``'logits'``, is the output layer of every :mod:`fedjx.models` model.
    head_epochs: passes of the head phase over the client's steps
      (``tau_h``; Collins et al. use several), or
    head_steps: exactly this many head steps.
    **options: :func:`~fedjx.algorithms.fedavg`'s but ``client_transform``:
      ``client_optimizer`` is both phases' optimizer (default SGD 0.1,
      injected; ``state.hparams['client_optimizer']``), a fresh state for
      each phase, applied to the head's or the body's arrays (dicts keyed by
      path); ``local_epochs``, ``local_steps`` the body phase
      (``tau_phi``); ``server_optimizer`` on the mean body update (default
      SGD 1.0: averaging); ``aggregator`` combines the body updates
      ``Delta_i`` (a DP aggregator privatizes them; the heads stay with the
      clients); the losses before and after are at ``(phi, h_i)`` as
      received and at ``(phi_i, h_i+)``; a skipped client keeps its head.

  Returns:
    The :class:`~fedjx.algorithms.Algorithm` (its state a
    :class:`~fedjx.algorithms.ServerState` whose optimizer state is the
    body's), with ``client_state_init``: rows are the clients' heads.
  """
  name = 'fedrep'
  try:
    head_schedule = client_update.check_schedule(
        name, head_epochs, head_steps, False)
  except ValueError as e:  # Named as the arguments are.
    raise ValueError(str(e).replace('local_', 'head_')) from None
  return _build(name, loss_fn, head, options, head_schedule)


@kit.declare(TRAITS)
def fedper(loss_fn: kit.LossFn, head: HeadLabels = 'logits',
           **options: Any) -> kit.Algorithm:
  """FedPer: joint local steps on body and personal head; the body averaged.

  Arguments as :func:`fedrep` without the head phase; ``local_epochs`` /
  ``local_steps`` are the joint steps.
  """
  name = 'fedper'
  return _build(name, loss_fn, head, options, None)


# ---------------------------------------------------------- personalization

def personalize_fn(loss_fn: kit.LossFn, head: HeadLabels = 'logits', *,
                   head_steps: int = 0,
                   optimizer: optax.GradientTransformation | None = None
                   ) -> Callable[[Any, Any, Mapping[str, Any]], kit.Params]:
  """``personalize(server_state, client_state, train) -> params`` for FedRep / FedPer.

  The global body with the client's own head (its row; a client that never
  trained has the initial head), then, if ``head_steps > 0``, that many
  steps of ``optimizer`` (default SGD 0.1) on the head alone over the
  client's training split ``train = {'batches': {k: [S, B, ...]}, 'mask':
  [S, B]}`` (cycling through its real steps), FedRep's head phase.
  """
  fn = 'fedrep.personalize_fn'
  check_head(fn, head)
  if isinstance(head_steps, bool) or not isinstance(head_steps, int) or head_steps < 0:
    raise ValueError(f'{fn}: head_steps={head_steps!r} must be an int >= 0.')
  optimizer = optimizer or optax.sgd(0.1)
  kit.check_optimizer(fn, 'optimizer', optimizer)

  def personalize(server_state, client_state, train):
    split = Split(fn, head, server_state.params)
    phi = split.body(server_state.params)
    h = client_state
    if head_steps:
      sched = client_update.LocalSchedule(steps=head_steps, evaluate=False)
      h, _, _, _ = client_update.train(
          lambda h, b: loss_fn(split.merge(phi, h), b), optimizer, h,
          optimizer.init(h), train['batches'], train['mask'], sched)
    return split.merge(phi, h)

  return personalize


__all__ = ['Split', 'fedper', 'fedrep', 'head_mask', 'personalize_fn']
