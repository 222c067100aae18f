"""The primitives compose with JAX's control flow and transformations.

Every map strategy (fused or not) x every placement of control flow around
or inside a program x (jit, eager, grad, jvp, hessian) gives the numbers of
the same computation written in plain JAX.

The client computation is ``y_i = tanh(w * x_i)`` with weight
``v_i = 1 + |x_i|^2``, and a round is
``g(w) = sum_i v_i y_i / sum_i v_i + sum_i y_i / (2 n)`` (a weighted mean and
a sum, both of them fusable). Each construct applies ``g`` one way or
another (two steps of a scan, a branch of a cond, ...), once written with
``broadcast`` / ``map_fn`` / the reductions and once with ``jnp`` alone.

Tolerance: each result is a short chain of sums of ``n = 6`` client terms,
computed in a different order by fused chunks, ``lax.map`` and ``vmap``; the
constructs chain at most 2 rounds and the derivative modes differentiate at
most twice, each of which at most doubles the stages whose rounding errors
add (float_tolerance's chain rule). Terms are O(1) (tanh and weights of a few
units; 8 stages of 6 terms of magnitude <= 4 each), so the absolute bound is
``atol(8 * 6, 8 * 6 * 4)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fedjx
import float_tolerance as ft
from fedjx import fusion
from fedjx import placements as placements_lib
from fedjx.interpreters import plan as plan_lib

N = 6
DIM = 3
ATOL = ft.atol(8 * N, 8 * N * 4.0)

STRATEGIES = [('vmap', None, True), ('auto', None, True), ('chunked', 4, True), ('sequential', None, True),
              ('chunked', 2, False), ('sequential', None, False)]


def _client(w, x):
  return jnp.tanh(w * x), 1.0 + jnp.sum(x * x)


def _round_fedjx(w, xs):
  ys, vs = fedjx.map_fn(_client, (fedjx.broadcast(w), xs))
  return (fedjx.reduce_weighted_mean(ys, vs) +
          fedjx.reduce_sum(ys) / (2 * N))


def _round_jnp(w, xs):
  ys, vs = jax.vmap(_client, in_axes=(None, 0))(w, xs)
  return (jnp.sum(vs[:, None] * ys, 0) / jnp.sum(vs) +
          jnp.sum(ys, 0) / (2 * N))


def _custom_vjp_of(g, enter=lambda f: f):
  """``g`` with a custom VJP that is ``g``'s own VJP.

  JAX calls the backward rule while transposing, after the program that
  called ``g`` has returned, so a backward rule that uses the primitives
  enters the placement itself (``enter`` makes it a program).
  """
  @jax.custom_vjp
  def f(w, xs):
    return g(w, xs)

  def fwd(w, xs):
    return g(w, xs), (w, xs)

  @enter
  def bwd_in_program(w, xs, ct):
    _, pullback = jax.vjp(lambda w: g(w, xs), w)
    return pullback(ct)[0]

  def bwd(res, ct):
    w, xs = res
    return bwd_in_program(w, xs, ct), jnp.zeros_like(xs)

  f.defvjp(fwd, bwd)
  return f


# Constructs with the map *inside* control flow: ``c(g)(w, xs)`` where ``g``
# is one round. ``differentiable`` says whether reverse mode applies.
INSIDE = {
    'scan': lambda g: lambda w, xs: lax.scan(
        lambda c, _: (c - 0.3 * g(c, xs), None), w, None, length=2)[0],
    'cond': lambda g: lambda w, xs: lax.cond(
        jnp.sum(w) > 0, lambda w: g(w, xs), lambda w: -w, w),
    'switch': lambda g: lambda w, xs: lax.switch(
        1, [lambda w: w, lambda w: g(w, xs)], w),
    'fori_loop': lambda g: lambda w, xs: lax.fori_loop(
        0, 2, lambda i, c: c - 0.3 * g(c, xs), w),
    'while_loop': lambda g: lambda w, xs: lax.while_loop(
        lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] - 0.3 * g(c[1], xs)),
        (0, w))[1],
    'checkpoint': lambda g: lambda w, xs: jax.checkpoint(g)(w, xs),
    'custom_vjp': _custom_vjp_of,
    'inner_jit': lambda g: lambda w, xs: jax.jit(g)(w, xs),
    'inner_vmap': lambda g: lambda w, xs: jnp.mean(jax.vmap(
        g, in_axes=(0, None))(jnp.stack([w, 2 * w]), xs), 0),
    'cond_in_scan': lambda g: lambda w, xs: lax.scan(
        lambda c, _: (lax.cond(jnp.sum(c) > -100, lambda c: c - 0.3 * g(c, xs),
                               lambda c: c, c), None), w, None, length=2)[0],
}
NOT_REVERSE = {'while_loop'}
NOT_FORWARD = {'custom_vjp', 'custom_vjp_of_program'}


def _as_program(body, strategy, chunk, fuse):
  return fedjx.program(body, clients=N, map_strategy=strategy,
                       chunk_size=chunk, fuse=fuse)


def _inside(construct, strategy, chunk, fuse):
  if construct == 'custom_vjp':
    body = _custom_vjp_of(
        _round_fedjx, lambda f: _as_program(f, strategy, chunk, fuse))
  else:
    body = INSIDE[construct](_round_fedjx)
  return (_as_program(body, strategy, chunk, fuse),
          INSIDE[construct](_round_jnp))


def _outside(construct, strategy, chunk, fuse):
  """The whole program placed inside control flow or a transformation."""
  program = _as_program(_round_fedjx, strategy, chunk, fuse)
  wrap = {
      'scan_over_program': INSIDE['scan'],
      'checkpoint_of_program': INSIDE['checkpoint'],
      'cond_around_program': INSIDE['cond'],
      'vmap_over_program': INSIDE['inner_vmap'],
      'custom_vjp_of_program': INSIDE['custom_vjp'],
  }[construct]
  return wrap(program), wrap(_round_jnp)


OUTSIDE = ['scan_over_program', 'checkpoint_of_program', 'cond_around_program',
           'vmap_over_program', 'custom_vjp_of_program']
MODES = ['jit', 'eager', 'grad', 'jvp', 'hessian']


def _evaluate(f, mode, w, xs):
  scalar = lambda w: jnp.sum(f(w, xs) ** 2)
  if mode == 'jit':
    return jax.jit(f)(w, xs)
  if mode == 'eager':
    return f(w, xs)
  if mode == 'grad':
    return jax.jit(jax.grad(scalar))(w)
  if mode == 'jvp':
    return jax.jit(lambda w: jax.jvp(lambda w: f(w, xs), (w,),
                                     (jnp.ones_like(w),)))(w)
  return jax.jit(jax.hessian(scalar))(w)


def _data():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=DIM), jnp.float32)
  xs = jnp.asarray(rng.normal(size=(N, DIM)), jnp.float32)
  return w, xs


def _check(build, construct, mode, strategy, chunk, fuse):
  if mode in ('grad', 'hessian') and construct in NOT_REVERSE:
    pytest.skip('JAX has no reverse mode for while_loop')
  if mode == 'jvp' and construct in NOT_FORWARD:
    pytest.skip('JAX has no forward mode for custom_vjp')
  w, xs = _data()
  program, reference = build(construct, strategy, chunk, fuse)
  got = _evaluate(program, mode, w, xs)
  want = _evaluate(reference, mode, w, xs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL)


def _ids(strategies):
  return [f'{s}{"" if c is None else c}{"" if f else "-unfused"}'
          for s, c, f in strategies]


def _modes_by_strategies():
  """``(mode, strategy, chunk, fuse)`` cases: all of them with the slow
  tests; in the default run, every strategy under jit and grad and the other
  modes (eager, jvp, hessian) under vmap and fused chunks."""
  cases = []
  for mode in MODES:
    for (s, c, f), name in zip(STRATEGIES, _ids(STRATEGIES)):
      # Every strategy under jit and grad; the other modes by default for
      # one unchunked and one fused chunked strategy.
      slow = mode not in ('jit', 'grad') and name not in ('vmap', 'chunked4')
      cases.append(pytest.param(mode, s, c, f, id=f'{mode}-{name}',
                                marks=[pytest.mark.slow] if slow else []))
  return cases


MODES_BY_STRATEGIES = _modes_by_strategies()


@pytest.mark.parametrize('mode,strategy,chunk,fuse', MODES_BY_STRATEGIES)
@pytest.mark.parametrize('construct', sorted(INSIDE))
def test_map_fn_inside_control_flow(construct, mode, strategy, chunk, fuse):
  _check(_inside, construct, mode, strategy, chunk, fuse)


@pytest.mark.parametrize('mode,strategy,chunk,fuse', MODES_BY_STRATEGIES)
@pytest.mark.parametrize('construct', OUTSIDE)
def test_program_inside_control_flow(construct, mode, strategy, chunk, fuse):
  _check(_outside, construct, mode, strategy, chunk, fuse)


def test_fedavg_rounds_in_a_scan_under_auto_with_large_clients():
  """Three FedAvg rounds in one program over clients that ``auto`` chunks.

  Each client holds ``[100, 784]`` float32 inputs (314 kB), above the size
  for which ``auto`` runs every client at once on the CPU, so the map inside
  the scan runs in chunks; the reference is the same rounds in plain JAX.
  Tolerance: per round, 2 SGD steps (a 784-term dot product, then a mean
  over 50 examples) and a mean over 8 clients; 3 rounds add their terms
  (float_tolerance's chain rule). The terms the weights are made of are the
  updates ``0.1 * g``, where a gradient entry averages ``|r x| < 0.1``
  (residuals of order 1, inputs of order ``784^-1/2``): 6 of them of at most
  0.01 each, against weights of order 1e-3.
  """
  n, dim = 8, 784
  rng = np.random.default_rng(1)
  xs = jnp.asarray(rng.normal(size=(n, 2, 50, dim)) / np.sqrt(dim), jnp.float32)
  ys = jnp.asarray(rng.normal(size=(n, 2, 50)), jnp.float32)
  w0 = jnp.zeros(dim, jnp.float32)

  def client(w, x, y):
    def step(w, batch):
      bx, by = batch
      g = jax.grad(lambda w: jnp.mean((bx @ w - by) ** 2))(w)
      return w - 0.1 * g, None
    return lax.scan(step, w, (x, y))[0]

  @jax.jit
  @fedjx.program(clients=n, map_strategy='auto')
  def rounds(w):
    def one(w, _):
      new = fedjx.map_fn(client, (fedjx.broadcast(w), xs, ys))
      return fedjx.reduce_mean(new), None
    return lax.scan(one, w, None, length=3)[0]

  def reference(w):
    for _ in range(3):
      w = jnp.mean(jax.vmap(client, in_axes=(None, 0, 0))(w, xs, ys), 0)
    return w

  assert fedjx.mapping.choose_chunk_size('auto', n, 2 * 50 * (dim + 1) * 4, 1,
                                         backend='cpu') < n
  want = reference(w0)
  assert float(jnp.max(jnp.abs(want))) > 1e-3  # The bound below is ~3% of it.
  np.testing.assert_allclose(rounds(w0), want, rtol=0,
                             atol=ft.atol(3 * (8 + 2 * (50 + dim)), 3 * 2 * 0.01))


def test_a_map_that_fusion_cannot_reach_logs_why(caplog):
  w, xs = _data()
  program, _ = _inside('scan', 'chunked', 2, True)
  with caplog.at_level('DEBUG', logger='fedjx.fusion'):
    jax.jit(program)(w, xs)
  assert any('runs unfused in chunks of 2' in r.getMessage() for r in caplog.records)


def test_top_level_maps_are_still_fused():
  """Fusion still carries the reductions of a map outside control flow.

  Fused, the reductions are consumed by the loop over chunks and never
  appear as equations; unfused, they do.
  """
  w, xs = _data()

  def reductions(fuse):
    jaxpr = jax.make_jaxpr(_as_program(_round_fedjx, 'chunked', 2, fuse))(w, xs)
    return {e.primitive.name for e in jaxpr.jaxpr.eqns} & {
        'fedjx_reduce_sum', 'fedjx_reduce_weighted_mean'}

  assert not reductions(True)
  assert reductions(False) == {'fedjx_reduce_sum', 'fedjx_reduce_weighted_mean'}


@pytest.mark.parametrize('mode', ['jit', 'grad', 'jvp', 'vmap', 'scan'])
def test_a_recorded_map_bound_anywhere_runs_as_the_unfused_loop(mode):
  """The recorded-map equation lowers, differentiates and batches by itself.

  :func:`fedjx.fusion.evaluate` consumes every such equation; these rules
  are what keeps one that is bound elsewhere from raising.
  """
  w, xs = _data()

  def recorded(w, xs):
    recorder = fusion.Recorder()
    recorder.active = True
    with placements_lib.placement_context({'clients': N}):
      ys = recorder.record(lambda placed, shared: jnp.tanh(shared[0] * placed[0]),
                           [xs], [w], N, 2, 'clients')
    return jnp.sum(ys, 0)

  reference = lambda w, xs: jnp.sum(jnp.tanh(w * xs), 0)
  if mode == 'jit':
    got, want = jax.jit(recorded)(w, xs), reference(w, xs)
  elif mode == 'grad':
    got = jax.grad(lambda w: jnp.sum(recorded(w, xs) ** 2))(w)
    want = jax.grad(lambda w: jnp.sum(reference(w, xs) ** 2))(w)
  elif mode == 'jvp':
    got = jax.jvp(lambda w: recorded(w, xs), (w,), (jnp.ones_like(w),))
    want = jax.jvp(lambda w: reference(w, xs), (w,), (jnp.ones_like(w),))
  elif mode == 'vmap':
    ws = jnp.stack([w, -w])
    got = jax.vmap(recorded, in_axes=(0, None))(ws, xs)
    want = jax.vmap(reference, in_axes=(0, None))(ws, xs)
  else:
    got = lax.scan(lambda c, _: (recorded(c, xs), None), w, None, length=2)[0]
    want = lax.scan(lambda c, _: (reference(c, xs), None), w, None, length=2)[0]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


# What an interpreter's plan does with each construct around a map: the
# constructs whose value is their body's are planned as the body; loops and
# branches are refused in one line naming them.
PLANNED = {'checkpoint', 'custom_vjp', 'inner_jit', 'inner_vmap'}
REFUSED_AS = {'scan': 'scan', 'cond': 'cond', 'switch': 'cond',
              'fori_loop': 'scan', 'while_loop': 'while', 'cond_in_scan': 'scan'}


@pytest.mark.parametrize('construct', sorted(INSIDE))
def test_plans_of_control_flow_are_right_or_refused_in_one_line(construct):
  assert set(INSIDE) == PLANNED | set(REFUSED_AS)
  w, xs = _data()
  program, reference = _inside(construct, 'vmap', None, True)
  if construct in PLANNED:
    plan = plan_lib.trace_plan_with_clients(program, (w, xs), client_args=(1,))
    assert plan.num_clients == N
    assert any(isinstance(s, plan_lib.MapStep) for s in plan.steps)
    got = plan_lib.evaluate(plan, w, xs)
    np.testing.assert_allclose(got[0], reference(w, xs), rtol=0, atol=ATOL)
  else:
    with pytest.raises(plan_lib.UnplaceableOperationError) as info:
      plan_lib.trace_plan_with_clients(program, (w, xs), client_args=(1,))
    message = str(info.value)
    assert '\n' not in message
    assert message.startswith(f"fedjx: '{REFUSED_AS[construct]}' at "
                              'test_composition_matrix.py:')
    assert 'inside a loop or a branch' in message


@pytest.mark.parametrize('strategy,chunk,fuse', STRATEGIES, ids=_ids(STRATEGIES))
@pytest.mark.parametrize('mode', ['jit', 'eager', 'grad', 'jvp'])
def test_map_fn_inside_a_nested_program(mode, strategy, chunk, fuse):
  """Two silos, each a program over its own clients (hierarchical FL)."""
  w, xs = _data()
  silo_xs = jnp.stack([xs, 2 * xs])

  inner = _as_program(_round_fedjx, strategy, chunk, fuse)

  @fedjx.program(placements={'silos': 2}, map_strategy=strategy, chunk_size=chunk,
                 fuse=fuse)
  def hierarchical(w, silo_xs):
    per_silo = fedjx.map_fn(inner, (fedjx.broadcast(w, placement='silos'), silo_xs),
                            placement='silos')
    return fedjx.reduce_mean(per_silo, placement='silos')

  def reference(w, silo_xs):
    return jnp.mean(jax.vmap(_round_jnp, in_axes=(None, 0))(w, silo_xs), 0)

  got = _evaluate(hierarchical, mode, w, silo_xs)
  want = _evaluate(reference, mode, w, silo_xs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL)
