"""fedjx-run on the mesh of ``config.mesh``: a replica's model on ``fsdp`` and ``tensor``.

On the 8 host devices of tests/conftest.py, ``config.mesh='clients=2,fsdp=2,tensor=2'``
with a ``llama_lm`` model (the ``500k`` preset on the byte corpus of
configs/diloco_text.py): the server state lies on
:func:`fedjx.sharding.replica_specs` (Megatron-style on ``tensor``, FSDP on
``fsdp``, replicated over ``clients``); a 2-round DiLoCo run equals the same
run on one device without a mesh to float32 reassociation; the compiled
round communicates across replicas only on ``clients``; a run resumed from a
checkpoint restores the layout and continues bit for bit. The config checks
that refuse bad meshes run without JAX.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import float_tolerance as ft
from fedjx import distributed
from fedjx import sharding
from fedjx.experiments import config as config_lib
from fedjx.experiments import experiment
from fedjx.experiments import lm_cost
from fedjx.experiments import processes
from fedjx.experiments import registry
from fedjx.experiments import run_trainer
from fedjx.experiments import runner
from fedjx.experiments.config_base import optimizer
from fedjx.models import llama

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = 'clients=2,fsdp=2,tensor=2'


def _config(mesh: str = '', rounds: int = 2) -> ml_collections.ConfigDict:
  """configs/diloco_text.py:2 with the ``500k`` Llama preset, made small.

  Two replicas, 2 inner steps of batch 4 and 32 byte tokens, 2 rounds, one
  module of the corpus. Inner SGD with momentum instead of AdamW: its update
  is linear in the gradient, so a float32 summation-order difference stays
  relative to the gradients' scale (AdamW's ``m / sqrt(v)`` turns a rounding
  difference of a near-zero gradient coordinate into a step of up to the
  learning rate, which no summation bound limits).
  """
  spec = importlib.util.spec_from_file_location(
      'diloco_text', os.path.join(REPO, 'configs', 'diloco_text.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config('2')
  config.rounds, config.local_steps, config.eval_every = rounds, 2, 2
  config.batch_size = 4
  config.checkpoint_every = 1
  config.progress = config.plot = config.tensorboard = False
  config.dataset.modules = ('json',)
  config.dataset.seq_len = 32
  config.eval_max_examples = 64
  config.model = dict(name='llama_lm', preset='500k')  # d 128, L 2, H 4, K 2, f 480, V 256
  config.algorithm.inner_optimizer = optimizer('sgd', learning_rate=0.05, momentum=0.9)
  config.mesh = mesh
  return config


def _path(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


# --- Config checks: one line each, before JAX is imported. -------------------


def _refusal(config_py: str) -> str:
  """The one-line error of ``config.with_defaults`` in a fresh interpreter,
  and whether JAX was imported by then."""
  code = ('import sys\n'
          'from fedjx.experiments import config as c\n'
          f'{config_py}\n'
          'try:\n'
          '  c.with_defaults(cfg)\n'
          'except c.ConfigError as e:\n'
          "  print(e); print('jax' in sys.modules)\n")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout


def test_bad_meshes_are_refused_in_one_line_without_jax():
  base = ("cfg = dict(dataset={'name': 'text'}, model={'name': 'transformer_lm'}, "
          "algorithm={'name': 'diloco'}, mesh=%r)")
  out = _refusal(base % 'clients=4,model=2').splitlines()
  assert out == ["config.mesh='clients=4,model=2': the axis 'model' is not one of "
                 "('clients', 'fsdp', 'tensor') (clients: the cohort; fsdp and tensor: "
                 "each replica's model).", 'False']
  out = _refusal(base % 'clients=2,tensor=4').splitlines()
  assert out[0] == ("config.mesh='clients=2,tensor=4': the tensor axis splits a llama_lm "
                    "model Megatron-style, and config.model.name='transformer_lm' has no "
                    "such layout; use 'llama_lm', or shard the model on fsdp only.")
  assert out[1] == 'False'
  out = _refusal(base % 'clients=0,fsdp=8').splitlines()
  assert out[0] == ("config.mesh='clients=0,fsdp=8': the axis 'clients' has size 0; sizes "
                    'are positive ints or -1 (the devices left over).')
  lora = ("cfg = dict(dataset={'name': 'text'}, model={'name': 'llama_lm'}, "
          "algorithm={'name': 'diloco'}, mesh='fsdp=2,tensor=4', lora={'rank': 4})")
  out = _refusal(lora).splitlines()
  assert out[0] == ("config.mesh='fsdp=2,tensor=4': the tensor axis splits the full model, "
                    'and config.lora.rank=4 trains adapters; with LoRA use clients and fsdp '
                    'axes only.')
  with pytest.raises(config_lib.ConfigError, match='unknown config field .param_sharding.'):
    config_lib.with_defaults(dict(_config(MESH), param_sharding='fsdp'))
  # A tensor size that does not split the heads is refused when the layout
  # is computed (the preset's shape is known once the model is built).
  bad = _config('clients=2,tensor=4')
  with pytest.raises(registry.ConfigError, match=r"config.mesh='clients=2,tensor=4': "
                     r'llama_lm: tensor=4 must divide the heads, MLP width and '
                     r'vocabulary; it does not divide num_kv_heads=2'):
    run_trainer.state_specs(bad, llama.llama_lm('500k'), llama.param_shapes('500k'),
                            processes.make_mesh(bad))


# --- The layout, and the constraint inside a vmapped client. -----------------


def test_replica_specs_follow_the_model_layout():
  shapes = llama.param_shapes('500k')
  specs = {_path(p): s for p, s in jax.tree_util.tree_leaves_with_path(
      sharding.replica_specs(shapes, 2, 2, 'llama'), is_leaf=lambda x: isinstance(x, P))}
  assert specs['layers/self_attn/q_proj/kernel'] == P(None, 'fsdp', 'tensor')
  assert specs['layers/self_attn/o_proj/kernel'] == P(None, 'tensor', 'fsdp')
  assert specs['norm/scale'] == P(None)
  # The same tree under the generic layout: FSDP on the largest divisible
  # dimension, no tensor axis.
  generic = {_path(p): s for p, s in jax.tree_util.tree_leaves_with_path(
      sharding.replica_specs(shapes, 2, 2, 'fsdp'), is_leaf=lambda x: isinstance(x, P))}
  assert generic['layers/mlp/up_proj/kernel'] == P(None, None, 'fsdp')  # [2, 128, 480]
  assert generic['norm/scale'] == P(None)  # 128 elements: too small.
  # A state: the outer momentum follows the parameters by path, scalars and
  # leaves that are not Llama parameters fall back to FSDP or replication.
  state = {'trace': shapes, 'count': np.zeros((), np.int32),
           'adapter': np.zeros((128, 8), np.float32)}
  got = sharding.replica_specs(state, 2, 2, 'llama')
  assert got['trace']['layers']['mlp']['down_proj']['kernel'] == P(None, 'tensor', 'fsdp')
  assert got['count'] == P() and got['adapter'] == P('fsdp', None)
  with pytest.raises(ValueError, match=r"layout='megatron' is not one of \('fsdp', 'llama'\)"):
    sharding.replica_specs(state, 2, 2, 'megatron')


def test_constrain_replica_inside_map_fn_stacks_clients_on_the_layout():
  mesh = processes.make_mesh(ml_collections.ConfigDict({'mesh': MESH}))
  model = llama.llama_lm('500k')
  shapes = llama.param_shapes('500k')
  stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((2,) + s.shape, s.dtype), shapes)

  def client(p):
    return jax.tree.map(lambda x: x * 2.0, sharding.constrain_replica(p, model.layout))

  with jax.set_mesh(mesh):
    step = jax.jit(jax.vmap(client, spmd_axis_name='clients'))
    compiled = step.lower(stacked).compile()
  outs = {_path(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(
      compiled.output_shardings[0] if isinstance(compiled.output_shardings, tuple)
      else compiled.output_shardings)}
  assert outs['layers/self_attn/q_proj/kernel'] == P('clients', None, 'fsdp', 'tensor')
  assert outs['embed_tokens/embedding'] == P('clients', 'tensor', 'fsdp')
  assert tuple(outs['norm/scale']) in (('clients',), ('clients', None))
  # Without a mesh the constraint is the identity.
  x = {'w': jnp.ones((4, 4))}
  assert sharding.constrain_replica(x, 'llama') is x


# --- fedjx-run on the mesh (slow: each run compiles a Llama round). ----------


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The 2-round run with no mesh on one device, and on ``MESH``."""
  assert jax.device_count() == 8
  root = tmp_path_factory.mktemp('runner_mesh')
  plain = runner.run(_config(), str(root / 'plain'))
  sharded = runner.run(_config(MESH), str(root / 'sharded'))
  return plain, sharded, root


