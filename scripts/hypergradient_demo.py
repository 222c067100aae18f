"""Hypergradient descent recovers a server learning rate 100x too small.

FedAvg with an SGD server optimizer trains a softmax regression on the
federated digits (50 clients, Dirichlet alpha = 0.5; 10 clients a round, 5
local SGD steps of 10 examples, client learning rate 0.3). Three runs:

* well-tuned: the server learning rate with the lowest final test loss of a
  grid; its final test loss (mean of the last 10 rounds) is the target;
* too small: that learning rate / 100, untuned;
* tuned: the same too-small start wrapped by
  ``fedjx.algorithms.hypergradient_tuner`` (Adam on the log learning rate,
  forward-mode tangents carried across rounds with decay 0.99).

Prints one JSON line per run (rounds to reach the target: the first round
whose 5-round moving average of the test loss is at or below it), and writes
the tuned learning-rate trajectory to ``<workdir>/tuner_lr_trajectory.png``
(``--workdir``, default ``runs/hypergradient_demo``) or to ``--plot``. The
figure in the docs was made with ``--plot benchmarks/results/tuner_lr_trajectory.png``;
nothing tracked is written unless asked.

  python scripts/hypergradient_demo.py --rounds 150 --workdir runs/hg_demo
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjx import algorithms
from fedjx import datasets


def loss_fn(params, batch):
  logits = batch['x'].reshape(batch['x'].shape[0], -1) @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def make_cohorts(train, rounds, cohort_size, batch_size, steps, seed):
  sampler = datasets.CohortSampler(train, cohort_size, seed=seed)
  return [datasets.make_cohort(train, sampler.sample(r), batch_size,
                               num_steps=steps, shuffle_seed=seed, round_num=r)
          for r in range(rounds)]


def run(algo, params, cohorts, test_loss):
  state = algo.init(params)
  losses, lrs = [], []
  key = jax.random.key(0)
  for r, cohort in enumerate(cohorts):
    state, metrics = algo.round(state, cohort, jax.random.fold_in(key, r))
    losses.append(float(test_loss(state.params)))
    lrs.append(float(state.hparams['server_optimizer']['learning_rate']))
  return np.asarray(losses), np.asarray(lrs)


def rounds_to_target(losses, target, window=5):
  smooth = np.convolve(losses, np.ones(window) / window, mode='valid')
  hit = np.nonzero(smooth <= target)[0]
  return int(hit[0]) + window if hit.size else None


def parse_args(argv=None):
  """The command line; ``--plot`` defaults to ``<workdir>/tuner_lr_trajectory.png``."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=150,
                      help='rounds of the well-tuned run (the others run 2x).')
  parser.add_argument('--grid', type=float, nargs='+', default=[0.3, 1.0, 3.0, 10.0])
  parser.add_argument('--client_learning_rate', type=float, default=0.3)
  parser.add_argument('--hyper_learning_rate', type=float, default=0.1)
  parser.add_argument('--horizon_decay', type=float, default=0.99)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--workdir', default=os.path.join('runs', 'hypergradient_demo'),
                      help='where the plot goes unless --plot is given.')
  parser.add_argument('--plot', default=None,
                      help='path of the plot (default <workdir>/tuner_lr_trajectory.png).')
  args = parser.parse_args(argv)
  if args.plot is None:
    args.plot = os.path.join(args.workdir, 'tuner_lr_trajectory.png')
  return args


def main():
  args = parse_args()

  train, test = datasets.load_digits(num_clients=50, alpha=0.5, seed=args.seed)
  test = jax.tree.map(jnp.asarray, test)
  test_loss = jax.jit(lambda p: jnp.mean(loss_fn(p, test)))
  cohorts = make_cohorts(train, 2 * args.rounds, 10, 10, 5, args.seed)
  params = {'w': jnp.zeros((64, 10)), 'b': jnp.zeros(10)}
  client = algorithms.base.default_sgd(args.client_learning_rate)

  def fedavg(server_lr):
    return algorithms.fedavg(loss_fn, client_optimizer=client, local_steps=5,
                             server_optimizer=algorithms.base.default_sgd(server_lr))

  start = time.time()
  grid = {lr: run(fedavg(lr), params, cohorts[:args.rounds], test_loss)[0]
          for lr in args.grid}
  best = min(grid, key=lambda lr: grid[lr][-10:].mean())
  target = float(grid[best][-10:].mean())
  small = best / 100
  untuned, _ = run(fedavg(small), params, cohorts, test_loss)
  tuner = algorithms.hypergradient_tuner(
      fedavg(small), loss_fn, tune='server_optimizer/learning_rate',
      hyper_learning_rate=args.hyper_learning_rate,
      horizon_decay=args.horizon_decay)
  tuned, lrs = run(tuner, params, cohorts, test_loss)

  rows = [
      dict(run='well_tuned', server_learning_rate=best,
           rounds_to_target=rounds_to_target(grid[best], target),
           final_test_loss=float(grid[best][-1])),
      dict(run='too_small_untuned', server_learning_rate=small,
           rounds_to_target=rounds_to_target(untuned, target),
           final_test_loss=float(untuned[-1])),
      dict(run='too_small_tuner', server_learning_rate=small,
           rounds_to_target=rounds_to_target(tuned, target),
           final_test_loss=float(tuned[-1]), final_learning_rate=float(lrs[-1])),
  ]
  for row in rows:
    print(json.dumps(dict(row, target_test_loss=target, rounds_run=(
        args.rounds if row['run'] == 'well_tuned' else 2 * args.rounds))))
  print(json.dumps(dict(client_learning_rate=args.client_learning_rate,
                        horizon_decay=args.horizon_decay,
                        hyper_learning_rate=args.hyper_learning_rate,
                        grid={str(k): float(v[-10:].mean()) for k, v in grid.items()},
                        seconds=round(time.time() - start, 1))))

  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.8))
  r = np.arange(1, 2 * args.rounds + 1)
  ax0.semilogy(r, lrs, label='hypergradient tuner')
  ax0.axhline(best, color='k', ls='--', lw=1, label=f'well-tuned ({best:g})')
  ax0.axhline(small, color='gray', ls=':', lw=1, label=f'start ({small:g})')
  ax0.set_xlabel('round')
  ax0.set_ylabel('server learning rate')
  ax0.legend()
  ax1.plot(np.arange(1, args.rounds + 1), grid[best], label='well-tuned')
  ax1.plot(r, untuned, label='100x too small')
  ax1.plot(r, tuned, label='100x too small + tuner')
  ax1.axhline(target, color='k', ls='--', lw=1, label='target')
  ax1.set_xlabel('round')
  ax1.set_ylabel('test loss')
  ax1.legend()
  fig.suptitle('FedAvg on federated digits: hypergradient descent on the '
               'server learning rate')
  fig.tight_layout()
  os.makedirs(os.path.dirname(args.plot) or '.', exist_ok=True)
  fig.savefig(args.plot, dpi=120)


if __name__ == '__main__':
  main()
