"""docs/writing_an_algorithm.md, run as a test.

The page's Python code blocks execute in order in one namespace; its
algorithm block (the first) holds FedDyn and FedCM, each under 40 lines as
the page says, importing nothing of ``fedjx.algorithms`` but the kit and a
part (a client transform); its FedDyn (Acar et al., "Federated Learning
Based on Dynamic Regularization", ICLR 2021, Algorithm 1) agrees over three
rounds with the shipped ``fedjx.algorithms.feddyn`` (same hyperparameters,
data and seed) and with a float64 NumPy loop of the paper's equations
written here:

    client k:  theta_k = theta^{t-1} after S steps of
                 theta <- theta - lr (grad L_k(theta) - g_k + alpha (theta - theta^{t-1}))
               g_k <- g_k - alpha (theta_k - theta^{t-1})
    server:    h <- h - (alpha / m) sum_k (theta_k - theta^{t-1})
               theta^t = mean_k theta_k - h / alpha

and its FedCM (Xu et al. 2021, Algorithm 1) with a float64 loop of

    client i:  y <- x;  K times:  y <- y - lr (alpha g(y) + (1 - alpha) Delta)
               Delta_i = (x - y) / (lr K)
    server:    Delta <- mean_i Delta_i;  x <- x - Delta

Its last block registers the page's FedDyn and runs it from a config
through the runner (a slow test).
"""

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx
import fedjx.algorithms as algos
import float_tolerance as ft
from fedjx.datasets import Cohort

PAGE = pathlib.Path(__file__).resolve().parent.parent / 'docs' / 'writing_an_algorithm.md'
MAX_LINES = 40  # Each algorithm of the page.

D, B, S, LR, ALPHA, M = 3, 2, 3, 0.1, 0.1, 5   # S: steps per client.
SIZES = [5, 4, 6, 3, 5]
ROUNDS = [[0, 1, 2], [2, 3, 4], [4, 2, -1]]    # Client 2 thrice; -1 pads.
THETA0 = np.array([-0.5, 0.0, 0.5, 0.1])        # [w, b]


def code_blocks(text):
  """The page's fenced ``python`` blocks, in order."""
  return re.findall(r'^```python\n(.*?)^```', text, re.S | re.M)


def _run_blocks(blocks, namespace):
  for i, block in blocks:
    exec(compile(block, f'{PAGE.name}, block {i}', 'exec'), namespace)  # pylint: disable=exec-used
  return namespace


@pytest.fixture(scope='module')
def page():
  """The namespace after running the page's algorithms and their run."""
  blocks = list(enumerate(code_blocks(PAGE.read_text())))[:2]
  return _run_blocks(blocks, {'__name__': 'writing_an_algorithm'})


def _algorithm_lines(block, name):
  """The lines of ``name``'s definition, from its decorator to its last
  line (the next top-level statement, blank lines excluded)."""
  lines = block.splitlines()
  top = [i for i, line in enumerate(lines) if line and not line[0].isspace()]
  define = [i for i in top if lines[i].startswith(f'def {name}(')][0]
  start = min(i for i in top if i <= define and (
      i == define or lines[i].startswith('@')) and all(
          lines[j].startswith('@') or j == define
          for j in top if i <= j <= define))
  end = min([i for i in top if i > define] + [len(lines)])
  while not lines[end - 1].strip():
    end -= 1
  return end - start


def test_each_algorithm_is_under_40_lines():
  text = PAGE.read_text()
  blocks = code_blocks(text)
  assert len(blocks) == 3, 'the algorithms, running them, a config'
  counts = {n: _algorithm_lines(blocks[0], n) for n in ('my_feddyn', 'my_fedcm')}
  assert max(counts.values()) < MAX_LINES
  assert (f'FedDyn (Acar et al., ICLR 2021) in {counts["my_feddyn"]} lines and '
          f'FedCM (Xu\net al., 2021) in {counts["my_fedcm"]}.') in text, (
              'the page states the counts')
  assert max(len(line) for block in blocks for line in block.splitlines()) <= 80


