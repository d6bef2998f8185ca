"""Tests for the expert-tier tools: tools/expert-profile (a real strata-server over a tiny MoE)
and the comparison in tools/device/parity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import servers
from strata_tools.device import counts, parity

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
    res = profile("--server", str(SERVER), "--model", str(MODEL), "--corpus", str(corpus), "--out", str(out),
                  "--n-predict", "4", "--", "-c", "2048")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 files" in res.stdout and "experts ranked" in res.stdout
    assert sorted(f.name for f in tmp_path.iterdir()) == ["corpus", "profile.json", "profile.json.log"]
    prof = json.loads(out.read_text())
    assert prof["format"] == "strata-expert-profile" and prof["version"] == 1
    ranked = prof["ranked"]
    assert len(ranked) == prof["model"]["n_layer"] * prof["model"]["n_expert"]
    assert [e[2] for e in ranked] == sorted((e[2] for e in ranked), reverse=True)
    assert len({(e[0], e[1]) for e in ranked}) == len(ranked)


def profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools/expert-profile"), *args], capture_output=True, text=True,
                          timeout=300)


def one_line(res: subprocess.CompletedProcess) -> str:
    """A failure's stderr, which must be one line of the tool's own, no traceback."""
    assert res.returncode != 0, res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("expert-profile: "), res.stderr
    return lines[0]


def fake_server(tmp_path: Path) -> tuple[Path, Path]:
    """A server that only leaves a mark that it was started, and that mark."""
    marker = tmp_path / "started"
    server = tmp_path / "server"
    server.write_text(f"#!/bin/sh\ntouch {marker}\n")
    server.chmod(0o755)
    return server, marker


def test_expert_profile_rejects_a_missing_corpus(tmp_path: Path) -> None:
    server, marker = fake_server(tmp_path)
    res = profile("--server", str(server), "--model", str(server), "--corpus", str(tmp_path / "nope"), "--out",
                  str(tmp_path / "p.json"))
    assert "no such corpus file or directory" in one_line(res)
    assert not marker.exists()


@pytest.mark.skipif(not (MODEL.exists() and SERVER.exists()), reason="needs tools/setup (tiny models, release build)")
def test_a_request_the_server_refuses_is_one_line_and_leaves_the_old_profile(tmp_path: Path) -> None:
    corpus = tmp_path / "long.txt"
    corpus.write_text("The sailors sang about the sea and the storms. " * 400)
    out = tmp_path / "profile.json"
    out.write_text('{"an": "older profile"}\n')
    res = profile("--server", str(SERVER), "--model", str(MODEL), "--corpus", str(corpus), "--out", str(out), "--",
                  "-c", "256")
    line = one_line(res)
    assert f"{corpus}: strata-server answered 400: " in line and "exceeds the available context size" in line, line
    assert out.read_text() == '{"an": "older profile"}\n'
    assert sorted(f.name for f in tmp_path.iterdir()) == ["long.txt", "profile.json", "profile.json.log"]


def test_a_missing_out_folder_is_named_before_the_server_starts(tmp_path: Path) -> None:
    server, marker = fake_server(tmp_path)
    (tmp_path / "corpus.txt").write_text("text")
    res = profile("--server", str(server), "--model", str(server), "--corpus", str(tmp_path / "corpus.txt"), "--out",
                  str(tmp_path / "missing" / "p.json"))
    assert one_line(res) == f"expert-profile: the folder of --out does not exist: {tmp_path / 'missing'}"
    assert not marker.exists()


def test_help_shows_the_server_arguments_after_a_double_dash() -> None:
    res = profile("--help")
    assert res.returncode == 0
    assert "--out PROFILE.json [options] [-- server args]" in res.stdout.splitlines()[0], res.stdout


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


def test_counts_sums_each_layers_selections(tmp_path: Path) -> None:
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"ranked": [[0, 3, 10], [1, 2, 7], [0, 1, 5], [1, 0, 0]]}))
    assert counts.layer_totals(p) == {0: 15, 1: 7}


@pytest.mark.skipif(not (MODEL.exists() and SERVER.exists()), reason="needs tools/setup (tiny models, release build)")
def test_counts_finds_four_slots_at_once_count_as_one_at_a_time(tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The sailors sang about the sea and the storms, and the harbour lights went out one by one. " * 40)
    root = servers.guard_root(tmp_path)
    cmd = ["env", "STRATA_LAB=zero-copy", f"STRATA_MEMGUARD_ROOT={root}", str(SERVER), "-m", str(MODEL), "-c", "8192", "--resident-cpu-experts",
           "--adapt-every", "64", "--expert-cache", "24"]
    res = subprocess.run([sys.executable, str(REPO / "tools/device/counts"), "--out", str(tmp_path / "out"),
                          "--prompt-file", str(prompt), "--k", "4", "--n", "12", "--", *cmd],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1] == "counts: pass"
    got = json.loads((tmp_path / "out" / "counts.json").read_text())
    assert got["pass"] and len(got["alone"]["per_layer"]) == 4
    assert got["alone"]["per_layer"] == got["together"]["per_layer"]
