"""``fedjx.plan``, the short name of :mod:`fedjx.interpreters.plan`.

MapReduce plans of traced fedjx programs. Everything public there is
importable from here (``from fedjx import plan``, ``import fedjx.plan``);
see that module for the documentation.
"""

from fedjx.interpreters.plan import *  # noqa: F401,F403
from fedjx.interpreters.plan import __all__  # noqa: F401
