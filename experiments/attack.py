"""``config.attack``: malicious clients in an experiment.

The config section is a spec like every other part,
``{'name': ..., 'fraction': ..., 'seed': ..., **options}``: the name picks
a builder of :data:`fedjx.experiments.parts.ATTACKS`, the options are its
keyword arguments (:func:`fedjx.experiments.parts.build_attack`), and
``fraction`` and ``seed`` choose the malicious clients (schema in
:mod:`fedjx.experiments.config`, ``ATTACK_DEFAULTS``). Building an
experiment turns it into these parts, where the config becomes the
dataset, the algorithm and the evaluation:

* :func:`malicious` -- the malicious client ids,
  :func:`fedjx.algorithms.attacks.malicious_clients` of the population,
  ``config.attack.fraction`` and ``config.attack.seed`` (default
  ``config.seed``): fixed for the run, so each round's number of malicious
  clients follows the sampling;
* :func:`poison_data` -- for data poisoning (``label_flip``, ``backdoor``),
  the training population with those clients' examples poisoned
  (:class:`fedjx.datasets.PoisonedDataset`);
* :func:`algorithm_spec` -- ``config.algorithm`` whose aggregator is wrapped
  by the attack (:func:`fedjx.algorithms.attacks.attacked`): model poisoning
  replaces the malicious clients' messages; data poisoning only counts them
  (a backdoor with ``boost`` also scales their updates, Bagdasaryan et al.
  2020's model replacement). Every attacked round reports
  ``malicious_clients``;
* :func:`with_success_rate` -- for data poisoning, the evaluation adds
  ``eval_attack_success_rate``: the fraction of the held-out examples the
  attack targets that the model classifies as the attacker wants (backdoor:
  test examples whose true label is not the target, with the trigger,
  predicted as the target; label flip: test examples whose label the flip
  moves, predicted as the flipped label).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from fedjx import datasets
from fedjx.algorithms import attacks
from fedjx.experiments import errors
from fedjx.experiments import evaluation
from fedjx.experiments import parts
from fedjx.experiments import registry

ConfigError = errors.ConfigError
SUCCESS_METRIC = 'eval_attack_success_rate'


def _attack(config: Any) -> dict[str, Any]:
  attack = config.get('attack') if hasattr(config, 'get') else None
  if attack is None:
    return {'name': ''}
  return attack.to_dict() if hasattr(attack, 'to_dict') else dict(attack)


def is_attacked(config: Any) -> bool:
  """Whether ``config.attack`` names an attack."""
  return bool(_attack(config).get('name'))


def malicious(config: Any, num_clients: int) -> np.ndarray | None:
  """``int32 [F]``: the run's malicious client ids, or None without an attack."""
  attack = _attack(config)
  if not attack.get('name'):
    return None
  seed = attack.get('seed')
  return attacks.malicious_clients(num_clients, float(attack['fraction']),
                                   int(config.seed if seed is None else seed))


def built(config: Any) -> Any:
  """:func:`fedjx.experiments.parts.build_attack` of ``config.attack``, or
  None without an attack."""
  attack = _attack(config)
  if not attack.get('name'):
    return None
  return parts.build_attack(attack)


def _poisoning(config: Any) -> Any:
  """The :class:`fedjx.experiments.parts.Poisoning` of ``config.attack``, or
  None for no attack or a model-poisoning one."""
  attack = built(config)
  if attack is None:
    return None
  return attack if isinstance(attack, parts.Poisoning) else None


def _num_classes(data: Any, name: str) -> int:
  if 'num_classes' not in data.info:
    raise ConfigError(f'config.attack.name={name!r} changes class labels, but '
                      'the dataset reports no num_classes; use a '
                      'classification dataset.')
  return int(data.info['num_classes'])


def poison_data(config: Any, data: Any) -> Any:
  """``data`` with the malicious clients' training examples poisoned.

  Unchanged unless ``config.attack.name`` is a data-poisoning attack.
  """
  poison = _poisoning(config)
  if poison is None:
    return data
  name = poison.name
  num_classes = _num_classes(data, name)
  ids = malicious(config, data.train.num_clients)
  if poison.needs_images:
    sample = np.asarray(data.train.client_data(0)['x'])
    if sample.ndim < 3:
      raise ConfigError(f'config.attack.name={name!r} sets a pixel pattern, '
                        f"but the dataset's inputs 'x' have shape "
                        f'{sample.shape[1:]} per example; it needs images.')
  seed = _attack(config).get('seed')
  try:
    transform = poison.transform(num_classes,
                                 int(config.seed if seed is None else seed))
  except ValueError as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f'config.attack: {e}') from None
  return dataclasses.replace(
      data, train=datasets.PoisonedDataset(data.train, ids, transform))


def model_attack(config: Any) -> Any:
  """The :class:`fedjx.algorithms.attacks.Attack` of ``config.attack``
  (:func:`fedjx.experiments.parts.build_attack`): what the malicious clients
  send; for data poisoning, their own updates
  (:func:`~fedjx.algorithms.attacks.identity`, or a backdoor's ``boost``)."""
  attack = built(config)
  if attack is None:
    return attacks.identity()
  return attack.attack if isinstance(attack, parts.Poisoning) else attack


def algorithm_spec(config: Any, spec: Any, num_clients: int) -> Any:
  """``spec`` (``config.algorithm``, as the privacy plan left it) with the
  attacked aggregator, or ``spec`` itself without an attack."""
  if not is_attacked(config):
    return spec
  name, kwargs = registry.split_name('algorithm', spec)
  if 'aggregator' not in registry.builder_options(name):
    raise ConfigError(f'config.attack.name={_attack(config)["name"]!r}: '
                      f'algorithm {name!r} takes no aggregator, which the attack '
                      'wraps; use one that does (e.g. fedavg, fedadam, '
                      'scaffold, diloco).')
  inner = kwargs.get('aggregator')
  try:
    aggregator = attacks.attacked(
        None if inner is None else parts.build_aggregator(inner),
        model_attack(config), malicious(config, num_clients), num_clients)
  except ValueError as e:
    raise ConfigError(f'config.attack: {e}') from None
  return dict(kwargs, name=name, aggregator=aggregator)


def with_success_rate(config: Any, model: Any, data: Any,
                      evaluate: Callable[[Any], dict[str, float]] | None
                      ) -> Callable[[Any], dict[str, float]] | None:
  """``evaluate`` plus ``eval_attack_success_rate`` for data poisoning.

  The success rate is the model's accuracy on the attack's held-out set
  (:func:`fedjx.datasets.poisoning.triggered_examples` or
  :func:`~fedjx.datasets.poisoning.flipped_examples` of the pooled test
  examples), whose labels are the attacker's.
  """
  if evaluate is None:
    return evaluate
  poison = _poisoning(config)
  if poison is None:
    return evaluate
  name = poison.name
  examples = evaluation.pool_examples(data.test, config.eval_max_examples)
  held_out = poison.held_out(examples, _num_classes(data, name))
  if held_out is None:
    return evaluate
  success = evaluation.make_evaluator(model, held_out, config.eval_batch_size)

  def evaluate_attacked(params: Any) -> dict[str, float]:
    out = evaluate(params)
    rates = success(params)
    if 'eval_accuracy' not in rates:
      raise ConfigError(f'config.attack.name={name!r}: the model reports no '
                        'accuracy, from which the attack success rate is read.')
    out[SUCCESS_METRIC] = rates['eval_accuracy']
    return out

  return evaluate_attacked
