"""The parts a config names inside an experiment, and their builders.

Every part of a config is ``{'name': ..., **options}``: the name picks a
builder of :mod:`fedjx.algorithms` from a table here, and the options are
that builder's keyword arguments::

  config.algorithm.aggregator = dict(name='krum', num_byzantine=2)
  config.attack = dict(name='alie', fraction=0.2, z=1.5)

The library's builders take the objects these build (an
:class:`~fedjx.algorithms.aggregators.Aggregator`, an
:class:`~fedjx.algorithms.attacks.Attack`), not names: the tables from
names to builders live here, in the layer that reads configs.

* :data:`AGGREGATORS` and :func:`build_aggregator`: the aggregators,
  defenses, compressors, secure sums and DP mechanisms a config names
  (``dp_defense``'s ``defense`` is itself a spec);
* :data:`ATTACKS` and :func:`build_attack`: the attacks ``config.attack``
  names. Model poisoning builds a :class:`~fedjx.algorithms.attacks.Attack`
  (the builders of :mod:`fedjx.algorithms.attacks`); data poisoning
  (:data:`DATA_POISONING`: :func:`label_flip`, :func:`backdoor`) a
  :class:`Poisoning`, whose options are those of
  :func:`fedjx.datasets.poisoning.flip_labels` /
  :func:`~fedjx.datasets.poisoning.backdoor` a config may set (the dataset
  gives ``num_classes``, ``config.attack.seed`` the seed), plus backdoor's
  ``boost`` (model replacement). ``config.attack``'s ``fraction`` and
  ``seed`` (:data:`ATTACK_SECTION`) are the section's own keys, not options.

An unknown name, an option the builder does not take, or a value it
refuses is one :class:`~fedjx.experiments.config.ConfigError` naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from fedjx.algorithms import aggregators
from fedjx.algorithms import attacks
from fedjx.algorithms import compression
from fedjx.algorithms import privacy
from fedjx.datasets import poisoning
from fedjx.experiments import errors
from fedjx.experiments import signatures

ConfigError = errors.ConfigError

# The aggregators a config can name: ``aggregator=dict(name='gaussian', ...)``.
AGGREGATORS: dict[str, Callable[..., aggregators.Aggregator]] = {
    'mean': aggregators.mean,
    'quantized_mean': aggregators.quantized_mean,
    'gaussian': aggregators.gaussian,
    'adaptive_gaussian': privacy.adaptive_gaussian,
    'tree_gaussian': privacy.tree_gaussian,
    # Compressors (their bits counted), secure sums and distributed DP.
    'stochastic_quantization': compression.stochastic_quantization,
    'eden': compression.eden,
    'drive': compression.drive,
    'qsgd': compression.qsgd,
    'terngrad': compression.terngrad,
    'sign_majority': compression.sign_majority,
    'top_k': compression.top_k,
    'random_k': compression.random_k,
    'uncompressed': compression.uncompressed,
    # Compressed outer steps of DiLoCo (per-replica state: num_replicas).
    'sparseloco': compression.sparseloco,
    'muloco_quantized': compression.muloco_quantized,
    'demo': compression.demo,
    'secure_sum': aggregators.secure_sum,
    'distributed_skellam': privacy.distributed_skellam,
    'local_gaussian': privacy.local_gaussian,
    # Defenses against Byzantine clients (``median`` is ``coordinate_median``).
    'median': aggregators.coordinate_median,
    'trimmed_mean': aggregators.trimmed_mean,
    'krum': aggregators.krum,
    'multi_krum': aggregators.multi_krum,
    'bulyan': aggregators.bulyan,
    'geometric_median': aggregators.geometric_median,
    'norm_bounding': aggregators.norm_bounding,
    'centered_clipping': aggregators.centered_clipping,
    'dp_defense': aggregators.dp_defense,
}
# Options of an aggregator that are aggregators themselves (specs in a config).
NESTED_AGGREGATORS = {'dp_defense': ('defense',)}

def options_of(builder: Callable[..., Any]) -> tuple[str, ...]:
  """The keyword options ``builder`` takes."""
  return tuple(signatures.keyword_parameters(builder))


def split(where: str, spec: Any, table: Mapping[str, Any]
          ) -> tuple[str, dict[str, Any]]:
  """``(name, options)`` of ``spec``, a ``{'name': <a key of table>, ...}``."""
  if hasattr(spec, 'to_dict'):
    spec = spec.to_dict()
  if not isinstance(spec, Mapping) or 'name' not in spec:
    raise ConfigError(f'config.{where}={spec!r} must be a dict with a "name" '
                      f'(one of {sorted(table)}) and its options.')
  options = dict(spec)
  name = options.pop('name')
  if name not in table:
    raise ConfigError(f'config.{where}.name={name!r} is not one of '
                      f'{sorted(table)}.{errors.suggest(name, table)}')
  return name, options


def check_options(where: str, name: str, builder: Callable[..., Any],
                  options: Mapping[str, Any]) -> None:
  """A ConfigError for an option ``builder`` does not take."""
  valid = options_of(builder)
  for key, value in options.items():
    if key not in valid:
      raise ConfigError(
          f'config.{where}.{key}={value!r} is not an option of {name!r}.'
          f'{errors.suggest(key, valid)} It takes {sorted(valid)}.')


def build_aggregator(spec: Any, where: str = 'algorithm.aggregator'
                     ) -> aggregators.Aggregator:
  """The :class:`~fedjx.algorithms.aggregators.Aggregator` a spec names.

  ``spec`` is ``{'name': <a key of AGGREGATORS>, **options}``, or already
  an Aggregator (returned as it is). The options of
  :data:`NESTED_AGGREGATORS` are specs too. ``where`` is the spec's place in
  the config, for the errors.
  """
  if isinstance(spec, aggregators.Aggregator):
    return spec
  name, options = split(where, spec, AGGREGATORS)
  builder = AGGREGATORS[name]
  check_options(where, name, builder, options)
  for key in NESTED_AGGREGATORS.get(name, ()):
    if key in options:
      options[key] = build_aggregator(options[key], f'{where}.{key}')
  try:
    return builder(**options)
  except (TypeError, ValueError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f'config.{where}={spec!r}: {e}') from None



# ---------------------------------------------------------------- attacks

class Poisoning(NamedTuple):
  """A data-poisoning attack of ``config.attack``: what :func:`label_flip`
  and :func:`backdoor` build.

  ``transform(num_classes, seed)`` is the transform of the malicious
  clients' examples (:class:`fedjx.datasets.PoisonedDataset`);
  ``held_out(examples, num_classes)`` the held-out set whose accuracy is
  the attack's success rate (None if it has no example); ``attack`` what
  the malicious clients send (:func:`~fedjx.algorithms.attacks.identity`,
  or :func:`~fedjx.algorithms.attacks.scaling` for a boosted backdoor);
  ``needs_images`` whether the inputs must be images.
  """
  name: str
  transform: Callable[[int, int], Any]
  held_out: Callable[[Mapping[str, Any], int], dict[str, Any] | None]
  attack: attacks.Attack
  needs_images: bool = False


def label_flip(mapping: Sequence[int] | None = None) -> Poisoning:
  """Label flipping: :func:`fedjx.datasets.poisoning.flip_labels` of the
  dataset's ``num_classes`` and ``mapping`` (None: ``y -> K - 1 - y``)."""
  if mapping is not None:
    if hasattr(mapping, 'tolist'):
      mapping = mapping.tolist()
    if not (isinstance(mapping, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in mapping)):
      raise ValueError(f'label_flip: mapping={mapping!r}; it must be a list of '
                       'ints, the new label of each class.')
    mapping = [int(v) for v in mapping]
  return Poisoning(
      'label_flip',
      lambda num_classes, seed: poisoning.flip_labels(num_classes, mapping),
      lambda examples, num_classes: poisoning.flipped_examples(
          examples, num_classes, mapping),
      attacks.identity())


