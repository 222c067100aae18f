"""A TPU pod planned with libtpu's compiler on this CPU (topology_plan, hlo_collectives).

The figures are checked against arithmetic done here: the ring's bytes per
chip of each collective, the parameter bytes of a layout, ``6 N_matmul + 12
L H h T`` per token from the preset's shape, and which mesh axes (and
whether the data-centre network) each collective of a compiled DiLoCo round
uses. The tests that compile need libtpu (``pip install -e '.[tpu]'``) and
skip with that reason without it; they run in this process, which has
``JAX_PLATFORMS=cpu`` and 8 host devices (tests/conftest.py).
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from fedjx.experiments import hlo_collectives as hc
from fedjx.experiments import lm_cost
from fedjx.experiments import plan_report
from fedjx.experiments import topology_plan as tp
from fedjx.models import llama_config as lc

needs_libtpu = pytest.mark.skipif(tp.libtpu_missing() is not None,
                                  reason=tp.libtpu_missing() or '')


def test_topology_names_and_cloud_accelerator_types():
  t = tp.topology('v5e-256')
  assert (t.chip.name, t.shape, t.chips, t.slice_name) == ('v5e', (16, 16), 256, 'v5e:16x16')
  t = tp.topology('v5p-128')  # Cloud TPU counts v5p TensorCores: 64 chips.
  assert (t.shape, t.chips) == ((4, 4, 4), 64)
  t = tp.topology('V5E:2x4', num_slices=2)
  assert (t.chips_per_slice, t.chips, t.name) == (8, 16, 'v5e:2x4 x 2 slices')
  for name, message in [('v4:2x2', 'CHIP one of v5e, v5p'),
                        ('v5e-5', 'v5e-N is one of v5e-1, v5e-4, v5e-8'),
                        ('v5e:2x2x2', 'a v5e slice has 2 torus axes'),
                        ('v5p:4x4', 'a v5p slice has 3 torus axes')]:
    with pytest.raises(ValueError, match=message):
      tp.topology(name)
  with pytest.raises(ValueError, match='num_slices=0 must be a positive integer'):
    tp.topology('v5e:2x4', num_slices=0)


def test_the_bytes_each_chip_sends_are_the_ring_s():
  assert hc._array_bytes('(bf16[2,3]{1,0:T(8,128)}, f32[4]{0}, u32[], token[])') == [
      12, 16, 4]
  assert hc._array_bytes('pred[8]{0}') == [8]
  # n = 4 chips, a 1,000-byte buffer: an all-reduce is a reduce-scatter then an
  # all-gather, each sending 3 of 4 quarters: 2 x 750.
  assert hc._wire('all-reduce', False, [1000.0], 4) == (1000.0, 1500.0)
  assert hc._wire('all-gather', False, [1000.0], 4) == (1000.0, 750.0)  # 3 shards of 250 in
  assert hc._wire('reduce-scatter', False, [250.0], 4) == (250.0, 750.0)  # 3 shards out
  assert hc._wire('all-to-all', False, [1000.0], 4) == (1000.0, 750.0)
  assert hc._wire('collective-permute', True, [1000.0, 1000.0, 4.0, 4.0], 2) == (1000.0, 1000.0)
  assert hc._wire('all-reduce', False, [1000.0], 1) == (1000.0, 0.0)


def test_collectives_name_the_axes_their_groups_span_and_count_a_channel_once():
  mesh = jax.make_mesh((2, 2, 2), tp.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
  hlo = '\n'.join([
      # Partitions 0 and 2 differ in fsdp only (row-major (clients, fsdp, tensor)).
      '  %a = f32[256]{0} all-reduce(%x), channel_id=1, replica_groups={{0,2},{1,3},{4,6},'
      '{5,7}}, to_apply=%add',
      '  %b = f32[256]{0:S(1)} all-reduce(%y), channel_id=1, replica_groups={{0,2},{1,3},'
      '{4,6},{5,7}}, to_apply=%add',  # The same channel and shape again: once.
      '  %c = bf16[8,64]{1,0} all-gather(%z), channel_id=2, replica_groups=[2,4]<=[8], '
      'dimensions={0}',
      '  %d = f32[16]{0} add(%p, %q)',
  ])
  found = hc.collectives(hlo, mesh)
  assert [(c.op, c.axes, c.across_slices, c.group_size) for c in found] == [
      ('all-reduce', ('fsdp',), False, 2), ('all-gather', ('fsdp', 'tensor'), False, 4)]
  assert hc.wire_bytes_by_axes(found) == {'fsdp': 2 * 1 / 2 * 1024,
                                          'fsdp+tensor': 3 / 4 * 8 * 64 * 2}
  assert hc.ops_by_axes(found) == {'fsdp': {'all-reduce': 1},
                                   'fsdp+tensor': {'all-gather': 1}}


def test_the_calibration_is_fitted_to_measured_steps_per_chip(tmp_path):
  path = tmp_path / 'calibration.json'
  cases = [{'program': 'p1', 'measured_step_s': 0.3, 'planned_compute_s': 0.1,
            'planned_hbm_s': 0.2},
           {'program': 'p2', 'measured_step_s': 0.45, 'planned_compute_s': 0.3,
            'planned_hbm_s': 0.2}]
  path.write_text(json.dumps({'v5e': {'factor': 1.5, 'cases': cases, 'source': 's'},
                              'v5p': {}}))
  c = tp.calibration('v5e', str(path))
  assert c.measured and (c.factor, c.source) == (1.5, 's')
  assert [case.program for case in c.cases] == ['p1', 'p2']
  # Both measured at 1.5 times their roofline (HBM 0.2 s, compute 0.3 s).
  assert tp.fit_calibration(list(c.cases)) == pytest.approx(1.5)
  assert not tp.calibration('v5p', str(path)).measured
  path.write_text(json.dumps({'v5e': {'factor': 1.5, 'cases': [
      {**cases[0], 'measured_step_s': -1}]}}))
  with pytest.raises(ValueError, match='must be positive seconds'):
    tp.calibration('v5e', str(path))
  path.write_text(json.dumps({'v5e': {'host_bytes_per_s': 3e9}}))
  assert tp.calibration('v5e', str(path)).host_bytes_per_s == 3e9
  path.write_text(json.dumps({'v5e': {'host_bytes_per_s': 0}}))
  with pytest.raises(ValueError, match='host_bytes_per_s=0 must be a positive'):
    tp.calibration('v5e', str(path))
  for chip in tp.CHIPS:  # The shipped file reads.
    assert tp.calibration(chip).chip == chip


def test_a_round_is_h_roofline_steps_and_the_outer_step_and_its_table_says_so():
  chip = tp.CHIPS['v5e']
  inner = tp.ProgramCost(
      argument_bytes=3_000_000, output_bytes=1_000_100, alias_bytes=1_000_000,
      temp_bytes=2_000_000, flops=2e12, hbm_bytes=4.095e9, xla_seconds=None,
      wire={'fsdp': 1e8}, collectives=(hc.Collective('all-gather', ('fsdp',), False, 2,
                                                     2e8, 1e8),),
      compile_seconds=1.0)
  outer = tp.ProgramCost(
      argument_bytes=1_000_000, output_bytes=500_000, alias_bytes=500_000, temp_bytes=0,
      flops=1e6, hbm_bytes=8.19e8, xla_seconds=None, wire={'clients': 2e8, 'dcn:clients': 3.125e7},
      collectives=(hc.Collective('all-reduce', ('clients',), True, 2, 3.125e7, 3.125e7),),
      compile_seconds=1.0)
  plan = tp.PodPlan(
      topology=tp.topology('v5e:2x4', 2), preset='35m', config=lc.preset('35m'),
      algorithm='diloco', replicas=4, fsdp=4, tensor=1, batch=8, seq_len=2048,
      inner_steps=10, params=lc.num_params('35m'), inner=inner, outer=outer,
      server_state_bytes=500_000, inner_state_bytes=700_000, analytic_flops=1.97e12,
      calibration=tp.Calibration('v5e', 1.5, source='measured'))
  # Compute 2e12 / 197e12 = 10.2 ms, HBM 4.095e9 / 819e9 = 5 ms, ICI 1e8 / 200e9
  # = 0.5 ms: compute binds the roofline; calibrated 1.5 times it.
  assert plan.raw_step_s == pytest.approx(2e12 / 197e12)
  assert plan.step_s == pytest.approx(1.5 * 2e12 / 197e12)
  # Outer: 1.5 x its roofline, HBM 8.19e8 / 819e9 = 1 ms (compute 1e6 / 197e12),
  # then ICI 2e8 / 200e9 = 1 ms and DCN 3.125e7 / 3.125e9 = 10 ms.
  assert plan.outer_s == pytest.approx(1.5 * 1e-3 + 1e-3 + 10e-3)
  assert plan.round_s == pytest.approx(10 * plan.step_s + plan.outer_s)
  assert plan.mfu == pytest.approx(1.97e12 * 10 / (plan.round_s * 197e12))
  # Peak: inner 3 + 1.0001 - 1 + 2 MB + server state 0.5 MB, against the outer
  # step's 1 MB + the inner optimizer's 0.7 MB.
  assert plan.peak_bytes == 5_000_100 + 500_000 and plan.fits
  text = plan_report.render_pod(plan)
  assert 'on v5e:2x4 x 2 slices (16 v5e chips), 4 replicas x FSDP 4 x tensor 1' in text
  assert re.search(r'    round peak +5\.50 MB', text)
  assert re.search(r'  fits v5e +yes  16\.91 GB of HBM a chip', text)
  assert re.search(r'    fsdp \(ICI\) +100\.00 MB  all-gather x1', text)
  assert re.search(r'    clients \(across slices, DCN\) +31\.25 MB  all-reduce x1', text)
  assert 'compute binds' in text and 'calibrated: x 1.5 the roofline (measured)' in text
  uncalibrated = dataclasses.replace(plan, calibration=tp.Calibration('v5e'))
  assert uncalibrated.step_s == pytest.approx(2e12 / 197e12)  # The roofline.
  assert 'uncalibrated: no v5e measurement' in plan_report.render_pod(uncalibrated)
  row = plan.to_json()
  assert row['calibration_factor'] == 1.5 and row['calibrated']
  assert row['calibration'] == 'x 1.5 the roofline (measured)'
  json.dumps(row)  # The --json line.
  assert uncalibrated.to_json()['calibration_factor'] is None
  assert f'{plan.tokens_per_round / plan.round_s:,.0f} tokens/s' in text


def _four_replicas_on_one_chip(**changes):
  """A hand-made plan of 4 replicas on one v5e chip (inner step 5,000,100
  bytes at its peak, outer step 1,000,000), with ``changes``."""
  inner = tp.ProgramCost(
      argument_bytes=3_000_000, output_bytes=100, alias_bytes=0, temp_bytes=2_000_000,
      flops=2e12, hbm_bytes=1e9, xla_seconds=None, wire={}, collectives=(),
      compile_seconds=1.0)
  outer = tp.ProgramCost(
      argument_bytes=1_000_000, output_bytes=0, alias_bytes=0, temp_bytes=0, flops=1e6,
      hbm_bytes=8.19e8, xla_seconds=None, wire={}, collectives=(), compile_seconds=1.0)
  kw = dict(topology=tp.topology('v5e:1x1'), preset='35m', config=lc.preset('35m'),
            algorithm='diloco', replicas=4, fsdp=1, tensor=1, batch=8, seq_len=2048,
            inner_steps=10, params=lc.num_params('35m'), inner=inner, outer=outer,
            server_state_bytes=500_000, inner_state_bytes=700_000,
            analytic_flops=1.97e12, calibration=tp.Calibration('v5e'),
            replica_param_bytes=350_000)
  return tp.PodPlan(**{**kw, **changes})


def test_replicas_beyond_the_chips_stream_through_each_chip_and_the_plan_counts_them():
  # 4 replicas on one chip: each round trains them one after another, the
  # chip holding the 3 waiting replicas' optimizer states and the running
  # sum of their models besides one replica's step.
  plan = _four_replicas_on_one_chip()
  assert plan.replicas_per_slot == 4
  assert plan.held_bytes == 500_000 + 3 * 700_000 + 350_000
  # Inner 5,000,100 + held 2,950,000 against outer 1,000,000 + 4 x 700,000.
  assert plan.peak_bytes == 5_000_100 + 2_950_000
  assert plan.round_s == pytest.approx(4 * 10 * plan.step_s + plan.outer_s)
  assert plan.mfu == pytest.approx(1.97e12 * 40 / (plan.round_s * 197e12))
  assert plan.tokens_per_round == 4 * 8 * 2048 * 10
  text = plan_report.render_pod(plan)
  assert '(4 replicas trained one after another on each group of 1 chip)' in text
  assert re.search(r'    other replicas +2\.45 MB', text)
  assert '40 inner steps (4 replicas x 10)' in text
  assert plan.to_json()['replicas_per_slot'] == 4


def test_replicas_states_on_the_host_leave_the_chip_two_in_flight():
  # The same 4 replicas with their optimizer states on the host: the chip
  # holds the server state, the next replica's state arriving and the
  # previous one's leaving, and the running sum of the models with its
  # compensation; the round adds the last state's copy at the host
  # bandwidth, and what of the others the next replica's steps do not hide.
  plan = _four_replicas_on_one_chip(
      replica_states='store', calibration=tp.Calibration('v5e', host_bytes_per_s=2.8e6))
  assert plan.held_bytes == 500_000 + 2 * 700_000 + 2 * 350_000
  # Inner 5,000,100 + held 2,600,000 against the outer step's 1,000,000 alone.
  assert plan.peak_bytes == 5_000_100 + 2_600_000
  copy, steps = 700_000 / 2.8e6, 10 * plan.step_s  # 0.25 s per state
  assert plan.host_s == pytest.approx(copy + 3 * max(0.0, copy - steps))
  assert plan.round_s == pytest.approx(40 * plan.step_s + plan.outer_s + plan.host_s)
  text = plan_report.render_pod(plan)
  assert re.search(r'    replicas in flight +2\.10 MB', text)
  assert "(config.client_state.placement='store')" in text
  assert re.search(r'\+ [\d.]+ m?s of copies to the host not hidden by the steps '
                   r'\(4 states at 0\.0 GB/s, each while the next replica trains\)', text)
  slow = _four_replicas_on_one_chip(  # Copies slower than a replica's steps.
      replica_states='store', calibration=tp.Calibration('v5e', host_bytes_per_s=1.0))
  assert slow.host_s == pytest.approx(
      700_000 + 3 * (700_000 - 10 * slow.step_s))
  unmeasured = _four_replicas_on_one_chip(replica_states='store')
  assert unmeasured.host_s == 0.0
  assert 'copies of the states to the host not counted' in plan_report.render_pod(unmeasured)
  with pytest.raises(ValueError, match="replica_states='host' is not one of 'device', 'store'"):
    tp.plan_pod('35m', 'v5e:1x1', replicas=4, fsdp=1, replica_states='host')


def test_the_slots_of_a_topology_divide_the_replicas_or_the_plan_is_refused():
  assert tp._slots(tp.topology('v5e:1x1'), 4, 1, 1) == 1
  assert tp._slots(tp.topology('v5e:2x2'), 8, 1, 1) == 4
  assert tp._slots(tp.topology('v5e:2x2'), 2, 2, 1) == 2
  with pytest.raises(ValueError, match=r'replicas=6 x fsdp=1 x tensor=1 is 6 chips; v5e:2x2 '
                     r'has 4: choose sizes whose product is 4, or a multiple of it'):
    tp._slots(tp.topology('v5e:2x2'), 6, 1, 1)
  with pytest.raises(ValueError, match='replicas=1 x fsdp=2'):
    tp._slots(tp.topology('v5e:2x2'), 1, 2, 1)


def test_auto_settings_are_resolved_for_the_tpu_chip_on_any_planning_machine():
  # The machine that plans may be a CPU: the chip's kernel all the same, and
  # a remat policy that grows with the memory the round's state leaves.
  ample = tp.for_chip(lc.preset('180m'), 8, 2048, 64e9)
  tight = tp.for_chip(lc.preset('180m'), 8, 2048, 2e9)
  assert ample.attention == tight.attention == 'splash'
  assert ample.remat == 'none' and tight.remat == 'full'
  assert 'auto' not in (ample.remat, ample.loss_chunk, ample.attention)
  explicit = tp.for_chip(lc.preset('180m').replace(remat='dots_saveable'), 8, 2048, 2e9)
  assert explicit.remat == 'dots_saveable'
  # A pod is planned with XLA's attention.
  assert tp.for_chip(lc.preset('180m'), 8, 2048, 64e9, kernel=False).attention == 'xla'


def test_without_libtpu_the_plan_says_how_to_install_it(monkeypatch):
  monkeypatch.delenv('TPU_LIBRARY_PATH', raising=False)
  monkeypatch.setattr(tp.importlib.util, 'find_spec', lambda name: None)
  assert "pip install -e '.[tpu]'" in tp.libtpu_missing()
  with pytest.raises(ValueError, match=r"topology='v5e:2x4': libtpu is not installed"):
    tp.compile_only_devices(tp.topology('v5e:2x4'))


def test_a_mesh_that_is_not_the_topology_is_refused_in_one_line():
  top = tp.topology('v5e:2x4', num_slices=2)
  with pytest.raises(ValueError, match=r'replicas=2 x fsdp=2 x tensor=1 is 4 chips; '
                     r'v5e:2x4 x 2 slices has 16: .*\(e.g. fsdp=8\)'):
    tp.pod_mesh(top, 2, 2, 1)
  with pytest.raises(ValueError, match=r'replicas=1 must be a multiple of the 2 slices'):
    tp.pod_mesh(top, 1, 16, 1)


@needs_libtpu
def test_libtpu_loads_without_warnings_where_there_is_no_tpu():
  env = {k: v for k, v in os.environ.items() if not k.startswith(('TPU_', 'JAX_PLATFORMS'))}
  env.pop('ALLOW_MULTIPLE_LIBTPU_LOAD', None)
  code = ('from fedjx.experiments import topology_plan as tp\n'
          "print(len(tp.compile_only_devices(tp.topology('v5e:2x4', 2))))\n")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == '16'
  assert 'TPU_ACCELERATOR_TYPE' not in out.stderr and 'TPU_WORKER_HOSTNAMES' not in out.stderr


@needs_libtpu
def test_diloco_s_outer_step_over_two_slices_crosses_the_dcn_once_per_chip_share():
  # 4 replicas of FSDP 4 on two v5e:2x4 slices, 2 replicas a slice. The mean
  # over replicas is hierarchical: a reduce-scatter between a slice's 2
  # replicas (each chip keeps half of its 4 N / F bytes), an all-reduce of
  # that half with the other slice (2 (S - 1) / S = 1 times it), an
  # all-gather back. Only 'clients' is used, within and across slices.
  top = tp.topology('v5e:2x4', num_slices=2)
  mesh = tp.pod_mesh(top, replicas=4, fsdp=4)
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert (slices[:2] == 0).all() and (slices[2:] == 1).all()  # Replicas 0, 1 | 2, 3.
  config = lc.preset('35m')
  jitted, args = lm_cost.outer_step_program(config, 4, 4, mesh)
  found = hc.collectives(jitted.lower(*args).compile().as_text(), mesh)
  assert {c.axes for c in found} == {('clients',)}
  wire = hc.wire_bytes_by_axes(found)
  share = 4 * lc.num_params(config) / (4 * 2)  # float32 over F = 4, halved by 2 replicas.
  assert wire['dcn:clients'] == pytest.approx(2 * (2 - 1) / 2 * share, rel=1e-3)
  # Within the slice: reduce-scatter (1 x share) and all-gather (1/2 x 2 share).
  assert wire['clients'] == pytest.approx(2 * share, rel=1e-3)
  assert {c.op for c in found if c.across_slices} == {'all-reduce'}


def _analytic_flops_per_token(config, seq_len):
  """6 N_matmul + 12 L H h T, N_matmul counted here from the shape."""
  d, f, h = config.width, config.mlp_width, config.head_width
  per_layer = d * config.num_heads * h * 2 + d * config.num_kv_heads * h * 2 + 3 * d * f
  n_matmul = config.num_layers * per_layer + config.vocab_size * d  # Tied: the head once.
  return 6 * n_matmul + 12 * config.num_layers * config.num_heads * h * seq_len


@pytest.mark.slow
@needs_libtpu
def test_a_v5e_256_diloco_round_plans_without_an_accelerator():
  # 8 replicas of FSDP 32 of the 1m preset: 32 divides every dimension of
  # 128, so each chip holds exactly 1/32 of a replica.
  plan = tp.plan_pod('1m', 'v5e-256', replicas=8, fsdp=32, batch=32, seq_len=128,
                     inner_steps=30)
  config = lc.preset('1m')
  n = lc.num_params(config)
  assert plan.params == n and plan.topology.chips == 256
  assert plan.server_state_bytes == 2 * 4 * n / 32  # theta and the outer momentum.
  assert plan.inner_state_bytes == pytest.approx(2 * 4 * n / 32, abs=64)  # AdamW's mu, nu.
  # The inner step's arguments: parameters and moments (3 x 4 N / F) and the
  # tokens, on tiles of the TPU's layout (at most 2x here).
  tokens = 32 * 129 * 4 / 32
  assert 3 * 4 * n / 32 + tokens <= plan.inner.argument_bytes <= 2 * (3 * 4 * n / 32 + tokens)
  assert plan.fits and plan.peak_bytes < tp.CHIPS['v5e'].hbm_bytes
  analytic = _analytic_flops_per_token(config, 128) * 32 * 128 / 32
  assert plan.analytic_flops == pytest.approx(analytic)
  assert abs(plan.inner.flops / analytic - 1) < 0.10  # XLA adds the element-wise work.
  inner_axes = {c.axes for c in plan.inner.collectives}
  assert inner_axes and all('clients' not in a for a in inner_axes)  # Replicas never talk.
  assert not any(c.across_slices for c in plan.inner.collectives)
  assert {c.axes for c in plan.outer.collectives} == {('clients',)}
  assert plan.round_s == pytest.approx(30 * plan.step_s + plan.outer_s)
  row = plan.to_json()
  assert row['fits'] and row['chips'] == 256 and json.loads(json.dumps(row)) == row


@pytest.mark.slow
@needs_libtpu
def test_fedjx_plan_plans_a_config_on_two_v5e_256_slices():
  env = {k: v for k, v in os.environ.items() if not k.startswith('TPU_')}
  out = subprocess.run(
      [sys.executable, '-m', 'fedjx.experiments.plan_cli', '--config',
       'configs/diloco_study.py:8,1m', '--tpu', 'v5e-256', '--num_slices', '2', '--json'],
      capture_output=True, text=True, env=env, timeout=1800, check=False,
      cwd=os.path.join(os.path.dirname(__file__), os.pardir))
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'TPU_ACCELERATOR_TYPE' not in out.stderr
  row = json.loads(out.stdout.strip().splitlines()[-1])
  # diloco_study's 8 replicas of 32 / 8 = 4 sequences of 128 bytes, H = 30, on
  # 512 chips: FSDP fills the 64 chips a replica has.
  assert (row['replicas'], row['fsdp'], row['tensor'], row['batch'], row['seq_len'],
          row['inner_steps'], row['chips']) == (8, 64, 1, 4, 128, 30, 512)
  assert row['fits'] and row['algorithm'] == 'diloco'
  assert set(row['outer_collectives']) == {'clients', 'dcn:clients'}
  assert not any(k.startswith('dcn:') for k in row['collectives'])
