"""Small comparisons of q-FFL, AFL and FedAsync against their baselines on digits.

  python scripts/fairness_study.py --workdir runs/fairness qffl afl fedasync

* ``qffl``: q-FFL (``configs/qffl_digits.py``, q in {0.1, 1, 5}) against
  FedAvg at server learning rate 1 (q = 0) and at its tuned 2
  (``configs/fedavg_digits.py``), every client holding out 20% of its
  examples; after the last round, each client's accuracy on its own
  held-out examples: mean over clients, worst 10% of clients (mean of the
  lowest tenth), best 10%, variance (Li et al. 2020 report the variance of
  the clients' accuracies).
* ``afl``: AFL (``configs/afl_digits.py``, classes as domains,
  exponentiated-gradient rate in {0.01, 0.03, 0.1}) against FedAvg
  (``configs/fedavg_digits.py``); on the central test split, the loss and
  accuracy of every class: the worst class's loss (AFL's objective), the
  worst class's accuracy, and the averages.
* ``fedasync``: FedAsync (``configs/fedasync_digits.py``) against FedBuff
  (``configs/fedbuff_digits.py``) on the same simulated schedule (30
  clients training at once, log-normal job times), FedBuff stepping every 10
  arrivals and FedAsync at every arrival, for the same number of client
  updates; the held-out accuracy at equal simulated time. ``fedjx-sweep``
  refuses asynchronous algorithms, so these are separate runs.

The synchronous ones run as sweeps
(``fedjx.experiments.sweeps.run.run_sweep``, the engine of ``fedjx-sweep``;
every trial of a grid in one compiled program), seeds 0, 1, 2; each trial's
final state is read back with ``run.load_trial_state``. Prints one JSON line
per trial and a markdown table per study (mean ± sample sd over seeds),
written to ``WORKDIR/<study>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(os.path.dirname(HERE), 'configs')
SEEDS = (0, 1, 2)
COMMON = dict(progress=False, tensorboard=False)


def _config(name: str, **overrides):
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = os.path.join(CONFIGS, f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'_study_{name}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for key, value in {**COMMON, **overrides}.items():
    target = config
    *parents, leaf = key.split('.')
    for p in parents:
      target = target[p]
    target[leaf] = value
  return config


def _sweep(workdir, config, settings):
  from fedjx.experiments.sweeps import run  # pylint: disable=g-import-not-at-top
  result = run.run_sweep(config, workdir, settings, SEEDS)
  out = []
  for trial in result.trials:
    state, _ = run.load_trial_state(workdir, trial.name)
    with open(os.path.join(workdir, 'trials', trial.name, 'config.json')) as f:
      out.append((trial.name, json.load(f), state.params))
  return out


def _per_example(config, params, examples):
  """Per-example loss and accuracy of ``params`` on ``examples`` (host arrays)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fedjx.experiments import registry  # pylint: disable=g-import-not-at-top
  model = registry.build_model(config['model'], {'num_classes': 10})
  fn = jax.jit(lambda p, b: (model.loss_fn(p, b), model.metrics_fn(p, b)['accuracy']))
  loss, acc = fn(params, {k: jnp.asarray(v) for k, v in examples.items()})
  return np.asarray(loss, np.float64), np.asarray(acc, np.float64)


def _stats(rows, keys):
  """``mean ± sd`` over seeds of each key, by setting."""
  by = {}
  for r in rows:
    by.setdefault(r['setting'], []).append(r)
  lines = []
  for setting, rs in by.items():
    cells = []
    for k in keys:
      v = np.array([r[k] for r in rs], np.float64)
      cells.append(f'{v.mean():.4f} ± {v.std(ddof=1):.4f}' if len(v) > 1
                   else f'{v.mean():.4f}')
    lines.append(f'| {setting} | {len(rs)} | ' + ' | '.join(cells) + ' |')
  return lines


def _write(workdir, study, header, keys, rows):
  table = (['| setting | seeds | ' + ' | '.join(header) + ' |',
            '|---|---|' + '---|' * len(header)] + _stats(rows, keys))
  text = '\n'.join(table) + '\n'
  with open(os.path.join(workdir, f'{study}.md'), 'w') as f:
    f.write(text)
  print(text)


