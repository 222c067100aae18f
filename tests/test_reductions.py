"""One semantics of the reductions, computed by four executors.

The compiled primitives, fused chunks, the streaming executor and the host
interpreter (``plan.evaluate``, as Beam and export) each reduce the same
terms; fedjx.reductions states the bound by which they may differ, tested
here against a float64 NumPy reference, with the zero-weight rule and the
result dtypes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx
import float_tolerance as ft
from fedjx import reductions
from fedjx import streaming
from fedjx.interpreters import plan as plan_lib

N, DIM, CHUNK = 37, 5, 8  # 37 clients: chunks of 8 leave a partial last one.


def _round(xs, ws):
  values = fedjx.map_fn(lambda x, w: (x * 1.0, w * 1.0), (xs, ws))
  return (fedjx.reduce_sum(values[0]), fedjx.reduce_mean(values[0]),
          fedjx.reduce_weighted_mean(*values))


def _executors(xs, ws):
  """``{executor: (sum, mean, weighted mean)}``."""
  compiled = jax.jit(fedjx.program(_round, clients=N, map_strategy='vmap'))
  fused = jax.jit(fedjx.program(_round, clients=N, map_strategy='chunked',
                                chunk_size=CHUNK))
  plan = plan_lib.trace_plan_with_clients(
      fedjx.program(_round, clients=N), (xs, ws), client_args=(0, 1))
  return {
      'compiled': compiled(xs, ws),
      'fused': fused(xs, ws),
      'streaming': streaming.run(
          fedjx.program(_round, clients=N),
          streaming.Clients.from_arrays(xs), streaming.Clients.from_arrays(ws),
          chunk_size=CHUNK),
      'host': plan_lib.evaluate(plan, xs, ws),
  }


def test_every_executor_is_within_the_stated_bound_of_the_exact_value():
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(N, DIM)).astype(np.float32)
  ws = rng.uniform(0.5, 2.0, size=N).astype(np.float32)
  x64, w64 = xs.astype(np.float64), ws.astype(np.float64)
  exact = (x64.sum(0), x64.mean(0), (w64[:, None] * x64).sum(0) / w64.sum())
  # gamma_N sum_i |w_i x_i| (over sum_i w_i for the mean and weighted mean),
  # plus the rounding of the result to float32. The weighted mean also
  # divides a rounded sum by a rounded sum of N weights.
  abs_sum = np.abs(x64).sum(0)
  bounds = (ft.gamma(N) * abs_sum + ft.U32 * np.abs(exact[0]),
            ft.gamma(N) * abs_sum / N + ft.U32 * np.abs(exact[1]),
            ft.gamma(N + 2) * (np.abs(w64[:, None] * x64).sum(0) / w64.sum()
                               + np.abs(exact[2])) + ft.U32 * np.abs(exact[2]))
  results = _executors(jnp.asarray(xs), jnp.asarray(ws))
  for name, values in results.items():
    for got, want, bound, what in zip(values, exact, bounds,
                                      ('sum', 'mean', 'weighted_mean')):
      assert np.asarray(got).dtype == np.float32, (name, what)
      err = np.abs(np.asarray(got, np.float64) - want)
      assert np.all(err <= bound), (name, what, err.max(), bound.min())
  # Any two executors: within the sum of their bounds.
  for a in results.values():
    for b in results.values():
      for ga, gb, bound in zip(a, b, bounds):
        assert np.all(np.abs(np.asarray(ga, np.float64) - np.asarray(gb)) <= 2 * bound)


def test_the_zero_weight_rule_holds_in_every_executor():
  xs = jnp.asarray(np.random.default_rng(1).normal(size=(N, DIM)), jnp.float32)
  ws = jnp.zeros(N, jnp.float32)
  for name, (_, _, weighted) in _executors(xs, ws).items():
    np.testing.assert_array_equal(np.asarray(weighted), np.zeros(DIM), err_msg=name)


@pytest.mark.parametrize('x_dtype,w_dtype', [
    (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
    (jnp.int32, jnp.float32), (jnp.bool_, None), (jnp.int8, None)])
def test_result_dtypes_are_jnps(x_dtype, w_dtype):
  x = jnp.ones((3, 2), x_dtype)
  assert reductions.result_dtype('sum', x_dtype) == jnp.sum(x, 0).dtype
  assert reductions.result_dtype('mean', x_dtype) == jnp.mean(x, 0).dtype
  if w_dtype is not None:
    w = jnp.ones(3, w_dtype)
    assert (reductions.result_dtype('weighted_mean', x_dtype, w_dtype) ==
            jnp.average(x, 0, weights=w).dtype)


def test_accumulators():
  assert reductions.carry_dtype(jnp.bfloat16) == jnp.float32
  assert reductions.carry_dtype(jnp.int32) == jnp.int32
  assert reductions.host_accumulator_dtype(np.float32) == np.float64
  assert reductions.host_accumulator_dtype(np.uint8) == np.uint64
  assert reductions.host_accumulator_dtype(np.bool_) == np.int64
  with pytest.raises(ValueError, match="kind='median'"):
    reductions.result_dtype('median', jnp.float32)


def test_compensated_sums_do_not_grow_their_error_with_the_count():
  """10,000 additions of 0.1 to 1e4 in float32: compensated, one rounding."""
  state = (jnp.float32(1e4), jnp.float32(0))
  add = jax.jit(reductions.compensated_add)
  for _ in range(10_000):
    state = add(state, jnp.float32(0.1))
  exact = 1e4 + 10_000 * float(np.float32(0.1))
  assert abs(float(state[0]) + float(state[1]) - exact) <= 2 * ft.U32 * exact
