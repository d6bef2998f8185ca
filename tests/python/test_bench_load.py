"""tools/bench/load on the CPU: percentiles and prompt slices, and a run of strata-server and
upstream llama-server (where tools/build-upstream built it) with four clients and a long prompt
among them, whose cases land in load.json and in tools/bench/matrix's load rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_tools.bench import load

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe.gguf"


def test_percentiles_and_distinct_slices():
    assert load.percentile([], 99) is None
    assert load.percentile([5.0], 50) == 5.0
    assert load.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert load.percentile(list(map(float, range(101))), 99) == 99.0
    s = load.slices([1, 2, 3], 1, 3, 2)
    assert s == [[2, 3], [1, 2], [3, 1]]
    with pytest.raises(SystemExit):
        load.slices([], 0, 1, 4)


def test_clients_at_once_and_a_long_prompt_among_them(tmp_path):
    if not (STRATA.exists() and MODEL.exists()):
        pytest.skip("strata-server or the tiny qwen3moe is missing (run tools/setup)")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((REPO / "ARCHITECTURE.md").read_text()[:20000])
    base = ["-m", str(MODEL), "-c", "8192", "-np", "4", "-t", "2"]
    arms = ["candidate", str(STRATA), *base]
    if UPSTREAM.exists():
        arms += ["---", "control", str(UPSTREAM), *base]
    out = tmp_path / "load-24-0.7"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "load"), "--corpus", str(corpus), "--clients", "4",
                        "--requests", "2", "--prompt-tokens", "64", "--gen", "24", "--mixed", "1500", "--out", str(out), "--", *arms],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "load.json").read_text())
    for a in res:
        assert a["parallel"] == 4, a
        dec, mix = a["cases"]["decode"], a["cases"]["mixed"]
        # every request streamed all of its tokens, one at a time
        assert (dec["requests"], dec["errors"], dec["gen_tokens"]) == (8, 0, 8 * 24), dec
        assert (mix["requests"], mix["errors"], mix["gen_tokens"]) == (4, 0, 4 * 24), mix
        assert len(dec["stream_tps"]) == 8 and dec["itl_ms_p99"] >= dec["itl_ms_p50"] > 0, dec
        assert mix["long"]["prompt_tokens"] == 1500 and mix["long"]["error"] is None, mix
        assert mix["itl_ms_p99_during_long"] is not None, mix
    m = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "matrix"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert m.returncode == 0, m.stderr
    rows = {r["case"]: r for r in json.loads(m.stdout)}
    assert set(rows) == {"decode", "mixed"}
    d = rows["decode"]
    assert (d["kind"], d["parallel"], d["clients"], d["prompt_tokens"], d["gen_tokens"], d["budget_gib"], d["skew"]) == \
        ("load", 4, 4, 64, 24, 24.0, 0.7)
    assert d["gen_tps"] > 0 and d["itl_p99_ms"] > 0
    if UPSTREAM.exists():
        assert d["gen_vs_control"] == round(res[0]["cases"]["decode"]["gen_tps"] / res[1]["cases"]["decode"]["gen_tps"], 3)
    assert rows["mixed"]["mixed_prompt_tokens"] == 1500
