"""Tests for the expert-tier tools: tools/expert-profile (a real strata-server over a tiny MoE)
and the comparison in tools/device/parity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_tools.device import parity

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe-iq3.gguf"
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))


@pytest.mark.skipif(not (MODEL.exists() and SERVER.exists()), reason="needs tools/setup (tiny models, release build)")
def test_expert_profile_ranks_every_expert(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("The sailors sang about the sea and the storms. " * 20)
    (corpus / "b.txt").write_text("def add(a, b):\n    return a + b\n" * 20)
    out = tmp_path / "profile.json"
    res = subprocess.run([sys.executable, str(REPO / "tools/expert-profile"), "--model", str(MODEL), "--corpus",
                          str(corpus), "--out", str(out), "--n-predict", "4", "--", "-c", "2048"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 files" in res.stdout and "experts ranked" in res.stdout
    prof = json.loads(out.read_text())
    assert prof["format"] == "strata-expert-profile" and prof["version"] == 1
    ranked = prof["ranked"]
    assert len(ranked) == prof["model"]["n_layer"] * prof["model"]["n_expert"]
    assert [e[2] for e in ranked] == sorted((e[2] for e in ranked), reverse=True)
    assert len({(e[0], e[1]) for e in ranked}) == len(ranked)


def test_expert_profile_rejects_a_missing_corpus(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(REPO / "tools/expert-profile"), "--model", str(MODEL), "--corpus",
                          str(tmp_path / "nope"), "--out", str(tmp_path / "p.json")], capture_output=True, text=True)
    assert res.returncode != 0 and "no such corpus file or directory" in res.stderr


def answer(tokens: list[int], probs: list[list[tuple[int, float]]]) -> dict:
    return {"tokens": tokens,
            "completion_probabilities": [{"id": t, "top_logprobs": [{"id": i, "logprob": lp} for i, lp in p]}
                                         for t, p in zip(tokens, probs)]}


def test_parity_compares_tokens_and_log_probabilities() -> None:
    a = answer([1, 2, 3], [[(1, -0.1), (5, -2.0)], [(2, -0.2), (6, -1.0)], [(3, -0.3), (7, -1.5)]])
    same = parity.compare(a, a, 0.01)
    assert same["pass"] and same["tokens_equal"] and same["max_abs_logprob_difference"] == 0
    off = answer([1, 2, 3], [[(1, -0.1), (5, -2.0)], [(2, -0.25), (6, -1.0)], [(3, -0.3), (7, -1.5)]])
    near = parity.compare(a, off, 0.01)
    assert not near["pass"] and near["tokens_equal"] and abs(near["max_abs_logprob_difference"] - 0.05) < 1e-9
    diverged = answer([1, 2, 4], [[(1, -0.1), (5, -2.0)], [(2, -0.2), (6, -1.0)], [(4, -0.3), (3, -0.4)]])
    d = parity.compare(a, diverged, 0.01)
    assert not d["pass"] and d["first_difference"] == 2
    assert abs(d["reference_margin_near_difference"] - 1.2) < 1e-9


def test_forced_parity_allows_near_ties_only() -> None:
    a = answer([1, 2, 3], [[(1, -0.1), (5, -2.0)], [(2, -0.50), (6, -0.51)], [(3, -0.3), (7, -1.5)]])

    def steps(*tops: list[tuple[int, float]]) -> list[list[dict]]:
        return [[{"id": i, "logprob": lp} for i, lp in t] for t in tops]

    same = parity.compare_forced(a, steps([(1, -0.1)], [(2, -0.5)], [(3, -0.3)]), 0.05)
    assert same["pass"] and same["top1_equal_steps"] == 3 and same["max_abs_logprob_difference"] == 0
    tie = parity.compare_forced(a, steps([(1, -0.1)], [(6, -0.49), (2, -0.52)], [(3, -0.3)]), 0.05)
    assert tie["pass"] and [f["step"] for f in tie["near_tie_flips"]] == [1]
    assert abs(tie["near_tie_flips"][0]["reference_gap"] - 0.01) < 1e-9
    wrong = parity.compare_forced(a, steps([(5, -0.1)], [(2, -0.5)], [(3, -0.3)]), 0.05)
    assert not wrong["pass"] and wrong["near_tie_flips"][0]["reference_gap"] > 1.8
    unseen = parity.compare_forced(a, steps([(1, -0.1)], [(2, -0.5)], [(9, -0.2)]), 0.05)
    assert not unseen["pass"]
    drift = parity.compare_forced(a, steps([(1, -0.2)], [(2, -0.5)], [(3, -0.3)]), 0.05)
    assert not drift["pass"] and drift["top1_equal_steps"] == 3


def test_forced_parity_counts_steps_without_probabilities() -> None:
    a = answer([1, 2, 3, 4], [[(1, -0.1)], [(3, -0.3)], [(4, -0.2)]])
    a["completion_probabilities"] = a["completion_probabilities"][:1] + [
        {"id": 3, "top_logprobs": [{"id": 3, "logprob": -0.3}]}, {"id": 4, "top_logprobs": [{"id": 4, "logprob": -0.2}]}]
    got = [[{"id": 1, "logprob": -0.1}], [], [{"id": 3, "logprob": -0.3}], [{"id": 4, "logprob": -0.2}]]
    v = parity.compare_forced(a, got, 0.05)
    assert v["pass"] and v["measured_steps"] == 3 and v["top1_equal_steps"] == 3
    few = parity.compare_forced(a, [[], [], [], got[3]], 0.05)
    assert not few["pass"] and few["measured_steps"] == 1
