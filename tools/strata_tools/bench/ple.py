"""PLE I/O benchmark: one model, the table in RAM (--ple-mode ram), mapped (mmap: the pin's
--lazy-mode on) and read from the file by Strata's direct-I/O readers (ssd).

For each arm a fresh strata-server; before it starts, the model file's pages are dropped from the
page cache with posix_fadvise(DONTNEED). It first answers a warm-up request (--warmup-tokens
token ids none of which the measured prompt uses, so the first request's one-time costs stay out
of the figures), then the file's pages are dropped again (pages the server has mapped stay: those
are the weights and the warm-up's rows, which the prompt does not need), so the measured
request's rows come from storage for the mapping arm and for the pool. Each arm runs that cold
request (prompt + decode) and a warm one (the same prompt again, no prompt cache), and records prefill and decode t/s from the server's timings, the server's RSS after the
requests, and bytes it read from storage (/proc/PID/io read_bytes) per prompt token and per
generated token. Writes matrix.json (with the server binary's sha256, --version line and commit)
and a Markdown table.

With --repeat N the three arms run N rounds, each round in another order (rotated), and the
table gives per arm the median and range over the rounds, and the ratios' medians over the
rounds (each round's arms ran back to back), for machines whose speed drifts between runs.

  tools/bench/ple MODEL --out DIR [--prompt-tokens 2048] [--predict 128] [--threads N]
                     [--repeat N] [--ssd-cache-mib N] [--warmup-tokens N] [--server PATH]
                     [-- more server arguments]

The prompt is token ids drawn over the vocabulary (seeded), so a batch needs about as many distinct
rows as varied text would.
"""

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from strata_tools import REPO, free_port, post_json, provenance, stop, wait_healthy

SERVER = REPO / "target/release/strata-server"
MODES = ("ram", "mmap", "ssd")


