"""Registries: the names a config may use for algorithms, datasets, models
and optimizers, and the builders behind them.

Each registry is a dict ``name -> builder``. A config names an entry and
gives its keyword arguments::

  config.algorithm = dict(name='fedavg', client_optimizer=dict(name='sgd',
                          learning_rate=0.1), ...)
  config.dataset = dict(name='digits', num_clients=50, alpha=0.5)
  config.model = dict(name='mlp', hidden=(200, 200))

An unknown name, or a keyword the builder does not take, raises a
:class:`ConfigError` listing what is valid. ``register_*`` adds entries (for
a new algorithm, dataset or model in a user's own code).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import optax

from fedjx import algorithms as algorithms_lib
from fedjx import datasets
from fedjx import models
from fedjx.experiments import data as data_lib
from fedjx.experiments import errors
from fedjx.experiments import parts
from fedjx.experiments import signatures


ConfigError = errors.ConfigError
_suggest = errors.suggest


def lookup(kind: str, registry: Mapping[str, Any], name: Any) -> Any:
  """``registry[name]``, or a ConfigError listing the valid names."""
  if name not in registry:
    raise ConfigError(f'unknown {kind} {name!r}.{_suggest(name, registry)} '
                      f'Valid {kind} names: {sorted(registry)}.')
  return registry[name]


def check_kwargs(kind: str, name: str, fn: Callable[..., Any],
                 kwargs: Mapping[str, Any], reserved: tuple[str, ...] = (),
                 forwards_to: Callable[..., Any] | None = None) -> None:
  """Raises a ConfigError if ``fn`` does not take every key of ``kwargs``.

  A builder with ``**kwargs`` accepts anything, unless ``forwards_to`` names
  the function those go to: then the valid keys are both functions'.
  """
  names, var = signatures.accepted_kwargs(fn)
  if var and forwards_to is not None:
    more, var = signatures.accepted_kwargs(forwards_to)
    names = names + [n for n in more if n not in names]
  valid = [n for n in names if n not in reserved]
  for key in kwargs:
    if key in reserved:
      raise ConfigError(
          f'{kind} {name!r} has no option {key!r}: the runner sets it. Valid '
          f'options of {kind} {name!r}: {sorted(valid)}.')
  if var:
    return
  for key in kwargs:
    if key not in valid:
      raise ConfigError(
          f'{kind} {name!r} has no option {key!r}.{_suggest(key, valid)} '
          f'Valid options of {kind} {name!r}: {sorted(valid)}.')


def check_numbers(kind: str, kwargs: Mapping[str, Any], non_negative: bool,
                  prefix: str = '') -> None:
  """Raises a ConfigError for a NaN or infinite number in ``kwargs`` (nested).

  With ``non_negative`` (algorithm hyperparameters: learning rates, momenta,
  decay rates, clipping norms, noise scales...), negative numbers too.
  """
  for key, value in kwargs.items():
    where = f'config.{kind}.{prefix}{key}'
    if isinstance(value, Mapping):
      check_numbers(kind, value, non_negative, f'{prefix}{key}.')
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      if not math.isfinite(value):
        raise ConfigError(f'{where}={value!r}; it must be a finite number.')
      if non_negative and value < 0:
        raise ConfigError(f'{where}={value!r}; it must be non-negative.')


def check_paths(kind: str, kwargs: Mapping[str, Any]) -> None:
  """Raises a ConfigError for an option ``*_path`` naming a missing file."""
  for key, value in kwargs.items():
    if key.endswith('_path') and isinstance(value, str) and value:
      if not os.path.exists(os.path.expanduser(value)):
        raise ConfigError(f'config.{kind}.{key}={value!r}: no such file or '
                          'directory.')


_TYPE_WORDS = {bool: 'a bool (True or False)', int: 'an int', float: 'a number',
               str: 'a string', type(None): 'None'}


def check_types(where: str, params: Mapping[str, inspect.Parameter],
                kwargs: Mapping[str, Any]) -> None:
  """Raises a ConfigError for an option whose value has a type its builder
  parameter does not take (:func:`signatures.option_types`): a string for a
  number, a number for a bool, a float for an int. ``where`` is e.g.
  ``'algorithm'``."""
  for key, value in kwargs.items():
    if key not in params:
      continue
    types = signatures.option_types(params[key])
    if types is None:
      continue
    if isinstance(value, bool):
      ok = bool in types
    elif isinstance(value, int):
      ok = int in types
    elif isinstance(value, float):
      ok = float in types
    elif isinstance(value, str):
      ok = str in types
    elif value is None:  # A required option left unset: its builder says so.
      ok = type(None) in types or params[key].default is inspect.Parameter.empty
    else:  # Lists, dicts...: the builder checks them.
      ok = True
    if not ok:
      allowed = ' or '.join(_TYPE_WORDS[t] for t in types
                            if not (t is int and float in types))
      raise ConfigError(f'config.{where}.{key}={value!r}; it must be {allowed}.')


def check_hparam_bounds(kwargs: Mapping[str, Any]) -> None:
  """Raises a ConfigError for an algorithm hyperparameter out of its range,
  by the bounds its builder checks at initialization (momentum in [0, 1],
  learning rates >= 0, ...; ``fedjx.algorithms.base.check_hparams``), for
  the algorithm's options and the options of its optimizer specs."""
  from fedjx.algorithms import base  # pylint: disable=g-import-not-at-top
  for key, value in kwargs.items():
    try:
      if isinstance(value, Mapping):
        for option, v in value.items():
          base.check_hparams(f'config.algorithm.{key}', {option: v})
      else:
        base.check_hparams('config.algorithm', {key: value})
    except ValueError as e:
      raise ConfigError(str(e)) from None


