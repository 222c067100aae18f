"""Row-sparse updates (fedjx.fused_updates): a gathered table's step touches
only the gathered rows, and computes what the dense step computes."""

import jax
import jax.numpy as jnp
from jax.test_util import check_grads
import numpy as np
import optax
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx import datasets
from fedjx import fused_updates

V, C, B, T = 50, 3, 4, 6  # Table rows, outputs, batch, tokens per example.
U64 = 2.0 ** -53


def bag_loss(params, batch):
  """A bag-of-tokens logistic regression: the sum of the tokens' rows."""
  w, b = params
  logits = jnp.sum(jnp.take(w, batch['tokens'], axis=0), axis=1) + b
  return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, batch['y']), -1)


def _batch(rng):
  tokens = rng.integers(0, V, (B, T))
  tokens[0, :3] = tokens[1, 0] = 7  # A row gathered four times.
  return {'tokens': jnp.asarray(tokens, jnp.int32),
          'y': jnp.asarray((rng.random((B, C)) < 0.3).astype(np.float64))}


def _params(rng):
  return (jnp.asarray(rng.normal(size=(V, C))), jnp.asarray(rng.normal(size=C)))


def _step(tx, loss=bag_loss):
  def step(params, state, batch):
    g = jax.grad(lambda p: jnp.mean(loss(p, batch)))(params)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _fused(fn, *args, **limits):
  """``fn`` evaluated by ``fused_updates.eval_jaxpr`` (with ``limits``)."""
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  return lambda *a: jax.tree.unflatten(jax.tree.structure(shape), fused_updates.eval_jaxpr(
      closed.jaxpr, closed.consts, *jax.tree.leaves(a), **limits))


OPTIMIZERS = {
    'sgd': optax.sgd(0.1),
    'sgd, schedule': optax.sgd(optax.linear_schedule(0.2, 0.05, 3)),
    'momentum': optax.sgd(0.1, momentum=0.9),
    'adam': optax.adam(0.01),
    'clipped sgd': optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)),
}


# A dense layer: its weight's gradient is a product of rank B, added by row
# blocks (here D = 67 rows in blocks of 8 of 9, the last one short).
D, K = 67, 5
BLOCKS = dict(block_bytes=8 * K * 8, min_blocked_bytes=0)  # float64 rows.


def dense_loss(params, batch):
  w, b = params
  logits = batch['x'] @ w + b
  return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, batch['y']), -1)


def _dense_batch(rng):
  return {'x': jnp.asarray(rng.normal(size=(B, D))),
          'y': jnp.asarray((rng.random((B, K)) < 0.3).astype(np.float64))}


def _dense_params(rng):
  return (jnp.asarray(rng.normal(size=(D, K))), jnp.asarray(rng.normal(size=K)))


# The kinds of fused gradient: (loss, params, batch, eval_jaxpr's limits,
# roundings per entry and step in the other order).
KINDS = {
    # A gathered table: per entry a sum of at most B * T + 2 terms (the
    # table row, the gathered examples' terms, the scale) in another order.
    'gathered table': (bag_loss, _params, _batch, {}, B * T + 2),
    # A dense layer added by blocks: each entry of the gradient is a dot
    # product of B terms (in a kernel's order), then the same scale and add.
    'dense layer': (dense_loss, _dense_params, _dense_batch, BLOCKS, B + 2),
}


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('name', OPTIMIZERS)
def test_steps_equal_the_dense_evaluation(name, kind):
  tx = OPTIMIZERS[name]
  loss, make_params, make_batch, limits, roundings = KINDS[kind]
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    params = make_params(rng)
    state = tx.init(params)
    dense = fused = (params, state)
    step = _step(tx, loss)
    run = _fused(step, params, state, make_batch(rng), **limits)
    for _ in range(3):
      batch = make_batch(rng)
      dense = jax.jit(step)(*dense, batch)
      fused = jax.jit(run)(*fused, batch)
    # Per step and entry, that many roundings of terms of magnitude below
    # 10 here; 3 steps.
    atol = 3 * 2 * roundings * U64 * 10
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(fused)):
      np.testing.assert_allclose(b, a, rtol=0, atol=atol)


def _shaped(jaxpr, shape):
  return [e for e in _eqns(jaxpr) if any(tuple(v.aval.shape) == shape for v in e.outvars)]


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _eqns(sub)


