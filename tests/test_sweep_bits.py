"""Sweep summaries of runs that count bits: totals and the accuracy-against-bits columns."""

import types

from fedjx.experiments.sweeps import summary


def rows(bits, clients):
  out = [{'round': 0, 'eval_accuracy': 0.1}]
  for r, (b, c) in enumerate(zip(bits, clients), start=1):
    out.append({'round': r, 'upload_bits': b, 'download_bits': 2 * b,
                'clients': c, 'eval_accuracy': 0.1 * r})
  return out


def test_trial_totals_are_bits_per_client_times_clients_summed():
  trial = types.SimpleNamespace(name='t0', setting={'bits': 2}, seed=0)
  row = summary.trial_row(trial, rows([100.0, 120.0, 80.0], [10, 9, 10]),
                          None)
  assert row['total_upload_bits'] == 100 * 10 + 120 * 9 + 80 * 10
  assert row['total_download_bits'] == 2 * row['total_upload_bits']
  assert row['final_upload_bits'] == 80.0
  plain = summary.trial_row(trial, [{'round': 1, 'eval_accuracy': 0.5}], None)
  assert 'total_upload_bits' not in plain


def test_markdown_shows_accuracy_against_bits_when_counted():
  trials = [types.SimpleNamespace(name=f't{b}', setting={'bits': b}, seed=0)
            for b in (1, 8)]
  trial_rows = [summary.trial_row(t, rows([float(t.setting['bits'])] * 2,
                                          [10, 10]), None) for t in trials]
  settings = summary.setting_rows(trial_rows, ['bits'])
  text = summary.markdown(settings, ['bits'], 'eval_accuracy', None)
  head = text.splitlines()[0]
  assert 'upload bits / client / round' in head and 'total upload bits' in head
  assert '| 8 | 1 | 0.2 ± 0 | 0.2 ± 0 | 8 ± 0 | 160 ± 0 | 0 |' in text
  plain = summary.markdown(
      summary.setting_rows([{'trial': 'a', 'bits': 1, 'seed': 0,
                             'final_eval_accuracy': 0.5}], ['bits']),
      ['bits'], 'eval_accuracy', None)
  assert 'upload bits' not in plain
