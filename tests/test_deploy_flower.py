"""fedjx rounds on Flower: on a real federation, a SuperLink and 3
SuperNodes started as processes on 127.0.0.1 (fedjx.deploy.local), the App
submitted with ``flwr run``; and the strategy with the ClientApp's own
functions over an in-process Grid.

Needs the flower extra (pip install -e '.[flower]'). Each process test runs
for a minute or more, so those are slow tests (pytest -m slow); every
process a test starts is stopped when it ends, on failure too.
"""

import functools
import itertools
import json
import os
import threading
import time
from unittest import mock

import pytest

pytest.importorskip(
    'flwr', reason="Flower is not installed: pip install -e '.[flower]' (the "
    'flower extra) to run fedjx on a local Flower federation')

import jax  # noqa: E402
import numpy as np  # noqa: E402

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from fedjx.deploy import flower  # noqa: E402
from fedjx.deploy import local  # noqa: E402
from fedjx.deploy import programs  # noqa: E402
from fedjx.deploy import rounds  # noqa: E402
from fedjx.experiments import experiment  # noqa: E402
from fedjx.experiments import metrics_writers  # noqa: E402
from fedjx.experiments import runner  # noqa: E402
from fedjx.experiments.deploy import app_dir  # noqa: E402
from fedjx.experiments.deploy import apps  # noqa: E402
from fedjx.experiments.deploy import config_rounds  # noqa: E402
from fedjx.experiments.deploy.config_rounds import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = 3
# Three clients, one per node; 8 local steps of 10 examples; a small MLP.
SMALL = ('rounds=3 cohort_size=3 dataset.num_clients=3 model.hidden=(16,) '
         'local_epochs=None local_steps=8 eval_every=1 checkpoint_every=1')
DP = ("algorithm={'name':'dp_fedavg','clip_norm':0.05,'noise_multiplier':0.5,"
      "'expected_clients_per_round':3.0,"
      "'client_optimizer':{'name':'sgd','learning_rate':0.3}}")


@pytest.fixture(scope='module')
def federation(tmp_path_factory):
  home = tmp_path_factory.mktemp('flower')
  with local.LocalFederation(NODES, str(home)) as fed:
    yield fed


def _deploy(fed, tmp_path, config_file, overrides, timeout=120.0):
  workdir = str(tmp_path / 'deployed')
  app = app_dir.write_app(str(tmp_path / 'app'))
  status = fed.run(app, dict(config=os.path.join(REPO, 'configs', config_file),
                             overrides=overrides, workdir=workdir, timeout=timeout),
                   timeout=900)
  assert status == 0, open(fed.log_path('run'), encoding='utf-8').read()[-3000:]
  return workdir


def _rows(workdir):
  return {r['round']: r for r in metrics_writers.read_metrics(workdir)}


