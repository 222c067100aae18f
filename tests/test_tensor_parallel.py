"""Megatron-style tensor parallelism of a Llama replica on a ``tensor`` mesh axis.

On the 8 host devices of tests/conftest.py, the mesh ``clients=2,fsdp=2,tensor=2``
of ``config.mesh``: one AdamW inner step of two replicas of the ``500k`` preset
(:func:`fedjx.experiments.lm_cost.inner_step_program`) against the same step
computed replica by replica on one device without a mesh; XLA's bytes per
device against the analytic state over ``fsdp x tensor``; the collectives of
the compiled inner step (none crosses ``clients``) and of DiLoCo's outer step
(all of them on ``clients`` alone), read from the replica groups of the HLO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import float_tolerance as ft
from fedjx import sharding
from fedjx.experiments import config as config_lib
from fedjx.experiments import lm_cost
from fedjx.experiments import plan_cli
from fedjx.experiments import processes
from fedjx.experiments import registry
from fedjx.models import llama
from fedjx.models import llama_config

PRESET = '500k'  # d 128, L 2, H 4, K 2, h 32, f 480, V 256, tied embedding.
M, F, T = 2, 2, 2
BATCH, SEQ = 2, 16
LR = 1e-3  # lm_cost.inner_optimizer's learning rate.
EPS = 1e-8  # optax.adamw's default eps.


def _path(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def test_the_specs_follow_megatron_with_fsdp_on_the_other_dimension():
  specs = sharding.llama_param_specs(llama.param_shapes(PRESET), fsdp=2, tensor=4)
  got = {_path(p): s for p, s in jax.tree_util.tree_leaves_with_path(
      specs, is_leaf=lambda x: isinstance(x, P))}
  assert got['embed_tokens/embedding'] == P('tensor', 'fsdp')  # [V, d]
  for name in ('self_attn/q_proj', 'self_attn/k_proj', 'self_attn/v_proj', 'mlp/gate_proj',
               'mlp/up_proj'):
    assert got[f'layers/{name}/kernel'] == P(None, 'fsdp', 'tensor'), name  # [L, d, out]
  for name in ('self_attn/o_proj', 'mlp/down_proj'):
    assert got[f'layers/{name}/kernel'] == P(None, 'tensor', 'fsdp'), name  # [L, in, d]
  assert got['layers/input_layernorm/scale'] == P(None, None)
  assert got['norm/scale'] == P(None)
  # Unscanned layers and an untied head; size-1 axes are left out.
  config = llama_config.preset(PRESET, scan_layers=False, tie_embeddings=False)
  flat = {_path(p): s for p, s in jax.tree_util.tree_leaves_with_path(
      sharding.llama_param_specs(llama.param_shapes(config), fsdp=1, tensor=2),
      is_leaf=lambda x: isinstance(x, P))}
  assert flat['lm_head/kernel'] == P(None, 'tensor')  # [d, V]
  assert flat['layers_1/mlp/down_proj/kernel'] == P('tensor', None)
  # AdamW's moments follow the parameters by path; its step count is replicated.
  state = jax.eval_shape(lm_cost.inner_optimizer().init, llama.param_shapes(PRESET))
  state_specs = sharding.llama_param_specs(state, fsdp=2, tensor=4)
  assert state_specs[0].mu == specs and state_specs[0].nu == specs
  assert state_specs[0].count == P()


def test_sizes_that_do_not_divide_and_foreign_leaves_are_refused():
  shapes = llama.param_shapes(PRESET)
  with pytest.raises(ValueError, match=r'fsdp=3 does not divide dimension 1 \(size 128\) of '
                     r'embed_tokens/embedding \(256, 128\)'):
    sharding.llama_param_specs(shapes, fsdp=3)
  with pytest.raises(ValueError, match=r'leaf conv/kernel is not a Llama parameter'):
    sharding.llama_param_specs({'conv': {'kernel': np.zeros((3, 3))}}, tensor=2)
  with pytest.raises(ValueError, match=r'tensor=0 must be a positive integer'):
    sharding.llama_param_specs(shapes, tensor=0)
  with pytest.raises(ValueError, match=r'tensor=3 must divide the heads, MLP width and '
                     r'vocabulary; it does not divide num_heads=4, num_kv_heads=2, '
                     r'vocab_size=256'):
    lm_cost.plan_inner_step(PRESET, tensor=3)


def test_mesh_strings_name_clients_fsdp_and_tensor():
  assert config_lib.mesh_axes('clients=-1') == {'clients': -1}
  assert config_lib.mesh_axes('clients=4, fsdp=2') == {'clients': 4, 'fsdp': 2}
  assert config_lib.mesh_axes('clients=2,fsdp=2,tensor=2') == {
      'clients': 2, 'fsdp': 2, 'tensor': 2}
  with pytest.raises(registry.ConfigError, match=r"'clients=2,fsdp=2,tensor=2'"):
    config_lib.mesh_axes('clients=2,tensor')
  with pytest.raises(registry.ConfigError, match=r"the axis 'tensor' is named twice"):
    config_lib.mesh_axes('tensor=2,clients=2,tensor=2')
  mesh = processes.make_mesh(ml_collections.ConfigDict({'mesh': 'clients=2,fsdp=2,tensor=2'}))
  assert mesh.axis_names == ('clients', 'fsdp', 'tensor')
  assert dict(mesh.shape) == {'clients': 2, 'fsdp': 2, 'tensor': 2}


def test_fedjx_plan_refuses_tensor_sizes_and_lora_with_tensor(capsys):
  assert plan_cli.main([f'--preset={PRESET}', '--tensor=3']) == 2
  assert 'tensor=3 must divide the heads' in capsys.readouterr().err
  assert plan_cli.main(['--preset=1m', '--lora_rank=4', '--tensor=2']) == 2
  assert '--replicas, --fsdp and --tensor must be 1' in capsys.readouterr().err


@pytest.fixture(scope='module')
def mesh():
  assert jax.device_count() == 8
  return processes.make_mesh(ml_collections.ConfigDict({'mesh': 'clients=2,fsdp=2,tensor=2'}))


@pytest.fixture(scope='module')
def inner(mesh):
  """The inner step compiled on the mesh, its inputs, and its outputs."""
  config = llama_config.preset(PRESET)
  step, shapes = lm_cost.inner_step_program(config, M, F, BATCH, SEQ, mesh, tensor=T)
  compiled = step.lower(*shapes).compile()
  model = llama.llama_lm(config)
  params = jax.vmap(lambda k: model.module.init(k, jnp.zeros((1, 8), jnp.int32))['params'])(
      jax.random.split(jax.random.key(0), M))
  opt_state = jax.vmap(lm_cost.inner_optimizer().init)(params)
  tokens = jax.random.randint(jax.random.key(1), (M, BATCH, SEQ + 1), 1, config.vocab_size)
  host = jax.tree.map(np.asarray, (params, opt_state, tokens))
  put = lambda tree, like: jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), tree, like)
  out = compiled(put(params, shapes[0]), put(opt_state, shapes[1]),
                 jax.device_put(tokens, shapes[2].sharding))
  return compiled, host, jax.tree.map(np.asarray, out), model


def _one_device_step(model, params, opt_state, tokens):
  """The unsharded reference: one replica's AdamW step on one device, no mesh."""
  opt = lm_cost.inner_optimizer()
  loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.loss_fn(p, {'x': tokens})))(params)
  updates, _ = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), loss, grads


