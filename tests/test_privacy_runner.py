"""The runner's privacy side: sampler from config, epsilon per round, budget, refusals."""

import json
import logging
import os
import warnings

import pytest

from fedjx import datasets
from fedjx.algorithms.privacy import accounting
from fedjx.experiments import privacy
from fedjx.experiments import registry
from fedjx.experiments import runner
from fedjx.experiments.config import with_defaults
from fedjx.experiments.config_base import base_config, optimizer


def small_config(**fields):
  """DP-FedAvg on 40 digits clients, Poisson q = 0.1, delta = 1e-3."""
  c = base_config()
  c.seed, c.rounds, c.cohort_size, c.batch_size = 3, 12, 4, 16
  c.local_epochs, c.eval_every, c.checkpoint_every = 1, 4, 4
  c.progress, c.plot, c.tensorboard = False, False, False
  c.dataset = dict(name='digits', num_clients=40, alpha=0.5)
  c.model = dict(name='logistic_regression')
  c.algorithm = dict(name='dp_fedavg', clip_norm=1.0, noise_multiplier=1.0,
                     expected_clients_per_round=4.0,
                     client_optimizer=optimizer('sgd', learning_rate=0.1))
  c.sampling = dict(name='poisson')
  c.privacy = dict(delta=1e-3)
  for key, value in fields.items():
    setattr(c, key, value)
  return c


def test_budget_stops_at_the_last_round_within_it_and_resumes_no_further(
    tmp_path, caplog):
  sampling = accounting.Sampling.poisson(40, 0.1)
  eps = [accounting.epsilon(1.0, r, 1e-3, sampling=sampling) for r in range(13)]
  target = (eps[3] + eps[4]) / 2  # rounds 1-3 fit, round 4 would not
  config = small_config(privacy=dict(delta=1e-3, target_epsilon=target))
  lines = []
  with caplog.at_level(logging.WARNING):
    result = runner.run(config, str(tmp_path), log=lines.append)
  # The RDP accountant drops orders it cannot compute without logging it.
  assert not [r for r in caplog.records
              if accounting.NOT_CONVERGED in r.getMessage()]
  assert result.step == 3 and not result.interrupted
  rows = [h for h in result.history if h['round'] > 0]
  # A fresh dp_accounting accountant per round agrees with the runner's
  # cumulative curve to float64 summation error over a few terms.
  assert [r['epsilon'] for r in rows] == pytest.approx(eps[1:4], rel=1e-12)
  bucket = privacy.make_sampler(with_defaults(config), 40).cohort_size
  assert bucket == datasets.poisson_bucket(40, 0.1)
  # Each round trained on the Poisson draw of its round, padded to the bucket.
  sampler = privacy.make_sampler(with_defaults(config), 40)
  assert [r['clients'] for r in rows] == [len(sampler.sample(r)) for r in range(3)]
  assert 'eval_accuracy' in rows[-1]  # the last round is evaluated
  assert os.path.isdir(tmp_path / 'checkpoints' / '3')  # and checkpointed
  budget = [l for l in lines if 'privacy budget' in l]
  assert budget == [
      f'fedjx: privacy budget target_epsilon={target:g} (delta=0.001) reached: '
      f'round 4 would bring epsilon to {eps[4]:.4g}; stopped after round 3 '
      f'(epsilon {eps[3]:.4g}).']
  statement = json.loads((tmp_path / 'privacy.json').read_text())
  assert statement['epsilon'] == pytest.approx(eps[3], rel=1e-12)
  assert (statement['unit'], statement['sampling'], statement['mechanism'],
          statement['accountant'], statement['delta'], statement['rounds'],
          statement['neighbouring']) == (
              'user (all the data of one client)', 'poisson', 'gaussian', 'rdp',
              1e-3, 3, 'add_or_remove_one')
  assert 'PoissonSampledDpEvent(sampling_probability=0.1' in statement['dp_event']
  detail = accounting.rdp_details(1.0, 3, 1e-3, sampling=sampling)
  assert statement['accountant_detail'] == accounting.accountant_detail(
      'rdp', 1.0, 3, 1e-3, sampling=sampling)
  assert f"epsilon from order {detail['best_order']:g}" in statement[
      'accountant_detail']
  summary = [l for l in lines if l.startswith('fedjx: privacy: (')]
  assert summary and 'add or remove one neighbours, rdp accountant' in summary[0]
  again = runner.run(config, str(tmp_path), log=lines.append)
  assert again.step == 3 and len([l for l in lines if 'privacy budget' in l]) == 2


