#!/usr/bin/env bash
# The accelerator benchmark of docs/benchmarks.md, in one run of under 10
# minutes on one GPU or TPU chip: whatever accelerator JAX sees (MFU against
# lm_cost.PEAK_BF16_FLOPS, the device found from its kind). Writes JSON lines
# and logs to the folder given (default runs/accelerator). Each part has its
# own time limit, so one slow part cannot starve the others; the most
# important parts run first.
#
#   bash scripts/benchmark_accelerator.sh runs/accelerator
#   bash scripts/benchmark_accelerator.sh runs/accelerator cnn lora
#   bash scripts/benchmark_accelerator.sh runs/accelerator chunks
#   bash scripts/benchmark_accelerator.sh runs/cpu chunks --small
#
# The names after the folder pick parts (lm, diloco, cross, cnn, lora; all
# by default; chunks only when named). On a TPU each limit is doubled: a
# freshly started TPU machine spends longer starting and compiling each
# part's process, so there the parts run in calls of under 10 minutes each
# (lm diloco; cross; cnn lora). The chunks part (cross-device rounds in
# vmapped chunks: the hand-written floor at several widths, fedjx's auto,
# 100,000 clients) has limits of its own that sum to 9 minutes and fits one
# call; --small runs it with small setups on any backend, the CPU too (a
# check that every command runs).
#
# Needs jax for the accelerator, flax and optax; installs fedjx itself
# without dependencies if it is not installed (or lays it out by links where
# pip cannot). Stops in one line where JAX sees no accelerator.
set -uo pipefail
out="${1:-runs/accelerator}"
shift $(($# > 0 ? 1 : 0))
small=false
names=()
for a in "$@"; do
  if [ "$a" = --small ]; then small=true; else names+=("$a"); fi
done
parts=" ${names[*]:-lm diloco cross cnn lora} "
for p in $parts; do
  case "$p" in lm|diloco|cross|cnn|lora|chunks) ;;
    *) echo "benchmark_accelerator: part '$p' is not one of lm, diloco, cross, cnn, lora, chunks." >&2; exit 2 ;;
  esac
