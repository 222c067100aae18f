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
``fedjx.distributed``, ``fedjx.chunk_cost`` (how many clients an
accelerator runs at once), ``fedjx.fused_updates`` (an SGD step added into
its parameter: a gathered table's on the gathered rows only, a large dense
layer's by row blocks on a CPU), ``fedjx.client_store``
(:class:`ClientStore`, per-client state kept on the host,
docs/client_state.md).
"""

from fedjx import _lazy

__version__ = '0.1.0'

SUBPACKAGES = ('algorithms', 'datasets', 'models', 'experiments')


# The primitives' names, where each is defined. They and the subpackages are
# imported when first used, so `import fedjx` does not import JAX: the
# command line answers --help and config errors without paying for it.
_NAMES = {
    'broadcast': 'fedjx.api', 'reduce_mean': 'fedjx.api',
    'reduce_sum': 'fedjx.api', 'reduce_weighted_mean': 'fedjx.api',
    'map_fn': 'fedjx.mapping',
    'MAP_STRATEGIES': 'fedjx.frames', 'program': 'fedjx.placements',
    'broadcast_p': 'fedjx.primitives', 'reduce_mean_p': 'fedjx.primitives',
    'reduce_sum_p': 'fedjx.primitives',
    'reduce_weighted_mean_p': 'fedjx.primitives',
    'ClientStore': 'fedjx.client_store',
    'IndexedBatches': 'fedjx.indexed',
}
# The primitive layer's own modules, for ``fedjx.mapping.any_in_chunk`` and
# the like after ``import fedjx`` alone.
MODULES = ('api', 'beam', 'chunk_cost', 'client_store', 'distributed', 'execution',
           'export', 'frames', 'fusion', 'indexed', 'interpreters', 'mapping', 'options',
           'placements', 'plan', 'primitives', 'reductions', 'sharding',
           'fused_updates', 'streaming')
# Modules that need an optional dependency (the package, its extra): left out
# of dir(fedjx) until imported, so help(fedjx) imports none of them.
OPTIONAL = {'beam': ('apache_beam', 'beam')}
__getattr__, __dir__ = _lazy.submodules(__name__, SUBPACKAGES + MODULES, _NAMES,
                                        OPTIONAL)


__all__ = [
    'ClientStore',
    'IndexedBatches',
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
