"""The benchmarks behind the commands in tools/bench/, and what they share: the medians of
strata-server's step trace, the arms of a decodediag directory and the prompts cut from a corpus."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def prompt_ids(tokens: list[int], depth: int) -> list[int]:
    """The first `depth` tokens of the corpus repeated as often as it takes."""
    if not tokens:
        raise SystemExit("the corpus tokenized to nothing")
    reps = -(-depth // len(tokens))
    return (tokens * reps)[:depth]


def step_trace_medians(path) -> dict | None:
    """The medians of the last line of a STRATA_STEP_TRACE file, in microseconds a decode step:
    the llama_decode call, the wait for the device, the host's time between steps and the
    sampler's and the expert tiers' bookkeeping's shares of it (tiers: None in traces from before it
    was recorded); None without a file or a line."""
    try:
        lines = [json.loads(ln) for ln in open(path).read().splitlines() if ln.strip()]
    except (OSError, json.JSONDecodeError):
        return None
    if not lines:
        return None
    last = lines[-1]
    parts = {"call": "launch_us", "wait": "wait_us", "between": "host_us", "sampler": "sample_us", "tiers": "tiers_us"}
    return {"steps": last.get("steps")} | {k: (last.get(v) or {}).get("median") for k, v in parts.items()}


def decodediag_arms(out) -> list[dict]:
    """The arms of a tools/bench/decodediag output directory, in arms.json's order: "arm",
    "command" (its argv), "step_us" (step_trace_medians of its trace, None without one) and either
    "error" (no result) or "decode_tps" (each run's), "median", "vs_first" (the median over the
    first arm's with a result), "graphs_reused" and "binary" (its provenance, where recorded); []
    without arms.json."""
    out = Path(out)
    try:
        arms = json.loads((out / "arms.json").read_text())
    except OSError:
        return []
    res: list[dict] = []
    first = None
    for name, command in arms.items():
        entry: dict = {"arm": name, "command": command, "step_us": step_trace_medians(out / f"{name}.steps.jsonl")}
        try:
            r = json.loads((out / f"{name}.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            res.append(entry | {"error": f"no result: {e}"})
            continue
        tps = [x["predicted_per_second"] for x in r["runs"]]
        med = statistics.median(tps)
        first = first or med
        res.append(entry | {"decode_tps": tps, "median": med, "vs_first": med / first, "graphs_reused": r.get("graphs_reused"),
                            "binary": r.get("binary")})
    return res
