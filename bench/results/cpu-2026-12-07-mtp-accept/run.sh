#!/usr/bin/env bash
# MTP acceptance of tools/mkmodel.py --mtp-accept P on the CPU: for each P a qwen4exp of width 256,
# served by strata-server with 4-token MTP drafts at p-min 0.5, 128 greedy tokens.
#   usage: bench/results/cpu-2026-12-07-mtp-accept/run.sh > result.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
t=$(mktemp -d)
for p in 0 0.5 0.9 1; do
    .venv/bin/python tools/mkmodel.py qwen4exp --seed 10 --embd 256 --expert-ffn 256 --mtp-accept "$p" --out "$t/m.gguf" > /dev/null
    target/release/strata-server -m "$t/m.gguf" -c 4096 -np 1 --spec 4 --spec-min-p 0.5 --port 18571 > "$t/log" 2>&1 &
    pid=$!
    until curl -sf localhost:18571/health > /dev/null; do sleep 0.5; done
    r=$(curl -s localhost:18571/completion -d '{"prompt": "The tide came in over the rocks", "n_predict": 128, "temperature": 0, "cache_prompt": false}')
    kill $pid; wait $pid 2> /dev/null || true
    echo "$r" | .venv/bin/python -c "import json,sys; t=json.load(sys.stdin)['timings']; n,a,d=t['predicted_n'],t.get('draft_n_accepted',0),t.get('draft_n',0); print(f'P={sys.argv[1]}: {n} tokens, drafted {d}, accepted {a}, tokens per verify step {n/(n-a):.2f}')" "$p"
done
rm -rf "$t"