@pytest.mark.slow
def test_one_inner_step_on_clients_fsdp_tensor_equals_one_device(inner):
  _, (params, opt_state, tokens), (new_params, new_state, loss), model = inner
  device = jax.devices()[0]
  ref = jax.jit(_one_device_step, static_argnums=0, device=device)
  # Each gradient coordinate is a chain of float32 sums, computed on the mesh in
  # another order (the batch split over fsdp, the head and MLP contractions split
  # over tensor and all-reduced): forward contractions over d + f + H h = 736 terms,
  # attention over T = 16 positions, the backward pass the same again, and the mean
  # over B T = 32 tokens. Two such computations differ by at most 2 gamma_n times
  # the sum of the terms' magnitudes, taken here as the leaf's largest gradient.
  n_chain = 2 * (128 + 480 + 128 + SEQ) + BATCH * SEQ
  grad_rtol = ft.rtol(n_chain)
  loose, total = 0, 0
  for k in range(M):
    want_p, want_loss, grads = jax.tree.map(np.asarray, ref(
        model, *jax.tree.map(lambda x: x[k], (params, opt_state, tokens))))
    # The loss: a mean over 32 token losses, each a log-sum-exp over V = 256.
    np.testing.assert_allclose(loss[k], want_loss, rtol=ft.rtol(n_chain + 256))
    flat_g = dict((_path(p), g) for p, g in jax.tree_util.tree_leaves_with_path(grads))
    for path, got in jax.tree_util.tree_leaves_with_path(new_params):
      name, g = _path(path), flat_g[_path(path)]
      delta = grad_rtol * np.max(np.abs(g))
      # AdamW's first moment is (1 - b1) g: the mesh's gradient itself.
      mu = [leaf for q, leaf in jax.tree_util.tree_leaves_with_path(new_state[0].mu)
            if _path(q) == name][0][k]
      delta = delta + 4 * ft.U32 * np.abs(g)  # And the rounding of 0.1 g and of / 0.1.
      assert np.all(np.abs(mu / 0.1 - g) <= delta), name
      # At step 1 the update is lr (phi(g) + wd p) with phi(g) = g / (|g| + eps)
      # (m_hat = g, v_hat = g^2). Where |g| > delta the sign is sure and phi moves
      # by at most delta eps / (|g| - delta + eps)^2; elsewhere by up to 2. Plus
      # float32 rounding of p - lr (...) on both sides (4 ulps of |p| + lr each:
      # phi's division and sum, the product by lr, the subtraction).
      want = want_p[name.split('/')[0]]
      for key in name.split('/')[1:]:
        want = want[key]
      p0 = np.asarray(want, np.float64)
      sure = np.abs(g) > delta
      phi_bound = np.where(sure, delta * EPS / (np.abs(g) - delta + EPS) ** 2, 2.0)
      bound = LR * phi_bound + 8 * ft.U32 * (np.abs(p0) + LR)
      diff = np.abs(got[k].astype(np.float64) - p0)
      assert np.all(diff <= bound), (name, k, float(np.max(diff - bound)))
      loose += int(np.sum(~sure))
      total += g.size
  # Coordinates whose gradient is below its rounding bound (bounded by 2 lr only)
  # are rare: 0.22 % of them here.
  assert loose <= 1e-2 * total, (loose, total)


