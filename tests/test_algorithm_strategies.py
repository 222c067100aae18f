"""Every algorithm gives the same rounds under every map strategy.

Each algorithm of ``test_nonfinite.BUILDERS`` (the FedAvg family, FedProx,
SCAFFOLD, DP-FedAvg, DiLoCo, Streaming DiLoCo, and DP and quantizing
aggregators on them) plus FedYogi, FedAdagrad, FedAvgM and FedNova runs two
rounds, one at a time and as ``run_rounds`` (a ``lax.scan`` over rounds),
under ``vmap``, ``chunked`` (fused and not), ``sequential`` and ``auto``. The
rounds must agree with the ``vmap`` rounds, which the algorithm tests check
against NumPy. Streaming DiLoCo's fragments are synchronized inside a
``lax.cond``, so its maps run under control flow.

Tolerance: the strategies compute the same per-client float32 operations and
differ in the order of the sums over the cohort (fused chunks, ``lax.map``,
``vmap``), as in test_nonfinite (its ``RTOL`` states the terms), over two
rounds (twice the terms).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx
import fedjx.algorithms as algos
import float_tolerance as ft
from fedjx import frames
from test_nonfinite import BUILDERS, C, DIM, T, B, _clean_cohort, scaled_loss
from test_algorithms_util import linreg_params, stack_cohorts

RTOL = 4 * ft.rtol(2 * (C + 2 + T * (DIM + B)))

sgd = functools.partial(algos.base.default_sgd, 0.1)
ALL = dict(BUILDERS)
ALL.update({
    'fedyogi': lambda **kw: algos.fedyogi(
        scaled_loss, client_optimizer=sgd(), server_learning_rate=0.05,
        local_steps=T, **kw),
    'fedadagrad': lambda **kw: algos.fedadagrad(
        scaled_loss, client_optimizer=sgd(), server_learning_rate=0.05,
        local_steps=T, **kw),
    'fedavgm': lambda **kw: algos.fedavgm(
        scaled_loss, client_optimizer=sgd(), server_learning_rate=0.5,
        server_momentum=0.9, local_steps=T, **kw),
    'fednova': lambda **kw: algos.fednova(
        scaled_loss, client_optimizer=sgd(), local_steps=T, **kw),
})
# ``auto`` picks ``vmap`` for clients this small on the CPU (the reference
# itself), and the unfused loops are the composition matrix's too: they run
# with the slow tests.
_SLOW = pytest.mark.slow
STRATEGIES = [pytest.param('chunked', 2, True, id='chunked2'),
              pytest.param('chunked', 2, False, marks=_SLOW, id='chunked2-unfused'),
              pytest.param('sequential', None, True, id='sequential'),
              pytest.param('auto', None, True, marks=_SLOW, id='auto'),
              pytest.param('sequential', None, False, marks=_SLOW,
                           id='sequential-unfused')]


def _rounds(name, strategy, chunk, fuse, scanned):
  algo = ALL[name]().compile(map_strategy=strategy, chunk_size=chunk, donate=False)
  cohorts = [_clean_cohort(seed) for seed in (0, 1)]
  keys = jax.random.split(jax.random.key(3), 2)
  state = algo.init(linreg_params(DIM))
  with (frames.without_fusion() if not fuse else _nothing()):
    if scanned:
      return algo.run_rounds(state, stack_cohorts(cohorts), keys)[0]
    for cohort, key in zip(cohorts, keys):
      state, _ = algo.round(state, cohort, key)
  return state


@functools.lru_cache(maxsize=None)
def _reference(name):
  return _rounds(name, 'vmap', None, True, scanned=False)


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _assert_close(got, want):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    if np.issubdtype(w.dtype, np.floating):
      scale = float(np.max(np.abs(w))) if w.size else 0.0
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * scale,
                                 err_msg=jax.tree_util.keystr(path))
    elif jnp.issubdtype(w.dtype, jax.dtypes.prng_key):
      continue
    else:
      np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


# Fused chunks by default for FedAvg; for the rest (per-client state, DP
# noise, replicas and every other algorithm) with the slow tests.
_CHUNKED_BY_DEFAULT = ('fedavg',)


def _cases():
  for name in sorted(ALL):
    for case in STRATEGIES:
      marks = list(case.marks)
      if case.id == 'chunked2' and name not in _CHUNKED_BY_DEFAULT:
        marks.append(_SLOW)
      yield pytest.param(name, *case.values, marks=marks, id=f'{name}-{case.id}')


@pytest.mark.parametrize('name,strategy,chunk,fuse', list(_cases()))
def test_every_strategy_gives_the_vmap_rounds(name, strategy, chunk, fuse):
  if strategy == 'auto':
    assert fedjx.mapping.choose_chunk_size('auto', C, 1 << 10, 1, backend='cpu') == C
  want = _reference(name)
  _assert_close(_rounds(name, strategy, chunk, fuse, scanned=False), want)
  _assert_close(_rounds(name, strategy, chunk, fuse, scanned=True), want)
