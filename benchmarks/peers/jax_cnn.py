"""pfl-research's ``simple_cnn`` in plain JAX (NHWC, no dropout), with
Glorot-uniform weights and zero biases, for the fedjx and ``lax.map``
rounds. Its max pooling is ``fedjx.models.pool.max_pool`` (a reshape and a
max, the values of ``lax.reduce_window``'s pooling at a fraction of its
derivative's cost on XLA:CPU)."""

import os

import jax
import jax.numpy as jnp
import optax

from fedjx.models import pool

_DN = ('NHWC', 'HWIO', 'NHWC')
# fedjx.models' convolution (im2col patches times the kernel), as fedjx's own
# CNNs run, or XLA's. XLA:CPU runs lax.conv_general_dilated (and its
# gradients) several times slower inside a while loop than outside one
# (jax-ml/jax issue 12868; 0.60 against 0.076 CPU s per local step of this
# CNN, jax 0.10.2), and every local-training loop is one; the patches are a
# matrix product there too (0.054 CPU s).
CONVS = {'patches': None, 'xla': jax.lax.conv_general_dilated}
_conv = {'fn': jax.lax.conv_general_dilated}


def use_conv(name: str) -> None:
  """Selects the convolution of :func:`apply`: ``'patches'`` or ``'xla'``."""
  if name == 'patches':
    from fedjx.models import conv  # pylint: disable=import-outside-toplevel
    _conv['fn'] = conv.patch_conv
  else:
    _conv['fn'] = CONVS[name]


def init(key):
  k = jax.random.split(key, 4)
  glorot = jax.nn.initializers.glorot_uniform()
  return {
      'c1': {'w': glorot(k[0], (3, 3, 3, 32)), 'b': jnp.zeros(32)},
      'c2': {'w': glorot(k[1], (3, 3, 32, 64)), 'b': jnp.zeros(64)},
      'd1': {'w': glorot(k[2], (14 * 14 * 64, 128)), 'b': jnp.zeros(128)},
      'd2': {'w': glorot(k[3], (128, 10)), 'b': jnp.zeros(10)}}


def apply(params, x):
  def conv(p, h):
    return _conv['fn'](h, p['w'], (1, 1), 'VALID',
                       dimension_numbers=_DN) + p['b']
  h = jax.nn.relu(conv(params['c1'], x))
  h = jax.nn.relu(conv(params['c2'], h))
  h = pool.max_pool(h, (2, 2))
  h = h.reshape(h.shape[0], -1)
  h = jax.nn.relu(h @ params['d1']['w'] + params['d1']['b'])
  return h @ params['d2']['w'] + params['d2']['b']


def loss(params, batch):
  """Per-example cross-entropy ``[B]``."""
  return optax.softmax_cross_entropy_with_integer_labels(
      apply(params, batch['x']), batch['y'])


def threads() -> dict:
  return {'xla_flags': os.environ.get('XLA_FLAGS', ''),
          'jax_devices': len(jax.devices()),
          'cpu_count': os.cpu_count(),
          'xla_cpu_threads': 'one intra-op pool of cpu_count threads (XLA default)'}
