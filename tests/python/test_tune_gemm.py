"""Tests for tools/tune-gemm: the dense shapes it lists from a GGUF, and the measuring program
(tools/gemm/tune.cpp) built against this checkout's llama.cpp and run on the CPU backend (its
smoke mode: the GPU candidates need the GPU machine)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from strata_tools import tune_gemm

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "tiny-qwen3moe-iq3.gguf"
LIBS = REPO / "target/llama.cpp/cpu/build/bin"
INCLUDE = REPO / "vendor/llama.cpp/ggml/include"


def tune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools/tune-gemm"), *args], capture_output=True, text=True, timeout=600)


def one_line(res: subprocess.CompletedProcess) -> str:
    """A failure's stderr, which must be one line of the tool's own, no traceback."""
    assert res.returncode != 0, res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tune-gemm: "), res.stderr
    return lines[0]


def header_only_gguf(path: Path) -> Path:
    """A GGUF header with one dense q8_0 weight of 128 rows of 256: all tune-gemm reads of a model."""
    name = b"blk.0.attn_q.weight"
    path.write_bytes(struct.pack("<IIQQ", 0x46554747, 3, 1, 0) + struct.pack("<Q", len(name)) + name
                     + struct.pack("<IQQIQ", 2, 256, 128, 8, 0))
    return path


def fake_tuner(tmp_path: Path, rc: int) -> Path:
    """A tuner that writes part of a table to its TABLE argument, says why it stops, and exits rc."""
    p = tmp_path / "tuner"
    p.write_text(f"#!/bin/sh\nprintf 'strata-gemm-table 1\\n' > \"$2\"\necho 'tune-gemm: no GPU backend was loaded'\nexit {rc}\n")
    p.chmod(0o755)
    return p


@pytest.mark.skipif(not MODEL.exists(), reason="needs tools/setup (tiny models)")
def test_shapes_are_the_dense_weights_at_each_batch_size() -> None:
    rows = tune_gemm.shapes(MODEL, [64, 512])
    # qwen3moe: q, k, v, output projections and the router per layer, the output head; experts
    # (3-D) and the token embedding are not dense matmuls
    assert ("q4_K", 151936, 512, 256) in rows, rows
    assert all(n in (64, 512) for _, _, n, _ in rows)
    assert len(rows) == len(set(rows))
    assert not any(t == "iq3_xxs" for t, *_ in rows), "expert tensors are 3-D"


@pytest.mark.skipif(not (MODEL.exists() and LIBS.exists() and shutil.which("g++")), reason="needs tools/setup and g++")
def test_the_tuner_builds_and_measures_the_default_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "table.txt"
    res = tune("--model", str(MODEL), "--out", str(out), "--include", str(INCLUDE), "--libs", str(LIBS), "--batches", "32",
               "--", "--cpu-smoke", "1", "--reps", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    log = out.with_suffix(".log").read_text()
    assert "q8_0 256 32 128 default:" in log and "the default stays" in log, log
    assert out.read_text().startswith("strata-gemm-table 1\nvalidator arch cpu\n")
    # Without --cpu-smoke there is no GPU to tune here: a clear error, not a table.
    bad = subprocess.run([str(out.with_suffix(".bin")), str(out.with_suffix(".shapes")), str(tmp_path / "t2.txt")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "no GPU backend was loaded" in bad.stderr


def test_report_gives_one_row_per_shape_with_the_fastest_candidate_and_the_verdict() -> None:
    log = "\n".join([
        "device NVIDIA H100 80GB HBM3: arch sm_90 runtime 13000 blaslt 130100",
        "q4_K 4096 512 4096 default: 105.20 us, 163.3 TFLOP/s, rel err 0.00e+00",
        "q4_K 4096 512 4096 mmq: 105.50 us, 162.8 TFLOP/s, rel err 0.00e+00",
        "q4_K 4096 512 4096 blaslt 0: 79.30 us, 216.7 TFLOP/s, rel err 1.12e-02",
        "q4_K 4096 512 4096 blaslt 1: 90.00 us, 190.9 TFLOP/s, rel err 1.12e-02",
        "q4_K 4096 512 4096 blaslt 2: 60.00 us, 286.3 TFLOP/s, rel err 3.00e-01 (rejected)",
        "q4_K 4096 512 4096: blaslt 0, 1.328x the default",
        "f32 512 512 2048 default: 17.60 us, 61.0 TFLOP/s, rel err 0.00e+00",
        "f32 512 512 2048 blaslt 7: 22.70 us, 47.3 TFLOP/s, rel err 3.02e-06",
        "f32 512 512 2048: the default stays",
        "q4_K 4096 4096 4096 default: 786.00 us, 174.9 TFLOP/s, rel err 0.00e+00",
    ])
    lines = tune_gemm.report(log).splitlines()
    assert len(lines) == 5, lines
    assert lines[2] == "| q4_K | 4096 | 512 | 4096 | 105.2 | 105.5 | 79.3 (blaslt 0, 1.12e-02) | blaslt 0, 1.328x |"
    assert lines[3] == "| f32 | 512 | 512 | 2048 | 17.6 | - | 22.7 (blaslt 7, 3.02e-06) | default |"
    assert lines[4].endswith("| 786.0 | - | - | not finished |")


def test_a_header_only_gguf_has_one_shape_per_batch(tmp_path: Path) -> None:
    assert tune_gemm.shapes(header_only_gguf(tmp_path / "m.gguf"), [32, 64]) == [("q8_0", 128, 32, 256), ("q8_0", 128, 64, 256)]


def test_a_missing_model_or_tuner_and_a_bad_out_are_one_line_each(tmp_path: Path) -> None:
    model = header_only_gguf(tmp_path / "m.gguf")
    tuner = fake_tuner(tmp_path, 0)
    assert one_line(tune("--model", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "t.txt"), "--binary", str(tuner))) == \
        f"tune-gemm: no such model file: {tmp_path / 'nope.gguf'}"
    assert "is not a GGUF file" in one_line(tune("--model", str(tuner), "--out", str(tmp_path / "t.txt"), "--binary", str(tuner)))
    assert one_line(tune("--model", str(model), "--out", str(tmp_path / "t.txt"), "--binary", str(tmp_path / "nope"))) == \
        f"tune-gemm: no tuner at --binary {tmp_path / 'nope'}"
    assert one_line(tune("--model", str(model), "--out", str(tmp_path / "missing" / "t.txt"), "--binary", str(tuner))) == \
        f"tune-gemm: the folder of --out does not exist: {tmp_path / 'missing'}"
    assert not (tmp_path / "missing").exists()
    assert one_line(tune("--model", str(model), "--out", str(tmp_path), "--binary", str(tuner))) == \
        f"tune-gemm: --out is a folder: {tmp_path}"
    assert "needs --include and --libs" in one_line(tune("--model", str(model), "--out", str(tmp_path / "t.txt")))


def test_a_failed_run_is_one_line_and_leaves_the_old_table(tmp_path: Path) -> None:
    out = tmp_path / "t.txt"
    out.write_text("an older table\n")
    res = tune("--model", str(header_only_gguf(tmp_path / "m.gguf")), "--out", str(out), "--binary", str(fake_tuner(tmp_path, 1)))
    assert one_line(res) == f"tune-gemm: the tuner failed (exit 1): tune-gemm: no GPU backend was loaded; see {tmp_path / 't.log'}"
    assert out.read_text() == "an older table\n"
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".partial")]


def test_a_run_that_succeeds_replaces_the_table(tmp_path: Path) -> None:
    out = tmp_path / "t.txt"
    out.write_text("an older table\n")
    res = tune("--model", str(header_only_gguf(tmp_path / "m.gguf")), "--out", str(out), "--binary", str(fake_tuner(tmp_path, 0)))
    assert res.returncode == 0, res.stderr
    assert out.read_text() == "strata-gemm-table 1\n"
    assert (tmp_path / "t.shapes").read_text() == "q8_0 128 512 256\nq8_0 128 2048 256\nq8_0 128 4096 256\n"


def test_help_shows_the_tuner_options_after_a_double_dash() -> None:
    res = tune("--help")
    assert res.returncode == 0 and "[-- tune.cpp options:" in res.stdout, res.stdout