def _plain(value: Any) -> Any:
  """ConfigDicts and lists to plain dicts and tuples."""
  if hasattr(value, 'to_dict'):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_plain(v) for v in value)
  return value


def split_name(kind: str, spec: Any) -> tuple[str, dict[str, Any]]:
  """``(name, kwargs)`` from a ``{'name': ..., **kwargs}`` config entry."""
  spec = _plain(spec)
  if not isinstance(spec, Mapping) or 'name' not in spec:
    raise ConfigError(f'config.{kind} must be a dict with a "name" key (and '
                      f'the builder\'s options); got {spec!r}.')
  spec = dict(spec)
  return spec.pop('name'), spec


# ------------------------------------------------------------------ optimizers

OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    name: getattr(optax, name) for name in (
        'sgd', 'adam', 'adamw', 'adagrad', 'rmsprop', 'lamb', 'lion',
        'adafactor', 'adabelief', 'lars', 'novograd', 'radam', 'sm3', 'fromage',
        'noisy_sgd', 'nadam', 'adamax')
    if hasattr(optax, name)
}
# The FedOpt server optimizers (Reddi et al. 2021; fedjx.algorithms.yogi_lib), so
# that algorithm='fedavg', server_optimizer={'name': 'yogi', ...} is FedYogi.
# 'yogi' is FedYogi's (its v_{-1}, no bias correction); optax's is 'optax_yogi'.
OPTIMIZERS.update({
    'adaptive_adam': algorithms_lib.adaptive_adam,
    'adaptive_adagrad': algorithms_lib.adaptive_adagrad,
    'yogi': algorithms_lib.yogi,
    'optax_yogi': optax.yogi,
})


def check_optimizer(spec: Any, where: str = 'optimizer'
                    ) -> tuple[Callable[..., Any], dict[str, Any]]:
  """The optax constructor an optimizer spec names and its checked options.

  Checks what :func:`build_optimizer` needs (the name, the option names and
  types, the required options) without building anything, so that
  :func:`fedjx.experiments.config.validate` checks a spec that the builder
  then builds once.
  """
  name, kwargs = split_name(where, spec)
  fn = lookup(f'{where} (optax optimizer)', OPTIMIZERS, name)
  check_kwargs(f'{where}', name, fn, kwargs)
  params = signatures.keyword_parameters(fn)
  check_types(where, params, kwargs)
  missing = [p.name for p in params.values() if p.default is p.empty and
             p.name not in kwargs]
  if missing:
    raise ConfigError(f'config.{where}: optax optimizer {name!r} needs '
                      f'{", ".join(missing)}; set config.{where}.{missing[0]}.')
  return fn, kwargs


