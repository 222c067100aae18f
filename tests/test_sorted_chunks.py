"""Accelerator chunks: ``auto`` on a TPU or GPU runs the clients in vmapped
chunks of ``W`` ordered by step count (``fedjx.mapping.run_sorted``), each
chunk a ``while`` loop over its largest member's steps, ``W`` from the cost
model of ``fedjx.chunk_cost``.

The CPU backend takes the accelerator's plan here by patching
``fedjx.mapping.sorts_by_cost`` (and the width by patching
``fedjx.chunk_cost.chunk_width``). References: a float64 NumPy FedAvg of the
same batches, the unchunked (``vmap``) round, and counted member-steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
from fedjx import algorithms
from fedjx import chunk_cost
from fedjx import datasets
from fedjx import frames
from fedjx import mapping
import float_tolerance as ft
import softmax_fedavg

N, BATCH, FEATURES, CLASSES, LR = 22, 3, 5, 3, 0.1
AUTO = jax.sharding.AxisType.Auto


def _population(n=N):
  return softmax_fedavg.population(n, FEATURES, CLASSES, spread=0.9)


_loss = softmax_fedavg.loss


def _params():
  return softmax_fedavg.initial_params(FEATURES, CLASSES)


def _cohort(on_device, n=N):
  sizes, x, y = _population(n)
  data = datasets.from_arrays({'x': x, 'y': y}, groups=np.repeat(np.arange(n), sizes))
  if on_device:
    data = datasets.on_device(data)
  return datasets.place_cohort(datasets.make_cohort(
      data, np.arange(n), BATCH, shuffle_seed=None))


def _accelerator(monkeypatch, width):
  """The accelerator's plan on this CPU: sorted chunks of ``width``."""
  monkeypatch.setattr(mapping, 'sorts_by_cost',
                      lambda strategy, backend=None: strategy == 'auto')
  monkeypatch.setattr(chunk_cost, 'chunk_width', lambda n, *a, **k: min(width, n))


def _round(cohort, strategy, loss=_loss):
  algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(LR),
                           server_optimizer=optax.sgd(1.0),
                           client_evaluation=False).compile(
      map_strategy=strategy, donate=False)
  state, metrics = algo.round(algo.init(_params()), cohort, jax.random.key(0))
  return [np.asarray(a) for a in state.params], metrics


def _numpy_fedavg(n=N):
  return softmax_fedavg.numpy_fedavg(*_population(n), _params(), BATCH, LR)


def _tolerance(want, n=N):
  return softmax_fedavg.tolerance(want, _population(n)[0], FEATURES, BATCH)


@pytest.mark.parametrize('width', [4, 11])  # 22 = 5 x 4 + 2 (overlap), 2 x 11.
@pytest.mark.parametrize('on_device', [False, True])
@pytest.mark.parametrize('fuse', [True, False])
def test_sorted_chunks_give_the_numpy_round_and_the_unchunked_one(
    width, on_device, fuse, monkeypatch):
  cohort = _cohort(on_device)
  one, one_metrics = _round(cohort, 'vmap')
  _accelerator(monkeypatch, width)
  bounds, order = [], mapping.descending_order
  monkeypatch.setattr(mapping, 'descending_order',
                      lambda c, b=None: (bounds.append(b), order(c, b))[1])
  with frames.without_fusion() if not fuse else _null():
    got, metrics = _round(cohort, 'auto')
  # The order is sorted by one key under the cohort's steps as the bound.
  assert bounds == [cohort.mask.shape[1]]
  want = _numpy_fedavg()
  for g, w, o in zip(got, want, one):
    np.testing.assert_allclose(g, w, rtol=0, atol=_tolerance(w))
    np.testing.assert_allclose(g, o, rtol=0, atol=_tolerance(o))
  # The training loss pools per-client sums of the map's outputs: each
  # client counted once, also a member of the last chunk that the chunk
  # before ran already (a sum of positive losses over the real examples).
  sizes, _, _ = _population()
  assert set(metrics) == set(one_metrics)
  for key in metrics:
    np.testing.assert_allclose(metrics[key], one_metrics[key],
                               rtol=ft.rtol(sizes.sum() + N), err_msg=key)


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def test_a_sorted_chunk_computes_its_largest_member_s_steps(monkeypatch):
  cohort = _cohort(False)
  cost = np.asarray(mapping.member_cost([cohort.mask]))
  calls = []

  def loss(params, batch):
    # Per member: under vmap the callback runs once for each member of a
    # chunk, so it counts the member-steps computed.
    jax.debug.callback(lambda _: calls.append(1), batch['y'][0])
    return _loss(params, batch)

  _accelerator(monkeypatch, 4)
  jax.block_until_ready(_round(cohort, 'auto', loss))
  assert len(calls) == mapping.computed_steps(cost, 4, 'sorted')
  # Sorted, the chunks pad at most 4 (max c - min c) member-steps.
  assert len(calls) <= cost.sum() + 4 * (cost.max() - cost.min())
  assert len(calls) < mapping.computed_steps(cost, N, 'vmap')


def test_sorted_chunks_host_twin():
  cost = [3, 9, 1, 9, 4, 2, 2]
  chunks = mapping.sorted_chunks(cost, 3)
  # Descending cost, ties in member order; the last chunk ends at the end.
  assert [list(c) for c in chunks] == [[1, 3, 4], [0, 5, 6], [5, 6, 2]]
  assert mapping.computed_steps(cost, 3, 'sorted') == 3 * 9 + 3 * 3 + 3 * 2
  assert mapping.computed_steps(cost, 7, 'sorted') == 7 * 9  # One chunk.

  order = jax.jit(lambda c: mapping.run_sorted(
      lambda carry, members, fresh: carry.at[members].add(fresh.astype(jnp.int32)),
      jnp.zeros(7, jnp.int32), c, 7, 3))(jnp.asarray(cost))
  np.testing.assert_array_equal(order, np.ones(7))  # Each member counted once.


