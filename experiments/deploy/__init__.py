"""An experiment config's rounds deployed on Flower: ``fedjx.experiments.deploy``.

Built on :mod:`fedjx.deploy` (the engine-independent rounds, program bytes,
the Flower strategy and ClientApp, the local federation):

* :mod:`~fedjx.experiments.deploy.config_rounds`: a config's experiment as
  :class:`~fedjx.deploy.rounds.ServerRounds`, and the dataset spec a node
  builds its client from;
* :mod:`~fedjx.experiments.deploy.apps`: the ServerApp and ClientApp ``flwr
  run`` loads, with ``fedjx-run``'s workdir (metrics, checkpoints, resume);
  needs the ``flower`` extra;
* :mod:`~fedjx.experiments.deploy.app_dir`: the Flower App directory that
  names them (imports neither JAX nor Flower);
* :mod:`~fedjx.experiments.deploy.cli`: ``fedjx-deploy``, a config's rounds
  on a local Flower federation.

See ``docs/deploy.md``.
"""