def build_optimizer(spec: Any, where: str = 'optimizer') -> optax.GradientTransformation:
  """An optax optimizer from ``{'name': 'sgd', 'learning_rate': 0.1, ...}``.

  Numeric hyperparameters are injected (``optax.inject_hyperparams``), so they
  live in the optimizer state as arrays: algorithms can read and change them
  without recompiling. Booleans and strings (e.g. ``nesterov=True``) are static.
  """
  fn, kwargs = check_optimizer(spec, where)
  static = tuple(k for k, v in kwargs.items()
                 if v is None or isinstance(v, (bool, str, tuple)))
  return optax.inject_hyperparams(fn, static_args=static)(**kwargs)


# ------------------------------------------------------------------ algorithms

# What the runner gives every algorithm builder besides the config's options:
# the model's metrics and its non-finite guard (every builder made with
# fedjx.algorithms.base.with_options takes both).
RUNNER_OPTIONS = ('metrics_fn', 'skip_nonfinite')


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
  """A registered algorithm: its builder and what it declares about itself.

  Everything the runner, the config checks and the sweep need to know about
  an algorithm is a field here, so adding an algorithm is one entry (in the
  package, one line of :data:`ALGORITHMS`; from your own code,
  :func:`register_algorithm`). Calling the entry calls the builder, and
  ``inspect.signature`` shows the builder's, so an entry stands wherever a
  builder does.

  Attributes:
    builder: ``builder(loss_fn, **options) -> Algorithm``.
    population: the option that takes the population size (SCAFFOLD's
      ``num_clients``, DiLoCo's ``num_replicas``): the runner sets it to
      the training population's size unless the config does. None: the
      algorithm keeps no per-client state.
    runner_options: which of :data:`RUNNER_OPTIONS` the builder takes.
    asynchronous: the runner feeds its rounds ``AsyncCohort``s from its
      simulated schedule (``fedjx.datasets.async_schedule``); ``fedjx-sweep``
      refuses it.
    updates_reach_params: every client output reaches the server model in
      the round that computes it (nothing waits in the state): with
      ``config.nonfinite`` ``'skip'`` or ``'stop'`` the runner runs its rounds
      unguarded first and redoes a round guarded only when its result is not
      finite (:mod:`fedjx.experiments.guarded_rounds`). False (the default,
      always safe): every round runs guarded.
    forwards_to: the builder passes its ``**kwargs`` on to another builder
      (the FedOpt conveniences to ``fedavg``): that builder, or the name of
      its entry. The options a config may give are both builders'.
    client_state: the builder's option choosing where its per-client state
      lives (SCAFFOLD's ``client_state``): the runner passes ``'store'``
      (rows outside the server state, in the run's ``ClientStore``) or
      ``'dense'`` (an ``[N, ...]`` array in it) per
      ``config.client_state.placement``. None: the algorithm offers no dense
      placement (``placement='device'`` is refused).
  """

  builder: Callable[..., Any]
  population: str | None = None
  runner_options: tuple[str, ...] = RUNNER_OPTIONS
  asynchronous: bool = False
  updates_reach_params: bool = False
  forwards_to: str | Callable[..., Any] | None = None
  client_state: str | None = None

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.builder(*args, **kwargs)

  @property
  def __signature__(self) -> inspect.Signature:
    return inspect.signature(self.builder)

  def forwarded(self) -> Callable[..., Any] | None:
    """The builder this entry's builder passes its ``**kwargs`` to, if any."""
    if isinstance(self.forwards_to, str):
      return algorithm_entry(self.forwards_to).builder
    if isinstance(self.forwards_to, AlgorithmEntry):
      return self.forwards_to.builder
    return self.forwards_to


