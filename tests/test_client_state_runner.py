"""The runner with per-client state in a ClientStore (config.client_state).

SCAFFOLD under ``placement='store'`` keeps its ``c_i`` in the run's store;
under ``'device'`` in the dense ``state.client_states``. The dense run is
the independent reference for the store's rows: after every round its
``client_controls[i]`` is the ``c_i`` the store must hold. Faults (SIGTERM,
SIGKILL during a checkpoint write, a damaged newest checkpoint, a resumed
run) must end bit-identical to the uninterrupted store run, rows included.
"""

import os
import signal

import jax
import numpy as np
import pytest

from fedjx import client_store
from fedjx.experiments import checkpointing
from fedjx.experiments import client_states
from fedjx.experiments import config as config_schema
from fedjx.experiments import runner
from fedjx.experiments.config_base import base_config, optimizer

import test_faults

ROUNDS = 6
NUM_CLIENTS = 12


def _config(rounds=ROUNDS, placement='store'):
  config = base_config()
  config.seed = 5
  config.rounds = rounds
  config.cohort_size = 4
  config.batch_size = 16
  config.local_steps = 2
  config.eval_every = 2
  config.checkpoint_every = 2
  config.progress = False
  config.plot = False
  config.tensorboard = False
  config.dataset = dict(name='digits', num_clients=NUM_CLIENTS, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(name='scaffold',
                          client_optimizer=optimizer('sgd', learning_rate=0.1))
  config.client_state.placement = placement
  return config


def _rows(workdir, step, like):
  """Every client's row as saved at ``step`` in ``workdir``'s store."""
  store = client_store.ClientStore(like, NUM_CLIENTS,
                                   directory=os.path.join(workdir, 'client_states'))
  try:
    store.restore(step)
    return store.read(np.arange(NUM_CLIENTS)), len(store)
  finally:
    store.close()


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('reference'))
  return runner.run(_config(), workdir, log=lambda msg: None)


@pytest.fixture(scope='module')
def dense(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('dense'))
  return runner.run(_config(placement='device'), workdir, log=lambda msg: None)


def _zeros(result):
  return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), result.state.params)


def _assert_like(reference, result):
  assert result.step == ROUNDS
  assert checkpointing.checksum(result.state) == checkpointing.checksum(
      reference.state)
  want, n_want = _rows(reference.workdir, ROUNDS, _zeros(reference))
  got, n_got = _rows(result.workdir, ROUNDS, _zeros(reference))
  assert n_got == n_want
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)
  strip = lambda rows: [{k: v for k, v in r.items() if k != 'elapsed_s'}
                        for r in rows]
  assert strip(result.history) == strip(reference.history)


@pytest.mark.slow
def test_store_rows_are_the_dense_client_controls(reference, dense):
  """The store run's c_i and model against the dense run's, which keeps them
  in the state (the same rounds, programs that differ only in where c_i
  live: equal to float32 rounding of the same sums)."""
  rows, held = _rows(reference.workdir, ROUNDS, _zeros(reference))
  controls = dense.state.client_states
  touched = [i for i in range(NUM_CLIENTS) if any(
      np.any(np.asarray(x)[i] != 0) for x in jax.tree.leaves(controls))]
  assert held == len(touched) > 0  # Only clients that trained hold an entry.
  for got, want in zip(jax.tree.leaves(rows), jax.tree.leaves(controls)):
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(reference.state.params),
                       jax.tree.leaves(dense.state.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-6)
  assert not jax.tree.leaves(reference.state.client_states)  # In the store.


@pytest.mark.slow
def test_resumed_run_is_bit_identical_rows_included(reference, tmp_path):
  workdir = str(tmp_path / 'run')
  first = runner.run(_config(rounds=4), workdir, log=lambda msg: None)
  assert first.step == 4
  result = runner.run(_config(), workdir, log=lambda msg: None)
  _assert_like(reference, result)


@pytest.mark.slow
def test_sigterm_then_resume_is_bit_identical(reference, tmp_path):
  workdir = str(tmp_path / 'run')

  def term_at_three(step, state, row):
    del state, row
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)

  stopped = runner.run(_config(), workdir, hooks=[term_at_three],
                       log=lambda msg: None)
  assert stopped.interrupted and stopped.step == 3
  result = runner.run(_config(), workdir, log=lambda msg: None)
  _assert_like(reference, result)


