"""Federated learning algorithms written with the fedjx primitives.

Every builder returns an :class:`Algorithm` with ``init(params) -> state``,
``round(state, cohort, key) -> (state, metrics)`` (jit-compiled, state
donated), ``run_rounds`` (many rounds in one ``lax.scan``) and ``apply`` (the
plain round, for ``jax.grad`` and friends). See docs/algorithms.md.

Names: an algorithm's builder is ``fedjx.algorithms.<name>`` (``fedavg``,
``fedrep``, ``ditto``, ...) and the module that implements it, with its
state type and public helpers, ``fedjx.algorithms.<name>_lib``
(``fedjx.algorithms.fedrep_lib.personalize_fn``), so no builder shadows a
module. Parts of the other kinds keep their modules' names
(``aggregators``, ``compression``, ``attacks``, ``schedules``, ...).

A new algorithm is written from one module, :mod:`fedjx.algorithms.kit`
(``from fedjx.algorithms import kit``): its state record
(:class:`ServerState`), ``make_algorithm``, the local update, the client
map, aggregation and the server update, the options and the metrics. Every
algorithm here, FedAvg included, is written from it; its docstring states
what else an algorithm module may import (docs/writing_an_algorithm.md).
"""

from fedjx.algorithms import adaptive_clipping
from fedjx.algorithms import aggregators
from fedjx.algorithms import attacks
from fedjx.algorithms import client_transforms
from fedjx.algorithms import client_update
from fedjx.algorithms import compression
from fedjx.algorithms import demo
from fedjx.algorithms import distributed_dp
from fedjx.algorithms import secure_aggregation
from fedjx.algorithms import dp_ftrl
from fedjx.algorithms import hypergradients
from fedjx.algorithms import kit
from fedjx.algorithms import lora_aggregation
from fedjx.algorithms import nonfinite
from fedjx.algorithms import outer_compression
from fedjx.algorithms import quantization
from fedjx.algorithms import schedules
from fedjx.algorithms import order_statistics
from fedjx.algorithms import robust_aggregators
from fedjx.algorithms.accounting import dp_epsilon
from fedjx.algorithms.adaptive_clipping import adaptive_gaussian
from fedjx.algorithms.aggregators import Aggregator
from fedjx.algorithms.aggregators import clip_update
from fedjx.algorithms.attacks import Attack
from fedjx.algorithms.attacks import attacked
from fedjx.algorithms.attacks import malicious_clients
from fedjx.algorithms.base import Algorithm
from fedjx.algorithms.base import ServerState
from fedjx.algorithms.base import WEIGHTINGS
from fedjx.algorithms.base import default_sgd
from fedjx.algorithms.client_transforms import control_variate
from fedjx.algorithms.client_transforms import proximal
from fedjx.algorithms.compression import drive
from fedjx.algorithms.compression import eden
from fedjx.algorithms.compression import qsgd
from fedjx.algorithms.compression import random_k
from fedjx.algorithms.compression import sign_majority
from fedjx.algorithms.compression import stochastic_quantization
from fedjx.algorithms.compression import terngrad
from fedjx.algorithms.compression import top_k
from fedjx.algorithms.compression import uncompressed
from fedjx.algorithms.distributed_dp import distributed_skellam
from fedjx.algorithms.distributed_dp import local_gaussian
from fedjx.algorithms.distributed_dp import local_gaussian_epsilon
from fedjx.algorithms.distributed_dp import skellam_epsilon
from fedjx.algorithms.secure_aggregation import secure_sum
from fedjx.algorithms.async_diloco_lib import AsyncDiLoCoState
from fedjx.algorithms.async_diloco_lib import DelayedNesterovState
from fedjx.algorithms.async_diloco_lib import async_diloco
from fedjx.algorithms.async_diloco_lib import delayed_nesterov
from fedjx.algorithms.diloco_lib import DiLoCoState
from fedjx.algorithms.diloco_lib import diloco
from fedjx.algorithms.diloco_recipe_lib import diloco_recipe
from fedjx.algorithms.dp_fedavg_lib import dp_fedavg
from fedjx.algorithms.dp_ftrl import tree_gaussian
from fedjx.algorithms.eager_diloco_lib import EagerDiLoCoState
from fedjx.algorithms.eager_diloco_lib import eager_diloco
from fedjx.algorithms.fedavg_lib import fedadagrad
from fedjx.algorithms.fedavg_lib import fedadam
from fedjx.algorithms.fedavg_lib import fedavg
from fedjx.algorithms.fedavg_lib import fedavgm
from fedjx.algorithms.fedavg_lib import fedyogi
from fedjx.algorithms.fedlora_lib import FedLoraState
from fedjx.algorithms.fedlora_lib import fedlora
from fedjx.algorithms.fedbuff_lib import AsyncCohort
from fedjx.algorithms.fedbuff_lib import FedBuffState
from fedjx.algorithms.fedbuff_lib import fedbuff
from fedjx.algorithms.fednova_lib import fednova
from fedjx.algorithms.fedexp_lib import FedExPState
from fedjx.algorithms.fedexp_lib import fedexp
from fedjx.algorithms.schedules import scheduled
from fedjx.algorithms.mime_lib import MimeState
from fedjx.algorithms.mime_lib import mime
from fedjx.algorithms.mime_lib import mime_lite
from fedjx.algorithms.ditto_lib import ditto
from fedjx.algorithms.ditto_lib import personalize_fn as ditto_personalize_fn
from fedjx.algorithms.feddyn_lib import FedDynState
from fedjx.algorithms.feddyn_lib import feddyn
from fedjx.algorithms.fedrep_lib import fedper
from fedjx.algorithms.fedrep_lib import fedrep
from fedjx.algorithms.fedrep_lib import personalize_fn as fedrep_personalize_fn
from fedjx.algorithms.apfl_lib import apfl
from fedjx.algorithms.apfl_lib import personalize_fn as apfl_personalize_fn
from fedjx.algorithms.hyp_cluster_lib import HypClusterState
from fedjx.algorithms.hyp_cluster_lib import hyp_cluster
from fedjx.algorithms.hyp_cluster_lib import kmeans_init
from fedjx.algorithms.hyp_cluster_lib import personalize_fn as hyp_cluster_personalize_fn
from fedjx.algorithms.afl_lib import AFLState
from fedjx.algorithms.afl_lib import afl
from fedjx.algorithms.fedasync_lib import FedAsyncState
from fedjx.algorithms.fedasync_lib import fedasync
from fedjx.algorithms.qffl_lib import qffl
from fedjx.algorithms.fedprox_lib import fedprox
from fedjx.algorithms.quantization import quantize
from fedjx.algorithms.scaffold_lib import ScaffoldState
from fedjx.algorithms.scaffold_lib import scaffold
from fedjx.algorithms.robust_aggregators import bulyan
from fedjx.algorithms.robust_aggregators import centered_clipping
from fedjx.algorithms.robust_aggregators import coordinate_median
from fedjx.algorithms.robust_aggregators import dp_defense
from fedjx.algorithms.robust_aggregators import geometric_median
from fedjx.algorithms.robust_aggregators import krum
from fedjx.algorithms.robust_aggregators import multi_krum
from fedjx.algorithms.robust_aggregators import norm_bounding
from fedjx.algorithms.robust_aggregators import trimmed_mean
from fedjx.algorithms.streaming_diloco_lib import StreamingDiLoCoState
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
    # The modules of the algorithms (each builder's is ``<name>_lib``).
    'afl_lib', 'apfl_lib', 'async_diloco_lib', 'diloco_lib', 'ditto_lib',
    'diloco_recipe_lib', 'dp_fedavg_lib', 'eager_diloco_lib', 'fedasync_lib', 'fedavg_lib',
    'fedbuff_lib', 'feddyn_lib', 'fedexp_lib', 'fedlora_lib', 'fednova_lib', 'fedprox_lib',
    'fedrep_lib', 'hyp_cluster_lib', 'mime_lib', 'qffl_lib', 'scaffold_lib',
    'streaming_diloco_lib', 'yogi_lib',
    'compression',
    'distributed_dp',
    'distributed_skellam',
    'drive',
    'eden',
    'local_gaussian',
    'local_gaussian_epsilon',
    'qsgd',
    'random_k',
    'secure_aggregation',
    'secure_sum',
    'sign_majority',
    'skellam_epsilon',
    'stochastic_quantization',
    'terngrad',
    'top_k',
    'uncompressed',
    # The kit: the vocabulary every algorithm is written with.
    'kit',
    'default_sgd',
    'Aggregator',
    'Algorithm',
    'AsyncCohort',
    'AsyncDiLoCoState',
    'DelayedNesterovState',
    'FedBuffState',
    'DiLoCoState',
    'EagerDiLoCoState',
    'ScaffoldState',
    'ServerState',
    'StreamingDiLoCoState',
    'WEIGHTINGS',
    'adaptive_adagrad',
    'adaptive_clipping',
    'adaptive_gaussian',
    'adaptive_adam',
    'aggregators',
    'Attack',
    'attacked',
    'attacks',
    'malicious_clients',
    'async_diloco',
    'client_transforms',
    'client_update',
    'control_variate',
    'clip_update',
    'diloco',
    'diloco_recipe',
    'dp_epsilon',
    'delayed_nesterov',
    'dp_fedavg',
    'dp_ftrl',
    'eager_diloco',
    'fedadagrad',
    'fedadam',
    'fedavg',
    'fedavgm',
    'fedbuff',
    'FedLoraState',
    'fedlora',
    'lora_aggregation',
    'fednova',
    'FedExPState',
    'fedexp',
    'scheduled',
    'schedules',
    'MimeState',
    'mime',
    'mime_lite',
    'ditto',
    'ditto_personalize_fn',
    'FedDynState',
    'feddyn',
    'fedper',
    'fedrep',
    'fedrep_personalize_fn',
    'apfl',
    'apfl_personalize_fn',
    'HypClusterState',
    'hyp_cluster',
    'hyp_cluster_personalize_fn',
    'kmeans_init',
    'AFLState',
    'FedAsyncState',
    'afl',
    'fedasync',
    'qffl',
    'fedprox',
    'fedyogi',
    'nonfinite',
    'proximal',
    'quantization',
    'quantize',
    'order_statistics',
    'robust_aggregators',
    'bulyan',
    'centered_clipping',
    'coordinate_median',
    'dp_defense',
    'geometric_median',
    'krum',
    'multi_krum',
    'norm_bounding',
    'trimmed_mean',
    'scaffold',
    'scale_by_adaptive',
    'scale_by_yogi',
    'streaming_diloco',
    'tree_gaussian',
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