done
wanted() { [[ "$parts" == *" $1 "* ]]; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
root="$PWD"
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
  command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c 'import jax, flax, optax; d = jax.devices()[0]; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices(), d.device_kind, (d.memory_stats() or {}).get("bytes_limit"))'
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"
backend="$(python -c 'import jax; print(jax.default_backend())' 2>/dev/null)"
if ! $small && [ "$backend" != gpu ] && [ "$backend" != tpu ]; then
  echo "benchmark_accelerator: JAX's backend is '$backend', not gpu or tpu; nothing run." >&2
  exit 2
fi

scale=1
[ "$backend" = tpu ] && scale=2
part() {  # part SECONDS NAME COMMAND...: one part, its output in NAME.log
  local seconds=$(($1 * scale)) name="$2"
  shift 2
  echo "== $name: $*"
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s in total"
}
cross() {  # cross SECONDS SCRIPT SETUP: one cross-device run (benchmarks/peers)
  local seconds=$(($1 * scale)) script="$2" setup="$3"
  echo "== cross-device $script $setup"
  (cd benchmarks/peers && timeout "$seconds" python "$script" --setup="$setup" \
    --rounds=4) >>"$out/cross_device.jsonl" 2>>"$out/cross_device.log"
  echo "   exit $? after ${SECONDS}s in total"
}
lm=(python scripts/benchmark_lm.py --out="$out/lm.jsonl" --device=auto --dtype=bfloat16
    --seq_len=2048)
cnn=(--steps=8 --batch=20 --repeats=3)

memory="$(python -c 'import jax; print((jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0))' 2>/dev/null)"
big=false
[ "${memory:-0}" -gt 40000000000 ] && big=true

# Time limits (before the TPU's doubling) sum to 9.2 minutes: compiling and
# building the synthetic cohorts takes most of each part's time.
if wanted lm; then
  # 1. Language-model inner steps (AdamW, bfloat16 compute over float32
  #    parameters, sequences of 2048 tokens): tokens/s, MFU against the
  #    device's bfloat16 dense peak, and memory, each preset at its best
  #    batch for the device's memory, fedjx's step (attention kernel, remat
  #    policy and loss chunks 'auto') and, interleaved, the hand-written
  #    step of the same shapes, kernel and policy
  #    (benchmarks/handwritten_lm.py). 1.3B keeps its parameters and AdamW
  #    moments in bfloat16 where float32 ones do not fit (21 GB).
  if $big; then
    part 60 lm_35m "${lm[@]}" --handwritten --batch=16 --presets=35m,180m
    part 110 lm_large "${lm[@]}" --handwritten --batch=8 --presets=550m,1.3b
  else
    part 45 lm_35m "${lm[@]}" --handwritten --batch=8 --presets=35m
    part 90 lm_180m_550m "${lm[@]}" --handwritten --batch=4 --presets=180m,550m
    part 45 lm_1.3b "${lm[@]}" --batch=4 --presets=1.3b --param_dtype=bfloat16
  fi
fi
if wanted diloco; then
  # 2. DiLoCo through fedjx-run (configs/diloco_study.py's one-chip
  #    presets: 35M with M = 4 and M = 8 replicas, 180M with M = 4; 30
  #    inner steps per replica per round, the global batch of 32 sequences
  #    of 2048 bytes split over the replicas), two rounds each; the second
  #    round's tokens_per_s and mfu rows are compared with the inner step
  #    of the same shape (the corpus's byte vocabulary) measured alone.
  for spec in 4,35m 8,35m 4,180m; do
    echo "== diloco $spec"
    (cd / && timeout $((100 * scale)) python -m fedjx.experiments.cli \
      --config="$root/configs/diloco_study.py:$spec,0.01" --workdir="$out/diloco_${spec/,/_}" \
      --config.rounds=2 --config.eval_every=2 --config.progress=False) >>"$out/diloco.log" 2>&1
    echo "   exit $? after ${SECONDS}s in total"
  done
  part 60 lm_diloco_35m "${lm[@]}" --presets=35m --vocab_size=256 --batch=8
  part 30 lm_diloco_35m_b4 "${lm[@]}" --presets=35m --vocab_size=256 --batch=4
  part 40 lm_diloco_180m "${lm[@]}" --presets=180m --vocab_size=256 --batch=8
fi
if wanted cross; then
  # 2. The cross-device regime (2NN, log-normal clients, one epoch of batch
  #    10): fedjx (population on the device, auto) and the hand-written JAX
  #    round, at 1,000 and 10,000 clients.
  cross 35 fedjx_cross_device.py 2nn-1000
  cross 25 handwritten_cross_device.py 2nn-1000
  cross 70 fedjx_cross_device.py 2nn-10000
  cross 60 handwritten_cross_device.py 2nn-10000
fi
if wanted chunks; then
  # 5. Cross-device rounds at the accelerator's speed (2NN, log-normal
  #    clients, one epoch of batch 10), each run in its own process with its
  #    own limit (not doubled), one JSON line each in chunks.jsonl: the
  #    hand-written floor in vmapped chunks of clients sorted by step count
  #    at several widths, the sequential hand-written floor, and fedjx's
  #    auto (sorted chunks from its cost model) at 1,000 and 10,000
  #    clients, then fedjx's round of 100,000 clients (8.6 GB of examples on
  #    the device). The JSON lines carry seconds per round, the time to the
  #    first round, computed / real steps, the chunk width and the device's
  #    peak bytes in use.
  chunk() {  # chunk SECONDS SCRIPT SETUP [ARGS...]
    local seconds="$1" script="$2" setup="$3"
    shift 3
    echo "== chunks $script $setup $*"
    (cd benchmarks/peers && timeout "$seconds" python "$script" --setup="$setup" \
      "$@") >>"$out/chunks.jsonl" 2>>"$out/chunks.log"
    echo "   exit $? after ${SECONDS}s in total"
  }
  if $small; then
    set1=2nn-100 set2=2nn-1000 set3=2nn-1000 widths="4 8 16 32" wide="8 16"
  else
    set1=2nn-1000 set2=2nn-10000 set3=2nn-100000 widths="20 40 80 200" wide="40 80"
  fi
  for w in $widths; do
    chunk 35 handwritten_chunks_cross_device.py "$set1" --rounds=4 --width="$w"
  done
  chunk 40 fedjx_cross_device.py "$set1" --rounds=4
  chunk 30 handwritten_cross_device.py "$set1" --rounds=4
  for w in $wide; do
    chunk 50 handwritten_chunks_cross_device.py "$set2" --rounds=4 --width="$w"
  done
  chunk 60 fedjx_cross_device.py "$set2" --rounds=4
  chunk 150 fedjx_cross_device.py "$set3" --rounds=3
fi
if wanted cnn; then
  # 3. CNN clients against the same FLOPs as one centralized batch, then in
  #    bfloat16 with float32 master weights (under `auto`): 1024 clients
  #    where the device holds the centralized batch of 163,840 images (over
  #    40 GB), else 128.
  clients=128
  $big && clients=1024
  part 80 cnn_f32 python scripts/benchmark.py --out="$out/cnn_f32.jsonl" \
    --models=cnn --clients="$clients" --strategies=vmap,chunked:64,auto "${cnn[@]}"
  part 40 cnn_bf16 python scripts/benchmark.py --out="$out/cnn_bf16.jsonl" \
    --models=cnn --clients="$clients" --precision=bfloat16 --strategies=auto "${cnn[@]}"
fi
if wanted lora; then
  # 4. Federated LoRA at the TinyLlama-1.1B shape (FlowerTune's: 2 clients
  #    of 10 AdamW steps, rank 32 on q and v; batch 4 of 512 tokens,
  #    bfloat16 compute and base): tokens/s, compile time and peak memory.
  part 80 lora_1.1b python scripts/benchmark_lora.py --shape=tinyllama-1.1b \
    --dtype=bfloat16 --base_dtype=bfloat16 --seq_len=512 --out="$out/lora_1.1b.jsonl"
fi
# Measured on one H200 on 2026-12-04 and not in the limits above: 100,000
# clients streamed (`python scripts/benchmark.py --streaming=256 --models=cnn
# --clients=100000 --steps=8 --batch=20`), XLA's memory plan at 10,000
# clients (`--compile_only --clients=10000 --strategies=chunked:64,nofuse:chunked:64`)
# and the cohort sweep (`--clients=16,128,1024 --strategies=vmap,chunked:64`).
echo "done in ${SECONDS}s; results in $out"
