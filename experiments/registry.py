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
from fedjx.algorithms import base
from fedjx.algorithms import traits as traits_lib
from fedjx.algorithms.traits import Traits
from fedjx.experiments import data as data_lib
from fedjx.experiments import errors
from fedjx.experiments import parts
from fedjx.experiments import signatures
from fedjx.models import lora
from fedjx.options import MapOptions


ConfigError = errors.ConfigError
_suggest = errors.suggest


def lookup(kind: str, registry: Mapping[str, Any], name: Any) -> Any:
  """``registry[name]``, or a ConfigError listing the valid names."""
  if name not in registry:
    raise ConfigError(f'unknown {kind} {name!r}.{_suggest(name, registry)} '
                      f'Valid {kind} names: {sorted(registry)}.')
  return registry[name]


def check_kwargs(kind: str, name: str, fn: Callable[..., Any],
                 kwargs: Mapping[str, Any], reserved: tuple[str, ...] = ()) -> None:
  """Raises a ConfigError if ``fn`` does not take every key of ``kwargs``.

  A builder with ``**kwargs`` accepts anything.
  """
  names, var = signatures.accepted_kwargs(fn)
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

# What the runner gives every algorithm builder that takes them, besides the
# config's options: the model's metrics and its non-finite guard.
RUNNER_OPTIONS = ('metrics_fn', 'skip_nonfinite')

# Every algorithm a config can name: its builder, which declares its traits
# where it is defined (``@kit.declare(Traits(...))``: the option taking the
# population size, whether it is asynchronous, ...). Adding an algorithm to
# the package is its module, its export from fedjx.algorithms and one line
# here (a literal, which fedjx-run reads before importing JAX:
# fedjx.experiments.preflight); in your own code,
# register_algorithm(name, builder); a builder is f(loss_fn, **options).
ALGORITHMS: dict[str, Callable[..., Any]] = {
    'afl': algorithms_lib.afl,
    'apfl': algorithms_lib.apfl,
    'async_diloco': algorithms_lib.async_diloco,
    'diloco': algorithms_lib.diloco,
    'diloco_recipe': algorithms_lib.diloco_recipe,
    'ditto': algorithms_lib.ditto,
    'dp_fedavg': algorithms_lib.dp_fedavg,
    'eager_diloco': algorithms_lib.eager_diloco,
    'fedadagrad': algorithms_lib.fedadagrad,
    'fedadam': algorithms_lib.fedadam,
    'fedasync': algorithms_lib.fedasync,
    'fedavg': algorithms_lib.fedavg,
    'fedavg_hypergradient_tuner': algorithms_lib.fedavg_hypergradient_tuner,
    'fedavgm': algorithms_lib.fedavgm,
    'fedbuff': algorithms_lib.fedbuff,
    'feddyn': algorithms_lib.feddyn,
    'fedexp': algorithms_lib.fedexp,
    'fedlora': algorithms_lib.fedlora,
    'fednova': algorithms_lib.fednova,
    'fedper': algorithms_lib.fedper,
    'fedprox': algorithms_lib.fedprox,
    'fedrep': algorithms_lib.fedrep,
    'fedyogi': algorithms_lib.fedyogi,
    'hyp_cluster': algorithms_lib.hyp_cluster,
    'mime': algorithms_lib.mime,
    'mime_lite': algorithms_lib.mime_lite,
    'qffl': algorithms_lib.qffl,
    'scaffold': algorithms_lib.scaffold,
    'streaming_diloco': algorithms_lib.streaming_diloco,
}
# Algorithm options the runner sets (not config.algorithm), for every entry.
RESERVED = ('loss_fn', 'metrics_fn', 'skip_nonfinite', 'lora_config')


def algorithm_builder(name: str) -> Callable[..., Any]:
  """The builder of algorithm ``name``, or a ConfigError listing the names."""
  return lookup('algorithm', ALGORITHMS, name)