@pytest.mark.slow
@pytest.mark.parametrize('damage', [test_faults._truncate, test_faults._flip],
                         ids=['truncated', 'flipped'])
def test_a_damaged_checkpoint_falls_back_and_restores_that_steps_rows(
    reference, tmp_path, damage):
  workdir = str(tmp_path / 'run')
  runner.run(_config(rounds=4), workdir, log=lambda msg: None)
  damage(test_faults._largest_data_file(workdir, 4))
  logged = []
  result = runner.run(_config(), workdir, log=logged.append)
  assert any('step 4 is damaged' in m for m in logged), logged
  assert any('after round 2' in m for m in logged), logged
  _assert_like(reference, result)


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume(reference, tmp_path):
  """The store saved step 4, the state's write was started: killed. The rerun
  restores the newest intact checkpoint (2 or 4) and the store's rows of it."""
  files = tmp_path / 'files'
  files.mkdir()
  (files / 'fault.py').write_text(test_faults.FAULT)
  (files / 'config_file.py').write_text(_CONFIG_FILE)
  workdir = tmp_path / 'run'
  killed = test_faults._fedjx_run(files, workdir, fault='kill_in_save:4')
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  done = test_faults._fedjx_run(files, workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  result = runner.run(_config(), str(workdir), log=lambda msg: None)  # Done: loads.
  _assert_like(reference, result)


_CONFIG_FILE = '''
from fedjx.experiments.config_base import base_config, optimizer

def get_config():
  config = base_config()
  config.seed = 5
  config.rounds = 6
  config.cohort_size = 4
  config.batch_size = 16
  config.local_steps = 2
  config.eval_every = 2
  config.checkpoint_every = 2
  config.progress = False
  config.plot = False
  config.tensorboard = False
  config.dataset = dict(name='digits', num_clients=12, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(name='scaffold',
                          client_optimizer=optimizer('sgd', learning_rate=0.1))
  return config
'''


def test_config_client_state_is_checked_in_one_line():
  config = _config()
  config.client_state.placement = 'host'
  with pytest.raises(config_schema.ConfigError,
                     match=r"config.client_state.placement='host' is not one of"):
    config_schema.with_defaults(config)
  config = _config()
  config.client_state.memory_budget_mb = -1
  with pytest.raises(config_schema.ConfigError,
                     match=r'config.client_state.memory_budget_mb=-1; it must'):
    config_schema.with_defaults(config)
  config = _config()
  config.client_state = dict(placement='store', budget=3)
  with pytest.raises(config_schema.ConfigError, match=r"client_state\['budget'\]"):
    config_schema.with_defaults(config)
  filled = config_schema.with_defaults(base_config())
  assert filled.client_state.to_dict() == {
      'placement': 'auto', 'memory_budget_mb': 1024, 'directory': ''}
  # Where rows live does not change results: a resumed run may change it.
  a, b = _config(), _config()
  b.client_state.memory_budget_mb = 1
  b.client_state.directory = '/elsewhere'
  assert config_schema.fingerprint(config_schema.with_defaults(a)) == (
      config_schema.fingerprint(config_schema.with_defaults(b)))


def test_device_placement_is_refused_without_a_dense_array(tmp_path):
  from fedjx.experiments import experiment  # pylint: disable=import-outside-toplevel
  config = _config()
  config.algorithm = dict(name='fedrep')
  config.client_state.placement = 'device'
  with pytest.raises(config_schema.ConfigError,
                     match=r"placement='device' but algorithm 'fedrep' offers no"):
    experiment.build(config_schema.with_defaults(config))


def test_attach_and_write_back_follow_the_cohort(tmp_path):
  """Rows are read in cohort order (a padding client reads the initial row)
  and written back by id (the padding row dropped)."""
  from fedjx import datasets  # pylint: disable=import-outside-toplevel
  initial = {'c': np.zeros((2,), np.float32)}
  store = client_store.ClientStore(initial, 5, directory=str(tmp_path))
  store.write(np.array([3]), {'c': np.array([[1., 2.]], np.float32)})
  cohort = datasets.Cohort(batches={}, mask=jax.numpy.ones((3, 1, 1), bool),
                           num_examples=jax.numpy.ones((3,)),
                           client_ids=jax.numpy.array([3, 0, -1]))
  attached = client_states.attach(store, cohort)
  np.testing.assert_array_equal(np.asarray(attached.client_states['c']),
                                [[1., 2.], [0., 0.], [0., 0.]])
  assert isinstance(attached.client_states['c'], jax.Array)
  new = {'c': np.array([[5., 5.], [6., 6.], [7., 7.]], np.float32)}
  client_states.write_back(store, attached, new)
  np.testing.assert_array_equal(store.read(np.arange(5))['c'],
                                [[6., 6.], [0., 0.], [0., 0.], [5., 5.], [0., 0.]])
  assert len(store) == 2
  steps = client_states.StoreSteps(store)
  steps.save(2)
  steps.save(2)  # The interrupt's save of a step already saved: once.
  assert store.saved_steps() == [2]
  store.close()



def _digits_with_a_nan_client(bad):
  """The digits builder with NaN in the first feature of every example of
  client ``bad`` (so every round that samples it is not finite)."""
  from fedjx.datasets import federated  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import data as data_lib  # pylint: disable=import-outside-toplevel

  class Poisoned(federated.MappedDataset):

    def _client_data(self, cid):
      out = dict(self._base.client_data(cid))
      if cid == bad:
        x = np.array(out['x'], np.float32)
        x[:, 0] = np.nan
        out['x'] = x
      return out

  def build(num_clients=50, alpha=0.5, seed=0):
    data = data_lib.digits(num_clients=num_clients, alpha=alpha, seed=seed)
    return data_lib.ExperimentData(Poisoned(data.train, lambda e: e), data.test,
                                   data.info)
  return build


@pytest.mark.slow
@pytest.mark.parametrize('execution,first', [('jit', 'late'), ('streaming', 'late'),
                                             ('streaming', 'early')])
def test_a_round_redone_guarded_writes_its_rows_once(tmp_path, execution, first):
  """A NaN client first sampled after the first checkpoint ('late'; 'early':
  in round 1, before it): its round runs unguarded, is not finite, and is
  redone guarded from the state before it, which the runner rebuilds from
  the checkpoint with the store restored to it (or from the initial state
  with the store reset) and the rounds since replayed. Streamed, the redone
  round stages its rows in the same store. The run equals the same rounds by
  hand with the rows kept in a dict, rows included: bit for bit compiled,
  to float32 summation order streamed."""
  from fedjx.experiments import guarded_rounds  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import registry  # pylint: disable=import-outside-toplevel
  from fedjx.experiments import experiment  # pylint: disable=import-outside-toplevel
  config = config_schema.with_defaults(_config())
  exp = experiment.build(config)
  rounds = [np.asarray(c.client_ids).tolist() for c in exp.cohorts(0, ROUNDS)]
  def first_round(i):
    return min([r for r, ids in enumerate(rounds) if i in ids] or [0])
  bad = next(i for i in range(NUM_CLIENTS)
             if (first_round(i) >= 3 if first == 'late' else first_round(i) == 1))
  registry.register_dataset('digits_nan', _digits_with_a_nan_client(bad))
  try:
    config = _config()
    config.dataset.name = 'digits_nan'
    config.execution = execution
    config.streaming_chunk_size = 3
    result = runner.run(config, str(tmp_path), log=lambda msg: None)
    exp = experiment.build(config_schema.with_defaults(config))
    fast = guarded_rounds.checking_finiteness(experiment.build_algorithm(
        exp.config, exp.model, NUM_CLIENTS, guarded=False), whole=True)
    slow = guarded_rounds.checking_finiteness(exp.algorithm)
    initial = _zeros(result)
    rows = {}  # The hand store: client id -> row.
    state = exp.algorithm.init(exp.init_params)
    peek = jax.jit(fast.apply)  # Does not donate.
    redone = []
    for r, cohort in enumerate(exp.cohorts(0, ROUNDS)):
      ids = np.asarray(cohort.client_ids).tolist()
      cohort = cohort._replace(client_states=jax.tree.map(
          lambda *leaves: jax.numpy.asarray(np.stack(leaves)),
          *[rows.get(i, initial) for i in ids]))
      key = exp.round_key_for(r)
      finite = bool(peek(state, cohort, key)[1][guarded_rounds.RESULT_FINITE])
      assert finite is (bad not in ids)
      if not finite:
        redone.append(r)
      state, _, new = (fast if finite else slow).round(state, cohort, key)
      for k, i in enumerate(ids):
        if i >= 0:
          rows[i] = jax.tree.map(lambda x: np.asarray(x)[k], new)
    assert redone and (redone[0] >= 3 if first == 'late' else redone[0] == 1)
    # Streamed sums run in chunk order (compensated): the tolerance of the
    # streamed run against the compiled one (the test below).
    same = (np.testing.assert_array_equal if execution == 'jit' else
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6))
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(state)):
      same(np.asarray(a), np.asarray(b))
    got, held = _rows(str(tmp_path), ROUNDS, initial)
    assert held == len(rows)
    for i in range(NUM_CLIENTS):
      want = rows.get(i, initial)
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        same(g[i], w)
  finally:
    registry.DATASETS.pop('digits_nan')


