"""Sweeps: a grid of hyperparameters and seeds trained in one compiled program.

``fedjx-sweep`` (:mod:`fedjx.experiments.sweeps.cli`) reads the command line;
:func:`fedjx.experiments.sweeps.run.run_sweep` trains the sweep. Its parts:

* :mod:`fedjx.experiments.sweeps.spec`: the swept fields, their values and
  the seeds;
* :mod:`fedjx.experiments.sweeps.plan`: the trials, and which of them share
  one compiled program;
* :mod:`fedjx.experiments.sweeps.group_round`: a group's round, every trial
  ``[seeds, settings]`` in one compiled call;
* :mod:`fedjx.experiments.sweeps.trainer`: a group's trials in the shared
  training loop, under the rules of their runs;
* :mod:`fedjx.experiments.sweeps.summary` and
  :mod:`fedjx.experiments.sweeps.plots`: the summary tables and plots.

This package imports none of them, so a module of it loads only what it
needs (the command line reads its flags without importing JAX).
"""
