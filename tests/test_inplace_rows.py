"""Per-client rows updated in place: ``fedjx.map_fn(..., rows=Rows(...))``.

Members run one at a time read their row of the store and write their new
row back inside the loop over members; other strategies gather, map and
scatter. Both must give exactly the numbers of a hand-written gather, map
and scatter (the same per-member operations in the same order: equality,
not a tolerance), and the in-place round of DiLoCo exactly those of the
same round with its replicas' states kept outside the server state
(``ClientState(num_clients=None)``: rows in, new rows out, written back
here in NumPy). Memory: the in-place round's temporaries do not grow with
the replicas' states the way a gathered copy and a stacked output make
them grow (two bytes of temporaries per byte of state).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx
from fedjx import frames
from fedjx.algorithms import diloco_lib
from fedjx.algorithms import kit
from fedjx.datasets import Cohort
from fedjx.mapping import Rows
from test_algorithms_util import linreg_data, linreg_loss, make_cohort

N, C, D = 5, 4, 3  # Store rows, members, row width.


def _member(row, x):
  """A row update that depends on the row and the member's input."""
  new = {'a': row['a'] * 0.5 + x, 'n': row['n'] + 1}
  return new, jnp.sum(new['a'] * x)


def _by_hand(store, ids, write, xs, strategy):
  return jax.jit(lambda *a: _gather_map_scatter(*a, strategy))(store, ids, write, xs)


def _gather_map_scatter(store, ids, write, xs, strategy):
  index = jnp.where(ids < 0, ids + N, ids)
  rows = jax.tree.map(lambda s: s[index], store)

  @fedjx.program(clients=C, map_strategy=strategy)
  def run(rows, xs):
    new, out = fedjx.map_fn(_member, (rows, xs))
    return new, out, fedjx.reduce_sum(out)

  new, out, total = run(rows, xs)
  drop = jnp.where(write, index, N)
  store = jax.tree.map(lambda s, v: s.at[drop].set(v, mode='drop'), store, new)
  return store, out, total


def _in_map(store, ids, write, xs, strategy):
  @fedjx.program(clients=C, map_strategy=strategy)
  def run(store, ids, write, xs):
    store, out = fedjx.map_fn(lambda row, x: _member(row, x), (xs,),
                              rows=Rows(store, ids, write))
    return store, out, fedjx.reduce_sum(out)

  return jax.jit(run)(store, ids, write, xs)


def _store():
  rng = np.random.default_rng(0)
  return {'a': jnp.asarray(rng.normal(size=(N, D)), jnp.float32),
          'n': jnp.arange(N, dtype=jnp.int32)}


@pytest.mark.parametrize('strategy,fuse', [('sequential', True), ('sequential', False),
                                           ('vmap', True), ('chunked', True)])
def test_rows_in_the_map_equal_gather_map_scatter(strategy, fuse):
  store = _store()
  ids = jnp.asarray([3, -1, 0, 2], jnp.int32)  # -1: row N - 1, as NumPy reads it.
  write = jnp.asarray([True, True, False, True])
  xs = jnp.asarray(np.random.default_rng(1).normal(size=(C, D)), jnp.float32)
  want = _by_hand(store, ids, write, xs, strategy)
  with frames.without_fusion() if not fuse else _nothing():
    got = _in_map(store, ids, write, xs, strategy)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # Rows 1 (no member) and 0 (write False) are as they were.
  np.testing.assert_array_equal(np.asarray(got[0]['n']), [0, 1, 3, 4, 5])


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def test_rows_are_checked():
  store = _store()

  @fedjx.program(clients=C)
  def run(ids):
    return fedjx.map_fn(_member, (jnp.zeros((C, D)),), rows=Rows(store, ids))

  with pytest.raises(ValueError, match=r'rows.ids has shape \(4, 1\)'):
    run(jnp.zeros((C, 1), jnp.int32))
  with pytest.raises(ValueError, match='must be a fedjx.mapping.Rows'):
    fedjx.program(clients=C)(lambda: fedjx.map_fn(
        _member, (jnp.zeros((C, D)),), rows=(store, jnp.zeros(C, jnp.int32))))()


# ------------------------------------------------------------------ DiLoCo

H = 3


def _diloco(num_replicas):
  """DiLoCo's round from the template, its replicas' AdamW states in the
  server state (``num_replicas``) or outside it (None)."""
  options = diloco_lib.check_options('diloco', {}, inner_optimizer=optax.adamw(
      0.05, weight_decay=0.1), inner_steps=H)

  def replica(c):
    trained = c.train(opt_state=c.state)
    return kit.Upload(optax.tree.sub(c.x, trained.params), trained,
                      state=trained.opt_state)

  return kit.algorithm('diloco', linreg_loss, options, client=replica,
                       client_state=kit.ClientState(options.client_optimizer.init,
                                                    num_replicas))


