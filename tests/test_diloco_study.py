"""The DiLoCo equal-compute study: its config's arms and its summary script."""

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

from config_files import load

from fedjx.experiments import metrics_writers

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG = REPO / 'configs' / 'diloco_text_equal_compute.py'


def _study():
  spec = importlib.util.spec_from_file_location(
      '_diloco_study', REPO / 'scripts' / 'diloco_study.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _compute(config):
  steps = config.rounds * config.local_steps
  return steps, steps * config.cohort_size * config.batch_size


@pytest.mark.parametrize('h', ['16', '50', '125', '250', '500'])
def test_every_arm_takes_the_same_steps_over_the_same_examples(h):
  dp, diloco = load(CONFIG, 'dp'), load(CONFIG, h)
  assert _compute(diloco) == _compute(dp)
  assert diloco.local_steps == int(h) and diloco.rounds == 2000 // int(h)
  assert dp.batch_size == diloco.cohort_size * diloco.batch_size
  assert dp.cohort_size == 1
  assert dp.algorithm.outer_optimizer.to_dict() == dict(
      name='sgd', learning_rate=1.0, momentum=0.0, nesterov=True)


@pytest.mark.parametrize('arg', ['17', '0', 'fast'])
def test_a_bad_arm_is_one_line_naming_it(arg):
  with pytest.raises(ValueError, match=f'{arg}') as e:
    load(CONFIG, arg)
  assert '\n' not in str(e.value)


def _trial(sweep_dir, name, *, seed, rounds, steps, replicas, batch, inner_lr,
           outer_lr, momentum, evals):
  """A trial directory as fedjx-sweep writes it: config.json and metrics."""
  path = os.path.join(sweep_dir, 'trials', name)
  os.makedirs(path)
  config = dict(seed=seed, rounds=rounds, local_steps=steps, cohort_size=replicas,
                batch_size=batch,
                algorithm=dict(name='diloco',
                               inner_optimizer=dict(name='adamw', learning_rate=inner_lr),
                               outer_optimizer=dict(name='sgd', learning_rate=outer_lr,
                                                    momentum=momentum)))
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(config, f)
  writer = metrics_writers.make_writer(path, tensorboard=False)
  for r, loss in evals:
    writer.write(r, {'eval_loss': loss})
  writer.close()


def test_the_summary_on_a_small_study(tmp_path):
  """T = 8 steps, K = 2, B = 2: data-parallel (batch 4, evaluated every 2
  steps, two learning rates) against DiLoCo H = 4 (two outer settings)."""
  study = _study()
  rng = np.random.default_rng(0)
  dp_curves = {}
  for lr in (0.1, 0.2):
    for seed in (0, 1, 2):
      losses = np.sort(rng.uniform(1.0, 3.0, 4))[::-1] + (0.5 if lr == 0.2 else 0.0)
      dp_curves[lr, seed] = losses
      _trial(tmp_path / 'diloco_dp', f'lr={lr},seed={seed}', seed=seed, rounds=4,
             steps=2, replicas=1, batch=4, inner_lr=lr, outer_lr=1.0, momentum=0.0,
             evals=[(0, 6.0)] + list(zip((1, 2, 3, 4), losses.tolist())))
  finals = {}
  for lr, momentum in ((0.7, 0.9), (1.0, 0.0)):
    for seed in (0, 1, 2):
      finals[lr, seed] = float(rng.uniform(1.0, 3.0))
      _trial(tmp_path / 'diloco_h4', f'lr={lr},seed={seed}', seed=seed, rounds=2,
             steps=4, replicas=2, batch=2, inner_lr=0.1, outer_lr=lr,
             momentum=momentum, evals=[(0, 6.0), (2, finals[lr, seed])])
  out = tmp_path / 'docs' / 'diloco_small'
  study.main([str(tmp_path), '--out', str(out)])

  rows = [json.loads(line) for line in open(str(out) + '.jsonl')]
  assert len(rows) == 4 and os.path.getsize(str(out) + '.png') > 0
  dp_rows = [r for r in rows if r['arm'] == 'data-parallel']
  diloco_rows = [r for r in rows if r['arm'] == 'DiLoCo']
  for row in dp_rows:
    finals_dp = np.array([dp_curves[row['inner_lr'], s][-1] for s in (0, 1, 2)])
    # Three float64 additions: a few ulps of 2**-52.
    np.testing.assert_allclose(row['mean'], finals_dp.mean(), rtol=1e-14)
    np.testing.assert_allclose(row['sd'], finals_dp.std(ddof=1), rtol=1e-12)
    assert row['communications'] == 8 and row['examples'] == 32
    assert row['eval_steps'] == [0, 2, 4, 6, 8]
  for row in diloco_rows:
    values = np.array([finals[row['outer_lr'], s] for s in (0, 1, 2)])
    np.testing.assert_allclose(row['mean'], values.mean(), rtol=1e-14)
    assert row['communications'] == 2 and row['examples'] == 32
  # The lower learning rate's curves are 0.5 lower everywhere: it is best.
  assert [r['best_tuned'] for r in dp_rows] == [True, False]
  best_h = min(diloco_rows, key=lambda r: r['mean'])
  assert best_h['best_tuned'] and sum(r['best_tuned'] for r in diloco_rows) == 1

  # Steps for the best data-parallel setting to reach DiLoCo's final loss,
  # seed by seed, computed here from the curves.
  collected = study.collect(str(tmp_path))
  best_dilo = study.best(collected['by_h'][4])
  expected = []
  for seed, final in zip(best_dilo['seeds'], best_dilo['final_eval_loss']):
    hits = [2 * (i + 1) for i, v in enumerate(dp_curves[0.1, seed]) if v <= final]
    expected.append(hits[0] if hits else None)
  assert study.equal_loss(best_dilo, study.best(collected['dp'])) == expected
  table = study.tables(collected)
  assert '| DiLoCo | 4 |' in table and 'H=4' in table


def test_unequal_compute_is_refused_in_one_line(tmp_path):
  study = _study()
  _trial(tmp_path / 'diloco_dp', 'a', seed=0, rounds=4, steps=2, replicas=1,
         batch=4, inner_lr=0.1, outer_lr=1.0, momentum=0.0, evals=[(4, 1.0)])
  _trial(tmp_path / 'diloco_h4', 'a', seed=0, rounds=2, steps=4, replicas=2,
         batch=4, inner_lr=0.1, outer_lr=1.0, momentum=0.0, evals=[(2, 1.0)])
  with pytest.raises(ValueError, match='H=4: DiLoCo takes 8 steps over 64 examples') as e:
    study.collect(str(tmp_path))
  assert '\n' not in str(e.value)
