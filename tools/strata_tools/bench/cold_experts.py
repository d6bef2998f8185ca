"""Decode speed of the cold-expert CPU kernels against llama.cpp's own CPU mul_mat_id, on one
machine, same model, same threads: one arm without expert tiers (every expert through ggml's
mul_mat_id on the CPU), one with tiers and an empty hot tier (`--expert-cache 0`: every selected
expert goes through Strata's kernels). Both run on the CPU, so the ratio is the kernels'
efficiency, not a placement gain.

    tools/bench/cold-experts --model M.gguf --out OUT.json [--server BIN] [-- server args]
"""
import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from strata_tools import REPO, NotReady, free_port, provenance, wait_healthy

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def arm(label: str, cmd: list[str], n_predict: int, reps: int, log: Path) -> dict:
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port), "--metrics"],
                                stdout=subprocess.DEVNULL, stderr=f)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(url, proc, timeout=600)
            except NotReady as e:
                raise SystemExit(f"cold-experts: {label} {e}; see {log}")
            body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
            rates = []
            for i in range(reps + 1):
                req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=3600) as r:
                    t = json.load(r)["timings"]
                if i > 0:
                    rates.append(t["predicted_per_second"])
            metrics = {}
            for line in get(url + "/metrics").decode().splitlines():
                if line.startswith("strata:expert_selections_total"):
                    metrics[line.split('"')[1]] = int(line.split()[-1])
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    rates.sort()
    res = {"label": label, "command": cmd, "decode_tps": rates, "median_decode_tps": rates[len(rates) // 2],
           "selections": metrics}
    print(f"{label}: decode t/s {', '.join(f'{r:.2f}' for r in rates)} (median {res['median_decode_tps']:.2f})"
          + (f"; selections {metrics}" if metrics else ""), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--server", default=str(REPO / "target/release/strata-server"))
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    base = [args.server, "-m", args.model, "-np", "1", "--no-repack"] + extra
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [arm("llama.cpp mul_mat_id", base, args.n_predict, args.reps, out.with_suffix(".a.log"))]
    runs.append(arm("strata cold kernels", base + ["--mmap-experts", "--expert-cache", "0"], args.n_predict,
                    args.reps, out.with_suffix(".b.log")))
    ratio = runs[1]["median_decode_tps"] / runs[0]["median_decode_tps"]
    print(f"ratio (strata cold kernels / llama.cpp mul_mat_id, median decode): {ratio:.3f}")
    out.write_text(json.dumps({"model": args.model, "binary": provenance.binary(args.server), "runs": runs, "ratio": ratio},
                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