def _details(workdir):
  with open(os.path.join(workdir, 'deploy.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def _close(got, want):
  # Both runs do float32 client work on the same data with the same keys;
  # the deployed aggregates are float64 sums of 3 clients rounded once, the
  # simulated round sums in float32 (<= 3 * 2**-24 relative apart), and 3
  # rounds of 8 local SGD steps amplify that by well under 10.
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=3 * 10 * 3 * 2**-23, atol=2e-6)


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads sockets from /proc')
def test_a_superlink_port_taken_by_another_program_is_said_at_once(tmp_path, monkeypatch):
  """Another program listens on the port picked for the SuperLink (taken
  between the pick and the bind): a connection to it succeeds, but the
  federation sees that its SuperLink is not the one listening, says so in
  one line and starts no node (before, the nodes were started against the
  other program and the run failed 41 s later)."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as listener:
    listener.bind(('127.0.0.1', 0))
    listener.listen()
    port = listener.getsockname()[1]
    monkeypatch.setattr(local, 'free_port', lambda: port)
    fed = local.LocalFederation(NODES, str(tmp_path / 'flower'), grace=2.0)
    with pytest.raises(local.FederationError, match=(
        f'another program listens on 127.0.0.1:{port}, which was free when it '
        'was picked for the superlink')):
      with fed:
        pass
  assert fed.nodes == [] and fed.superlink.poll() is not None


@pytest.mark.slow
@pytest.mark.parametrize('config_file', ['fedavg_digits.py', 'fedadam_digits.py'])
def test_deployed_rounds_equal_the_simulated_rounds(federation, tmp_path, config_file):
  workdir = _deploy(federation, tmp_path, config_file, SMALL)
  deployed, step = runner.load_state(workdir)  # fedjx's own reader
  assert step == 3
  config = load_config(os.path.join(REPO, 'configs', config_file), SMALL)
  simulated = runner.run(config, str(tmp_path / 'simulated'))
  for g, w in zip(jax.tree.leaves(deployed), jax.tree.leaves(simulated.state)):
    _close(g, w)
  rows, sim_rows = _rows(workdir), {r['round']: r for r in simulated.history}
  for r in (1, 2, 3):
    for key in ('train_loss_before', 'train_loss_after', 'eval_loss', 'examples'):
      _close(rows[r][key], sim_rows[r][key])
    assert rows[r]['deploy_replied'] == NODES and rows[r]['deploy_failed'] == 0

  # Bytes on the wire, against the model's size: the program goes once to
  # each node; after that a client receives the model (and a few scalars
  # and the data spec) and sends back its weighted update and statistics.
  model = rows[1]['deploy_model_bytes']
  assert model == sum(np.asarray(x).nbytes for x in jax.tree.leaves(deployed.params))
  assert rows[1]['deploy_programs_sent'] == NODES
  for r in (2, 3):
    assert rows[r]['deploy_programs_sent'] == 0
    down = rows[r]['deploy_bytes_to_clients'] / NODES
    up = rows[r]['deploy_bytes_from_clients'] / NODES
    assert model < down < 1.5 * model + 2048, (down, model)
    assert model < up < 1.5 * model + 2048, (up, model)
  first = rows[1]['deploy_bytes_to_clients'] - rows[2]['deploy_bytes_to_clients']
  assert first >= NODES * rows[1]['deploy_program_bytes']


@pytest.mark.slow
def test_a_deployed_run_resumes_from_its_checkpoint(federation, tmp_path):
  config_file = 'fedavg_digits.py'
  _deploy(federation, tmp_path, config_file, SMALL.replace('rounds=3', 'rounds=2'))
  workdir = _deploy(federation, tmp_path, config_file, SMALL)  # the same workdir
  assert sorted(_rows(workdir)) == [0, 1, 2, 3]
  assert [d['round'] for d in _details(workdir)] == [0, 1, 2]
  assert 'resuming' in open(federation.log_path('run'), encoding='utf-8').read()
  deployed, step = runner.load_state(workdir)
  assert step == 3
  config = load_config(os.path.join(REPO, 'configs', config_file), SMALL)
  simulated = runner.run(config, str(tmp_path / 'simulated'))
  for g, w in zip(jax.tree.leaves(deployed), jax.tree.leaves(simulated.state)):
    _close(g, w)


@pytest.mark.slow
def test_dp_clipping_happens_on_the_clients(federation, tmp_path):
  clip = 0.05
  workdir = _deploy(federation, tmp_path, 'fedavg_digits.py', f'{SMALL} {DP}')
  state, _ = runner.load_state(workdir)
  param_shapes = [list(np.shape(x)) for x in jax.tree.leaves(state.params)]
  rows = _rows(workdir)
  for detail in _details(workdir):
    update = [i for i, s in enumerate(detail['output_shapes']) if s in param_shapes and s]
    assert len(update) == len(param_shapes)
    assert len(detail['received_norms']) == NODES
    for norms in detail['received_norms'].values():
      # What the server received from each client: a clipped update
      # (float32 rescaling to the clip norm: a few ulps).
      assert np.sqrt(sum(norms[i] ** 2 for i in update)) <= clip * (1 + 1e-5)
    # The clients' own updates were larger than the clip: clipping did work.
    row = rows[detail['round'] + 1]
    assert row['mean_update_norm'] > 2 * clip and row['clipped_fraction'] == 1.0


def _log_count(path, text):
  try:
    with open(path, encoding='utf-8', errors='replace') as f:
      return f.read().count(text)
  except FileNotFoundError:
    return 0


@pytest.mark.slow
def test_a_node_killed_mid_round(tmp_path):
  """Node 2 dies while it runs round 1's client work: round 1 aggregates the
  other two clients (Flower FedAvg's rule: the replies that arrived, when
  the SuperLink reports the node unavailable or the timeout passes), round
  2 runs without it, and the metrics count the missing client."""
  workdir = str(tmp_path / 'deployed')
  app = app_dir.write_app(str(tmp_path / 'app'))
  config_file = os.path.join(REPO, 'configs', 'fedavg_digits.py')
  status = []
  with local.LocalFederation(NODES, str(tmp_path / 'flower')) as fed:
    run = threading.Thread(target=lambda: status.append(fed.run(
        app, dict(config=config_file, overrides=SMALL, workdir=workdir, timeout=60.0,
                  **{'wait-s': 5.0}),
        timeout=900)))
    run.start()
    node_log = fed.log_path('node-2')
    deadline = time.monotonic() + 600
    # The second train message has reached node 2: round 1 is under way there.
    while _log_count(node_log, 'Receiving: train message') < 2:
      assert run.is_alive() and time.monotonic() < deadline
      time.sleep(0.1)
    fed.kill_node(2)
    run.join(timeout=900)
  assert status == [0]
  rows, details = _rows(workdir), _details(workdir)
  assert rows[1]['deploy_replied'] == 3
  for r in (2, 3):  # rounds 1 and 2 ran without node 2
    assert rows[r]['deploy_sampled'] == 3
    assert rows[r]['deploy_replied'] == 2 and rows[r]['deploy_failed'] == 1
    assert rows[r]['clients'] == 2.0  # the algorithm's own count
    assert details[r - 1]['replied'] == [0, 1]
    assert list(details[r - 1]['failed']) == ['2']

  # The same rounds simulated with client 2 as a padding client (no
  # examples, weight 0) where it was missing.
  config = load_config(config_file, SMALL)
  exp = experiment.build(config)
  state = exp.algorithm.init(exp.init_params)
  apply = jax.jit(exp.algorithm.apply)
  for r, cohort in enumerate(exp.cohorts(0, 3)):
    if r >= 1:
      mask = np.asarray(cohort.mask).copy()
      mask[2] = False
      num = np.asarray(cohort.num_examples).copy()
      num[2] = 0
      cohort = cohort._replace(mask=mask, num_examples=num)
    state, _ = apply(state, cohort, exp.round_key_for(r))
  deployed, _ = runner.load_state(workdir)
  for g, w in zip(jax.tree.leaves(deployed.params), jax.tree.leaves(state.params)):
    _close(g, w)


@pytest.mark.slow
def test_flower_simulation_engine_runs_the_same_rounds(tmp_path):
  """The same App on Flower's simulation engine (virtual SuperNodes; Ray)."""
  pytest.importorskip('ray', reason="Flower's simulation engine needs Ray: pip "
                      "install 'flwr[simulation]'")
  workdir = str(tmp_path / 'deployed')
  app = app_dir.write_app(str(tmp_path / 'app'))
  config_file = os.path.join(REPO, 'configs', 'fedavg_digits.py')
  with local.LocalFederation(NODES, str(tmp_path / 'flower'), simulation=True) as fed:
    status = fed.run(app, dict(config=config_file, overrides=SMALL, workdir=workdir),
                     timeout=900)
  assert status == 0
  rows = _rows(workdir)
  assert [rows[r]['deploy_replied'] for r in (1, 2, 3)] == [NODES] * 3
  deployed, _ = runner.load_state(workdir)
  simulated = runner.run(load_config(config_file, SMALL), str(tmp_path / 'simulated'))
  for g, w in zip(jax.tree.leaves(deployed), jax.tree.leaves(simulated.state)):
    _close(g, w)


class InProcessGrid(Grid):
  """A Grid whose nodes are the ClientApp's functions called in this process:
  ``silent`` nodes say who they are but never return client work;
  ``other_version`` nodes run a fedjx 9.9; ``on_train(grid, msg)`` runs as
  each TRAIN message is pushed and returns False to leave it unanswered;
  nodes in ``gone`` are no longer connected; ``node_data`` builds a node's
  client (a config's dataset by default)."""

  def __init__(self, num_nodes, silent=(), other_version=(), on_train=None,
               node_data=config_rounds.node_data):
    self.node_data = node_data
    self.contexts = {
        100 + i: Context(run_id=1, node_id=100 + i, state=RecordDict(), run_config={},
                         node_config={'partition-id': i, 'num-partitions': num_nodes})
        for i in range(num_nodes)}
    self.silent, self.other_version = set(silent), set(other_version)
    self.on_train = on_train
    self.gone = set()
    self._ids = itertools.count()
    self._replies = {}

  def set_run(self, run):
    pass

  @property
  def run(self):
    return None

  def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
    return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                   group_id=group_id)

  def get_node_ids(self):
    return [n for n in self.contexts if n not in self.gone]

  def push_messages(self, messages):
    ids = []
    for msg in messages:
      ids.append(f'message-{next(self._ids)}')
      msg.metadata.__dict__['_message_id'] = ids[-1]
      reply = self._reply(msg)
      if reply is not None:
        self._replies[ids[-1]] = reply
    return ids

  def pull_messages(self, message_ids):
    return [self._replies.pop(m) for m in list(message_ids) if m in self._replies]

  def send_and_receive(self, messages, *, timeout=None):
    return self.pull_messages(self.push_messages(messages))

  def _reply(self, msg):
    node, query = msg.metadata.dst_node_id, msg.metadata.message_type == 'query'
    if node in self.gone or (node in self.silent and not query):
      return None
    if not query and self.on_train is not None and self.on_train(self, msg) is False:
      return None
    app = (flower.describe if query else
           functools.partial(flower.train, node_data=self.node_data))
    unpack = programs.unpack
    if node in self.other_version:
      unpack = functools.partial(programs.unpack, fedjx_version='9.9.0')
    try:
      with mock.patch.object(flower.programs, 'unpack', unpack):
        return app(msg, self.contexts[node])
    except Exception as e:  # pylint: disable=broad-except
      return Message(Error(code=0, reason=str(e)), reply_to=msg)  # as Flower does


