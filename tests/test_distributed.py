"""Meshes from config, FSDP shardings, and multi-process runs on this machine."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import float_tolerance as ft
from fedjx import distributed
from fedjx import sharding
from fedjx.experiments import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, 'scripts', 'run.py')


def test_make_mesh_from_axis_sizes():
  mesh = distributed.make_mesh({'clients': -1, 'fsdp': 2})
  assert dict(mesh.shape) == {'clients': 4, 'fsdp': 2}
  assert distributed.make_mesh({'clients': 8}, axis_types='explicit').axis_types[0] == (
      jax.sharding.AxisType.Explicit)
  with pytest.raises(ValueError, match='need 6 devices'):
    distributed.make_mesh({'clients': 3, 'fsdp': 2})
  with pytest.raises(ValueError, match='at most one size'):
    distributed.make_mesh({'clients': -1, 'fsdp': -1})
  with pytest.raises(ValueError, match='axis_types'):
    distributed.make_mesh({'clients': 8}, axis_types='manual')


def test_fsdp_spec_shards_the_largest_divisible_dimension():
  assert sharding.fsdp_spec((64, 256), 4) == P(None, 'fsdp')
  assert sharding.fsdp_spec((256, 6), 4) == P('fsdp', None)
  assert sharding.fsdp_spec((3, 5, 7), 4, min_size=1) == P(None, None, None)
  assert sharding.fsdp_spec((8,), 4) == P(None)  # Too small to be worth it.


def test_put_global_and_to_host_round_trip():
  mesh = distributed.make_mesh({'clients': 4, 'fsdp': 2})
  tree = {'w': np.arange(64.0).reshape(8, 8), 'key': jax.random.key(3)}
  specs = {'w': P(None, 'fsdp'), 'key': P()}
  placed = distributed.put_global(tree, mesh, specs)
  assert placed['w'].sharding.spec == P(None, 'fsdp')
  np.testing.assert_array_equal(distributed.to_host(placed)['w'], tree['w'])
  np.testing.assert_array_equal(jax.random.key_data(placed['key']),
                                jax.random.key_data(tree['key']))


def _cli(workdir, *extra, devices=8):
  args = [RUN, '--config', os.path.join(REPO, 'configs', 'fedavg_digits.py'),
          '--config.rounds=3', '--config.cohort_size=8', '--config.eval_every=3',
          '--config.mesh=clients=-1', '--config.progress=False',
          '--config.plot=False', '--config.tensorboard=False',
          f'--workdir={workdir}', *extra]
  return args


def _params(workdir):
  state, step = runner.load_state(str(workdir))
  return step, [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.slow
def test_two_processes_match_one_process_with_eight_devices(tmp_path):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  one = subprocess.run([sys.executable, *_cli(tmp_path / 'one')], env=env,
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-2000:]
  results = distributed.launch_local(_cli(tmp_path / 'two'), num_processes=2,
                                     devices_per_process=4, timeout=600)
  for r in results:
    assert r.returncode == 0, r.stderr[-2000:]
  # Only process 0 reports.
  assert 'done' in results[0].stdout and 'done' not in results[1].stdout
  step_one, params_one = _params(tmp_path / 'one')
  step_two, params_two = _params(tmp_path / 'two')
  assert step_one == step_two == 3
  # The runs differ only in the order of the cross-device reductions. Per
  # round, the longest chain of float32 sums is about one epoch of the MLP
  # (64 + 128 + 10 terms per layer, batches of 10, <= 3 steps, forward and
  # backward) and 8 clients: < 1500 terms; 3 rounds: n = 4500, relative to
  # each leaf's scale.
  tol = ft.rtol(4500)
  for a, b in zip(params_one, params_two):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.max(np.abs(b))))


def test_processes_with_different_device_counts_are_one_line(tmp_path):
  port = distributed.free_port()
  procs = []
  for pid, devices in ((0, 4), (1, 2)):
    env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}',
               JAX_PLATFORMS='cpu', FEDJX_COORDINATOR=f'localhost:{port}',
               FEDJX_NUM_PROCESSES='2', FEDJX_PROCESS_ID=str(pid))
    env.pop('FEDJX_DEBUG', None)
    procs.append(subprocess.Popen([sys.executable, *_cli(tmp_path / 'w')], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
  for proc in procs:
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err[-3000:]
    assert len(lines) == 1 and 'Traceback' not in err, err[-3000:]
    assert "config.mesh='clients=-1' spans 6 devices" in lines[0]
    assert 'process 0 has 4, process 1 has 2' in lines[0]


def test_a_coordinator_port_in_use_is_one_line_from_process_0(tmp_path):
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as busy:
    busy.bind(('localhost', 0))
    busy.listen()
    port = busy.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS='cpu', FEDJX_COORDINATOR=f'localhost:{port}',
               FEDJX_NUM_PROCESSES='2', FEDJX_PROCESS_ID='0')
    env.pop('FEDJX_DEBUG', None)
    out = subprocess.run([sys.executable, *_cli(tmp_path / 'w')], env=env,
                         capture_output=True, text=True, timeout=120)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
  assert f"coordinator address 'localhost:{port}'" in lines[0]
  assert f'port {port} is in use' in lines[0]


def _eval_rows(workdir):
  import json  # pylint: disable=g-import-not-at-top
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [r for r in map(json.loads, f) if 'eval_loss' in r]


@pytest.mark.slow  # ~50 s: a one-process and a two-process FSDP run compile.
def test_fsdp_over_two_processes_evaluates_like_one_process(tmp_path):
  # The MLP's 64x128 and 128x10 kernels are sharded over the fsdp axis, so
  # no process holds the parameters whole: evaluation must gather them.
  fsdp = ('--config.mesh=clients=2,fsdp=4',)
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  one = subprocess.run([sys.executable, *_cli(tmp_path / 'one', *fsdp)], env=env,
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-2000:]
  results = distributed.launch_local(_cli(tmp_path / 'two', *fsdp), num_processes=2,
                                     devices_per_process=4, timeout=600)
  for r in results:
    assert r.returncode == 0, r.stderr[-2000:]
  import json  # pylint: disable=g-import-not-at-top
  with open(tmp_path / 'two' / 'config.json', encoding='utf-8') as f:
    saved = json.load(f)
  assert saved['mesh'] == 'clients=2,fsdp=4'
  rows_one, rows_two = _eval_rows(tmp_path / 'one'), _eval_rows(tmp_path / 'two')
  assert [r['round'] for r in rows_two] == [r['round'] for r in rows_one] == [0, 3]
  step_one, params_one = _params(tmp_path / 'one')
  step_two, params_two = _params(tmp_path / 'two')
  assert step_one == step_two == 3
  tol = ft.rtol(4500)  # As in the test above: only the summation order differs.
  for a, b in zip(params_one, params_two):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.max(np.abs(b))))
  # The evaluations are of those parameters on the same examples: at round 0
  # the same initial model (identical), after it models equal to float
  # rounding, whose losses differ by far less than 1e-4 relative.
  assert rows_two[0]['eval_loss'] == rows_one[0]['eval_loss']
  np.testing.assert_allclose(rows_two[1]['eval_loss'], rows_one[1]['eval_loss'],
                             rtol=1e-4)


def _diloco_config(**overrides):
  import importlib.util  # pylint: disable=g-import-not-at-top
  from fedjx.experiments.config_base import optimizer  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      'diloco_text', os.path.join(REPO, 'configs', 'diloco_text.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config('2')
  config.rounds, config.local_steps, config.eval_every = 2, 2, 2
  config.progress = config.plot = config.tensorboard = False
  config.dataset.modules = ('json',)  # A small corpus and evaluation: the
  config.eval_max_examples = 64       # model and steps are the config's.
  # Inner SGD with momentum instead of the config's AdamW: its update is
  # linear in the gradients, so float32 summation-order differences stay
  # relative to the gradients' scale (AdamW's m / sqrt(v) turns a rounding
  # difference of a near-zero gradient coordinate into a step of up to the
  # learning rate, which no summation bound can limit). Its momentum buffer
  # is sharded like AdamW's moments.
  config.algorithm.inner_optimizer = optimizer('sgd', learning_rate=0.05, momentum=0.9)
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


@pytest.mark.slow  # ~35 s, mostly compiling two transformer rounds.
def test_diloco_replicas_sharded_over_fsdp_axis_match_unsharded(tmp_path):
  plain = runner.run(_diloco_config(), str(tmp_path / 'plain'))
  sharded = runner.run(_diloco_config(mesh='clients=2,fsdp=4'), str(tmp_path / 'sharded'))
  specs = [x.sharding.spec for x in jax.tree.leaves(sharded.state.params)]
  assert any('fsdp' in tuple(s) for s in specs)  # The model spans 4 devices.
  # The runs differ only in the order of float32 sums (matrix products split
  # over the 'fsdp' axis, replicas averaged over 'clients'). The longest
  # chain of sums per inner step of the byte-level transformer (width 64, 2
  # layers, MLP 256, 64 positions of batch 8, 256 byte classes): forward,
  # per layer, layer norms, projections and attention over 64 terms (7 x 64)
  # plus head dimension 16 and the MLP's 256, about 720, so ~1440 for two
  # layers, plus the output projection (64), softmax (256) and the loss mean
  # over 512 tokens: ~2300; the backward pass the same again, plus weight
  # gradients summed over 512 tokens: ~5200 per step. 2 inner steps x 2
  # rounds, plus the replica average and the outer step: n ~ 21,000.
  # Momentum and the outer Nesterov step are linear in the gradients, so the
  # difference is rtol(n) relative to each leaf's scale.
  tol = ft.rtol(21_000)
  for a, b in zip(jax.tree.leaves(distributed.to_host(sharded.state.params)),
                  jax.tree.leaves(plain.state.params)):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=tol,
                               atol=tol * float(np.max(np.abs(b))))
  # (The evaluation losses follow from these parameters; a bound on their
  # difference would need the loss's gradient, so they are not compared.)
  assert np.isfinite(sharded.history[-1]['eval_loss'])


_SCAFFOLD_CONFIG = '''
from fedjx.experiments.config_base import base_config, optimizer

def get_config():
  config = base_config()
  config.seed = 3
  config.rounds = 4
  config.cohort_size = 8
  config.batch_size = 16
  config.local_steps = 2
  config.eval_every = 2
  config.checkpoint_every = 2
  config.mesh = 'clients=-1'
  config.progress = False
  config.plot = False
  config.tensorboard = False
  config.dataset = dict(name='digits', num_clients=16, alpha=0.5)
  config.model = dict(name='logistic_regression')
  config.algorithm = dict(name='scaffold',
                          client_optimizer=optimizer('sgd', learning_rate=0.1))
  return config
'''


def _state(workdir):
  state, step = runner.load_state(str(workdir))
  return step, state


@pytest.mark.slow  # ~50 s: runs on one process, on two, resumed on two and on one.
def test_scaffold_over_two_processes_matches_one_process(tmp_path):
  """SCAFFOLD's per-client c_i cannot live in a host store that each process
  holds alone (a client's row would be on whichever process trained it
  last): on two processes the runner keeps them on the devices, says so in
  one line, and resumes like that, ending with the one-process store run's
  model."""
  config = tmp_path / 'scaffold.py'
  config.write_text(_SCAFFOLD_CONFIG)
  cli = lambda workdir, *extra: [RUN, '--config', str(config),
                                 f'--workdir={workdir}', *extra]
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  env.pop('FEDJX_DEBUG', None)
  one = subprocess.run([sys.executable, *cli(tmp_path / 'one')], env=env,
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-2000:]
  assert 'per-client state on the devices' not in one.stderr  # The store.
  two = tmp_path / 'two'
  # Two rounds, then resumed to four: checkpoint and resumption across processes.
  for rounds in (2, 4):
    results = distributed.launch_local(cli(two, f'--config.rounds={rounds}'),
                                       num_processes=2, devices_per_process=4,
                                       timeout=600, env={'FEDJX_DEBUG': ''})
    for r in results:
      assert r.returncode == 0, r.stderr[-2000:]
    said = [l for l in results[0].stderr.splitlines()
            if 'per-client state on the devices' in l]
    assert len(said) == 1 and 'a run of 2 processes has no host store' in said[0]
  assert 'resuming' in results[0].stderr and 'after round 2' in results[0].stderr
  import json  # pylint: disable=g-import-not-at-top
  with open(two / 'config.json', encoding='utf-8') as f:
    assert json.load(f)['client_state']['placement'] == 'device'
  step_one, state_one = _state(tmp_path / 'one')
  step_two, state_two = _state(two)
  assert step_one == step_two == 4
  assert not jax.tree.leaves(state_one.client_states)  # In the host store.
  assert jax.tree.leaves(state_two.client_states)      # Dense, [16, ...].
  # The runs differ in the order of float32 sums only (cross-device
  # reductions over 8 devices of 2 processes vs 1; c_i gathered from a dense
  # array vs read from the store, both exact copies). The longest chain per
  # local step of the 64-feature, 10-class logistic regression: the logits
  # (64 terms), the softmax (10), the batch mean of the loss and the weight
  # gradient (16 + 16): ~110; 2 steps, then the 8 clients' average and the
  # server control's (8 + 8): ~240 per round, 4 rounds: ~960. The controls'
  # rounding re-enters the model through the corrected steps (eta K (c - c_i)
  # is a parameter-scale difference), doubling it to first order: n = 2000,
  # relative to each leaf's scale.
  tol = ft.rtol(2000)
  for a, b in zip(jax.tree.leaves((state_one.params, state_one.extras)),
                  jax.tree.leaves((state_two.params, state_two.extras))):
    a, b = np.asarray(a), distributed.to_host(b)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.max(np.abs(b))))
  # The workdir resumes on one process too, keeping its placement.
  more = subprocess.run([sys.executable, *cli(two, '--config.rounds=5')], env=env,
                        capture_output=True, text=True, timeout=600)
  assert more.returncode == 0, more.stderr[-2000:]
  assert 'keeps it there' in more.stderr and 'after round 4' in more.stderr
  assert _state(two)[0] == 5


def test_wait_for_coordinator_tells_a_coordinator_from_a_port_taken():
  import socket  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  # A gRPC server answers the HTTP/2 preface with a SETTINGS frame at once.
  with socket.socket() as server:
    server.bind(('localhost', 0))
    server.listen()
    port = server.getsockname()[1]

    def answer():
      conn, _ = server.accept()
      with conn:
        conn.sendall(b'\x00\x00\x00\x04\x00\x00\x00\x00\x00')
        conn.recv(64)

    threading.Thread(target=answer, daemon=True).start()
    distributed.wait_for_coordinator(f'localhost:{port}', timeout_s=5)
  # A program that accepts connections and stays silent is not one.
  with socket.socket() as busy:
    busy.bind(('localhost', 0))
    busy.listen()
    port = busy.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(distributed.CoordinatorError,
                       match=rf'port {port} of localhost is taken by a program that '
                       "is not process 0's coordinator"):
      distributed.wait_for_coordinator(f'localhost:{port}', timeout_s=1)
    assert time.monotonic() - start < 3  # Bounded by timeout_s, not JAX's 300 s.
  # Nothing listening: retried until timeout_s, then one line.
  with pytest.raises(distributed.CoordinatorError,
                     match=rf"'localhost:{port}' did not come up within 1 s"):
    distributed.wait_for_coordinator(f'localhost:{port}', timeout_s=1)
  with pytest.raises(distributed.CoordinatorError, match='is not host:port'):
    distributed.wait_for_coordinator('localhost', timeout_s=1)


def test_a_coordinator_port_taken_is_one_line_from_process_1_in_bounded_time(tmp_path):
  import socket  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  with socket.socket() as busy:
    busy.bind(('localhost', 0))
    busy.listen()  # Accepts connections (the kernel's backlog), never answers.
    port = busy.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS='cpu', FEDJX_COORDINATOR=f'localhost:{port}',
               FEDJX_NUM_PROCESSES='2', FEDJX_PROCESS_ID='1')
    env.pop('FEDJX_DEBUG', None)
    start = time.monotonic()
    out = subprocess.run([sys.executable, *_cli(tmp_path / 'w'),
                          '--config.coordinator_timeout_s=3'], env=env,
                         capture_output=True, text=True, timeout=280)
    took = time.monotonic() - start
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
  assert f'port {port} of localhost is taken' in lines[0]
  assert 'choose another port in --config.coordinator_address' in lines[0]
  assert 'stop the program holding it' in lines[0]
  # Start-up (imports, flags: seconds, more on a loaded machine) plus the
  # 3 s wait; JAX alone would wait 300 s.
  assert took < 150, took