def per_client(builder: Callable[..., Any], population: str,
               **traits: Any) -> AlgorithmEntry:
  """``builder``, whose option ``population`` takes the population size
  (``traits``: the other :class:`AlgorithmEntry` fields)."""
  return AlgorithmEntry(builder, population=population, **traits)


def algorithm_entry(name: str) -> AlgorithmEntry:
  """The :class:`AlgorithmEntry` of ``name`` (a plain builder put in
  :data:`ALGORITHMS` by hand: the entry's defaults, every runner option)."""
  value = lookup('algorithm', ALGORITHMS, name)
  return value if isinstance(value, AlgorithmEntry) else AlgorithmEntry(value)


_FEDAVG_FAMILY = dict(updates_reach_params=True)
_FEDOPT = dict(updates_reach_params=True, forwards_to='fedavg')

# Every algorithm a config can name: one entry each, saying everything about
# it (:class:`AlgorithmEntry`). In your own code, add one with
# register_algorithm(name, builder, ...); a builder is f(loss_fn, **options)
# and takes metrics_fn and skip_nonfinite.
ALGORITHMS: dict[str, AlgorithmEntry | Callable[..., Any]] = {
    'fedavg': AlgorithmEntry(algorithms_lib.fedavg, **_FEDAVG_FAMILY),
    'fedadam': AlgorithmEntry(algorithms_lib.fedadam, **_FEDOPT),
    'fedyogi': AlgorithmEntry(algorithms_lib.fedyogi, **_FEDOPT),
    'fedadagrad': AlgorithmEntry(algorithms_lib.fedadagrad, **_FEDOPT),
    'fedavgm': AlgorithmEntry(algorithms_lib.fedavgm, **_FEDOPT),
    'fedprox': AlgorithmEntry(algorithms_lib.fedprox, **_FEDAVG_FAMILY),
    'fednova': AlgorithmEntry(algorithms_lib.fednova, **_FEDAVG_FAMILY),
    # The base optimizer's state moves with the clients' gradients, which a
    # check of the new model does not see: guarded.
    'mime_lite': AlgorithmEntry(algorithms_lib.mime_lite),
    'mime': AlgorithmEntry(algorithms_lib.mime),
    'fedexp': AlgorithmEntry(algorithms_lib.fedexp, **_FEDAVG_FAMILY),
    'scaffold': per_client(algorithms_lib.scaffold, 'num_clients',
                           updates_reach_params=True,
                           client_state='client_state'),
    # Each client's row (a head, a personal model, FedDyn's gradient state)
    # moves beside the model, which a check of the new model does not see:
    # guarded.
    'fedrep': AlgorithmEntry(algorithms_lib.fedrep),
    'fedper': AlgorithmEntry(algorithms_lib.fedper),
    'ditto': AlgorithmEntry(algorithms_lib.ditto),
    'feddyn': per_client(algorithms_lib.feddyn, 'num_clients'),
    'apfl': AlgorithmEntry(algorithms_lib.apfl),
    # Its K cluster models are state beside the one model state.params
    # holds: guarded.
    'hyp_cluster': AlgorithmEntry(algorithms_lib.hyp_cluster),
    'dp_fedavg': AlgorithmEntry(algorithms_lib.dp_fedavg, updates_reach_params=True),
    'diloco': per_client(algorithms_lib.diloco, 'num_replicas',
                         updates_reach_params=True),
    # The scaling-law study's inner recipe (clipped AdamW, warmup-cosine).
    'diloco_recipe': per_client(algorithms_lib.diloco_recipe, 'num_replicas',
                                updates_reach_params=True, forwards_to='diloco'),
    # Its replicas keep parameters a round does not synchronize: guarded.
    'streaming_diloco': per_client(algorithms_lib.streaming_diloco, 'num_replicas'),
    # Its replicas keep their own outer models (eager updates): guarded.
    'eager_diloco': per_client(algorithms_lib.eager_diloco, 'num_replicas'),
    'fedavg_hypergradient_tuner': AlgorithmEntry(
        algorithms_lib.fedavg_hypergradient_tuner),
    # Its buffer is the round's cohort: every update reaches the model.
    'fedbuff': AlgorithmEntry(algorithms_lib.fedbuff, asynchronous=True,
                              updates_reach_params=True),
    # Its replicas keep training across rounds: guarded.
    'async_diloco': per_client(algorithms_lib.async_diloco, 'num_replicas',
                               asynchronous=True),
    # Its step is a ratio of the cohort's sums: every update reaches the model.
    'qffl': AlgorithmEntry(algorithms_lib.qffl, updates_reach_params=True),
    # Its domain weights and counts are state beside the model: guarded.
    'afl': AlgorithmEntry(algorithms_lib.afl),
    # One arrival per round, mixed in at once.
    'fedasync': AlgorithmEntry(algorithms_lib.fedasync, asynchronous=True,
                               updates_reach_params=True),
    # HetLoRA's pruned ranks are client state beside the adapters: guarded.
    'fedlora': AlgorithmEntry(algorithms_lib.fedlora),
}
# Algorithm options the runner sets (not config.algorithm), for every entry.
RESERVED = ('loss_fn', 'metrics_fn', 'skip_nonfinite', 'lora_config')