def test_algorithm_block_is_written_from_the_kit():
  tree = ast.parse(code_blocks(PAGE.read_text())[0])
  imported = [alias.name for node in ast.walk(tree)
              if isinstance(node, ast.Import) for alias in node.names]
  imported += [f'{node.module}.{alias.name}' for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) for alias in node.names]
  assert [m for m in imported if m.startswith('fedjx.algorithms')] == [
      'fedjx.algorithms.kit', 'fedjx.algorithms.transforms.proximal']
  used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
          and isinstance(node.value, ast.Name) and node.value.id == 'kit'}
  assert used <= set(algos.kit.__all__)


def _population():
  rng = np.random.default_rng(3)
  out = []
  for i, n in enumerate(SIZES):
    x = (rng.normal(size=(n, D)) + 0.3 * i).astype(np.float32)
    w = rng.normal(size=D)
    out.append({'x': x, 'y': (x @ w + 0.1 * rng.normal(size=n)).astype(np.float32)})
  return out


def _vector(params):
  return np.concatenate([np.asarray(params['w'], np.float64).ravel(),
                         np.asarray(params['b'], np.float64).ravel()])


def _cohorts(population, rounds, steps):
  empty = {k: v[:0] for k, v in population[0].items()}
  for ids in rounds:
    yield Cohort.from_clients([population[i] if i >= 0 else empty for i in ids],
                              B, steps=steps, client_ids=ids)


def _run(algo, population, h_of):
  """Three rounds, the g_k rows kept in a ClientStore: (theta, h, rows)."""
  state = algo.init({'w': jnp.asarray(THETA0[:-1], jnp.float32),
                     'b': jnp.asarray(THETA0[-1], jnp.float32)})
  store = fedjx.ClientStore(algo.client_state_init(state.params), M)
  for r, cohort in enumerate(_cohorts(population, ROUNDS, S)):
    cohort = cohort._replace(client_states=store.read(cohort.client_ids))
    state, _, rows = algo.round(state, cohort, jax.random.key(r))
    store.write(cohort.client_ids, rows)
  rows = {i: _vector(jax.tree.map(lambda x: x[0], store.read([i])))
          for i in range(M)}
  return _vector(state.params), _vector(h_of(state)), rows


def _oracle(population, rounds, theta, alpha, m, weighting):
  """The equations in float64: (theta, h, {k: g_k}, the largest magnitude)."""
  h, g = np.zeros_like(theta), {k: np.zeros_like(theta) for k in range(m)}
  big = 0.0  # The largest magnitude of any intermediate value.
  for ids in rounds:
    models, weights = [], []
    for k in (i for i in ids if i >= 0):
      t = theta.copy()
      x, y = (np.asarray(population[k][f], np.float64) for f in ('x', 'y'))
      for j in range(0, len(y), B):
        xb, yb = x[j:j + B], y[j:j + B]
        r = xb @ t[:-1] + t[-1] - yb
        grad = np.concatenate([xb.T @ r / len(yb), [np.mean(r)]])
        t = t - LR * (grad - g[k] + alpha * (t - theta))
        big = max(big, np.abs(xb * t[:-1]).max(), np.abs(yb).max(),
                  np.abs(r).max(), np.abs(grad).max(), np.abs(t).max())
      g[k] = g[k] - alpha * (t - theta)
      models.append(t)
      weights.append(len(y) if weighting == 'num_examples' else 1.0)
    h = h - alpha / m * sum(t - theta for t in models)
    theta = np.average(models, axis=0, weights=weights) - h / alpha
    big = max(big, np.abs(theta).max(), np.abs(h / alpha).max(),
              max(np.abs(v).max() for v in g.values()))
  return theta, h, g, big


