"""Privacy: differentially private aggregators, their accounting and audits.

* :mod:`~fedjx.algorithms.privacy.accounting`: the epsilon of a run
  (:func:`dp_epsilon`), matched to the cohort sampling;
* :mod:`~fedjx.algorithms.privacy.adaptive_clipping`: the clip norm follows
  a quantile of the update norms (:func:`adaptive_gaussian`);
* :mod:`~fedjx.algorithms.privacy.dp_ftrl`: DP-FTRL's tree-aggregated noise
  (:func:`tree_gaussian`);
* :mod:`~fedjx.algorithms.privacy.distributed_dp`: distributed DP on a
  secure sum (:func:`distributed_skellam`) and local DP
  (:func:`local_gaussian`);
* :mod:`~fedjx.algorithms.privacy.audit`: empirical privacy from canary
  clients.

The Gaussian mechanism itself is :func:`fedjx.algorithms.aggregators.gaussian`.
Modules and names are imported on first use.
"""

from fedjx import _lazy

MODULES = ('accounting', 'adaptive_clipping', 'audit', 'distributed_dp', 'dp_ftrl')

# Each name, where it is defined.
_NAMES = {
    'dp_epsilon': 'fedjx.algorithms.privacy.accounting',
    'adaptive_gaussian': 'fedjx.algorithms.privacy.adaptive_clipping',
    'distributed_skellam': 'fedjx.algorithms.privacy.distributed_dp',
    'local_gaussian': 'fedjx.algorithms.privacy.distributed_dp',
    'local_gaussian_epsilon': 'fedjx.algorithms.privacy.distributed_dp',
    'skellam_epsilon': 'fedjx.algorithms.privacy.distributed_dp',
    'tree_gaussian': 'fedjx.algorithms.privacy.dp_ftrl',
}
__getattr__, __dir__ = _lazy.submodules(__name__, MODULES, _NAMES)

__all__ = [
    'adaptive_gaussian', 'distributed_skellam', 'dp_epsilon', 'local_gaussian',
    'local_gaussian_epsilon', 'skellam_epsilon', 'tree_gaussian'
]
