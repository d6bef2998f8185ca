#!/usr/bin/env bash
# Replays --adapt-every with the old and the new policy on two recorded profiles, two hot-tier
# sizes and three starts; writes sim.txt (summaries) and curves.txt (per 100 steps).
set -euo pipefail
cd "$(dirname "$0")/../../.."
cargo build -q --release -p strata-residency --example adapt_sim
S=target/release/examples/adapt_sim
out=bench/results/adapt-sim-2026-12-05
old="--decay 0.75 --hysteresis 0.5 --margin 2 --max-swaps 64 --z 0 --per-batch 4"
new="--per-batch 8"
: > $out/sim.txt
: > $out/curves.txt
for prof in bench/results/h100-2026-12-05d-table/call3-skew03-rows03/profile-skew0.3.json \
            bench/results/cpu-2026-12-03/profile-80b-a3b-skew0.7.json; do
    for hf in 0.646 0.3; do
        for pol in old new; do
            for st in even stale profile; do
                args=${!pol}
                r=$($S --profile "$prof" --start $st --hot-frac $hf $args)
                echo "$(basename "$prof") hot $hf policy $pol start $st: $(echo "$r" | tail -1)" >> $out/sim.txt
                if [ $hf = 0.646 ] && [[ $prof == *skew0.3* ]]; then
                    echo "== $(basename "$prof") hot $hf policy $pol start $st" >> $out/curves.txt
                    echo "$r" >> $out/curves.txt
                fi
            done
        done
    done
done