def test_the_bytes_per_device_are_the_state_over_fsdp_times_tensor(inner):
  compiled = inner[0]
  memory = compiled.memory_analysis()
  n = llama_config.num_params(PRESET)
  state = 3 * n * 4 / (F * T)  # float32 parameters, AdamW's mu and nu, split F T ways.
  tokens = BATCH * (SEQ + 1) * 4 / F  # One replica's int32 tokens over its fsdp devices.
  # The norms (2 L d + d = 640 of 500,352 parameters) stay whole on every device:
  # 3 x 640 x 4 x (1 - 1/4) bytes more than the split, and AdamW's count.
  norms = 3 * 640 * 4 * (1 - 1 / (F * T))
  assert abs(memory.argument_size_in_bytes - (state + tokens + norms)) <= 64
  assert abs(memory.argument_size_in_bytes / state - 1) < 0.02
  assert memory.alias_size_in_bytes >= 0.99 * state  # The donated state is reused.


def test_no_collective_of_the_inner_step_crosses_clients(inner, mesh):
  axes = lm_cost.collective_axes(inner[0].as_text(), mesh)
  spanned = {a for _, group in axes for a in group}
  assert spanned == {'fsdp', 'tensor'}, sorted(set(axes))  # Both are used, clients never.


def test_the_outer_step_communicates_on_clients_alone(mesh):
  config = llama_config.preset(PRESET)
  step, shapes = lm_cost.outer_step_program(config, M, F, mesh, tensor=T)
  compiled = step.lower(*shapes).compile()
  axes = lm_cost.collective_axes(compiled.as_text(), mesh)
  assert axes and all(group == ('clients',) for _, group in axes), axes
  # The numbers, against float64 NumPy: Delta = theta - mean_k theta_k,
  # b <- 0.9 b + Delta, theta <- theta - 0.7 (Delta + 0.9 b).
  rng = np.random.default_rng(0)
  draw = lambda s: rng.normal(size=s.shape).astype(np.float32)
  theta, state, theta_k = (jax.tree.map(draw, tree) for tree in shapes)
  put = lambda tree, like: jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), tree, like)
  new_theta, new_state = compiled(put(theta, shapes[0]), put(state, shapes[1]),
                                  put(theta_k, shapes[2]))
  b_old = jax.tree.leaves(state)
  for t, b, tk, got_t, got_b in zip(jax.tree.leaves(theta), b_old, jax.tree.leaves(theta_k),
                                    jax.tree.leaves(new_theta), jax.tree.leaves(new_state)):
    t, b, tk = (np.asarray(x, np.float64) for x in (t, b, tk))
    delta = t - tk.mean(axis=0)
    b = 0.9 * b + delta
    want = t - 0.7 * (delta + 0.9 * b)
    # A handful of float32 operations on values of size ~3: a few ulps of 10.
    np.testing.assert_allclose(got_b, b, rtol=0, atol=ft.gamma(8) * 10)
    np.testing.assert_allclose(got_t, want, rtol=0, atol=ft.gamma(16) * 10)