def test_an_sgd_step_adds_into_the_table_where_it_gathered():
  rng = np.random.default_rng(1)
  params, tx = _params(rng), optax.sgd(0.1)
  run = _fused(_step(tx), params, tx.init(params), _batch(rng))
  jaxpr = jax.make_jaxpr(run)(params, tx.init(params), _batch(rng)).jaxpr
  table = _shaped(jaxpr, (V, C))
  # The table's only computation: one scatter-add into the table itself.
  assert [e.primitive for e in table] == [jax.lax.scatter_add_p]
  assert table[0].invars[0] is jaxpr.invars[0]
  # The dense evaluation scales and adds a whole [V, C] gradient.
  dense = jax.make_jaxpr(_step(tx))(params, tx.init(params), _batch(rng)).jaxpr
  assert {e.primitive.name for e in _shaped(dense, (V, C))} >= {'mul', 'add'}


@pytest.mark.parametrize('kind', KINDS)
def test_derivatives_through_fused_steps_match_finite_differences(kind):
  loss, make_params, make_batch, limits, _ = KINDS[kind]
  rng = np.random.default_rng(2)
  with jax.enable_x64(True):
    params, tx = make_params(rng), optax.sgd(0.3)
    batches = [make_batch(rng) for _ in range(2)]
    run = _fused(_step(tx, loss), params, tx.init(params), batches[0], **limits)

    def trained(w):
      p, s = (w, params[1]), tx.init(params)
      for batch in batches:
        p, s = run(p, s, batch)
      return jnp.sum(p[0] ** 2) + jnp.sum(jnp.sin(p[1]))

    check_grads(trained, (params[0],), order=2, modes=('fwd', 'rev'))


def _cohort(rng, sizes):
  """A cohort of the given client sizes (float64 labels), in data order."""
  n = sum(sizes)
  tokens = rng.integers(0, V, (n, T)).astype(np.int32)
  y = (rng.random((n, C)) < 0.3).astype(np.float64)
  population = datasets.from_arrays({'tokens': tokens, 'y': y},
                                    groups=np.repeat(np.arange(len(sizes)), sizes))
  return jax.tree.map(jnp.asarray, datasets.make_cohort(
      population, np.arange(len(sizes)), B, shuffle_seed=None))


def _fedavg(strategy):
  return algos.fedavg(bag_loss, client_optimizer=optax.sgd(0.5),
                      client_evaluation=False).compile(map_strategy=strategy,
                                                       donate=False)


def _assert_same_round(got, want, clients):
  """Local steps: per entry a sum of at most B * T + 2 terms of magnitude
  below 10, over at most 4 steps, then a weighted mean of the clients."""
  atol = 2 * (4 * (B * T + 2) + clients) * U64 * 10
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(b, a, rtol=0, atol=atol)


def test_a_sequential_round_updates_the_table_in_the_loop_and_equals_vmap():
  """One client at a time (a while loop over its steps, the sparse update)
  and all at once (vmap: the tree of steps, dense updates) give one round."""
  rng = np.random.default_rng(3)
  with jax.enable_x64(True):
    cohort, params = _cohort(rng, [9, 2, 14, 5]), _params(rng)
    rounds = {}
    for strategy in ('sequential', 'vmap'):
      algo = _fedavg(strategy)
      state = algo.init(params)
      rounds[strategy] = algo.round(state, cohort, jax.random.key(0))[0].params
    jaxpr = jax.make_jaxpr(_fedavg('sequential').round)(
        state, cohort, jax.random.key(0)).jaxpr
    _assert_same_round(rounds['sequential'], rounds['vmap'], 4)
  # Some while loop (a client's steps) adds into the table and never
  # scales a whole [V, C] gradient.
  loops = [e for e in _eqns(jaxpr) if e.primitive.name == 'while']
  inner = [_shaped(e.params['body_jaxpr'].jaxpr, (V, C)) for e in loops]
  assert any(jax.lax.scatter_add_p in [e.primitive for e in table] and
             'mul' not in [e.primitive.name for e in table] for table in inner)


