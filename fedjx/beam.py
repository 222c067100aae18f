"""``fedjx.beam``, the short name of :mod:`fedjx.interpreters.beam`.

Fedjx programs as Apache Beam pipelines. Everything public there is
importable from here (``from fedjx import beam``, ``import fedjx.beam``);
see that module for the documentation.
"""

from fedjx.interpreters.beam import *  # noqa: F401,F403
from fedjx.interpreters.beam import __all__  # noqa: F401
