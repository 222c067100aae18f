"""``init``'s copy of the state: new buffers, same values and placements, one
program per placement."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjx.algorithms import base


def test_fresh_copy_keeps_values_and_placements_in_new_buffers():
  weak = jnp.asarray(2.0) * 1  # a weakly typed array
  tree = {'w': jnp.arange(6.0).reshape(2, 3), 'b': jnp.ones(3),
          'i': jnp.zeros((), jnp.int32), 'weak': weak,
          'np': np.arange(4, dtype=np.int32), 'py': 0.5}
  out = base._fresh_copy(tree)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for name, x in tree.items():
    y = out[name]
    assert isinstance(y, jax.Array)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert y.dtype == jnp.asarray(x).dtype
    if isinstance(x, jax.Array):
      assert y is not x
      assert y.sharding == x.sharding
      assert y.committed == x.committed
      assert y.weak_type == x.weak_type
  # Deleting the originals leaves the copies readable.
  for name in ('w', 'b', 'i', 'weak'):
    tree[name].delete()
  np.testing.assert_array_equal(np.asarray(out['w']), np.arange(6.0).reshape(2, 3))
  np.testing.assert_array_equal(np.asarray(out['i']), 0)


def test_fresh_copy_compiles_one_program_for_a_placement():
  tree = [jnp.ones(s) for s in ((7,), (7, 5), (5, 7, 3), (11,))]
  before = base._copy_all._cache_size()
  base._fresh_copy(tree)
  assert base._copy_all._cache_size() == before + 1
  base._fresh_copy([x + 1 for x in tree])  # the same shapes: no new program
  assert base._copy_all._cache_size() == before + 1