def _tolerance(population, rounds, steps, alpha, big):
  """The float32 tolerance of the comparisons, from the computation's shape.

  Each float32 operation rounds its result with relative error at most
  u = 2**-24, so, to first order, a value computed through a chain of n
  dependent roundings, each of a value of magnitude at most V, through maps
  that do not expand errors, is within gamma_n V of the exact value
  (Higham, "Accuracy and Stability of Numerical Algorithms", Lemma 3.1;
  tests/float_tolerance.py), and two float32 computations of it (the page's
  and the shipped FedDyn, which XLA may order differently) within twice
  that: ``ft.atol(n, V)``.

  n, the roundings along one chain: a local step rounds the residual
  x.w + b - y (d + 2 terms), the mean of x_j r_j over the batch (B + 2),
  FedDyn's two terms and the SGD step (5), so S (d + B + 9) per client; the
  client's Delta_k and g_k (3), the cohort's sums (C each, two of them) and
  the server's h, h / alpha and step (6) add 2 C + 9 per round; R rounds
  chain.

  Non-expanding maps: a local step multiplies an error in theta by
  I - LR (H_b + alpha I), H_b = x_b^T x_b / |b| (x_b with a column of ones
  for the bias) the batch's Hessian, of norm at most 1 when
  LR (lambda_max(H_b) + alpha) <= 2 (asserted on the data); the cohort's
  mean and the sums over m >= C clients do not expand either. A round adds
  the errors of its three inputs (theta, h / alpha and the g_k, each
  entering the next round's theta through such maps), so R rounds amplify
  them at most 3**R.

  V is the largest magnitude of the oracle's intermediates (theta, h /
  alpha, the g_k, each step's x_j w_j, y, residuals and gradients). The
  result, ``3**R ft.atol(n, V)``, is a worst case: it assumes every rounding
  at its largest and every error amplified.
  """
  for data in population:
    x = np.concatenate([data['x'], np.ones((len(data['y']), 1))], axis=1)
    for j in range(0, len(x), B):
      hessian = x[j:j + B].T @ x[j:j + B] / len(x[j:j + B])
      assert LR * (np.linalg.eigvalsh(hessian).max() + alpha) <= 2.0
  d, c, r = population[0]['x'].shape[1], len(rounds[0]), len(rounds)
  n = r * (steps * (d + B + 9) + 2 * c + 9)
  return 3.0 ** r * ft.atol(n, big)


@pytest.mark.parametrize('weighting', ['num_examples', 'uniform'])
def test_page_feddyn_against_shipped_and_numpy(page, weighting):
  population = _population()
  mine = _run(page['my_feddyn'](page['loss_fn'], M, alpha=ALPHA,
                                weighting=weighting), population,
              lambda state: state.extras)  # The page keeps h in the kit's record.
  shipped = _run(algos.feddyn(page['loss_fn'], M, alpha=ALPHA,
                              weighting=weighting), population,
                 lambda state: state.extras)
  theta, h, g, big = _oracle(population, ROUNDS, THETA0, ALPHA, M, weighting)
  tol = _tolerance(population, ROUNDS, S, ALPHA, big)
  # The bound is a worst case (the errors seen are about 1e-7), but it is
  # below a twentieth of h / alpha's part of theta: a wrong h (its m, its
  # sign, its alpha) fails.
  assert tol < np.abs(h / ALPHA).max() / 20
  for got in (mine, shipped):
    np.testing.assert_allclose(got[0], theta, rtol=0, atol=tol)
    np.testing.assert_allclose(got[1], h, rtol=0, atol=tol)
    for k in range(M):
      np.testing.assert_allclose(got[2][k], g[k], rtol=0, atol=tol)
  np.testing.assert_allclose(mine[0], shipped[0], rtol=0, atol=tol)
  np.testing.assert_allclose(mine[1], shipped[1], rtol=0, atol=tol)
  # h stays (1/m) sum_k g_k over the population (zero rows included).
  np.testing.assert_allclose(h, sum(g.values()) / M, rtol=0, atol=1e-12)
  assert np.abs(h).max() > 1e-3