def test_a_sweep_refuses_an_algorithm_whose_rows_live_only_in_a_store():
  from fedjx.experiments.sweeps import plan  # pylint: disable=import-outside-toplevel
  config = _config()
  config.algorithm = dict(name='fedrep')
  with pytest.raises(config_schema.ConfigError,
                     match=r"^fedjx-sweep: algorithm 'fedrep' keeps per-client state"):
    plan.build_trial(config_schema.validate(config))


def test_a_streamed_store_backed_run_equals_the_compiled_run_rows_included(
    tmp_path, reference):
  # Streamed rounds read each chunk's rows from the store as the chunk loads
  # and return the new rows gathered chunk by chunk on the host; sums run in
  # chunk order, compensated: float32 summation-order differences only.
  config = _config()
  config.execution = 'streaming'
  config.streaming_chunk_size = 3
  workdir = str(tmp_path)
  result = runner.run(config, workdir, log=lambda msg: None)
  assert result.step == ROUNDS
  like = _zeros(result)
  got, held = _rows(workdir, ROUNDS, like)
  want, want_held = _rows(reference.workdir, ROUNDS, like)
  assert held == want_held
  for g, w in zip(jax.tree.leaves((result.state.params, got)),
                  jax.tree.leaves((reference.state.params, want))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_auto_placement_keeps_replicas_on_the_device_and_clients_in_a_store():
  from fedjx.experiments import registry
  # A population of clients (SCAFFOLD's num_clients) reads a cohort's rows
  # from a store; DiLoCo's few replicas keep theirs in the server state.
  assert registry.resolve_placement('scaffold', 'auto') == 'store'
  assert registry.resolve_placement('diloco', 'auto') == 'device'
  assert registry.resolve_placement('diloco_recipe', 'auto') == 'device'
  assert registry.resolve_placement('diloco', 'store') == 'store'
  assert registry.resolve_placement('scaffold', 'device') == 'device'


@pytest.mark.parametrize('execution', ['jit', 'streaming'])
def test_diloco_replicas_states_in_a_store_match_the_device(tmp_path, execution):
  """DiLoCo's 3 replicas' AdamW states kept on the host (placement='store',
  compiled or streamed one replica at a time) against the same run with the
  states in the server state: the same rounds, whose outer gradients differ
  only in the order of float32 sums of 3 terms, so the models agree to a
  few float32 roundings over 3 rounds of 4 inner AdamW steps."""
  def config(placement):
    c = _config(rounds=3, placement=placement)
    c.dataset = dict(name='digits', num_clients=3, alpha=0.5)
    c.cohort_size = 3
    c.algorithm = dict(name='diloco', inner_steps=4)
    c.execution = execution if placement == 'store' else 'jit'
    return c

  host = runner.run(config('store'), str(tmp_path / 'host'), log=lambda msg: None)
  device = runner.run(config('device'), str(tmp_path / 'device'), log=lambda msg: None)
  assert not jax.tree.leaves(host.state.client_states)  # In the store.
  assert jax.tree.leaves(device.state.client_states)
  for got, want in zip(jax.tree.leaves(host.state.params),
                       jax.tree.leaves(device.state.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  store = client_store.ClientStore(
      jax.tree.map(lambda x: np.asarray(x)[0], device.state.client_states), 3,
      directory=os.path.join(host.workdir, 'client_states'))
  try:
    store.restore(3)
    rows = store.read(np.arange(3))
  finally:
    store.close()
  for got, want in zip(jax.tree.leaves(rows), jax.tree.leaves(device.state.client_states)):
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
