"""The interpreters' shared plan, their package, and the core's layering.

* Every plan step carries what it reads and writes; the plan carries which
  inputs the clients hold, the broadcasts' sources and liveness. Checked
  against an independent computation over the steps.
* ``fedjx.plan``, ``fedjx.beam`` and ``fedjx.export`` are the modules of
  ``fedjx.interpreters``.
* The core (``fedjx/``) does not import the layers above it (datasets,
  algorithms, models, experiments): by its import graph, and by running
  every interpreter in a fresh process.
"""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjx
import float_tolerance as ft
from fedjx import streaming
from fedjx.interpreters import export as export_lib
from fedjx.interpreters import plan as plan_lib

CORE = pathlib.Path(fedjx.__file__).resolve().parent
ABOVE = ('fedjx.datasets', 'fedjx.algorithms', 'fedjx.models', 'fedjx.experiments')


def _program():
  @fedjx.program(clients=4)
  def program(w, data, weights):
    y = fedjx.map_fn(lambda w, d: jnp.sum(w * d), (fedjx.broadcast(w), data))
    mean = fedjx.reduce_weighted_mean(y, weights)
    # A second stage: the clients see the aggregate and their data again.
    z = fedjx.map_fn(lambda w, m, d: (w[0] + m) * jnp.sum(w * d),
                     (fedjx.broadcast(w), fedjx.broadcast(mean), data))
    return fedjx.reduce_sum(z) + 1.0, mean
  return program


def _args():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=2), jnp.float32),
          jnp.asarray(rng.normal(size=(4, 3, 2)), jnp.float32),
          jnp.asarray([1.0, 0.0, 2.0, 3.0], jnp.float32))


# ------------------------------------------------------------------ the plan

def test_steps_carry_reads_and_writes_and_the_plan_its_inputs_split():
  plan = plan_lib.trace_plan_with_clients(_program(), _args(), client_args=(1, 2))
  assert [len(ids) for ids in plan.arg_ids] == [1, 1, 1]
  assert plan.in_ids == sum(plan.arg_ids, ())
  assert plan.client_in_ids == plan.arg_ids[1] + plan.arg_ids[2]
  assert plan.server_in_ids == plan.arg_ids[0]
  assert {plan.kinds[i] for i in plan.client_in_ids} == {plan_lib.CLIENT}

  defined = set(plan.in_ids) | set(plan.consts)
  for step in plan.steps:
    if isinstance(step, plan_lib.ServerStep):
      fields = (step.in_ids, step.out_ids, ())
    elif isinstance(step, plan_lib.BroadcastStep):
      fields = ((step.in_id,), (step.out_id,), ())
      assert plan.broadcast_sources[step.out_id] == step.in_id
      assert plan.source(step.out_id) == step.in_id
    elif isinstance(step, plan_lib.MapStep):
      fields = (step.const_ids + step.x_ids, step.out_ids, step.x_ids)
    else:
      operands = (step.x_id,) + (() if step.weight_id is None else (step.weight_id,))
      fields = (operands, (step.out_id,), operands)
    assert (step.reads, step.writes, step.placed_reads) == fields
    assert set(step.reads) <= defined, step          # Read after written.
    assert not set(step.writes) & defined, step       # Written once.
    defined |= set(step.writes)
    with pytest.raises(dataclasses.FrozenInstanceError):
      step.reads = ()

  # live_after[s]: what a later step or the output reads and no later step
  # writes (every value is written once).
  assert len(plan.live_after) == len(plan.steps)
  for s in range(len(plan.steps)):
    later = plan.steps[s + 1:]
    read_later = set(plan.out_ids).union(*[t.reads for t in later])
    written_later = set().union(*[t.writes for t in later])
    assert plan.live_after[s] == frozenset(read_later - written_later), s
  assert set(plan.out_ids) <= plan.live_after[-1]


