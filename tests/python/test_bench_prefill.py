"""tools/bench/prefill in --quick mode against real servers on loopback: strata-server and,
unchanged, upstream llama-server from the same pin; then --compare on the two runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import servers

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench" / "prefill"
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe.gguf"


def serve(binary: Path, log: Path):
    for p in (binary, MODEL):
        if not p.exists():
            pytest.fail(f"{p} is missing: run tools/setup and tools/build-upstream")
    return servers.start(binary, ["-m", str(MODEL), "-c", "4096", "-np", "1"], stderr=open(log, "wb", buffering=0))


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "empty.log").write_bytes(b"")
    for label, binary in (("control", UPSTREAM), ("candidate", STRATA)):
        log = tmp / f"{label}.log"
        proc, url = serve(binary, log)
        try:
            res = bench("--model", "tiny", "--url", url, "--engine-log", str(log), "--binary", str(binary), "--label", label,
                        "--output", str(tmp / f"{label}.json"), "--quick")
            assert res.returncode == 0, res.stderr
            out[label] = tmp / f"{label}.json"
            bad = bench("--model", "tiny", "--url", url, "--engine-log", str(tmp / "empty.log"), "--binary", str(binary),
                        "--label", label, "--output", str(tmp / "bad.json"), "--quick")
            out[label + "-bad"] = bad
        finally:
            proc.terminate()
            proc.wait()
    return out


def test_a_run_records_every_request_on_both_servers(runs):
    by_label = {label: json.loads(runs[label].read_text()) for label in ("control", "candidate")}
    for label, run in by_label.items():
        kinds = [r["kind"] for r in run["requests"]]
        assert kinds == ["warmup"] + ["fresh", "follow-up"] * 4, label
        for r in run["requests"]:
            assert r["predicted_n"] == 16 and r["stop_reason"] == "length", (label, r)
            assert r["prefill_tps"] > 0 and r["decode_tps"] > 0 and r["wall_s"] > 0
            assert r["engine_log"]["prompt_n"] == r["prompt_n"]
            if r["kind"] == "follow-up":
                assert r["cache_n"] > 0, (label, r)
            else:
                assert r["cache_n"] == 0, (label, r)
        sizes = [r["prompt_n"] for r in run["requests"] if r["kind"] == "fresh"]
        assert sizes[1] > 1.6 * sizes[0] and sizes[3] > 1.6 * sizes[2], sizes
    # each run names its binary by content and version, strata-server also by commit
    for label, binary in (("control", UPSTREAM), ("candidate", STRATA)):
        b = by_label[label]["binary"]
        assert b["sha256"] == hashlib.sha256(binary.read_bytes()).hexdigest() and b["version"], b
    assert re.fullmatch(r"[0-9a-f]{12}", by_label["candidate"]["binary"]["commit"])
    assert "commit" not in by_label["control"]["binary"]
    # the same prompts through the same template and tokenizer
    assert [r["prompt_n"] for r in by_label["control"]["requests"] if r["kind"] == "fresh"] == \
           [r["prompt_n"] for r in by_label["candidate"]["requests"] if r["kind"] == "fresh"]


def test_a_log_without_timing_records_fails_the_run(runs, tmp_path):
    for label in ("control", "candidate"):
        bad = runs[label + "-bad"]
        assert bad.returncode != 0
        assert "added 0 completed timing records" in bad.stderr, bad.stderr


def test_compare_prints_the_table_and_a_chart(runs, tmp_path):
    chart = tmp_path / "chart.png"
    res = bench("--compare", str(runs["control"]), str(runs["candidate"]), "--chart", str(chart))
    assert res.returncode == 0, res.stderr
    table = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert "control prefill t/s" in table[0] and "candidate / control" in table[0], res.stdout
    assert len(table) == 1 + 4, res.stdout
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
