"""Tests of fedjx.algorithms.fedlora against single-client FedAvg runs and NumPy.

Oracle: client ``k``'s trained adapters are the params after one FedAvg round
(server SGD 1.0, so the new params are the client's) on a cohort of that
client alone, started from the global adapters truncated to its rank. From
them, in float64 (``P_k = s a_k b_k``, ``n_k`` examples, ``N = sum n_k``):

* FedIT: ``a = sum n_k a_k / N``, ``b`` likewise (Zhang et al. 2024, arXiv
  2305.05644), i.e. FedAvg on the adapters;
* FLoRA: merged delta ``M = sum n_k P_k / N`` (Wang et al. 2024, arXiv
  2409.05976);
* FlexLoRA: ``s a b`` the best rank-``r`` approximation of ``sum n_k P_k / N``
  (Bai et al. 2024, arXiv 2402.11505), by NumPy's SVD;
* HetLoRA: ``S_k = ||P_k||_F`` per matrix and layer, ``a = sum S_k a_k / sum
  S_k``, ``b`` likewise (Cho et al. 2024, arXiv 2401.06432).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms.aggregators import lora as lora_aggregation
from fedjx.models import adapters
from fedjx.models import llama
from fedjx.models import lora
from fedjx.models.lora_config import LoraConfig

import float_tolerance as ft
from test_algorithms_util import copy, make_cohort

CFG = LoraConfig(rank=4, alpha=8.0)
S = CFG.scale
RANKS = (2, 4)
SIZES = (3, 5, 4)
LR = 0.5
STEPS = 3  # ceil(5 / 2): every cohort below has the same shape (one compilation).
# Two float32 computations of the same local training: each of the <= 3 SGD
# steps is a forward and a backward pass through the one-layer model (< 1000
# terms each, see tests/test_lora.py), then the means over clients: n = 3 * 2 *
# 1000 = 6000 bounds the error relative to each quantity's scale.
CHAIN = 6000


@functools.lru_cache(maxsize=None)
def setup():
  m = llama.llama_lm('500k', num_layers=1, width=32, num_heads=2, num_kv_heads=2,
                     mlp_width=64)
  rng = np.random.RandomState(0)
  clients = [{'x': rng.randint(1, 256, (n, 9)).astype(np.int32)} for n in SIZES]
  example = {'x': jnp.asarray(clients[0]['x'][:2])}
  lm = lora.lora_model(m, CFG, jax.random.key(0), example)
  ad = lm.init(jax.random.key(1), example)
  # Nonzero b, so every factor's gradient is nonzero from the first step.
  ad = jax.tree_util.tree_map_with_path(
      lambda p, v: v + 0.3 * jax.random.normal(jax.random.key(7), v.shape)
      if p[-1].key.endswith('_b') else v, ad)
  return lm, clients, ad


def sgd():
  return optax.sgd(LR)


@functools.lru_cache(maxsize=None)
def oracle_clients():
  """Each client's trained adapters (pairs, float64), from one-client FedAvg rounds."""
  lm, clients, ad = setup()
  alg = algos.fedavg(lm.loss_fn, client_optimizer=sgd(), server_optimizer=optax.sgd(1.0))
  out = []
  for k, data in enumerate(clients):
    rank = RANKS[k % len(RANKS)]
    start = adapters.from_pairs(lora_aggregation.truncate(adapters.adapter_pairs(ad), rank))
    cohort = make_cohort([data], 2, steps=STEPS, client_ids=[k])
    state, _ = alg.round(alg.init(copy(start)), cohort, jax.random.key(0))
    out.append({n: {x: np.asarray(v, np.float64) for x, v in p.items()}
                for n, p in adapters.adapter_pairs(state.params).items()})
  return out


def cohort():
  return make_cohort(setup()[1], 2, steps=STEPS)


def run(rule, rounds=1, client_ranks=RANKS):
  lm, _, ad = setup()
  alg = algos.fedlora(lm.loss_fn, lora_config=CFG, rule=rule, client_ranks=client_ranks,
                      client_optimizer=sgd())
  state = alg.init(copy(ad))
  states = []
  for r in range(rounds):
    state, _ = alg.round(state, cohort(), jax.random.key(r))
    states.append(copy(state))
  return states


def close(got, want, scale):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                             atol=ft.atol(CHAIN, scale))


def mean_product(trained, name):
  n = np.asarray(SIZES, np.float64)
  return sum(nk * S * t[name]['a'] @ t[name]['b'] for nk, t in zip(n, trained)) / n.sum()


def abs_scale(trained, name):
  """The magnitude of the terms of the mean product (its error scale)."""
  return max(float(np.max(S * np.abs(t[name]['a']) @ np.abs(t[name]['b']))) for t in trained)


