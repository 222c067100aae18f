"""fedjx.deploy without a deployment engine: versioned program bytes, and a
config's rounds (fedjx.experiments.deploy) as server and node halves that
reproduce the simulated round.

The Flower processes themselves are tested in test_deploy_flower.py."""

import json
import os
import struct
import subprocess
import sys
import time
import tomllib

import jax
import numpy as np
import pytest

from fedjx.deploy import local
from fedjx.deploy import programs
from fedjx.deploy import rounds
from fedjx.experiments import cli
from fedjx.experiments import config as config_lib
from fedjx.experiments.deploy import app_dir
from fedjx.experiments.deploy import config_rounds


def _square_program():
  return jax.export.export(jax.jit(lambda x: (x * x).sum()))(
      jax.ShapeDtypeStruct((3,), np.float32))


def _with_header(data, **changes):
  header, payload = programs.read_header(data)
  text = json.dumps(dict(header, **changes)).encode()
  return programs.MAGIC + struct.pack('>I', len(text)) + text + payload


def test_program_bytes_round_trip_with_their_header():
  data = programs.pack(_square_program(), 'client_work')
  program = programs.unpack(data)
  assert program.header['format'] == programs.FORMAT_VERSION
  assert program.header['piece'] == 'client_work'
  assert program.header['fedjx'] == programs.fedjx.__version__
  x = np.asarray([1.0, 2.0, -3.0], np.float32)
  assert float(program.exported.call(x)) == 14.0  # exact in float32
  # Another patch release of the same minor version is accepted.
  major, minor = programs.fedjx.__version__.split('.')[:2]
  programs.unpack(data, fedjx_version=f'{major}.{minor}.99')


@pytest.mark.parametrize('change, match', [
    (dict(format=programs.FORMAT_VERSION + 1), 'reads format'),
    (dict(fedjx='99.0.0'), 'accepts'),
    (dict(sha256='0' * 64), 'damaged'),
], ids=['format', 'fedjx_version', 'digest'])
def test_a_node_refuses_incompatible_bytes_in_one_line(change, match):
  data = _with_header(programs.pack(_square_program(), 'client_work'), **change)
  with pytest.raises(programs.IncompatibleProgramError, match=match) as info:
    programs.unpack(data)
  assert '\n' not in str(info.value)


def test_bytes_that_are_not_a_program_are_refused():
  with pytest.raises(programs.IncompatibleProgramError, match='not a fedjx program'):
    programs.unpack(b'\x00' * 64)
  payload = bytes(_square_program().serialize())
  with pytest.raises(programs.IncompatibleProgramError, match='not a fedjx program'):
    programs.unpack(payload)  # bare jax.export bytes carry no version


def _config(algorithm=None):
  config = cli.load_config_file('configs/fedavg_digits.py')
  extras = [(('rounds',), 2), (('cohort_size',), 3), (('dataset', 'num_clients'), 3),
            (('model', 'hidden'), (8,)), (('local_epochs',), None),
            (('local_steps',), 4)]
  if algorithm is not None:
    extras.append((('algorithm',), algorithm))
  return config_lib.validate(cli.apply_overrides(config, extras))


def _deployed_rounds(server, num_rounds):
  """The rounds as a deployment runs them: program bytes unpacked on each
  node, node data built from the spec's JSON, aggregation in NumPy."""
  nodes = {c: config_rounds.node_data(server.spec.to_json(), c, server.num_clients)
           for c in range(server.num_clients)}
  state, history, received = server.initial_state(), [], []
  for r in range(num_rounds):
    ids, steps = server.cohort(r)
    pieces = server.pieces(state, steps)
    program = programs.unpack(pieces.client_program)
    to_clients, placed, residuals = server.prepare(pieces, state, r)
    outputs = [rounds.run_client(program, to_clients, [x[i] for x in placed],
                                 nodes[c].inputs(r, steps))
               for i, c in enumerate(ids.tolist())]
    received.append(outputs)
    state, metrics = server.update(pieces, residuals, outputs)
    history.append(rounds.scalars(metrics))
  return state, history, received, pieces


