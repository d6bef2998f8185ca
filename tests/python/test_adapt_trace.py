"""Tests for tools/device/adapt-trace (hit rate of the hot tier over time, per arm) and the stale
profile that tools/expert-profile --reverse writes for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import servers
from strata_tools import split_arms
from strata_tools.device import adapt_trace

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe-iq3.gguf"
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))


def test_arms_split_on_triple_dashes_and_need_a_name() -> None:
    arms = split_arms(["a=bin", "-m", "x", "---", "b=env", "V=1", "bin"])
    assert arms == [("a", ["bin", "-m", "x"]), ("b", ["env", "V=1", "bin"])]
    with pytest.raises(SystemExit, match="NAME=BIN"):
        split_arms(["bin", "-m", "x"])


def test_windows_are_consecutive_slices_that_wrap() -> None:
    assert adapt_trace.windows("abcdef", 4, 4) == ["abcd", "efab", "cdef", "abcd"]
    with pytest.raises(SystemExit, match="empty"):
        adapt_trace.windows("", 2, 4)


def test_reverse_gives_each_layer_its_ranking_backwards(tmp_path: Path) -> None:
    prof = {"format": "strata-expert-profile", "version": 1, "model": {}, "tokens": 10, "source": "test",
            "ranked": [[0, 2, 9], [1, 0, 7], [0, 0, 5], [1, 1, 3], [0, 1, 1], [1, 2, 0]]}
    src, out = tmp_path / "p.json", tmp_path / "stale.json"
    src.write_text(json.dumps(prof))
    res = subprocess.run([sys.executable, str(REPO / "tools/expert-profile"), "--reverse", str(src), "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    assert got["ranked"] == [[0, 1, 9], [1, 2, 7], [0, 0, 5], [1, 1, 3], [0, 2, 1], [1, 0, 0]]
    assert "reversed" in got["source"]


@pytest.mark.skipif(not (MODEL.exists() and SERVER.exists()), reason="needs tools/setup (tiny models, release build)")
def test_a_trace_of_two_arms_counts_decode_selections(tmp_path: Path) -> None:
    common = [str(SERVER), "-m", str(MODEL), "-c", "2048", "--metrics", "--expert-cache", "24"]
    argv = ["--out", str(tmp_path / "out"), "--prompt-file", str(REPO / "docs/expert-tiers.md"), "--windows", "3",
            "--steps", "20", "--", "fixed=" + common[0], *common[1:], "--mmap-experts", "---",
            "adapt=" + common[0], *common[1:], "--resident-cpu-experts", "--adapt-every", "4"]
    env = dict(os.environ, STRATA_MEMGUARD_ROOT=str(servers.guard_root(tmp_path)))
    res = subprocess.run([sys.executable, str(REPO / "tools/device/adapt-trace"), *argv], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    trace = json.loads((tmp_path / "out/trace.json").read_text())
    assert list(trace["arms"]) == ["fixed", "adapt"]
    for rows in trace["arms"].values():
        assert [r["steps"] for r in rows] == [20, 40, 60]
        for r in rows:
            # n_used selections per layer and step, over 4 tiered layers: decode only
            assert sum(r["selections"].values()) == 20 * 4 * 4, r
            assert 0 <= r["hit_rate"] <= 1
    assert trace["arms"]["adapt"][-1]["swaps_total"] > 0
    assert (tmp_path / "out/hit-rate.png").stat().st_size > 0
