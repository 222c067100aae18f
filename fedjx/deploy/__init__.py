"""Deploying fedjx rounds on real clients: ``fedjx.deploy``.

A round written with the fedjx primitives splits into exported pieces
(``fedjx.export``): ``server_prepare`` and ``server_update`` run on the
server, ``client_work`` on each client's own device over its own data, and
the aggregations between them are plain data. This package runs those
pieces on a deployment engine; fedjx builds no transport of its own.

* :mod:`fedjx.deploy.programs`: versioned bytes of an exported piece (a
  header with a format version and the fedjx version; a node refuses
  incompatible bytes in one line);
* :mod:`fedjx.deploy.rounds`: an algorithm's rounds as server and node
  halves, independent of any engine;
* :mod:`fedjx.deploy.flower`: a Flower ClientApp and the strategy that
  drives it over them (needs the ``flower`` extra: ``pip install -e
  '.[flower]'`` from a checkout, i.e. ``flwr>=1.42``);
* :mod:`fedjx.deploy.local`: a SuperLink and SuperNodes as processes on
  this machine.

An experiment config's rounds on Flower (the ServerApp and ClientApp that
``flwr run`` loads, metrics and checkpoints in a workdir, the command
``fedjx-deploy``) are the experiments layer's (``docs/deploy.md``): this
package depends on ``fedjx``, ``fedjx.datasets`` and the exported pieces
only.

``import fedjx`` imports none of these; only :mod:`fedjx.deploy.flower`
imports Flower. See ``docs/deploy.md``.
"""
