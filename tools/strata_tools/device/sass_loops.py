"""The loops of one kernel's SASS (cuobjdump -sass -fun NAME OBJ), each with its length and its
loads by kind, and the kernel's resources (cuobjdump -res-usage: registers, stack, shared and
constant bytes), for several object files side by side: whether a patched kernel's loop is the
pristine one's (same length, same LDG.E.CONSTANT / LDG.E / generic LD mix).

    tools/device/sass_loops.py KERNEL pristine.o patched.o ...

Needs cuobjdump and nvdisasm on PATH (NVIDIA's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
wheels carry them).
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys

INS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRA = re.compile(r"\bBRA\s+(?:`\()?(?:!?P\d+,\s*)?0x([0-9a-f]+)")


def parse(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(INS.match, sass.splitlines()) if m]


def instructions(obj: str, kernel: str) -> list[tuple[int, str]]:
    return parse(subprocess.run(["cuobjdump", "-sass", "-fun", kernel, obj], capture_output=True, text=True, check=True).stdout)


def resources(obj: str, kernel: str) -> str:
    out = subprocess.run(["cuobjdump", "-res-usage", obj], capture_output=True, text=True, check=True).stdout.splitlines()
    return next((out[i + 1].strip() for i, line in enumerate(out[:-1]) if line.strip() == f"Function {kernel}:"), "?")


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int, dict[str, int]]]:
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = BRA.search(text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            start = at[int(m.group(1), 16)]
            loads = collections.Counter()
            for _, t in ins[start:i + 1]:
                op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
                if op.startswith(("LDG", "LD.", "LDL")):
                    loads[op] += 1
            out.append((ins[start][0], i + 1 - start, dict(sorted(loads.items()))))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    kernel, objs = argv[0], argv[1:]
    print(f"kernel {kernel}")
    for obj in objs:
        ins = instructions(obj, kernel)
        print(f"{obj}: {len(ins)} instructions, {resources(obj, kernel)}")
        for start, n, loads in loops(ins):
            print(f"  loop at {start:#06x}: {n:4d} instructions, loads {loads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
