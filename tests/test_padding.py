"""Padded steps cost nothing: a step that is padding for every client run
together with it is skipped, and cohorts can be laid out by step count."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
from jax.test_util import check_grads
import numpy as np
import optax
import pytest

import fedjx
import fedjx.algorithms as algos
from fedjx import datasets
from fedjx import frames
import float_tolerance as ft
from test_algorithms_util import linreg_data, linreg_loss, linreg_params, make_cohort

N = 6
FLAGS = np.array([True, False, False, True, False, False])


def _any_in_chunk(strategy, chunk, fuse):
  @fedjx.program(clients=N, map_strategy=strategy, chunk_size=chunk, fuse=fuse)
  def program(flags):
    seen = fedjx.map_fn(lambda f: fedjx.mapping.any_in_chunk(f), flags)
    return fedjx.reduce_sum(seen.astype(jnp.int32)), seen
  return jax.jit(program)(jnp.asarray(FLAGS))[1]


@pytest.mark.parametrize('strategy,chunk,fuse,want', [
    ('vmap', None, True, [True] * N),              # One chunk: any of all.
    ('chunked', 2, True, [True, True, True, True, False, False]),  # Pairs.
    ('chunked', 2, False, [True, True, True, True, False, False]),
    ('chunked', 3, True, [True] * N),              # {0,1,2}, {3,4,5}.
    ('sequential', None, True, list(FLAGS)),       # One member: its own.
    ('sequential', None, False, list(FLAGS)),
])
def test_any_in_chunk_is_the_or_over_the_members_run_together(strategy, chunk, fuse, want):
  np.testing.assert_array_equal(_any_in_chunk(strategy, chunk, fuse), want)


def test_any_in_chunk_outside_a_map_is_the_value_itself():
  assert bool(fedjx.mapping.any_in_chunk(True))
  assert not bool(fedjx.mapping.any_in_chunk(jnp.asarray(False)))


def _counting_loss(counter):
  def loss(params, batch):
    jax.debug.callback(counter.append, 1)
    return linreg_loss(params, batch)
  return loss


@pytest.mark.parametrize('strategy,chunk,expected', [
    ('sequential', None, 3 + 1 + 2 + 2),  # Each client its own steps.
    ('chunked', 2, 3 + 1 + 2),            # {3}, {1} alone, then {2, 2}.
    ('vmap', None, 3),                    # One chunk: the largest client's.
])
def test_steps_that_are_padding_for_the_whole_chunk_are_not_computed(strategy, chunk, expected):
  """Clients of 3, 1, 2 and 2 steps, padded to S = 4: each step a chunk
  computes calls the loss's callback once (under vmap, once for the chunk's
  members together); steps that are padding for the whole chunk never do.
  Without skipping, every chunk would compute all 4 steps. Chunks of 2 are
  formed from the step counts: {3, 1} and {1, 2} would waste more than 5%,
  so clients 0 and 1 run alone."""
  rng = np.random.default_rng(0)
  data = linreg_data(rng, [12, 4, 8, 8], dim=3)
  cohort = make_cohort(data, batch_size=4, steps=4)
  calls = []
  algo = algos.fedavg(_counting_loss(calls), client_optimizer=optax.sgd(0.1),
                      client_evaluation=False).compile(
      map_strategy=strategy, chunk_size=chunk, donate=False)
  state = algo.init(linreg_params(3))
  with frames.without_fusion():
    jax.block_until_ready(algo.round(state, cohort, jax.random.key(0)))
    calls.clear()
    jax.block_until_ready(algo.round(state, cohort, jax.random.key(0)))
  assert len(calls) == expected


def test_skipping_changes_no_number():
  """The round with padding skipped equals plain SGD on each client's own
  batches, weighted by example counts (a NumPy reference)."""
  rng = np.random.default_rng(1)
  sizes = [12, 4, 8, 3]
  data = linreg_data(rng, sizes, dim=3)
  cohort = make_cohort(data, batch_size=4, steps=8)
  params = linreg_params(3)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1),
                      client_evaluation=False).compile(map_strategy='sequential')
  new, _ = algo.round(algo.init(params), cohort, jax.random.key(0))
  models = []
  for d in data:
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    for s in range(0, len(d['y']), 4):
      x, y = d['x'][s:s + 4].astype(np.float64), d['y'][s:s + 4].astype(np.float64)
      r = x @ w['w'] + w['b'] - y
      w = {'w': w['w'] - 0.1 * x.T @ r / len(y), 'b': w['b'] - 0.1 * r.mean()}
    models.append(w)
  weights = np.asarray(sizes, np.float64) / sum(sizes)
  for k in ('w', 'b'):
    want = sum(wi * m[k] for wi, m in zip(weights, models))
    # 3 local steps of sums over 4 examples x 3 features, then a mean of 4.
    np.testing.assert_allclose(new.params[k], want, rtol=0,
                               atol=ft.atol(3 * 4 * 3 + 4, 10.0))


def test_cohorts_ordered_by_steps_give_the_same_round():
  rng = np.random.default_rng(2)
  sizes = np.array([5, 40, 12, 30, 1, 22, 9, 17])
  x = rng.normal(size=(sizes.sum(), 3)).astype(np.float32)
  y = rng.normal(size=sizes.sum()).astype(np.float32)
  data = datasets.from_arrays({'x': x, 'y': y}, groups=np.repeat(np.arange(8), sizes))
  ids = np.arange(8)
  plain = datasets.make_cohort(data, ids, 4, shuffle_seed=None)
  ordered = datasets.make_cohort(data, ids, 4, shuffle_seed=None, order_by_steps=True)
  steps = np.asarray(ordered.mask.any(-1).sum(-1))
  assert list(steps) == sorted(steps, reverse=True)
  np.testing.assert_array_equal(np.sort(ordered.client_ids), ids)
  np.testing.assert_array_equal(
      ordered.num_examples, plain.num_examples[np.asarray(ordered.client_ids)])
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1)).compile(
      map_strategy='chunked', chunk_size=2, donate=False)
  state = algo.init(linreg_params(3))
  a, _ = algo.round(state, jax.tree.map(jnp.asarray, plain), jax.random.key(0))
  b, _ = algo.round(state, jax.tree.map(jnp.asarray, ordered), jax.random.key(0))
  for u, v in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    # The same per-client models, averaged over 8 clients in another order.
    np.testing.assert_allclose(u, v, rtol=0, atol=ft.atol(2 * 8, 8 * 2.0))


@pytest.mark.parametrize('axis_type', [
    'Explicit', pytest.param('Auto', marks=pytest.mark.slow)])
def test_padding_is_skipped_on_a_clients_mesh(axis_type):
  """8 clients on 8 host devices, one per device, all in one chunk: of the
  S = 4 padded steps only the largest client's 3 are computed (each calls
  the loss's callback once for the chunk), on an Explicit mesh axis too
  (where the chunk's predicate is gathered, not psummed), and the round
  equals the one without a mesh."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  rng = np.random.default_rng(3)
  data = linreg_data(rng, [12, 4, 8, 8, 4, 4, 8, 12], dim=3)
  cohort = make_cohort(data, batch_size=4, steps=4)
  calls = []

  def loss(params, batch):
    jax.debug.callback(lambda: calls.append(1))
    return linreg_loss(params, batch)

  algo = algos.fedavg(loss, client_optimizer=optax.sgd(0.1),
                      client_evaluation=False).compile(map_strategy='vmap',
                                                       donate=False)
  state = algo.init(linreg_params(3))
  want, _ = algo.round(state, cohort, jax.random.key(0))
  mesh = jax.make_mesh((8,), ('clients',),
                       axis_types=(getattr(AxisType, axis_type),))
  with jax.set_mesh(mesh):
    placed = jax.device_put(cohort, NamedSharding(mesh, P('clients')))
    jax.block_until_ready(algo.round(state, placed, jax.random.key(0)))
    calls.clear()
    got, _ = algo.round(state, placed, jax.random.key(0))
    jax.block_until_ready(got)
  assert len(calls) == 3
  for u, v in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    # 3 local steps of sums over 4 examples x 3 features, a mean of 8.
    np.testing.assert_allclose(u, v, rtol=0, atol=ft.atol(3 * 4 * 3 + 8, 10.0))


def _scan_step(carry, x, active):
  """A step that leaves ``carry`` unchanged and returns zeros when inactive."""
  new = carry * 0.5 + jnp.sin(x)
  return jnp.where(active, new, carry), jnp.where(active, new.sum(), 0.0)


@pytest.mark.parametrize('s', [1, 2, 3, 7, 16, 23])
def test_scan_steps_equals_a_plain_scan_step_for_step(s):
  """The tree of branches gives the plain ``lax.scan``'s carry and stacked
  outputs exactly (the same operations in the same order), for S a power of
  two, a prime and 1, with padding anywhere (not only at the end)."""
  from fedjx.algorithms import client_update
  rng = np.random.default_rng(s)
  xs = jnp.asarray(rng.normal(size=(s, 3)), jnp.float32)
  active = jnp.asarray(rng.random(s) < 0.5)
  carry = jnp.asarray(rng.normal(size=3), jnp.float32)
  plain = jax.lax.scan(lambda c, a: _scan_step(c, *a), carry, (xs, active))
  tree = jax.jit(functools.partial(client_update.scan_steps, _scan_step))(
      carry, xs, active)
  for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(got, want)


def _counting(step_fn):
  """``step_fn`` that records each time it runs, and the list it records in."""
  steps = []

  def step(carry, x, active):
    jax.debug.callback(lambda: steps.append(1))
    return step_fn(carry, x, active)
  return step, steps


@pytest.mark.parametrize('s,real', [(16, 5), (16, 16), (16, 1), (23, 23), (16, 0)])
def test_a_round_enters_only_the_real_steps_and_no_branch(s, real):
  """Evaluated, the steps are a ``while`` loop over the real ones: each is
  entered once, no other, and no ``lax.cond`` is traced at all."""
  from fedjx.algorithms import client_update
  step, steps = _counting(_scan_step)
  active = jnp.arange(s) < real
  with mock.patch.object(jax.lax, 'cond', side_effect=AssertionError('cond')):
    out = jax.jit(functools.partial(client_update.scan_steps, step))(
        jnp.zeros(3), jnp.ones((s, 3)), active)
    jax.block_until_ready(out)
  assert len(steps) == real


@pytest.mark.parametrize('s,real,entered,skipped', [
    # S = 16 is a tree of depth 4. 5 real steps (0-4): the leaves 0-4 and,
    # above them, the nodes [0,16), [0,8), [0,4), [4,8), [4,6), [0,2), [2,4);
    # skipped: [8,16), [6,8), the leaf 5.
    (16, 5, 5, 3),
    (16, 16, 16, 0),
    (16, 1, 1, 4),   # [1], [2,4), [4,8), [8,16).
    (23, 23, 23, 2),  # Depth 5 covers 32: [24,32) and the leaf 23 are past S.
    (16, 0, 0, 1),   # The root.
])
def test_the_tree_of_a_derivative_enters_only_steps_up_to_the_last_real_one(
    s, real, entered, skipped):
  """The form differentiated (the tree of branches): the steps after a
  client's last real one are never entered, and they cost at most one
  skipped branch per level of the tree."""
  from fedjx.algorithms import client_update
  step, steps = _counting(_scan_step)
  skips = []
  real_cond = jax.lax.cond

  def counting_cond(pred, true_fn, false_fn, *operands):
    def skip(*ops):
      jax.debug.callback(lambda: skips.append(1))
      return false_fn(*ops)
    return real_cond(pred, true_fn, skip, *operands)

  active = jnp.arange(s) < real
  with mock.patch.object(jax.lax, 'cond', counting_cond):
    out = jax.jit(lambda c, x: client_update._tree_steps(step, c, x, active, active))(
        jnp.zeros(3), jnp.ones((s, 3)))
    jax.block_until_ready(out)
  assert len(steps) == entered
  assert len(skips) == skipped


def test_derivatives_reach_what_the_step_closes_over():
  """The step closes over a traced weight ``v`` and integer indices (as the
  client's step closes over its data): reverse mode through the jitted
  steps (whose derivative rule is traced after the jit's trace) matches
  finite differences and forward mode, and both match the plain ``scan``."""
  from fedjx.algorithms import client_update
  active = jnp.asarray([True, False, True, True, False])
  idx = jnp.asarray([4, 3, 2, 1, 0], jnp.int32)

  def rounds(v, x):
    def step(carry, i, on):
      new = carry * v[idx[i]] + jnp.sin(x[i])
      return jnp.where(on, new, carry), jnp.where(on, new.sum(), 0.0)
    c, ys = client_update.scan_steps(step, x[0] * 0.0, jnp.arange(5), active)
    plain_c, plain_ys = jax.lax.scan(lambda c, a: step(c, *a), x[0] * 0.0,
                                     (jnp.arange(5), active))
    return jnp.sum(c ** 2) + jnp.sum(ys), jnp.sum(plain_c ** 2) + jnp.sum(plain_ys)

  with jax.enable_x64():
    v = jnp.linspace(0.5, 0.9, 5, dtype=jnp.float64)
    x = jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float64).reshape(5, 3)
    f = jax.jit(lambda v, x: rounds(v, x)[0])
    check_grads(f, (v, x), order=2, modes=('fwd', 'rev'))
    got = jax.grad(f, argnums=(0, 1))(v, x)
    want = jax.grad(lambda v, x: rounds(v, x)[1], argnums=(0, 1))(v, x)
    for g, w in zip(got, want):
      # The same float64 operations in the same order.
      np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_gradients_flow_through_the_tree_of_steps():
  """Reverse and forward mode through the tree of steps (every level is
  ``scan`` and ``cond``), against finite differences."""
  from fedjx.algorithms import client_update
  active = jnp.asarray([True, True, False, True, False, False, False])

  def f(carry, xs):
    c, ys = client_update.scan_steps(_scan_step, carry, xs, active)
    return jnp.sum(c ** 2) + jnp.sum(ys)

  with jax.enable_x64():
    xs = jnp.linspace(-1.0, 1.0, 21, dtype=jnp.float64).reshape(7, 3)
    check_grads(f, (jnp.asarray([0.3, -0.2, 0.5], jnp.float64), xs), order=2,
                modes=('fwd', 'rev'))


