"""Wrappers keep every trait of what they wrap.

An algorithm's traits (its :class:`fedjx.algorithms.traits.Traits` record,
and its per-client state ``client_state_init``) and an aggregator's (its
``traits`` record, ``weights`` and ``message_bytes``) say what it is; every
wrapper builds its result from the wrapped value (``_replace``), so each is
the wrapped one's, and a scheduled algorithm with per-client state still
runs as one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.privacy import accounting
from fedjx.algorithms.aggregators import core as aggregators
from fedjx.algorithms import attacks
from fedjx.algorithms import base
from fedjx.algorithms.privacy import audit as privacy_audit
from fedjx.experiments import guarded_rounds
from fedjx.experiments import parts
from client_rows import Rows, run_round
from test_algorithms_util import (KEY, assert_trees_close, linreg_data,
                                  linreg_loss, linreg_params, make_cohort)

# Algorithms whose traits differ from the defaults, and FedAvg's defaults.
ALGORITHMS = {
    'ditto': lambda: algos.ditto(linreg_loss, lam=0.5),  # client_state_init
    'fedexp': lambda: algos.fedexp(linreg_loss),         # unprivatized
    'fedavg': lambda: algos.fedavg(linreg_loss),
}
SCHEDULE = {'client_optimizer/learning_rate': 0.1}
# Each wrapper of an algorithm, for the algorithms it takes.
WRAPPERS = {
    'scheduled': lambda a: algos.scheduled(a, SCHEDULE),
    'scheduled, compiled': lambda a: algos.scheduled(a, SCHEDULE).compile('vmap'),
    'checking_finiteness': guarded_rounds.checking_finiteness,
    'hypergradient_tuner': lambda a: algos.hypergradient_tuner(
        a, linreg_loss, tune='client_optimizer/learning_rate'),
}


def assert_same_traits(wrapped, inner, traits):
  for trait in traits:
    assert getattr(wrapped, trait) is getattr(inner, trait), trait


# What declares an algorithm and an aggregator, beside their steps.
ALGORITHM_TRAITS = ('client_state_init', 'traits')
AGGREGATOR_TRAITS = ('weights', 'message_bytes', 'traits')


def test_the_trait_fields_are_fields():
  assert set(ALGORITHM_TRAITS) <= set(base.Algorithm._fields)
  assert set(AGGREGATOR_TRAITS) <= set(aggregators.Aggregator._fields)


@pytest.mark.parametrize('algorithm', sorted(ALGORITHMS))
@pytest.mark.parametrize('wrapper', sorted(WRAPPERS))
def test_algorithm_wrappers_keep_every_trait(wrapper, algorithm):
  inner = ALGORITHMS[algorithm]()
  if wrapper == 'hypergradient_tuner' and inner.client_state_init is not None:
    with pytest.raises(ValueError) as e:  # Its derivative carries no rows.
      WRAPPERS[wrapper](inner)
    assert '\n' not in str(e.value)
    assert 'algo.client_state_init is set' in str(e.value)
    return
  assert_same_traits(WRAPPERS[wrapper](inner), inner, ALGORITHM_TRAITS)


def test_a_scheduled_algorithm_with_client_state_runs_as_one():
  """scheduled(ditto) with ditto's own client learning rate gives ditto's
  round: the same server model and the same clients' rows."""
  population = linreg_data(np.random.default_rng(8), [5, 3, 4], shift=2.0)
  cohort = make_cohort(population, 2, client_ids=[0, 2, 1])
  inner = algos.ditto(linreg_loss, lam=0.5, client_optimizer=algos.default_sgd(0.1))
  outer = algos.scheduled(inner, SCHEDULE)
  out = []
  for algo in (inner, outer):
    rows = Rows(algo.client_state_init(linreg_params()))
    state = algo.init(linreg_params())
    state, metrics, new_rows = run_round(algo, state, cohort, rows, KEY)
    out.append((state.params, new_rows))
  assert float(metrics['hparam/client_optimizer/learning_rate']) == \
      pytest.approx(0.1, rel=2 ** -24)
  # The same float32 program but for the scheduled write of an equal value.
  assert_trees_close(out[1], out[0], n=1)
  with pytest.raises(ValueError, match='run_rounds is not available'):
    outer.run_rounds(outer.init(linreg_params()),
                     jax.tree.map(lambda x: x[None], cohort), KEY[None])


# Aggregators whose traits differ from the defaults.
AGGREGATOR_SPECS = {
    'gaussian': dict(name='gaussian'),  # weights, checks_update, privacy
    'qsgd': dict(name='qsgd'),  # message_bytes, wire_bits
    'krum': dict(name='krum', num_byzantine=1),  # needs_all_updates
    'distributed_skellam': dict(name='distributed_skellam'),
    'mean': dict(name='mean'),
}
CANARIES = privacy_audit.Canaries(10, accounting.Sampling('uniform', 50, 10), 0)
AGGREGATOR_WRAPPERS = {
    'attacked': lambda a: attacks.attacked(a, attacks.sign_flip(), [1], 5),
    'with_canaries': lambda a: privacy_audit.with_canaries(
        a, CANARIES, clip_norm=lambda state, hp: jnp.float32(1.0),
        expected_clients_per_round=None),
}


@pytest.mark.parametrize('aggregator', sorted(AGGREGATOR_SPECS))
@pytest.mark.parametrize('wrapper', sorted(AGGREGATOR_WRAPPERS))
def test_aggregator_wrappers_keep_every_trait(wrapper, aggregator):
  inner = parts.build_aggregator(AGGREGATOR_SPECS[aggregator])
  assert_same_traits(AGGREGATOR_WRAPPERS[wrapper](inner), inner,
                     AGGREGATOR_TRAITS)


def test_dp_defense_keeps_the_defenses_traits_and_declares_its_own():
  inner = parts.build_aggregator(AGGREGATOR_SPECS['krum'])
  wrapped = parts.build_aggregator(dict(name='dp_defense', defense=inner))
  assert_same_traits(wrapped, inner, ('weights', 'message_bytes'))
  assert wrapped.traits == inner.traits._replace(
      checks_update=True, privacy=wrapped.traits.privacy)
  assert wrapped.traits.needs_all_updates == inner.traits.needs_all_updates
  assert str(wrapped.traits.privacy) == 'dp_defense (central DP)'