def drop_file_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def proc_io(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prompt(n_tokens: int, seed: int) -> list[int]:
    """Token ids spread over the vocabulary, so that a batch needs as many distinct table rows as
    a prompt of varied text (a few repeats, as text has)."""
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 250_000) for _ in range(n_tokens * 3 // 4)]
    return ids + [rng.choice(ids) for _ in range(n_tokens - len(ids))]


def warmup_prompt(n_tokens: int, avoid: set[int]) -> list[int]:
    rng = random.Random(2)
    out: list[int] = []
    while len(out) < n_tokens:
        t = rng.randrange(1000, 250_000)
        if t not in avoid:
            out.append(t)
    return out


def arm(model: Path, mode: str, args, env_extra: dict, tag: str = "") -> dict:
    drop_file_cache(model)
    port = free_port()
    cache = ["--ple-cache-mib", str(args.ssd_cache_mib)] if mode == "ssd" and args.ssd_cache_mib is not None else []
    cmd = [str(args.server), "-m", str(model), "-c", str(args.prompt_tokens + args.predict + 64), "-np", "1", "--port", str(port), "-t", str(args.threads),
           "-b", "512", "-ub", "512", "--metrics", "--ple-mode", mode, *cache, *args.server_args]
    env = dict(os.environ, **env_extra)
    t0 = time.time()
    log = open(args.out / f"server-{mode}{tag}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc)
        load_s = time.time() - t0
        io0 = proc_io(proc.pid)
        measured = prompt(args.prompt_tokens, 1)
        if args.warmup_tokens > 0:
            post_json(base + "/completion", {"prompt": warmup_prompt(args.warmup_tokens, set(measured)), "n_predict": 8,
                                             "temperature": 0.0, "ignore_eos": True, "cache_prompt": False})
            drop_file_cache(model)
        body = {"prompt": measured, "n_predict": args.predict, "temperature": 0.0,
                "ignore_eos": True, "cache_prompt": False}
        runs = []
        for name in ("cold", "warm"):
            # warm: the same rows again (the row cache or the page cache holds them)
            io_a = proc_io(proc.pid)
            r = post_json(base + "/completion", body)
            io_b = proc_io(proc.pid)
            t = r["timings"]
            runs.append({
                "run": name,
                "prompt_n": t["prompt_n"], "prefill_tps": t["prompt_per_second"],
                "predicted_n": t["predicted_n"], "decode_tps": t["predicted_per_second"],
                "read_bytes": io_b - io_a,
                "read_bytes_per_token": (io_b - io_a) / max(1, t["prompt_n"] + t["predicted_n"]),
                "tokens": r.get("tokens", []),
                "content": r["content"],
            })
        rss = rss_mib(proc.pid)
        metrics = ""
        try:
            import urllib.request
            metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        except Exception:
            pass
        return {"mode": mode, "env": env_extra, "command": " ".join(cmd), "load_s": load_s, "rss_mib": rss,
                "read_bytes_total": proc_io(proc.pid) - io0, "runs": runs,
                "ple_metrics": [l for l in metrics.splitlines() if l.startswith("strata:ple_")]}
    finally:
        stop(proc)
        log.close()


def main() -> int:
    argv = sys.argv[1:]
    own, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--server", type=Path, default=SERVER)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--io-threads", default="8")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--warmup-tokens", type=int, default=256, help="the warm-up request's prompt (0: none)")
    ap.add_argument("--ssd-cache-mib", type=int, default=None, help="--ple-cache-mib of the ssd arm (default: the server's)")
    args = ap.parse_args(own)
    args.server_args = server_args
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(args.repeat):
        tag = f"-r{k + 1}" if args.repeat > 1 else ""
        by_mode = {}
        for mode in MODES[k % 3:] + MODES[:k % 3]:
            env = {"STRATA_IO_THREADS": args.io_threads} if mode == "ssd" else {}
            r = arm(args.model, mode, args, env, tag)
            r["round"] = k + 1
            by_mode[mode] = r
            print(f"round {k + 1} {mode}: load {r['load_s']:.1f} s, rss {r['rss_mib']:.0f} MiB, " + ", ".join(
                f"{x['run']} prefill {x['prefill_tps']:.1f} t/s decode {x['decode_tps']:.1f} t/s read {x['read_bytes'] / 2**20:.1f} MiB"
                for x in r["runs"]), flush=True)
        ram = {x["run"]: x for x in by_mode["ram"]["runs"]}
        mmap = {x["run"]: x for x in by_mode["mmap"]["runs"]}
        for r in by_mode.values():
            for x in r["runs"]:
                x["same_tokens_as_ram"] = x["content"] == ram[x["run"]]["content"]
                x["prefill_vs_ram"] = x["prefill_tps"] / ram[x["run"]]["prefill_tps"]
                x["decode_vs_ram"] = x["decode_tps"] / ram[x["run"]]["decode_tps"]
                x["prefill_vs_mmap"] = x["prefill_tps"] / mmap[x["run"]]["prefill_tps"]
                x["decode_vs_mmap"] = x["decode_tps"] / mmap[x["run"]]["decode_tps"]
        rows.extend(by_mode[m] for m in MODES)
    size = args.model.stat().st_size
    meta = {"model": str(args.model), "model_bytes": size, "machine": platform.node(), "cpus": os.cpu_count(),
            "prompt_tokens": args.prompt_tokens, "predict": args.predict, "threads": args.threads, "repeat": args.repeat,
            "ssd_cache_mib": args.ssd_cache_mib, "server": str(args.server), "binary": provenance.binary(args.server),
            "server_args": server_args,
            "cache_drop": "posix_fadvise(POSIX_FADV_DONTNEED) on the model file before each arm and after its warm-up request",
            "warmup_tokens": args.warmup_tokens}
    out = {"meta": meta, "rows": rows}
    if args.repeat > 1:
        out["summary"] = summary(rows)
    (args.out / "matrix.json").write_text(json.dumps(out, indent=1))
    if args.repeat > 1:
        lines = ["| mode | run | prefill t/s median (range) | decode t/s median (range) | prefill / ram | decode / ram | prefill / mmap | decode / mmap | RSS MiB | same text as ram |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for x in out["summary"]:
            rng = lambda k: f"{x[k]['median']:.1f} ({x[k]['min']:.1f}-{x[k]['max']:.1f})"
            lines.append(f"| {x['mode']} | {x['run']} | {rng('prefill_tps')} | {rng('decode_tps')} | {x['prefill_vs_ram']['median']:.2f} | "
                         f"{x['decode_vs_ram']['median']:.2f} | {x['prefill_vs_mmap']['median']:.2f} | {x['decode_vs_mmap']['median']:.2f} | "
                         f"{x['rss_mib']['median']:.0f} | {x['same_tokens_as_ram']} |")
        (args.out / "table.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    lines = ["| mode | run | prefill t/s | decode t/s | prefill / ram | decode / ram | read MiB | read B/token | RSS MiB | same text as ram |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for x in r["runs"]:
            lines.append(f"| {r['mode']} | {x['run']} | {x['prefill_tps']:.1f} | {x['decode_tps']:.1f} | {x['prefill_vs_ram']:.2f} | "
                         f"{x['decode_vs_ram']:.2f} | {x['read_bytes'] / 2**20:.1f} | {x['read_bytes_per_token']:.0f} | {r['rss_mib']:.0f} | {x['same_tokens_as_ram']} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def summary(rows: list[dict]) -> list[dict]:
    """Per mode and run (cold, warm): median, min and max over the rounds."""
    out = []
    for mode in MODES:
        for run in ("cold", "warm"):
            xs = [(r, x) for r in rows if r["mode"] == mode for x in r["runs"] if x["run"] == run]
            stats = {"mode": mode, "run": run, "rounds": len(xs), "same_tokens_as_ram": all(x["same_tokens_as_ram"] for _, x in xs)}
            for key in ("prefill_tps", "decode_tps", "prefill_vs_ram", "decode_vs_ram", "prefill_vs_mmap", "decode_vs_mmap", "rss_mib"):
                v = sorted(r[key] if key == "rss_mib" else x[key] for r, x in xs)
                stats[key] = {"median": statistics.median(v), "min": v[0], "max": v[-1]}
            out.append(stats)
    return out


if __name__ == "__main__":
    sys.exit(main())
