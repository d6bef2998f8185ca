"""tools/device/kprof: ncu's CSV read into kernels, decode steps found from the end of the log,
and the ncu command line it builds (no GPU here: the run itself is for the device machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_tools.device import kprof

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "device" / "kprof"
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe-iq3.gguf"


HEAD = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'


def row(i: int, name: str, grid: str, value: str, unit: str = "nsecond") -> str:
    return (f'"{i}","1","strata-server","h","{name}","1","7","(128, 1, 1)","{grid}","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')


def test_the_csv_gives_kernels_in_launch_order_in_microseconds():
    text = "\n".join(["==PROF== Connected to process 1", HEAD,
                      row(1, "void k_b<float, 2>(const float *, int)", "(4, 1, 1)", "2,500"),
                      row(0, "void rms_norm_f32<1024>(const float *, float *)", "(1, 1, 1)", "1.5", "usecond")])
    k = kprof.parse_ncu_csv(text)
    assert [x["name"] for x in k] == ["rms_norm_f32<1024>", "k_b<float, 2>"]
    assert [x["us"] for x in k] == [1.5, 2.5]


def test_decode_steps_are_the_repeated_tail_without_the_first():
    t = kprof
    mk = lambda names: [{"name": n, "grid": "g", "block": "b", "us": 1.0 + i} for i, n in enumerate(names)]
    prompt = mk(["load", "p1", "p2", "mm", "out"])
    step = ["norm", "mm", "mm", "add", "out"]
    first = mk(["norm", "mm", "add", "out"])
    kernels = prompt + first + mk(step) * 4
    steps = t.decode_steps(kernels)
    assert len(steps) == 3 and all([k["name"] for k in s] == step for s in steps)
    s = t.step_summary(steps)
    assert s["kernels_per_step"] == 5 and s["gpu_us_per_step"] == 15.0
    assert s["by_kernel"][0] == {"name": "mm", "launches_per_step": 2.0, "us_per_step": 5.0}
    assert t.decode_steps(mk(["a", "b", "c"])) == []


def test_ncu_wraps_the_server_and_an_env_prefix_stays_in_front():
    cmd = kprof.profiled_command(["env", "A=1", "B=x=y", "srv", "-m", "m"], "ncu", Path("/o/a.csv"))
    assert cmd[:3] == ["env", "A=1", "B=x=y"] and cmd[3] == "ncu"
    assert cmd[-3:] == ["srv", "-m", "m"] and "gpu__time_duration.sum" in cmd and "/o/a.csv" in cmd
    assert kprof.profiled_command(["srv"], "ncu", Path("x"))[0] == "ncu"


FAKE_NCU = """#!/usr/bin/env python3
# Stands in for ncu: runs the command after its options and, when that ends, copies a prepared
# log of kernels to --log-file.
import shutil, signal, subprocess, sys
args, i, log = sys.argv[1:], 0, None
while i < len(args) and args[i].startswith("--"):
    if args[i] == "--log-file":
        log = args[i + 1]
    i += 1 if args[i] == "--csv" else 2
signal.signal(signal.SIGTERM, lambda *_: None)
subprocess.Popen(args[i:]).wait()
shutil.copy(sys.argv[0] + ".csv", log)
"""


@pytest.mark.skipif(not (SERVER.exists() and MODEL.exists()), reason="needs tools/setup")
def test_a_run_stops_the_server_under_ncu_and_reads_its_log(tmp_path):
    # A prompt, then five identical decode steps of three kernels (norm 3 us, mmvq 1, out 2).
    names = ["prompt_a", "prompt_b"] + ["norm", "mmvq", "out"] * 5
    ncu = tmp_path / "ncu"
    ncu.write_text(FAKE_NCU)
    ncu.chmod(0o755)
    rows = [row(n, k, "(2, 1, 1)", str(1000 * (n % 3 + 1))) for n, k in enumerate(names)]
    (tmp_path / "ncu.csv").write_text("==PROF== Disconnected from process\n" + "\n".join([HEAD] + rows) + "\n")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    res = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "out"), "--prompt-file", str(prompt), "--ncu", str(ncu),
                          "--prompt-tokens", "16", "--predict", "4", "--", f"tiny={SERVER}", "-m", str(MODEL), "-c", "512", "-t", "2",
                          "--mmap-experts", "--expert-cache", "16"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr + res.stdout
    r = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert r["timings"]["predicted_n"] == 4
    assert r["kernels_logged"] == 17 and r["steps"] == 4 and r["kernels_per_step"] == 3
    assert [(k["name"], k["us_per_step"]) for k in r["by_kernel"]] == [("norm", 3.0), ("out", 2.0), ("mmvq", 1.0)]
    assert r["gpu_us_per_step"] == 6.0
    step = (tmp_path / "out" / "tiny.step.tsv").read_text().splitlines()
    assert [l.split("\t")[0] for l in step[1:]] == [n for n in names[-3:]], step
    # the last decode step's selections by tier, from /metrics: one token's, hot and cold
    sel = r["last_step_selections"]
    assert set(sel) == {"vram", "ram", "mmap"} and sel["vram"] > 0 and sel["mmap"] > 0, sel
    assert "tiny" in (tmp_path / "out" / "summary.txt").read_text()