def forwarded_name(name: str) -> str | Callable[..., Any] | None:
  """The registered name of the builder that algorithm ``name`` passes its
  ``**kwargs`` to (the builder itself when no entry has it); None if it
  forwards nothing or is not registered."""
  if name not in ALGORITHMS:
    return None
  entry = algorithm_entry(name)
  if entry.forwards_to is None or isinstance(entry.forwards_to, str):
    return entry.forwards_to
  target = entry.forwarded()
  for other in ALGORITHMS:
    if algorithm_entry(other).builder is target:
      return other
  return target


def is_asynchronous(name: str) -> bool:
  """Whether algorithm ``name`` runs on a simulated schedule (its entry's
  ``asynchronous``); False for a name not registered."""
  return name in ALGORITHMS and algorithm_entry(name).asynchronous


def forwarded_builder(name: str) -> Callable[..., Any] | None:
  """The builder that algorithm ``name`` passes its ``**kwargs`` to, if any."""
  if name not in ALGORITHMS:
    return None
  return algorithm_entry(name).forwarded()


def builder_options(name: str, kind: str = 'algorithm') -> dict[str, inspect.Parameter]:
  """The options of builder ``name`` of ``kind`` a config may set, by name.

  The builder's keyword parameters, and for an algorithm that forwards
  ``**kwargs`` (the FedOpt conveniences) those of the builder it forwards to;
  the runner's :data:`RESERVED` options are left out.
  """
  if kind != 'algorithm':
    table = {'dataset': DATASETS, 'model': MODELS}[kind]
    return signatures.keyword_parameters(lookup(kind, table, name))
  fns = [lookup('algorithm', ALGORITHMS, name), forwarded_builder(name)]
  options: dict[str, inspect.Parameter] = {}
  for fn in fns:
    if fn is None:
      continue
    for key, p in signatures.keyword_parameters(fn).items():
      if key not in RESERVED and key not in options:
        options[key] = p
  return options