def algorithm_traits(name: str) -> Traits:
  """What algorithm ``name``'s builder declares (:class:`Traits`; the
  defaults for a builder that declares none)."""
  return traits_lib.of(algorithm_builder(name))


def resolve_placement(name: str, placement: str) -> str:
  """``config.client_state.placement`` for algorithm ``name``, ``'auto'`` resolved.

  ``'auto'`` is ``'device'`` for an algorithm whose population is replicas
  (DiLoCo's ``num_replicas``: a few rows, each a model's optimizer state,
  read by every round, updated in place on the device) and ``'store'``
  otherwise (a population of clients, of which a round reads a cohort's
  rows). A DiLoCo run whose replicas' states do not fit beside the round
  on the device names ``'store'`` (docs/scaling.md).
  """
  if placement != 'auto':
    return placement
  replicas = name in ALGORITHMS and algorithm_traits(name).population == 'num_replicas'
  return 'device' if replicas else 'store'


def is_asynchronous(name: str) -> bool:
  """Whether algorithm ``name`` runs on a simulated schedule (its declared
  ``asynchronous``); False for a name not registered."""
  return name in ALGORITHMS and algorithm_traits(name).asynchronous


def builder_options(name: str, kind: str = 'algorithm') -> dict[str, inspect.Parameter]:
  """The options of builder ``name`` of ``kind`` a config may set, by name.

  The builder's keyword parameters, and for an algorithm those its
  ``**options`` takes (its declared ``Traits.options``); the runner's
  :data:`RESERVED` options are left out.
  """
  if kind != 'algorithm':
    table = {'dataset': DATASETS, 'model': MODELS}[kind]
    return signatures.keyword_parameters(lookup(kind, table, name))
  builder = algorithm_builder(name)
  options = {key: p for key, p in signatures.keyword_parameters(builder).items()
             if key not in RESERVED}
  for key, p in signatures.declared_options(builder).items():
    if key not in RESERVED and key not in options:
      options[key] = p
  return options


def runner_options(name: str) -> tuple[str, ...]:
  """Which of :data:`RUNNER_OPTIONS` the builder of ``name`` takes (all of
  them when it takes any ``**kwargs`` and declares no options)."""
  builder = algorithm_builder(name)
  names, var = signatures.accepted_kwargs(builder)
  names = list(names) + list(signatures.declared_options(builder))
  var = var and not traits_lib.of(builder).options
  return tuple(k for k in RUNNER_OPTIONS if var or k in names)


_DEFAULT_MAP = MapOptions()  # what an algorithm not compiled again runs with


