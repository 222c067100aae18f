"""Interpreters of a round's MapReduce plan.

A program written with the fedjx primitives is traced once into a plan
(:mod:`fedjx.interpreters.plan`): server steps, broadcasts, per-client maps
and reductions, each step carrying what it reads and writes. The plan's
interpreters run or rewrite it:

* :mod:`fedjx.interpreters.plan`: tracing, and ``evaluate``, a reference
  interpreter that runs a plan client by client in-process;
* :mod:`fedjx.interpreters.beam`: the plan as an Apache Beam pipeline
  (``pip install -e '.[beam]'``);
* :mod:`fedjx.interpreters.export`: the plan as ``jax.export`` pieces
  (``server_prepare``, ``client_work``, aggregations, ``server_update``) for
  cross-device systems.

:mod:`fedjx.streaming` (clients streamed from the host in chunks on local
devices) interprets the same plans. ``fedjx.plan``, ``fedjx.beam`` and
``fedjx.export`` are short names for the three modules here.

The submodules are imported on first use (``beam`` needs Apache Beam).
"""

from fedjx import _lazy

MODULES = ('plan', 'beam', 'export')


# Submodules are imported when first used; beam needs Apache Beam (left out of
# dir() until imported, so help() does not import it).
__getattr__, __dir__ = _lazy.submodules(__name__, MODULES,
                                        optional={'beam': ('apache_beam', 'beam')})