def build_algorithm(spec: Any, model: models.Model, *, map_strategy: str = 'auto',
                    chunk_size: int | None = None,
                    num_clients: int | None = None,
                    skip_nonfinite: bool | None = None,
                    placement: str | None = None) -> Any:
  """An algorithm from ``config.algorithm``.

  Options whose name ends in ``optimizer`` are optimizer specs (see
  :func:`build_optimizer`), ``aggregator`` an aggregator spec
  (:func:`fedjx.experiments.parts.build_aggregator`); the others are passed
  through. The entry
  (:class:`AlgorithmEntry`) says what else the builder receives: the model's
  ``metrics_fn`` and ``skip_nonfinite`` (the runner's non-finite guard; left
  to the builder's default when None), and, for an algorithm with per-client
  state, the population size ``num_clients`` as its ``population`` option
  unless the config sets it. How clients run is not the builder's business:
  a ``map_strategy`` or ``chunk_size`` other than the defaults is applied
  once, with ``algorithm.compile(map_strategy=..., chunk_size=...)``.
  ``placement`` (``config.client_state.placement``, None: the builder's
  default) sets the entry's ``client_state`` option: ``'store'`` or
  ``'dense'`` for ``'device'``.
  """
  name, kwargs = split_name('algorithm', spec)
  entry = algorithm_entry(name)
  check_kwargs('algorithm', name, entry, kwargs, RESERVED, entry.forwarded())
  for key, value in list(kwargs.items()):
    if key.endswith('optimizer') and isinstance(value, Mapping):
      kwargs[key] = build_optimizer(value, where=f'algorithm.{key}')
    elif key == 'aggregator' and isinstance(value, Mapping):
      kwargs[key] = parts.build_aggregator(value, where=f'algorithm.{key}')
  supplied = {'metrics_fn': model.metrics_fn, 'skip_nonfinite': skip_nonfinite}
  names, var = signatures.accepted_kwargs(entry.builder)
  if 'lora_config' in names:  # Federated LoRA reads the adapters' rank and scale.
    from fedjx.models import lora  # pylint: disable=g-import-not-at-top
    if not isinstance(model, lora.LoraModel):
      raise ConfigError(f'algorithm {name!r} trains LoRA adapters; set config.lora.rank '
                        '(docs/fine_tuning.md).')
    kwargs['lora_config'] = model.config
  for key in entry.runner_options:
    if not var and key not in names:
      taken = tuple(k for k in entry.runner_options if k in names)
      raise ConfigError(
          f'algorithm {name!r}: its builder does not take {key!r}, which its '
          'registry entry says the runner passes; declare what it takes with '
          f'AlgorithmEntry(builder, runner_options={taken!r}).')
    if supplied[key] is not None:
      kwargs[key] = supplied[key]
  if (entry.population is not None and entry.population not in kwargs
      and num_clients is not None):
    kwargs[entry.population] = num_clients
  if placement is not None:
    _place_client_state(name, entry, kwargs, placement)
  algorithm = entry(model.loss_fn, **kwargs)
  if (map_strategy, chunk_size) != ('auto', None):
    if not hasattr(algorithm, 'compile'):
      raise ConfigError(f'algorithm {name!r} returns {type(algorithm).__name__}, '
                        'which has no compile(); it runs with the default '
                        "map_strategy='auto' and chunk_size=None only.")
    algorithm = algorithm.compile(map_strategy=map_strategy, chunk_size=chunk_size)
  return algorithm


def _place_client_state(name: str, entry: AlgorithmEntry,
                        kwargs: dict[str, Any], placement: str) -> None:
  """Sets the entry's ``client_state`` option for ``placement``."""
  del name
  option = entry.client_state
  if option is None or option in kwargs:
    return  # No choice to make (build_algorithm's caller refuses 'device').
  if option in signatures.accepted_kwargs(entry.builder)[0]:
    kwargs[option] = 'dense' if placement == 'device' else 'store'


# ------------------------------------------------------------------ datasets


ExperimentData = data_lib.ExperimentData

DATASETS: dict[str, Callable[..., ExperimentData]] = dict(data_lib.BUILDERS)


def register_dataset(name: str, builder: Callable[..., ExperimentData]) -> None:
  """Adds (or replaces) a dataset builder ``builder(**kwargs) -> ExperimentData``."""
  DATASETS[name] = builder


