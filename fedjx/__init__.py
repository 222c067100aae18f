"""fedjx: federated learning research in JAX on differentiable MapReduce primitives.

The primitive layer. Inside a function decorated with :func:`program`:

* :func:`broadcast` places a server value at every client,
* :func:`map_fn` runs a function on each client's slice of placed values,
* :func:`reduce_sum`, :func:`reduce_mean`, :func:`reduce_weighted_mean` bring
  placed values back to the server.

All compose with ``jit``, ``grad`` (to any order), ``jvp``, ``vmap``,
``lax.scan`` and ``jax.checkpoint``.

Subpackages (imported on first use, so ``import fedjx`` stays light;
``fedjx.algorithms`` works after ``import fedjx`` alone):

* ``fedjx.algorithms``: FedAvg, FedOpt, FedProx, SCAFFOLD, DiLoCo,
  DP-FedAvg, hypergradients (docs/algorithms.md);
* ``fedjx.datasets``: federated datasets, cohorts, partitions, file formats
  (docs/datasets.md);
* ``fedjx.models``: Flax models with per-example losses and metrics;
* ``fedjx.experiments``: the config-driven runner behind ``fedjx-run``
  (docs/experiments.md).

Modules: ``fedjx.interpreters`` (the MapReduce plan of a program and what
runs it: ``plan``, ``beam`` for Apache Beam, ``export`` for exported
computations; also reachable as ``fedjx.plan``, ``fedjx.beam`` and
``fedjx.export``), ``fedjx.streaming``, ``fedjx.sharding``,
``fedjx.distributed``.
"""

from fedjx import _lazy
from fedjx.api import broadcast
from fedjx.api import reduce_mean
from fedjx.api import reduce_sum
from fedjx.api import reduce_weighted_mean
from fedjx.mapping import map_fn
from fedjx.placements import MAP_STRATEGIES
from fedjx.placements import program
from fedjx.primitives import broadcast_p
from fedjx.primitives import reduce_mean_p
from fedjx.primitives import reduce_sum_p
from fedjx.primitives import reduce_weighted_mean_p

__version__ = '0.1.0'

SUBPACKAGES = ('algorithms', 'datasets', 'models', 'experiments')


# Subpackages are imported when first used.
__getattr__, __dir__ = _lazy.submodules(__name__, SUBPACKAGES)


__all__ = [
    'MAP_STRATEGIES',
    'broadcast',
    'broadcast_p',
    'map_fn',
    'program',
    'reduce_mean',
    'reduce_mean_p',
    'reduce_sum',
    'reduce_sum_p',
    'reduce_weighted_mean',
    'reduce_weighted_mean_p',
]
