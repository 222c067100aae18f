"""bfloat16 compute with float32 master weights."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjx import models


def test_mixed_precision_keeps_float32_gradients_close_to_float32():
  model = models.mlp(num_classes=4, hidden=(16,))
  rng = np.random.default_rng(0)
  batch = {'x': jnp.asarray(rng.normal(size=(8, 10)), jnp.float32),
           'y': jnp.asarray(rng.integers(0, 4, size=8), jnp.int32)}
  params = model.init(jax.random.key(0), batch)
  loss = lambda fn: (lambda p: jnp.mean(fn(p, batch)))
  bf16 = models.mixed_precision(model.loss_fn)
  assert bf16(params, batch).dtype == jnp.float32
  g32 = jax.grad(loss(model.loss_fn))(params)
  g16 = jax.grad(loss(bf16))(params)
  for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):
    assert b.dtype == jnp.float32  # master weights stay float32
    # bfloat16 keeps 8 significant bits (unit roundoff 2**-9); inputs and
    # weights are rounded at each of the 3 layers (input, hidden, softmax),
    # relative 2 * 2**-9 per product with float32 accumulation: at most
    # 3 * 2 * 2**-9 = 1.2e-2 of the gradient's scale, twice for safety of the
    # first-order bound.
    np.testing.assert_allclose(b, a, rtol=0,
                               atol=2 * 3 * 2 * 2.0**-9 * float(jnp.max(jnp.abs(a))))
  # The computation really runs in bfloat16.
  text = str(jax.make_jaxpr(loss(bf16))(params))
  assert 'bf16' in text