def test_page_run_agrees(page):
  """The page's own run: its FedDyn, the shipped one and the equations."""
  population, rounds = page['population'], page['train'].__defaults__[0]
  theta0 = np.zeros(population[0]['x'].shape[1] + 1)
  theta, _, _, big = _oracle(population, rounds, theta0, 0.1, len(population),
                             'num_examples')
  tol = _tolerance(population, rounds, 4, 0.1, big)
  for got in (page['mine'], page['shipped']):
    np.testing.assert_allclose(_vector(got.params), theta, rtol=0, atol=tol)
  np.testing.assert_allclose(_vector(page['mine'].params),
                             _vector(page['shipped'].params), rtol=0, atol=tol)


# ------------------------------------------------------------------ FedCM

def _fedcm_oracle(population, rounds, theta, alpha, lr, weighting):
  """FedCM's equations in float64: (theta, Delta, the largest magnitude)."""
  momentum, big = np.zeros_like(theta), 0.0
  for ids in rounds:
    deltas, weights = [], []
    for k in (i for i in ids if i >= 0):
      t = theta.copy()
      x, y = (np.asarray(population[k][f], np.float64) for f in ('x', 'y'))
      steps = 0
      for j in range(0, len(y), B):
        xb, yb = x[j:j + B], y[j:j + B]
        r = xb @ t[:-1] + t[-1] - yb
        grad = np.concatenate([xb.T @ r / len(yb), [np.mean(r)]])
        t = t - lr * (alpha * grad + (1 - alpha) * momentum)
        steps += 1
        big = max(big, np.abs(xb * t[:-1]).max(), np.abs(yb).max(),
                  np.abs(r).max(), np.abs(grad).max(), np.abs(t).max())
      deltas.append((theta - t) / (lr * steps))
      weights.append(len(y) if weighting == 'num_examples' else 1.0)
    momentum = np.average(deltas, axis=0, weights=weights)
    theta = theta - momentum
    big = max(big, np.abs(theta).max(), np.abs(momentum).max())
  return theta, momentum, big