def backdoor(target: int = 0, patch_size: int = 2, patch_value: float = 1.0,
             poison_fraction: float = 0.5, boost: float | None = None
             ) -> Poisoning:
  """The pixel-pattern backdoor: :func:`fedjx.datasets.poisoning.backdoor`
  of the dataset's ``num_classes`` and ``config.attack.seed``; ``boost``
  (None or 1: none) also scales the malicious clients' updates
  (:func:`fedjx.algorithms.attacks.scaling`, Bagdasaryan et al. 2020's
  model replacement)."""
  # Every option but target < num_classes, which the dataset tells.
  classes = target + 1 if isinstance(target, int) and not isinstance(
      target, bool) and target >= 1 else 2
  poisoning.check_backdoor(target, classes, patch_size, patch_value,
                           poison_fraction)
  boosted = boost is not None and boost != 1
  sent = attacks.scaling(float(boost)) if boosted else attacks.identity()
  return Poisoning(
      'backdoor',
      lambda num_classes, seed: poisoning.backdoor(
          target, num_classes, patch_size=patch_size, patch_value=patch_value,
          poison_fraction=poison_fraction, seed=seed),
      lambda examples, num_classes: poisoning.triggered_examples(
          examples, target, patch_size=patch_size, patch_value=patch_value),
      sent, needs_images=True)


