"""Hit rate of the hot tier and decode speed over time, per arm: how fast `--adapt-every` follows
the routing from a profile or from no profile at all.

    tools/device/adapt-trace --out DIR --prompt-file F [--windows N] [--steps 100] \\
        -- NAME=BIN ARGS... [--- NAME=BIN ARGS...]...

Each arm (a strata-server command line with `--metrics`; `env VAR=VALUE BIN` works) is started
alone. For window i the prompt is a slice of F (each window its own, cycling through the file):
one request evaluates it (n_predict 0), a second decodes STEPS tokens after it from the cached
prompt, and the `strata:expert_selections_total` counters read around that second request give
the hot tier's share of the window's decode selections. DIR/trace.json holds each arm's binary (sha256, --version line) and every window
(step, hit rate, decode t/s, swaps and the host's microseconds making them so far),
DIR/hit-rate.png plots hit rate and decode t/s against decode steps for all arms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from strata_tools import NotReady, free_port, post_json, provenance, split_arms, stop, strata_metrics, wait_healthy

TIERS = ("vram", "ram", "mmap")


def selections(m: dict[str, float]) -> dict[str, float]:
    return {t: m.get(f'strata:expert_selections_total{{tier="{t}"}}', 0.0) for t in TIERS}


def windows(text: str, n: int, chars: int) -> list[str]:
    """n prompts of `chars` characters, consecutive slices of text (wrapping around)."""
    if not text:
        raise SystemExit("adapt-trace: the prompt file is empty")
    doubled = text * (1 + (n * chars) // len(text) + 1)
    return [doubled[i * chars:(i + 1) * chars] for i in range(n)]


def run_arm(name: str, cmd: list[str], prompts: list[str], steps: int, out: Path) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out / f"{name}.log"
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    rows = []
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=f)
        try:
            try:
                wait_healthy(url, proc, poll=0.5)
            except NotReady as e:
                raise SystemExit(f"adapt-trace: {name} {e}; see {log}")
            done = 0
            for i, prompt in enumerate(prompts):
                post_json(url + "/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True})
                before = selections(strata_metrics(url))
                r = post_json(url + "/completion", {"prompt": prompt, "n_predict": steps, "cache_prompt": True, "temperature": 0,
                                                    "ignore_eos": True})
                m = strata_metrics(url)
                after = selections(m)
                d = {t: after[t] - before[t] for t in TIERS}
                total = sum(d.values())
                done += r["timings"]["predicted_n"]
                rows.append({"window": i, "steps": done, "hit_rate": d["vram"] / total if total else None,
                             "decode_tps": r["timings"]["predicted_per_second"], "prompt_cached": r["timings"].get("cache_n"),
                             "swaps_total": m.get("strata:expert_swaps_total"),
                             "swap_us_total": {p: m.get(f'strata:expert_swap_microseconds_total{{part="{p}"}}') for p in ("copies", "maps")},
                             "selections": d})
                hr = rows[-1]["hit_rate"]
                print(f"   {name} window {i}: {done} steps, hit rate {hr if hr is None else round(hr, 4)}, "
                      f"{rows[-1]['decode_tps']:.1f} t/s, swaps {rows[-1]['swaps_total']}", flush=True)
        finally:
            stop(proc)
    return rows


def plot(trace: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name, rows in trace["arms"].items():
        xs = [r["steps"] for r in rows]
        a.plot(xs, [r["hit_rate"] for r in rows], marker=".", label=name)
        b.plot(xs, [r["decode_tps"] for r in rows], marker=".", label=name)
    a.set_ylabel(f"hot-tier hit rate per {trace['steps']} steps")
    b.set_ylabel("decode tokens/s")
    b.set_xlabel("decode steps")
    a.set_title(f"Hot tier over time, {Path(trace['model']).name if trace.get('model') else ''}")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, arms_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--windows", type=int, default=20, help="windows per arm (default 20)")
    ap.add_argument("--steps", type=int, default=100, help="decode steps per window (default 100)")
    ap.add_argument("--prompt-chars", type=int, default=600, help="characters of each window's prompt (default 600)")
    ap.add_argument("--model", default="", help="model name for the plot's title")
    args = ap.parse_args(own)
    arms = split_arms(arms_argv, "adapt-trace")
    if not arms:
        ap.error("no arms: -- NAME=BIN ARGS [--- NAME=BIN ARGS]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = windows(Path(args.prompt_file).read_text(errors="replace"), args.windows, args.prompt_chars)
    trace = {"steps": args.steps, "windows": args.windows, "model": args.model, "commands": {n: c for n, c in arms},
             "binaries": {n: provenance.binary(provenance.command_binary(c)) for n, c in arms}, "arms": {}}
    for name, cmd in arms:
        trace["arms"][name] = run_arm(name, cmd, prompts, args.steps, out)
        (out / "trace.json").write_text(json.dumps(trace, indent=1))
    plot(trace, out / "hit-rate.png")
    for name, rows in trace["arms"].items():
        late = [r for r in rows[len(rows) // 2:] if r["hit_rate"] is not None]
        if late:
            hr = sum(r["hit_rate"] for r in late) / len(late)
            tps = sum(r["decode_tps"] for r in late) / len(late)
            print(f"{name}: second half hit rate {hr:.4f}, decode {tps:.1f} t/s")
    return 0
