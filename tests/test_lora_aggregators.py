"""The framework's aggregators on LoRA adapters: only the adapters travel.

FedAvg on a :class:`fedjx.models.lora.LoraModel` (FedIT, and FFA-LoRA with
``train_a=False``) with the DP Gaussian aggregator and a quantized mean:
each client's update is the adapter tree alone, so

* ``communicated_bytes`` is clients x the adapter tree's bytes (FFA-LoRA:
  the ``b`` leaves only), far below the model's;
* the DP round equals a NumPy replay of McMahan et al. 2018's Algorithm 1 on
  the adapters: each client's adapter delta (from a single-client FedAvg
  round, which runs that client's local steps exactly) clipped to norm C,
  summed, plus the round's Gaussian noise (recovered from the same key by
  running the aggregator on zero updates), divided by the client count; the
  frozen base is untouched.

Tolerance: the replay sums 3 clients' float32 deltas of size O(1) and the
noise; float32 rounding over those few terms is ~1e-6 relative, checked at
1e-5 of the update's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import aggregators
from fedjx.models import adapters
from fedjx.models import llama
from fedjx.models import lora
from fedjx.models.lora_config import LoraConfig
from test_algorithms_util import make_cohort

SIZES = (3, 5, 4)


def _clients():
  rng = np.random.RandomState(0)
  return [{'x': rng.randint(1, 256, (n, 9)).astype(np.int32)} for n in SIZES]


def _model(train_a=True):
  model = llama.llama_lm('500k', num_layers=1, width=32, num_heads=2, num_kv_heads=2,
                         mlp_width=64)
  batch = {'x': jnp.asarray(_clients()[0]['x'][:2])}
  lm = lora.lora_model(model, LoraConfig(rank=4, alpha=8.0, train_a=train_a),
                       jax.random.key(0), batch)
  ad = lm.init(jax.random.key(1), batch)
  # Nonzero b, so that every adapter has a gradient.
  ad = jax.tree_util.tree_map_with_path(
      lambda p, x: 0.3 * jax.random.normal(jax.random.key(7), x.shape)
      if adapters.path_name(p).endswith('_lora_b') else x, ad)
  return model, lm, ad


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize('train_a', [True, False])
def test_only_the_adapters_are_sent(train_a):
  model, lm, ad = _model(train_a)
  algorithm = algos.fedavg(lm.loss_fn, client_optimizer=optax.sgd(0.5))
  state, metrics = algorithm.round(algorithm.init(ad), make_cohort(_clients(), 2),
                                   jax.random.key(0))
  adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(ad))
  assert float(metrics['communicated_bytes']) == len(SIZES) * adapter_bytes
  names = [adapters.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(ad)[0]]
  assert all(n.endswith('_lora_b') or (train_a and n.endswith('_lora_a')) for n in names)
  model_bytes = sum(x.size * 4 for x in jax.tree.leaves(
      adapters.partition(lm.frozen, adapters.is_adapter)[1]))
  assert adapter_bytes < model_bytes / 10


@pytest.mark.slow
def test_dp_gaussian_on_adapters_matches_a_numpy_replay():
  _, lm, ad = _model()
  clip, z = 0.05, 0.7
  sgd = optax.sgd(0.5)
  dp = algos.fedavg(lm.loss_fn, client_optimizer=sgd, weighting='uniform',
                    aggregator=aggregators.gaussian(clip_norm=clip, noise_multiplier=z))
  key = jax.random.key(3)
  clients = _clients()
  state, _ = dp.round(dp.init(ad), make_cohort(clients, 2, steps=3), key)
  # Each client's delta x - y_k, from a round with that client alone.
  plain = algos.fedavg(lm.loss_fn, client_optimizer=sgd)
  deltas = []
  for c in clients:
    one, _ = plain.round(plain.init(ad), make_cohort([c], 2, steps=3), key)
    deltas.append(_flat(ad) - _flat(one.params))
  clipped = [d * min(1.0, clip / np.linalg.norm(d)) for d in deltas]
  # The round's noise: the same aggregator and key on zero-update clients.
  zero = [{'x': np.zeros((n, 9), np.int32)} for n in SIZES]
  still = algos.fedavg(lambda p, b: jnp.zeros(b['x'].shape[0]), client_optimizer=sgd,
                       weighting='uniform',
                       aggregator=aggregators.gaussian(clip_norm=clip, noise_multiplier=z))
  noised, _ = still.round(still.init(ad), make_cohort(zero, 2, steps=3), key)
  noise_mean = _flat(ad) - _flat(noised.params)   # (noise) / C
  want = _flat(ad) - (np.sum(clipped, axis=0) / len(SIZES) + noise_mean)
  got = _flat(state.params)
  scale = np.max(np.abs(want))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
  assert np.linalg.norm(noise_mean) > 0  # The noise is there.


def test_quantized_mean_runs_on_adapters_and_counts_their_bits():
  _, lm, ad = _model()
  algorithm = algos.fedavg(lm.loss_fn, client_optimizer=optax.sgd(0.5),
                           aggregator=aggregators.quantized_mean('e3m0'))
  _, metrics = algorithm.round(algorithm.init(ad), make_cohort(_clients(), 2),
                               jax.random.key(0))
  adapter_values = sum(x.size for x in jax.tree.leaves(ad))
  sent = float(metrics['communicated_bytes'])
  assert 0 < sent <= len(SIZES) * adapter_values * 4
