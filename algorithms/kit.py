"""The algorithm kit: the whole vocabulary an algorithm is written with.

Every algorithm of :mod:`fedjx.algorithms`, FedAvg included, is written from
this one module (``from fedjx.algorithms import kit``, names used as
``kit.X``) and the fedjx primitives. A round of a FedAvg-like algorithm
(McMahan et al. 2017, Algorithm 1; Reddi et al. 2021, Algorithm 1) reads, in
the kit's words::

    x = state.params
    for each client i (kit.map_clients, a fedjx.map_fn):
        y_i = kit.local_update(ClientOpt, x, D_i)     (T local steps)
        kit.ClientOutput(update=x - y_i, stats=..., state=...)
    Delta = kit.aggregate(...)    = sum_i w_i Delta_i / sum_i w_i  (kit.mean())
    x <- kit.server_update(...)   = x + ServerOpt(Delta)
    metrics = kit.round_metrics(clients, ...)
    kit.make_algorithm(name, init, round_fn, ...)

The names, by concept (each is defined in the module named, which holds one
concept; the kit curates them, and defines FedAvg's options and standard
parts, which every FedAvg-like algorithm shares):

1. State: :class:`ServerState` (``params``, ``opt_state``, ``hparams``,
   ``round_index``, ``aggregator_state``; an algorithm with more state
   defines its own ``NamedTuple`` with ``params`` and ``hparams`` at least),
   :class:`Algorithm`, :func:`make_algorithm`, :func:`scan_rounds`, the
   types ``Params``, ``PyTree``, ``LossFn``, ``MetricsFn``, ``Metrics``
   (:mod:`~fedjx.algorithms.base`).
2. Hyperparameters, traced in ``state.hparams``: :func:`optimizer_hparams`,
   :func:`with_hparams`, :func:`hparam_names`, :func:`combine_hparams`,
   :func:`default_sgd`, :func:`scheduled` (:mod:`~fedjx.algorithms.schedules`).
3. The local update, one client's steps inside ``fedjx.map_fn``:
   :func:`local_update`, :func:`train`, :func:`evaluate`,
   :class:`LocalSchedule`, :class:`ClientUpdate`, :func:`step_schedule`,
   :func:`scan_steps`, :func:`tie_to`, :func:`masked_mean_loss`
   (:mod:`~fedjx.algorithms.client_update`); client-side variants chained in
   front of the client optimizer: :func:`proximal`, :class:`ProximalState`,
   :func:`control_variate`, :func:`learning_rate_of`
   (:mod:`~fedjx.algorithms.transforms.core`); :func:`client_training`
   (the client optimizer after an optional transform), :func:`tree_sub`,
   :func:`client_metrics`, :func:`gather_clients`, :func:`scatter_clients`.
4. The client map and its non-finite guard: :func:`map_clients` (with an
   aggregator's per-client encode), :func:`map_guarded` (given weights, no
   aggregator), :class:`ClientOutput`, :class:`Clients`,
   :func:`weighted_mean`, :func:`participants` (the guarded cohort's count),
   :func:`aggregation_weights`, ``WEIGHTINGS``
   (:mod:`~fedjx.algorithms.nonfinite`, :mod:`~fedjx.algorithms.aggregators`).
5. Aggregation and the server update: :class:`Aggregator`, :func:`mean` (the
   default, ``sum_i w_i Delta_i / sum_i w_i``), :func:`aggregate`,
   :func:`server_step` (aggregate, then ``x <- x + ServerOpt(Delta)``),
   :func:`server_update`, :func:`aggregator_hparams`, :func:`encode_map`,
   :func:`encode_hparams`, :func:`client_weights`, :func:`upload_bytes`
   (:mod:`~fedjx.algorithms.aggregators`).
6. Options: ``COMMON_OPTIONS`` (every builder's), ``OPTIONS`` (FedAvg's, which
   its variants take), :func:`without`, :func:`with_options`,
   :func:`take_options`, :class:`Parts` and :func:`check_parts` (FedAvg's
   checked parts), :func:`initial_hparams`, :func:`client_hparams_of`.
7. Checks, one-line errors naming the argument: :func:`check_number`,
   :func:`check_choice`, :func:`check_positive_int`, :func:`check_optimizer`,
   :func:`check_schedule`, :func:`check_aggregator`,
   :func:`check_skip_nonfinite`, :func:`check_private_uploads`,
   :func:`check_cohort`.
8. Metrics: :func:`round_metrics` (a guarded cohort's pooled statistics and
   ``nonfinite_clients``), :func:`stats_metrics` (placed statistics without
   the guard).

Where the kit's name differs from the defining one (the defining module's
name would be ambiguous here): ``map_guarded`` is
``nonfinite.map_clients``, ``round_metrics`` is ``nonfinite.round_metrics``
and ``stats_metrics`` ``base.round_metrics``, ``check_aggregator`` is
``aggregators.check``, ``server_step`` ``aggregators.step``,
``aggregator_hparams`` ``aggregators.init_hparams`` and
``check_skip_nonfinite`` ``nonfinite.check_flag``.

What an algorithm module (``fedjx.algorithms.<name>_lib``) imports from
``fedjx.algorithms`` (``tests/test_kit.py`` enforces it):

* the kit, for every name the kit has: a name the kit exports is never taken
  from another module;
* the module of another algorithm it is built on (``<name>_lib``: FedProx
  and DP-FedAvg are FedAvg's round with a part fixed; the FedOpt family
  takes ``yogi_lib``'s server optimizers; Async and Streaming DiLoCo take
  DiLoCo's outer step; FedAsync takes FedBuff's ring of updates);
* a part of another kind than the kit's, from the subpackage of its kind
  (:data:`PART_MODULES`) or one of its modules: a DP or quantized
  aggregator (``aggregators.gaussian``, ``aggregators.quantized_mean``), a
  LoRA aggregation rule (``aggregators.lora``), a wire format
  (``compression.quantization``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import optax

from fedjx.algorithms.aggregators.core import Aggregator
from fedjx.algorithms.aggregators.core import aggregate
from fedjx.algorithms.aggregators.core import check as check_aggregator
from fedjx.algorithms.aggregators.core import client_weights
from fedjx.algorithms.aggregators.core import encode_hparams
from fedjx.algorithms.aggregators.core import encode_map
from fedjx.algorithms.aggregators.core import init_hparams as aggregator_hparams
from fedjx.algorithms.aggregators.core import map_clients
from fedjx.algorithms.aggregators.core import mean
from fedjx.algorithms.aggregators.core import step as server_step
from fedjx.algorithms.aggregators.core import upload_bytes
from fedjx.algorithms.base import COMMON_OPTIONS
from fedjx.algorithms.base import WEIGHTINGS
from fedjx.algorithms.base import Algorithm
from fedjx.algorithms.base import LossFn
from fedjx.algorithms.base import Metrics
from fedjx.algorithms.base import MetricsFn
from fedjx.algorithms.base import Params
from fedjx.algorithms.base import PyTree
from fedjx.algorithms.base import ServerState
from fedjx.algorithms.base import aggregation_weights
from fedjx.algorithms.base import check_choice
from fedjx.algorithms.base import check_cohort
from fedjx.algorithms.base import check_number
from fedjx.algorithms.base import check_optimizer
from fedjx.algorithms.base import check_positive_int
from fedjx.algorithms.base import check_private_uploads
from fedjx.algorithms.base import client_metrics
from fedjx.algorithms.base import combine_hparams
from fedjx.algorithms.base import default_sgd
from fedjx.algorithms.base import gather_clients
from fedjx.algorithms.base import hparam_names
from fedjx.algorithms.base import make_algorithm
from fedjx.algorithms.base import optimizer_hparams
from fedjx.algorithms.base import round_metrics as stats_metrics
from fedjx.algorithms.base import scan_rounds
from fedjx.algorithms.base import scatter_clients
from fedjx.algorithms.base import server_update
from fedjx.algorithms.base import take_options
from fedjx.algorithms.base import tree_sub
from fedjx.algorithms.base import with_hparams
from fedjx.algorithms.base import with_options
from fedjx.algorithms.transforms.core import ProximalState
from fedjx.algorithms.transforms.core import control_variate
from fedjx.algorithms.transforms.core import learning_rate_of
from fedjx.algorithms.transforms.core import proximal
from fedjx.algorithms.client_update import ClientUpdate
from fedjx.algorithms.client_update import LocalSchedule
from fedjx.algorithms.client_update import check_schedule
from fedjx.algorithms.client_update import evaluate
from fedjx.algorithms.client_update import local_update
from fedjx.algorithms.client_update import masked_mean_loss
from fedjx.algorithms.client_update import scan_steps
from fedjx.algorithms.client_update import step_schedule
from fedjx.algorithms.client_update import tie_to
from fedjx.algorithms.client_update import train
from fedjx.algorithms.nonfinite import ClientOutput
from fedjx.algorithms.nonfinite import Clients
from fedjx.algorithms.nonfinite import check_flag as check_skip_nonfinite
from fedjx.algorithms.nonfinite import map_clients as map_guarded
from fedjx.algorithms.nonfinite import participants
from fedjx.algorithms.nonfinite import round_metrics
from fedjx.algorithms.nonfinite import weighted_mean
from fedjx.algorithms.schedules import scheduled

PART_MODULES = ('aggregators', 'compression')
"""The subpackages of ``fedjx.algorithms`` whose parts, of other kinds than
the kit's, an algorithm module may import beside the kit (module docstring)."""


