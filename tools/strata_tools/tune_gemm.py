"""Tunes the GEMM table (STRATA_HIPBLASLT_TUNING) for a model on this machine's GPU: lists the
model's dense matmul shapes at the given prompt batch sizes, builds tools/gemm/tune.cpp against a
patched llama.cpp build, runs it (every candidate timed, checked against the default, the fastest
written when it beats the default), and keeps its log beside the table.

    tools/tune-gemm --model M.gguf --out TABLE --include DIR --libs DIR [--batches 512,2048,4096]
                    [--binary PATH] [-- tune.cpp options: --reps N --tol T --min-speedup S ...]
    tools/tune-gemm --report LOG    # a run's log as a per-shape table (markdown)

--include: ggml/include of the pin; --libs: the directory with libggml.so.0, libggml-base.so.0
and the backend modules (libggml-cuda.so built with patches/0007). docs/gemm-dispatch.md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from strata_tools import REPO
from strata_tools.gguf_header import gguf_tensors

# ggml type ids (ggml.h) to the names ggml_type_name gives.
TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 10: "q2_K", 11: "q3_K",
              12: "q4_K", 13: "q5_K", 14: "q6_K", 16: "iq2_xxs", 17: "iq2_xs", 18: "iq3_xxs", 19: "iq1_s",
              20: "iq4_nl", 21: "iq3_s", 22: "iq2_s", 23: "iq4_xs", 29: "iq1_m", 30: "bf16"}


def shapes(model: Path, batches: list[int]) -> list[tuple[str, int, int, int]]:
    """(type, m, n, k) of every dense matmul weight of the model (2-D `.weight` tensors other than
    the token embedding), for each batch size n; distinct, in file order."""
    _, tensors = gguf_tensors(model)
    out: list[tuple[str, int, int, int]] = []
    for name, dims, ttype in tensors:
        if len(dims) != 2 or not name.endswith(".weight") or name.startswith("token_embd") or "per_layer_token_embd" in name:
            continue
        if ttype not in TYPE_NAMES:
            continue
        k, m = dims
        for n in batches:
            s = (TYPE_NAMES[ttype], m, n, k)
            if s not in out:
                out.append(s)
    return out


TIMED = re.compile(r"(\S+) (\d+) (\d+) (\d+) (default|mmq|blaslt \d+): ([\d.]+) us, [\d.]+ TFLOP/s, rel err (\S+?)(?: |$)")
VERDICT = re.compile(r"(\S+) (\d+) (\d+) (\d+): (?:(mmq|blaslt \d+), ([\d.]+)x the default|the default stays)")


def report(log: str) -> str:
    """A tuner log as one markdown row per shape: the default's time, MMQ's, the fastest BLASLt
    candidate's within the tolerance, and what the table took (with the measured speedup)."""
    shapes: dict[tuple[str, ...], dict] = {}
    for line in log.splitlines():
        if m := TIMED.match(line):
            s = shapes.setdefault(m.group(1, 2, 3, 4), {})
            name, us, err = m.group(5), float(m.group(6)), float(m.group(7))
            if name.startswith("blaslt"):
                if line.endswith("(rejected)"):
                    continue
                if "blaslt" not in s or us < s["blaslt"][1]:
                    s["blaslt"] = (name, us, err)
            else:
                s[name] = (name, us, err)
        elif m := VERDICT.match(line):
            shapes.setdefault(m.group(1, 2, 3, 4), {})["verdict"] = f"{m.group(5)}, {m.group(6)}x" if m.group(5) else "default"
    out = ["| type | m | n | k | default us | mmq us | fastest BLASLt us (rel err) | table |", "|---|---|---|---|---|---|---|---|"]
    for (t, m, n, k), s in shapes.items():
        cell = lambda key: f"{s[key][1]:.1f}" if key in s else "-"  # noqa: E731
        bl = f"{s['blaslt'][1]:.1f} ({s['blaslt'][0]}, {s['blaslt'][2]:.2e})" if "blaslt" in s else "-"
        out.append(f"| {t} | {m} | {n} | {k} | {cell('default')} | {cell('mmq')} | {bl} | {s.get('verdict', 'not finished')} |")
    return "\n".join(out) + "\n"


def build(include: Path, libs: Path, out: Path) -> None:
    cmd = ["g++", "-O2", "-std=c++17", str(REPO / "tools/gemm/tune.cpp"), f"-I{include}", f"-L{libs}", "-l:libggml.so.0",
           "-l:libggml-base.so.0", f"-Wl,-rpath,{libs.resolve()}", "-o", str(out)]
    subprocess.run(cmd, check=True)


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["--report"] and len(argv) == 2:
        sys.stdout.write(report(Path(argv[1]).read_text()))
        return 0
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="the table to write")
    ap.add_argument("--batches", default="512,2048,4096", help="prompt batch sizes (columns) to tune, comma-separated")
    ap.add_argument("--include", help="ggml/include of the pinned llama.cpp")
    ap.add_argument("--libs", help="directory of libggml.so.0, libggml-base.so.0 and the backend modules")
    ap.add_argument("--binary", help="a tune-gemm already built (default: build it next to --out)")
    args = ap.parse_args(own)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    list_file = out.with_suffix(".shapes")
    rows = shapes(Path(args.model), [int(b) for b in args.batches.split(",") if b])
    if not rows:
        raise SystemExit(f"tune-gemm: {args.model} has no dense matmul weights of a known type")
    list_file.write_text("".join(f"{t} {m} {n} {k}\n" for t, m, n, k in rows))
    binary = Path(args.binary) if args.binary else out.with_suffix(".bin")
    if not args.binary:
        if not (args.include and args.libs):
            ap.error("building the tuner needs --include and --libs (or give --binary)")
        build(Path(args.include), Path(args.libs), binary)
    log = out.with_suffix(".log")
    print(f"tune-gemm: {len(rows)} shapes of {args.model} -> {out} (log {log})", flush=True)
    with open(log, "w") as f:
        # ggml looks for its backend modules beside the executable and in the working directory
        rc = subprocess.run([str(binary.resolve()), str(list_file.resolve()), str(out.resolve()), *extra], stdout=f,
                            stderr=subprocess.STDOUT, cwd=args.libs).returncode
    print(log.read_text().splitlines()[-1] if log.stat().st_size else "(no output)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
