"""Aggregators and defenses: how the clients' updates become one update.

Each is an :class:`Aggregator` (a per-client ``encode`` and a server
``combine``), taken by any algorithm's ``aggregator=``. Modules:

* :mod:`~fedjx.algorithms.aggregators.core`: the :class:`Aggregator` type,
  the plain and quantized means, the Gaussian mechanism, clipping;
* :mod:`~fedjx.algorithms.aggregators.robust` and
  :mod:`~fedjx.algorithms.aggregators.order_statistics`: defenses against
  Byzantine clients;
* :mod:`~fedjx.algorithms.aggregators.secure`: secure aggregation, simulated;
* :mod:`~fedjx.algorithms.aggregators.lora`: federated LoRA aggregation rules.

Modules and names are imported on first use.
"""

from fedjx import _lazy

MODULES = ('core', 'lora', 'order_statistics', 'robust', 'secure')

# Each name, where it is defined.
_NAMES = {
    'add_gaussian_noise': 'fedjx.algorithms.aggregators.core',
    'Aggregator': 'fedjx.algorithms.aggregators.core',
    'audited': 'fedjx.algorithms.aggregators.core',
    'clip_update': 'fedjx.algorithms.aggregators.core',
    'denominator': 'fedjx.algorithms.aggregators.core',
    'gaussian': 'fedjx.algorithms.aggregators.core',
    'mean': 'fedjx.algorithms.aggregators.core',
    'normal_like': 'fedjx.algorithms.aggregators.core',
    'participants': 'fedjx.algorithms.aggregators.core',
    'quantized_mean': 'fedjx.algorithms.aggregators.core',
    'safe_global_norm': 'fedjx.algorithms.aggregators.core',
    'upload_bytes': 'fedjx.algorithms.aggregators.core',
    'bulyan': 'fedjx.algorithms.aggregators.robust',
    'centered_clipping': 'fedjx.algorithms.aggregators.robust',
    'coordinate_median': 'fedjx.algorithms.aggregators.robust',
    'dp_defense': 'fedjx.algorithms.aggregators.robust',
    'geometric_median': 'fedjx.algorithms.aggregators.robust',
    'krum': 'fedjx.algorithms.aggregators.robust',
    'multi_krum': 'fedjx.algorithms.aggregators.robust',
    'norm_bounding': 'fedjx.algorithms.aggregators.robust',
    'trimmed_mean': 'fedjx.algorithms.aggregators.robust',
    'secure_sum': 'fedjx.algorithms.aggregators.secure',
}
__getattr__, __dir__ = _lazy.submodules(__name__, MODULES, _NAMES)

__all__ = [
    'Aggregator', 'add_gaussian_noise', 'audited', 'bulyan',
    'centered_clipping', 'clip_update', 'coordinate_median', 'denominator',
    'dp_defense', 'gaussian', 'geometric_median', 'krum', 'mean', 'multi_krum',
    'norm_bounding', 'normal_like', 'participants', 'quantized_mean',
    'safe_global_norm', 'secure_sum', 'trimmed_mean', 'upload_bytes'
]
