"""Decode speed of several server arms on one prompt, to attribute a decode gap by switching one
thing per arm (CUDA graphs off with GGML_CUDA_DISABLE_GRAPHS=1, ggml's op fusion off with
GGML_CUDA_DISABLE_FUSION=1, another cold-decode mechanism, no ring windows ...). Each arm is one
server command line (llama-server or strata-server; `env X=Y CMD` sets variables); it is
started, answers a short warm-up request, then --runs requests of the same prompt (no prompt
cache) that each generate --predict tokens, greedy, ignoring end of text.

    tools/bench/decodediag --out DIR --prompt-file F [--prompt-tokens 512] [--predict 256] [--runs 2]
                            -- NAME=CMD... --- NAME=CMD...
    tools/bench/decodediag --summary DIR

Writes DIR/arms.json, DIR/NAME.json (timings of every run, and the binary's sha256 and --version line), DIR/NAME.log and DIR/summary.txt:
per arm the decode t/s of each run, the median, the ratio of the median to the first arm's and
the server's "graphs reused" count after the last run. strata-server arms also write
DIR/NAME.steps.jsonl (STRATA_STEP_TRACE, which upstream ignores): the host's time around their
decode steps, whose medians of the last line the summary adds (the llama_decode call, the wait
for the device, the host's time between steps and the sampler's and the expert tiers' shares
of it).
"""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from strata_tools import NotReady, free_port, post_json, provenance, split_arms, stop, wait_healthy
from strata_tools.bench import decodediag_arms

REUSED = re.compile(r"graphs reused =\s*(\d+)")


def parse_arms(args: list[str]) -> dict[str, list[str]]:
    """NAME=CMD ARGS... --- NAME=CMD ARGS... into {NAME: [CMD, ARGS...]}."""
    arms: dict[str, list[str]] = {}
    for name, cmd in split_arms(args, "decodediag"):
        if name in arms:
            raise SystemExit(f"decodediag: arm {name} given twice")
        arms[name] = cmd
    if not arms:
        raise SystemExit("decodediag: no arms")
    return arms


def run_arm(name: str, cmd: list[str], text: str, a: argparse.Namespace) -> dict:
    port = free_port()
    log_path = a.out / f"{name}.log"
    with open(log_path, "wb") as log:
        env = os.environ | {"STRATA_STEP_TRACE": str(a.out / f"{name}.steps.jsonl")}
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, poll=0.5)
            tokens = post_json(url + "/tokenize", {"content": text})["tokens"]
            prompt = (tokens * (a.prompt_tokens // max(len(tokens), 1) + 1))[:a.prompt_tokens]
            body = {"prompt": prompt, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
            post_json(url + "/completion", body | {"prompt": prompt[:32], "n_predict": 16})
            runs = []
            for _ in range(a.runs):
                t = post_json(url + "/completion", body | {"n_predict": a.predict})["timings"]
                runs.append({"prompt_n": t["prompt_n"], "predicted_n": t["predicted_n"],
                             "prompt_per_second": t["prompt_per_second"], "predicted_per_second": t["predicted_per_second"]})
        except NotReady as e:
            raise SystemExit(f"decodediag: {name}: {e}; see {log_path}")
        finally:
            stop(proc)
    reused = REUSED.findall(log_path.read_text(errors="replace"))
    return {"command": cmd, "binary": provenance.binary(provenance.command_binary(cmd)), "runs": runs,
            "graphs_reused": int(reused[-1]) if reused else None}


def summary(out: Path) -> str:
    arms = decodediag_arms(out)
    rows = [f"{'arm':<20} {'decode t/s per run':<24} {'median':>8} {'vs first':>9} {'graphs reused':>14}"]
    for a in arms:
        if "error" in a:
            rows.append(f"{a['arm']:<20} (no result)")
            continue
        runs = "/".join(f"{x:.1f}" for x in a["decode_tps"])
        reused = "-" if a["graphs_reused"] is None else str(a["graphs_reused"])
        rows.append(f"{a['arm']:<20} {runs:<24} {a['median']:>8.1f} {a['vs_first']:>8.3f}x {reused:>14}")
    traced = [(a["arm"], a["step_us"]) for a in arms if a["step_us"]]
    if traced:
        rows.append("")
        rows.append(f"{'host time, median us':<20} {'call':>8} {'wait':>8} {'between':>8} {'sampler':>8} {'tiers':>8}  (last {traced[0][1]['steps']} steps)")
        for name, t in traced:
            med = [float("nan") if t[k] is None else t[k] for k in ("call", "wait", "between", "sampler", "tiers")]
            rows.append(f"{name:<20} " + " ".join(f"{x:>8.1f}" for x in med))
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prompt-file", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--predict", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--summary", type=Path)
    ap.add_argument("arms", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.summary:
        sys.stdout.write(summary(a.summary))
        return
    if a.out is None or a.prompt_file is None:
        ap.error("--out and --prompt-file are required")
    arms = parse_arms(a.arms[1:] if a.arms[:1] == ["--"] else a.arms)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "arms.json").write_text(json.dumps(arms, indent=1))
    text = a.prompt_file.read_text()
    for name, cmd in arms.items():
        (a.out / f"{name}.json").write_text(json.dumps(run_arm(name, cmd, text, a), indent=1))
        print(f"decodediag: {name} done", flush=True)
    text = summary(a.out)
    (a.out / "summary.txt").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