def _fedcm_tolerance(population, rounds, steps, alpha, big):
  """The float32 error of FedCM's rounds against the exact equations.

  Per round, with errors ``E_x`` in the model and ``E_D`` in the momentum
  ``Delta`` it starts from (to first order; H_b the batch Hessians, lambda
  the largest eigenvalue of any, K_i client i's real steps):

  * a local step maps an error in ``y`` through ``I - lr alpha H_b``, of
    norm at most 1 when ``lr alpha lambda <= 2`` (asserted); it adds
    ``lr (1 - alpha) E_D``, ``lr K_i (1 - alpha) E_D <= E_D`` over the steps
    when ``lr K_i <= 1`` (asserted);
  * ``x - y_i`` carries ``x``'s error through ``I - prod_b (I - lr alpha
    H_b)``, of norm at most ``lr alpha K_i lambda``, so after the division
    by ``lr K_i``: ``Delta_i``'s error is at most ``alpha lambda E_x +
    (1 - alpha) E_D + eps / (lr K_i)``, ``eps`` the roundings of the local
    chain, the mean and the division: ``ft.atol(n, V)`` with ``n`` as for
    FedDyn (:func:`_tolerance`) and ``V`` the largest magnitude;
  * the mean does not expand, ``x - Delta`` adds ``E_D``.

  So ``max(E_x, E_D)`` grows at most ``g = 2 + alpha lambda`` times a round,
  plus ``eps / (lr K_min)``: after ``R`` rounds ``R g^R eps / (lr K_min)``
  bounds it. A worst case, every rounding at its largest.
  """
  lam = 0.0
  for data in population:
    x = np.concatenate([data['x'], np.ones((len(data['y']), 1))], axis=1)
    for j in range(0, len(x), B):
      hessian = x[j:j + B].T @ x[j:j + B] / len(x[j:j + B])
      lam = max(lam, np.linalg.eigvalsh(hessian).max())
  k_min = min(-(-SIZES[i] // B) for ids in rounds for i in ids if i >= 0)
  k_max = max(-(-SIZES[i] // B) for ids in rounds for i in ids if i >= 0)
  assert LR * alpha * lam <= 2.0 and LR * k_max <= 1.0
  d, c, r = population[0]['x'].shape[1], len(rounds[0]), len(rounds)
  n = steps * (d + B + 9) + 2 * c + 9
  return r * (2.0 + alpha * lam) ** r * ft.atol(n, big) / (LR * k_min)


@pytest.mark.parametrize('weighting', ['num_examples', 'uniform'])
def test_page_fedcm_against_numpy(page, weighting):
  """Two rounds (the momentum of the first drives the second) at the
  paper's alpha = 0.1."""
  population, alpha, rounds = _population(), 0.1, ROUNDS[:2]
  algo = page['my_fedcm'](page['loss_fn'], alpha=alpha, weighting=weighting)
  state = algo.init({'w': jnp.asarray(THETA0[:-1], jnp.float32),
                     'b': jnp.asarray(THETA0[-1], jnp.float32)})
  assert algo.client_state_init is None
  assert float(state.hparams['alpha']) == np.float32(alpha)
  for r, cohort in enumerate(_cohorts(population, rounds, S)):
    state, metrics = algo.round(state, cohort, jax.random.key(r))
  theta, momentum, big = _fedcm_oracle(population, rounds, THETA0, alpha, LR,
                                       weighting)
  tol = _fedcm_tolerance(population, rounds, S, alpha, big)
  # The tolerance tells FedCM from its neighbours: without momentum (alpha
  # = 1) or with another alpha the model moves by more than twice it.
  for other in (1.0, 0.2):
    moved = _fedcm_oracle(population, rounds, THETA0, other, LR, weighting)[0]
    assert np.abs(moved - theta).max() > 2 * tol
  np.testing.assert_allclose(_vector(state.params), theta, rtol=0, atol=tol)
  np.testing.assert_allclose(_vector(state.extras), momentum, rtol=0, atol=tol)
  np.testing.assert_allclose(float(metrics['pseudo_grad_norm']),
                             np.linalg.norm(momentum), rtol=0, atol=2 * tol)


def test_page_fedcm_at_alpha_one_is_fedavg(page):
  """alpha = 1 drops the momentum: the update is FedAvg's over lr K."""
  population = _population()
  mine = page['my_fedcm'](page['loss_fn'], alpha=1.0,
                          client_optimizer=algos.default_sgd(LR))
  base = algos.fedavg(page['loss_fn'], client_optimizer=algos.default_sgd(LR),
                      server_optimizer=algos.default_sgd(1.0 / (LR * 3)))
  params = {'w': jnp.asarray(THETA0[:-1], jnp.float32),
            'b': jnp.asarray(THETA0[-1], jnp.float32)}
  cohort = next(_cohorts(population, [[0, 4]], S))  # 5 examples: 3 steps each.
  a, _ = mine.round(mine.init(params), cohort, jax.random.key(0))
  b, _ = base.round(base.init(params), cohort, jax.random.key(0))
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=0, atol=ft.atol(4 * S, 10.0))


@pytest.mark.slow  # The runner: data, compilation, two rounds, evaluation.
def test_page_config_runs_the_registered_algorithm(page):
  from fedjx.experiments import registry  # pylint: disable=import-outside-toplevel
  blocks = list(enumerate(code_blocks(PAGE.read_text())))[2:]
  try:
    namespace = _run_blocks(blocks, dict(page))
  finally:
    registry.ALGORITHMS.pop('my_feddyn', None)
  result = namespace['result']
  assert result.step == 2
  assert 0.0 <= result.history[-1]['eval_accuracy'] <= 1.0
  # The runner gave the builder the population size it declares.
  assert np.isfinite(result.history[-1]['h_norm'])
