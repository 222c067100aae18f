"""Federated learning algorithms written with the fedjx primitives.

Every builder returns an :class:`Algorithm` with ``init(params) -> state``,
``round(state, cohort, key) -> (state, metrics)`` (jit-compiled, state
donated), ``run_rounds`` (many rounds in one ``lax.scan``) and ``apply`` (the
plain round, for ``jax.grad`` and friends). See docs/algorithms.md.

Names are grouped by kind:

* algorithms, here: a builder is ``fedjx.algorithms.<name>`` (``fedavg``,
  ``fedrep``, ``ditto``, ...) and the module that implements it, with its
  state type and public helpers, ``fedjx.algorithms.<name>_lib``
  (``fedjx.algorithms.fedrep_lib.personalize_fn``), so no builder shadows a
  module; the wrappers :mod:`~fedjx.algorithms.hypergradients` and
  :mod:`~fedjx.algorithms.tuner`;
* the parts an algorithm takes, one subpackage per kind, each with a short
  public list: :mod:`~fedjx.algorithms.aggregators` (aggregators and
  defenses), :mod:`~fedjx.algorithms.transforms` (client transforms),
  :mod:`~fedjx.algorithms.attacks`, :mod:`~fedjx.algorithms.compression`
  and :mod:`~fedjx.algorithms.privacy`
  (``fedjx.algorithms.aggregators.krum``,
  ``fedjx.algorithms.privacy.dp_epsilon``).

A new algorithm is written from one module, :mod:`fedjx.algorithms.kit`
(``from fedjx.algorithms import kit``): its state record
(:class:`ServerState`), ``make_algorithm``, the local update, the client
map, aggregation and the server update, the options and the metrics. Every
algorithm here, FedAvg included, is written from it; its docstring states
what else an algorithm module may import (docs/writing_an_algorithm.md).
The tables from config names to builders live in :mod:`fedjx.experiments`.
"""

from fedjx.algorithms import aggregators
from fedjx.algorithms import attacks
from fedjx.algorithms import compression
from fedjx.algorithms import privacy
from fedjx.algorithms import transforms
from fedjx.algorithms import traits
from fedjx.algorithms import client_update
from fedjx.algorithms import hypergradients
from fedjx.algorithms import kit
from fedjx.algorithms import nonfinite
from fedjx.algorithms import schedules
from fedjx.algorithms.base import Algorithm
from fedjx.algorithms.base import ServerState
from fedjx.algorithms.base import WEIGHTINGS
from fedjx.algorithms.base import default_sgd
from fedjx.algorithms.traits import Traits
from fedjx.algorithms.async_diloco_lib import DelayedNesterovState
from fedjx.algorithms.async_diloco_lib import async_diloco
from fedjx.algorithms.async_diloco_lib import delayed_nesterov
from fedjx.algorithms.diloco_lib import diloco
from fedjx.algorithms.diloco_recipe_lib import diloco_recipe
from fedjx.algorithms.dp_fedavg_lib import dp_fedavg
from fedjx.algorithms.eager_diloco_lib import eager_diloco
from fedjx.algorithms.fedavg_lib import fedadagrad
from fedjx.algorithms.fedavg_lib import fedadam
from fedjx.algorithms.fedavg_lib import fedavg
from fedjx.algorithms.fedavg_lib import fedavgm
from fedjx.algorithms.fedavg_lib import fedyogi
from fedjx.algorithms.fedlora_lib import fedlora
from fedjx.algorithms.fedbuff_lib import AsyncCohort
from fedjx.algorithms.fedbuff_lib import fedbuff
from fedjx.algorithms.fednova_lib import fednova
from fedjx.algorithms.fedexp_lib import fedexp
from fedjx.algorithms.schedules import scheduled
from fedjx.algorithms.mime_lib import mime
from fedjx.algorithms.mime_lib import mime_lite
from fedjx.algorithms.ditto_lib import ditto
from fedjx.algorithms.ditto_lib import personalize_fn as ditto_personalize_fn
from fedjx.algorithms.feddyn_lib import feddyn
from fedjx.algorithms.fedrep_lib import fedper
from fedjx.algorithms.fedrep_lib import fedrep
from fedjx.algorithms.fedrep_lib import personalize_fn as fedrep_personalize_fn
from fedjx.algorithms.apfl_lib import apfl
from fedjx.algorithms.apfl_lib import personalize_fn as apfl_personalize_fn
from fedjx.algorithms.hyp_cluster_lib import hyp_cluster
from fedjx.algorithms.hyp_cluster_lib import kmeans_init
from fedjx.algorithms.hyp_cluster_lib import personalize_fn as hyp_cluster_personalize_fn
from fedjx.algorithms.afl_lib import afl
from fedjx.algorithms.fedasync_lib import fedasync
from fedjx.algorithms.qffl_lib import qffl
from fedjx.algorithms.fedprox_lib import fedprox
from fedjx.algorithms.scaffold_lib import scaffold
from fedjx.algorithms.streaming_diloco_lib import streaming_diloco
from fedjx.algorithms.yogi_lib import adaptive_adagrad
from fedjx.algorithms.yogi_lib import adaptive_adam
from fedjx.algorithms.yogi_lib import scale_by_adaptive
from fedjx.algorithms.yogi_lib import scale_by_yogi
from fedjx.algorithms.yogi_lib import yogi
from fedjx.algorithms.hypergradients import hypergradient
from fedjx.algorithms.hypergradients import learn_client_weights
from fedjx.algorithms.hypergradients import reweight_cohort
from fedjx.algorithms.hypergradients import unrolled_objective
from fedjx.algorithms.tuner import TunerState
from fedjx.algorithms.tuner import fedavg_hypergradient_tuner
from fedjx.algorithms.tuner import hypergradient_tuner

