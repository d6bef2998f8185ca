"""What the Python tools and tests share: a free loopback port, waiting for a server's /health,
stopping it, JSON requests, strata-server's /metrics samples and its step trace, and the arms of
a tools/device/decodediag directory.

Scripts under tools/ put tools/ on sys.path (`sys.path.insert(0, str(TOOLS))`) and import this.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import urllib.request


class NotReady(Exception):
    """The server exited or did not answer /health with "ok" in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 1800, poll: float = 0.3) -> None:
    """Returns once GET url/health answers {"status": "ok"}; raises NotReady if proc exits first
    or timeout seconds pass."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise NotReady(f"exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.load(r).get("status") == "ok":
                    return
        except (OSError, ValueError):
            pass
        if time.time() > deadline:
            raise NotReady(f"not ready in {timeout:.0f} s")
        time.sleep(poll)


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited after timeout seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post_json(url: str, body: dict, timeout: float = 3600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def strata_metrics(url: str) -> dict[str, float]:
    """The strata:* samples of /metrics, keyed by name with labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("strata:"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


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
    """The arms of a tools/device/decodediag output directory, in arms.json's order: "arm",
    "command" (its argv), "step_us" (step_trace_medians of its trace, None without one) and either
    "error" (no result) or "decode_tps" (each run's), "median", "vs_first" (the median over the
    first arm's with a result) and "graphs_reused"; [] without arms.json."""
    from pathlib import Path

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
        res.append(entry | {"decode_tps": tps, "median": med, "vs_first": med / first, "graphs_reused": r.get("graphs_reused")})
    return res