# ------------------------------------------------------- FedAvg's options

OPTIONS: dict[str, Any] = {
    'client_optimizer': None,
    'server_optimizer': None,
    'local_epochs': 1,
    'local_steps': None,
    'client_transform': None,
    'aggregator': None,
    'client_metrics': False,
    **COMMON_OPTIONS,
}
"""FedAvg's options, by name, with their defaults; its variants take them
too, less those they set themselves (:func:`without`)."""


def without(*names: str) -> dict[str, Any]:
  """:data:`OPTIONS` less ``names`` (those a variant sets itself)."""
  return {k: v for k, v in OPTIONS.items() if k not in names}


class Parts(NamedTuple):
  """FedAvg's checked parts (see :func:`check_parts`)."""

  client_optimizer: optax.GradientTransformation
  server_optimizer: optax.GradientTransformation
  aggregator: Aggregator
  schedule: LocalSchedule


def check_parts(name: str, o: Mapping[str, Any]) -> Parts:
  """The optimizers (SGD 0.1 / SGD 1.0 by default), aggregator and local
  schedule of FedAvg's options ``o``, every option checked (one-line errors)."""
  client_optimizer = o['client_optimizer'] or default_sgd(0.1)
  server_optimizer = o['server_optimizer'] or default_sgd(1.0)
  check_optimizer(name, 'client_optimizer', client_optimizer)
  check_optimizer(name, 'server_optimizer', server_optimizer)
  if o['client_transform'] is not None:
    check_optimizer(name, 'client_transform', o['client_transform'])
  check_choice(name, 'weighting', o['weighting'], WEIGHTINGS)
  aggregator = check_aggregator(name, o['aggregator'])
  check_skip_nonfinite(name, o['skip_nonfinite'])
  check_choice(name, 'client_metrics', o['client_metrics'], (False, True))
  schedule = check_schedule(name, o['local_epochs'], o['local_steps'],
                            o['client_evaluation'])
  return Parts(client_optimizer, server_optimizer, aggregator, schedule)