@pytest.fixture
def task_identity():
  """The run and node a Message is created in (set by Flower in its processes)."""
  from flwr.supercore.task_identity import TaskIdentity  # pylint: disable=g-import-not-at-top
  saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # pylint: disable=protected-access
  TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
  yield
  TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = saved


@pytest.mark.slow
def test_the_strategy_leaves_out_silent_and_refusing_nodes(tmp_path, task_identity):
  overrides = ('rounds=2 cohort_size=3 dataset.num_clients=3 model.hidden=(8,) '
               'local_epochs=None local_steps=4 eval_every=1')
  config_file = os.path.join(REPO, 'configs', 'fedavg_digits.py')
  workdir = str(tmp_path / 'deployed')
  grid = InProcessGrid(3, silent={101}, other_version={102})
  strategy = apps.run_server(grid, apps.Settings(
      config_file, overrides, workdir, timeout=5.0, wait_s=0.0))
  rows, details = _rows(workdir), _details(workdir)
  for r in (1, 2):
    assert rows[r]['deploy_sampled'] == 3 and rows[r]['deploy_replied'] == 1
    assert rows[r]['deploy_failed'] == 2 and rows[r]['clients'] == 1.0
    failed = details[r - 1]['failed']
    assert failed['1'] == 'no reply within 5 s'
    # The node of another version refused the program, in one line.
    assert 'accepts 9.9.x only' in failed['2'] and '\n' not in failed['2']
  # Node 100 keeps the program; the two that failed are sent it again.
  assert rows[1]['deploy_programs_sent'] == 3 and rows[2]['deploy_programs_sent'] == 2
  # The rounds simulated with clients 1 and 2 as padding clients.
  exp = experiment.build(load_config(config_file, overrides))
  state = exp.algorithm.init(exp.init_params)
  for r, cohort in enumerate(exp.cohorts(0, 2)):
    mask, num = np.asarray(cohort.mask).copy(), np.asarray(cohort.num_examples).copy()
    mask[1:], num[1:] = False, 0
    state, _ = jax.jit(exp.algorithm.apply)(
        state, cohort._replace(mask=mask, num_examples=num), exp.round_key_for(r))
  for g, w in zip(jax.tree.leaves(strategy.state), jax.tree.leaves(state)):
    _close(g, w)


