"""FedProx against a hand-written loop on the proximal objective."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjx.algorithms as algos
from test_algorithms_util import KEY, assert_trees_close, linreg_data
from test_algorithms_util import linreg_loss, linreg_params, make_cohort
from test_algorithms_util import reference_sgd, weighted_average


def test_fedprox_matches_proximal_local_sgd():
  sizes = [3, 9, 6]
  data = linreg_data(np.random.default_rng(20), sizes, shift=3.0)
  params = linreg_params()
  mu, lr = 0.5, 0.1
  cohort = make_cohort(data, batch_size=3)
  algo = algos.fedprox(linreg_loss, mu=mu, client_optimizer=optax.sgd(lr),
                       local_epochs=2)
  state = algo.init(params)
  x = params
  for _ in range(2):
    state, metrics = algo.round(state, cohort, KEY)
    # grad of h_i(y) = F_i(y) + mu/2 ||y - x||^2 is grad F_i(y) + mu (y - x).
    prox = lambda g, y, x=x: jax.tree.map(lambda y, x: mu * (y - x), y, x)
    ys = [reference_sgd(linreg_loss, x, d, 3, lr, epochs=2, correction=prox)[0]
          for d in data]
    x = weighted_average(ys, sizes)
  assert_trees_close(state.params, x)
  # mu is traced: mu = 0 in the state gives FedAvg's local SGD.
  hp = dict(state.hparams, mu=jnp.float32(0.0))
  state, _ = algo.round(state._replace(hparams=hp), cohort, KEY)
  ys = [reference_sgd(linreg_loss, x, d, 3, lr, epochs=2)[0] for d in data]
  assert_trees_close(state.params, weighted_average(ys, sizes))
  assert np.isfinite(metrics['train_loss_after'])


def test_fedprox_rejects_negative_mu():
  with pytest.raises(ValueError, match='mu'):
    algos.fedprox(linreg_loss, mu=-1.0)
