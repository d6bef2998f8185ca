#!/usr/bin/env bash
# The compute buffer of the tiny qwen4exp (the 80B's QSA indexer shape) at a 262,144-token context,
# by batch size, as llama.cpp reports it at start-up.
#   usage: bench/results/h100-2026-12-07d-seed/cpu-compute-buffer.sh > cpu-compute-buffer.txt
set -uo pipefail
cd "$(dirname "$0")/../../.."
for ub in 512 2048 8192; do
    log=$(mktemp)
    target/release/strata-server -m .cache/models/tiny-qwen4exp.gguf -c 262144 -np 1 -b "$ub" -ub "$ub" \
        -ctk q8_0 -ctv q8_0 --port 18572 -lv 4 > "$log" 2>&1 &
    pid=$!
    until grep -q "listening on" "$log"; do sleep 0.5; done
    kill $pid; wait $pid 2> /dev/null
    echo "-ub $ub: $(grep -o 'CPU compute buffer size = *[0-9.]* MiB' "$log")"
    rm -f "$log"
done
