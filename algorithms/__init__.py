"""Federated learning algorithms written with the fedjx primitives.

Every builder returns an :class:`Algorithm` with ``init(params) -> state``,
``round(state, cohort, key) -> (state, metrics)`` (jit-compiled, state
donated), ``run_rounds`` (many rounds in one ``lax.scan``) and ``apply`` (the
plain round, for ``jax.grad`` and friends). See docs/algorithms.md.

A new algorithm needs only names from here: :func:`make_algorithm` wraps its
``init`` and round (written with the fedjx primitives), and
:func:`check_schedule`, :func:`local_update`, :func:`round_metrics`, :func:`server_update`,
:func:`default_sgd`, :class:`ServerState` and :func:`with_options` are the
pieces its round and builder use (also importable from
``fedjx.algorithms.base`` and ``fedjx.algorithms.client_update``).
"""

from fedjx.algorithms import adaptive_clipping
from fedjx.algorithms import aggregators
from fedjx.algorithms import attacks
from fedjx.algorithms import client_transforms
from fedjx.algorithms import client_update
from fedjx.algorithms import compression
from fedjx.algorithms import distributed_dp
from fedjx.algorithms import secure_aggregation
from fedjx.algorithms import dp_ftrl
from fedjx.algorithms import hypergradients
from fedjx.algorithms import nonfinite
from fedjx.algorithms import quantization
from fedjx.algorithms import schedules
from fedjx.algorithms import order_statistics
from fedjx.algorithms import robust_aggregators
from fedjx.algorithms.adaptive_clipping import adaptive_gaussian
from fedjx.algorithms.aggregators import Aggregator
from fedjx.algorithms.attacks import Attack
from fedjx.algorithms.attacks import attacked
from fedjx.algorithms.attacks import malicious_clients
from fedjx.algorithms.base import Algorithm
from fedjx.algorithms.base import ServerState
from fedjx.algorithms.base import WEIGHTINGS
from fedjx.algorithms.base import COMMON_OPTIONS
from fedjx.algorithms.base import aggregation_weights
from fedjx.algorithms.base import default_sgd
from fedjx.algorithms.base import make_algorithm
from fedjx.algorithms.base import round_metrics
from fedjx.algorithms.base import server_update
from fedjx.algorithms.base import with_options
from fedjx.algorithms.base import scan_rounds
from fedjx.algorithms.client_transforms import control_variate
from fedjx.algorithms.client_transforms import proximal
from fedjx.algorithms.client_update import LocalSchedule
from fedjx.algorithms.client_update import check_schedule
from fedjx.algorithms.client_update import local_update
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
from fedjx.algorithms.async_diloco import AsyncDiLoCoState
from fedjx.algorithms.async_diloco import DelayedNesterovState
from fedjx.algorithms.async_diloco import async_diloco
from fedjx.algorithms.async_diloco import delayed_nesterov
from fedjx.algorithms.diloco import DiLoCoState
from fedjx.algorithms.diloco import diloco
from fedjx.algorithms.dp_fedavg import clip_update
from fedjx.algorithms.dp_fedavg import dp_epsilon
from fedjx.algorithms.dp_fedavg import dp_fedavg
from fedjx.algorithms.dp_ftrl import tree_gaussian
from fedjx.algorithms.fedavg import fedadagrad
from fedjx.algorithms.fedavg import fedadam
from fedjx.algorithms.fedavg import fedavg
from fedjx.algorithms.fedavg import fedavgm
from fedjx.algorithms.fedavg import fedyogi
from fedjx.algorithms.fedbuff import AsyncCohort
from fedjx.algorithms.fedbuff import FedBuffState
from fedjx.algorithms.fedbuff import fedbuff
from fedjx.algorithms.fednova import fednova
from fedjx.algorithms.fedexp import FedExPState
from fedjx.algorithms.fedexp import fedexp
from fedjx.algorithms.schedules import scheduled
from fedjx.algorithms.mime import MimeState
from fedjx.algorithms.mime import mime
from fedjx.algorithms.mime import mime_lite
from fedjx.algorithms.ditto import ditto
from fedjx.algorithms.ditto import personalize_fn as ditto_personalize_fn
from fedjx.algorithms.feddyn import FedDynState
from fedjx.algorithms.feddyn import feddyn
from fedjx.algorithms.fedrep import fedper
from fedjx.algorithms.fedrep import fedrep
from fedjx.algorithms.fedrep import personalize_fn as fedrep_personalize_fn
from fedjx.algorithms.apfl import apfl
from fedjx.algorithms.apfl import personalize_fn as apfl_personalize_fn
from fedjx.algorithms.hyp_cluster import HypClusterState
from fedjx.algorithms.hyp_cluster import hyp_cluster
from fedjx.algorithms.hyp_cluster import kmeans_init
from fedjx.algorithms.hyp_cluster import personalize_fn as hyp_cluster_personalize_fn
from fedjx.algorithms.afl import AFLState
from fedjx.algorithms.afl import afl
from fedjx.algorithms.fedasync import FedAsyncState
from fedjx.algorithms.fedasync import fedasync
from fedjx.algorithms.qffl import qffl
from fedjx.algorithms.fedprox import fedprox
from fedjx.algorithms.quantization import quantize
from fedjx.algorithms.scaffold import ScaffoldState
from fedjx.algorithms.scaffold import scaffold
from fedjx.algorithms.robust_aggregators import bulyan
from fedjx.algorithms.robust_aggregators import centered_clipping
from fedjx.algorithms.robust_aggregators import coordinate_median
from fedjx.algorithms.robust_aggregators import dp_defense
from fedjx.algorithms.robust_aggregators import geometric_median
from fedjx.algorithms.robust_aggregators import krum
from fedjx.algorithms.robust_aggregators import multi_krum
from fedjx.algorithms.robust_aggregators import norm_bounding
from fedjx.algorithms.robust_aggregators import trimmed_mean
from fedjx.algorithms.streaming_diloco import StreamingDiLoCoState
from fedjx.algorithms.streaming_diloco import streaming_diloco
from fedjx.algorithms.yogi import adaptive_adagrad
from fedjx.algorithms.yogi import adaptive_adam
from fedjx.algorithms.yogi import scale_by_adaptive
from fedjx.algorithms.yogi import scale_by_yogi
from fedjx.algorithms.yogi import yogi
from fedjx.algorithms.hypergradients import hypergradient
from fedjx.algorithms.hypergradients import learn_client_weights
from fedjx.algorithms.hypergradients import reweight_cohort
from fedjx.algorithms.hypergradients import unrolled_objective
from fedjx.algorithms.tuner import TunerState
from fedjx.algorithms.tuner import fedavg_hypergradient_tuner
from fedjx.algorithms.tuner import hypergradient_tuner

__all__ = [
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
    'check_schedule',
    'local_update',
    'with_options',
    'server_update',
    'round_metrics',
    'make_algorithm',
    'default_sgd',
    'Aggregator',
    'Algorithm',
    'COMMON_OPTIONS',
    'AsyncCohort',
    'AsyncDiLoCoState',
    'DelayedNesterovState',
    'FedBuffState',
    'DiLoCoState',
    'LocalSchedule',
    'ScaffoldState',
    'ServerState',
    'StreamingDiLoCoState',
    'WEIGHTINGS',
    'adaptive_adagrad',
    'adaptive_clipping',
    'adaptive_gaussian',
    'adaptive_adam',
    'aggregation_weights',
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
    'dp_epsilon',
    'delayed_nesterov',
    'dp_fedavg',
    'dp_ftrl',
    'fedadagrad',
    'fedadam',
    'fedavg',
    'fedavgm',
    'fedbuff',
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
    'scan_rounds',
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