def build_algorithm(spec: Any, model: models.Model, *,
                    map_options: MapOptions = _DEFAULT_MAP,
                    num_clients: int | None = None,
                    skip_nonfinite: bool | None = None,
                    placement: str | None = None) -> Any:
  """An algorithm from ``config.algorithm``.

  Options whose name ends in ``optimizer`` are optimizer specs (see
  :func:`build_optimizer`), ``aggregator`` an aggregator spec
  (:func:`fedjx.experiments.parts.build_aggregator`); the others are passed
  through. What the builder declares (its :class:`Traits`) says what else it
  receives: the model's ``metrics_fn`` and ``skip_nonfinite`` (the runner's
  non-finite guard; left to the builder's default when None) if it takes
  them, and, for an algorithm with per-client state, the population size
  ``num_clients`` as its ``population`` option unless the config sets it. How clients run is not the builder's business:
  ``map_options`` (the config's, checked where it entered,
  ``fedjx.options.RoundOptions.of(config).map``), when not the defaults,
  is applied once, with ``algorithm.compile(map_options)``.
  ``placement`` (``config.client_state.placement``, None: the builder's
  default) sets its declared ``client_state`` option: ``'store'``, or
  ``'dense'`` for ``'device'`` (``'auto'``: :func:`resolve_placement`).
  """
  name, kwargs = split_name('algorithm', spec)
  builder = algorithm_builder(name)
  traits = traits_lib.of(builder)
  check_algorithm_kwargs(name, kwargs)
  for key, value in list(kwargs.items()):
    if key.endswith('optimizer') and isinstance(value, Mapping):
      kwargs[key] = build_optimizer(value, where=f'algorithm.{key}')
    elif key == 'aggregator' and isinstance(value, Mapping):
      kwargs[key] = parts.build_aggregator(value, where=f'algorithm.{key}')
  supplied = {'metrics_fn': model.metrics_fn, 'skip_nonfinite': skip_nonfinite}
  names, _ = signatures.accepted_kwargs(builder)
  if 'lora_config' in names:  # Federated LoRA reads the adapters' rank and scale.
    if not isinstance(model, lora.LoraModel):
      raise ConfigError(f'algorithm {name!r} trains LoRA adapters; set config.lora.rank '
                        '(docs/fine_tuning.md).')
    kwargs['lora_config'] = model.config
  for key in runner_options(name):
    if supplied[key] is not None:
      kwargs[key] = supplied[key]
  if (traits.population is not None and traits.population not in kwargs
      and num_clients is not None):
    kwargs[traits.population] = num_clients
  if placement is not None and traits.client_state is not None and (
      traits.client_state not in kwargs):
    resolved = resolve_placement(name, placement)
    kwargs[traits.client_state] = 'dense' if resolved == 'device' else 'store'
  algorithm = builder(model.loss_fn, **kwargs)
  if map_options != _DEFAULT_MAP:
    if not hasattr(algorithm, 'compile'):
      raise ConfigError(f'algorithm {name!r} returns {type(algorithm).__name__}, '
                        'which has no compile(); it runs with the default '
                        "map_strategy='auto' and chunk_size=None only.")
    algorithm = algorithm.compile(map_options)
  return algorithm


# ------------------------------------------------------------------ datasets


ExperimentData = data_lib.ExperimentData

DATASETS: dict[str, Callable[..., ExperimentData]] = dict(data_lib.BUILDERS)


def register_dataset(name: str, builder: Callable[..., ExperimentData]) -> None:
  """Adds (or replaces) a dataset builder ``builder(**kwargs) -> ExperimentData``."""
  DATASETS[name] = builder


def register_algorithm(name: str, builder: Callable[..., Any]) -> None:
  """Adds (or replaces) the algorithm ``name``: ``builder(loss_fn, **options)``.

  What the runner needs to know about it is what the builder declares
  (``@fedjx.algorithms.traits.declare(Traits(...))``; none: the defaults):
  the option taking the population size, whether it is asynchronous, the
  options its ``**options`` takes, ... (:class:`Traits`).
  """
  if not callable(builder):
    raise ConfigError(f'register_algorithm({name!r}): builder={builder!r} is '
                      'not callable (a builder(loss_fn, **options)).')
  if not isinstance(getattr(builder, 'traits', traits_lib.NONE), Traits):
    raise ConfigError(f'register_algorithm({name!r}): builder.traits='
                      f'{builder.traits!r} is not a fedjx.algorithms.traits.Traits.')
  ALGORITHMS[name] = builder


def check_algorithm_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
  """Raises a ConfigError unless algorithm ``name`` takes every key of
  ``kwargs``: its builder's keyword parameters and declared options, less
  the runner's :data:`RESERVED` ones."""
  builder = algorithm_builder(name)
  declared = signatures.declared_options(builder)
  names, var = signatures.accepted_kwargs(builder)
  valid = [n for n in list(names) + list(declared) if n not in RESERVED]
  for key in kwargs:
    if key in RESERVED:
      raise ConfigError(
          f'algorithm {name!r} has no option {key!r}: the runner sets it. Valid '
          f'options of algorithm {name!r}: {sorted(valid)}.')
  if var and not declared:
    return
  for key in kwargs:
    if key not in valid:
      raise ConfigError(
          f'algorithm {name!r} has no option {key!r}.{_suggest(key, valid)} '
          f'Valid options of algorithm {name!r}: {sorted(valid)}.')


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