@pytest.mark.slow  # ~50 s: two runs compile a Llama round each.
def test_sharded_run_equals_the_one_device_run(runs):
  plain, sharded, _ = runs
  # The runs differ only in the order of float32 sums: products split over
  # fsdp (the contraction over d = 128 in two halves) and tensor (o_proj and
  # down_proj sum over heads and the MLP width in two halves), the batch's
  # gradient summed over the fsdp devices, the replicas averaged over
  # clients. The longest chain of sums of one inner step of the 500k preset
  # (d 128, L 2, f 480, T 32, V 256, batch 4): forward, per layer, the norm
  # (128), q/k/v (128), scores and values over 32 positions and h = 32
  # (64), o_proj (128), the MLP's gate/up (128) and down (480): ~1,000, so
  # ~2,000 for two layers, plus the tied head (128), the softmax (256) and
  # the loss mean over 4 x 32 tokens (128): ~2,500; the backward pass the
  # same again plus weight gradients summed over 128 tokens: ~5,200 per
  # step. 2 inner steps x 2 rounds, plus the replica mean and the outer step:
  # n ~ 21,000. Momentum SGD and the outer Nesterov step are linear in the
  # gradients, so each leaf differs by rtol(n) of its scale (4 steps of
  # momentum 0.9 and Nesterov 0.9 multiply no rounding by more than ~4, well
  # inside the first-order bound's slack).
  tol = ft.rtol(21_000)
  worst = 0.0
  for a, b in zip(jax.tree.leaves(distributed.to_host(sharded.state.params)),
                  jax.tree.leaves(plain.state.params)):
    a, b = np.asarray(a), np.asarray(b)
    scale = float(np.max(np.abs(b)))
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)
    worst = max(worst, float(np.max(np.abs(a - b))) / scale)
  assert worst < tol
  print(f'max |sharded - plain| / max |plain| per leaf: {worst:.3g} (bound {tol:.3g})')
  # The round metrics (losses of the same models) agree as closely.
  for key in ('train_loss_before', 'train_loss_after'):
    np.testing.assert_allclose(sharded.history[-1][key], plain.history[-1][key], rtol=1e-4)


