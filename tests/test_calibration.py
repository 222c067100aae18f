"""The TPU plan's calibration and the peak memory's bracket, on this CPU.

The fit of ``step = a compute + b HBM`` (topology_plan.fit_calibration)
against NumPy's least squares and SciPy's non-negative least squares on
made-up cases; the calibration file read and written; the ballast bracket
of lm_cost.peak_bracket against a made-up device whose program needs a
known peak; scripts/check_plan.py's cases and its judgement of measured
rows. Nothing here compiles for a TPU.
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import scipy.optimize

from fedjx.experiments import lm_cost
from fedjx.experiments import topology_plan as tp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def _check_plan():
  spec = importlib.util.spec_from_file_location(
      'check_plan', os.path.join(ROOT, 'scripts', 'check_plan.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _cases(a, b, noise=0.0, n=6, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    c, h = rng.uniform(0.01, 0.2), rng.uniform(0.01, 0.3)
    m = (a * c + b * h) * (1 + noise * rng.standard_normal())
    out.append(tp.CalibrationCase(f'case {i}', m, c, h, {'preset': f'p{i}'}))
  return out


def _rows(cases):
  return np.array([[c.compute_s / c.measured_step_s, c.hbm_s / c.measured_step_s]
                   for c in cases])


def test_the_fit_is_least_squares_in_relative_error():
  cases = _cases(1.2, 0.8, noise=0.05)
  x = _rows(cases)
  ref, *_ = np.linalg.lstsq(x, np.ones(len(cases)), rcond=None)
  assert (ref > 0).all()
  assert tp.fit_calibration(cases) == pytest.approx(tuple(ref), rel=1e-9)
  # Without noise the fit recovers the coefficients.
  assert tp.fit_calibration(_cases(1.2, 0.8)) == pytest.approx((1.2, 0.8), rel=1e-9)


@pytest.mark.parametrize('a, b', [(0.0, 1.1), (1.3, 0.0), (2.0, -0.5), (-0.3, 1.0)])
def test_the_fit_keeps_its_coefficients_non_negative_as_scipy_s_nnls(a, b):
  cases = _cases(a, b, noise=0.02, seed=3)
  cases = [c for c in cases if c.measured_step_s > 0]
  ref, _ = scipy.optimize.nnls(_rows(cases), np.ones(len(cases)))
  got = tp.fit_calibration(cases)
  assert min(got) >= 0
  assert got == pytest.approx(tuple(ref), rel=1e-7, abs=1e-12)


def test_leave_one_out_refits_without_each_case():
  cases = _cases(1.1, 0.9, noise=0.05, n=5)
  ratios = tp.leave_one_out(cases)
  for i, case in enumerate(cases):
    a, b = tp.fit_calibration(cases[:i] + cases[i + 1:])
    assert ratios[i] == pytest.approx((a * case.compute_s + b * case.hbm_s)
                                      / case.measured_step_s)
  with pytest.raises(ValueError, match='at least two'):
    tp.leave_one_out(cases[:1])
  with pytest.raises(ValueError, match='no measured case'):
    tp.fit_calibration([])


def test_the_calibration_file_round_trips_and_old_entries_are_refused(tmp_path):
  cases = _cases(1.1, 0.9, noise=0.05, n=3)
  cal = tp.fitted('v5e', cases, source='made up', host_bytes_per_s=3e9)
  path = tmp_path / 'calibration.json'
  path.write_text(json.dumps({'v5e': {**cal.to_json(), 'host_bytes_per_s': 3e9},
                              'v5p': {}}))
  back = tp.calibration('v5e', str(path))
  assert back.measured and (back.compute, back.hbm) == pytest.approx((cal.compute, cal.hbm))
  assert [c.program for c in back.cases] == ['case 0', 'case 1', 'case 2']
  assert back.cases[0].info['preset'] == 'p0' and back.host_bytes_per_s == 3e9
  assert back.on_chip_s(0.1, 0.2) == pytest.approx(cal.compute * 0.1 + cal.hbm * 0.2)
  assert back.describe().startswith(f'{cal.compute:.3g} x compute + {cal.hbm:.3g} x HBM, '
                                    'fitted to 3 steps measured on one v5e (made up)')
  unmeasured = tp.calibration('v5p', str(path))
  assert not unmeasured.measured and unmeasured.on_chip_s(0.1, 0.2) == 0.2
  assert 'uncalibrated' in unmeasured.describe()
  path.write_text(json.dumps({'v5e': {'measured_step_s': 0.3, 'planned_step_s': 0.2}}))
  with pytest.raises(ValueError, match='one measured step .* no longer calibrates'):
    tp.calibration('v5e', str(path))
  path.write_text(json.dumps({'v5e': {'compute': -1, 'hbm': 1, 'cases': []}}))
  with pytest.raises(ValueError, match='must be non-negative numbers'):
    tp.calibration('v5e', str(path))
  path.write_text(json.dumps({'v5e': {'compute': 1, 'hbm': 1, 'cases': [{'program': 'x'}]}}))
  with pytest.raises(ValueError, match='needs measured_step_s, planned_compute_s'):
    tp.calibration('v5e', str(path))


def test_the_shipped_calibration_is_the_fit_of_its_cases():
  for chip in tp.CHIPS:
    cal = tp.calibration(chip)
    if cal.measured:
      assert len(cal.cases) >= 2
      assert (cal.compute, cal.hbm) == pytest.approx(tp.fit_calibration(list(cal.cases)),
                                                     rel=1e-6)


class FakeDevice:
  """A device of ``limit`` bytes whose program needs ``peak`` bytes, its
  ``args`` bytes of arguments already in use."""

  def __init__(self, limit, args, peak, other=1000):
    self.limit, self.in_use, self.peak, self.args = limit, args + other, peak, args
    self.runs, self.prepared, self.ballasts = [], 0, []

  def stats(self):
    return {'bytes_limit': self.limit, 'bytes_in_use': self.in_use}

  def allocate(self, nbytes):
    if nbytes > self.limit - self.in_use:
      raise RuntimeError('RESOURCE_EXHAUSTED: the ballast')
    self.in_use += nbytes
    device = self

    class Ballast:
      def delete(self):
        device.in_use -= nbytes
    self.ballasts.append(nbytes)
    return Ballast()

  def run(self):
    free = self.limit - self.in_use
    self.runs.append(free)
    if self.peak - self.args > free:
      raise RuntimeError('RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting '
                         f'to allocate {self.peak - self.args} bytes.\nmore')

  def prepare(self):
    self.prepared += 1


@pytest.mark.parametrize('true_over_planned, at_most, at_least', [
    (1.0, True, True), (0.95, True, True), (1.08, True, True),
    (1.15, False, True), (0.85, True, False)])
def test_the_ballast_brackets_the_program_s_peak(true_over_planned, at_most, at_least):
  planned, args = 10_000_000, 3_000_000
  dev = FakeDevice(limit=16_000_000, args=args, peak=int(true_over_planned * planned))
  before = dev.in_use
  out = lm_cost.peak_bracket(dev.run, planned, args, dev.stats, dev.allocate,
                             prepare=dev.prepare)
  # The program had its budget less its resident arguments free each time.
  assert dev.runs == [pytest.approx(1.1 * planned - args, abs=2),
                      pytest.approx(0.9 * planned - args, abs=2)]
  assert dev.in_use == before and dev.prepared == 2  # Ballasts freed; prepared each try.
  assert (out['peak_at_most'], out['peak_at_least']) == (at_most, at_least)
  assert out['peak_within_10pct'] == (at_most and at_least)
  assert [t['ran'] for t in out['tries']] == [at_most, not at_least]
  failed = [t for t in out['tries'] if t['ran'] is False]
  assert all(t['error'].startswith('RESOURCE_EXHAUSTED') and '\n' not in t['error']
             for t in failed)


def test_a_bracket_without_room_proves_nothing_and_other_errors_propagate():
  planned, args = 10_000_000, 3_000_000
  small = FakeDevice(limit=9_000_000, args=args, peak=planned)  # Under 1.1 x planned.
  out = lm_cost.peak_bracket(small.run, planned, args, small.stats, small.allocate)
  assert out['tries'][0]['ran'] is None and 'less than the budget' in out['tries'][0]['error']
  assert not out['peak_at_most'] and not out['peak_within_10pct']
  dev = FakeDevice(limit=16_000_000, args=args, peak=planned)

  def broken():
    raise RuntimeError('INTERNAL: something else')
  with pytest.raises(RuntimeError, match='INTERNAL'):
    lm_cost.peak_bracket(broken, planned, args, dev.stats, dev.allocate)
  assert dev.in_use == args + 1000  # The ballast was freed all the same.
  assert lm_cost.ballast_bytes({'bytes_limit': 100, 'bytes_in_use': 30}, 50, 20) == 40


def test_check_plan_s_cases_name_remat_and_vocabulary():
  cp = _check_plan()
  assert cp.parse_case('35m:8') == ('35m', 8, None, None)
  assert cp.parse_case('35m:8', 'full', 256) == ('35m', 8, 'full', 256)
  assert cp.parse_case('35m:8::256') == ('35m', 8, None, 256)
  assert cp.parse_case('550m:4:full') == ('550m', 4, 'full', None)
  assert cp.parse_case('180m:4:none:32000') == ('180m', 4, 'none', 32000)
  for item in ('35m', '35m:x', '35m:0', '35m:8::v', '35m:8:a:1:2', ':8'):
    with pytest.raises(ValueError, match=r'PRESET:BATCH\[:REMAT\[:VOCAB\]\]'):
      cp.parse_case(item)
  for case in (('35m', 8, None, None), ('35m', 8, None, 256), ('550m', 4, 'full', None),
               ('180m', 4, 'none', 32000)):
    assert cp.parse_case(cp.case_name(*case)) == case
  config = cp.case_config('35m', 'full', 256, 'bfloat16')
  assert (config.vocab_size, config.remat, config.dtype) == (256, 'full', 'bfloat16')
  with pytest.raises(SystemExit):
    cp.parse(['--cases=35m:8', '--calibrate=loo'])  # One case: nothing to leave out.
  with pytest.raises(SystemExit):
    cp.parse(['--cases=35m:8,180m:4', '--calibrate=3'])


def _row(preset, batch, vocab, measured, compute, hbm, peak_ok=True):
  return {'chip': 'v5e', 'device': 'TPU v5 lite', 'case': f'{preset}:{batch}::{vocab}',
          'preset': preset, 'batch': batch, 'seq_len': 2048, 'vocab_size': vocab,
          'dtype': 'bfloat16', 'param_dtype': 'float32', 'remat': 'none',
          'attention': 'splash', 'loss_chunk': 0, 'plan_flops': 1e12, 'plan_hbm_bytes': 1e10,
          'plan_peak_bytes': 10**10, 'plan_compute_s': compute, 'plan_hbm_s': hbm,
          'measured_step_s': measured, 'peak_within_10pct': peak_ok, 'date': '2026-12-07',
          'jax': '0.10.2', 'libtpu': None}


def test_check_plan_fits_the_calibrating_cases_and_checks_the_others(tmp_path):
  cp = _check_plan()
  truth = lambda c, h: 1.1 * c + 0.9 * h
  shapes = [('35m', 8, 32000, 0.024, 0.063), ('35m', 8, 256, 0.016, 0.046),
            ('180m', 4, 256, 0.05, 0.12), ('180m', 4, 32000, 0.06, 0.13)]
  rows = [_row(p, b, v, truth(c, h), c, h) for p, b, v, c, h in shapes]
  rows[3]['measured_step_s'] *= 1.2  # A case the others do not predict.
  rows[1]['peak_within_10pct'] = False
  entry = cp.judge(rows, '2')
  assert [r['role'] for r in rows] == ['calibration', 'calibration', 'check', 'check']
  assert rows[2]['step_ratio'] == pytest.approx(1.0) and rows[2]['within_10pct']
  assert rows[3]['step_ratio'] == pytest.approx(1 / 1.2) and not rows[3]['within_10pct']
  assert not rows[1]['within_10pct']  # Its step fits; its peak's bracket does not.
  e = entry['v5e']
  assert (e['compute'], e['hbm']) == pytest.approx((1.1, 0.9))
  assert len(e['cases']) == 2 and e['cases'][1]['vocab_size'] == 256
  assert 'vocabulary 256' in e['cases'][1]['program']
  # The entry is what calibration() reads.
  path = tmp_path / 'c.json'
  path.write_text(json.dumps(entry))
  assert tp.calibration('v5e', str(path)).compute == pytest.approx(1.1)
  rows = [_row(p, b, v, truth(c, h), c, h) for p, b, v, c, h in shapes]
  entry = cp.judge(rows, 'loo')
  assert all(r['step_ratio'] == pytest.approx(1.0) for r in rows)
  assert len(entry['v5e']['cases']) == 4