@pytest.mark.parametrize('n,bound', [(7, 9), (1000, 64), (257, 0), (50, 2**26)])
def test_descending_order_is_the_stable_argsort(n, bound):
  # Costs in [0, bound] with many ties; the last case's keys would overflow
  # int32, so it takes the argsort, as does a cost with no bound.
  cost = np.random.RandomState(n).randint(0, min(bound, 9) + 1, n).astype(np.int32)
  want = np.argsort(-cost, kind='stable')
  for b in (bound, None):
    got = jax.jit(lambda c, b=b: mapping.descending_order(c, b))(cost)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


def test_the_cost_bound_is_the_cohort_mask_s_steps():
  leaves = [np.zeros((4, 6, 3), bool), np.zeros((4, 6), np.float32),
            np.zeros((4, 9, 2, 1), bool)]
  assert mapping.cost_bound(leaves) == 9
  assert mapping.cost_bound(leaves[1:2]) is None
  cost = mapping.member_cost(leaves)
  assert int(jnp.max(cost)) <= mapping.cost_bound(leaves)


def test_gradient_through_sorted_chunks(monkeypatch):
  x = jnp.linspace(-1.0, 1.0, 10)
  cost = jnp.asarray([1, 5, 2, 2, 9, 3, 3, 1, 7, 4])
  _accelerator(monkeypatch, 4)

  @fedjx.program(clients=10, map_strategy='auto')
  def program(x):
    return fedjx.reduce_sum(fedjx.map_fn(lambda v: v * v * v, x, cost=cost))

  np.testing.assert_allclose(jax.grad(program)(x), 3 * x * x, rtol=1e-6)
  with frames.without_fusion():
    np.testing.assert_allclose(jax.grad(program)(x), 3 * x * x, rtol=1e-6)


def test_gradient_of_a_round_of_sorted_chunks(monkeypatch):
  """The differentiated round takes the tree of steps; its derivative with
  respect to the starting model equals the unchunked round's."""
  cohort = _cohort(True)
  algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(LR),
                           server_optimizer=optax.sgd(1.0),
                           client_evaluation=False)

  def loss_after(strategy):
    compiled = algo.compile(map_strategy=strategy, donate=False)

    def f(params):
      state = compiled.init(params)
      state, _ = compiled.apply(state, cohort, jax.random.key(0))
      return sum(jnp.sum(p * p) for p in jax.tree.leaves(state.params))
    return jax.jit(jax.grad(f))(_params())

  want = loss_after('vmap')
  _accelerator(monkeypatch, 4)
  got = loss_after('auto')
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # The round's chain (see _tolerance) twice, forward and backward.
    np.testing.assert_allclose(g, w, rtol=0, atol=2 * _tolerance(w))


@pytest.mark.parametrize('devices', [2, 4])
def test_sorted_chunks_in_blocks_per_device(devices, monkeypatch):
  """On an Auto mesh axis (8 host devices), each device sorts its own block."""
  n = 24
  _accelerator(monkeypatch, 3)
  mesh = jax.make_mesh((devices,), ('clients',), axis_types=(AUTO,),
                       devices=jax.devices()[:devices])
  with jax.set_mesh(mesh):
    got, _ = _round(_cohort(True, n), 'auto')
  want = _numpy_fedavg(n)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=_tolerance(w, n))


def test_the_cost_model_widths():
  """The model's chunks for the setups measured on a TPU v5e."""
  two_nn = chunk_cost.StepCost(model_bytes=199_210 * 4, flops=12e6)
  cnn = chunk_cost.StepCost(model_bytes=1_200_000 * 4, flops=1.3e9)
  kind = 'TPU v5 lite'
  # b = 3 x 0.8 MB / 819 GB/s = 2.9 us; 9 L / b = 24.8 -> 32; for padding,
  # sqrt(L n / (8 b)) = 18.6 -> 32 (1,000), 5.9 -> 8 (100).
  assert chunk_cost.chunk_width(1000, two_nn, 'tpu', kind) == 32
  assert chunk_cost.chunk_width(10_000, two_nn, 'tpu', kind) == 32
  assert chunk_cost.chunk_width(100, two_nn, 'tpu', kind) == 8
  # A tiny member (a 610-weight logistic regression): latency bound, wide.
  tiny = chunk_cost.StepCost(model_bytes=2440, flops=48e3)
  assert chunk_cost.chunk_width(128, tiny, 'tpu', kind) == 128
  # A convolution's step (1.3 GFLOP at 20 TFLOP/s) hides the latency: alone.
  assert chunk_cost.chunk_width(1000, cnn, 'tpu', kind) == 1
  assert mapping.choose_chunk_size('auto', 1000, 1 << 20, 1, backend='tpu',
                                   step=two_nn, device_kind=kind) == 25  # Divides 1000.
  assert mapping.choose_chunk_size('auto', 1000, 1 << 20, 1, backend='tpu',
                                   step=cnn, device_kind=kind) == 1


def test_loop_flops_count_each_loop_body_once():
  w = jnp.ones((7, 5))

  def f(x):  # x [3, 7]: one product of 2 x 3 x 7 x 5 flops per iteration.
    return jax.lax.fori_loop(0, jnp.sum(x > 0), lambda i, h: h + (x @ w).sum(),
                             0.0) + (x @ w).sum()

  jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 7)))
  assert chunk_cost.loop_flops(jaxpr.jaxpr) == 2 * (2 * 3 * 7 * 5)