def test_a_cohort_smaller_than_the_population(tmp_path, task_identity):
  """2 of 3 clients a round, sampled as fedjx-run samples them: only their
  nodes get work, and the model is the simulated one."""
  overrides = ('rounds=2 cohort_size=2 dataset.num_clients=3 model.hidden=(8,) '
               'local_epochs=None local_steps=4 eval_every=1')
  config_file = os.path.join(REPO, 'configs', 'fedavg_digits.py')
  workdir = str(tmp_path / 'deployed')
  strategy = apps.run_server(InProcessGrid(3), apps.Settings(
      config_file, overrides, workdir, timeout=5.0, wait_s=0.0))
  exp = experiment.build(load_config(config_file, overrides))
  details = _details(workdir)
  state = exp.algorithm.init(exp.init_params)
  for r, cohort in enumerate(exp.cohorts(0, 2)):
    assert details[r]['sampled'] == details[r]['replied'] == cohort.client_ids.tolist()
    assert len(details[r]['sampled']) == 2 and exp.data.train.num_clients == 3
    state, _ = jax.jit(exp.algorithm.apply)(state, cohort, exp.round_key_for(r))
  for g, w in zip(jax.tree.leaves(strategy.state), jax.tree.leaves(state)):
    _close(g, w)


def test_the_library_runs_an_algorithm_without_a_config(task_identity):
  """fedjx.deploy alone (no config, registry or workdir): FedAvg on an
  in-memory population, 3 clients a round of 4, equals the simulated rounds."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from fedjx import algorithms, datasets  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  population = datasets.from_arrays(
      {'x': rng.randn(40, 3).astype(np.float32), 'y': rng.randn(40).astype(np.float32),
       'c': np.repeat(np.arange(4), 10)}, group_key='c')
  algorithm = algorithms.fedavg(lambda p, b: (b['x'] @ p['w'] - b['y']) ** 2,
                                client_optimizer=optax.sgd(0.1),
                                server_optimizer=optax.sgd(1.0))
  batching = datasets.prefetch.Batching(5, None, 3, None, shuffle=True, bucket=False)
  key_for = lambda r: jax.random.fold_in(jax.random.key(7), r)
  server = rounds.ServerRounds(algorithm, {'w': jnp.zeros(3)}, population, batching,
                               cohort_size=3, seed=1, key_for=key_for)
  strategy = flower.FedjxStrategy(server, '', num_rounds=2, timeout=5.0, wait_s=0.0)
  node_data = lambda spec, c, n: rounds.NodeData(population, batching, 1, c, n)
  flower.run(InProcessGrid(4, node_data=node_data), strategy, 5.0)
  assert [r['round'] for r in strategy.history] == [1, 2]
  assert [r['deploy_replied'] for r in strategy.history] == [3, 3]
  want = algorithm.init({'w': jnp.zeros(3)})
  for r in range(2):
    ids, steps = server.cohort(r)
    cohort = batching.cohort(population, ids, 1, r, steps=steps)
    want, _ = jax.jit(algorithm.apply)(want, cohort, key_for(r))
  for g, w in zip(jax.tree.leaves(strategy.state), jax.tree.leaves(want)):
    _close(g, w)


GRID_RUN = ('rounds=3 cohort_size=3 dataset.num_clients=3 model.hidden=(8,) '
            'local_epochs=None local_steps=4 eval_every=1 checkpoint_every=2')


def _round_of(msg):
  return int(msg.content[flower.CONFIG]['round'])


@pytest.mark.slow  # Four runs of the server, ~30 s.
def test_a_stopped_run_resumes_to_the_uninterrupted_model(tmp_path, task_identity):
  """SIGTERM while round 1 waits for a client, then SIGINT while round 2
  does: each run drops the round in flight (no row, no checkpoint of it),
  saves the last complete round (off the checkpoint_every=2 schedule), and
  the runs resumed from those checkpoints end with the uninterrupted run's
  model, bit for bit (the same operations on the same values), and with
  one row per round."""
  import signal  # pylint: disable=g-import-not-at-top
  config_file = os.path.join(REPO, 'configs', 'fedavg_digits.py')
  settings = lambda w: apps.Settings(config_file, GRID_RUN, w, timeout=300.0,
                                       wait_s=0.0)
  whole = apps.run_server(InProcessGrid(3), settings(str(tmp_path / 'whole')))
  workdir = str(tmp_path / 'stopped')

  def signal_in(round_num, signum):
    def on_train(grid, msg):
      if _round_of(msg) == round_num and msg.metadata.dst_node_id == 102:
        os.kill(os.getpid(), signum)  # The node's reply never comes.
        return False
      return True
    return on_train

  t0 = time.monotonic()
  for round_num, signum in ((1, signal.SIGTERM), (2, signal.SIGINT)):
    stopped = apps.run_server(InProcessGrid(3, on_train=signal_in(round_num, signum)),
                                settings(workdir))
    assert stopped.stopped and stopped.step == round_num
    assert runner.load_state(workdir)[1] == round_num  # The last complete round.
    assert max(_rows(workdir)) == round_num
  assert time.monotonic() - t0 < 150  # Not the 300 s timeout of a round.
  resumed = apps.run_server(InProcessGrid(3), settings(workdir))
  assert not resumed.stopped and resumed.start_round == 2
  for got, want in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  rows = metrics_writers.read_metrics(workdir)
  assert [r['round'] for r in rows] == [0, 1, 2, 3]
  assert [d['round'] for d in _details(workdir)] == [0, 1, 2]
  assert all(d['replied'] == [0, 1, 2] for d in _details(workdir))
  assert not os.path.exists(os.path.join(workdir, flower.STOP_FILE))


def test_a_stop_file_stops_the_run_and_a_stale_one_does_not(tmp_path, task_identity):
  config_file = os.path.join(REPO, 'configs', 'fedavg_digits.py')
  workdir = str(tmp_path / 'deployed')
  os.makedirs(workdir)
  flower.request_stop(workdir)  # Left from an earlier run: removed at start.

  def on_train(grid, msg):
    if _round_of(msg) == 1:
      flower.request_stop(workdir)
      return False
    return True

  strategy = apps.run_server(InProcessGrid(3, on_train=on_train), apps.Settings(
      config_file, GRID_RUN, workdir, timeout=30.0, wait_s=0.0))
  assert strategy.stopped and strategy.step == 1
  assert runner.load_state(workdir)[1] == 1
  assert not os.path.exists(os.path.join(workdir, flower.STOP_FILE))


def test_a_lost_node_is_detected_once_and_not_waited_for(tmp_path, task_identity):
  """Node 102 disconnects while round 1 waits for it: round 1 ends at once
  with the two others, and rounds 2 and 3 neither send to it nor wait for
  it (wait-s and the timeout are 300 s each here; before, every later round
  waited the whole wait-s for a third node)."""
  def on_train(grid, msg):
    if _round_of(msg) == 1 and msg.metadata.dst_node_id == 102:
      grid.gone.add(102)
      return False
    return True

  overrides = GRID_RUN.replace('rounds=3', 'rounds=4')
  workdir = str(tmp_path / 'deployed')
  t0 = time.monotonic()
  apps.run_server(InProcessGrid(3, on_train=on_train), apps.Settings(
      os.path.join(REPO, 'configs', 'fedavg_digits.py'), overrides, workdir,
      timeout=300.0, wait_s=300.0))
  assert time.monotonic() - t0 < 150  # Not one wait-s per round.
  rows, details = _rows(workdir), _details(workdir)
  assert [rows[s]['deploy_nodes_lost'] for s in (1, 2, 3, 4)] == [0, 1, 0, 0]
  assert [rows[s]['deploy_nodes'] for s in (1, 2, 3, 4)] == [3, 2, 2, 2]
  assert [rows[s]['deploy_replied'] for s in (1, 2, 3, 4)] == [3, 2, 2, 2]
  assert details[1]['lost'] == [2] and details[1]['failed'] == {'2': 'node lost'}
  for s in (3, 4):
    assert details[s - 1]['failed'] == {'2': 'no node holds this partition'}
    assert rows[s]['deploy_round_s'] < 10
