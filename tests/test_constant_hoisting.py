"""fedjx.constant_hoisting: closed-over arrays become arguments of the program.

References: the same function written with the array as an explicit
argument under ``jax.jit`` (the same operations, so equal results to the
last bit), and the program text (no constant of the array's size in it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjx import algorithms
from fedjx import constant_hoisting
from fedjx import datasets

_N = 256  # A [256, 256] float32 constant: 256 KiB, far above JAX's inlining limit.


def _frozen():
  return jnp.asarray(np.random.default_rng(0).normal(size=(_N, _N)).astype(np.float32))


def _explicit(frozen, x, y):
  return {'h': jnp.tanh(x @ frozen) * y, 's': jnp.sum(frozen * y)}


def _no_big_constant(text):
  """Whether the lowered module embeds no constant of ``_N * _N`` values."""
  return not any('constant' in line and f'tensor<{_N}x{_N}xf32>' in line
                 for line in text.split('\n'))


def test_equals_the_array_passed_explicitly():
  frozen = _frozen()
  fn = lambda x, y: _explicit(frozen, x, y)
  x, y = jnp.ones((3, _N)) * 0.01, jnp.float32(2.0)
  want = jax.jit(_explicit)(frozen, x, y)
  got = constant_hoisting.jit(fn)(x, y)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)
  assert _no_big_constant(constant_hoisting.jit(fn).lower(x, y).as_text())
  assert not _no_big_constant(jax.jit(fn).lower(x, y).as_text())  # The check can fail.


def test_constants_of_a_nested_jit_are_hoisted():
  frozen = _frozen()
  inner = jax.jit(lambda x, y: _explicit(frozen, x, y))
  fn = lambda x, y: inner(jnp.sin(x), y)
  x, y = jnp.ones((3, _N)) * 0.01, jnp.float32(2.0)
  want = jax.jit(lambda f, x, y: _explicit(f, jnp.sin(x), y))(frozen, x, y)
  for g, w in zip(jax.tree.leaves(constant_hoisting.jit(fn)(x, y)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)
  assert _no_big_constant(constant_hoisting.jit(fn).lower(x, y).as_text())
  assert not _no_big_constant(jax.jit(fn).lower(x, y).as_text())


def test_numpy_constants_are_hoisted_too():
  frozen = np.asarray(_frozen())
  fn = lambda x: x @ frozen
  x = jnp.ones((2, _N))
  got = constant_hoisting.jit(fn)(x)
  np.testing.assert_array_equal(got, jax.jit(jnp.matmul)(x, jnp.asarray(frozen)))
  assert _no_big_constant(constant_hoisting.jit(fn).lower(x).as_text())


def test_one_trace_per_signature_and_donation():
  frozen = _frozen()
  hoisted = constant_hoisting.jit(lambda x, y: _explicit(frozen, x, y), donate_argnums=(0,))
  for rows in (3, 3, 5):
    x = jnp.ones((rows, _N))
    hoisted(x, 1.0)
    assert x.is_deleted()  # Donated.
  assert not frozen.is_deleted()  # A constant is never donated.
  assert hoisted._cache_size() == 2  # pylint: disable=protected-access


def test_lower_compile_and_call_with_shapes():
  frozen = _frozen()
  fn = lambda x, y: _explicit(frozen, x, y)
  hoisted = constant_hoisting.jit(fn)
  spec = jax.ShapeDtypeStruct((4, _N), jnp.float32)
  compiled = hoisted.lower(spec, jax.ShapeDtypeStruct((), jnp.float32)).compile()
  # The constant is an argument of the executable: its bytes are counted there.
  assert compiled.memory_analysis().argument_size_in_bytes >= frozen.nbytes
  x = jnp.full((4, _N), 0.02)
  want = jax.jit(_explicit)(frozen, x, jnp.float32(3.0))
  for g, w in zip(jax.tree.leaves(compiled(x, jnp.float32(3.0))), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)
  assert hoisted._cache_size() == 0  # pylint: disable=protected-access


def test_under_grad_and_vmap():
  frozen = _frozen()
  hoisted = constant_hoisting.jit(lambda x, y: _explicit(frozen, x, y))
  x = jnp.ones((2, _N)) * 0.01
  dy = jax.grad(lambda y: hoisted(x, y)['s'])(1.5)
  np.testing.assert_array_equal(dy, jax.grad(lambda y: jax.jit(_explicit)(frozen, x, y)['s'])(1.5))
  ys = jnp.arange(3.0)
  np.testing.assert_array_equal(
      jax.vmap(lambda y: hoisted(x, y)['h'])(ys),
      jax.vmap(lambda y: jax.jit(_explicit)(frozen, x, y)['h'])(ys))


def test_closing_over_a_value_of_an_enclosing_trace():
  @jax.jit
  def outer(y):
    return constant_hoisting.jit(lambda x: x * y)(jnp.arange(3.0))
  np.testing.assert_array_equal(outer(2.0), np.arange(3.0) * 2.0)

  def lower_inside(y):
    constant_hoisting.jit(lambda x: x * y).lower(jnp.arange(3.0))
    return y
  with pytest.raises(ValueError, match='enclosing trace'):
    jax.jit(lower_inside)(2.0)


def test_a_round_whose_loss_closes_over_a_frozen_model():
  # A frozen feature map under a trained linear head: the frozen array is an
  # argument of the compiled round, and the round equals its eager
  # evaluation (float32, sums over at most 8 * 256 terms).
  frozen = _frozen() / np.sqrt(_N)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(96, _N)).astype(np.float32)
  y = rng.integers(0, 4, size=96).astype(np.int32)

  def loss(params, batch):
    logits = jnp.tanh(batch['x'] @ frozen) @ params['w']
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])

  data = datasets.from_arrays({'x': x, 'y': y}, groups=np.arange(96) % 4)
  cohort = datasets.make_cohort(data, [0, 1, 2, 3], batch_size=8)
  algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1))
  params = {'w': jnp.zeros((_N, 4))}
  key = jax.random.key(0)
  with jax.disable_jit():
    want, _ = algo.apply(algo.init(params), cohort, key)
  got, _ = algo.round(algo.init(params), cohort, key)
  tol = 8 * _N * np.finfo(np.float32).eps
  np.testing.assert_allclose(got.params['w'], want.params['w'], rtol=tol, atol=tol)
  text = algo.round.lower(algo.init(params), cohort, key).as_text()
  assert _no_big_constant(text)


def _small_round():
  rng = np.random.default_rng(2)
  data = datasets.from_arrays(
      {'x': rng.normal(size=(24, 3)).astype(np.float32),
       'y': rng.normal(size=(24,)).astype(np.float32)}, groups=np.arange(24) % 4)
  cohort = datasets.make_cohort(data, [0, 1, 2, 3], batch_size=3)
  loss = lambda p, b: (b['x'] @ p['w'] - b['y']) ** 2
  algo = algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1))
  return algo, {'w': jnp.zeros(3)}, cohort, jax.random.key(0)


def test_reusing_a_donated_state_is_one_line_naming_the_fix(capfd):
  algo, params, cohort, key = _small_round()
  state = algo.init(params)
  new, _ = algo.round(state, cohort, key)
  with pytest.raises(constant_hoisting.DeletedArgumentError) as e:
    algo.round(state, cohort, key)
  text = str(e.value)
  assert '\n' not in text and 'algo.apply' in text and 'donate=False' in text
  assert 'fedavg_round: argument 0' in text
  with pytest.raises(constant_hoisting.DeletedArgumentError, match='algo.apply'):
    algo.run_rounds(state, jax.tree.map(lambda x: x[None], cohort), key[None])
  # The check comes before XLA sees the buffer: XLA logs nothing.
  assert 'Buffer has been deleted' not in capfd.readouterr().err
  # The state the round returned, algo.apply and donate=False all go on.
  again, _ = algo.round(new, cohort, key)
  kept = algo.compile(donate=False)
  one, _ = kept.round(again, cohort, key)
  two, _ = kept.round(again, cohort, key)
  np.testing.assert_array_equal(one.params['w'], two.params['w'])
  a, _ = algo.apply(one, cohort, key)
  b, _ = algo.apply(one, cohort, key)
  np.testing.assert_array_equal(a.params['w'], b.params['w'])


def test_a_deleted_argument_that_is_not_donated():
  hoisted = constant_hoisting.jit(lambda x, y: x + y, donate_argnums=(0,))
  y = jnp.ones(3)
  y.delete()
  with pytest.raises(constant_hoisting.DeletedArgumentError,
                     match=r'argument 1 holds arrays whose buffers were deleted'):
    hoisted(jnp.ones(3), y)
