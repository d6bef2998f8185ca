"""The kernels of one decode step, timed one by one with Nsight Compute (ncu), for each of several
server arms: where a tiered step's GPU time goes against upstream's all-GPU one. Each arm is one
server command line (`env X=Y CMD` sets variables); it runs under `ncu --clock-control none
--metrics gpu__time_duration.sum` with CUDA graphs off (GGML_CUDA_DISABLE_GRAPHS=1, so every
kernel is its own launch; a kernel's duration does not depend on how it was launched), answers one
request of --prompt-tokens tokens that generates --predict tokens, and stops. Decode steps are
found from the end of the kernel log: the longest run of identical kernel sequences (the graph is
reused every step), the first steps after the prompt left out. The server runs with --metrics;
strata-server's selections of the last decode step by tier (the step of NAME.step.tsv) are kept,
so a tiered step's cold reads can be divided by its cold selections.

    tools/device/kprof --out DIR --prompt-file F [--prompt-tokens 64] [--predict 12] [--ncu ncu]
                       -- NAME=CMD... --- NAME=CMD...
    tools/device/kprof --summary DIR

Writes DIR/NAME.ncu.csv (ncu's log), DIR/NAME.json (per step: kernels, their summed GPU time, and
per kernel name its launches and time), DIR/NAME.step.tsv (the last step's kernels in launch order)
and DIR/summary.txt: per arm the kernels and GPU time of a
step and the last step's selections by tier, then per kernel name the time a step spends in it in
each arm.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from strata_tools import NotReady, free_port, post_json, provenance, split_arms, stop, strata_metrics, wait_healthy

METRIC = "gpu__time_duration.sum"
UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def short_name(name: str) -> str:
    """A demangled kernel name without its parameter list (template arguments kept)."""
    depth = 0
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and i > 0:
            return name[:i].removeprefix("void ").strip()
    return name.removeprefix("void ").strip()


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels in launch order from ncu's CSV (details page: one row per metric; raw page: one row
    per kernel): name, grid, block and GPU time in microseconds."""
    lines = [l for l in text.splitlines() if l.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    out: dict[str, dict] = {}
    for r in rows:
        if r.get("Metric Name") == METRIC:
            value, unit = r["Metric Value"], r.get("Metric Unit", "ns")
        elif METRIC in r:
            value, unit = r[METRIC], "ns"
        else:
            continue
        try:
            us = float(value.replace(",", "")) * UNITS.get(unit.strip(), 1e-3)
        except ValueError:
            continue
        out[r["ID"]] = {"name": short_name(r["Kernel Name"]), "grid": r.get("Grid Size", ""), "block": r.get("Block Size", ""), "us": us}
    return [out[k] for k in sorted(out, key=int)]


def decode_steps(kernels: list[dict], skip_first: int = 1) -> list[list[dict]]:
    """The longest run of identical kernel sequences at the end of the log, one list per step,
    oldest first, without its first `skip_first` steps (they may still differ)."""
    sig = [(k["name"], k["grid"], k["block"]) for k in kernels]
    if len(sig) < 2:
        return []
    at = [i for i, s in enumerate(sig) if s == sig[-1]]
    best: list[list[dict]] = []
    for prev in reversed(at[:-1]):
        p = len(sig) - 1 - prev
        n = 1
        while (n + 1) * p <= len(sig) and sig[len(sig) - (n + 1) * p:len(sig) - n * p] == sig[len(sig) - p:]:
            n += 1
        if n >= 2:
            best = [kernels[len(sig) - (j + 1) * p:len(sig) - j * p] for j in reversed(range(n))]
            break
    return best[skip_first:] if len(best) > skip_first + 1 else best


def step_summary(steps: list[list[dict]]) -> dict:
    """Per step: kernels, their GPU time, and per kernel name launches and microseconds."""
    if not steps:
        return {"steps": 0}
    by: dict[str, list[float]] = {}
    for step in steps:
        for k in step:
            e = by.setdefault(k["name"], [0.0, 0.0])
            e[0] += 1
            e[1] += k["us"]
    n = len(steps)
    names = sorted(by, key=lambda x: -by[x][1])
    return {
        "steps": n,
        "kernels_per_step": len(steps[0]),
        "gpu_us_per_step": sum(k["us"] for s in steps for k in s) / n,
        "by_kernel": [{"name": x, "launches_per_step": by[x][0] / n, "us_per_step": by[x][1] / n} for x in names],
    }


def step_table(step: list[dict]) -> str:
    """One decode step's kernels in launch order: name, grid, block, microseconds."""
    rows = ["kernel\tgrid\tblock\tus"] + [f"{k['name']}\t{k['grid']}\t{k['block']}\t{k['us']:.3f}" for k in step]
    return "\n".join(rows) + "\n"


def profiled_command(cmd: list[str], ncu: str, log: Path) -> list[str]:
    """`ncu ... CMD`, with an `env X=Y` prefix of the arm kept in front of ncu."""
    pre: list[str] = []
    if cmd[:1] == ["env"]:
        i = 1
        while i < len(cmd) and "=" in cmd[i] and not cmd[i].startswith("-"):
            i += 1
        pre, cmd = cmd[:i], cmd[i:]
    return pre + [ncu, "--clock-control", "none", "--metrics", METRIC, "--csv", "--print-units", "base",
                  "--target-processes", "all", "--log-file", str(log)] + cmd


def end(proc: subprocess.Popen) -> None:
    """Stops the server under ncu (SIGTERM to ncu's children) so that ncu writes its log, then ncu."""
    try:
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        kids = []
    for k in kids:
        try:
            os.kill(int(k), signal.SIGTERM)
        except (OSError, ValueError):
            pass
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        stop(proc)


def last_step_selections(samples: dict[str, float]) -> dict[str, int]:
    """strata-server's selections of the last decode step by tier ({} from a server without tiers)."""
    key = 'strata:expert_selections_last_step{tier="'
    return {k[len(key):-2]: int(v) for k, v in samples.items() if k.startswith(key)}


def run_arm(name: str, cmd: list[str], text: str, a: argparse.Namespace) -> dict:
    port = free_port()
    log_path = a.out / f"{name}.log"
    csv_path = a.out / f"{name}.ncu.csv"
    full = profiled_command(cmd, a.ncu, csv_path) + ["--host", "127.0.0.1", "--port", str(port), "--metrics"]
    env = dict(os.environ, GGML_CUDA_DISABLE_GRAPHS="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, poll=1.0)
            tokens = post_json(url + "/tokenize", {"content": text})["tokens"]
            prompt = (tokens * (a.prompt_tokens // max(len(tokens), 1) + 1))[:a.prompt_tokens]
            t = post_json(url + "/completion", {"prompt": prompt, "n_predict": a.predict, "temperature": 0.0,
                                                "ignore_eos": True, "cache_prompt": False})["timings"]
            selections = last_step_selections(strata_metrics(url))
        except NotReady as e:
            raise SystemExit(f"kprof: {name}: {e}; see {log_path}")
        finally:
            end(proc)
    kernels = parse_ncu_csv(csv_path.read_text(errors="replace")) if csv_path.exists() else []
    steps = decode_steps(kernels)
    if steps:
        (a.out / f"{name}.step.tsv").write_text(step_table(steps[-1]))
    return {"command": cmd, "binary": provenance.binary(provenance.command_binary(cmd)), "timings": t, "last_step_selections": selections, "kernels_logged": len(kernels)} | step_summary(steps)


def summary(out: Path) -> str:
    arms = json.loads((out / "arms.json").read_text())
    res = {n: json.loads((out / f"{n}.json").read_text()) for n in arms if (out / f"{n}.json").exists()}
    rows = [f"{'arm':<16} {'steps':>6} {'kernels/step':>13} {'GPU us/step':>12}  last step's selections by tier"]
    for n, r in res.items():
        if not r.get("steps"):
            rows.append(f"{n:<16} no decode steps found in {r.get('kernels_logged', 0)} kernels")
            continue
        sel = ", ".join(f"{t} {v}" for t, v in r.get("last_step_selections", {}).items()) or "-"
        rows.append(f"{n:<16} {r['steps']:>6} {r['kernels_per_step']:>13} {r['gpu_us_per_step']:>12.1f}  {sel}")
    names: list[str] = []
    for r in res.values():
        for k in r.get("by_kernel", []):
            if k["name"] not in names:
                names.append(k["name"])
    head = " ".join(f"{n[:14]:>16}" for n in res)
    rows += ["", f"{'kernel (launches/step, us/step per arm)':<60} {head}"]
    for x in names:
        cells = []
        for r in res.values():
            k = next((k for k in r.get("by_kernel", []) if k["name"] == x), None)
            cells.append(f"{'-':>16}" if k is None else f"{k['launches_per_step']:>5.0f} {k['us_per_step']:>10.1f}")
        rows.append(f"{x[:60]:<60} {' '.join(cells)}")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prompt-file", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--predict", type=int, default=12)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--summary", type=Path)
    ap.add_argument("arms", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.summary:
        sys.stdout.write(summary(a.summary))
        return
    if a.out is None or a.prompt_file is None:
        ap.error("--out and --prompt-file are required")
    arms = dict(split_arms(a.arms[1:] if a.arms[:1] == ["--"] else a.arms, "kprof"))
    if not arms:
        raise SystemExit("kprof: no arms")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "arms.json").write_text(json.dumps(arms, indent=1))
    text = a.prompt_file.read_text()
    for name, cmd in arms.items():
        (a.out / f"{name}.json").write_text(json.dumps(run_arm(name, cmd, text, a), indent=1))
        print(f"kprof: {name} done", flush=True)
    text = summary(a.out)
    (a.out / "summary.txt").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
