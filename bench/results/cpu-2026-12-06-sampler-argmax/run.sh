#!/usr/bin/env bash
# Greedy decode on this machine's CPU with the sampler chain (STRATA_SAMPLER_ARGMAX=0) and with
# the scan of the logits (the default): the sampler's time per token from STRATA_STEP_TRACE and
# decode t/s, three rounds in alternating order, on tools/setup's tiny Qwen3-MoE (151,936 tokens).
# Writes results.txt (one line per server run) and answers-*.json (whose equality is checked).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/cpu-2026-12-06-sampler-argmax
m=.cache/models/tiny-qwen3moe.gguf
port=8097
: > $out/results.txt
run() {  # $1: STRATA_SAMPLER_ARGMAX, $2: round
    local trace=$out/trace-$1-$2.jsonl
    rm -f "$trace"
    STRATA_SAMPLER_ARGMAX=$1 STRATA_STEP_TRACE=$trace target/release/strata-server -m $m -c 4096 -np 1 \
        --host 127.0.0.1 --port $port > /dev/null 2>&1 &
    local pid=$!
    until curl -sf localhost:$port/health > /dev/null; do sleep 0.2; done
    local tps=()
    for p in "Once upon a time" "The capital of France is" "def fibonacci(n):" "1, 2, 3,"; do
        tps+=("$(curl -s localhost:$port/completion -d "{\"prompt\":\"$p\",\"n_predict\":256,\"temperature\":0,\"top_k\":1,\"ignore_eos\":true,\"cache_prompt\":false}" |
            tee -a $out/answers-$1-$2.json | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["timings"]["predicted_per_second"], 1))')")
    done
    kill $pid; wait $pid 2> /dev/null || true
    python3 - "$1" "$2" "$trace" "${tps[@]}" >> $out/results.txt <<'PY'
import json, sys
argmax, rnd, trace, tps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
lines = [json.loads(l) for l in open(trace)]
sample = [l["sample_us"]["median"] for l in lines]
print(f"STRATA_SAMPLER_ARGMAX={argmax} round {rnd}: sampler us/token (median per 256 steps) {sample}, decode t/s {', '.join(tps)}")
PY
    rm -f "$trace"
}
for r in 1 2 3; do
    if [ $((r % 2)) = 1 ]; then run 0 $r; run 1 $r; else run 1 $r; run 0 $r; fi
done
for r in 1 2 3; do
    python3 - $out/answers-0-$r.json $out/answers-1-$r.json <<'PY'
import json, sys
def tokens(path):
    dec = json.JSONDecoder(); text = open(path).read(); i = 0; out = []
    while i < len(text):
        v, i = dec.raw_decode(text, i); out.append(v["content"])
    return out
assert tokens(sys.argv[1]) == tokens(sys.argv[2]), "the scan answered differently"
PY
done
echo "answers equal in every round" >> $out/results.txt
rm -f $out/answers-*.json
cat $out/results.txt
