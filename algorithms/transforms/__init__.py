"""Client transforms: client-side variants as optax transformations.

Chained in front of any client optimizer (FedProx's :func:`proximal`,
SCAFFOLD's :func:`control_variate`); defined in
:mod:`~fedjx.algorithms.transforms.core`, imported on first use.
"""

from fedjx import _lazy

MODULES = ('core',)

# Each name, where it is defined.
_NAMES = {
    'control_variate': 'fedjx.algorithms.transforms.core',
    'learning_rate_of': 'fedjx.algorithms.transforms.core',
    'proximal': 'fedjx.algorithms.transforms.core',
    'ProximalState': 'fedjx.algorithms.transforms.core',
}
__getattr__, __dir__ = _lazy.submodules(__name__, MODULES, _NAMES)

__all__ = [
    'ProximalState', 'control_variate', 'learning_rate_of', 'proximal'
]
