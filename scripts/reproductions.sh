#!/usr/bin/env bash
# Runs the sweeps behind docs/reproductions.md; each writes summary.md in its
# own directory under OUT (default runs/reproductions).
#   bash scripts/reproductions.sh [OUT] [NAME ...]     (NAME: fedopt fedprox scaffold)
set -euo pipefail
OUT=${1:-runs/reproductions}
shift || true
WHICH=${*:-fedopt fedprox scaffold}
SEEDS=0,1,2
COMMON=(--config.tensorboard=False --config.progress=False)
CLIENT_LR='algorithm.client_optimizer.learning_rate=0.03,0.1,0.3'

run() { echo "== $*" >&2; fedjx-sweep "$@" "${COMMON[@]}"; }

for name in $WHICH; do
  case $name in
  fedopt)  # Reddi et al. 2021 on digits: rounds to 90% test accuracy.
    FEDOPT=(--seeds $SEEDS --target eval_accuracy=0.9 --config.rounds=150
            --config.eval_every=1 --sweep "$CLIENT_LR")
    run --config configs/fedavg_digits.py --workdir "$OUT/fedopt_fedavg" "${FEDOPT[@]}" \
        --sweep 'algorithm.server_optimizer.learning_rate=0.3,1.0,2.0,3.0,5.0,10.0'
    run --config configs/fedavgm_digits.py --workdir "$OUT/fedopt_fedavgm" "${FEDOPT[@]}" \
        --sweep 'algorithm.server_learning_rate=0.03,0.1,0.3,1.0,3.0'
    for algo in fedadam fedyogi; do
      run --config configs/${algo}_digits.py --workdir "$OUT/fedopt_$algo" "${FEDOPT[@]}" \
          --sweep 'algorithm.server_learning_rate=0.001,0.003,0.01,0.03,0.1,0.3,1.0'
    done ;;
  fedprox)  # Li et al. 2020: mu at the config's local work and at 5x the local steps.
    PROX=(--seeds $SEEDS --config.eval_every=10
          --sweep 'algorithm.mu=0.0,0.001,0.01,0.1,1.0')
    run --config configs/fedprox_synthetic.py --workdir "$OUT/fedprox_e20" "${PROX[@]}"
    run --config configs/fedprox_synthetic.py --workdir "$OUT/fedprox_e100" "${PROX[@]}" \
        --config.local_epochs=100 --config.max_local_steps=1280 ;;
  scaffold)  # Karimireddy et al. 2020: SCAFFOLD against FedAvg on Synthetic(1, 1).
    run --config configs/scaffold_synthetic.py --workdir "$OUT/scaffold" --seeds $SEEDS \
        --config.eval_every=10
    run --config configs/fedprox_synthetic.py --workdir "$OUT/scaffold_fedavg" --seeds $SEEDS \
        --config.eval_every=10 --sweep 'algorithm.mu=0.0' ;;
  *) echo "unknown reproduction $name" >&2; exit 2 ;;
  esac
done