def test_server_and_node_halves_reproduce_the_simulated_rounds():
  server = config_rounds.ExperimentRounds(_config())
  got, history, _, _ = _deployed_rounds(server, 2)
  exp = server.exp
  want = server.initial_state()
  apply = jax.jit(exp.algorithm.apply)
  for r, cohort in enumerate(exp.cohorts(0, 2)):  # the runner's own cohorts
    want, metrics = apply(want, cohort, exp.round_key_for(r))
    assert history[r]['examples'] == float(metrics['examples'])
  # float32 client work in both; the aggregates here are float64 sums of 3
  # clients rounded once, the jitted round sums in float32: each aggregate
  # differs by at most 3 * 2**-24 relative, and two rounds of 4 local SGD
  # steps carry that into the parameters amplified by well under 10.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=2 * 10 * 3 * 2**-23, atol=1e-6)


def test_dp_clipping_runs_on_the_nodes():
  clip = 0.05
  server = config_rounds.ExperimentRounds(_config(dict(
      name='dp_fedavg', clip_norm=clip, noise_multiplier=0.5,
      expected_clients_per_round=3.0,
      client_optimizer=dict(name='sgd', learning_rate=0.3))))
  state = server.initial_state()
  _, history, received, pieces = _deployed_rounds(server, 1)
  shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(state.params)]
  out_shapes = [tuple(a.shape) for a in pieces.split.client_work.out_avals]
  update = [i for i, s in enumerate(out_shapes) if s in shapes and s != ()]
  assert len(update) == len(shapes)
  # What the server receives from each client: its update, clipped to norm
  # `clip` (float32 rescaling: relative error a few ulps).
  for outputs in received[0]:
    norm = np.sqrt(sum(np.sum(np.asarray(outputs[i], np.float64) ** 2) for i in update))
    assert norm <= clip * (1 + 1e-5)
  # ... while the clients' own updates were far larger.
  assert history[0]['mean_update_norm'] > 10 * clip
  assert history[0]['clipped_fraction'] == 1.0


def test_the_flower_app_names_fedjx_s_apps_and_its_run_config(tmp_path):
  app_dir.write_app(str(tmp_path), config='configs/fedavg_digits.py', timeout=30,
                    wait_s=5)
  with open(tmp_path / 'pyproject.toml', 'rb') as f:
    project = tomllib.load(f)
  app = project['tool']['flwr']['app']
  assert app['components'] == {
      'serverapp': 'fedjx.experiments.deploy.apps:server_app',
      'clientapp': 'fedjx.experiments.deploy.apps:client_app'}
  assert app['config']['config'] == 'configs/fedavg_digits.py'
  assert app['config']['timeout'] == 30.0 and app['config']['wait-s'] == 5.0
  assert set(app['config']) == set(app_dir.RUN_CONFIG_DEFAULTS)
  with pytest.raises(ValueError, match='rounds=3 is not a run config key'):
    app_dir.write_app(str(tmp_path), rounds=3)


def _gone(pid):
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      return f.read().rsplit(')', 1)[1].split()[0] == 'Z'  # a zombie is gone
  except OSError:
    return True


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads processes from /proc')
def test_stopping_a_process_ends_what_it_started_in_other_sessions(tmp_path):
  # As Flower's SuperLink starts its SuperExec: a child in a session of its own.
  child = "import time; time.sleep(120)"
  parent = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            f"{child!r}], start_new_session=True); time.sleep(120)")
  process = subprocess.Popen([sys.executable, '-c', parent], start_new_session=True)
  deadline = time.monotonic() + 30
  while not local.descendants(process.pid):
    assert time.monotonic() < deadline
    time.sleep(0.05)
  (grandchild, session, _), = local.descendants(process.pid)
  assert session == grandchild  # outside the parent's session
  local.LocalFederation(1, str(tmp_path), grace=1.0).stop_process(process)
  assert process.poll() is not None
  deadline = time.monotonic() + 10
  while not _gone(grandchild):
    assert time.monotonic() < deadline, 'the process in its own session survived'
    time.sleep(0.05)


def test_a_federation_needs_a_node():
  with pytest.raises(ValueError, match='num_nodes=0'):
    local.LocalFederation(0, '.')


def test_a_federation_stops_its_superlink_before_its_nodes(tmp_path, monkeypatch):
  """A ServerApp still running then sees its link end, not its clients
  vanish one by one (which it would record as a round without replies)."""
  fed = local.LocalFederation(2, str(tmp_path))
  fed.superlink, fed.nodes = 'superlink', ['node-0', 'node-1']
  stopped = []
  monkeypatch.setattr(fed, 'stop_process', stopped.append)
  fed.stop()
  assert stopped == ['superlink', 'node-0', 'node-1']


