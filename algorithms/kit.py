"""The algorithm kit: the vocabulary an algorithm is written with.

An algorithm is its idea: hooks on the round that FedAvg and its relatives
share (:mod:`fedjx.algorithms.template`). A round, in the kit's words::

    x = state.params;  sent = prepare(state, cohort)           (optional)
    for each client (one fedjx.map_fn, guarded against NaN and Inf):
        Upload = client(Client(x, hparams, sent, row, data, train))
        the aggregator encodes Upload.update
    Delta = the aggregator's combination of the updates
    Step = server(Server(state, Delta, clients, sent))        (optional)
    x <- x + ServerOpt(Step.pseudo_grad)                       (or Step.params)

The names, each documented where it is defined:

1. What an algorithm is: :class:`Algorithm` (``init``, ``round``,
   ``run_rounds``, ``apply``, ``compile``, ``client_state_init``,
   ``traits``), :class:`ServerState` (``params``, ``opt_state``,
   ``hparams``, ``round_index``, ``aggregator_state``, ``extras``,
   ``client_states``: one record for every algorithm), :class:`Traits`
   (what an algorithm or a part declares about itself) and :func:`declare`
   (a builder's traits, where it is defined).
2. The round template: :func:`algorithm` (hooks and options in, an
   :class:`Algorithm` out); :class:`Options` (FedAvg's parts and options,
   checked once: optimizers, local schedule, client transform, aggregator,
   weighting, guard) and :func:`options_but` (the options a builder takes);
   the hooks' records :class:`Client` (what a client hook receives, its
   ``train``), :class:`Upload` (what it returns), :class:`Server` (what the
   server hook receives), :class:`Step` (what it returns),
   :class:`ClientState` (the clients' own state) and :class:`ClientUpdate`
   (what local training returns).
3. A round written by hand (asynchronous, hierarchical, personalized
   rounds): :func:`make_algorithm`.
4. Types: ``LossFn``, ``Params``, ``PyTree``.
5. Checks, one-line errors naming the argument: :func:`check_number`,
   :func:`check_choice`, :func:`check_positive_int`,
   :func:`check_optimizer`, :func:`check_private_uploads` (a DP aggregator
   refused where a round releases more than it noises).
6. Hyperparameters: :func:`default_sgd` (SGD with traced hyperparameters),
   :func:`with_hparams` (``state.hparams`` written into an optimizer's
   state), :func:`scheduled` (hyperparameters as functions of the round).

What an algorithm module (``fedjx.algorithms.<name>_lib``) imports from
``fedjx.algorithms`` (``tests/test_kit.py`` enforces it):

* the kit, for every name the kit has: a name the kit exports is never taken
  from another module;
* the module of another algorithm it is built on (``<name>_lib``: DP-FedAvg
  and FedProx declare FedAvg's traits; Async and Streaming DiLoCo take
  DiLoCo's options; FedAsync takes FedBuff's ring of updates);
* a part of another kind, from the subpackage of its kind
  (:data:`PART_MODULES`) or one of its modules: a DP or quantized
  aggregator, a client transform (``transforms.proximal``), a wire format;
* for a round written by hand, the round's machinery from the modules that
  define it (:data:`ROUND_MODULES`): the client map and its guard
  (:mod:`~fedjx.algorithms.nonfinite`, :mod:`~fedjx.algorithms.aggregators`),
  local training (:mod:`~fedjx.algorithms.client_update`), the state and the
  server update (:mod:`~fedjx.algorithms.base`), the template's options and
  training (:mod:`~fedjx.algorithms.template`).
"""

from __future__ import annotations

from fedjx.algorithms.base import Algorithm
from fedjx.algorithms.base import LossFn
from fedjx.algorithms.base import Params
from fedjx.algorithms.base import PyTree
from fedjx.algorithms.base import ServerState
from fedjx.algorithms.base import check_choice
from fedjx.algorithms.base import check_number
from fedjx.algorithms.base import check_optimizer
from fedjx.algorithms.base import check_positive_int
from fedjx.algorithms.base import check_private_uploads
from fedjx.algorithms.base import default_sgd
from fedjx.algorithms.base import make_algorithm
from fedjx.algorithms.base import with_hparams
from fedjx.algorithms.client_update import ClientUpdate
from fedjx.algorithms.schedules import scheduled
from fedjx.algorithms.template import Client
from fedjx.algorithms.template import ClientState
from fedjx.algorithms.template import Options
from fedjx.algorithms.template import Server
from fedjx.algorithms.template import Step
from fedjx.algorithms.template import Upload
from fedjx.algorithms.template import algorithm
from fedjx.algorithms.template import options_but
from fedjx.algorithms.traits import Traits
from fedjx.algorithms.traits import declare

PART_MODULES = ('aggregators', 'compression', 'transforms')
"""The subpackages of ``fedjx.algorithms`` whose parts, of other kinds than
the kit's, an algorithm module may import beside the kit (module docstring)."""

ROUND_MODULES = ('base', 'client_update', 'nonfinite', 'template')
"""The modules of ``fedjx.algorithms`` whose machinery a round written by
hand may import beside the kit (module docstring), with ``aggregators``'."""

__all__ = [
    # 1. What an algorithm is.
    'Algorithm', 'ServerState', 'Traits', 'declare',
    # 2. The round template.
    'Client', 'ClientState', 'ClientUpdate', 'Options', 'Server', 'Step',
    'Upload', 'algorithm', 'options_but',
    # 3. A round written by hand.
    'make_algorithm',
    # 4. Types.
    'LossFn', 'Params', 'PyTree',
    # 5. Checks.
    'check_choice', 'check_number', 'check_optimizer', 'check_positive_int',
    'check_private_uploads',
    # 6. Hyperparameters.
    'default_sgd', 'scheduled', 'with_hparams',
]
