"""Deploying fedjx rounds on real clients: ``fedjx.deploy``.

A round written with the fedjx primitives splits into exported pieces
(``fedjx.export``): ``server_prepare`` and ``server_update`` run on the
server, ``client_work`` on each client's own device over its own data, and
the aggregations between them are plain data. This package runs those
pieces on a deployment engine; fedjx builds no transport of its own.

* :mod:`fedjx.deploy.programs`: versioned bytes of an exported piece (a
  header with a format version and the fedjx version; a node refuses
  incompatible bytes in one line);
* :mod:`fedjx.deploy.rounds`: an experiment config's rounds as server and
  node halves, independent of any engine;
* :mod:`fedjx.deploy.flower`: a Flower ServerApp and ClientApp over them
  (needs the ``flower`` extra: ``pip install -e '.[flower]'`` from a
  checkout, i.e. ``flwr>=1.42``).
* :mod:`fedjx.deploy.cli`: ``fedjx-deploy``, a config's rounds on a local
  Flower federation (checked before any process starts; stopped with a
  checkpoint of the last complete round).

``import fedjx`` imports none of these; only :mod:`fedjx.deploy.flower`
imports Flower. See ``docs/deploy.md``.
"""