_COLLECTIVES = ('all-reduce', 'all-gather', 'all-to-all', 'collective-permute',
                'reduce-scatter')


def _collectives_in_branches(hlo: str) -> list[str]:
  """The collectives of compiled HLO text that run inside a conditional's
  branch, however deeply nested (through loops, calls and fusions)."""
  import re  # pylint: disable=g-import-not-at-top
  bodies, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r'(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if name is None and head:
      name, bodies[head.group(1)] = head.group(1), []
    elif line.startswith('}'):
      name = None
    elif name is not None:
      bodies[name].append(line)
  single = r'(?:true_computation|false_computation|body|condition|calls|to_apply)=%?([\w.\-]+)'

  def called(lines, branches_only=False):
    out = []
    for line in lines:
      for group in re.findall(r'branch_computations=\{([^}]*)\}', line):
        out += [n.strip().lstrip('%') for n in group.split(',')]
      out += re.findall(r'(?:true_computation|false_computation)=%?([\w.\-]+)', line)
      if not branches_only:
        out += re.findall(single, line)
    return out

  seen, todo = set(), called([l for b in bodies.values() for l in b], branches_only=True)
  while todo:
    n = todo.pop()
    if n not in seen and n in bodies:
      seen.add(n)
      todo += called(bodies[n])
  return [l.strip() for n in seen for l in bodies[n]
          if any(f' {c}(' in l or f' {c}-start(' in l for c in _COLLECTIVES)]


