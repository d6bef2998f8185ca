"""Tunes the GEMM table (STRATA_HIPBLASLT_TUNING) for a model on this machine's GPU: lists the
model's dense matmul shapes at the given prompt batch sizes, builds tools/gemm/tune.cpp against a
patched llama.cpp build, runs it (every candidate timed, checked against the default, the fastest
written when it beats the default), and keeps its log beside the table.

    tools/tune-gemm --model M.gguf --out TABLE --include DIR --libs DIR [--batches 512,2048,4096]
                    [--binary PATH] [-- tune.cpp options: --reps N --tol T --min-speedup S ...]
    tools/tune-gemm --report LOG    # a run's log as a per-shape table (markdown)

--include: ggml/include of the pin; --libs: the directory with libggml.so.0, libggml-base.so.0
and the backend modules (libggml-cuda.so built with patches/0006). docs/gemm-dispatch.md.

The tuner writes the table under a temporary name beside --out (whose folder must exist),
renamed to --out when it succeeds: a failed run leaves --out as it was. Every failure is one
line on stderr and a non-zero exit; the tuner's own output is in the log.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from strata_tools import REPO
from strata_tools.gguf_header import GGUFError, gguf_tensors

TITLE, USAGE, DESCRIPTION = __doc__.split("\n\n", 2)
TUNER_SOURCE = REPO / "tools/gemm/tune.cpp"
LIBS = ("libggml.so.0", "libggml-base.so.0")


class Failure(SystemExit):
    """One line on stderr, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"tune-gemm: {message}")

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
    """Compiles the tuner; g++'s messages go to OUT.build.log when it fails."""
    if shutil.which("g++") is None:
        raise Failure("building the tuner needs g++ (or give --binary)")
    if not (include / "ggml.h").is_file():
        raise Failure(f"no ggml.h in --include {include}")
    missing = [lib for lib in LIBS if not (libs / lib).exists()]
    if missing:
        raise Failure(f"no {', '.join(missing)} in --libs {libs}")
    cmd = ["g++", "-O2", "-std=c++17", str(TUNER_SOURCE), f"-I{include}", f"-L{libs}", "-l:libggml.so.0",
           "-l:libggml-base.so.0", f"-Wl,-rpath,{libs.resolve()}", "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        log = out.with_suffix(".build.log")
        log.write_text(res.stdout + res.stderr)
        first = next((ln for ln in res.stderr.splitlines() if "error" in ln), "")
        raise Failure(f"building {TUNER_SOURCE.relative_to(REPO)} failed (g++ exit {res.returncode})"
                      f"{': ' + first.strip() if first else ''}; see {log}")


def tune(args, extra: list[str]) -> int:
    out = Path(args.out).resolve()
    if not out.parent.is_dir():
        raise Failure(f"the folder of --out does not exist: {out.parent}")
    if out.is_dir():
        raise Failure(f"--out is a folder: {out}")
    if not Path(args.model).is_file():
        raise Failure(f"no such model file: {args.model}")
    if args.binary and not (Path(args.binary).is_file() and os.access(args.binary, os.X_OK)):
        raise Failure(f"no tuner at --binary {args.binary}")
    if not args.binary and not (args.include and args.libs):
        raise Failure("building the tuner needs --include and --libs (or give --binary)")
    if args.libs and not Path(args.libs).is_dir():
        raise Failure(f"--libs is not a folder: {args.libs}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        raise Failure(f"--batches wants sizes separated by commas, not {args.batches}")
    try:
        rows = shapes(Path(args.model), batches)
    except GGUFError as e:
        raise Failure(str(e))
    if not rows:
        raise Failure(f"{args.model} has no dense matmul weights of a known type")
    list_file = out.with_suffix(".shapes")
    list_file.write_text("".join(f"{t} {m} {n} {k}\n" for t, m, n, k in rows))
    binary = Path(args.binary) if args.binary else out.with_suffix(".bin")
    if not args.binary:
        build(Path(args.include), Path(args.libs), binary)
    log = out.with_suffix(".log")
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    print(f"tune-gemm: {len(rows)} shapes of {args.model} -> {out} (log {log})", flush=True)
    try:
        with open(log, "w") as f:
            # ggml looks for its backend modules beside the executable and in the working directory
            rc = subprocess.run([str(binary.resolve()), str(list_file.resolve()), str(partial), *extra], stdout=f,
                                stderr=subprocess.STDOUT, cwd=args.libs).returncode
        last = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
        if rc != 0:
            raise Failure(f"the tuner failed (exit {rc}): {last}; see {log}")
        if not partial.is_file():
            raise Failure(f"the tuner wrote no table: {last}; see {log}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    print(last)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--report"] and len(argv) == 2:
        try:
            text = Path(argv[1]).read_text(errors="replace")
        except OSError as e:
            raise Failure(f"cannot read {argv[1]}: {e.strerror or e}")
        sys.stdout.write(report(text))
        return 0
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="tune-gemm", usage="\n       ".join(ln.strip() for ln in USAGE.splitlines()),
                                 description=TITLE + "\n\n" + DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the model (GGUF) whose dense matmuls are tuned")
    ap.add_argument("--out", required=True, help="the table to write (its folder must exist)")
    ap.add_argument("--batches", default="512,2048,4096", help="prompt batch sizes (columns) to tune, comma-separated")
    ap.add_argument("--include", help="ggml/include of the pinned llama.cpp")
    ap.add_argument("--libs", help="directory of libggml.so.0, libggml-base.so.0 and the backend modules")
    ap.add_argument("--binary", help="a tune-gemm already built (default: build it next to --out)")
    args = ap.parse_args(own)
    try:
        return tune(args, extra)
    except OSError as e:
        raise Failure(f"{e.filename}: {e.strerror or e}" if e.filename else str(e))
    except KeyboardInterrupt:
        raise Failure("interrupted; --out is left as it was")


if __name__ == "__main__":
    sys.exit(main())
