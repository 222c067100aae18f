"""HetLoRA's rank self-pruning inside ``fedlora`` rounds, against a replay.

Each client ``k`` of rank ``r`` (its stored rank, or its ``client_ranks``
rank the first time) trains on ``loss + lambda T(a, b)`` with plain SGD,
where ``T = sum_matrices ||a[:, t:r]||_F ||b[t:r, :]||_F`` and ``t = floor(gamma
r)``; it prunes to ``max(1, floor(gamma r))`` when ``T(trained) < T(received)``
and sends its adapters cut to the new rank; the server takes HetLoRA's
norm-weighted mean ``sum_k ||s a_k b_k|| (a_k, b_k) / sum_k ||s a_k b_k||`` per
matrix. The replay here trains each client with a hand-written JAX loop of
SGD steps (the masked mean loss of each step's real examples plus the
penalty), and does the rule and the weighted mean in float64 NumPy; the
ranks must agree exactly and the adapters to float32 rounding (SGD over a
few steps of O(1) values: 1e-5 relative, checked at 1e-4 of their scale).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.aggregators import lora as agg
from fedjx.models import adapters as trees
from fedjx.models import llama
from fedjx.models import lora
from fedjx.models.lora_config import LoraConfig
from client_rows import Rows, run_round
from test_algorithms_util import make_cohort

SIZES, BATCH, LR, LAM, GAMMA = (3, 5), 2, 0.1, 2.0, 0.5
RANK = 4


def _setup():
  model = llama.llama_lm('500k', num_layers=1, width=32, num_heads=2, num_kv_heads=2,
                         mlp_width=64)
  rng = np.random.RandomState(0)
  clients = [{'x': rng.randint(1, 256, (n, 9)).astype(np.int32)} for n in SIZES]
  first = {'x': jnp.asarray(clients[0]['x'][:2])}
  config = LoraConfig(rank=RANK, alpha=8.0)
  lm = lora.lora_model(model, config, jax.random.key(0), first)
  return lm, config, clients, lm.init(jax.random.key(1), first)


def _tail(pairs, rank):
  t = math.floor(GAMMA * rank)
  return sum(np.linalg.norm(np.asarray(p['a'], np.float64)[..., :, t:rank]) *
             np.linalg.norm(np.asarray(p['b'], np.float64)[..., t:rank, :])
             for p in pairs.values())


def _train(lm, start, client, steps):
  """SGD on the masked mean loss of each step's examples plus lambda T."""
  rank = RANK
  def objective(p, x):
    return jnp.mean(lm.loss_fn(p, {'x': x})) + LAM * agg.tail_norm(
        trees.adapter_pairs(p), rank, decay=GAMMA)
  grad = jax.jit(jax.grad(objective))
  p = start
  for s in range(steps):
    x = client['x'][s * BATCH:(s + 1) * BATCH]
    if len(x):
      p = jax.tree.map(lambda w, g: w - LR * g, p, grad(p, jnp.asarray(x)))
  return p


def _replay(lm, config, clients, global_ad, ranks):
  """One round: (new ranks, new global pairs in float64)."""
  steps = max(math.ceil(n / BATCH) for n in SIZES)
  received = agg.truncate(trees.adapter_pairs(global_ad), RANK)
  new_ranks, sent = [], []
  for client, rank in zip(clients, ranks):
    assert rank == RANK  # The first pruning round starts every client at RANK.
    trained = trees.adapter_pairs(_train(lm, trees.from_pairs(received), client, steps))
    prune = _tail(trained, rank) < _tail(received, rank)
    new = max(1, math.floor(GAMMA * rank)) if prune else rank
    new_ranks.append(new)
    sent.append({n: {'a': np.asarray(p['a'], np.float64) * (np.arange(RANK) < new),
                     'b': np.asarray(p['b'], np.float64) * (np.arange(RANK) < new)[:, None]}
                 for n, p in trained.items()})
  out = {}
  for name in sent[0]:
    norms = [np.linalg.norm(config.scale * s[name]['a'] @ s[name]['b'], axis=(-2, -1))
             for s in sent]
    total = sum(norms)
    out[name] = {k: sum(w[..., None, None] * s[name][k] for w, s in zip(norms, sent))
                 / total[..., None, None] for k in ('a', 'b')}
  return new_ranks, out


@pytest.mark.slow
def test_self_pruning_rounds_match_the_replay():
  lm, config, clients, ad = _setup()
  algorithm = algos.fedlora(lm.loss_fn, lora_config=config, rule='hetlora',
                            self_prune=GAMMA, prune_strength=LAM,
                            client_optimizer=optax.sgd(LR))
  state = algorithm.init(ad)
  store = Rows(algorithm.client_state_init(ad))
  cohort = make_cohort(clients, BATCH)
  # Round 1 starts from b = 0 (a zero tail received): nobody can prune.
  state, metrics, rows = run_round(algorithm, state, cohort, store, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(rows), [RANK, RANK])
  # Round 2 from the aggregated adapters, replayed.
  want_ranks, want = _replay(lm, config, clients, state.params, [RANK, RANK])
  state, metrics, rows = run_round(algorithm, state, cohort, store, jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(rows), want_ranks)
  assert min(want_ranks) < RANK  # The penalty shrank some tail: a prune happened.
  assert float(metrics['mean_client_rank']) == pytest.approx(np.mean(want_ranks))
  got = trees.adapter_pairs(state.params)
  for name, pair in want.items():
    for k in ('a', 'b'):
      scale = np.max(np.abs(pair[k]))
      np.testing.assert_allclose(np.asarray(got[name][k], np.float64), pair[k],
                                 rtol=0, atol=1e-4 * scale)


def test_pruning_options_are_checked():
  lm, config, _, _ = _setup()
  with pytest.raises(ValueError, match='self_prune'):
    algos.fedlora(lm.loss_fn, lora_config=config, rule='hetlora', self_prune=1.5)
  with pytest.raises(ValueError, match='prune_strength'):
    algos.fedlora(lm.loss_fn, lora_config=config, rule='hetlora', prune_strength=1.0)
