"""The matrix of tools/device/run-ring rows: one object per row directory
(row-GIB-SKEW-UB[-DECODE][+ARM], or tools/device/run-seed's row-GIB-SPEC-UB[-PLE]-aACCEPT[-cgroupGIB]
with the keys model, spec, accept_rate, ple_mode, ctx, the tokens per verify step of each arm and the
time batches waited for PLE rows and its share of the candidate's prompt and decode time; DECODE cpu where the CPU computed decode's cold experts from a
pageable RAM copy, absent for zero-copy decode from a page-locked one; ARM the residency arm:
profile (the default), adapt (the profile and --adapt-every), noprofile (only --adapt-every),
onepass, waves, paced or minp (tools/device/run-ring says what each sets); made by
tools/bench/ab) with the ratios of the candidate to the control and to the all-GPU ceiling
measured in the same device call. Older calls' folders read the same: there DECODE (cpu, mapped,
workers, mixed) and the arms lend, table, chains and stage name switches since removed
(docs/lab.md), and cpu computed from the page-locked copy.

    tools/bench/matrix DIR... > matrix.json

Each row names the binaries its arms ran, as tools/bench/prefill recorded them in the arms'
results ("binaries": control and candidate, each with its sha256 and --version line), and
"commit": the candidate strata-server's, from its --version (null for results that predate that
record).
A row whose ceiling arm ran in another row of the same call (same skew and batch size) takes it
from there. Rows where an arm has no result are listed with "error". A candidate that wrote a
step trace (candidate.steps.jsonl, STRATA_STEP_TRACE) adds its medians as candidate_step_us.

With --with-decode the output is an object: "rows" (the above), "decode" (each
decodediag/ directory's arms: decode t/s per run, their median, the ratio to the first arm's
median, the command, its binary, and the step trace's medians where strata-server wrote one),
"kprof" (each kprof/ directory's per-step kernel totals by arm) and "strata_commits" (the distinct
commits of the strata-server binaries the rows and arms ran).

tools/device/run-seed's long-context rows (depth-GIB-ARM-aACCEPT, tools/bench/depth's depth.json)
follow: one per strata arm (kv, allkv, short) and depth, with the keys model, ctx, prompt_tokens,
kv_resident, budget_gib, the speeds, the card's memory and hot tier, prefill_ratio_min and
decode_ratio_min against the control at that depth (the faster of control and nkvo where both
ran), prefill_vs_allgpu and decode_vs_allgpu where upstream all-GPU ran, and decode_vs_short
against the short arm's decode. depth-parity-aACCEPT adds the parity verdict of the streamed cache.

tools/bench/load's rows (load-GIB-SKEW[-SUFFIX] holding load.json with the arms control, candidate
and ceiling) follow: one per case (decode, mixed) with the keys parallel, clients, prompt_tokens,
gen_tokens, budget_gib, skew, the candidate's gen_tps, gen_vs_control, gen_vs_allgpu, ttft and
itl_p99_ms, each arm's itl_p99_ms, errors, and for the mixed case the streams' p99 gap while the long
prompt was read and their decode rates' spread (fastest over slowest).

The GEMM table's rows (gemm-MODEL-on and gemm-MODEL-off: everything on the GPU, the candidate
with STRATA_HIPBLASLT_TUNING and without) follow, each with its ratio to the control and, for
"on", to the "off" candidate of the same model.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from strata_tools.bench import decodediag_arms, step_trace_medians

GIB = 1024 ** 3
ROW = re.compile(r"row-([\d.]+)-([\d.]+)-(\d+)(?:-([a-z]+))?(?:\+([a-z]+))?")
# tools/device/run-seed: row-GIB-SPEC-UB[-PLE]-aACCEPT[-cgroupGIB] on the qwen4exp 80B
SEED = re.compile(r"row-([\d.]+)-(\d+)-(\d+)(?:-(ssd|ram))?-a([\d.]+)(?:-cgroup(\d+))?")
SEED_CTX = 262144
GEMM = re.compile(r"gemm-(.+)-(on|off)")
DEPTH = re.compile(r"depth-([\d.]+)-([a-z]+)-a([\d.]+)")
HOT = re.compile(r"--expert-cache \S+: (\d+) experts hot \(([^)]*)\)")
LOAD = re.compile(r"load-([\d.]+)-([\d.]+)(?:-[\w.]+)?")
HIT = re.compile(r"profile hit rate of the hot tier ([\d.]+)%")


def fresh(path: Path) -> list[dict]:
    return [r for r in json.loads(path.read_text())["requests"] if r["kind"] == "fresh"]


def binaries(d: Path) -> dict:
    """The row's "commit" (its candidate's) and "binaries" (each arm's), from the arms' results."""
    found = {}
    for arm in ("control", "candidate"):
        try:
            b = json.loads((d / f"{arm}.json").read_text()).get("binary")
        except (OSError, json.JSONDecodeError):
            continue
        if b:
            found[arm] = b
    return {"commit": found.get("candidate", {}).get("commit"), "binaries": found}


def metrics(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                try:
                    out[key] = float(val)
                except ValueError:
                    pass
    return out


def ceiling_key(name: str) -> tuple[str, str] | None:
    """Rows of one call share the ceiling of the same (skew, batch), or for run-seed (drafting, batch)."""
    if m := ROW.fullmatch(name):
        return m.group(2), m.group(3)
    if m := SEED.fullmatch(name):
        return "spec" + m.group(2), m.group(3)
    return None


def tokens_per_step(requests: list[dict]) -> float | None:
    """Tokens each verify step of speculative decoding emitted (None without drafting)."""
    gen = sum(r["predicted_n"] or 0 for r in requests)
    acc = sum(r.get("draft_n_accepted") or 0 for r in requests)
    if not any(r.get("draft_n") for r in requests) or gen <= acc:
        return None
    return round(gen / (gen - acc), 3)


def row(d: Path, ceilings: dict[tuple[str, str], Path]) -> dict:
    if m := SEED.fullmatch(d.name):
        gib, spec, ub, ple, acc, cg = m.groups()
        out = {"model": "qwen4exp-80b-a3b", "budget_gib": float(gib), "skew": 0.7, "ubatch": int(ub), "spec": int(spec),
               "accept_rate": float(acc), "ple_mode": ple or "ssd", "ctx": SEED_CTX, "dir": d.name} | binaries(d)
        if cg:
            out["cgroup_gib"] = int(cg)
        out["arm"] = "seed-line"
    else:
        m = ROW.fullmatch(d.name)
        gib, skew, ub = m.group(1), m.group(2), m.group(3)
        out = {"budget_gib": float(gib), "skew": float(skew), "ubatch": int(ub), "dir": d.name} | binaries(d)
        if m.group(4):
            out["cold_decode"] = m.group(4)
        out["arm"] = m.group(5) or "profile"
    try:
        ctl, cand = fresh(d / "control.json"), fresh(d / "candidate.json")
    except (OSError, KeyError, json.JSONDecodeError) as e:
        out["error"] = f"no result: {e}"
        return out
    pre = [c["prefill_tps"] / b["prefill_tps"] for b, c in zip(ctl, cand)]
    dec = [c["decode_tps"] / b["decode_tps"] for b, c in zip(ctl, cand)]
    out.update(prefill_ratio_min=round(min(pre), 3), prefill_ratio_max=round(max(pre), 3),
               decode_ratio_min=round(min(dec), 3), decode_ratio_max=round(max(dec), 3))
    ceil_path = ceilings.get(ceiling_key(d.name))
    if ceil_path:
        ceil = fresh(ceil_path)
        out["prefill_vs_allgpu"] = round(statistics.median(c["prefill_tps"] / x["prefill_tps"] for c, x in zip(cand, ceil)), 3)
        out["decode_vs_allgpu"] = round(statistics.median(c["decode_tps"] / x["decode_tps"] for c, x in zip(cand, ceil)), 3)
        out["ceiling_from"] = ceil_path.parent.name
    mt = metrics(d / "candidate.metrics.txt")
    sel = {t: mt.get(f'strata:expert_selections_total{{tier="{t}"}}', 0.0) for t in ("vram", "ram", "mmap")}
    if sum(sel.values()) > 0:
        out["hit_rate"] = round(sel["vram"] / sum(sel.values()), 4)
    if "strata:expert_swaps_total" in mt:
        out["swaps"] = int(mt["strata:expert_swaps_total"])
    for part in ("copies", "maps"):
        key = f'strata:expert_swap_microseconds_total{{part="{part}"}}'
        if key in mt:
            out[f"swap_{part}_seconds"] = round(mt[key] / 1e6, 3)
    if "spec" in out:
        for arm, reqs in (("control", ctl), ("candidate", cand)):
            if (tps := tokens_per_step(reqs)) is not None:
                out[f"{arm}_tokens_per_step"] = tps
        ple = mt.get("strata:ple_supply_seconds_total")
        if ple is not None:
            every = json.loads((d / "candidate.json").read_text())["requests"]
            busy = sum((r["prompt_ms"] or 0) + (r["predicted_ms"] or 0) for r in every) / 1e3
            # the batches' wait for their PLE rows, against the time of every prompt and decode step
            out["ple_supply_seconds"] = round(ple, 3)
            out["ple_supply_share"] = round(ple / busy, 4) if busy else None
    tokens = mt.get("llamacpp:prompt_tokens_total", 0.0)
    if tokens > 0:
        out["h2d_gib_per_1k_tokens"] = round(mt.get("strata:prefill_ring_h2d_bytes_total", 0.0) / tokens * 1000 / GIB, 3)
    steps = step_trace_medians(d / "candidate.steps.jsonl")
    if steps:
        out["candidate_step_us"] = steps
    out["control_prefill_tps"] = [round(b["prefill_tps"], 1) for b in ctl]
    out["candidate_prefill_tps"] = [round(c["prefill_tps"], 1) for c in cand]
    out["control_decode_tps"] = [round(b["decode_tps"], 1) for b in ctl]
    out["candidate_decode_tps"] = [round(c["decode_tps"], 1) for c in cand]
    return out


def gemm_row(d: Path, dirs: dict[str, Path]) -> dict:
    model, table = GEMM.fullmatch(d.name).groups()
    out = {"kind": "gemm", "model": model, "table": table, "dir": d.name} | binaries(d)
    try:
        ctl, cand = fresh(d / "control.json"), fresh(d / "candidate.json")
    except (OSError, KeyError, json.JSONDecodeError) as e:
        out["error"] = f"no result: {e}"
        return out
    pre = [c["prefill_tps"] / b["prefill_tps"] for b, c in zip(ctl, cand)]
    out.update(prefill_ratio_min=round(min(pre), 3), prefill_ratio_max=round(max(pre), 3))
    off = dirs.get(f"gemm-{model}-off")
    if table == "on" and off is not None and (off / "candidate.json").exists():
        base = fresh(off / "candidate.json")
        vs = [c["prefill_tps"] / b["prefill_tps"] for b, c in zip(base, cand)]
        out.update(prefill_vs_off_min=round(min(vs), 3), prefill_vs_off_max=round(max(vs), 3))
    mt = metrics(d / "candidate.metrics.txt")
    paths = {p: int(mt[f'strata:gemm_matmuls_total{{path="{p}"}}']) for p in ("default", "mmq", "blaslt")
             if f'strata:gemm_matmuls_total{{path="{p}"}}' in mt}
    if paths:
        out["matmuls_by_path"] = paths
    out["control_prefill_tps"] = [round(b["prefill_tps"], 1) for b in ctl]
    out["candidate_prefill_tps"] = [round(c["prefill_tps"], 1) for c in cand]
    return out


def depth_arm(d: Path) -> dict | None:
    """The one arm of a depth directory, with its hot tier from the server's log where it has one."""
    try:
        arm = json.loads((d / "depth.json").read_text())[0]
    except (OSError, IndexError, KeyError, json.JSONDecodeError):
        return None
    log = d / f"{arm['label']}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    if m := HOT.search(text):
        arm["hot_experts"], arm["hot_size"] = int(m.group(1)), m.group(2)
    if m := HIT.search(text):
        arm["hit_rate"] = round(float(m.group(1)) / 100, 4)
    return arm


def flag_value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd and cmd.index(flag) + 1 < len(cmd) else None


def depth_rows(dirs: list[Path]) -> list[dict]:
    arms: dict[tuple[str, str], dict[str, dict]] = {}
    for d in dirs:
        m = DEPTH.fullmatch(d.name)
        if m and (a := depth_arm(d)):
            a["dir"] = d.name
            arms.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = a
    out = []
    for (gib, acc), by in sorted(arms.items()):
        ctl = [by[k] for k in ("control", "nkvo") if k in by]
        short = by.get("short", {}).get("rows", [])
        for name in ("kv", "allkv", "short"):
            if name not in by:
                continue
            a = by[name]
            for r in a["rows"]:
                pt = r["prompt_tokens"]
                row = {"kind": "depth", "model": "qwen4exp-80b-a3b", "arm": name, "ctx": a.get("n_ctx"), "prompt_tokens": pt,
                       "kv_resident": int(v) if (v := flag_value(a["cmd"], "--kv-resident")) else None,
                       "budget_gib": float(gib), "accept_rate": float(acc), "dir": a["dir"],
                       "commit": (a.get("binary") or {}).get("commit"), "prefill_tps": round(r["prefill_tps"], 1),
                       "decode_tps": round(r["decode_tps"], 1), "card_used_mib": r.get("card_used_mib")}
                for k in ("hot_experts", "hot_size", "hit_rate"):
                    if k in a:
                        row[k] = a[k]
                # the control a user would run: the faster of the upstream arms at this depth
                at = [x for c in ctl for x in c["rows"] if x["prompt_tokens"] == pt]
                if at:
                    row["control"] = {"prefill_tps": round(max(x["prefill_tps"] for x in at), 1),
                                      "decode_tps": round(max(x["decode_tps"] for x in at), 1)}
                    row["prefill_ratio_min"] = round(r["prefill_tps"] / row["control"]["prefill_tps"], 3)
                    row["decode_ratio_min"] = round(r["decode_tps"] / row["control"]["decode_tps"], 3)
                full = [x for x in by.get("allgpu", {}).get("rows", []) if x["prompt_tokens"] == pt]
                if full:
                    row["prefill_vs_allgpu"] = round(r["prefill_tps"] / full[0]["prefill_tps"], 3)
                    row["decode_vs_allgpu"] = round(r["decode_tps"] / full[0]["decode_tps"], 3)
                if short:
                    row["decode_vs_short"] = round(r["decode_tps"] / short[0]["decode_tps"], 3)
                    row["short_prompt_tokens"] = short[0]["prompt_tokens"]
                out.append(row)
    for d in dirs:
        if re.fullmatch(r"depth-parity-a[\d.]+", d.name) and (d / "parity.json").exists():
            p = json.loads((d / "parity.json").read_text())
            out.append({"kind": "depth-parity", "dir": d.name, "commands": p["commands"], "prompt_tokens": p["a"].get("tokens_evaluated"),
                        "verdict": p["verdict"]})
    return out


def load_rows(dirs: list[Path]) -> list[dict]:
    out = []
    for d in dirs:
        m = LOAD.fullmatch(d.name)
        try:
            arms = {a["label"]: a for a in json.loads((d / "load.json").read_text())}
        except (OSError, KeyError, TypeError, json.JSONDecodeError):
            continue
        cand = arms.get("candidate")
        if not m or cand is None:
            continue
        p = cand["params"]
        for case, r in cand["cases"].items():
            row = {"kind": "load", "case": case, "dir": d.name, "parallel": cand.get("parallel"), "clients": p["clients"],
                   "prompt_tokens": p["prompt_tokens"], "gen_tokens": p["gen"], "budget_gib": float(m.group(1)),
                   "skew": float(m.group(2)), "commit": (cand.get("binary") or {}).get("commit"), "gen_tps": r["gen_tps"],
                   "ttft_ms_p50": r["ttft_ms_p50"], "itl_p99_ms": r["itl_ms_p99"], "errors": r["errors"],
                   "stream_tps_spread": r["stream_tps_spread"]}
            for arm, key in (("control", "gen_vs_control"), ("ceiling", "gen_vs_allgpu")):
                other = arms.get(arm, {}).get("cases", {}).get(case)
                if other and other.get("gen_tps"):
                    row[key] = round(r["gen_tps"] / other["gen_tps"], 3)
                    row[f"{arm}_itl_p99_ms"] = other["itl_ms_p99"]
                    row[f"{arm}_errors"] = other["errors"]
                    if case == "mixed":
                        row[f"{arm}_itl_p99_during_long_ms"] = other.get("itl_ms_p99_during_long")
            if case == "mixed":
                row["mixed_prompt_tokens"] = r["long"]["prompt_tokens"]
                row["itl_p99_during_long_ms"] = r.get("itl_ms_p99_during_long")
            out.append(row)
    return out


def decode_arms(call: Path) -> list[dict]:
    out: list[dict] = []
    for a in decodediag_arms(call / "decodediag"):
        entry: dict = {"call": call.name, "arm": a["arm"], "command": " ".join(a["command"]), "binary": a.get("binary")}
        if "error" in a:
            out.append(entry | {"error": a["error"]})
            continue
        entry.update(decode_tps=[round(x, 1) for x in a["decode_tps"]], decode_tps_median=round(a["median"], 1),
                     graphs_reused=a["graphs_reused"], vs_first=round(a["vs_first"], 3))
        if a["step_us"]:
            entry["step_us"] = a["step_us"]
        out.append(entry)
    return out


def kprof_arms(call: Path) -> dict:
    out: dict = {}
    for f in sorted((call / "kprof").glob("*.json")):
        if f.name == "arms.json":
            continue
        try:
            res = json.loads(f.read_text())
            out[f.stem] = {k: res[k] for k in ("steps", "kernels_per_step", "gpu_us_per_step")}
        except (OSError, KeyError, json.JSONDecodeError):
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with-decode", action="store_true", help="an object with the decodediag and kprof arms too")
    ap.add_argument("dirs", nargs="+", help="call output directories holding row-* (and gemm-*) directories")
    args = ap.parse_args(argv)
    rows = sorted(d for base in args.dirs for d in Path(base).glob("row-*") if d.is_dir() and ceiling_key(d.name))
    ceilings: dict[tuple[str, str], Path] = {}
    for d in rows:
        if (d / "ceiling.json").exists():
            ceilings[ceiling_key(d.name)] = d / "ceiling.json"
    gemm = sorted(d for base in args.dirs for d in Path(base).glob("gemm-*") if d.is_dir() and GEMM.fullmatch(d.name))
    by_name = {d.name: d for d in gemm}
    depth = sorted(d for base in args.dirs for d in Path(base).glob("depth-*") if d.is_dir())
    load = sorted(d for base in args.dirs for d in Path(base).glob("load-*") if d.is_dir())
    out = [row(d, ceilings) for d in rows] + depth_rows(depth) + load_rows(load) + [gemm_row(d, by_name) for d in gemm]
    if args.with_decode:
        calls = [Path(b) for b in args.dirs]
        decode = [a for c in calls if (c / "decodediag").is_dir() for a in decode_arms(c)]
        commits = {r["commit"] for r in out} | {(a["binary"] or {}).get("commit") for a in decode}
        out = {"strata_commits": sorted(c for c in commits if c), "rows": out, "decode": decode,
               "kprof": {c.name: k for c in calls if (k := kprof_arms(c))}}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
