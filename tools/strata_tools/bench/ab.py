"""A/B run: upstream llama-server (control) against strata-server (candidate), one at a time on
one idle machine, each measured by tools/bench/prefill; prints the compare table last.

    tools/bench/ab --control BIN --candidate BIN --model GGUF --out DIR
                    [--vram-gib G] [--ctx N] [--quick] [--ceiling] [--control-args ARGS]
                    [--candidate-args ARGS] [--load ARGS --corpus FILE] [-- EXTRA SERVER ARGS]
    tools/bench/ab --plan GGUF --vram-gib G [--ctx N]

Each arm is started alone with its stderr written unbuffered to DIR/<arm>.log, benchmarked, and
stopped before the next starts; strata-server also writes the host's time around its decode
steps to DIR/<arm>.steps.jsonl (STRATA_STEP_TRACE). With --vram-gib G the run emulates a card of G GiB: the control
gets the placement such a user would choose, `-ngl 99 --n-cpu-moe N` with N from the tensor sizes
(--plan prints that arithmetic alone); on a GPU the control is instead fitted by measurement
(`fit_control`: one start with every expert on the CPU gives what the card holds besides the
experts, compute buffers included; where that exceeds the card, -ub halves as a user's would);
the candidate gets the same placement plus
`--vram-reserve-mib`, the Strata flag that will let its expert residency use the rest.
With --ceiling a third arm runs first: the control with everything on the GPU (`-ngl 99`), the
all-GPU ceiling both are compared with.
With --load ARGS each arm is measured by tools/bench/load instead (ARGS its flags, e.g. "--clients 8
--gen 256 --mixed 32768"; -np in the extra server args), the arms in one DIR/load.json.

The build half of the protocol (CUDA builds of both arms from the carried pin) lives in
docs/bench-ab.md; this script only needs the two binaries.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from strata_tools import NotReady, wait_healthy
from strata_tools.bench import load, prefill
from strata_tools.gguf_header import GGUFError, read_gguf

GIB = 1024 ** 3
# Compute buffers and CUDA context the user leaves room for on top of weights and KV cache.
HEADROOM_GIB = 1.5


# llama.cpp keeps the input layer's tensors (token and per-layer token embeddings) in host memory
INPUT_TENSORS = ("token_embd.weight", "per_layer_token_embd.weight")
# bytes per KV cache element by llama.cpp cache type
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32}


def kv_type_bytes(args: list[str]) -> tuple[float, float]:
    """Bytes per K and V element for the cache types in server arguments (f16 by default)."""
    k = v = "f16"
    for i, a in enumerate(args[:-1]):
        if a in ("-ctk", "--cache-type-k"):
            k = args[i + 1]
        elif a in ("-ctv", "--cache-type-v"):
            v = args[i + 1]
        elif a == "--kv" and args[i + 1] == "int8":
            k = v = "q8_0"
    return KV_TYPE_BYTES.get(k, 2.0), KV_TYPE_BYTES.get(v, 2.0)


def sizes(model: Path, n_ctx: int, kv_bytes: tuple[float, float] = (2.0, 2.0)) -> tuple[dict, int, list[int]]:
    """The model's header KVs, the bytes a full GPU placement needs besides the experts (other
    weights but the input layer's, the KV cache of the attention layers at n_ctx, headroom), and
    the expert bytes of each layer."""
    kv, tensors = read_gguf(model)
    arch = kv["general.architecture"]
    n_layer = kv[f"{arch}.block_count"]
    experts = [0] * n_layer
    other = 0
    for name, size in tensors:
        parts = name.split(".")
        if parts[0] == "blk" and "_exps" in name:
            experts[int(parts[1])] += size
        elif name not in INPUT_TENSORS:
            other += size
    n_head = kv[f"{arch}.attention.head_count"]
    n_head_kv = kv.get(f"{arch}.attention.head_count_kv", n_head)
    head_k = kv.get(f"{arch}.attention.key_length", kv[f"{arch}.embedding_length"] // n_head)
    head_v = kv.get(f"{arch}.attention.value_length", head_k)
    # hybrid models (Qwen3.5-style): only every full_attention_interval-th trunk layer has a KV cache
    n_trunk = n_layer - kv.get(f"{arch}.nextn_predict_layers", 0)
    interval = kv.get(f"{arch}.full_attention_interval")
    n_attn = sum((il + 1) % interval == 0 for il in range(n_trunk)) if interval else n_layer
    kv_cache = int(n_ctx * n_attn * n_head_kv * (head_k * kv_bytes[0] + head_v * kv_bytes[1]))
    kv["strata.other_bytes"], kv["strata.kv_cache_bytes"] = other, kv_cache
    return kv, other + kv_cache + int(HEADROOM_GIB * GIB), experts


def smallest_n_cpu_moe(fixed: float, experts: list[int], budget: float) -> int:
    """The fewest leading layers whose experts, kept on the CPU, leave fixed plus the rest within budget."""
    n = 0
    while n < len(experts) and fixed + sum(experts[n:]) > budget:
        n += 1
    return n


def plan_n_cpu_moe(model: Path, vram_gib: float, n_ctx: int, kv_bytes: tuple[float, float] = (2.0, 2.0)) -> tuple[int, list[str]]:
    """The smallest --n-cpu-moe that fits weights, KV cache and headroom in vram_gib, and the
    lines of arithmetic behind it."""
    kv, fixed, experts = sizes(model, n_ctx, kv_bytes)
    n_layer = len(experts)
    budget = vram_gib * GIB
    n = smallest_n_cpu_moe(fixed, experts, budget)
    lines = [
        f"model {model.name}: {n_layer} layers, experts {sum(experts) / GIB:.3f} GiB, "
        f"other weights {kv['strata.other_bytes'] / GIB:.3f} GiB",
        f"KV cache ({kv_bytes[0]:g} + {kv_bytes[1]:g} bytes an element) at n_ctx {n_ctx}: {kv['strata.kv_cache_bytes'] / GIB:.3f} GiB; "
        f"headroom {HEADROOM_GIB:.2f} GiB",
        f"card {vram_gib:g} GiB: experts of layers {n}..{n_layer - 1} on the GPU = {sum(experts[n:]) / GIB:.3f} GiB, "
        f"total {(fixed + sum(experts[n:])) / GIB:.3f} GiB -> --n-cpu-moe {n}",
    ]
    if fixed > budget:
        lines.append("warning: weights other than experts, KV cache and headroom alone exceed the card")
    return n, lines


# What a fitted control leaves free on the card beyond its measured start: buffers that grow
# after the first requests (the GPU library's workspaces).
FIT_MARGIN_GIB = 0.25
UB_MIN = 512


def ubatch_of(args: list[str]) -> int:
    """The physical batch size in server arguments (llama.cpp's default 512; the last one given wins)."""
    ub = UB_MIN
    for i, a in enumerate(args[:-1]):
        if a in ("-ub", "--ubatch-size", "--prefill"):
            ub = int(args[i + 1])
    return ub


def fit_control(experts: list[int], vram_gib: float, ub: int, probe) -> tuple[int, int, list[str]]:
    """The control a user would run on a card of vram_gib: the typed -ub where the server with
    every expert on the CPU fits the card, else the largest halving of it (down to 512) that does;
    then the smallest --n-cpu-moe whose GPU experts fit beside what that start took. probe(ub)
    starts the server so and returns the bytes it took on the card (weights but the experts, KV
    cache, compute buffers, the CUDA context), or None where that cannot be measured."""
    budget = vram_gib * GIB - FIT_MARGIN_GIB * GIB
    lines = []
    seen: dict[int, int] = {}
    while True:
        base = probe(ub)
        if base is None:
            return ub, -1, lines + [f"probe: -ub {ub}: the card's use could not be measured"]
        lines.append(f"probe: -ub {ub}, every expert on the CPU: {base / GIB:.3f} GiB on the card")
        seen[ub] = base
        if base <= budget or ub <= UB_MIN:
            break
        ub = next_ub(seen, budget)
    n = smallest_n_cpu_moe(base, experts, budget)
    lines.append(f"card {vram_gib:g} GiB (margin {FIT_MARGIN_GIB:.2f}): experts of layers {n}..{len(experts) - 1} on the GPU = "
                 f"{sum(experts[n:]) / GIB:.3f} GiB, total {(base + sum(experts[n:])) / GIB:.3f} GiB -> -ub {ub} --n-cpu-moe {n}")
    if base > budget:
        lines.append(f"warning: the control does not fit the card even with every expert on the CPU at -ub {ub}")
    return ub, n, lines


def next_ub(seen: dict[int, int], budget: float) -> int:
    """The next -ub to probe after the smallest probed one did not fit: its half, or, with two
    probes, the largest halving that the line through them (buffers grow with -ub) puts under
    the budget, so that a start is not spent on each halving between."""
    ub = min(seen)
    nxt = max(UB_MIN, ub // 2)
    if len(seen) < 2:
        return nxt
    hi = max(u for u in seen if u != ub)
    slope = (seen[hi] - seen[ub]) / (hi - ub)
    while nxt > UB_MIN and seen[ub] - slope * (ub - nxt) > budget:
        nxt //= 2
    return max(UB_MIN, nxt)


def cached_probe(probe, path: Path | None, key: str):
    """probe(ub), remembered in the JSON file at path under key and ub: rows of one machine that
    start the same control probe it once."""
    def run(ub: int) -> int | None:
        memo = {}
        if path is not None and path.exists():
            try:
                memo = json.loads(path.read_text())
            except (OSError, ValueError):
                memo = {}
        k = f"{key} -ub {ub}"
        if k in memo:
            return memo[k]
        got = probe(ub)
        if path is not None and got is not None:
            memo[k] = got
            path.write_text(json.dumps(memo, indent=1))
        return got
    return run


def card_used_mib() -> int | None:
    """Memory in use on the first GPU in MiB, from nvidia-smi; None without one."""
    return card_mib("memory.used")


def probe_start(cmd: list[str], log: Path, port: int) -> int | None:
    """Bytes the server of cmd takes on the (otherwise idle) first GPU once ready and warmed up:
    the card's use with it running less the use before it started."""
    before = card_used_mib()
    if before is None:
        return None
    with open(log, "ab", buffering=0) as f:
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=f)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            after = card_used_mib()
        finally:
            stop(proc)
    return None if after is None else max(0, after - before) << 20


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def card_mib(field: str) -> int | None:
    """nvidia-smi's FIELD (memory.total, memory.used) of the first GPU in MiB; None without one."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return int(first[0]) if out.returncode == 0 and first and first[0].strip().isdigit() else None


def card_total_mib() -> int | None:
    """The first GPU's memory in MiB, from nvidia-smi; None without one."""
    return card_mib("memory.total")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 1800) -> None:
    try:
        wait_healthy(url, proc, timeout, poll=0.5)
    except NotReady as e:
        raise SystemExit(f"ab: server {e}")