# The attacks a config can name: ``config.attack = dict(name='alie', z=1.5)``.
ATTACKS: dict[str, Callable[..., attacks.Attack | Poisoning]] = {
    # Model poisoning: the malicious clients' messages replaced.
    'sign_flip': attacks.sign_flip,
    'gaussian_noise': attacks.gaussian_noise,
    'scaling': attacks.scaling,
    'alie': attacks.alie,
    'ipm': attacks.ipm,
    # Data poisoning: their examples changed (and eval_attack_success_rate).
    'label_flip': label_flip,
    'backdoor': backdoor,
}
DATA_POISONING = ('label_flip', 'backdoor')
# The keys of config.attack that are not options of the named attack.
ATTACK_SECTION = ('fraction', 'seed')


def _type_names(types: tuple[type, ...]) -> str:
  names = [t.__name__ for t in types if t is not type(None)]
  return ' or '.join(names + (['None'] if type(None) in types else []))


def check_types(where: str, builder: Callable[..., Any],
                options: Mapping[str, Any]) -> None:
  """A ConfigError for an option whose value is not of its parameter's types
  (:func:`fedjx.experiments.signatures.option_types`), or a non-finite number."""
  params = signatures.keyword_parameters(builder)
  for key, value in options.items():
    types = signatures.option_types(params[key])
    if types is None:
      continue
    ok = isinstance(value, types) and not (
        isinstance(value, bool) and bool not in types)
    if not ok:
      raise ConfigError(f'config.{where}.{key}={value!r}; it must be '
                        f'{_type_names(types)}.')
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f'config.{where}.{key}={value!r}; it must be a finite '
                        'number.')


def build_attack(spec: Any, where: str = 'attack'
                 ) -> attacks.Attack | Poisoning:
  """The attack a spec names: an :class:`~fedjx.algorithms.attacks.Attack`
  (model poisoning) or a :class:`Poisoning` (data poisoning).

  ``spec`` is ``config.attack``, ``{'name': <a key of ATTACKS>, **options}``
  (its :data:`ATTACK_SECTION` keys, ``fraction`` and ``seed``, are left
  out), or already an Attack or a Poisoning (returned as it is). An unknown
  name or option, or a value the builder refuses, is one ConfigError naming
  ``config.<where>.<key>``.
  """
  if isinstance(spec, (attacks.Attack, Poisoning)):
    return spec
  name, options = split(where, spec, ATTACKS)
  for key in ATTACK_SECTION:
    options.pop(key, None)
  builder = ATTACKS[name]
  check_options(where, name, builder, options)
  check_types(where, builder, options)
  try:
    return builder(**options)
  except (TypeError, ValueError) as e:
    if isinstance(e, ConfigError):
      raise
    text = str(e)
    for key, value in options.items():
      if f'{key}=' in text:
        raise ConfigError(f'config.{where}.{key}={value!r}: {text}') from None
    raise ConfigError(f'config.{where}={spec!r}: {text}') from None
