"""``fedjx.export``, the short name of :mod:`fedjx.interpreters.export`.

Rounds split into exported server and client pieces. Everything public there
is importable from here (``from fedjx import export``, ``import
fedjx.export``); see that module for the documentation.
"""

from fedjx.interpreters.export import *  # noqa: F401,F403
from fedjx.interpreters.export import __all__  # noqa: F401
