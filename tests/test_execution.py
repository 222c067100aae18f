"""fedjx.execution and config.execution: jit, streaming and the auto choice."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from fedjx import algorithms
from fedjx import datasets
from fedjx import execution
from fedjx.experiments import config as config_lib
from fedjx.experiments import registry
from fedjx.experiments import runner


def _loss(params, batch):
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


def _cohort(clients=9, steps=2, batch=4):
  rng = np.random.default_rng(0)
  batches = {'x': rng.normal(size=(clients, steps, batch, 5)).astype(np.float32),
             'y': rng.integers(0, 3, size=(clients, steps, batch)).astype(np.int32)}
  mask = np.ones((clients, steps, batch), bool)
  return datasets.Cohort(batches, mask, mask.sum((1, 2)).astype(np.float32),
                         np.arange(clients, dtype=np.int32))


def _state(algo):
  return algo.init({'w': jnp.full((5, 3), 0.01), 'b': jnp.zeros(3)})


@pytest.mark.parametrize('mode,headroom,says', [
    ('streaming', 0.8, None), ('auto', 0.8, None),
    ('auto', 0.0, 'streaming the cohort in chunks of 4')])
def test_every_execution_gives_the_compiled_round(mode, headroom, says):
  algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1))
  cohort, key = _cohort(), jax.random.key(0)
  want = jax.jit(algo.apply)(_state(algo), cohort, key)
  logged = []
  run = execution.round_runner(algo, mode, chunk_size=4, log=logged.append,
                               headroom=headroom)
  for _ in range(2):  # The second call reuses the first one's decision.
    got = run(_state(algo), cohort, key)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # Float32 sums of 9 clients in another order: rtol ~ 9 * 2**-24.
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  if says is None:
    assert not logged
  else:
    assert len(logged) == 1 and says in logged[0]


def test_auto_compiles_the_round_once():
  # 'auto' compiles the round for its memory plan; the round then runs that
  # executable: algorithm.round (whose jit cache lower().compile() does not
  # fill) never compiles it a second time.
  algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1))
  cohort, key = _cohort(), jax.random.key(0)
  want = jax.jit(algo.apply)(_state(algo), cohort, key)
  run = execution.round_runner(algo, 'auto', log=lambda m: None)
  state = _state(algo)
  assert run.loads_whole(state, key)(cohort)  # The decision, from shapes.
  for _ in range(2):
    got = run(_state(algo), jax.device_put(cohort), key)
  assert algo.round._cache_size() == 0  # pylint: disable=protected-access
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_running_out_of_memory_while_a_round_runs_is_one_line_naming_the_settings():
  # What the compiled plan did not see (fragmentation, buffers beside the
  # round) fails at run time; the runner names the program and the settings.
  algo = algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1))
  cohort, key = jax.device_put(_cohort()), jax.random.key(0)
  run = execution.round_runner(algo, 'auto', log=lambda m: None)
  run(_state(algo), cohort, key)  # Compiles and keeps the round's executable.

  def exhausted(*args):
    raise ValueError('RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to '
                     'allocate 1.08G. That was not possible.\nmore of the log')

  run._compiled = {k: exhausted for k in run._compiled}  # pylint: disable=protected-access
  with pytest.raises(execution.OutOfMemory) as e:
    run(_state(algo), cohort, key)
  message = str(e.value)
  assert message.startswith("the round ran out of the device's memory while running "
                            '(Error allocating device buffer: Attempting to allocate 1.08G.')
  assert 'config.' in message and '\n' not in message


def test_streamed_chunks_hold_a_budget_of_client_data():
  # 64 MiB of data per chunk, at least 64 clients, at most the cohort.
  assert execution.streaming_chunk(4096, 10**6) == 2**26 // 4096
  assert execution.streaming_chunk(2**22, 10**6) == 64
  assert execution.streaming_chunk(100, 1000) == 1000
  # A client larger than a chunk's bytes (a replica with its optimizer
  # state) streams alone.
  assert execution.streaming_chunk(2**26 + 1, 8) == 1
  algo = algorithms.fedavg(_loss)
  run = execution.round_runner(algo, 'streaming')
  per_client = (2 * 4 * 5 * 4) + (2 * 4 * 4) + (2 * 4) + 4 + 4  # x, y, mask, n, id
  assert run.chunk_for(_cohort(clients=9)) == 9
  assert execution.streaming_chunk(per_client, 10**6) == 2**26 // per_client


def test_unknown_execution_is_an_error():
  algo = algorithms.fedavg(_loss)
  with pytest.raises(ValueError, match="execution='fast' is not one of"):
    execution.round_runner(algo, 'fast')


def test_config_execution_is_validated():
  config = ml_collections.ConfigDict({
      'dataset': {'name': 'digits', 'num_clients': 10},
      'model': {'name': 'logistic_regression'},
      'algorithm': {'name': 'fedavg'}, 'execution': 'fast'})
  with pytest.raises(registry.ConfigError, match="config.execution='fast'"):
    config_lib.validate(config)
  config.execution = 'streaming'
  assert config_lib.validate(config).execution == 'streaming'
  assert config_lib.validate({k: v for k, v in config.items() if k != 'execution'}
                         ).execution == 'auto'


def test_runner_streams_rounds_to_the_same_results(tmp_path, monkeypatch):
  def config(execution):
    return ml_collections.ConfigDict({
        'seed': 1, 'rounds': 2, 'cohort_size': 5, 'batch_size': 16,
        'local_epochs': 1, 'eval_every': 2, 'checkpoint_every': 2,
        'progress': False, 'plot': False, 'tensorboard': False,
        'streaming_chunk_size': 2, 'execution': execution,
        'dataset': {'name': 'digits', 'num_clients': 12, 'alpha': 0.5},
        'model': {'name': 'logistic_regression'},
        'algorithm': {'name': 'fedavg'}})

  # Every read of client data for a round goes through make_cohort in
  # fedjx.datasets.prefetch: record how many clients each call reads at once.
  loaded = []
  make_cohort = datasets.prefetch.make_cohort

  def counting(dataset, client_ids, *args, **kwargs):
    loaded.append(int(np.sum(np.asarray(client_ids) != datasets.PADDING_CLIENT)))
    return make_cohort(dataset, client_ids, *args, **kwargs)

  monkeypatch.setattr(datasets.prefetch, 'make_cohort', counting)
  logged = []
  jit = runner.run(config('jit'), str(tmp_path / 'jit'), log=logged.append)
  assert max(loaded) == 5  # The compiled round reads each cohort whole.
  loaded.clear()
  streamed = runner.run(config('streaming'), str(tmp_path / 'streaming'),
                        log=logged.append)
  # Streamed: one chunk of 2 clients at a time, never the cohort of 5
  # (5 clients per round: chunks of 2, 2 and 1, plus one client for the spec).
  assert loaded and max(loaded) <= 2
  assert sum(loaded) >= 2 * 5
  # Float32 sums of 5 clients in chunks of 2 (compensated across chunks)
  # against one sum of 5, over 2 rounds: rtol ~ 2 * 2 * 5 * 2**-24 < 1e-5.
  for g, w in zip(jax.tree.leaves(streamed.state), jax.tree.leaves(jit.state)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert streamed.history[-1]['train_loss_after'] == pytest.approx(
      jit.history[-1]['train_loss_after'], rel=1e-5)


def test_lazy_cohorts_load_what_the_placed_cohorts_hold():
  population = datasets.synthetic(1.0, 1.0, num_clients=9, seed=0,
                                  min_examples=2, max_examples=12)

  class ThreeOfFive:  # Draws fewer than its cohort size: two padding clients.
    cohort_size, seed = 5, 4

    def sample(self, round_num):
      return np.sort(np.random.default_rng(round_num).choice(9, 3, replace=False)
                     ).astype(np.int32)

  kwargs = dict(num_epochs=2, max_steps=6, sampler=ThreeOfFive(), num_rounds=3,
                prefetch=0)
  eager = list(datasets.cohort_iterator(population, 5, 3, **kwargs))
  lazy = list(datasets.prefetch.lazy_cohort_iterator(population, 5, 3, **kwargs))
  for placed, clients in zip(eager, lazy):
    assert list(clients.client_ids) == list(np.asarray(placed.client_ids))
    assert clients.placed_spec().mask.shape == placed.mask.shape
    # Any chunk of clients: the same rows, bit for bit.
    chunk = clients.client_ids[1:4]
    for got, want in zip(jax.tree.leaves(clients.load(chunk)),
                         jax.tree.leaves(placed)):
      np.testing.assert_array_equal(got, np.asarray(want)[1:4])
  whole = list(datasets.prefetch.lazy_cohort_iterator(
      population, 5, 3, whole=lambda clients: True, **kwargs))
  for placed, got in zip(eager, whole):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(placed)):
      np.testing.assert_array_equal(a, b)
