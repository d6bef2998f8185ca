"""tools/bench/ab on the CPU: the --n-cpu-moe arithmetic from a real GGUF's tensor sizes, and a
--quick A/B of upstream llama-server against strata-server (one arm at a time, compare table,
chart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import servers

from strata_tools.bench import ab as ab_tool

REPO = Path(__file__).resolve().parents[2]

AB = REPO / "tools" / "bench" / "ab"
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe.gguf"


def ab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AB), *args], capture_output=True, text=True, timeout=600)


def plan(vram_gib: float) -> list[str]:
    res = ab("--plan", str(MODEL), "--vram-gib", str(vram_gib), "--ctx", "4096")
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_plan_moves_experts_to_the_cpu_only_as_far_as_the_card_needs():
    assert plan(64)[-1].endswith("--n-cpu-moe 0")
    tight = plan(1.51)
    assert tight[-2].endswith("--n-cpu-moe 4"), tight
    assert tight[-1].startswith("warning:"), tight
    # a card that holds all but about two layers' experts
    _, fixed, experts = ab_tool.sizes(MODEL, 4096)
    middle = (fixed + sum(experts[2:]) + 1) / 2 ** 30
    line = plan(middle)[-1]
    assert line.endswith("--n-cpu-moe 2"), line


def test_quick_ab_runs_both_arms_and_compares(tmp_path):
    for p in (STRATA, UPSTREAM, MODEL):
        if not p.exists():
            pytest.fail(f"{p} is missing: run tools/setup and tools/build-upstream")
    res = ab("--control", str(UPSTREAM), "--candidate", str(STRATA), "--model", str(MODEL), "--out", str(tmp_path),
             "--ctx", "4096", "--quick", "--port", str(servers.free_port()))
    assert res.returncode == 0, res.stderr + res.stdout
    assert "candidate / control" in (tmp_path / "compare.md").read_text()
    for f in ("control.json", "candidate.json", "control.log", "candidate.log", "prefill.png"):
        assert (tmp_path / f).stat().st_size > 0, f


def test_the_control_is_fitted_by_its_measured_start_and_lowers_its_batch_only_where_that_overflows():
    gib = 2 ** 30
    experts = [gib] * 8
    seen = []

    def probe(ub):  # compute buffers of 1 GiB a 1024 tokens beside 2 GiB of weights and KV
        seen.append(ub)
        return 2 * gib + ub * gib // 1024

    # a 16 GiB card holds the typed -ub 4096 (6 GiB) and all 8 GiB of experts
    ub, n, lines = ab_tool.fit_control(experts, 16, 4096, probe)
    assert (ub, n, seen) == (4096, 0, [4096]), lines
    # a 8 GiB card: 6 GiB leaves 1.75 GiB, one layer of experts
    seen.clear()
    ub, n, lines = ab_tool.fit_control(experts, 8, 4096, probe)
    assert (ub, n) == (4096, 7), lines
    # a 5 GiB card cannot hold the 8192-token batch's 10 GiB: halved until the start fits
    seen.clear()
    ub, n, lines = ab_tool.fit_control(experts, 5, 8192, probe)
    assert seen == [8192, 4096, 2048] and ub == 2048 and n == 8, lines
    assert lines[-1].endswith("-> -ub 2048 --n-cpu-moe 8"), lines
    # nothing fits: the smallest batch, every expert on the CPU, and a warning
    seen.clear()
    ub, n, lines = ab_tool.fit_control(experts, 2, 2048, probe)
    assert (ub, n, seen) == (512, 8, [2048, 1024, 512]) and lines[-1].startswith("warning:"), lines
    # no GPU to measure on: said, and no placement
    ub, n, lines = ab_tool.fit_control(experts, 8, 4096, lambda ub: None)
    assert n == -1 and "could not be measured" in lines[-1]
    # two probes give the line: the halvings it puts over the card are not started
    seen.clear()
    ub, n, lines = ab_tool.fit_control(experts, 3.4, 16384, probe)
    assert seen == [16384, 8192, 1024] and ub == 1024, lines


def test_a_probe_cache_starts_each_control_once_per_machine(tmp_path):
    calls = []

    def probe(ub):
        calls.append(ub)
        return ub * 10 if ub > 1 else None

    cache = tmp_path / "probes.json"
    a = ab_tool.cached_probe(probe, cache, "llama-server -m x")
    assert (a(4096), a(4096)) == (40960, 40960) and calls == [4096]
    # another run of the tool on the same machine reads it; another command line does not
    assert ab_tool.cached_probe(probe, cache, "llama-server -m x")(4096) == 40960 and calls == [4096]
    assert ab_tool.cached_probe(probe, cache, "llama-server -m y")(4096) == 40960 and calls == [4096, 4096]
    # an unmeasured probe is not remembered; no cache file: every call probes
    assert ab_tool.cached_probe(probe, cache, "z")(1) is None and ab_tool.cached_probe(probe, cache, "z")(1) is None
    assert calls == [4096, 4096, 1, 1]
    assert ab_tool.cached_probe(probe, None, "k")(2) == 20 and ab_tool.cached_probe(probe, None, "k")(2) == 20
    assert calls[-2:] == [2, 2]


def test_the_batch_size_a_command_line_types_is_the_last_one():
    assert ab_tool.ubatch_of(["-c", "4096"]) == 512
    assert ab_tool.ubatch_of(["-b", "8192", "-ub", "8192", "--ubatch-size", "2048"]) == 2048
    assert ab_tool.ubatch_of(["--prefill", "8192"]) == 8192


def test_ab_with_load_measures_each_arm_with_clients_at_once(tmp_path):
    for p in (STRATA, UPSTREAM, MODEL):
        if not p.exists():
            pytest.fail(f"{p} is missing: run tools/setup and tools/build-upstream")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(__file__).resolve().parents[2] / "ARCHITECTURE.md").read_text()[:20000])
    out = tmp_path / "load-24-0.7"
    res = ab("--control", str(UPSTREAM), "--candidate", str(STRATA), "--model", str(MODEL), "--out", str(out),
             "--ctx", "4096", "--load", "--clients 3 --prompt-tokens 32 --gen 8", "--corpus", str(corpus), "--", "-np", "3", "-t", "2")
    assert res.returncode == 0, res.stderr + res.stdout
    arms = json.loads((out / "load.json").read_text())
    assert [a["label"] for a in arms] == ["control", "candidate"]
    for a in arms:
        assert a["parallel"] == 3 and a["cases"]["decode"]["gen_tokens"] == 24 and a["cases"]["decode"]["errors"] == 0, a