def test_every_interpreter_gives_the_program_s_numbers():
  program, args = _program(), _args()
  want = program(*args)
  w, data, weights = [np.asarray(a, np.float64) for a in args]
  y = (w * data).sum((1, 2))
  mean = (weights * y).sum() / weights.sum()
  hand = np.asarray([((w[0] + mean) * y).sum() + 1.0, mean])
  # First-order rounding bound: the same computation on magnitudes, times
  # 2 gamma_n for the longest chain of float32 roundings (6-term dot
  # products, 4-term weighted mean, 4-term sum, a few products): n = 16.
  y_mag = np.abs(w * data).sum((1, 2))
  mean_mag = (weights * y_mag).sum() / weights.sum()
  mag = np.asarray([((abs(w[0]) + mean_mag) * y_mag).sum() + 1.0, mean_mag])
  atol = ft.atol(16, mag)

  def check(got):
    err = np.abs(np.asarray(got, np.float64) - hand)
    assert np.all(err <= atol), (err, atol)

  check(want)
  plan = plan_lib.trace_plan_with_clients(program, args, client_args=(1, 2))
  evaluated = jax.tree.unflatten(plan.out_tree, plan_lib.evaluate(plan, *args))
  split = export_lib.split_program(program, *args, client_args=(1, 2))
  assert len(split.stages) == 2
  exported = split.run([args[0]], [args[1], args[2]])
  streamed = streaming.run(program, args[0], streaming.Clients.from_arrays(args[1]),
                           streaming.Clients.from_arrays(args[2]), chunk_size=3)
  for got in (evaluated, exported, streamed):
    check(got)


# ------------------------------------------------------------ the short names

def test_short_names_are_the_interpreters_modules():
  import fedjx.beam as beam_short  # pylint: disable=import-outside-toplevel
  import fedjx.export as export_short  # pylint: disable=import-outside-toplevel
  from fedjx import plan as plan_short  # pylint: disable=import-outside-toplevel
  pytest.importorskip('apache_beam')
  from fedjx.interpreters import beam as beam_lib  # pylint: disable=import-outside-toplevel
  for short, full in ((plan_short, plan_lib), (export_short, export_lib),
                      (beam_short, beam_lib)):
    assert short.__all__ == full.__all__
    for name in full.__all__:
      assert getattr(short, name) is getattr(full, name), name
  assert fedjx.interpreters.plan is plan_lib  # The package's lazy attribute.


# ------------------------------------------------------------------ layering

def _imports_in(node, module):
  """Every module an import statement under ``node`` names."""
  for child in ast.walk(node):
    if isinstance(child, ast.Import):
      yield from (a.name for a in child.names)
    elif isinstance(child, ast.ImportFrom):
      base = child.module or ''
      if child.level:
        parts = module.split('.')[:-child.level]
        base = '.'.join(parts + ([base] if base else []))
      yield base
      yield from (f'{base}.{a.name}' for a in child.names)


# fedjx.deploy runs an algorithm's exported rounds on a deployment engine:
# it builds on fedjx.datasets (a node's client, batched as simulated) and
# the algorithms' exported pieces, never on fedjx.experiments (whose
# fedjx.experiments.deploy runs a config's rounds with it).
DEPLOY = CORE / 'deploy'


def test_deploy_imports_nothing_of_the_experiments_layer():
  paths = sorted(DEPLOY.rglob('*.py'))
  assert paths
  for path in paths:
    module = 'fedjx.deploy.' + path.stem
    tree = ast.parse(path.read_text(), str(path))
    for name in _imports_in(tree, module):
      assert not name.startswith('fedjx.experiments'), f'{path.name} imports {name}'


