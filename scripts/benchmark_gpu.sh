#!/usr/bin/env bash
# The GPU benchmark of docs/benchmarks.md, in one run (about 10 minutes on one
# H200). Writes JSON lines, logs and plots to the folder given (default
# runs/gpu). Each part has its own time limit, so one slow part cannot starve
# the others; the most important parts run first.
#
#   bash scripts/benchmark_gpu.sh runs/gpu
#
# Needs jax with CUDA, flax and optax; installs fedjx itself without
# dependencies if it is not installed (or lays it out by links where pip
# cannot).
set -uo pipefail
out="${1:-runs/gpu}"
mkdir -p "$out"
importable() {  # from outside the checkout, whose fedjx/ lacks the subpackages
  (cd / && python -c 'import fedjx.experiments, fedjx.algorithms' 2>/dev/null)
}
importable ||
  python -m pip install --quiet --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1
if ! importable; then  # no pip for this python: the package laid out by links
  tree="$(mktemp -d)"
  mkdir "$tree/fedjx"
  cp -r fedjx/. "$tree/fedjx/"
  for sub in algorithms datasets models experiments; do
    ln -s "$PWD/$sub" "$tree/fedjx/$sub"
  done
  export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
fi
importable || { echo "fedjx is not importable; see $out/install.log" >&2; exit 1; }
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

# Only parts not yet measured on a GPU run (docs/benchmarks.md, "GPU"), the
# most important first. Time limits sum to 9.1 minutes: compiling and building
# the synthetic cohorts takes most of each part's time.
cnn=(--steps=8 --batch=20 --repeats=3)
# 1. 100,000 clients streamed from the host in chunks of 256
#    (fedjx.streaming): time and peak memory; then streaming against the
#    compiled round at 1024 clients, interleaved.
bench 60 cnn_100000_streaming --streaming=256 --models=cnn --clients=100000 \
  --steps=8 --batch=20
bench 40 cnn_1024_streaming_vs_jit --streaming=64 --models=cnn --clients=1024 \
  --compare_jit --steps=8 --batch=20 --repeats=3
# 2. 10,000 clients on one card: XLA's memory plan with the reductions fused
#    into the loop over chunks (the default) and with the client updates
#    stacked (nofuse:), then the fused round timed.
bench 40 cnn_10000_plan --compile_only --models=cnn --clients=10000 \
  --strategies=chunked:64,nofuse:chunked:64 --steps=8 --batch=20
bench 45 cnn_10000_fused --models=cnn --clients=10000 --strategies=chunked:64 \
  --no_references --steps=8 --batch=20 --repeats=1
# 3. The cross-device regime scaled up (2NN, 10,000 log-normal clients, one
#    epoch of batch 10): fedjx (population on the device, auto) and the
#    hand-written JAX round.
cross 60 fedjx_cross_device.py 2nn-10000
cross 45 handwritten_cross_device.py 2nn-10000
# 4. 1024 CNN clients with XLA's convolutions, and in bfloat16 with float32
#    master weights.
bench 45 cnn_xla_1024_f32 --models=cnn_xla --clients=1024 \
  --strategies=chunked:64 "${cnn[@]}"
bench 45 cnn_1024_bf16 --models=cnn --clients=1024 --precision=bfloat16 \
  --strategies=chunked:64 "${cnn[@]}"
# 5. Language-model inner steps (AdamW, bfloat16 compute over float32
#    parameters, batch 8 of 2048 tokens): tokens/s, MFU against the H200's
#    bfloat16 dense peak, and memory, for the presets that fit one card.
lm() {  # lm SECONDS NAME ARGS...: scripts/benchmark_lm.py, JSON lines in NAME.jsonl
  local seconds="$1" name="$2"
  shift 2
  echo "== $name: $*"
  timeout "$seconds" python scripts/benchmark_lm.py --out="$out/$name.jsonl" \
    --device=h200 --dtype=bfloat16 --batch=8 --seq_len=2048 "$@" \
    >"$out/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s in total"
}
lm 50 lm_small --presets=35m,180m
lm 55 lm_large --presets=550m,1.3b --remat=full
# 6. Federated LoRA at the TinyLlama-1.1B shape (FlowerTune's: 2 clients of
#    10 AdamW steps, rank 32 on q and v; batch 4 of 512 tokens, bfloat16
#    compute and base): tokens/s, compile time and peak memory.
echo "== lora_1.1b"
timeout 60 python scripts/benchmark_lora.py --shape=tinyllama-1.1b --dtype=bfloat16 \
  --base_dtype=bfloat16 --seq_len=512 --out="$out/lora_1.1b.jsonl" \
  >"$out/lora_1.1b.log" 2>&1
echo "   exit $? after ${SECONDS}s in total"
# Measured on 2026-12-04, not rerun here: 1024 CNN clients against the
# centralized reference in float32 (`bench 110 cnn_1024_f32 --models=cnn
# --clients=1024 --strategies=vmap,chunked:64,chunked:256,auto`), the 2NN on
# 1000 clients against the PyTorch loop (`cross 30 fedjx_cross_device.py
# 2nn-1000`, `cross 40 torch_cross_device.py 2nn-1000`), and, cut for time,
# the cohort sweep (`bench 40 cnn_sweep --models=cnn --clients=16,128,1024
# --strategies=vmap,chunked:64 --plot="$out/cnn_sweep.png"`).
echo "done in ${SECONDS}s; results in $out"
