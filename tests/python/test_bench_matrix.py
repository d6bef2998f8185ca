"""tools/bench/matrix: the rows of a device call as the expert issues' matrix.json wants them,
from row directories laid out as tools/device/run-ring and tools/bench/ab leave them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MATRIX = REPO / "tools" / "bench" / "matrix"
KEYS = {"budget_gib", "skew", "ubatch", "hit_rate", "prefill_ratio_min", "prefill_ratio_max", "decode_ratio_min",
        "decode_ratio_max", "prefill_vs_allgpu", "decode_vs_allgpu", "h2d_gib_per_1k_tokens", "commit"}


# what tools/bench/prefill records of the binary an arm ran
UPSTREAM_BIN = {"path": "/x/llama-server", "sha256": "aa" * 32, "version": "version: 0.6.0-dev (build 11434, commit unknown)"}
STRATA_BIN = {"path": "/x/strata-server", "sha256": "bb" * 32, "version": "strata-server 0.1.0 (commit 0123456789ab)",
              "commit": "0123456789ab"}


def requests(prefill: list[float], decode: list[float], binary: dict | None = None) -> dict:
    fresh = [{"kind": "fresh", "prefill_tps": p, "decode_tps": d} for p, d in zip(prefill, decode)]
    out = {"requests": [{"kind": "warmup", "prefill_tps": 1.0, "decode_tps": 1.0}, *fresh,
                        {"kind": "follow-up", "prefill_tps": 1.0, "decode_tps": 1.0}]}
    return out | ({"binary": binary} if binary else {})


def row_dir(base: Path, name: str, control, candidate, ceiling=None, metrics: str | None = None, binaries: bool = True) -> None:
    d = base / name
    d.mkdir(parents=True)
    (d / "control.json").write_text(json.dumps(requests(*control, UPSTREAM_BIN if binaries else None)))
    if candidate is not None:
        (d / "candidate.json").write_text(json.dumps(requests(*candidate, STRATA_BIN if binaries else None)))
    if ceiling is not None:
        (d / "ceiling.json").write_text(json.dumps(requests(*ceiling)))
    if metrics is not None:
        (d / "candidate.metrics.txt").write_text(metrics)


def test_rows_carry_the_ratios_the_hit_rate_and_the_copies(tmp_path):
    call = tmp_path / "call1"
    metrics = "\n".join([
        "# HELP strata:expert_selections_total selections by tier",
        'strata:expert_selections_total{tier="vram"} 900',
        'strata:expert_selections_total{tier="ram"} 100',
        'strata:expert_selections_total{tier="mmap"} 0',
        "llamacpp:prompt_tokens_total 2000",
        f"strata:prefill_ring_h2d_bytes_total {2 * 1024 ** 3}",
        "strata:expert_swaps_total 30",
        'strata:expert_swap_microseconds_total{part="copies"} 1250000',
        'strata:expert_swap_microseconds_total{part="maps"} 250000',
    ])
    row_dir(call, "row-24-0.7-4096", ([100, 200, 100, 200], [10, 10, 20, 20]), ([150, 300, 130, 280], [15, 12, 30, 25]),
            ceiling=([200, 400, 200, 400], [20, 20, 40, 40]), metrics=metrics)
    steps = [{"steps": 256, "launch_us": {"median": 900.0, "mean": 950.0}, "wait_us": {"median": 5000.0, "mean": 5100.0},
              "host_us": {"median": 120.0, "mean": 130.0}, "sample_us": {"median": 90.0, "mean": 95.0}},
             {"steps": 256, "launch_us": {"median": 800.0, "mean": 850.0}, "wait_us": {"median": 5200.0, "mean": 5300.0},
              "host_us": {"median": 110.0, "mean": 115.0}, "sample_us": {"median": 80.0, "mean": 85.0}}]
    (call / "row-24-0.7-4096" / "candidate.steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    row_dir(call, "row-12-0.7-4096+minp", ([100] * 4, [10] * 4), ([120, 140, 160, 180], [20] * 4), binaries=False)
    row_dir(call, "row-12-0.7-512-cpu+waves", ([100] * 4, [10] * 4), None)
    res = subprocess.run([sys.executable, str(MATRIX), str(call)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = {r["dir"]: r for r in json.loads(res.stdout)}
    assert set(rows) == {"row-24-0.7-4096", "row-12-0.7-4096+minp", "row-12-0.7-512-cpu+waves"}

    full = rows["row-24-0.7-4096"]
    assert KEYS <= set(full), KEYS - set(full)
    assert (full["budget_gib"], full["skew"], full["ubatch"], full["arm"], full["commit"]) == (24.0, 0.7, 4096, "profile", "0123456789ab")
    assert full["binaries"] == {"control": UPSTREAM_BIN, "candidate": STRATA_BIN}
    assert (full["prefill_ratio_min"], full["prefill_ratio_max"]) == (1.3, 1.5)
    assert (full["decode_ratio_min"], full["decode_ratio_max"]) == (1.2, 1.5)
    # medians over the four fresh requests of candidate / ceiling: (0.75, 0.75, 0.65, 0.7) and (0.75, 0.6, 0.75, 0.625)
    assert (full["prefill_vs_allgpu"], full["decode_vs_allgpu"]) == (0.725, 0.688)
    assert full["hit_rate"] == 0.9
    assert full["h2d_gib_per_1k_tokens"] == 1.0
    assert (full["swaps"], full["swap_copies_seconds"], full["swap_maps_seconds"]) == (30, 1.25, 0.25)
    # the medians of the step trace's last line
    assert full["candidate_step_us"] == {"steps": 256, "call": 800.0, "wait": 5200.0, "between": 110.0, "sampler": 80.0, "tiers": None}

    minp = rows["row-12-0.7-4096+minp"]
    assert minp["arm"] == "minp"
    # results from before binaries were recorded: no commit, never a typed one
    assert minp["commit"] is None and minp["binaries"] == {}
    # the ceiling of the same skew and batch size, measured in another row of the call
    assert minp["ceiling_from"] == "row-24-0.7-4096"
    assert minp["prefill_vs_allgpu"] == 0.525
    assert (minp["prefill_ratio_min"], minp["prefill_ratio_max"]) == (1.2, 1.8)
    assert not {"hit_rate", "h2d_gib_per_1k_tokens", "swaps", "swap_copies_seconds", "swap_maps_seconds", "candidate_step_us"} & set(minp), \
        "no /metrics and no step trace, no figures from them"

    broken = rows["row-12-0.7-512-cpu+waves"]
    assert (broken["cold_decode"], broken["arm"]) == ("cpu", "waves")
    assert broken["error"].startswith("no result")


def test_gemm_rows_compare_the_table_with_the_control_and_with_itself_off(tmp_path):
    call1, call2 = tmp_path / "call1", tmp_path / "call2"
    row_dir(call1, "gemm-llama-8b-off", ([100, 200, 100, 200], [10] * 4), ([100, 190, 100, 200], [10] * 4))
    row_dir(call2, "gemm-llama-8b-on", ([100, 200, 100, 200], [10] * 4), ([130, 260, 120, 300], [10] * 4),
            metrics='strata:gemm_matmuls_total{path="default"} 7\nstrata:gemm_matmuls_total{path="blaslt"} 3\n')
    row_dir(call2, "gemm-m80-on", ([100] * 4, [10] * 4), None)
    (call2 / "gemm-m80-on.txt").write_text("a log beside the directory, not a row")
    res = subprocess.run([sys.executable, str(MATRIX), str(call1), str(call2)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = {r["dir"]: r for r in json.loads(res.stdout)}
    assert set(rows) == {"gemm-llama-8b-off", "gemm-llama-8b-on", "gemm-m80-on"}
    on = rows["gemm-llama-8b-on"]
    assert (on["kind"], on["model"], on["table"]) == ("gemm", "llama-8b", "on")
    assert (on["prefill_ratio_min"], on["prefill_ratio_max"]) == (1.2, 1.5)
    # against the off candidate, request by request: 1.3, 260/190, 1.2, 1.5
    assert (on["prefill_vs_off_min"], on["prefill_vs_off_max"]) == (1.2, 1.5)
    assert on["matmuls_by_path"] == {"default": 7, "blaslt": 3}
    off = rows["gemm-llama-8b-off"]
    assert (off["prefill_ratio_min"], off["prefill_ratio_max"]) == (0.95, 1.0)
    assert "prefill_vs_off_min" not in off
    assert rows["gemm-m80-on"]["error"].startswith("no result")


def test_with_decode_adds_the_decodediag_arms_and_the_kernel_totals(tmp_path):
    call = tmp_path / "call2"
    row_dir(call, "row-24-0.7-4096", ([100] * 4, [10] * 4), ([150] * 4, [15] * 4), ceiling=([200] * 4, [20] * 4))
    diag = call / "decodediag"
    diag.mkdir()
    (diag / "arms.json").write_text(json.dumps({"allgpu": ["llama-server", "-ngl", "99"],
                                                "tiered": ["strata-server", "--resident-experts"],
                                                "broken": ["strata-server"]}))
    (diag / "allgpu.json").write_text(json.dumps({"runs": [{"predicted_per_second": 200.0}, {"predicted_per_second": 190.0}],
                                                  "graphs_reused": 500}))
    (diag / "tiered.json").write_text(json.dumps({"runs": [{"predicted_per_second": 170.0}, {"predicted_per_second": 160.0},
                                                           {"predicted_per_second": 180.0}], "graphs_reused": 499,
                                                  "binary": STRATA_BIN | {"commit": "ba9876543210"}}))
    kprof = call / "kprof"
    kprof.mkdir()
    (kprof / "arms.json").write_text("{}")
    (kprof / "allgpu.json").write_text(json.dumps({"steps": 10, "kernels_per_step": 1110, "gpu_us_per_step": 6939.1,
                                                   "by_kernel": []}))
    res = subprocess.run([sys.executable, str(MATRIX), "--with-decode", str(call)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # the rows' candidates and the decode arms ran two builds
    assert out["strata_commits"] == ["0123456789ab", "ba9876543210"]
    assert [r["dir"] for r in out["rows"]] == ["row-24-0.7-4096"]
    arms = {a["arm"]: a for a in out["decode"]}
    assert arms["allgpu"]["decode_tps_median"] == 195.0 and arms["allgpu"]["vs_first"] == 1.0
    assert arms["tiered"]["decode_tps"] == [170.0, 160.0, 180.0]
    assert arms["tiered"]["vs_first"] == round(170.0 / 195.0, 3)
    assert arms["tiered"]["command"] == "strata-server --resident-experts"
    assert arms["tiered"]["binary"]["commit"] == "ba9876543210" and arms["allgpu"]["binary"] is None
    assert arms["broken"]["error"].startswith("no result")
    assert out["kprof"] == {"call2": {"allgpu": {"steps": 10, "kernels_per_step": 1110, "gpu_us_per_step": 6939.1}}}


def depth_dir(base: Path, arm: str, cmd: list[str], rows: list[tuple[int, float, float]], log: str = "") -> None:
    d = base / f"depth-24-{arm}-a0.9"
    d.mkdir(parents=True)
    arms = [{"label": arm, "cmd": cmd, "binary": STRATA_BIN if "strata" in cmd[0] else UPSTREAM_BIN, "n_ctx": 262144,
             "rows": [{"prompt_tokens": p, "prefill_tps": pre, "decode_tps": dec, "predicted_n": 128, "card_used_mib": 24000}
                      for p, pre, dec in rows]}]
    (d / "depth.json").write_text(json.dumps(arms))
    (d / f"{arm}.log").write_text(log)


def test_depth_rows_compare_each_depth_with_the_faster_control_and_the_short_row(tmp_path):
    up, st = ["/x/llama-server", "-c", "262144"], ["/x/strata-server", "--max-context", "262144"]
    depth_dir(tmp_path, "control", up, [(8192, 1000, 20), (262016, 500, 10)])
    depth_dir(tmp_path, "nkvo", up + ["-nkvo"], [(8192, 800, 25), (262016, 400, 5)])
    depth_dir(tmp_path, "kv", st + ["--kv-resident", "32768"], [(8192, 3000, 100), (262016, 1000, 60)],
              log="--expert-cache auto: 13000 experts hot (14.57 GiB)\n... profile hit rate of the hot tier 99.50%\n")
    depth_dir(tmp_path, "short", ["/x/strata-server", "--max-context", "16384"], [(8192, 3200, 120)])
    res = subprocess.run([sys.executable, str(MATRIX), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = {(r["arm"], r["prompt_tokens"]): r for r in json.loads(res.stdout)}
    assert set(rows) == {("kv", 8192), ("kv", 262016), ("short", 8192)}
    kv = rows[("kv", 262016)]
    assert (kv["kind"], kv["model"], kv["ctx"], kv["kv_resident"], kv["budget_gib"]) == ("depth", "qwen4exp-80b-a3b", 262144, 32768, 24.0)
    # the control at 8192 is the faster per measure: prefill 1000 (control), decode 25 (nkvo)
    assert rows[("kv", 8192)]["control"] == {"prefill_tps": 1000, "decode_tps": 25}
    assert (rows[("kv", 8192)]["prefill_ratio_min"], rows[("kv", 8192)]["decode_ratio_min"]) == (3.0, 4.0)
    assert (kv["prefill_ratio_min"], kv["decode_ratio_min"], kv["decode_vs_short"]) == (2.0, 6.0, 0.5)
    assert (kv["hot_experts"], kv["hit_rate"]) == (13000, 0.995)
    assert rows[("short", 8192)]["kv_resident"] is None and "hot_experts" not in rows[("short", 8192)]