def register_algorithm(name: str, builder: Callable[..., Any] | AlgorithmEntry, *,
                       population: str | None = None,
                       runner_options: tuple[str, ...] | None = None,
                       asynchronous: bool = False,
                       updates_reach_params: bool = False,
                       forwards_to: str | Callable[..., Any] | None = None) -> None:
  """Adds (or replaces) the algorithm ``name``: one :class:`AlgorithmEntry`.

  Args:
    name: the name configs use.
    builder: the builder ``builder(loss_fn, **kwargs)``, or a whole
      :class:`AlgorithmEntry` (then no other argument may be given).
    population: the builder's option that takes the population size, for an
      algorithm with per-client state (see :class:`AlgorithmEntry`).
    runner_options: which of :data:`RUNNER_OPTIONS` the builder takes; None
      reads them from its signature here, once (all of them if it takes
      ``**kwargs``), and the entry keeps them.
    asynchronous, updates_reach_params, forwards_to: the entry's traits (see
      :class:`AlgorithmEntry`).
  """
  if isinstance(builder, AlgorithmEntry):
    if (population, runner_options, asynchronous, updates_reach_params,
        forwards_to) != (None, None, False, False, None):
      raise ConfigError(f'register_algorithm({name!r}): an AlgorithmEntry says '
                        'everything about its algorithm; give its fields in it, '
                        'not as arguments.')
    entry = builder
  else:
    if runner_options is None:
      names, var = signatures.accepted_kwargs(builder)
      runner_options = tuple(k for k in RUNNER_OPTIONS if var or k in names)
    entry = AlgorithmEntry(builder, population, tuple(runner_options),
                           asynchronous=bool(asynchronous),
                           updates_reach_params=bool(updates_reach_params),
                           forwards_to=forwards_to)
  for key in entry.runner_options:
    if key not in RUNNER_OPTIONS:
      raise ConfigError(f'register_algorithm({name!r}): runner_options has '
                        f'{key!r}; valid runner options: {list(RUNNER_OPTIONS)}.')
  if isinstance(entry.forwards_to, str) and entry.forwards_to not in ALGORITHMS:
    raise ConfigError(
        f'register_algorithm({name!r}): forwards_to={entry.forwards_to!r} is not '
        f'a registered algorithm.{_suggest(entry.forwards_to, ALGORITHMS)}')
  ALGORITHMS[name] = entry


def build_dataset(spec: Any, seed: int) -> ExperimentData:
  """The data of ``config.dataset``; ``seed`` is passed if not set and taken."""
  name, kwargs = split_name('dataset', spec)
  fn = lookup('dataset', DATASETS, name)
  check_kwargs('dataset', name, fn, kwargs)
  accepted, _ = signatures.accepted_kwargs(fn)
  if 'seed' in accepted and 'seed' not in kwargs:
    kwargs['seed'] = seed
  data = fn(**kwargs)
  if not isinstance(data, ExperimentData):
    raise TypeError(f'dataset builder {name!r} returned {type(data).__name__}; '
                    'it must return an ExperimentData.')
  if 'num_classes' in data.info:  # Labels outside [0, num_classes) are errors.
    check = lambda d: datasets.check_labels(d, data.info['num_classes'], dataset=name)
    data = dataclasses.replace(data, train=check(data.train), test=check(data.test))
  return data


# ------------------------------------------------------------------ models

MODELS: dict[str, Callable[..., models.Model]] = {
    'logistic_regression': models.logistic_regression,
    'mlp': models.mlp,
    'emnist_cnn': models.emnist_cnn,
    'resnet': models.resnet,
    'transformer_lm': models.transformer_lm,
    'lstm_lm': models.lstm_lm,
    'llama_lm': models.llama_lm,
}


def register_model(name: str, builder: Callable[..., models.Model]) -> None:
  """Adds (or replaces) a model builder ``builder(**kwargs) -> Model``."""
  MODELS[name] = builder


def build_model(spec: Any, info: Mapping[str, Any] | None = None) -> models.Model:
  """The model of ``config.model``; dataset ``info`` fills options not set."""
  name, kwargs = split_name('model', spec)
  fn = lookup('model', MODELS, name)
  check_kwargs('model', name, fn, kwargs)
  accepted, _ = signatures.accepted_kwargs(fn)
  for key, value in (info or {}).items():
    if key in accepted and key not in kwargs:
      kwargs[key] = value
  return fn(**kwargs)