def qffl(workdir, rounds=100):
  from fedjx.experiments import registry  # pylint: disable=g-import-not-at-top
  runs = _sweep(os.path.join(workdir, 'qffl'),
                _config('qffl_digits', rounds=rounds, eval_every=10),
                [{'algorithm.q': q} for q in (0.0, 0.1, 1.0, 5.0)])
  runs += _sweep(os.path.join(workdir, 'qffl_fedavg'),
                 _config('fedavg_digits', rounds=rounds, eval_every=10,
                         **{'dataset.client_test_fraction': 0.2}), [{}])
  rows = []
  for name, config, params in runs:
    data = registry.build_dataset(config['dataset'], config['seed'])
    test = data.test
    parts = [test.client_data(c) for c in range(test.num_clients)]
    sizes = np.array([len(p['y']) for p in parts])
    examples = {k: np.concatenate([p[k] for p in parts]) for k in ('x', 'y')}
    _, acc = _per_example(config, params, examples)
    owner = np.repeat(np.arange(len(parts)), sizes)
    per_client = (np.bincount(owner, acc, len(parts))[sizes > 0]
                  / sizes[sizes > 0])
    order = np.sort(per_client)
    tenth = max(1, int(round(0.1 * len(order))))
    algo = config['algorithm']
    setting = (f"q-FFL q={algo['q']:g}" if algo['name'] == 'qffl' else
               f"FedAvg server lr {algo['server_optimizer']['learning_rate']:g}")
    row = dict(study='qffl', trial=name, setting=setting, seed=config['seed'],
               mean=float(per_client.mean()), worst10=float(order[:tenth].mean()),
               best10=float(order[-tenth:].mean()),
               variance=float(per_client.var()), pooled=float(acc.mean()))
    print(json.dumps(row), flush=True)
    rows.append(row)
  _write(workdir, 'qffl', ['mean client accuracy', 'worst 10%', 'best 10%',
                           'variance', 'pooled accuracy'],
         ['mean', 'worst10', 'best10', 'variance', 'pooled'], rows)


def afl(workdir, rounds=100):
  from fedjx.experiments import registry  # pylint: disable=g-import-not-at-top
  runs = _sweep(os.path.join(workdir, 'afl'),
                _config('afl_digits', rounds=rounds, eval_every=10),
                [{'algorithm.domain_learning_rate': r} for r in (0.01, 0.03, 0.1)])
  runs += _sweep(os.path.join(workdir, 'afl_fedavg'),
                 _config('fedavg_digits', rounds=rounds, eval_every=10), [{}])
  rows = []
  for name, config, params in runs:
    test = registry.build_dataset(config['dataset'], config['seed']).test
    loss, acc = _per_example(config, params, test)
    y = np.asarray(test['y'])
    count = np.bincount(y, minlength=10)
    class_loss = np.bincount(y, loss, 10) / count
    class_acc = np.bincount(y, acc, 10) / count
    algo = config['algorithm']
    setting = (f"AFL eta_lambda={algo['domain_learning_rate']:g}"
               if algo['name'] == 'afl' else 'FedAvg')
    row = dict(study='afl', trial=name, setting=setting, seed=config['seed'],
               worst_class_loss=float(class_loss.max()),
               worst_class_accuracy=float(class_acc.min()),
               mean_class_loss=float(class_loss.mean()), accuracy=float(acc.mean()))
    print(json.dumps(row), flush=True)
    rows.append(row)
  _write(workdir, 'afl', ['worst-class loss', 'worst-class accuracy',
                          'mean class loss', 'accuracy'],
         ['worst_class_loss', 'worst_class_accuracy', 'mean_class_loss',
          'accuracy'], rows)


def fedasync(workdir, arrivals=3000):
  from fedjx.experiments import runner  # pylint: disable=g-import-not-at-top
  histories = []
  for label, name, rounds, every in (('FedBuff (K = 10)', 'fedbuff_digits', arrivals // 10, 10),
                                     ('FedAsync', 'fedasync_digits', arrivals, 100)):
    for seed in SEEDS:
      config = _config(name, seed=seed, rounds=rounds, eval_every=every,
                       checkpoint_every=rounds)
      result = runner.run(config, os.path.join(workdir, 'fedasync', f'{name}_{seed}'),
                          log=lambda msg: None)
      evals = [(r['simulated_time'], r['eval_accuracy']) for r in result.history
               if 'eval_accuracy' in r and 'simulated_time' in r]
      histories.append((label, seed, evals))
  horizon = min(e[-1][0] for _, _, e in histories)
  times = [horizon * f for f in (0.25, 0.5, 1.0)]
  rows = []
  for label, seed, evals in histories:
    row = dict(study='fedasync', setting=label, seed=seed)
    for i, t in enumerate(times):
      seen = [a for s, a in evals if s <= t]
      row[f't{i}'] = seen[-1] if seen else float('nan')
    row['final_time'] = evals[-1][0]
    print(json.dumps(row), flush=True)
    rows.append(row)
  _write(workdir, 'fedasync', [f'accuracy at {t:.0f} s' for t in times] +
         ['simulated time of the last update (s)'],
         ['t0', 't1', 't2', 'final_time'], rows)


STUDIES = {'qffl': qffl, 'afl': afl, 'fedasync': fedasync}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='runs/fairness')
  parser.add_argument('--rounds', type=int, default=100,
                      help='rounds of the synchronous studies')
  parser.add_argument('--arrivals', type=int, default=3000,
                      help='client updates of each asynchronous run')
  parser.add_argument('studies', nargs='*', default=list(STUDIES),
                      choices=list(STUDIES))
  args = parser.parse_args(argv)
  os.makedirs(args.workdir, exist_ok=True)
  for study in args.studies:
    STUDIES[study](args.workdir, args.arrivals if study == 'fedasync'
                   else args.rounds)


if __name__ == '__main__':
  sys.exit(main())
