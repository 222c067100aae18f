"""Every reduction of every dtype: jnp's promotion, exact values, every path.

For each reduction and dtype, abstract evaluation, eager execution, the jitted
CPU lowering, the lowering of the other backends (exported for CUDA, which
needs no GPU), JVP and transpose must agree on the output dtype, and that
dtype is what ``jnp.sum`` / ``jnp.mean`` / ``jnp.average`` give.

The values are small integers (0..3, weights 1..4), so every sum and mean is
exact in every dtype (bfloat16 holds integers up to 256 exactly, and the
means divide by N = 4). The weighted mean divides by the total weight: one
rounding of ``1 / total`` and one of the product, so it is within
``2 eps`` of the float64 value; the assertions allow ``4 eps``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx

N = 4
DTYPES = ['bool', 'int8', 'uint8', 'int16', 'int32', 'float16', 'bfloat16', 'float32']
X64_DTYPES = ['bool', 'int8', 'int32', 'int64', 'uint8', 'float32', 'float64']
REDUCTIONS = ['sum', 'mean', 'weighted_mean']


def _reduce(op, x, w):
  if op == 'sum':
    return fedjx.reduce_sum(x)
  if op == 'mean':
    return fedjx.reduce_mean(x)
  return fedjx.reduce_weighted_mean(x, w)


def _jnp_reference(op, x, w):
  if op == 'sum':
    return jnp.sum(x, axis=0)
  if op == 'mean':
    return jnp.mean(x, axis=0)
  return jnp.average(x, axis=0, weights=w)


def _numpy_reference(op, x, w):
  x = np.asarray(x, np.float64)
  if op == 'sum':
    return x.sum(0)
  if op == 'mean':
    return x.mean(0)
  w = np.asarray(w, np.float64)
  return np.tensordot(w, x, axes=1) / w.sum()


def _data(dtype, weight_dtype):
  rng = np.random.default_rng(0)
  x = rng.integers(0, 4, size=(N, 3, 2))
  x = (x % 2 == 1) if dtype == 'bool' else x
  w = np.arange(1, N + 1)
  return jnp.asarray(x, dtype), jnp.asarray(w, weight_dtype)


def _tolerance(dtype):
  if not jnp.issubdtype(dtype, jnp.inexact):
    return 0.0
  return 4 * float(jnp.finfo(dtype).eps)


def _check(op, dtype, weight_dtype):
  x, w = _data(dtype, weight_dtype)
  program = fedjx.program(lambda x, w: _reduce(op, x, w), clients=N)
  want_dtype = jax.eval_shape(lambda x, w: _jnp_reference(op, x, w), x, w).dtype
  want = _numpy_reference(op, x, w)
  assert jax.eval_shape(program, x, w).dtype == want_dtype, (op, dtype)
  for fn in (program, jax.jit(program)):
    got = fn(x, w)
    assert got.dtype == want_dtype, (op, dtype, fn)
    tol = _tolerance(want_dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
  # The lowering used on GPU/TPU (exported for CUDA; nothing runs on a GPU).
  exported = jax.export.export(jax.jit(program), platforms=('cuda',))(x, w)
  assert exported.out_avals[0].dtype == want_dtype
  if jnp.issubdtype(x.dtype, jnp.inexact):
    _, tangent = jax.jvp(lambda v: program(v, w), (x,), (jnp.ones_like(x),))
    assert tangent.dtype == want_dtype
    ones = np.ones(want.shape)
    np.testing.assert_allclose(np.asarray(tangent, np.float64),
                               _numpy_reference(op, ones[None].repeat(N, 0), w),
                               rtol=_tolerance(want_dtype))
    (cotangent,) = jax.linear_transpose(lambda v: program(v, w), x)(
        jnp.ones(want.shape, want_dtype))
    assert cotangent.dtype == x.dtype
    scale = {'sum': np.ones(N), 'mean': np.full(N, 1 / N),
             'weighted_mean': np.asarray(w, np.float64) / float(np.sum(w))}[op]
    np.testing.assert_allclose(
        np.asarray(cotangent, np.float64),
        np.broadcast_to(scale[:, None, None], x.shape), rtol=_tolerance(x.dtype))


@pytest.mark.parametrize('op', REDUCTIONS)
@pytest.mark.parametrize('dtype', DTYPES)
def test_every_reduction_of_every_dtype(op, dtype):
  _check(op, dtype, 'float32')
  if op == 'weighted_mean' and dtype != 'bool':
    _check(op, dtype, dtype)


@pytest.mark.parametrize('op', REDUCTIONS)
def test_every_reduction_of_every_dtype_with_x64(op):
  with jax.enable_x64(True):
    for dtype in X64_DTYPES:
      _check(op, dtype, 'float32')
      if op == 'weighted_mean':
        _check(op, dtype, 'float64')


def test_interpreters_give_the_same_dtypes_and_values():
  """Beam's combiners, the reference interpreter and a split round, on every
  dtype at once, equal the jitted program (exact on these small integers)."""
  fedjx_beam = pytest.importorskip('fedjx.beam')
  from fedjx import export as fedjx_export
  from fedjx import plan as plan_lib

  data = {d: _data(d, 'float32')[0] for d in DTYPES}
  weights = _data('int8', 'float32')[1]

  @fedjx.program(clients=N)
  def program(data, weights):
    local = fedjx.map_fn(lambda x: x, data)
    return {op: {d: _reduce(op, x, weights) for d, x in local.items()} for op in REDUCTIONS}

  want = jax.jit(program)(data, weights)
  plan = plan_lib.trace_plan_with_clients(program, (data, weights), client_args=(0, 1))
  evaluated = jax.tree.unflatten(
      plan.out_tree, plan_lib.evaluate(plan, *jax.tree.leaves((data, weights))))
  split = fedjx_export.split_round(program, data, weights, client_args=(0, 1))
  exported = split.run([], [np.asarray(x) for x in jax.tree.leaves((data, weights))])
  beam = fedjx_beam.run(program, fedjx_beam.ClientData.from_arrays(data),
                        fedjx_beam.ClientData.from_arrays(weights))
  for got in (evaluated, exported, beam):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert np.asarray(g).dtype == w.dtype
      tol = _tolerance(w.dtype)
      np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                 rtol=tol, atol=tol)