# ------------------------------------------------ FedAvg's standard parts

def client_training(loss_fn: LossFn, metrics_fn: MetricsFn | None,
                    client_optimizer: optax.GradientTransformation,
                    client_transform: optax.GradientTransformation | None,
                    schedule: LocalSchedule) -> Any:
  """``train(x, hparams, batches, mask)``: a client's local steps from ``x``.

  The client optimizer, chained after the client transform when there is
  one (``optax.chain(transform, optimizer)``), with the traced
  hyperparameters ``hparams`` of :func:`client_hparams_of`; returns
  :func:`local_update`'s result.
  """

  def train_from(x, hparams, batches, mask):
    optimizer = client_optimizer
    opt_state = with_hparams(client_optimizer.init(x),
                             hparams['client_optimizer'])
    if client_transform is not None:
      optimizer = optax.chain(client_transform, client_optimizer)
      opt_state = (with_hparams(client_transform.init(x),
                                hparams['client_transform']), opt_state)
    return local_update(loss_fn, metrics_fn, optimizer, x, opt_state, batches,
                        mask, schedule)

  return train_from


def initial_hparams(client_optimizer, server_optimizer, client_transform,
                    aggregator: Aggregator, params: Params,
                    name: str = 'fedavg') -> dict[str, Any]:
  """``state.hparams`` of FedAvg's parts: both optimizers', the client
  transform's (top level) and the aggregator's; a name two of them share is
  refused (:func:`combine_hparams`)."""
  transform_hparams = ({} if client_transform is None else
                       optimizer_hparams(client_transform, params))
  return combine_hparams(
      name,
      algorithm={'client_optimizer': optimizer_hparams(client_optimizer, params),
                 'server_optimizer': optimizer_hparams(server_optimizer, params)},
      client_transform=transform_hparams,
      aggregator=aggregator_hparams(aggregator))