def run_arm(label: str, cmd: list[str], args, port: int) -> Path:
    out = Path(args.out)
    log = out / f"{label}.log"
    print(f"== {label}: {' '.join(cmd)}", flush=True)
    with open(log, "wb", buffering=0) as f:
        # strata-server writes the host's time around its decode steps there; upstream ignores it
        env = os.environ | {"STRATA_STEP_TRACE": str(out / f"{label}.steps.jsonl")}
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=f, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            t0 = time.time()
            wait_ready(url, proc)
            print(f"   ready in {time.time() - t0:.1f} s", flush=True)
            result = out / f"{label}.json"
            prefill.main(["--model", Path(args.model).stem, "--url", url, "--engine-log", str(log), "--binary", cmd[0],
                          "--label", label, "--output", str(result)] + (["--quick"] if args.quick else []))
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                    (out / f"{label}.metrics.txt").write_bytes(r.read())
            except OSError as e:
                print(f"   no /metrics: {e}", flush=True)
        finally:
            stop(proc)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--control", help="upstream llama-server binary")
    ap.add_argument("--candidate", help="strata-server binary")
    ap.add_argument("--model", help="GGUF both arms serve")
    ap.add_argument("--out", help="directory for logs, JSONs and the chart")
    ap.add_argument("--vram-gib", type=float, help="emulate a card of this many GiB")
    ap.add_argument("--ctx", type=int, default=16384, help="context size of both arms (default 16384)")
    ap.add_argument("--quick", action="store_true", help="tools/bench/prefill --quick (CPU smoke test)")
    ap.add_argument("--plan", metavar="GGUF", help="print the --n-cpu-moe arithmetic for this model and exit")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--ceiling", action="store_true", help="also run the control all on the GPU first (the ceiling)")
    ap.add_argument("--control-args", default="", help="flags for the control and the ceiling only, one string "
                    "(e.g. the drafting the candidate's own flags imply)")
    ap.add_argument("--candidate-args", default="", help="flags for the candidate only (its expert tiers), one string; "
                    "with --vram-gib they replace --n-cpu-moe")
    ap.add_argument("--no-control-fit", action="store_true", help="with --vram-gib on a GPU, place the control by the "
                    "tensor arithmetic alone instead of measuring its start with every expert on the CPU")
    ap.add_argument("--load", metavar="ARGS", help="measure the arms with tools/bench/load and these flags, one string")
    ap.add_argument("--corpus", help="the text tools/bench/load slices prompts from (with --load)")
    ap.add_argument("--probe-cache", metavar="FILE", help="remember the control's probes in FILE (JSON) for later "
                    "rows on the same machine")
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    try:
        return run(ap, args, extra)
    except GGUFError as e:
        raise SystemExit(f"ab: {e}")


