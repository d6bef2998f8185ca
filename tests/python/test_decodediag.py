"""tools/bench/decodediag: arms parsed from its command line, and a real run of two arms of
strata-server on a tiny MoE (the second through `env`), with the summary it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_tools.bench import decodediag

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "bench" / "decodediag"
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe-iq3.gguf"


def test_arms_are_split_on_triple_dashes_and_named_by_their_first_word():
    arms = decodediag.parse_arms(["a=srv", "-m", "x", "---", "b=env", "K=1", "srv", "-m", "x"])
    assert arms == {"a": ["srv", "-m", "x"], "b": ["env", "K=1", "srv", "-m", "x"]}
    for bad in (["srv", "-m", "x"], ["a=srv", "---", "a=srv"], [], ["=srv"]):
        with pytest.raises(SystemExit):
            decodediag.parse_arms(bad)


@pytest.mark.skipif(not (SERVER.exists() and MODEL.exists()), reason="needs tools/setup")
def test_two_arms_run_and_the_summary_compares_them(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    common = ["-m", str(MODEL), "-c", "1024", "-t", "2"]
    res = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "out"), "--prompt-file", str(prompt),
                          "--prompt-tokens", "64", "--predict", "8", "--runs", "2", "--",
                          f"plain={SERVER}", *common, "---"] +
                         ["tiers=env", "STRATA_LAB=flat-ids", str(SERVER), *common, "--mmap-experts", "--expert-cache", "4"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr + res.stdout
    for name in ("plain", "tiers"):
        r = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert [x["predicted_n"] for x in r["runs"]] == [8, 8]
        assert all(x["prompt_n"] == 64 for x in r["runs"])
        assert r["graphs_reused"] is not None
        assert r["binary"]["path"] == str(SERVER) and len(r["binary"]["commit"]) == 12, r["binary"]
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert lines[1].startswith("plain") and "1.000x" in lines[1]
    assert lines[2].startswith("tiers")
