"""The personalization study: per-client held-out accuracy of global and personal models.

On two label-skewed populations,

* ``digits``: scikit-learn's digits over 30 clients, Dirichlet(0.3) label
  skew (``fedjx.datasets.load_digits``);
* ``synthetic``: Synthetic(1, 1) of FedProx, 30 clients of at most 200
  examples, each labelled by its own softmax model (label skew by
  construction);

each client's examples are split 75/25 into its training and held-out
splits (``fedjx.datasets.client_splits``). For each seed, the same MLP
(one hidden layer of 64) is trained for ``--rounds`` rounds of 10 clients
(batch 10, one local epoch, client SGD 0.1) by FedAvg, FedRep, Ditto and
APFL, and every client is evaluated on its held-out split
(``fedjx.experiments.personalization``): the global model ("before") and the
method's personal model ("after"): FedAvg fine-tuned for ``--fine_tune_epochs``
epochs of the client's training split, FedRep's body with the client's head,
Ditto's personal ``v_k``, APFL's mixture. Writes

* ``<out>.jsonl``: one line per (dataset, seed, method): the statistics of
  the per-client accuracies before and after, and the per-client values;
* ``<out>.png``: per-client held-out accuracy after, pooled over seeds (one
  box per method, FedAvg's global model first);

and prints a Markdown table (means over seeds of mean, p10, worst 10%).

  python scripts/personalization_study.py --seeds 0,1,2 --rounds 30 \\
      --out benchmarks/results/personalization
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import optax

import fedjx
from fedjx import algorithms, datasets, models
from fedjx.experiments import personalization

NUM_CLIENTS, COHORT, BATCH, LR = 30, 10, 10, 0.1
METHODS = ('fedavg', 'fedavg+fine_tune', 'fedrep', 'ditto', 'apfl')
LABELS = {'fedavg': 'FedAvg (global model)', 'fedavg+fine_tune': 'FedAvg + fine-tuning',
          'fedrep': 'FedRep', 'ditto': 'Ditto', 'apfl': 'APFL'}


def population(name: str, seed: int) -> datasets.FederatedDataset:
  if name == 'digits':
    return datasets.load_digits(num_clients=NUM_CLIENTS, alpha=0.3, seed=seed,
                                test_fraction=0.0)[0]
  return datasets.synthetic(1.0, 1.0, num_clients=NUM_CLIENTS, seed=seed,
                            max_examples=200)


def personalize_fns(model: models.Model, fine_tune_epochs: int) -> dict:
  return {
      'fedavg': None,
      'fedavg+fine_tune': personalization.fine_tune(
          model.loss_fn, optax.sgd(LR), epochs=fine_tune_epochs),
      'fedrep': algorithms.fedrep_personalize_fn(model.loss_fn, 'logits'),
      'ditto': algorithms.ditto_personalize_fn(),
      'apfl': algorithms.apfl_personalize_fn(),
  }


def train(algo, params, splits, rounds: int, seed: int):
  """``rounds`` rounds of ``algo`` on ``splits.train``; (state, store or None)."""
  algo = algo.compile(donate=False)
  state = algo.init(params)
  store = None
  if algo.client_state_init is not None:
    initial = jax.tree.map(np.asarray, jax.device_get(algo.client_state_init(params)))
    store = fedjx.ClientStore(initial, splits.train.num_clients)
  sampler = datasets.CohortSampler(splits.train, COHORT, seed)
  key = jax.random.key(seed)
  for r in range(rounds):
    cohort = datasets.make_cohort(splits.train, sampler.sample(r), BATCH,
                                  num_epochs=1, shuffle_seed=seed, round_num=r)
    if store is not None:
      cohort = cohort._replace(client_states=store.read(cohort.client_ids))
    out = algo.round(state, datasets.place_cohort(cohort), jax.random.fold_in(key, r))
    state = out[0]
    if store is not None:
      store.write(cohort.client_ids, jax.tree.map(np.asarray, jax.device_get(out[2])))
  return state, store


def run(dataset: str, seed: int, rounds: int, fine_tune_epochs: int) -> list[dict]:
  splits = datasets.client_splits(population(dataset, seed), test_fraction=0.25,
                                  seed=seed)
  model = models.mlp(10, hidden=(64,))
  sample = {k: v[:BATCH] for k, v in splits.train.client_data(0).items()}
  params = model.init(jax.random.key(seed), sample)
  loss = model.loss_fn
  sgd = optax.sgd(LR)
  algos = {'fedavg': algorithms.fedavg(loss, client_optimizer=sgd),
           'fedrep': algorithms.fedrep(loss, 'logits', head_epochs=5,
                                       client_optimizer=sgd),
           'ditto': algorithms.ditto(loss, lam=0.1, client_optimizer=sgd),
           'apfl': algorithms.apfl(loss, client_optimizer=sgd)}
  fns = personalize_fns(model, fine_tune_epochs)
  lines = []
  for name, algo in algos.items():
    t = time.time()
    state, store = train(algo, params, splits, rounds, seed)
    seconds = time.time() - t
    for method in [m for m in METHODS if m.split('+')[0] == name]:
      t = time.time()
      fn = fns[method] or (lambda s, row, d: s.params)
      result = personalization.personalization_eval(
          fn, state, model, splits.train, splits.test, batch_size=BATCH,
          client_states=store, cohort_size=COHORT)
      before = personalization.distribution(result.global_['accuracy'])
      after = personalization.distribution(result.personal['accuracy'])
      lines.append(dict(dataset=dataset, seed=seed, method=method, rounds=rounds,
                        before=before, after=after,
                        train_seconds=round(seconds, 1),
                        eval_seconds=round(time.time() - t, 1),
                        accuracy_before=result.global_['accuracy'].round(4).tolist(),
                        accuracy_after=result.personal['accuracy'].round(4).tolist()))
      print(json.dumps({k: v for k, v in lines[-1].items()
                        if not k.startswith('accuracy')}), flush=True)
  return lines


def table(lines: list[dict]) -> str:
  rows = ['| dataset | method | global mean | global p10 | global worst 10% | '
          'personal mean | personal p10 | personal worst 10% |',
          '|---|---|---|---|---|---|---|---|']
  for dataset in dict.fromkeys(l['dataset'] for l in lines):
    for method in METHODS:
      sel = [l for l in lines if l['dataset'] == dataset and l['method'] == method]
      if not sel:
        continue
      cell = lambda side, k: (f"{np.mean([l[side][k] for l in sel]):.3f} "
                              f"± {np.std([l[side][k] for l in sel]):.3f}")
      rows.append(f'| {dataset} | {LABELS[method]} | ' + ' | '.join(
          cell(s, k) for s in ('before', 'after') for k in ('mean', 'p10', 'worst10'))
                  + ' |')
  return '\n'.join(rows)


def plot(lines: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = list(dict.fromkeys(l['dataset'] for l in lines))
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.4),
                           squeeze=False)
  for ax, dataset in zip(axes[0], names):
    data, labels = [], []
    for method in METHODS:
      sel = [l for l in lines if l['dataset'] == dataset and l['method'] == method]
      if sel:
        data.append(np.concatenate([l['accuracy_after'] for l in sel]))
        labels.append(LABELS[method].replace(' (global model)', '\n(global)')
                      .replace(' + ', '\n+ '))
    ax.boxplot(data, whis=(10, 90), showmeans=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
    ax.set_title(f'{dataset}: per-client held-out accuracy', fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=80)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--datasets', default='digits,synthetic')
  parser.add_argument('--rounds', type=int, default=30)
  parser.add_argument('--fine_tune_epochs', type=int, default=5)
  parser.add_argument('--out', default='benchmarks/results/personalization')
  args = parser.parse_args()
  lines = []
  for dataset in args.datasets.split(','):
    for seed in [int(s) for s in args.seeds.split(',')]:
      lines.extend(run(dataset, seed, args.rounds, args.fine_tune_epochs))
  with open(args.out + '.jsonl', 'w', encoding='utf-8') as f:
    for line in lines:
      f.write(json.dumps(line) + '\n')
  plot(lines, args.out + '.png')
  print(table(lines))


if __name__ == '__main__':
  main()
