"""tools/bench/depth on the CPU: the prompt at each depth, and a run of strata-server with and
without --kv-resident on the tiny qwen4exp whose rows land in depth.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_tools.bench import depth

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen4exp.gguf"


def test_a_depth_takes_the_corpus_from_its_start_and_repeats_it():
    assert depth.prompt_ids([1, 2, 3], 2) == [1, 2]
    assert depth.prompt_ids([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(SystemExit):
        depth.prompt_ids([], 4)
    assert depth.fitted(262144, 262144, 128) == 262016 and depth.fitted(8192, 16384, 128) == 8192
    assert depth.fitted(8192, None, 128) == 8192
    assert depth.arms_of(["a", "bin", "-x", "---", "b", "bin2"], "depth") == [("a", ["bin", "-x"]), ("b", ["bin2"])]
    with pytest.raises(SystemExit):
        depth.arms_of(["a"], "depth")


def test_each_arm_measures_every_depth(tmp_path):
    if not (STRATA.exists() and MODEL.exists()):
        pytest.skip("strata-server or the tiny qwen4exp is missing (run tools/setup)")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((REPO / "ARCHITECTURE.md").read_text()[:6000])
    base = [str(STRATA), "-m", str(MODEL), "-c", "2048", "-fa", "on", "-t", "2"]
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "depth"), "--corpus", str(corpus), "--depths", "64,1500,4096",
                        "--n", "4", "--out", str(tmp_path), "--", "placed", *base, "--kv-resident", "256", "---", "plain", *base],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    arms = json.loads((tmp_path / "depth.json").read_text())
    assert [a["label"] for a in arms] == ["placed", "plain"]
    for a in arms:
        # 4096 does not fit the 2048-token context with the 4 generated tokens: cut to 2044
        assert [row["prompt_tokens"] for row in a["rows"]] == [64, 1500, 2044], a
        assert a["n_ctx"] == 2048
        assert all(row["prefill_tps"] > 0 and row["decode_tps"] > 0 and row["predicted_n"] == 4 for row in a["rows"]), a
        assert a["binary"]["sha256"]
    assert "--kv-resident 256: the K and V of 2 QSA layers" in (tmp_path / "placed.log").read_text()
