"""Evaluating personalized models: each client's own model on its own held-out data.

As TensorFlow Federated's ``personalization_eval``: for every evaluated
client ``i`` with training split ``D_i`` and held-out split ``T_i`` (from
:func:`fedjx.datasets.client_splits`),

    params_i = personalize(server_state, client_state_i, D_i)

and both ``params_i`` (*personal*) and the global model ``w`` (*global*,
``server_state.params``) are evaluated on ``T_i``: the example mean over
``T_i`` of the model's evaluation loss and each metric. What is reported is
the distribution of these per-client numbers over the clients, each client
counting once (:func:`distribution`): mean, p10, p25, median, p75, p90 and
the mean of the worst 10% of clients.

``personalize`` is the contract of ``docs/client_state.md``:
``client_state_i`` is client ``i``'s row (None for a stateless algorithm),
``D_i = {'batches': {k: [S, B, ...]}, 'mask': [S, B]}``. :func:`fine_tune`
is one (``k`` local steps or epochs from ``w``); FedRep, Ditto, APFL and
HypCluster each provide theirs (``fedjx.algorithms.<name>_lib.personalize_fn``).

The work is one ``fedjx.program`` over a block of ``cohort_size`` clients
(``map_fn`` over them, so the map strategy and chunk size bound device
memory as in a round), and the host walks the evaluated clients block by
block, so memory does not grow with their number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjx
from fedjx import datasets
from fedjx.algorithms import client_update
from fedjx.options import MapOptions

Personalize = Callable[[Any, Any, Mapping[str, Any]], Any]

# The statistics of a per-client distribution, in the order they are reported.
STATISTICS = ('mean', 'p10', 'p25', 'median', 'p75', 'p90', 'worst10')


def fine_tune(loss_fn: Callable[[Any, Any], jax.Array],
              optimizer: optax.GradientTransformation, *,
              steps: int | None = None, epochs: int | None = None) -> Personalize:
  """``personalize``: the global model fine-tuned on the client's training split.

  From ``w = server_state.params`` and a fresh ``optimizer.init(w)``, either
  ``steps`` steps (cycling through the client's real batches in order) or
  ``epochs`` passes over its batches, each step on the masked mean loss of
  one batch, ``w <- w + optimizer.update(grad, ...)`` (as a client's local
  training in FedAvg, :func:`fedjx.algorithms.client_update.train`).
  ``client_state`` is not read. Give exactly one of ``steps``, ``epochs``.
  """
  if (steps is None) == (epochs is None):
    raise ValueError(f'fine_tune: give exactly one of steps={steps!r} and '
                     f'epochs={epochs!r}.')
  for name, value in (('steps', steps), ('epochs', epochs)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
      raise ValueError(f'fine_tune: {name}={value!r}; it must be an int >= 1.')
  schedule = client_update.LocalSchedule(epochs=epochs or 1, steps=steps,
                                         evaluate=False)

  def personalize(server_state, client_state, train):
    del client_state
    w = server_state.params
    params, _, _, _ = client_update.train(
        loss_fn, optimizer, w, optimizer.init(w), train['batches'],
        jnp.asarray(train['mask']), schedule)
    return params

  return personalize


def distribution(values: Any, lower_is_worse: bool = True) -> dict[str, float]:
  """Statistics of per-client values, each client counting once.

  ``p<q>`` and ``median`` are NumPy's linearly interpolated percentiles;
  ``worst10`` is the mean of the ``ceil(K / 10)`` worst of the ``K`` values
  (the lowest if ``lower_is_worse``, as for accuracy; the highest for a
  loss).
  """
  v = np.asarray(values, np.float64).reshape(-1)
  if v.size == 0:
    raise ValueError('distribution: values is empty; it needs one value per '
                     'evaluated client.')
  q = np.percentile(v, [10, 25, 50, 75, 90])
  k = math.ceil(v.size / 10)
  worst = np.sort(v)[:k] if lower_is_worse else np.sort(v)[::-1][:k]
  return dict(zip(STATISTICS, [float(v.mean()), *map(float, q),
                               float(worst.mean())]))


class PersonalizationResult(NamedTuple):
  """Per-client held-out metrics of the personal and the global models.

  Attributes:
    client_ids: ``[K]`` the evaluated clients (ids of the splits).
    num_examples: ``[K]`` each client's held-out examples.
    personal: ``{metric: [K]}``, ``params_i`` on ``T_i`` (``'loss'`` and the
      model's metrics, e.g. ``'accuracy'``).
    global_: the same for the global model.
  """

  client_ids: np.ndarray
  num_examples: np.ndarray
  personal: dict[str, np.ndarray]
  global_: dict[str, np.ndarray]

  def summary(self) -> dict[str, float]:
    """``{'personal/<metric>_<stat>', 'global/<metric>_<stat>'...}``
    (:data:`STATISTICS`), plus ``personal/num_clients``."""
    out = {}
    for side, values in (('personal', self.personal), ('global', self.global_)):
      for metric, v in sorted(values.items()):
        stats = distribution(v, lower_is_worse=metric != 'loss')
        out.update({f'{side}/{metric}_{k}': x for k, x in stats.items()})
    out['personal/num_clients'] = float(self.client_ids.size)
    return out


def _read_rows(client_states: Any, ids: np.ndarray) -> Any:
  if client_states is None:
    return None
  read = getattr(client_states, 'read', client_states)
  return read(ids)


_BLOCKS: dict[tuple, Callable[..., Any]] = {}


def _block(personalize: Personalize, model: Any, c: int, stateful: bool,
           map_options: MapOptions) -> Callable[..., Any]:
  """The compiled program of one block of ``c`` clients (kept for reuse)."""
  key = (id(personalize), id(model), c, stateful, map_options)
  if key in _BLOCKS and _BLOCKS[key][0] is personalize and _BLOCKS[key][1] is model:
    return _BLOCKS[key][2]

  def client(state, w, row, tb, tm, eb, em):
    params = personalize(state, row if stateful else None,
                         {'batches': tb, 'mask': tm})
    personal = client_update.evaluate(model.eval_loss_fn, model.metrics_fn,
                                      params, eb, em)
    global_ = client_update.evaluate(model.eval_loss_fn, model.metrics_fn,
                                     w, eb, em)
    return personal, global_

  @jax.jit
  def block(state, w, rows, tb, tm, eb, em):
    @fedjx.program(clients=c, map_strategy=map_options)
    def run(state, w, rows, tb, tm, eb, em):
      args = (fedjx.broadcast(state), fedjx.broadcast(w), rows, tb, tm, eb, em)
      return fedjx.map_fn(client, args)
    return run(state, w, rows, tb, tm, eb, em)

  if len(_BLOCKS) > 32:
    _BLOCKS.clear()
  _BLOCKS[key] = (personalize, model, block)
  return block


def personalization_eval(personalize: Personalize, server_state: Any,
                         model: Any, train: datasets.FederatedDataset,
                         test: datasets.FederatedDataset, *,
                         batch_size: int,
                         client_ids: Sequence[int] | np.ndarray | None = None,
                         client_states: Any = None,
                         global_params: Any = None,
                         cohort_size: int = 16,
                         max_steps: int | None = None,
                         map_strategy: str | MapOptions = 'auto',
                         chunk_size: int | None = None) -> PersonalizationResult:
  """Evaluates ``personalize``'s models of ``client_ids`` (see the module doc).

  Args:
    personalize: ``personalize(server_state, client_state, train) -> params``.
    server_state: the algorithm's server state.
    model: a ``fedjx.models.Model`` (``eval_loss_fn``, ``metrics_fn``).
    train, test: per-client training and held-out splits with the same ids
      (:func:`fedjx.datasets.client_splits`).
    batch_size: examples per batch of both splits.
    client_ids: the clients evaluated (default: all of ``train``'s).
    client_states: None (stateless), a ``fedjx.ClientStore`` or
      ``read(ids) -> rows``: the clients' rows (ids of ``train``).
    global_params: the global model (default ``server_state.params``).
    cohort_size: clients per compiled block (the last is padded).
    max_steps: at most this many batches of a client's training split.
    map_strategy, chunk_size: how ``map_fn`` runs a block's clients (or
      ``map_strategy`` a checked :class:`fedjx.options.MapOptions`).
  """
  map_options = MapOptions.of(map_strategy, chunk_size, 'personalization_eval: ')
  if isinstance(cohort_size, bool) or not isinstance(cohort_size, int) or cohort_size < 1:
    raise ValueError(f'personalization_eval: cohort_size={cohort_size!r}; it must '
                     'be an int >= 1.')
  if train.num_clients != test.num_clients:
    raise ValueError(f'personalization_eval: train has {train.num_clients} clients'
                     f' and test {test.num_clients}; the splits must share ids '
                     '(fedjx.datasets.client_splits).')
  ids = (train.client_ids if client_ids is None
         else np.asarray([train.check_client(c) for c in
                          np.asarray(client_ids).reshape(-1).tolist()], np.int32))
  if ids.size == 0:
    raise ValueError('personalization_eval: client_ids is empty; give at least '
                     'one client to evaluate.')
  if global_params is None:
    global_params = server_state.params
  c = min(cohort_size, int(ids.size))
  block = _block(personalize, model, c, client_states is not None, map_options)
  sums: list[tuple[dict, dict]] = []
  for start in range(0, ids.size, c):
    chunk = ids[start:start + c]
    tr = datasets.make_cohort(train, chunk, batch_size, num_epochs=1,
                              max_steps=max_steps, shuffle_seed=None, pad_to=c)
    te = datasets.make_cohort(test, chunk, batch_size, num_epochs=1,
                              shuffle_seed=None, pad_to=c)
    rows = (jnp.zeros(c) if client_states is None
            else _read_rows(client_states, tr.client_ids))
    out = block(server_state, global_params, rows, tr.batches, tr.mask,
                te.batches, te.mask)
    out = jax.device_get(out)
    sums.append(jax.tree.map(lambda x, n=chunk.size: np.asarray(x)[:n], out))
  personal = {k: np.concatenate([s[0][k] for s in sums]) for k in sums[0][0]}
  global_ = {k: np.concatenate([s[1][k] for s in sums]) for k in sums[0][1]}
  count = personal.pop('count')
  global_.pop('count')
  n = np.maximum(count, 1.0)
  return PersonalizationResult(
      ids.astype(np.int64), count.astype(np.int64),
      {k: v / n for k, v in personal.items()},
      {k: v / n for k, v in global_.items()})


__all__ = ['PersonalizationResult', 'STATISTICS', 'distribution', 'fine_tune',
           'personalization_eval']