__all__ = [
    # The parts of an algorithm, one subpackage per kind.
    'aggregators', 'attacks', 'compression', 'privacy', 'transforms',
    # What an algorithm or a part declares about itself.
    'traits', 'Traits',
    # The modules of the algorithms (each builder's is ``<name>_lib``).
    'afl_lib', 'apfl_lib', 'async_diloco_lib', 'diloco_lib', 'ditto_lib',
    'diloco_recipe_lib', 'dp_fedavg_lib', 'eager_diloco_lib', 'fedasync_lib', 'fedavg_lib',
    'fedbuff_lib', 'feddyn_lib', 'fedexp_lib', 'fedlora_lib', 'fednova_lib', 'fedprox_lib',
    'fedrep_lib', 'hyp_cluster_lib', 'mime_lib', 'qffl_lib', 'scaffold_lib',
    'streaming_diloco_lib', 'yogi_lib',
    # The kit: the vocabulary every algorithm is written with.
    'kit',
    'default_sgd',
    'Algorithm',
    'AsyncCohort',
    'DelayedNesterovState',
    'ServerState',
    'WEIGHTINGS',
    'adaptive_adagrad',
    'adaptive_adam',
    'async_diloco',
    'client_update',
    'diloco',
    'diloco_recipe',
    'delayed_nesterov',
    'dp_fedavg',
    'eager_diloco',
    'fedadagrad',
    'fedadam',
    'fedavg',
    'fedavgm',
    'fedbuff',
    'fedlora',
    'fednova',
    'fedexp',
    'scheduled',
    'schedules',
    'mime',
    'mime_lite',
    'ditto',
    'ditto_personalize_fn',
    'feddyn',
    'fedper',
    'fedrep',
    'fedrep_personalize_fn',
    'apfl',
    'apfl_personalize_fn',
    'hyp_cluster',
    'hyp_cluster_personalize_fn',
    'kmeans_init',
    'afl',
    'fedasync',
    'qffl',
    'fedprox',
    'fedyogi',
    'nonfinite',
    'scaffold',
    'scale_by_adaptive',
    'scale_by_yogi',
    'streaming_diloco',
    'yogi',
    'TunerState',
    'fedavg_hypergradient_tuner',
    'hypergradient',
    'hypergradient_tuner',
    'hypergradients',
    'learn_client_weights',
    'reweight_cohort',
    'unrolled_objective',
]