def test_core_imports_nothing_above_it():
  for path in sorted(p for p in CORE.rglob('*.py') if DEPLOY not in p.parents):
    module = 'fedjx.' + '.'.join(path.relative_to(CORE).with_suffix('').parts)
    tree = ast.parse(path.read_text(), str(path))
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn in functions:  # Not even lazily, inside a function.
      for name in _imports_in(fn, module):
        assert not name.startswith(ABOVE), f'{path.name}:{fn.lineno} imports {name}'

    # What importing the module runs: statements outside functions.
    top = ast.Module(body=[n for n in tree.body if not isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef))], type_ignores=[])
    for cls in [n for n in ast.walk(top) if isinstance(n, ast.ClassDef)]:
      cls.body = [n for n in cls.body
                 if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for name in _imports_in(top, module):
      assert not name.startswith(ABOVE), f'{path.name} imports {name}'


_FRESH = '''
import sys
import jax.numpy as jnp
import numpy as np
import fedjx, fedjx.plan, fedjx.export, fedjx.streaming, fedjx.execution
from fedjx import interpreters
from fedjx.interpreters import plan, export
beam = None
try:
  from fedjx import beam
except ImportError:  # Without the beam extra.
  pass

@fedjx.program(clients=3)
def program(w, data):
  y = fedjx.map_fn(lambda w, d: jnp.sum(w * d), (fedjx.broadcast(w), data))
  return fedjx.reduce_sum(y)

w, data = jnp.ones(2), jnp.arange(6.0).reshape(3, 2)
p = plan.trace_plan_with_clients(program, (w, data), client_args=(1,))
outs = [plan.evaluate(p, w, data)[0],
        export.split_round(program, w, data, client_args=(1,)).run([w], [data]),
        fedjx.streaming.run(program, w, fedjx.streaming.Clients.from_arrays(data))]
if beam is not None:
  outs.append(beam.run(program, w, beam.ClientData.from_arrays(data)))
assert all(float(o) == 15.0 for o in outs), outs
print(len(outs), sorted(m for m in sys.modules if m.startswith(%r)))
'''


def test_running_every_interpreter_imports_no_layer_above():
  out = subprocess.run([sys.executable, '-c', _FRESH % (ABOVE,)], capture_output=True,
                       text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  count, loaded = out.stdout.strip().split(' ', 1)
  assert int(count) >= 3 and loaded == '[]', out.stdout


# ----------------------------------------------------------- dataset clients

def _population():
  from fedjx import datasets  # pylint: disable=import-outside-toplevel
  return datasets, datasets.synthetic(1.0, 1.0, num_clients=9, seed=0, max_examples=60)


def test_streaming_clients_from_a_dataset():
  datasets, population = _population()
  ids = [4, 0, 7]
  new = datasets.streaming_clients(population, ids, batch_size=2, num_steps=3)
  want = datasets.make_cohort(population, np.asarray(ids, np.int32), 2, num_steps=3,
                              bucket=False)
  assert list(new.client_ids) == ids
  for got, ref in zip(jax.tree.leaves(new.load(ids)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(got, ref)
  assert jax.tree.map(lambda s: (s.shape, s.dtype), new.placed_spec()) == jax.tree.map(
      lambda a: (np.shape(a), np.asarray(a).dtype), want)
  assert isinstance(new, streaming.Clients)
  assert not hasattr(streaming.Clients, 'from_dataset')


def test_beam_client_data_from_a_dataset():
  pytest.importorskip('apache_beam')
  from fedjx.interpreters import beam  # pylint: disable=import-outside-toplevel
  import pickle  # pylint: disable=import-outside-toplevel
  datasets, population = _population()
  ids = [4, 0, 7]
  new = datasets.beam_client_data(population, ids, batch_size=2, num_steps=3)
  want = datasets.make_cohort(population, np.asarray(ids, np.int32), 2, num_steps=3,
                              bucket=False)
  shipped = pickle.loads(pickle.dumps(new.load))  # What a Beam worker runs.
  for k, client in enumerate(ids):
    for got, ref in zip(jax.tree.leaves(shipped(client)), jax.tree.leaves(want)):
      np.testing.assert_array_equal(got, np.asarray(ref)[k])
  assert isinstance(new, beam.ClientData) and list(new.client_ids) == ids
  assert not hasattr(beam.ClientData, 'from_dataset')


@pytest.mark.parametrize('fn', ['streaming_clients', 'beam_client_data'])
def test_dataset_clients_refuse_bad_arguments_in_one_line(fn):
  datasets, population = _population()
  make = getattr(datasets, fn)
  with pytest.raises(ValueError, match=rf'^fedjx\.datasets\.{fn}: client_ids is empty'):
    make(population, [], batch_size=2, num_steps=3)
  with pytest.raises(ValueError, match=rf'^fedjx\.datasets\.{fn}: num_steps=0; it must'):
    make(population, [1], batch_size=2, num_steps=0)
