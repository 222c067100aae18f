"""The benchmark's fusion and streaming records (numbers only; no timings asserted)."""

import round_bench as benchmark  # benchmarks/, put on sys.path by conftest.py


def test_fusion_prefix_is_parsed():
  assert benchmark.fusion_of('nofuse:chunked:64') == (False, 'chunked:64')
  assert benchmark.fusion_of('auto') == (True, 'auto')
  assert benchmark.parse_strategy('nofuse:chunked:64') == ('chunked', 64)


def test_compile_only_reports_fused_and_stacked_plans():
  records = benchmark.compile_only(['logreg'], [12], ['chunked:4', 'nofuse:chunked:4'],
                                   steps=1, batch=2, emit=lambda r: None)
  fused, stacked = records
  assert fused['fused'] and not stacked['fused']
  for r in records:
    assert r['peak_minus_arguments_bytes'] == r['temp_bytes'] + r['output_bytes']
  assert fused['argument_bytes'] == stacked['argument_bytes']


def test_streaming_round_record():
  records = []
  rec = benchmark.streaming_round('logreg', 10, 4, 1, 2, emit=records.append,
                                  compare_jit=True, repeats=1)
  assert records == [rec]
  assert rec['clients'] == 10 and rec['chunk_clients'] == 4
  assert rec['ratio_vs_jit'] > 0 and rec['peak_rss_bytes'] >= rec['rss_before_round_bytes'] > 0
  # 10 clients of 1 step of 2 examples of 60 float32 features, int32 labels,
  # a bool mask, a float32 weight and an int32 id.
  per_client = 2 * 60 * 4 + 2 * 4 + 2 + 4 + 4
  assert rec['data_bytes_of_cohort'] == 10 * per_client
  assert rec['data_bytes_per_chunk'] == 4 * per_client
