#!/usr/bin/env bash
# Creates one virtualenv per peer framework, outside the repository:
#   $FEDJX_PEERS_DIR/{pfl,flower,fedjax,fedjx}  (default ~/.cache/fedjx-peers)
# Usage: bash benchmarks/peers/setup.sh [pfl flower fedjax fedjx]
# FEDJX_PEERS_PYTHON picks the interpreter (default python3.11: jaxlib 0.4.13
# has no wheels past 3.11). TORCH_INDEX_URL, if set, is where torch comes from
# (for example the CPU-only wheel index).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
root="${FEDJX_PEERS_DIR:-$HOME/.cache/fedjx-peers}"
py="${FEDJX_PEERS_PYTHON:-python3.11}"
envs=("$@")
[ ${#envs[@]} -eq 0 ] && envs=(pfl flower fedjax fedjx)
mkdir -p "$root"
for name in "${envs[@]}"; do
  venv="$root/$name"
  echo "== $name -> $venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  case "$name" in
    pfl|flower)
      if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "$venv/bin/pip" install -q torch --index-url "$TORCH_INDEX_URL"
      fi
      "$venv/bin/pip" install -q -r "$here/requirements-$name.txt" ;;
    fedjax)
      "$venv/bin/pip" install -q -r "$here/requirements-fedjax.txt" ;;
    fedjx)
      "$venv/bin/pip" install -q "$repo" ;;
    *) echo "unknown environment: $name (allowed: pfl flower fedjax fedjx)" >&2; exit 2 ;;
  esac
  "$venv/bin/pip" freeze > "$venv/freeze.txt"
done
echo "done: $root"
