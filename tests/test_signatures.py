"""One reader of builder signatures: the config checks and the command line
read a parameter's types the same way (fedjx.experiments.signatures)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Optional

import pytest

from fedjx.experiments import cli
from fedjx.experiments import registry
from fedjx.experiments import signatures


def _builder(loss_fn, *, lr: float = 1, steps: int | None = None,
             flag: bool = False, name: str = 'a', hidden: Sequence[int] = (3,),
             maybe: Optional[float] = None, plain=0.5, untyped=None, **rest):
  del loss_fn, lr, steps, flag, name, hidden, maybe, plain, untyped, rest


PARAMS = signatures.keyword_parameters(_builder)


def test_keyword_parameters_and_accepted_kwargs():
  assert list(PARAMS) == ['loss_fn', 'lr', 'steps', 'flag', 'name', 'hidden',
                          'maybe', 'plain', 'untyped']
  names, var = signatures.accepted_kwargs(_builder)
  assert names == list(PARAMS) and var
  assert signatures.accepted_kwargs(lambda x, *, y: None) == (['x', 'y'], False)


@pytest.mark.parametrize('name, types, parsed', [
    ('lr', (float, int), float),
    ('steps', (int, type(None)), int),
    ('flag', (bool,), bool),
    ('name', (str,), str),
    ('hidden', None, None),  # Not a plain annotation: not checked, a literal.
    ('maybe', (float, type(None), int), float),
    ('plain', (float, int), float),  # From the default.
    ('untyped', None, None),
])
def test_types_from_the_annotation_else_the_default(name, types, parsed):
  assert signatures.option_types(PARAMS[name]) == types
  assert signatures.parse_type(PARAMS[name]) is parsed


def test_the_command_line_and_the_config_checks_agree():
  # What the command line parses, the config check accepts, and the reverse.
  for name, text in (('lr', '2'), ('steps', '7'), ('steps', 'None'),
                     ('flag', 'yes'), ('name', 'b'), ('hidden', '(4, 5)'),
                     ('maybe', 'None'), ('plain', '1')):
    value = cli.parse_value(text, PARAMS[name], name)
    registry.check_types('algorithm', PARAMS, {name: value})
  assert cli.parse_value('(4, 5)', PARAMS['hidden'], 'hidden') == (4, 5)
  assert isinstance(cli.parse_value('2', PARAMS['lr'], 'lr'), float)
  with pytest.raises(cli.UsageError, match='not an int'):
    cli.parse_value('2.5', PARAMS['steps'], 'steps')
  with pytest.raises(registry.ConfigError, match=r'config\.algorithm\.steps=2\.5; '
                     'it must be an int or None'):
    registry.check_types('algorithm', PARAMS, {'steps': 2.5})


def test_the_readers_are_not_copied():
  # cli and registry hold no signature reader of their own.
  for module in (cli, registry):
    for gone in ('_target_type', '_annotation_types', 'option_types',
                 'accepted_kwargs', '_keyword_parameters'):
      assert not hasattr(module, gone), (module.__name__, gone)
  assert inspect.getmodule(signatures.option_types) is signatures
