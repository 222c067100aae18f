#!/usr/bin/env bash
# The GPU benchmark of docs/benchmarks.md, in one run (about 10 minutes on one
# H200). Writes JSON lines, logs and plots to the folder given (default
# runs/gpu). Each part has its own time limit, so one slow part cannot starve
# the others; the most important parts run first.
#
#   bash scripts/benchmark_gpu.sh runs/gpu
#
# Needs jax with CUDA, flax and optax; installs fedjx itself without
# dependencies if it is not installed.
set -uo pipefail
out="${1:-runs/gpu}"
mkdir -p "$out"
python -c 'import fedjx.experiments' 2>/dev/null ||
  pip install --quiet --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
} >"$out/environment.txt" 2>&1

bench() {  # bench SECONDS NAME ARGS...: one part, its JSON lines in NAME.jsonl
  local seconds="$1" name="$2"
  shift 2
  echo "== $name: $*"
  timeout "$seconds" python scripts/benchmark.py --out="$out/$name.jsonl" "$@" \
    >"$out/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s in total"
}

cross() {  # cross SECONDS SCRIPT SETUP: one cross-device run (benchmarks/peers)
  local seconds="$1" script="$2" setup="$3"
  echo "== cross-device $script $setup"
  (cd benchmarks/peers && timeout "$seconds" python "$script" --setup="$setup" \
    --rounds=4) >>"$out/cross_device.jsonl" 2>>"$out/cross_device.log"
  echo "   exit $? after ${SECONDS}s in total"
}

# 0. The cross-device regime scaled up (2NN, 10,000 log-normal clients, one
#    epoch of batch 10): fedjx (population on the device, auto), the
#    hand-written JAX round, and the PyTorch loop where torch is installed.
cross 45 fedjx_cross_device.py 2nn-10000
cross 35 handwritten_cross_device.py 2nn-10000
cross 30 fedjx_cross_device.py 2nn-1000
if python -c 'import torch' 2>/dev/null; then
  cross 40 torch_cross_device.py 2nn-1000
fi

# EMNIST CNN, 8 local SGD steps of batch 20 per client (the setting of the
# measurements the project started from). With the cross-device part above,
# time limits sum to 9.3 minutes.
cnn=(--steps=8 --batch=20 --repeats=3)
# 1. The headline: 1024 clients against the centralized reference, float32,
#    with patch convolutions (the default) and with XLA's.
bench 110 cnn_1024_f32 --models=cnn --clients=1024 \
  --strategies=vmap,chunked:64,chunked:256,auto "${cnn[@]}"
bench 50 cnn_xla_1024_f32 --models=cnn_xla --clients=1024 \
  --strategies=chunked:64 "${cnn[@]}"
# 2. The same in bfloat16 with float32 master weights.
bench 40 cnn_1024_bf16 --models=cnn --clients=1024 --precision=bfloat16 \
  --strategies=chunked:64,auto "${cnn[@]}"
# 3. 10,000 clients on one card: XLA's memory plan with the reductions fused
#    into the loop over chunks (the default) and with the client updates
#    stacked (nofuse:), then the fused round timed.
bench 35 cnn_10000_plan --compile_only --models=cnn --clients=1024,10000 \
  --strategies=chunked:64,nofuse:chunked:64,auto --steps=8 --batch=20
bench 45 cnn_10000_fused --models=cnn --clients=10000 --strategies=chunked:64 \
  --no_references --steps=8 --batch=20 --repeats=1
# 4. 100,000 clients streamed from the host in chunks of 256
#    (fedjx.streaming): time and peak memory; then streaming against the
#    compiled round at 1024 clients, interleaved.
bench 55 cnn_100000_streaming --streaming=256 --models=cnn --clients=100000 \
  --steps=8 --batch=20
bench 35 cnn_1024_streaming_vs_jit --streaming=64 --models=cnn --clients=1024 \
  --compare_jit --steps=8 --batch=20 --repeats=3
# 5. A cohort sweep, for the plot and the auto rule.
bench 35 cnn_sweep --models=cnn --clients=16,128,4096 \
  --strategies=vmap,chunked:64,auto "${cnn[@]}" --plot="$out/cnn_sweep.png"
echo "done in ${SECONDS}s; results in $out"