# A stand-in for flower-superlink and flower-supernode: binds 127.0.0.1 at
# its --port and listens (as the SuperLink's server does), or fails as
# uvicorn does when the port is taken ([Errno 98], status 1); a node writes
# a file saying it started.
_STAND_IN = r'''#!{python}
import socket, sys, time
args = sys.argv[1:]
if sys.argv[0].endswith('supernode'):
  open('node-started', 'w').close()
  time.sleep(60)
port = int(args[args.index('--port') + 1])
s = socket.socket()
try:
  s.bind(('127.0.0.1', port))
except OSError as e:
  print(f'ERROR [server] [Errno {{e.errno}}] error while attempting to bind on '
        f"address ('127.0.0.1', {{port}}): address already in use", flush=True)
  sys.exit(1)
s.listen()
time.sleep(60)
'''


@pytest.fixture
def stand_in_flower(tmp_path, monkeypatch):
  commands = {}
  for name in ('flower-superlink', 'flower-supernode'):
    path = tmp_path / name
    path.write_text(_STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    commands[name] = str(path)
  monkeypatch.setattr(local, '_command', commands.__getitem__)


def _occupied_port():
  """A plain listening socket on 127.0.0.1 (another program's, to the link)."""
  import socket  # pylint: disable=g-import-not-at-top
  listener = socket.socket()
  listener.bind(('127.0.0.1', 0))
  listener.listen()
  return listener


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads sockets from /proc')
def test_a_superlink_port_taken_by_another_program_is_one_line_and_no_node_starts(
    tmp_path, stand_in_flower, monkeypatch):
  """The port was free when picked, then another program listened on it:
  a connection to it would succeed, but the link is not the one listening."""
  with _occupied_port() as listener:
    port = listener.getsockname()[1]
    monkeypatch.setattr(local, 'free_port', lambda: port)  # The pick lands on it.
    fed = local.LocalFederation(2, str(tmp_path / 'home'), grace=1.0)
    with pytest.raises(local.FederationError) as raised:
      with fed:
        pass
  message = str(raised.value)
  assert message == (
      f'fedjx.deploy.local: another program listens on 127.0.0.1:{port}, which '
      'was free when it was picked for the superlink; the superlink cannot bind '
      'it. Run the command again (it picks another port).')
  assert fed.nodes == [] and not (tmp_path / 'home' / 'node-started').exists()
  assert fed.superlink.poll() is not None  # Stopped on the way out.


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads sockets from /proc')
def test_a_superlink_that_exits_is_one_line_with_the_reason_from_its_log(
    tmp_path, stand_in_flower):
  fed = local.LocalFederation(1, str(tmp_path / 'home'), grace=1.0)
  with _occupied_port() as listener:
    port = listener.getsockname()[1]
    # Its bind fails (the port is taken) before this look at who listens.
    fed.superlink = fed._start(  # pylint: disable=protected-access
        [local._command('flower-superlink'), '--port', str(port)],  # pylint: disable=protected-access
        'superlink', str(tmp_path / 'home' / 'link'))
    fed.superlink.wait(timeout=60)
    with pytest.raises(local.FederationError) as raised:
      fed._wait_listening(port, fed.superlink, 'superlink', 60)  # pylint: disable=protected-access
  fed.stop()
  log = os.path.join(str(tmp_path / 'home'), 'superlink.log')
  assert str(raised.value) == (
      'fedjx.deploy.local: superlink exited with status 1 ([Errno 98] error '
      f"while attempting to bind on address ('127.0.0.1', {port}): address "
      f'already in use); see {log}.')


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads sockets from /proc')
def test_the_nodes_start_once_the_superlink_itself_listens(tmp_path, stand_in_flower):
  with local.LocalFederation(2, str(tmp_path / 'home'), grace=1.0) as fed:
    held = local.listening_sockets(fed.port)
    assert held and held <= local._sockets_of(fed.superlink.pid)  # pylint: disable=protected-access
    assert len(fed.nodes) == 2
  assert local.listening_sockets(fed.port) == set()  # Stopped, the port is free.