def run(ap: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int:
    if args.plan:
        if args.vram_gib is None:
            ap.error("--plan needs --vram-gib")
        for line in plan_n_cpu_moe(Path(args.plan), args.vram_gib, args.ctx, kv_type_bytes(extra))[1]:
            print(line)
        return 0
    missing = [f for f in ("control", "candidate", "model", "out") if getattr(args, f) is None]
    if missing:
        ap.error("a run needs " + ", ".join("--" + m for m in missing))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    common = ["-m", args.model, "-c", str(args.ctx), "-np", "1", "--metrics"] + extra
    control_extra: list[str] = []
    candidate_extra: list[str] = []
    if args.vram_gib is not None:
        n, lines = plan_n_cpu_moe(Path(args.model), args.vram_gib, args.ctx, kv_type_bytes(extra))
        control_extra = ["-ngl", "99", "--n-cpu-moe", str(n)]
        total = card_total_mib()
        if total is not None and not args.no_control_fit:
            # the arithmetic's headroom is no measure of compute buffers, which grow with -ub times the context
            typed = ubatch_of(extra + shlex.split(args.control_args))
            base = [args.control] + common + ["-ngl", "99", "--cpu-moe"] + shlex.split(args.control_args)
            probe_log = Path(args.out) / "control-probe.log"
            _, experts = sizes(Path(args.model), args.ctx)[1:]
            probe = cached_probe(lambda u: probe_start(base + ["-ub", str(u)], probe_log, args.port),
                                 args.probe_cache and Path(args.probe_cache), shlex.join(base))
            ub, n, fitted = fit_control(experts, args.vram_gib, typed, probe)
            lines = [lines[0]] + fitted
            if n >= 0:
                control_extra = ["-ngl", "99", "--n-cpu-moe", str(n)] + (["-ub", str(ub)] if ub != typed else [])
        print("\n".join(lines), flush=True)
        (Path(args.out) / "placement.txt").write_text("\n".join(lines) + "\n")
        candidate_extra = ["-ngl", "99"] if args.candidate_args else list(control_extra)
        if total is not None:
            candidate_extra += ["--vram-reserve-mib", str(max(0, total - int(args.vram_gib * 1024)))]
    candidate_extra += shlex.split(args.candidate_args)
    fitted_ub = control_extra[-2:] if control_extra[-2:-1] == ["-ub"] else []
    control_extra = control_extra[:len(control_extra) - len(fitted_ub)] + shlex.split(args.control_args) + fitted_ub
    ceiling_extra = ["-ngl", "99"] + shlex.split(args.control_args)
    if args.load is not None:
        if not args.corpus:
            ap.error("--load needs --corpus")
        arms = [("control", [args.control] + common + control_extra), ("candidate", [args.candidate] + common + candidate_extra)]
        if args.ceiling:
            arms.append(("ceiling", [args.control] + common + ceiling_extra))
        spec = [t for label, cmd in arms for t in ("---", label, *cmd)][1:]
        return load.main(["--corpus", args.corpus, *shlex.split(args.load), "--out", args.out, "--", *spec])
    ceiling = [run_arm("ceiling", [args.control] + common + ceiling_extra, args, args.port)] if args.ceiling else []
    runs = [run_arm("control", [args.control] + common + control_extra, args, args.port),
            run_arm("candidate", [args.candidate] + common + candidate_extra, args, args.port)] + ceiling
    chart = Path(args.out) / "prefill.png"
    table = prefill.compare([str(r) for r in runs], str(chart))
    (Path(args.out) / "compare.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