def test_collective_axes_reads_each_replica_group_form(mesh):
  lines = {
      'all-reduce(x), replica_groups={{0,4},{1,5},{2,6},{3,7}}': ('clients',),
      'all-gather(x), replica_groups=[4,2]<=[8], dimensions={0}': ('tensor',),
      'all-reduce(x), replica_groups=[4,2]<=[2,2,2]T(0,2,1)': ('fsdp',),
      "all-reduce(x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}": ('clients',),
      "all-reduce(x), replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], "
      "device_ids=([2,2,2]T(0,2,1)) {'axis_2'}": ('fsdp',),
      "all-reduce(x), replica_groups=mesh['axis_0'=2,'axis_1'=4], "
      "device_ids=(0,2,4,6,1,3,5,7) {'axis_0'}": ('tensor',),
      'all-reduce(x), replica_groups={}': ('clients', 'fsdp', 'tensor'),
      'collective-permute(x), source_target_pairs={{0,0},{1,2},{2,1}}': ('fsdp', 'tensor'),
  }
  for line, want in lines.items():
    assert lm_cost.collective_axes(f'  %c = f32[2] {line}', mesh) == [(line.split('(')[0],
                                                                        want)], line


@pytest.mark.slow
def test_fedjx_plan_with_tensor_prints_the_split_bytes(capsys):
  assert plan_cli.main([f'--preset={PRESET}', '--replicas=2', '--fsdp=2', '--tensor=2',
                        '--batch=2', '--seq_len=16']) == 0
  out = capsys.readouterr().out
  assert '2 replicas x FSDP 2 x tensor 2 on 8 cpu devices' in out
  assert 'analytic float32 parameters and moments 1.50 MB' in out