def client_hparams_of(state: Any, client_transform: Any) -> dict[str, Any]:
  """The hyperparameters the clients' :func:`client_training` reads."""
  hparams = {'client_optimizer': state.hparams['client_optimizer']}
  if client_transform is not None:
    hparams['client_transform'] = {
        k: state.hparams[k]
        for k in hparam_names(client_transform, state.params)}
  return hparams


__all__ = [
    # 1. State.
    'Algorithm', 'LossFn', 'Metrics', 'MetricsFn', 'Params', 'PyTree',
    'ServerState', 'make_algorithm', 'scan_rounds',
    # 2. Hyperparameters.
    'combine_hparams', 'default_sgd', 'hparam_names', 'optimizer_hparams',
    'scheduled', 'with_hparams',
    # 3. The local update.
    'ClientUpdate', 'LocalSchedule', 'ProximalState', 'client_metrics',
    'client_training', 'control_variate', 'evaluate', 'gather_clients',
    'learning_rate_of', 'local_update', 'masked_mean_loss', 'proximal',
    'scan_steps', 'scatter_clients', 'step_schedule', 'tie_to', 'train',
    'tree_sub',
    # 4. The client map and the non-finite guard.
    'ClientOutput', 'Clients', 'WEIGHTINGS', 'aggregation_weights',
    'map_clients', 'map_guarded', 'participants', 'weighted_mean',
    # 5. Aggregation and the server update.
    'Aggregator', 'aggregate', 'aggregator_hparams', 'client_weights',
    'encode_hparams', 'encode_map', 'mean', 'server_step', 'server_update',
    'upload_bytes',
    # 6. Options.
    'COMMON_OPTIONS', 'OPTIONS', 'PART_MODULES', 'Parts', 'check_parts',
    'client_hparams_of', 'initial_hparams', 'take_options', 'with_options',
    'without',
    # 7. Checks.
    'check_aggregator', 'check_choice', 'check_cohort', 'check_number',
    'check_optimizer', 'check_positive_int', 'check_private_uploads',
    'check_schedule', 'check_skip_nonfinite',
    # 8. Metrics.
    'round_metrics', 'stats_metrics',
]