def plan_of(population=1000, **fields):
  return privacy.plan(with_defaults(small_config(**fields)), population)


def test_plan_reads_the_mechanism_and_the_sampling():
  with pytest.warns(UserWarning) as warned:  # delta = 1e-3 = 1/N
    p = plan_of()
  assert [str(w.message) for w in warned] == [
      'config.privacy.delta=0.001 is at least 1/N = 1/1000: a mechanism that '
      "publishes one random client's data in full meets it; use delta < 1/N, "
      'e.g. None (N^-1.1 = 0.000501).']
  assert (p.mechanism.name, p.mechanism.mechanism, p.mechanism.noise_multiplier,
          p.mechanism.expected_clients_per_round, p.mechanism.restart_every) == (
              'gaussian', 'gaussian', 1.0, 4.0, None)
  assert p.sampling == accounting.Sampling.poisson(1000, 4 / 1000)
  assert p.delta == 1e-3 and p.accountant == 'rdp' and p.target_epsilon is None
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # below 1/N: no warning
    uniform = plan_of(sampling=dict(name='uniform'), privacy=dict())
  assert uniform.sampling == accounting.Sampling('uniform', 1000, 4)
  assert uniform.delta == pytest.approx(1000 ** -1.1, rel=1e-15)  # default
  tree = plan_of(sampling=dict(name='epochs'), rounds=400,
                 privacy=dict(delta=1e-4), algorithm=dict(
      name='fedavg', aggregator=dict(name='tree_gaussian', noise_multiplier=2.0,
                                     restart_every=125)))
  assert tree.mechanism.mechanism == 'tree' and tree.mechanism.restart_every == 125
  assert tree.epsilon(400) == accounting.epsilon(
      2.0, 400, tree.delta, sampling=accounting.Sampling('epochs', 1000, 4),
      mechanism='tree', restart_every=125)
  assert plan_of(algorithm=dict(name='fedavg')) is None  # no DP noise


@pytest.mark.parametrize('fields, message', [
    (dict(algorithm=dict(name='fedavg', aggregator=dict(
        name='tree_gaussian', noise_multiplier=1.0))),
     r"config: tree aggregation \(DP-FTRL\) with 'poisson' sampling has no "
     r"bound on how often a client takes part; use sampling name='epochs'"),
    (dict(algorithm=dict(name='dp_fedavg', noise_multiplier=1.0)),
     r'config: gaussian with Poisson sampling divides by the number of '
     r'participating clients, which is private and not accounted; set '
     r'expected_clients_per_round=4 \(q N\)'),
    (dict(algorithm=dict(name='fedavg', aggregator=dict(
        name='gaussian', expected_clients_per_round=10.0))),
     r"config: expected_clients_per_round=10 is not the expected cohort 4 of "
     r"'poisson' sampling"),
    (dict(sampling=dict(name='uniform'), privacy=dict(accountant='pld')),
     r"config: accountant='pld' does not model fixed-size sampling"),
    (dict(algorithm=dict(name='fedavg'), privacy=dict(target_epsilon=4.0)),
     r"config.privacy.target_epsilon=4.0 but algorithm 'fedavg' adds no DP "
     r'noise'),
])
def test_unaccountable_configs_are_refused_in_one_line(fields, message):
  with pytest.raises(registry.ConfigError, match=message) as e:
    plan_of(**fields)
  assert '\n' not in str(e.value)


def test_default_sampling_keeps_the_uniform_sampler():
  config = with_defaults(small_config(sampling=dict(name='uniform')))
  assert privacy.make_sampler(config, 20) is None  # cohort_iterator's default


@pytest.mark.slow  # 13 PLD compositions: about 20 s
def test_pld_budget_is_the_last_round_within_it():
  # PLD epsilons are computed on demand; stop_round bisects over them.
  p = plan_of(population=40, privacy=dict(delta=1e-3, accountant='pld',
                                           target_epsilon=1.0))
  eps = [p.epsilon(r) for r in range(p.rounds + 1)]
  within = [r for r in range(p.rounds + 1) if eps[r] <= 1.0]
  assert 0 < max(within) < p.rounds
  assert p.stop_round() == max(within)
  assert eps[-1] < accounting.epsilon(1.0, p.rounds, 1e-3, sampling=p.sampling)