@pytest.mark.slow  # Shares the runs of the test above.
def test_server_state_lies_on_the_llama_layout(runs):
  _, sharded, _ = runs
  mesh = processes.make_mesh(ml_collections.ConfigDict({'mesh': MESH}))
  params = {_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(sharded.state.params)}
  q = params['layers/self_attn/q_proj/kernel']  # [L, d, H h] = [2, 128, 128]
  assert q.sharding.spec == P(None, 'fsdp', 'tensor')
  assert q.addressable_shards[0].data.shape == (2, 64, 64)  # 1/4 per device
  assert params['embed_tokens/embedding'].sharding.spec == P('tensor', 'fsdp')
  assert params['layers/mlp/down_proj/kernel'].sharding.spec == P(None, 'tensor', 'fsdp')
  assert params['norm/scale'].sharding.is_fully_replicated
  assert params['layers/input_layernorm/scale'].sharding.is_fully_replicated
  # Every leaf of the state (the outer Nesterov momentum, each replica's
  # stored inner state) is on the layout replica_specs gives, over the
  # whole mesh: none is split over clients.
  specs = sharding.replica_specs(sharded.state, 2, 2, 'llama')
  for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(sharded.state),
                             jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
    if not isinstance(x, jax.Array):
      continue
    assert x.sharding.mesh.shape == mesh.shape, _path(path)
    assert x.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), x.ndim), (
        _path(path), x.sharding.spec, spec)
    assert 'clients' not in jax.tree.leaves(tuple(x.sharding.spec)), _path(path)


@pytest.mark.slow  # ~15 s: compiles the round once more, without running it.
def test_outer_step_communicates_on_clients_only():
  config = config_lib.validate(_config(MESH))
  mesh = processes.make_mesh(config)
  with jax.set_mesh(mesh):
    exp = experiment.build(config)
    state = exp.algorithm.init(exp.init_params)
    state = distributed.put_global(state, mesh, run_trainer.state_specs(
        config, exp.model, state, mesh))
    cohort = next(iter(exp.cohorts(0, 1)))
    hlo = exp.algorithm.round.lower(state, cohort, exp.round_key_for(0)).compile().as_text()
  lines = [l for l in hlo.splitlines()
           if any(f' {c}(' in l or f' {c}-start(' in l for c in lm_cost.COLLECTIVES)]
  axes = lm_cost.collective_axes(hlo, mesh)
  assert len(axes) == len(lines) and axes
  # No collective mixes the replicas' axis with a replica's own axes: inside
  # a replica (its inner steps) devices talk over fsdp and tensor; across
  # replicas (the outer step) over clients alone.
  for (op, spanned), line in zip(axes, lines):
    assert spanned in ((), ('clients',), ('fsdp',), ('tensor',), ('fsdp', 'tensor')), (
        op, spanned, line[:160])
  # The outer gradient's mean over the replicas is all-reduced over clients,
  # shard by shard: its operands include the per-device shard of the MLP's
  # up projection, [L, d / fsdp, f / tensor] = [2, 64, 240], never the whole
  # [2, 128, 480].
  outer = [l for (op, spanned), l in zip(axes, lines)
           if op == 'all-reduce' and spanned == ('clients',)]
  assert any('f32[2,64,240]' in l for l in outer), outer
  assert not any('f32[2,128,480]' in l for (_, s), l in zip(axes, lines) if 'clients' in s)


@pytest.mark.slow  # ~25 s: a 1-round run, its resumption, and a look at the checkpoint.
def test_resumed_run_restores_the_layout_and_continues_bit_for_bit(runs):
  _, sharded, root = runs
  workdir = str(root / 'resumed')
  runner.run(_config(MESH, rounds=1), workdir)
  # Nothing left to train: the result is the state restored from the
  # checkpoint after round 1, laid out as a fresh run lays it out.
  restored = runner.run(_config(MESH, rounds=1), workdir)
  assert restored.step == 1
  for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(sharded.state)):
    if isinstance(a, jax.Array):  # (P(None, None) and XLA's P() alike.)
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
  resumed = runner.run(_config(MESH, rounds=2), workdir)
  assert resumed.step == 2
  for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(sharded.state)):
    if isinstance(a, jax.Array):
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    np.testing.assert_array_equal(distributed.to_host(a), distributed.to_host(b))