@pytest.mark.slow
def test_fedit_is_fedavg_on_the_adapters():
  lm, _, ad = setup()
  fedavg = algos.fedavg(lm.loss_fn, client_optimizer=sgd(), server_optimizer=optax.sgd(1.0))
  want, _ = fedavg.round(fedavg.init(copy(ad)), cohort(), jax.random.key(0))
  got = run('fedit', client_ranks=None)[0]
  for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    close(g, np.asarray(w, np.float64), float(np.max(np.abs(w))))


@pytest.mark.slow
def test_flora_merges_the_mean_product_and_resets_b():
  trained = oracle_clients()
  state = run('flora')[0]
  merged = adapters.merged_pairs(adapters.split_merged(state.params)[1])
  pairs = adapters.adapter_pairs(adapters.split_merged(state.params)[0])
  assert set(merged) == set(pairs) == set(trained[0])
  for name, m in merged.items():
    close(m, mean_product(trained, name), abs_scale(trained, name))
    np.testing.assert_array_equal(pairs[name]['b'], 0.0)


def test_flexlora_is_the_best_rank_r_fit_of_the_mean_product():
  trained = oracle_clients()
  got = adapters.adapter_pairs(run('flexlora')[0].params)
  for name, pair in got.items():
    p = mean_product(trained, name)
    u, sv, vt = np.linalg.svd(p, full_matrices=False)
    r = CFG.rank
    want = np.einsum('...ir,...r,...rj->...ij', u[..., :r], sv[..., :r], vt[..., :r, :])
    # The rank-r subspace moves by (perturbation) / (singular gap) (Wedin); the
    # gap is checked to be a sizable fraction of the top singular value.
    gap = np.min(sv[..., r - 1] - sv[..., r])
    assert gap > 1e-2 * np.max(sv)
    tol_scale = abs_scale(trained, name) * (1 + np.max(sv) / gap)
    close(S * np.matmul(np.asarray(pair['a'], np.float64), np.asarray(pair['b'], np.float64)),
          want, tol_scale)


def test_hetlora_is_the_norm_weighted_mean():
  trained = oracle_clients()
  got = adapters.adapter_pairs(run('hetlora')[0].params)
  for name, pair in got.items():
    norms = [np.sqrt(np.sum(np.square(S * t[name]['a'] @ t[name]['b']), axis=(-2, -1)))
             for t in trained]
    total = sum(norms)
    for x in ('a', 'b'):
      want = sum(nk[..., None, None] * t[name][x] for nk, t in zip(norms, trained))
      want = want / total[..., None, None]
      close(pair[x], want, max(float(np.max(np.abs(t[name][x]))) for t in trained))


def test_flora_second_round_starts_from_the_merged_base():
  lm, clients, _ = setup()
  first, second = run('flora', rounds=2)
  batch = {'x': jnp.asarray(clients[1]['x'])}
  base_loss = np.asarray(lm.base.loss_fn(lm.frozen, batch))
  after = np.asarray(lm.loss_fn(first.params, batch))
  # b = 0 after the merge: the state's model is the base with W + M.
  assert np.max(np.abs(after - base_loss)) > 1e-4
  m1 = adapters.merged_pairs(adapters.split_merged(first.params)[1])
  m2 = adapters.merged_pairs(adapters.split_merged(second.params)[1])
  for name in m1:
    d1, d2 = np.asarray(m1[name], np.float64), np.asarray(m2[name], np.float64)
    step = d2 - d1
    assert np.max(np.abs(step)) > 1e-3 * np.max(np.abs(d1))
    # Round two adds one more mean of products of ranks 2, 4, 2: rank <= 8.
    assert all(np.linalg.matrix_rank(s, tol=1e-5 * np.max(np.abs(s))) <= 8
               for s in step.reshape((-1,) + step.shape[-2:]))


@pytest.mark.parametrize('kwargs,argument', [
    ({'aggregator': object()}, 'aggregator='),
    ({'lora_config': LoraConfig(rank=4, alpha=8.0, train_a=False)}, 'train_a=False'),
    ({'client_ranks': (2, 5)}, 'client_ranks='),
    ({'client_ranks': ()}, 'client_ranks='),
    ({'client_ranks': (0,)}, 'client_ranks='),
    ({'rule': 'fedprox'}, 'rule='),
])
def test_bad_arguments_raise(kwargs, argument):
  args = {'lora_config': CFG, **kwargs}
  with pytest.raises(ValueError, match=f'fedlora: .*{argument}'):
    algos.fedlora(lambda p, b: 0.0, **args)
