"""FedRep and FedPer against float64 NumPy oracles of Collins et al. 2021,
Algorithm 1 and Arivazhagan et al. 2019: two rounds with a client drawn
twice (its stored head read back), a padding client and a skipped
(non-finite) client whose rows come back unchanged, under every map
strategy; DP on the body; personalization; one-line errors.

The model is linear regression, body ``w`` and head ``b``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from fedjx.algorithms import aggregators
from fedjx.algorithms.fedrep_lib import head_mask
from fedjx.algorithms.fedrep_lib import personalize_fn
from client_rows import Rows, batches_of, linreg_grad, run_round, theta_of
from test_algorithms_util import CHAIN, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort

B, LR, SERVER_LR = 2, 0.1, 0.8
SIZES = [5, 3, 4, 6]           # Batches of 2: 3, 2, 2 and 3 steps.
ROUNDS = [[0, 2, 1, -1], [2, 3, 1, -1]]   # Client 2 twice; 1 is NaN in round 2.
KEY = jax.random.key(0)


def _population():
  return linreg_data(np.random.default_rng(7), SIZES, shift=2.0)


def _cohort(population, ids, nan=()):
  data = []
  for i in ids:
    if i < 0:  # A padding client: no examples.
      data.append({k: v[:0] for k, v in population[0].items()})
    else:
      d = dict(population[i])
      if i in nan:
        d['x'] = np.full_like(d['x'], np.nan)
      data.append(d)
  return make_cohort(data, B, steps=3, client_ids=ids)


def _oracle(theta, heads, population, ids, *, fedper, head_epochs=1,
            clip=None, skip=()):
  """One round in float64: returns the new theta (w, b) and heads."""
  w = theta[:-1]
  deltas, sizes, heads = [], [], dict(heads)
  for i in ids:
    if i < 0 or i in skip:
      continue
    d = population[i]
    h = heads.get(i, theta[-1])  # A new client: the initial head.
    wi = w.copy()
    if fedper:
      for x, y in batches_of(d, B):
        g = linreg_grad(np.append(wi, h), x, y)
        wi, h = wi - LR * g[:-1], h - LR * g[-1]
    else:
      for _ in range(head_epochs):
        for x, y in batches_of(d, B):
          h = h - LR * linreg_grad(np.append(w, h), x, y)[-1]
      for x, y in batches_of(d, B):
        wi = wi - LR * linreg_grad(np.append(wi, h), x, y)[:-1]
    heads[i] = h
    deltas.append(w - wi)
    sizes.append(len(d['y']))
  if clip is None:
    mean = np.average(deltas, axis=0, weights=sizes)
  else:
    mean = np.mean([d * min(1.0, clip / np.linalg.norm(d)) for d in deltas], 0)
  return np.append(w - SERVER_LR * mean, theta[-1]), heads


def _run(algo, population, *, fedper, head_epochs=1, clip=None):
  """Both rounds, checked against the oracle after each."""
  params = linreg_params()
  state = algo.init(params)
  store = Rows(algo.client_state_init(params))
  theta, heads = theta_of(params), {}
  for r, ids in enumerate(ROUNDS):
    nan = (1,) if r == 1 else ()
    before = {i: store.row(i) for i in ids}
    state, metrics, rows = run_round(algo, state, _cohort(population, ids, nan),
                                     store, jax.random.key(r))
    theta, heads = _oracle(theta, heads, population, ids, fedper=fedper,
                           head_epochs=head_epochs, clip=clip, skip=nan)
    assert_trees_close(theta_of(state.params), theta, n=CHAIN)
    for j, i in enumerate(ids):
      if i < 0 or i in nan:  # Padding and skipped clients: rows unchanged.
        np.testing.assert_array_equal(rows["['b']"][j], before[i]["['b']"])
      else:
        assert_trees_close(rows["['b']"][j], heads[i], n=CHAIN)
    assert float(metrics['nonfinite_clients']) == len(nan)
  return state, store


def _strategies(default):
  """vmap, chunked and sequential maps; those not in ``default`` slow."""
  return [pytest.param(s, c, id=s, marks=() if s in default else pytest.mark.slow)
          for s, c in [('vmap', None), ('chunked', 2), ('sequential', None)]]


@pytest.mark.parametrize('strategy, chunk', _strategies(('vmap',)))
def test_fedrep_two_rounds_against_numpy(strategy, chunk):
  algo = algos.fedrep(linreg_loss, 'b', head_epochs=2,
                      server_optimizer=optax.sgd(SERVER_LR)).compile(strategy, chunk)
  state, _ = _run(algo, _population(), fedper=False, head_epochs=2)
  # The server's head is never trained: the initial one, for new clients.
  np.testing.assert_array_equal(state.params['b'], linreg_params()['b'])


@pytest.mark.parametrize('strategy, chunk', _strategies(('vmap',)))
def test_fedper_two_rounds_against_numpy(strategy, chunk):
  algo = algos.fedper(linreg_loss, {'w': 'body', 'b': 'head'},
                      server_optimizer=optax.sgd(SERVER_LR)).compile(strategy, chunk)
  _run(algo, _population(), fedper=True)


def test_fedrep_with_a_dp_aggregator_on_the_body():
  # Noise 0: the body updates clipped to 0.05, summed, divided by the
  # number of participants; the heads never reach the aggregator.
  clip = 0.05
  algo = algos.fedrep(linreg_loss, lambda p: {'w': False, 'b': True},
                      server_optimizer=optax.sgd(SERVER_LR),
                      aggregator=aggregators.gaussian(clip, 0.0))
  _run(algo, _population(), fedper=False, clip=clip)


@pytest.mark.slow
def test_dp_noise_reaches_the_body_not_the_heads():
  algo = algos.fedper(linreg_loss, 'b',
                      aggregator=aggregators.gaussian(1.0, 1.0)).compile(donate=False)
  params = linreg_params()
  state = algo.init(params)
  cohort = _cohort(_population(), [0, 2, 1, -1])
  outs = [run_round(algo, state, cohort, Rows(algo.client_state_init(params)),
                    jax.random.key(k)) for k in (1, 2)]
  assert float(jnp.max(jnp.abs(outs[0][0].params['w'] - outs[1][0].params['w']))) > 1e-3
  np.testing.assert_array_equal(outs[0][2]["['b']"], outs[1][2]["['b']"])


def test_personalize_is_the_global_body_with_the_own_head():
  pop = _population()
  algo = algos.fedrep(linreg_loss, 'b')
  params = linreg_params()
  state = algo.init(params)
  store = Rows(algo.client_state_init(params))
  state, _, _ = run_round(algo, state, _cohort(pop, [0, 2, 1, -1]), store, KEY)
  train = _cohort(pop, [2])
  train = {'batches': jax.tree.map(lambda x: x[0], train.batches),
           'mask': train.mask[0]}
  plain = personalize_fn(linreg_loss, 'b')(state, store.row(2), train)
  np.testing.assert_array_equal(plain['w'], state.params['w'])
  np.testing.assert_array_equal(plain['b'], store.row(2)["['b']"])
  # Three head steps cycle through client 2's two real batches.
  tuned = jax.jit(personalize_fn(linreg_loss, 'b', head_steps=3,
                                 optimizer=optax.sgd(LR)))(state, store.row(2), train)
  theta = theta_of(plain)
  batches = batches_of(pop[2], B)
  for t in range(3):
    theta[-1] -= LR * linreg_grad(theta, *batches[t % 2])[-1]
  assert_trees_close(theta_of(tuned), theta, n=CHAIN)


def test_head_labels_forms_agree():
  p = linreg_params()
  leaves = [k for k in ('b', 'w')]  # jax.tree.leaves order of a dict.
  want = [k == 'b' for k in leaves]
  for head in ('b', ('b',), {'w': 'body', 'b': 'head'}, {'w': False, 'b': True},
               lambda params: jax.tree.map(lambda x: x.ndim == 0, params)):
    assert head_mask('t', head, p) == want


@pytest.mark.parametrize('build, match', [
    (lambda: algos.fedrep(linreg_loss, ''), r"fedrep: head='' names no parameter"),
    (lambda: algos.fedrep(linreg_loss, 'b', head_epochs=0), r'head_epochs=0'),
    (lambda: algos.fedrep(linreg_loss, 'b', client_transform=optax.sgd(1.0)),
     r'option client_transform=.* is not taken'),
    (lambda: algos.fedper(linreg_loss, 'b', weighting='count'), r"weighting='count'"),
    (lambda: algos.fedper(linreg_loss, 'logits').init(linreg_params()),
     r'leaves the head empty'),
    (lambda: algos.fedper(linreg_loss, ('w', 'b')).init(linreg_params()),
     r'leaves the body empty'),
    (lambda: algos.fedper(linreg_loss, {'w': 'x', 'b': 'head'}).init(linreg_params()),
     r"head label 'x' of params\['w'\] is not one of"),
    (lambda: algos.fedper(linreg_loss, {'w': 'body'}).init(linreg_params()),
     r'do not match the params'),
    (lambda: personalize_fn(linreg_loss, 'b', head_steps=-1), r'head_steps=-1'),
])
def test_errors_are_one_line(build, match):
  with pytest.raises(ValueError, match=match) as e:
    build()
  assert '\n' not in str(e.value)


def test_a_round_needs_the_cohort_s_rows():
  algo = algos.fedper(linreg_loss, 'b')
  state = algo.init(linreg_params())
  cohort = _cohort(_population(), [0, 1])
  with pytest.raises(ValueError, match='cohort.client_states=None'):
    algo.round(state, cohort, KEY)


def test_the_library_store_gives_the_rounds_of_the_test_store(tmp_path):
  # The heads (dicts keyed by path) through fedjx.ClientStore, one row in
  # memory and the rest in memory-mapped files: the same rounds bit for bit.
  import fedjx
  pop = _population()
  algo = algos.fedrep(linreg_loss, 'b', head_epochs=2).compile(donate=False)
  params = linreg_params()
  initial = algo.client_state_init(params)
  rows_store = Rows(initial)
  lib_store = fedjx.ClientStore(initial, len(SIZES), directory=tmp_path,
                                memory_budget_bytes=4)
  a = b = algo.init(params)
  for r, ids in enumerate(ROUNDS):
    cohort = _cohort(pop, ids)
    a, _, _ = run_round(algo, a, cohort, rows_store, jax.random.key(r))
    b, _, _ = run_round(algo, b, cohort, lib_store, jax.random.key(r))
  np.testing.assert_array_equal(a.params['w'], b.params['w'])
  assert len(lib_store) == 4 and lib_store.disk_bytes > 0
  jax.tree.map(np.testing.assert_array_equal, lib_store.read(range(4)),
               rows_store.read(range(4)))
