"""Attacks: model poisoning by a fixed set of malicious clients.

An :class:`Attack` wraps the algorithm's aggregator (:func:`attacked`) and
replaces the malicious clients' messages; defined in
:mod:`~fedjx.algorithms.attacks.core`, imported on first use.
"""

from fedjx import _lazy

MODULES = ('core',)

# Each name, where it is defined.
_NAMES = {
    'alie': 'fedjx.algorithms.attacks.core',
    'alie_z': 'fedjx.algorithms.attacks.core',
    'Attack': 'fedjx.algorithms.attacks.core',
    'attacked': 'fedjx.algorithms.attacks.core',
    'AttackState': 'fedjx.algorithms.attacks.core',
    'gaussian_noise': 'fedjx.algorithms.attacks.core',
    'Honest': 'fedjx.algorithms.attacks.core',
    'identity': 'fedjx.algorithms.attacks.core',
    'ipm': 'fedjx.algorithms.attacks.core',
    'malicious_clients': 'fedjx.algorithms.attacks.core',
    'malicious_count': 'fedjx.algorithms.attacks.core',
    'METRIC': 'fedjx.algorithms.attacks.core',
    'scaling': 'fedjx.algorithms.attacks.core',
    'sign_flip': 'fedjx.algorithms.attacks.core',
}
__getattr__, __dir__ = _lazy.submodules(__name__, MODULES, _NAMES)

__all__ = [
    'Attack', 'AttackState', 'Honest', 'METRIC', 'alie', 'alie_z', 'attacked',
    'gaussian_noise', 'identity', 'ipm', 'malicious_clients',
    'malicious_count', 'scaling', 'sign_flip'
]
