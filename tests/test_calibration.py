"""The TPU plan's calibration and the peak memory's bracket, on this CPU.

The fit of ``step = f max(compute, HBM)`` (topology_plan.fit_calibration)
against NumPy's least squares on made-up cases; the calibration file read
and written, and its earlier formats refused; the ballast bracket of
lm_cost.peak_bracket against a made-up device whose program needs a known
peak; scripts/check_plan.py's cases and its judgement of measured rows.
Nothing here compiles for a TPU.
"""

import importlib.util
import json
import os
import re

import numpy as np
import pytest

from fedjx.experiments import lm_cost
from fedjx.experiments import topology_plan as tp
from fedjx.experiments import tpu_env

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def _check_plan():
  spec = importlib.util.spec_from_file_location(
      'check_plan', os.path.join(ROOT, 'scripts', 'check_plan.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _cases(factor, noise=0.0, n=6, seed=0):
  """Made-up cases measured at ``factor`` times their roofline (times 1 + noise);
  some HBM-bound, some compute-bound."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    c, h = rng.uniform(0.01, 0.3), rng.uniform(0.01, 0.3)
    m = factor * max(c, h) * (1 + noise * rng.standard_normal())
    out.append(tp.CalibrationCase(f'case {i}', m, c, h, {'preset': f'p{i}'}))
  return out


def _lstsq_factor(cases):
  """NumPy's least squares of the column roofline / measured against ones."""
  x = np.array([[max(c.compute_s, c.hbm_s) / c.measured_step_s] for c in cases])
  (f,), *_ = np.linalg.lstsq(x, np.ones(len(cases)), rcond=None)
  return float(f)


def test_the_fit_is_least_squares_in_relative_error():
  cases = _cases(1.2, noise=0.05)
  assert {c.compute_s > c.hbm_s for c in cases} == {True, False}  # Both kinds bound.
  f = tp.fit_calibration(cases)
  assert isinstance(f, float)
  assert f == pytest.approx(_lstsq_factor(cases), rel=1e-12)
  r = np.array([max(c.compute_s, c.hbm_s) / c.measured_step_s for c in cases])
  assert f == pytest.approx(r.sum() / (r * r).sum(), rel=1e-12)

  def loss(g):
    return sum((g * max(c.compute_s, c.hbm_s) / c.measured_step_s - 1) ** 2 for c in cases)
  assert loss(f) < min(loss(f * 0.999), loss(f * 1.001))  # The minimum.


@pytest.mark.parametrize('factor', [0.8, 1.0, 1.27, 2.5])
def test_the_fit_recovers_the_factor_of_exact_cases(factor):
  cases = _cases(factor, n=5, seed=int(factor * 10))
  assert tp.fit_calibration(cases) == pytest.approx(factor, rel=1e-12)
  assert tp.fit_calibration(cases[:1]) == pytest.approx(factor, rel=1e-12)
  # A case's compute time under its HBM time does not move the fit.
  hidden = [tp.CalibrationCase(c.program, c.measured_step_s, 0.5 * c.roofline_s,
                               c.roofline_s) for c in cases]
  assert tp.fit_calibration(hidden) == pytest.approx(factor, rel=1e-12)


def test_leave_one_out_refits_without_each_case():
  cases = _cases(1.1, noise=0.05, n=5)
  ratios = tp.leave_one_out(cases)
  for i, case in enumerate(cases):
    f = _lstsq_factor(cases[:i] + cases[i + 1:])
    assert ratios[i] == pytest.approx(f * max(case.compute_s, case.hbm_s)
                                      / case.measured_step_s, rel=1e-12)
  assert tp.leave_one_out(_cases(1.3, n=4)) == pytest.approx([1.0] * 4, rel=1e-12)
  with pytest.raises(ValueError, match='at least two'):
    tp.leave_one_out(cases[:1])
  with pytest.raises(ValueError, match='no measured case'):
    tp.fit_calibration([])


def test_the_calibration_file_round_trips_and_old_entries_are_refused(tmp_path):
  cases = _cases(1.1, noise=0.05, n=3)
  cal = tp.fitted('v5e', cases, source='made up', host_bytes_per_s=3e9)
  assert cal.factor == tp.fit_calibration(cases)
  path = tmp_path / 'calibration.json'
  path.write_text(json.dumps({'v5e': {**cal.to_json(), 'host_bytes_per_s': 3e9},
                              'v5p': {}}))
  entry = json.loads(path.read_text())['v5e']
  assert entry['model'] == tp.CALIBRATION_MODEL and 'compute' not in entry
  back = tp.calibration('v5e', str(path))
  assert back.measured and back.factor == cal.factor
  assert back.cases == cal.cases and back.source == 'made up'
  assert [c.program for c in back.cases] == ['case 0', 'case 1', 'case 2']
  assert back.cases[0].info['preset'] == 'p0' and back.host_bytes_per_s == 3e9
  assert back.on_chip_s(0.1, 0.2) == pytest.approx(cal.factor * 0.2)
  assert back.on_chip_s(0.3, 0.2) == pytest.approx(cal.factor * 0.3)
  assert back.describe() == (f'x {cal.factor:.4g} the roofline, fitted to 3 steps measured '
                             'on one v5e (made up)')
  unmeasured = tp.calibration('v5p', str(path))
  assert not unmeasured.measured and unmeasured.factor is None
  assert unmeasured.on_chip_s(0.1, 0.2) == 0.2
  assert 'uncalibrated' in unmeasured.describe()
  # The single measured step of the first format.
  path.write_text(json.dumps({'v5e': {'measured_step_s': 0.3, 'planned_step_s': 0.2}}))
  old = re.escape(f'{path}: v5e: ')
  with pytest.raises(ValueError, match=old + r'one measured step \(measured_step_s, '
                     r'planned_step_s\) no longer calibrates; keep "factor" and the "cases" '
                     r'.*scripts/check_plan\.py'):
    tp.calibration('v5e', str(path))
  # The two coefficients of the second: refit the cases it keeps.
  two = {'compute': 0.147, 'hbm': 0.955, 'cases': [c.to_json() for c in cases]}
  path.write_text(json.dumps({'v5e': two}))
  with pytest.raises(ValueError, match=old + r'the coefficients "compute" and "hbm" .* no '
                     r'longer calibrate; replace them by "factor" .*fit_calibration.*--judge'):
    tp.calibration('v5e', str(path))
  for bad in (0, -1, 'x', True):
    path.write_text(json.dumps({'v5e': {'factor': bad, 'cases': []}}))
    with pytest.raises(ValueError, match='must be a positive number'):
      tp.calibration('v5e', str(path))
  path.write_text(json.dumps({'v5e': {'factor': 1.0, 'cases': [{'program': 'x'}]}}))
  with pytest.raises(ValueError, match='needs measured_step_s, planned_compute_s'):
    tp.calibration('v5e', str(path))


def test_the_shipped_calibration_is_the_fit_of_its_cases():
  for chip in tp.CHIPS:
    cal = tp.calibration(chip)
    if cal.measured:
      assert len(cal.cases) >= 2
      assert cal.factor == pytest.approx(tp.fit_calibration(list(cal.cases)), rel=1e-9)
  v5e = tp.calibration('v5e')
  assert v5e.factor == pytest.approx(1.0165, abs=1e-4) and len(v5e.cases) == 7
  # Its cases are HBM-bound: the roofline is their HBM time.
  assert all(c.hbm_s > c.compute_s for c in v5e.cases)
  # Leaving each case out: what docs/scaling.md tabulates.
  assert [round(r, 3) for r in tp.leave_one_out(list(v5e.cases))] == [
      1.008, 0.946, 1.128, 0.989, 1.022, 0.860, 1.023]


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
  truth = lambda c, h: 1.05 * max(c, h)
  shapes = [('35m', 8, 32000, 0.024, 0.063), ('35m', 8, 256, 0.016, 0.046),
            ('180m', 4, 256, 0.05, 0.12), ('180m', 4, 32000, 0.06, 0.13)]
  rows = [_row(p, b, v, truth(c, h), c, h) for p, b, v, c, h in shapes]
  rows[3]['measured_step_s'] *= 1.2  # A case the others do not predict.
  rows[1]['peak_within_10pct'] = False
  entry = cp.judge(rows, '2')
  assert [r['role'] for r in rows] == ['calibration', 'calibration', 'check', 'check']
  assert all(r['calibration_factor'] == pytest.approx(1.05) for r in rows)
  assert rows[2]['plan_step_s'] == pytest.approx(1.05 * 0.12)
  assert rows[2]['step_ratio'] == pytest.approx(1.0) and rows[2]['within_10pct']
  assert rows[3]['step_ratio'] == pytest.approx(1 / 1.2) and not rows[3]['within_10pct']
  assert not rows[1]['within_10pct']  # Its step fits; its peak's bracket does not.
  e = entry['v5e']
  assert e['factor'] == pytest.approx(1.05) and e['model'] == tp.CALIBRATION_MODEL
  assert len(e['cases']) == 2 and e['cases'][1]['vocab_size'] == 256
  assert 'vocabulary 256' in e['cases'][1]['program']
  # The entry is what calibration() reads.
  path = tmp_path / 'c.json'
  path.write_text(json.dumps(entry))
  assert tp.calibration('v5e', str(path)).factor == pytest.approx(1.05)
  # Leave-one-out: each row checked with the factor fitted on the others.
  rows = [_row(p, b, v, truth(c, h), c, h) for p, b, v, c, h in shapes]
  rows[3]['measured_step_s'] *= 1.2
  entry = cp.judge(rows, 'loo')
  cases = [cp.to_case(r) for r in rows]
  assert [r['step_ratio'] for r in rows] == pytest.approx(tp.leave_one_out(cases))
  assert rows[0]['calibration_factor'] == pytest.approx(tp.fit_calibration(cases[1:]))
  assert rows[3]['calibration_factor'] == pytest.approx(1.05)
  assert len(entry['v5e']['cases']) == 4
  assert entry['v5e']['factor'] == pytest.approx(tp.fit_calibration(cases))


def test_check_plan_judges_an_earlier_run_s_rows(tmp_path, capsys, monkeypatch):
  cp = _check_plan()
  monkeypatch.setattr(tpu_env, 'quiet', lambda: None)  # Leave this process's environment.
  shapes = [('35m', 8, 32000, 0.024, 0.063), ('35m', 8, 256, 0.016, 0.046),
            ('180m', 4, 256, 0.05, 0.12)]
  path = tmp_path / 'run.jsonl'
  rows = [_row(p, b, v, 1.1 * h, c, h) for p, b, v, c, h in shapes]
  path.write_text('not json\n' + ''.join(json.dumps(r) + '\n' for r in rows)
                  + json.dumps({'case': '550m:4', 'error': 'exit 1'}) + '\n')
  out = tmp_path / 'judged.jsonl'
  judged = cp.main([f'--judge={path}', '--calibrate=loo', f'--out={out}'])
  assert len(judged) == 3
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert [line['calibration_factor'] for line in lines[:3]] == pytest.approx([1.1] * 3)
  assert all(line['step_ratio'] == pytest.approx(1.0) for line in lines[:3])
  summary = lines[-1]
  assert summary['summary'] and summary['factor'] == pytest.approx(1.1)
  assert summary['tpu_calibration.json']['v5e']['factor'] == pytest.approx(1.1)
  assert capsys.readouterr().out.count('\n') == 4