def _cohorts():
  rng = np.random.default_rng(7)
  out = []
  # Replicas 0..2 of 3; the second round a cohort of two, in another order,
  # the third with an empty (padding) client.
  for ids, sizes in (([0, 1, 2], [8, 4, 6]), ([2, 0], [5, 7]), ([1, 2, 0], [6, 0, 4])):
    out.append(make_cohort(linreg_data(rng, sizes), batch_size=4, steps=2,
                           client_ids=ids))
  return out


@pytest.mark.parametrize('strategy,fuse', [('sequential', True), ('sequential', False),
                                           ('vmap', True)])
def test_diloco_rows_in_place_equal_rows_outside(strategy, fuse):
  params = {'w': jnp.linspace(-0.5, 0.5, 3, dtype=jnp.float32),
            'b': jnp.asarray(0.1, jnp.float32)}
  inside = _diloco(3).compile(map_strategy=strategy, donate=False)
  outside = _diloco(None).compile(map_strategy=strategy, donate=False)
  a, b = inside.init(params), outside.init(params)
  rows = jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], 3, axis=0),
                      optax.adamw(0.05).init(params))
  key = jax.random.key(0)
  with frames.without_fusion() if not fuse else _nothing():
    for cohort in _cohorts():
      ids = np.asarray(cohort.client_ids)
      a, ma = inside.round(a, cohort, key)
      b, mb, new = outside.round(
          b, Cohort(*cohort, client_states=jax.tree.map(lambda r: r[ids], rows)), key)
      for r, v in zip(jax.tree.leaves(rows), jax.tree.leaves(new)):
        r[ids] = np.asarray(v)
      for g, w in zip(jax.tree.leaves((a.params, a.opt_state, ma)),
                      jax.tree.leaves((b.params, b.opt_state, mb))):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
      for g, w in zip(jax.tree.leaves(a.client_states), jax.tree.leaves(rows)):
        np.testing.assert_array_equal(np.asarray(g), w)


def _round_memory(num_replicas, dim):
  """``(temp bytes, alias bytes, client-state bytes)`` of a DiLoCo round of
  ``num_replicas`` replicas of a ``dim``-wide linear model, compiled for
  the CPU, one replica at a time, donating the state."""
  inner = optax.adamw(0.05, weight_decay=0.1)
  algo = diloco_lib.diloco(linreg_loss, num_replicas, inner_optimizer=inner,
                           inner_steps=2).compile(map_strategy='sequential')
  params = {'w': jnp.zeros((dim,), jnp.float32), 'b': jnp.zeros((), jnp.float32)}
  state = jax.eval_shape(algo.init, params)
  cohort = jax.eval_shape(lambda: make_cohort(
      [{'x': np.zeros((2, dim), np.float32), 'y': np.zeros((2,), np.float32)}]
      * num_replicas, batch_size=2, steps=1))
  memory = algo.round.lower(state, cohort, jax.random.key(0)).compile().memory_analysis()
  states = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.client_states))
  return memory.temp_size_in_bytes, memory.alias_size_in_bytes, states


def test_diloco_round_holds_the_replicas_states_once():
  # AdamW's two moments per replica, 8 x dim bytes (512 KB): 8 MB of states
  # for 16 replicas, 16 MB for 32, against a working set of a few copies of
  # one replica's 256 KB model. A gathered copy and a stacked output add two
  # bytes of temporaries per byte of state (measured: 19 MB and 36 MB); in
  # place, none (2.9 MB both).
  dim = 1 << 16
  small, alias_small, states_small = _round_memory(16, dim)
  large, alias_large, states_large = _round_memory(32, dim)
  assert large - small < 0.5 * (states_large - states_small), (small, large)
  assert large < states_large, (large, states_large)
  # The new states reuse the donated ones.
  assert alias_large >= states_large, (alias_large, states_large)


def test_a_round_that_does_not_fit_names_the_rows_it_keeps():
  from fedjx import execution
  state = _diloco(4).init({'w': jnp.zeros((1 << 20,), jnp.float32),
                           'b': jnp.zeros((), jnp.float32)})
  # AdamW's two moments of 2^20 + 1 floats per replica, 4 replicas.
  rows = 4 * 2 * ((1 << 20) + 1) * 4 + 4 * 4  # + the int32 step counts
  text = execution.round_settings(state)
  assert text.startswith(f'the state keeps {rows / 1e9:.2f} GB of per-client rows')
  assert 'config.cohort_size' in text and text.endswith(execution.ROUND_SETTINGS)
  assert "config.client_state.placement='store'" in text
  assert execution.round_settings(state._replace(client_states=())) == (
      execution.ROUND_SETTINGS)