@pytest.mark.parametrize('axis_type', ['Explicit', 'Auto'])
def test_no_collective_runs_inside_a_branch(axis_type):
  """The chunk's "any member needs this step" is combined across devices
  once, before the tree of steps: a collective in each of the tree's
  branches deadlocked a run of two processes on XLA:CPU, so the compiled round of
  8 clients on 8 devices has none there (while the skipping still works:
  ``test_padding_is_skipped_on_a_clients_mesh``)."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  rng = np.random.default_rng(3)
  cohort = make_cohort(linreg_data(rng, [12, 4, 8, 8, 4, 4, 8, 12], dim=3),
                       batch_size=4, steps=4)
  algo = algos.fedavg(linreg_loss, client_optimizer=optax.sgd(0.1)).compile(
      map_strategy='vmap', donate=False)
  state = algo.init(linreg_params(3))
  mesh = jax.make_mesh((8,), ('clients',), axis_types=(getattr(AxisType, axis_type),))
  with jax.set_mesh(mesh):
    placed = jax.device_put(cohort, NamedSharding(mesh, P('clients')))
    hlo = jax.jit(algo.round).lower(state, placed, jax.random.key(0)).compile().as_text()
  assert 'conditional(' in hlo          # The steps are still skipped by branches,
  assert any(f' {c}(' in hlo or f' {c}-start(' in hlo for c in _COLLECTIVES)  # across devices,
  assert _collectives_in_branches(hlo) == []  # with every collective outside them.