def test_a_round_split_over_cpu_devices_equals_the_round_on_one():
  """16 clients on an Auto `clients` mesh of 8 host devices (each device runs
  its block of 2 clients one at a time under shard_map, the sparse update
  inside) equal the vmapped round without a mesh."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  rng = np.random.default_rng(4)
  with jax.enable_x64(True):
    cohort = _cohort(rng, [9, 2, 14, 5, 1, 7, 12, 3, 4, 8, 6, 1, 10, 2, 5, 11])
    params = _params(rng)
    vmapped = _fedavg('vmap')
    want = vmapped.round(vmapped.init(params), cohort, jax.random.key(0))[0].params
    algo = _fedavg('sequential')
    mesh = jax.make_mesh((8,), ('clients',), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
      placed = jax.device_put(cohort, NamedSharding(mesh, P('clients')))
      got = algo.round(algo.init(params), placed, jax.random.key(0))[0].params
    _assert_same_round(got, want, 16)


def test_a_sequential_round_differentiates_as_the_vmapped_one():
  """Reverse mode through a round whose clients' steps add into the table
  (the derivative rule traces the same rewritten steps) equals reverse mode
  through the vmapped round, and finite differences."""
  rng = np.random.default_rng(5)
  with jax.enable_x64(True):
    cohort, params = _cohort(rng, [6, 2, 9]), _params(rng)
    grads = {}
    for strategy in ('sequential', 'vmap'):
      algo = _fedavg(strategy)

      def objective(w, algo=algo):
        new = algo.round(algo.init((w, params[1])), cohort, jax.random.key(0))[0]
        return jnp.sum(new.params[0] ** 2)

      grads[strategy] = jax.grad(objective)(params[0])
      if strategy == 'sequential':
        check_grads(objective, (params[0],), order=1, modes=('rev',))
    # Two passes (forward and its transpose) of the round's sums, as above.
    atol = 2 * 2 * (3 * (B * T + 2) + 3) * U64 * 10
    np.testing.assert_allclose(grads['sequential'], grads['vmap'], rtol=0, atol=atol)


def _dots(text):
  import re
  return re.findall(r'= f64\[([0-9,]*)\][^=]* dot\(', text)


def _dense_sgd_step(seed):
  """An SGD step of the dense layer, and arguments for it (float64)."""
  rng, tx = np.random.default_rng(seed), optax.sgd(0.1)
  params = _dense_params(rng)
  return _step(tx, dense_loss), (params, tx.init(params), _dense_batch(rng))


def test_an_sgd_step_on_cpu_never_builds_the_whole_product():
  with jax.enable_x64(True):
    step, args = _dense_sgd_step(7)
    hlo = jax.jit(_fused(step, *args, **BLOCKS)).lower(*args).compile().as_text()
    dense = jax.jit(step).lower(*args).compile().as_text()
  # The dense step computes the [D, K] (or [K, D]) gradient in one product;
  # the blocked step only [K, 8] and [K, 3] ones (and the forward [B, K]).
  assert {f'{D},{K}', f'{K},{D}'} & set(_dots(dense))
  assert set(_dots(hlo)) <= {f'{B},{K}', f'{K},8', f'{K},3', f'8,{K}', f'3,{K}'}, _dots(hlo)
  assert 'dynamic-update-slice' in hlo


def test_small_products_are_left_as_written():
  with jax.enable_x64(True):
    step, args = _dense_sgd_step(8)
    run = _fused(step, *args)  # Defaults: 4 MiB and over only.
    jaxpr = jax.make_jaxpr(run)(*args).jaxpr
  assert 'platform_index' not in {e.primitive.name for e in _eqns(jaxpr)}


def test_a_sequential_round_of_a_large_dense_layer_equals_vmap():
  """A 4 MiB float32 weight (the default threshold) trained one client at a
  time (blocked updates in the while loop) and all at once (vmap, dense
  updates): the same round."""
  rows, cols, n = 2048, 512, [3, 1, 4]
  rng = np.random.default_rng(10)
  x = (rng.random((sum(n), rows)) < 0.01).astype(np.float32)
  y = (rng.random((sum(n), cols)) < 0.1).astype(np.float32)
  population = datasets.from_arrays({'x': x, 'y': y},
                                    groups=np.repeat(np.arange(len(n)), n))
  cohort = jax.tree.map(jnp.asarray, datasets.make_cohort(
      population, np.arange(len(n)), 2, shuffle_seed=None))
  params = (jnp.asarray(0.5 * rng.normal(size=(rows, cols)).astype(np.float32)),
            jnp.zeros(cols, jnp.float32))
  got = {}
  for strategy in ('sequential', 'vmap'):
    algo = algos.fedavg(dense_loss, client_optimizer=optax.sgd(0.5),
                        client_evaluation=False).compile(map_strategy=strategy, donate=False)
    got[strategy] = algo.round(algo.init(params), cohort, jax.random.key(0))[0].params
    if strategy == 'sequential':
      jaxpr = jax.make_jaxpr(algo.round)(algo.init(params), cohort, jax.random.key(0)).jaxpr
  assert 'platform_index' in {e.primitive.name for e in _eqns(jaxpr)}
  # Each entry: at most 2 steps of a dot of 2 terms, scale and add (4
  # roundings each), then a weighted mean of 3 clients; float32, the
  # weights below 5 in magnitude.
  atol = (2 * 4 + 3) * 2.0 ** -24 * 5
  for a, b in zip(jax.tree.leaves(got['vmap']), jax.tree.leaves(got['sequential'])):
    np.testing.assert_allclose(b, a, rtol=0, atol=atol)
