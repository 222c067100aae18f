"""Chunks formed from the clients' step counts: a chunked round computes at
most 1.05 times the real steps, for any sizes, with the numbers of the
unchunked round."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx import datasets
from fedjx import frames
import float_tolerance as ft
from test_algorithms_util import linreg_loss, linreg_params

N, K, BATCH, DIM = 16, 4, 2, 3


def _sizes(kind):
  rng = np.random.default_rng(0)
  if kind in ('lognormal', 'unordered'):
    return np.maximum(1, np.round(8 * np.exp(0.8 * rng.normal(size=N)))).astype(int)
  if kind == 'one_huge':
    return np.array([64] + [4] * (N - 1))
  return np.full(N, 6)  # equal


def _cohort(kind):
  sizes = _sizes(kind)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(sizes.sum(), DIM)).astype(np.float32)
  y = rng.normal(size=sizes.sum()).astype(np.float32)
  data = datasets.from_arrays({'x': x, 'y': y}, groups=np.repeat(np.arange(N), sizes))
  cohort = datasets.make_cohort(data, np.arange(N), BATCH, shuffle_seed=None,
                                order_by_steps=kind != 'unordered')
  return jax.tree.map(jnp.asarray, cohort)


def _counting_loss(calls):
  def loss(params, batch):
    # The argument is per member, so under vmap the callback runs once for
    # each member of the chunk: it counts member-steps computed.
    jax.debug.callback(lambda _: calls.append(1), batch['y'][0])
    return linreg_loss(params, batch)
  return loss


def _round(loss, strategy, cohort, chunk=None):
  algo = algos.fedavg(loss, client_optimizer=optax.sgd(0.1),
                      client_evaluation=False).compile(
      map_strategy=strategy, chunk_size=chunk, donate=False)
  state = algo.init(linreg_params(DIM))
  return algo.round(state, cohort, jax.random.key(0))


@pytest.mark.parametrize('kind,fuse', [
    ('lognormal', True), ('one_huge', False), ('equal', True), ('unordered', False)])
def test_chunked_round_computes_at_most_5_percent_more_than_its_real_steps(kind, fuse):
  cohort = _cohort(kind)
  cost = np.asarray(fedjx.mapping.member_cost([cohort.mask]))
  real = int(cost.sum())
  calls = []
  loss = _counting_loss(calls)
  with frames.without_fusion() if not fuse else _nothing():
    jax.block_until_ready(_round(loss, 'chunked', cohort, K))
  counted = len(calls)
  assert counted == fedjx.mapping.computed_steps(cost, K)
  assert real <= counted <= 1.05 * real
  if kind == 'equal':  # Every window is one chunk of 4: no waste at all.
    assert fedjx.mapping.chunk_widths(cost, K) == [K] * (N // K)
    assert counted == real


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *unused):
    return False


@pytest.mark.parametrize('kind', [
    'lognormal', pytest.param('unordered', marks=pytest.mark.slow)])
def test_chunked_round_equals_the_sequential_round(kind):
  cohort = _cohort(kind)
  want, _ = _round(linreg_loss, 'sequential', cohort)
  fused, _ = _round(linreg_loss, 'chunked', cohort, K)
  with frames.without_fusion():
    plain, _ = _round(linreg_loss, 'chunked', cohort, K)
  steps = int(np.asarray(cohort.mask).any(-1).sum(-1).max())
  for got in (fused, plain):
    for u, v in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
      # Per-client SGD of up to `steps` steps on sums of BATCH x DIM terms,
      # then a weighted mean of N models summed in another order.
      np.testing.assert_allclose(u, v, rtol=0,
                                 atol=ft.atol(steps * BATCH * DIM + N, 4.0 * N))


def test_chunk_widths_follow_the_waste_rule():
  # Descending costs: the first clients differ too much for a chunk of 4.
  assert fedjx.mapping.chunk_widths([32, 20, 18, 10, 5, 5, 5, 5, 5, 4], 4) == \
      [1, 1, 1, 1, 4, 1, 1]
  # 4 x 5 = 20 > 1.05 x 19 = 19.95: 5, 5, 5, 4 is not a chunk.
  assert fedjx.mapping.chunk_widths([5, 5, 5, 4], 4) == [1, 1, 1, 1]
  # 4 x 5 = 20 <= 1.05 x 20: one chunk; the 3 left run alone.
  assert fedjx.mapping.chunk_widths([5, 5, 5, 5, 3, 2, 1], 4) == [4, 1, 1, 1]
  assert fedjx.mapping.computed_steps([5, 5, 5, 5, 3, 2, 1], 4) == 20 + 6
  assert fedjx.mapping.computed_steps([5, 1], 2, 'vmap') == 10
  assert fedjx.mapping.computed_steps([5, 1], 1, 'sequential') == 6


def test_an_explicit_cost_orders_the_chunks_and_changes_no_number():
  x = jnp.arange(10.0)

  @fedjx.program(clients=10, map_strategy='chunked', chunk_size=3)
  def program(x, cost):
    return fedjx.map_fn(lambda v: v * v + 1, x, cost=cost)

  for cost in ([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10, list(range(10))):
    np.testing.assert_array_equal(jax.jit(program)(x, jnp.asarray(cost)),
                                  x * x + 1)
  with pytest.raises(ValueError, match='cost has shape'):
    jax.jit(program)(x, jnp.ones(3, jnp.int32))


def _widths_of(roles):
  """The chunk widths that per-member roles (chunk_roles) describe."""
  return [{1: 1, 2: K}[int(r)] for r in np.asarray(roles) if r]


@pytest.mark.parametrize('cost', [
    [5] * 37,  # Chunks of 4, one member alone at the end.
    list(np.random.default_rng(0).integers(1, 30, size=50)),  # Mostly alone.
    [9, 9, 9, 9] * 3 + list(range(40, 0, -1)) + [2] * 9,  # Blocks of each kind.
    [7, 1, 1, 1, 1, 1],  # One block, partial.
])
def test_blocks_run_the_chunks_of_chunk_widths_in_order(cost):
  n = len(cost)
  roles = fedjx.mapping.chunk_roles(jnp.asarray(cost), n, K)
  assert _widths_of(roles) == fedjx.mapping.chunk_widths(cost, K)

  def step(carry, start, width):
    order, count = carry
    order = jax.lax.dynamic_update_slice_in_dim(
        order, jnp.full((width,), count, jnp.int32), start, 0)
    return order, count + 1

  order, count = jax.jit(lambda c: fedjx.mapping.run_by_cost(
      step, (jnp.full((n,), -1, jnp.int32), jnp.zeros((), jnp.int32)), c, n, K,
      block=8))(jnp.asarray(cost))
  widths = fedjx.mapping.chunk_widths(cost, K)
  want = np.repeat(np.arange(len(widths)), widths)
  np.testing.assert_array_equal(order, want)  # Each member once, in order.
  assert int(count) == len(widths)


def test_gradient_through_blocks_of_chunks():
  x = jnp.linspace(-1.0, 1.0, 40)
  cost = jnp.asarray([4] * 12 + list(range(28, 0, -1)))

  @fedjx.program(clients=40, map_strategy='chunked', chunk_size=4)
  def program(x):
    return fedjx.reduce_sum(fedjx.map_fn(lambda v: v * v * v, x, cost=cost))

  np.testing.assert_allclose(jax.grad(program)(x), 3 * x * x, rtol=1e-6)
  with frames.without_fusion():
    np.testing.assert_allclose(jax.grad(program)(x), 3 * x * x, rtol=1e-6)
